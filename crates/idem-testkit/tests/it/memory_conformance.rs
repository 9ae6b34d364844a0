//! The conformance suite against `MemoryStore`, the reference implementation: once on a manual
//! clock with parallel tasks, once on paused tokio time.

use idem_core::MemoryStore;
use idem_core::time::{ManualClock, TokioClock};
use idem_testkit::Harness;

mod manual_clock {
    use super::*;

    idem_testkit::dedup_store_conformance!(|| async {
        let clock = ManualClock::new();
        Harness::manual(MemoryStore::with_clock(clock.clone()), clock)
    });
}

mod paused_tokio_time {
    use super::*;

    idem_testkit::dedup_store_conformance!(paused: || async {
        let clock = TokioClock::new();
        Harness::new(MemoryStore::with_clock(clock.clone()), clock, std::time::Duration::from_secs(10))
    });
}

/// The version guard's contract on the reference store.
#[tokio::test]
async fn version_guard_rejects_stale_and_equal_versions() {
    use idem_core::{Advance, DedupKey, VersionGuard};
    let store = MemoryStore::new();
    let e = DedupKey::new("customer-state", "c-1").unwrap();
    assert_eq!(store.advance(&e, 3).await.unwrap(), Advance::Applied);
    assert_eq!(store.advance(&e, 2).await.unwrap(), Advance::Stale { current: 3 });
    assert_eq!(store.advance(&e, 3).await.unwrap(), Advance::Stale { current: 3 });
    assert_eq!(store.advance(&e, 4).await.unwrap(), Advance::Applied);
    let other = DedupKey::new("customer-state", "c-2").unwrap();
    assert_eq!(store.advance(&other, 1).await.unwrap(), Advance::Applied);
}

mod batched_group_commit {
    use super::*;
    use idem_core::{BatchConfig, Batched};

    idem_testkit::dedup_store_conformance!(|| async {
        let clock = ManualClock::new();
        let store = Batched::new(MemoryStore::with_clock(clock.clone()), BatchConfig::default());
        Harness::manual(store, clock)
    });
}
