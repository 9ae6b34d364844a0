//! The Redis Streams source for the shared consumer: a consumer group in, outcomes out as
//! `XACK`, dead-letter entries, or entries left pending for `XAUTOCLAIM`.
//!
//! [`StreamConfig`] holds what is specific to Redis and opens a [`StreamSource`]; the
//! [`Consumer`](idem_core::Consumer) does the rest (claims or the inbox transaction, handlers,
//! the order of verbs, shutdown). `StreamConsumer<B>` names that consumer. The outcome → verb
//! table, the retry delay, the redelivery window and the failure modes are in the
//! [crate docs](crate); here is how they come about.
//!
//! - **Fetch**: first the entries that sat in the group's pending list for longer than
//!   [`reclaim_idle`](StreamConfig::reclaim_idle) (`XAUTOCLAIM`, at most every quarter of it
//!   unless the last scan stopped mid-way; each one's delivery count from `XPENDING`), then new
//!   entries (`XREADGROUP … >`, blocking for the consumer's idle wait only when nothing was taken
//!   over), on a reader connection per fetch in flight.
//! - **Dead letters**: one pipeline of `XADD`s per batch, answered per entry.
//! - **Settle**: one `XACK` for the batch's acknowledged and dead-lettered entries; retries and
//!   releases are left pending, which is all Redis offers: `XAUTOCLAIM` is the redelivery, and
//!   `reclaim_idle` the retry delay.
//! - **Delivery limit**: [`give_up`](idem_core::consumer::Source::give_up) answers once an entry's
//!   delivery count reached [`max_deliveries`](StreamConfig::max_deliveries), so the consumer
//!   dead-letters the retry that would have been one delivery too many.
//! - **Dead letters read back**: [`StreamDeadLetters`] lists, replays and removes them
//!   (`XRANGE`, `XADD` to the consumed stream, `XDEL`).

mod config;
mod delivery;
mod dlq;
mod source;

pub use config::StreamConfig;
pub use delivery::Delivery;
pub use dlq::StreamDeadLetters;
pub use source::{GROUP_FIELD, StreamSource};
