//! idem-sqlx's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod common;
mod galera;
mod inbox_conformance;
mod linearizability;
mod migrations;
mod mysql_conformance;
mod mysql_store;
mod outbox;
mod pg_conformance;
mod pg_store;
mod sqlite_conformance;
mod sqlite_store;
mod startup_check;
mod tls;
