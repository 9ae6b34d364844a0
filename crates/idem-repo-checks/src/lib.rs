//! A test-only crate, never published: checks of the repository as a whole.
//!
//! - `tests/it/preserve_order.rs`: idem-core's canonical JSON sorts object keys itself, so
//!   fingerprints do not change when some crate in the build turns on serde_json's
//!   `preserve_order` (its `Map` then keeps insertion order instead of sorting). Cargo unifies
//!   features per build, so depending on `serde_json/preserve_order` here builds idem-core the
//!   way such a user's build does (in a `--workspace` build, every crate gets it).
//! - `tests/it/telemetry_docs.rs`: `docs/OPERATIONS.md` and the Grafana dashboard name exactly the
//!   metrics the engine emits. It reads files outside every published crate, so it lives here.
