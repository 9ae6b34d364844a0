//! idem-kafka's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod common;
mod dead_letter_loop;
mod event_hubs;
mod modes;
mod offset_inbox;
mod pg_inbox;
mod publish;
mod retention;
mod tls;
mod two_phase;
