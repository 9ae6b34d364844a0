//! idem-amqp's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod common;
mod connection_loss;
mod dead_letter_loop;
mod inbox;
mod modes;
mod publish;
mod tls;
mod verbs;
