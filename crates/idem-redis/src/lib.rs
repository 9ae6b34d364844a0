//! Redis for **idem**: a dedup store ([`RedisStore`]) and a Redis Streams source for the shared
//! consumer ([`StreamConsumer`]).
//!
//! - [`RedisStore`] implements the [`DedupStore`](idem_core::DedupStore) contract: a fresh key
//!   is claimed with one `SET … NX GET` (Redis ≥ 7.0), every other read-decide-write is one Lua
//!   script, leases run on Redis' own clock and retention is the keys' native TTL, under a
//!   validated, hash-tagged [`Namespace`]. It runs on one server or on a Redis Cluster
//!   ([`RedisStore::cluster_builder`]). At connect it refuses an evicting `maxmemory-policy`
//!   (on a cluster, on any master) and warns when persistence is off.
//! - [`StreamConsumer`] reads a stream through a consumer group ([`StreamConfig`]) with idem's
//!   [`Consumer`](idem_core::Consumer): in two-phase mode over any store (this one included;
//!   `.store(store)`), or in inbox mode over a SQL inbox (`.inbox(store.inbox(retain))` of
//!   `idem-sqlx`'s SQLite, PostgreSQL or MySQL store), where each batch's effects commit with
//!   their dedup markers in one transaction.
//!
//! # Outcomes and verbs
//! | idem outcome | Redis Streams |
//! | --- | --- |
//! | processed, duplicate | `XACK` |
//! | in progress elsewhere, transient failure | none: the entry stays pending and `XAUTOCLAIM` hands it out again once it has been idle for [`reclaim_idle`](StreamConfig::reclaim_idle) |
//! | conflict, permanent failure, missing key; a retry due at the [`max_deliveries`](StreamConfig::max_deliveries)-th delivery | `XADD` to the dead-letter stream, then `XACK` |
//! | fetched while the consumer shuts down | none (pending; taken over after `reclaim_idle`) |
//!
//! A dead-letter entry carries the entry's fields, the shared
//! [`headers`](idem_core::consumer::headers) `idem-reason`, `idem-outcome`, `idem-scope`,
//! `idem-source` (the stream), `idem-source-position` (the entry id), `idem-delivered`, and
//! [`idem-group`](GROUP_FIELD).
//!
//! **The retry delay** the consumer suggests (another consumer's remaining lease) cannot be
//! honoured: Redis has no delayed redelivery, so a retried entry comes back after
//! `reclaim_idle` (plus up to a quarter of it, the scan period), whatever was asked.
//!
//! **The redelivery window** is `max_deliveries × reclaim_idle` (each gap up to a quarter
//! longer): the handler runs at most `max_deliveries` times, and a retry due at the last
//! delivery is dead-lettered instead. Opening the source refuses a retention shorter than that
//! (plus [`dead_letter_allowance`](StreamConfig::dead_letter_allowance)). Without
//! `max_deliveries` it is unbounded: an entry that never settles keeps coming back.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem::engine::HandlerError;
//! use idem::extract::Envelope;
//! use idem::redis::{StreamConfig, StreamConsumer, redis};
//! use idem::{PostgresStore, sqlx};
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! store.migrate().await?; // once: creates the table (a consumer's build checks it)
//! let client = redis::Client::open("redis://127.0.0.1/")?;
//! let config = StreamConfig::new(client, "orders", "order-writer", "w-1")
//!     .reclaim_idle(Duration::from_secs(60))
//!     .max_deliveries(5);
//! let consumer = StreamConsumer::builder(config)
//!     .inbox(store.inbox(Duration::from_secs(7 * 86_400))) // or .store(redis_store): two-phase
//!     .scope("order-writer")
//!     .build()
//!     .await?;
//! let report = consumer
//!     .run(|mut tx, entry| async move {
//!         sqlx::query("INSERT INTO orders (id, body) VALUES ($1, $2)")
//!             .bind(entry.message_id().unwrap_or_default().to_owned())
//!             .bind(entry.payload().to_vec())
//!             .execute(&mut *tx) // commits with the dedup marker, then XACK
//!             .await
//!             .map_err(|e| HandlerError::Transient(e.to_string()))?;
//!         Ok(())
//!     }, async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! println!("{report}");
//! # Ok(()) }
//! ```
//!
//! # Failure modes
//! - **A consumer dies** (crash, kill, lost host) with entries read: they stay pending in its
//!   name; once idle for `reclaim_idle` any member of the group takes them over. Effects
//!   committed before the crash make the copies duplicates (acknowledged, not run again); a
//!   two-phase key still under the dead consumer's lease is left pending until the lease runs
//!   out. Each takeover counts a delivery.
//! - **Between commit and `XACK`** (crash, failed `XACK`): the entries come back after
//!   `reclaim_idle` and are found done. A failed `XACK` is counted in the report's
//!   `settle_failures`; the run goes on (the connection manager reconnects).
//! - **Dead letters** are written and confirmed before the `XACK`: a crash in between
//!   dead-letters an entry twice, never zero times. A copy that fails (the dead-letter stream
//!   unwritable) is not acknowledged; it is counted in `dead_letter_failures` and the entry comes
//!   back.
//! - **A batch slower than `reclaim_idle`**: other consumers take its entries over while they
//!   are handled; two-phase, they find the keys in progress and leave them pending; in inbox mode
//!   they wait on the marker and find them duplicates. Effects still happen once, but deliveries
//!   are spent: keep `reclaim_idle` above the longest batch, and
//!   `(max_deliveries − 1) × reclaim_idle` above the engine's lease (opening warns otherwise).
//! - **Connection trouble**: a failed fetch is retried per the consumer's
//!   [`FetchFailures`](idem_core::consumer::FetchFailures); a blocking read with no answer 5 s
//!   after its block time is dropped with its connection; any broker call hanging past the
//!   consumer's broker timeout ends the run, and whatever was not acknowledged comes back.
//! - **The group or stream is deleted** (`NOGROUP`): the run ends at once.
//! - **Redis loses writes** (failover, no persistence): a lost `XACK` is only a redelivery, found
//!   done; lost dedup records of a [`RedisStore`] let duplicates through, hence its startup
//!   checks, or a SQL store for the records.
//!
//! Needs Redis 6.2 or later (`XAUTOCLAIM`; the script-free claim needs 7.0 and is used only
//! there); tested on 7.0. No TLS features are enabled.
//!
//! # Redis Cluster and failover
//! [`RedisStore::cluster_builder`] and [`StreamConfig::cluster`] take any of the cluster's
//! nodes; the rest is discovered, and `MOVED`/`ASK` redirections and failovers are followed.
//! A namespace's records share one hash slot (`idem:{<namespace>}:…`), so each namespace lives
//! on one master and batches stay single-slot scripts: spread load with several namespaces
//! (one per consumer group, say). A stream lives on its key's slot; its dead-letter stream may
//! be elsewhere.
//!
//! **What a failover keeps.** Redis replicates asynchronously. When a master dies, the replica
//! promoted in its place has what had reached it, and nothing after:
//! - **Default (asynchronous).** A claim or completion acknowledged by the dead master but not
//!   yet replicated is gone. A lost claim lets a redelivery run the handler while the first
//!   run may still be going; a lost completion makes the key read as in progress (or absent),
//!   so a redelivery runs the handler again once the lease ends. The window is the replication
//!   lag; `tests/it/failover.rs` widens it on purpose (replicas stopped, their links full) and
//!   loses 100 of 100 acknowledged claims.
//! - **[`wait_for_replicas(n, timeout)`](RedisStoreBuilder::wait_for_replicas).** Every write
//!   returns only once `n` replicas acknowledged it (Redis `WAIT`; concurrent writes share one
//!   `WAIT`); otherwise the operation fails with a retryable error and the message is not
//!   acknowledged. A failover that promotes an acknowledging replica keeps every acknowledged
//!   claim and completion: in `tests/it/failover.rs`, 636 completions acknowledged across a master
//!   kill, 0 lost, the store acknowledging again 3.3 s after the kill.
//! - **Not promised even then.** `WAIT` is not consensus: if the promoted replica is not one
//!   that acknowledged (more replicas than `n`, or a manual failover), or a replica that
//!   acknowledged restarts without persistence, writes can still be lost; a write that failed
//!   its `WAIT` may or may not survive. A shard left with fewer than `n` replicas refuses every
//!   write until one rejoins. Use a SQL store where losing a record is not acceptable.
//!
//! Costs measured on one machine (`docs/BENCHMARKS.md`): the cluster client is slower per call
//! than the single-server connection (0.55–0.9× at one namespace); `wait_for_replicas(1)` runs
//! at 0.44–0.67× of asynchronous writes.
//!
//! # Publishing (outbox relay)
//! [`StreamPublisher`] is the Redis Streams [`Publisher`](idem_core::outbox::Publisher) of an
//! outbox [`Relay`](idem_core::outbox::Relay): one pipelined round trip of `XADD`s per batch,
//! each entry laid out as [`StreamConsumer`] reads it by default — the outbox id in
//! `message_id`, the body in `payload`, each header a field — so a message the relay publishes
//! twice is a duplicate downstream. Optional approximate trimming (`MAXLEN ~`) and a replica
//! wait (`WAIT`) for the batch.

mod error;
mod namespace;
mod publish;
mod store;
mod stream;
mod tls;

pub use error::Error;
pub use namespace::{MAX_NAMESPACE_BYTES, Namespace};
pub use publish::{Refused, StreamPublisher};
#[doc(hidden)]
pub use store::ClockOffset;
pub use store::{MAX_RESULT_BYTES, RedisConnection, RedisStore, RedisStoreBuilder, ServerSettings};
pub use stream::{Delivery, GROUP_FIELD, StreamConfig, StreamDeadLetters, StreamSource};
#[cfg(feature = "rustls")]
pub use tls::install_crypto_provider;

/// A Redis stream consumer made idempotent: the shared consumer over a [`StreamSource`], in
/// two-phase mode (`B` a store) or inbox mode (`B` an [`Inbox`](idem_core::Inbox) over a SQL inbox:
/// `Inbox<PostgresInbox>`).
pub type StreamConsumer<B> = idem_core::Consumer<StreamSource, B>;

/// The Redis client crate this adapter is built on (for `Client` and your own commands).
pub use redis;
