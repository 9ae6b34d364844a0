//! Hostile input: property tests over the key extractors, dedup keys and the canonical-JSON
//! fingerprint. Each property runs [`CASES`] generated cases (fixed, so the run time is
//! predictable; the table in `docs/RELIABILITY.md` lists them). A failing case is printed
//! shrunk, with the seed to replay it.

// Generators and oracles are not themselves tests, so clippy's test exemption does not reach
// them; a failed `?` or unwrap there is a test failure, which is what we want.
#![allow(clippy::unwrap_used)]

mod extract;
mod fingerprint;
mod json;
mod key;

use proptest::test_runner::Config;

/// Cases per property.
pub(crate) const CASES: u32 = 512;

/// [`CASES`] cases, and no `proptest-regressions/` files: a failure found here becomes a
/// named regression test instead.
pub(crate) fn config() -> Config {
    Config { cases: CASES, failure_persistence: None, ..Config::default() }
}
