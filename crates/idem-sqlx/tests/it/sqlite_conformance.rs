//! The conformance suite against `SqliteStore`, on a fresh database file per case.

use idem_core::time::ManualClock;
use idem_sqlx::SqliteStore;
use idem_testkit::Harness;

idem_testkit::dedup_store_conformance!(|| async {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new();
    let store = SqliteStore::open(dir.path().join("conformance.sqlite"))
        .await
        .expect("open sqlite store")
        .with_clock(clock.clone());
    Harness::manual(store, clock).with_guard(dir)
});
