//! idem-cli's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod chaos;
mod demo;
mod dlq;
mod dlq_brokers;
mod galera;
mod ops;
mod relay;
mod secrets;
mod serve;
mod tls;
