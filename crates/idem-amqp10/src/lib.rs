//! AMQP 1.0 for **idem**, on [`fe2o3_amqp`]: any AMQP 1.0 queue ([`Amqp10Config`]) or an Azure
//! Service Bus queue or subscription ([`ServiceBus`]) as a source for the shared consumer
//! ([`Amqp10Consumer`]).
//!
//! Deliveries are received **unsettled**: the broker keeps each one locked (Service Bus
//! PeekLock) or unacknowledged (RabbitMQ) until the consumer has decided it, and the settling
//! disposition is always the last step — after the effect is committed (or was already),
//! after a dead-letter copy is accepted. The dedup key is the AMQP `message-id` by default
//! (Service Bus' `MessageId`; never the `correlation-id`); any extractor of
//! `idem_core::extract` works, including CloudEvents in the AMQP binding.
//!
//! | idem outcome | AMQP 1.0 (RabbitMQ and other brokers) |
//! | --- | --- |
//! | processed, duplicate | `accepted` |
//! | in progress elsewhere | held for the other lease's remaining time (clamped to [`Amqp10Config::retry_delay`]), then `released` |
//! | transient failure | `released` (redelivered at once) |
//! | conflict, permanent failure, missing key | [`DeadLetters::Address`]: a copy with the `idem-*` application properties, then `accepted` once the copy is; [`DeadLetters::Reject`]: `rejected` with the reason as the error description |
//! | fetched while the consumer shuts down | `released` |
//!
//! Service Bus maps them to complete / abandon / dead-letter: see [`servicebus`].
//!
//! ```no_run
//! use std::time::Duration;
//! use idem::amqp10::{Amqp10Config, Amqp10Consumer, DeadLetters};
//! use idem::engine::HandlerError;
//! use idem::{PostgresStore, sqlx};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! store.migrate().await?; // once: creates the table (a consumer's build checks it)
//! let config = Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672", "/amq/queue/orders")
//!     .dead_letters(DeadLetters::Address("/queue/orders.dlq".into()));
//! let consumer = Amqp10Consumer::builder(config)
//!     .inbox(store.inbox(Duration::from_secs(7 * 86_400))) // or .store(store): two-phase
//!     .scope("order-writer")
//!     .build()
//!     .await?;
//! consumer
//!     .run(|mut tx, msg| async move {
//!         sqlx::query("INSERT INTO orders (body) VALUES ($1)")
//!             .bind(msg.payload().to_vec())
//!             .execute(&mut *tx) // commits with the dedup marker, then `accepted`
//!             .await
//!             .map_err(HandlerError::Transient)?;
//!         Ok(())
//!     }, async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # Failure modes
//! - A dead-letter copy that is not accepted is never followed by the original's `accepted`:
//!   the original is released instead. An accepted copy followed by a lost `accepted` is
//!   redelivered and dead-lettered again: dead letters are at least once.
//! - No broker call waits forever: the consumer bounds fetches and dispositions by its
//!   [`broker_timeout`](idem_core::consumer::Builder::broker_timeout); closing the links and the
//!   connection is bounded by [`Amqp10Config::verb_timeout`] (RabbitMQ's AMQP 1.0 plugin
//!   answers a closing detach without `closed=true`).
//! - RabbitMQ's AMQP 1.0 links offer only accepted, rejected and released: a `modified`
//!   disposition would leave the message stuck until the connection closes, so it is used
//!   only on Service Bus.
//! - A broken link or connection ends the run with an error; build a new consumer.
//!   Unsettled messages are redelivered by the broker (Service Bus: when their lock
//!   expires) and the store turns them into duplicates.

mod address;
mod config;
mod connect;
mod delivery;
mod dlq;
mod error;
mod link;
pub mod servicebus;
mod source;
mod tls;

pub use config::{Amqp10Config, DeadLetters};
pub use delivery::Delivery;
pub use dlq::{Amqp10DeadLetters, SERVICE_BUS_DEAD_LETTER_QUEUE};
pub use error::Error;
pub use servicebus::{
    AccessToken, BoxError, ServiceBus, ServiceBusConfig, SessionFilter, TokenKind, TokenSource,
};
pub use source::Amqp10Source;
pub use tls::Tls;

/// An AMQP 1.0 or Service Bus consumer made idempotent: the shared consumer over an
/// [`Amqp10Source`], in two-phase mode (`B` a store) or inbox mode (`B` an
/// [`Inbox`](idem_core::Inbox) over a SQL inbox: `Inbox<PostgresInbox>`).
pub type Amqp10Consumer<B> = idem_core::Consumer<Amqp10Source, B>;

pub use fe2o3_amqp;
