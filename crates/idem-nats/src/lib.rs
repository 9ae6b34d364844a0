//! NATS JetStream consumer adapter for **idem**.
//!
//! A pull consumer with explicit acks whose every delivery ends in exactly one JetStream verb,
//! sent only after the effect is committed or dead-lettered:
//!
//! | idem outcome | JetStream |
//! | --- | --- |
//! | processed, duplicate | `Ack` |
//! | in progress elsewhere | `Nak` delayed by the other lease's remaining time |
//! | transient failure | release the claim, `Nak` after [`Settings::retry_delay`] |
//! | conflict, permanent failure, retry at the last `max_deliver` | publish to the dead-letter subject (publish ack awaited) with [`headers::REASON`], then `Term` |
//!
//! A retry due at the consumer's last allowed delivery (`max_deliver`) is dead-lettered instead
//! (`Idem-Outcome: gave_up`), because JetStream would stop delivering it without a trace; for a
//! key in progress elsewhere that copy is redundant but never a loss.
//!
//! While handlers run, `Progress` (`+WPI`) restarts `ack_wait` on the same beat as the lease
//! heartbeat. The key comes from `Nats-Msg-Id` by default ([`Delivery`] implements
//! [`Envelope`](idem_core::extract::Envelope), so any `KeyExtractor` works). Messages fetched
//! together are claimed together.
//!
//! Two modes:
//! - [`JetStreamConsumer`]: two-phase, over any [`DedupStore`](idem_core::DedupStore), for
//!   effects outside the database (pass `ctx.downstream_key()` to the callee).
//! - [`InboxConsumer`] (feature `sqlite`): transactional inbox; the marker and the handler's
//!   writes commit in one SQLite transaction per batch, then the batch is acked.
//! - [`PgInboxConsumer`] (feature `postgres`): the same over the PostgreSQL inbox
//!   ([`PostgresInbox`](idem_sqlx::PostgresInbox)), one transaction per batch.
//!
//! # Redelivery window
//! JetStream redelivers an unacked message after `ack_wait`, at most `max_deliver` times (each
//! `Nak` delay or `backoff` step counts instead of `ack_wait` for that delivery), and a producer's
//! duplicate may wait in the stream up to `max_age`. Records must outlive
//! `max_deliver × max(ack_wait, backoff, nak delays) + max_age + dead-letter allowance`; both
//! consumers check it with [`RetentionWindow`](idem_core::RetentionWindow) at startup, and refuse a
//! consumer without `max_deliver`.
//!
//! # Server compatibility
//! Built and tested against NATS 2.9.10; see [`compat`] for what is switched off.

pub mod compat;
mod consumer;
mod delivery;
mod error;
#[cfg(feature = "sqlite")]
mod inbox;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod inbox_common;
#[cfg(feature = "postgres")]
mod pg_inbox;
mod report;
mod settings;
mod source;

/// The client this adapter is built on, re-exported so callers use the same version.
pub use async_nats;
pub use compat::redelivery_window;
pub use consumer::{JetStreamConsumer, Verdicts};
pub use delivery::{Delivery, MSG_ID_HEADER};
pub use error::Error;
#[cfg(feature = "sqlite")]
pub use inbox::InboxConsumer;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub use inbox_common::InboxWrites;
#[cfg(feature = "postgres")]
pub use pg_inbox::PgInboxConsumer;
pub use report::Report;
pub use settings::Settings;
pub use source::headers;
