//! The outboxes on the real databases, in one test binary: the store contract
//! (`outbox_conformance!`), handlers enqueueing with their writes, PostgreSQL's wake-up.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

mod conformance;
mod handler;
mod wake;
mod wal;
