//! The conformance suite against `MemoryStore`, the reference implementation.

use idem_core::MemoryStore;
use idem_core::time::ManualClock;
use idem_testkit::Harness;

idem_testkit::dedup_store_conformance!(|| async {
    let clock = ManualClock::new();
    Harness::manual(MemoryStore::with_clock(clock.clone()), clock)
});
