//! idem-nats's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod common;
mod dead_letter_loop;
mod duplicate_window;
mod inbox;
mod modes;
mod publish;
mod tls;
mod verbs;
