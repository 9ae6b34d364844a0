//! The whole store contract against the SDK's in-memory emulator (always runs).

use crate::common;

use idem_core::time::ManualClock;
use idem_cosmos::CosmosStore;
use idem_testkit::Harness;

idem_testkit::dedup_store_conformance!(|| async {
    let emu = common::Emulator::start().await;
    let container = emu.container("/pk").await;
    let clock = ManualClock::new();
    // The emulator lives as long as the client the store holds; nothing outlives the case.
    Harness::manual(CosmosStore::new(container).with_clock(clock.clone()), clock)
        .with_guard(emu.store)
});
