//! NATS JetStream consumer adapter for **idem**.
//!
//! A pull consumer with explicit acks, driven by idem's shared
//! [`Consumer`](idem_core::Consumer): every delivery ends in exactly one JetStream verb, sent only
//! after its effect is committed or its dead-letter copy is stored.
//!
//! | idem outcome | JetStream |
//! | --- | --- |
//! | processed, duplicate | `Ack` |
//! | in progress elsewhere | `Nak` delayed by the other lease's remaining time |
//! | transient failure | (two-phase: the claim released) `Nak` after [`JetStreamConfig::retry_delay`] |
//! | conflict, permanent failure, missing key, a retry at the last `max_deliver` | publish to the dead-letter subject (publish ack awaited) with the `idem-*` headers, then `Term` |
//! | fetched while the consumer shuts down | `Nak` at once |
//!
//! A retry due at the consumer's last allowed delivery (`max_deliver`) is dead-lettered instead,
//! because JetStream would stop delivering it without a trace; for a key in progress elsewhere
//! that copy is redundant but never a loss.
//!
//! While handlers run, `Progress` (`+WPI`) restarts `ack_wait` on the lease heartbeat's beat
//! (or [`JetStreamConfig::progress`]). The key comes from `Nats-Msg-Id` by default ([`Delivery`]
//! implements [`Envelope`](idem_core::extract::Envelope), so any `KeyExtractor` works).
//!
//! Both modes use the same builder calls:
//!
//! ```no_run
//! use std::time::Duration;
//! use idem::nats::async_nats::{self, jetstream};
//! use idem::engine::HandlerError;
//! use idem::nats::{JetStreamConfig, JetStreamConsumer};
//! use idem::{PostgresStore, sqlx};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let js = jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
//! let pull = js.get_stream("ORDERS").await?.get_consumer("order-writer").await?;
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! store.migrate().await?; // once: creates the schema and table (the consumer checks them)
//! // The stream captures `orders.>`: dead letters go outside it, to a stream of their own.
//! let consumer = JetStreamConsumer::builder(JetStreamConfig::new(js, pull, "dlq.orders"))
//!     .inbox(store.inbox(Duration::from_secs(7 * 86_400))) // or .store(store): two-phase
//!     .scope("order-writer")
//!     .build()
//!     .await?;
//! let report = consumer
//!     .run(|mut tx, msg| async move {
//!         sqlx::query("INSERT INTO orders (body) VALUES ($1)")
//!             .bind(msg.payload_bytes().to_vec())
//!             .execute(&mut *tx) // commits with the dedup marker, then the ack is sent
//!             .await
//!             .map_err(HandlerError::Transient)?;
//!         Ok(())
//!     }, async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! println!("{report}");
//! # Ok(()) }
//! ```
//!
//! # Redelivery window
//! JetStream redelivers an unacked message after `ack_wait`, at most `max_deliver` times (each
//! `Nak` delay or `backoff` step counts instead of `ack_wait` for that delivery), and a producer's
//! duplicate may wait in the stream up to `max_age`. Records must outlive
//! `max_deliver × max(ack_wait, backoff, nak delays) + max_age + dead-letter allowance`; the
//! source checks it with [`RedeliveryWindow`](idem_core::RedeliveryWindow) when it opens, and
//! refuses a consumer without `max_deliver` and a stream without `max_age` (unless
//! [`JetStreamConfig::assume_max_age`] states the longest a message may wait there).
//!
//! # Dead letters
//! Dead letters go to a subject that a stream captures and that this consumer does not read:
//! with the common layout of a stream on `orders.>`, `orders.dlq` would be captured by the
//! consumed stream and fetched again as a new message (the source refuses it when it opens,
//! [`Error::DeadLetterLoop`]); `dlq.orders`, on a stream of its own, is not. See
//! [`JetStreamConfig`] for what the check covers. [`JetStreamDeadLetters`] reads them back,
//! replays and removes them (`idem dlq`, the console).
//!
//! # Producer duplicates and JetStream's own window
//! JetStream drops a publish whose `Nats-Msg-Id` it saw within the stream's
//! `duplicate_window` (2 minutes by default) before any consumer sees it: the publish ack says
//! `duplicate` (with the stored copy's sequence) and nothing is stored. The two layers combine
//! like this:
//!
//! | a second copy of a message… | JetStream | idem |
//! | --- | --- | --- |
//! | re-published inside the window | drops it; one message is stored | never sees it |
//! | re-published after the window | stores it as a new message | a duplicate (or a conflict, if the body changed) |
//! | redelivered (lost ack, crash, `ack_wait`, `Nak`) | delivers it again | a duplicate |
//!
//! So idem only sees the duplicates of redelivery and of re-publishes after the window. The
//! window compares ids only: a re-publish inside it with another body under the same id is
//! dropped too, so idem cannot report it as a conflict. In tests this shows as fewer
//! deliveries than publishes: publishing one id twice in a row delivers one message, and the
//! report counts one processed and no duplicate. To make idem see a producer's retry, publish
//! it after the window (this crate's tests use a 100 ms window and wait three windows, since
//! the server forgets ids on a timer).
//!
//! # Publishing (outbox relay)
//! [`JetStreamPublisher`] is the JetStream [`Publisher`](idem_core::outbox::Publisher) of an
//! outbox [`Relay`](idem_core::outbox::Relay): it sends a batch at once, each message with its
//! headers and its outbox id as `Nats-Msg-Id` — what this crate's consumer keys on by default,
//! so a message the relay publishes twice is a duplicate downstream (or, within the stream's
//! duplicate window, dropped by JetStream itself: the ack says `duplicate`, which counts as
//! published) — then awaits every publish ack. A subject no stream captures is a (retryable)
//! failure, never a silent success.
//!
//! # Server compatibility
//! Built and tested against NATS 2.9.10; see [`compat`] for what is switched off.

pub mod compat;
mod config;
mod delivery;
mod dlq;
mod error;
mod publish;
mod source;
mod subject;

/// The client this adapter is built on, re-exported so callers use the same version.
pub use async_nats;
pub use compat::redelivery_window;
pub use config::JetStreamConfig;
pub use delivery::{Delivery, MSG_ID_HEADER};
pub use dlq::JetStreamDeadLetters;
pub use error::Error;
pub use publish::{JetStreamPublisher, Refused};
pub use source::JetStreamSource;

/// A JetStream pull consumer made idempotent: the shared consumer over a [`JetStreamSource`], in
/// two-phase mode (`B` a store) or inbox mode (`B` an [`Inbox`](idem_core::Inbox) over a SQL inbox:
/// `Inbox<PostgresInbox>`).
pub type JetStreamConsumer<B> = idem_core::Consumer<JetStreamSource, B>;
