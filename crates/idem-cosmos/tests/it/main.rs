//! idem-cosmos's integration tests, one binary: a module per subject (one link instead of
//! one per file; `cargo test -p CRATE --test it MODULE::` runs one subject).

mod azure_account;
mod common;
mod emulator_conformance;
mod emulator_inbox;
mod emulator_linearizability;
mod emulator_marker;
mod emulator_throttling;
mod wire_cosmosdb_server;
