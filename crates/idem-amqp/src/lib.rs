//! RabbitMQ for **idem**, on [`lapin`]: a queue as a source for the shared consumer
//! ([`AmqpConsumer`]).
//!
//! [`AmqpConfig`] names the queue and what is RabbitMQ's own (prefetch, delay queue,
//! dead-letter exchange, redelivery window); the [`Consumer`](idem_core::Consumer) does the rest —
//! batches, one claim or one transaction per batch, handlers, the order of the verbs — in
//! two-phase mode over any store or in inbox mode over a SQL inbox. Manual acks only, and the
//! ack is always the last step: after the effect is committed (or was already), after a
//! dead-letter or delay copy is confirmed.
//!
//! | idem outcome | RabbitMQ |
//! | --- | --- |
//! | processed, duplicate | `basic.ack` |
//! | in progress elsewhere | a copy to the delay queue with a per-message TTL (the other lease's remaining time, clamped to [`AmqpConfig::retry_delay`]), confirmed, then `basic.ack`; it dead-letters back to the work queue when it expires |
//! | transient failure | `basic.nack(requeue)` |
//! | conflict, permanent failure, missing key | a copy to the dead-letter exchange with the `idem-*` headers (reason, outcome, scope, `idem-source` = the queue), confirmed, then `basic.ack` |
//! | fetched while the consumer shuts down | `basic.nack(requeue)`, untouched |
//!
//! ```no_run
//! use std::time::Duration;
//! use idem::amqp::{AmqpConfig, AmqpConsumer, lapin};
//! use idem::engine::HandlerError;
//! use idem::{PostgresStore, sqlx};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! store.migrate().await?; // once: creates the table (a consumer's build checks it)
//! let conn = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
//! let consumer = AmqpConsumer::builder(AmqpConfig::new(&conn, "orders"))
//!     .inbox(store.inbox(Duration::from_secs(7 * 86_400))) // or .store(store): two-phase
//!     .scope("order-writer")
//!     .build()
//!     .await?;
//! consumer
//!     .run(|mut tx, msg| async move {
//!         sqlx::query("INSERT INTO orders (body) VALUES ($1)")
//!             .bind(msg.payload().to_vec())
//!             .execute(&mut *tx) // commits with the dedup marker, then basic.ack
//!             .await
//!             .map_err(HandlerError::Transient)?;
//!         Ok(())
//!     }, async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # Publishing (outbox relay)
//! [`AmqpPublisher`] is the RabbitMQ [`Publisher`](idem_core::outbox::Publisher) of an outbox
//! [`Relay`](idem_core::outbox::Relay): a batch is published at once on a channel with publisher
//! confirms, `mandatory` and persistent, each message's outbox id as its `message_id` property —
//! what this crate's consumer keys on by default, so a message the relay publishes twice is a
//! duplicate downstream. A message counts as published once the broker acked it and did not
//! return it; unroutable, nacked and unconfirmed messages are retried by the relay.
//!
//! # Redelivery window
//! RabbitMQ redelivers an unacked message when its channel closes and after `consumer_timeout`
//! (30 min by default); quorum queues stop after `x-delivery-limit` deliveries. Records must
//! outlive that: give the config a [`RabbitWindow`] and the consumer refuses a shorter
//! retention when it is built. RabbitMQ has no per-delivery "still working" signal: a handler
//! longer than `consumer_timeout` gets its channel closed and its message redelivered, so keep
//! handlers shorter (the engine's `heartbeat` extends only the idem lease, which the
//! redelivery then finds in progress and sends round the delay queue until the first attempt
//! finishes).
//!
//! # Failure modes
//! - A dead-letter or delay copy that is not confirmed (nacked, unroutable, channel gone) is
//!   never followed by an ack: the original is requeued instead.
//! - A confirmed dead-letter copy followed by a failed ack is redelivered and dead-lettered
//!   again: the dead-letter queue is at least once.
//! - No broker verb waits forever: a fetch, an ack, nack or copy that has not finished within
//!   the consumer's [`broker_timeout`](idem_core::consumer::Builder::broker_timeout) (30 s) ends
//!   the run with [`BrokerTimeout`](idem_core::consumer::Error::BrokerTimeout) (lapin was seen to
//!   leave an ack pending forever after its connection failed), and a fetch that finds the
//!   consuming channel disconnected ends it at once ([`Error::ChannelClosed`]).
//! - Any broker error ends the run with an error; reconnect and build a new consumer. Unacked
//!   messages are redelivered by the broker; the store turns them into duplicates.

mod config;
mod delivery;
mod dlq;
mod error;
mod publish;
mod source;
pub mod topology;
mod window;

pub use config::AmqpConfig;
pub use delivery::Delivery;
pub use dlq::AmqpDeadLetters;
pub use error::Error;
pub use publish::{AmqpPublisher, Refused};
pub use source::AmqpSource;
pub use topology::Topology;
pub use window::{DEFAULT_CONSUMER_TIMEOUT, RabbitWindow};

/// A RabbitMQ consumer made idempotent: the shared consumer over an [`AmqpSource`], in two-phase
/// mode (`B` a store) or inbox mode (`B` an [`Inbox`](idem_core::Inbox) over a SQL inbox:
/// `Inbox<PostgresInbox>`).
pub type AmqpConsumer<B> = idem_core::Consumer<AmqpSource, B>;

pub use lapin;
