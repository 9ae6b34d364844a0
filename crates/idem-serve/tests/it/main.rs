//! idem-serve's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod access;
mod common;
mod console;
mod grpc;
mod grpc_codegen;
mod limits;
mod push;
mod readiness;
mod remote_conformance;
