//! The outbox contract against the reference implementation.

idem_testkit::outbox_conformance!(|| async {
    let clock = idem_core::time::ManualClock::new();
    Some(idem_testkit::Harness::manual(
        idem_core::outbox::MemoryOutbox::with_clock(clock.clone()),
        clock,
    ))
});
