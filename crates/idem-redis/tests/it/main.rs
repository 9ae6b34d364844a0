//! idem-redis's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod common;
mod dead_letter_loop;
mod debug_secrets;
mod failover;
mod linearizability;
mod modes;
mod publish;
mod redis_conformance;
mod redis_startup;
mod redis_streams;
mod tls;
