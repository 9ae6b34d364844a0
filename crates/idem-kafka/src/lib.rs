//! Kafka consumer adapter for **idem** (on `rdkafka`), driven by idem's shared
//! [`Consumer`](idem_core::Consumer).
//!
//! A consumer-group consumer with auto-commit off. Each partition's offset is committed only
//! up to the last message whose outcome is durable, even when the messages of one partition
//! finish out of order:
//!
//! | idem outcome | Kafka |
//! | --- | --- |
//! | processed, duplicate | the offset may be committed (once every earlier message of the partition has settled) |
//! | in progress elsewhere | pause the partition, retry the message after the other lease's remaining time (at most [`KafkaConfig::retry_delay`]) |
//! | transient failure | (two-phase: the claim released) pause the partition, retry after [`KafkaConfig::retry_delay`] |
//! | conflict, permanent failure, missing key | produce to the dead-letter topic with the `idem-*` headers (`idem-source` = topic, `idem-source-position` = `partition:offset`), await the broker's ack, then the offset may be committed |
//! | fetched while the consumer shuts down | left uncommitted (the partition's next owner reads it again) |
//!
//! The key comes from the `message-id` header by default ([`Delivery`] implements
//! [`Envelope`](idem_core::extract::Envelope), so the CloudEvents and JSON-pointer extractors
//! work too) — never from the offset, because a producer's retry writes the same message at a
//! new offset.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem::engine::HandlerError;
//! use idem::kafka::{KafkaConfig, KafkaConsumer, rdkafka::ClientConfig};
//! use idem::{PostgresStore, sqlx};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! store.migrate().await?; // once: creates the table (a consumer's build checks it)
//! let mut config = ClientConfig::new();
//! config.set("bootstrap.servers", "127.0.0.1:9092").set("group.id", "order-writer");
//! let consumer = KafkaConsumer::builder(KafkaConfig::new(&config, &["orders"], "orders.dlq"))
//!     .inbox(store.inbox(Duration::from_secs(7 * 86_400))) // or .store(store): two-phase
//!     .scope("order-writer")
//!     .build()
//!     .await?;
//! consumer
//!     .run(|mut tx, msg| async move {
//!         sqlx::query("INSERT INTO orders (body) VALUES ($1)")
//!             .bind(msg.payload_bytes().to_vec())
//!             .execute(&mut *tx) // commits with the dedup marker; then the offset is committed
//!             .await
//!             .map_err(HandlerError::Transient)?;
//!         Ok(())
//!     }, async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # Offset inbox
//! With [`offset_inbox`](idem_core::consumer::Builder::offset_inbox) each batch commits its
//! partitions' positions — one row per scope × topic × partition — in the transaction of the
//! handlers' writes: a message below its partition's stored position is a duplicate, acked
//! without running the handler, so redeliveries need no per-message marker and no purge,
//! whatever the topics' retention. [`KafkaConfig::stored_positions`] makes the source seek each
//! assigned partition to its stored position (at the next fetch: the rebalance callback runs on
//! librdkafka's thread). A message whose partition has an earlier message not yet settled waits
//! for it, so positions never pass an effect that is not committed.
//!
//! Producer duplicates (one message id at two offsets) are caught by markers kept for the
//! inbox's retention, the window (`store.inbox(one_hour)`); `.without_markers()` drops them,
//! and the producer must then be idempotent (`enable.idempotence=true`, as [`KafkaPublisher`]
//! is), knowing that an application or relay that publishes a message twice still writes two
//! copies. What it does not promise (positions belong to the scope, a re-created topic, …):
//! `docs/adr/0009-offset-inbox.md`.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem::engine::HandlerError;
//! use idem::inbox::OffsetInbox;
//! use idem::kafka::{KafkaConfig, KafkaConsumer, rdkafka::ClientConfig};
//! use idem::{PostgresStore, sqlx};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! store.migrate().await?; // creates the positions table too
//! // Markers for one hour catch a producer's retries; positions catch every redelivery.
//! let inbox = OffsetInbox::new(store.inbox(Duration::from_secs(3600)));
//! let mut config = ClientConfig::new();
//! config.set("bootstrap.servers", "127.0.0.1:9092").set("group.id", "order-writer");
//! let kafka = KafkaConfig::new(&config, &["orders"], "dlq.orders").stored_positions(inbox.clone());
//! let consumer = KafkaConsumer::builder(kafka)
//!     .offset_inbox(inbox)
//!     .scope("order-writer")
//!     .build()
//!     .await?;
//! consumer
//!     .run(|mut tx, msg| async move {
//!         sqlx::query("INSERT INTO orders (body) VALUES ($1)")
//!             .bind(msg.payload_bytes().to_vec())
//!             .execute(&mut *tx) // commits with the partition's position
//!             .await
//!             .map_err(HandlerError::Transient)?;
//!         Ok(())
//!     }, async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # Publishing (outbox relay)
//! [`KafkaPublisher`] is the Kafka [`Publisher`](idem_core::outbox::Publisher) of an outbox
//! [`Relay`](idem_core::outbox::Relay): an idempotent producer with `acks=all` that produces a
//! batch at once and awaits every delivery report. Each record carries the message's outbox id
//! in the `message-id` header — what this crate's consumer keys on by default, so a message the
//! relay publishes twice is a duplicate downstream — and its ordering key as the record key, so
//! one key stays on one partition, in order.
//!
//! # Rebalances
//! librdkafka reports a revocation inside a poll, and the consumer polls only between batches:
//! handlers in flight finish and their offsets are committed before the partition is given up.
//! Messages of a revoked partition already polled, or waiting for a retry, are still processed
//! but their offsets are no longer committed: the new owner starts at the committed offset,
//! which is never past them, and the store makes the second copy a duplicate.
//!
//! A commit never moves the group's offset back as far as the member can see: before its first
//! commit of a partition after an assignment, and before its closing commit, the source reads
//! the group's committed offsets (one round trip) and leaves out a partition the group has
//! already committed past. Kafka fences a stale member's commits; a broker that does not
//! (tansu 0.6.0 gave one partition to two members after a restart) would otherwise let the
//! member that fell behind hand the partition's messages back.
//!
//! Both protocols work: the eager default, and `partition.assignment.strategy =
//! cooperative-sticky`, under which a join revokes only the partitions that move (the
//! adapter leaves assign and incremental assign to librdkafka; tested on tansu).
//!
//! # Against tansu
//! The tests run against tansu 0.6.0, which answers a fetch that starts inside a multi-record
//! batch with a later batch (records are skipped for every client, not only this one); the
//! tests' producers write one record per batch. See `docs/notes/kafka.md`. A
//! [`KafkaPublisher`] in front of tansu should do the same (`batch.num.messages=1` in its
//! configuration); its publisher tests read every topic from the start, where batch boundaries
//! do not matter. tansu 0.6.0 grants idempotent producers their ids (`InitProducerId`) and
//! checks their sequence numbers, so the publisher keeps idempotence on there.
//!
//! Dead letters are at least once: a dead-lettered message whose offset was not yet committed
//! when its partition moved (or the consumer died) is dead-lettered again by the next owner.
//!
//! # Retention
//! Kafka redelivers nothing on a timer, but a consumer that restarts from an old offset, or a
//! producer retry, replays messages for as long as the topic keeps them: records must be
//! retained at least for the topic's `retention.ms` plus the consumer lag you tolerate. The
//! source asks the brokers for each topic's `retention.ms` when it opens and logs a warning for
//! every topic that outlives the records; [`KafkaSource::retention_gaps`] returns the same
//! check to act on.
//!
//! A broker that does not answer `DescribeConfigs` can be told the retention instead
//! ([`KafkaConfig::redelivery_window`]); opening then fails with
//! [`Error::Retention`] when the dedup records are kept for less.
//!
//! # Azure Event Hubs
//! With the `event-hubs` feature (librdkafka built with OpenSSL), `EventHubsConfig` (in the
//! `event_hubs` module) builds the configuration for Event Hubs' Kafka endpoint from a
//! connection string, with the hub's retention stated and checked. Tested at the configuration
//! level only: parsing, the settings, librdkafka accepting them; not against Azure in CI.
//!
//! # Closing
//! When a run ends the source commits what settled and leaves the group on a blocking thread,
//! bounded by [`KafkaConfig::close_timeout`]: dropping an rdkafka consumer was seen to hang for more
//! than 20 s against some brokers.

mod config;
mod delivery;
mod dlq;
mod error;
#[cfg(feature = "event-hubs")]
pub mod event_hubs;
mod positions;
mod publish;
mod rebalance;
mod retention;
mod security;
mod source;
mod subscription;
mod tracker;

pub use config::KafkaConfig;
pub use delivery::{Delivery, MSG_ID_HEADER};
pub use dlq::KafkaDeadLetters;
pub use error::Error;
#[cfg(feature = "event-hubs")]
pub use event_hubs::EventHubsConfig;
pub use publish::KafkaPublisher;
/// The client this adapter is built on, re-exported so callers use the same version.
pub use rdkafka;
pub use retention::RetentionGap;
pub use source::KafkaSource;

/// A Kafka consumer made idempotent: the shared consumer over a [`KafkaSource`], in two-phase mode
/// (`B` a store) or inbox mode (`B` an [`Inbox`](idem_core::Inbox) over a SQL inbox:
/// `Inbox<PostgresInbox>`).
pub type KafkaConsumer<B> = idem_core::Consumer<KafkaSource, B>;
