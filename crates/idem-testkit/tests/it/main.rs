//! idem-testkit's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod batched;
mod crash_loop;
mod engine;
mod linearizability;
mod memory_conformance;
mod memory_outbox_conformance;
mod protocol_model;
mod store_timeout;
