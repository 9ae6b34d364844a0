//! idem-http's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod common;
mod http;
mod response;
