//! Kafka consumer adapter for **idem** (on `rdkafka`).
//!
//! A consumer-group consumer with auto-commit off. Each partition's offset is committed only
//! up to the last message whose outcome is durable, even when the messages of one partition
//! finish out of order:
//!
//! | idem outcome | Kafka |
//! | --- | --- |
//! | processed, duplicate | the offset may be committed (once every earlier message of the partition has settled) |
//! | in progress elsewhere | pause the partition, retry the message after the other lease's remaining time |
//! | transient failure | release the claim, pause the partition, retry after [`Settings::retry_delay`] |
//! | conflict, permanent failure | produce to the dead-letter topic with [`headers::REASON`] and the original topic/partition/offset, await the broker's ack, then the offset may be committed |
//!
//! The key comes from the `message-id` header by default ([`Delivery`] implements
//! [`Envelope`](idem_core::extract::Envelope), so the CloudEvents and JSON-pointer extractors
//! work too) — never from the offset, because a producer's retry writes the same message at a
//! new offset. Messages polled together are claimed together.
//!
//! Two modes:
//! - [`KafkaConsumer`]: two-phase, over any [`DedupStore`](idem_core::DedupStore), for effects
//!   outside the database (pass `ctx.downstream_key()` to the callee).
//! - [`PgInboxConsumer`] (feature `postgres`): transactional inbox; the marker and the
//!   handler's writes commit in one PostgreSQL transaction, then the offset is committed.
//!
//! # Rebalances
//! librdkafka reports a revocation inside a poll, and the adapter polls only between batches:
//! handlers in flight finish and their offsets are committed before the partition is given up.
//! Messages of a revoked partition already polled, or waiting for a retry, are still processed
//! but their offsets are no longer committed: the new owner starts at the committed offset,
//! which is never past them, and the store makes the second copy a duplicate.
//!
//! Both protocols work: the eager default, and `partition.assignment.strategy =
//! cooperative-sticky`, under which a join revokes only the partitions that move (the
//! adapter leaves assign and incremental assign to librdkafka; tested on tansu).
//!
//! # Against tansu
//! The tests run against tansu 0.6.0, which answers a fetch that starts inside a multi-record
//! batch with a later batch (records are skipped for every client, not only this one); the
//! tests' producers write one record per batch. See `docs/notes/kafka.md`.
//!
//! Dead letters are at least once: a dead-lettered message whose offset was not yet committed
//! when its partition moved (or the consumer died) is dead-lettered again by the next owner.
//!
//! # Retention
//! Kafka redelivers nothing on a timer, but a consumer that restarts from an old offset, or a
//! producer retry, replays messages for as long as the topic keeps them: records must be
//! retained at least for the topic's `retention.ms` plus the consumer lag you tolerate. `run`
//! asks the brokers for each topic's `retention.ms` when it starts and logs a warning for every
//! topic that outlives the records; `retention_gaps` returns the same check to act on.
//!
//! # Closing
//! Call `close` (it leaves the group on a blocking thread with a timeout): dropping an rdkafka
//! consumer was seen to hang for more than 20 s against some brokers.

mod consumer;
mod delivery;
mod error;
#[cfg(feature = "postgres")]
mod pg_inbox;
mod report;
mod retention;
mod settings;
mod source;
mod tracker;

pub use consumer::KafkaConsumer;
pub use delivery::{Delivery, MSG_ID_HEADER};
pub use error::Error;
#[cfg(feature = "postgres")]
pub use pg_inbox::PgInboxConsumer;
/// The client this adapter is built on, re-exported so callers use the same version.
pub use rdkafka;
pub use report::Report;
pub use retention::RetentionGap;
pub use settings::Settings;
pub use source::{Action, Settled, headers};
