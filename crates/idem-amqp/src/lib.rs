//! RabbitMQ consumer adapter for **idem**, on [`lapin`].
//!
//! [`AmqpConsumer`] owns the loop: receive (manual acks, a prefetch) → extract the key (the AMQP
//! `message_id` by default; any [`KeyExtractor`](idem_core::extract::KeyExtractor) set on the
//! engine replaces it) → claim the batch with one `claim_many` → run the handler → record →
//! settle. The ack is always last. Two modes:
//!
//! - **two-phase** ([`AmqpConsumer::run`]): the engine's store holds a lease while the handler
//!   runs, for effects that cannot join a transaction (pass [`Context::downstream_key`] to the
//!   callee). A crash after the effect but before its completion is recorded reruns the
//!   handler with the same downstream key.
//! - **transactional inbox** ([`AmqpConsumer::run_inbox`], feature `sqlite`;
//!   [`AmqpConsumer::run_postgres_inbox`], feature `postgres`): the marker commits with the
//!   handler's writes on the caller's connection; commit, then ack.
//!
//! # Redelivery window
//! RabbitMQ redelivers an unacked message when its channel closes and after `consumer_timeout`
//! (30 min by default); quorum queues stop after `x-delivery-limit` deliveries. Records must
//! outlive that: give the builder a [`RabbitWindow`] and `connect` refuses a shorter retention.
//! RabbitMQ has no per-delivery "still working" signal: a handler longer than
//! `consumer_timeout` gets its channel closed and its message redelivered, so keep handlers
//! shorter (the engine's `heartbeat` extends only the idem lease, which the redelivery then
//! finds in progress and sends round the delay queue until the first attempt finishes).
//!
//! # Failure modes
//! - A dead-letter or delay copy that is not confirmed (nacked, unroutable, channel gone) is
//!   never followed by an ack: the original is requeued instead.
//! - A confirmed dead-letter copy followed by a failed ack is redelivered and dead-lettered
//!   again: the dead-letter queue is at least once.
//! - No broker verb waits forever: an ack, nack or copy that has not finished within
//!   [`AmqpConsumerBuilder::broker_timeout`] (30 s), or a delivery stream whose channel has
//!   been disconnected that long, ends the run with [`Error::BrokerTimeout`] (lapin was seen
//!   to leave an ack pending forever after its connection failed).
//! - Any broker error ends [`AmqpConsumer::run`] with an [`Error`]; reconnect and build a new
//!   consumer. Unacked messages are redelivered by the broker; the store turns them into
//!   duplicates.
//!
//! [`Context::downstream_key`]: idem_core::consumer::Context::downstream_key

mod builder;
mod consumer;
mod error;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
mod inbox;
mod message;
mod settle;
pub mod topology;
mod window;

pub use builder::AmqpConsumerBuilder;
pub use consumer::AmqpConsumer;
pub use error::Error;
pub use message::AmqpMessage;
pub use settle::{Action, Report, Stats};
pub use topology::Topology;
pub use window::{DEFAULT_CONSUMER_TIMEOUT, RabbitWindow};

pub use lapin;
