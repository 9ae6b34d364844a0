//! A test-only crate: `tests/preserve_order.rs` checks that idem-core's canonical JSON sorts
//! object keys itself, so fingerprints do not change when some crate in the build turns on
//! serde_json's `preserve_order` (its `Map` then keeps insertion order instead of sorting).
//!
//! Its own crate because Cargo features are unified per build: depending on
//! `serde_json/preserve_order` here is the only way to build idem-core the way such a user's
//! build does, without turning the feature on for idem-core's own tests.
