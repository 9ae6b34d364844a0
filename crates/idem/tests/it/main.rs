//! idem's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod clock_skew;
mod outbox_chain;
mod partitions;
