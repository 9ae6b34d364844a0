//! Redis for **idem**: a dedup store ([`RedisStore`]) and a Redis Streams source for the shared
//! consumer driver ([`StreamConsumer`]).
//!
//! - [`RedisStore`] implements the [`DedupStore`](idem_core::DedupStore) contract with one Lua
//!   script per operation, leases on Redis' own clock and retention as native TTLs, under a
//!   validated, hash-tagged [`Namespace`]. At connect it refuses an evicting
//!   `maxmemory-policy` and warns when persistence is off.
//! - [`StreamConsumer`] reads a stream through a consumer group ([`StreamConfig`]) with idem's
//!   [`Driver`](idem_core::Driver), in two-phase mode over any store (this one included) or in
//!   inbox mode over a SQL inbox, and turns each outcome into a verb:
//!
//! | idem outcome | Redis Streams |
//! | --- | --- |
//! | processed, duplicate | `XACK` |
//! | in progress elsewhere, transient failure | nothing: the entry stays pending and `XAUTOCLAIM` hands it out again after [`StreamConfig::reclaim_idle`] (the retry delay cannot be honoured more precisely) |
//! | conflict, permanent failure, missing key, a retry at [`StreamConfig::max_deliveries`] | `XADD` to the dead-letter stream (the entry's fields plus the `idem-*` headers, `idem-source` = stream, `idem-source-position` = entry id, `idem-group`), then `XACK` |
//! | fetched while the consumer shuts down | nothing (pending, reclaimed after the idle time) |
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_core::consumer::HandlerError;
//! use idem_redis::{StreamConfig, StreamConsumer};
//! use idem_sqlx::PostgresStore;
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! let client = redis::Client::open("redis://127.0.0.1/")?;
//! let consumer = StreamConsumer::builder(StreamConfig::new(client, "orders", "order-writer", "w-1"))
//!     .inbox(store.inbox(Duration::from_secs(7 * 86_400))) // or .store(redis_store): two-phase
//!     .scope("order-writer")
//!     .build()
//!     .await?;
//! consumer
//!     .run(|mut tx, entry| async move {
//!         sqlx::query("INSERT INTO orders (body) VALUES ($1)")
//!             .bind(idem_core::extract::Envelope::payload(&entry).to_vec())
//!             .execute(&mut *tx) // commits with the dedup marker, then XACK
//!             .await
//!             .map_err(HandlerError::Transient)?;
//!         Ok(())
//!     }, async { tokio::signal::ctrl_c().await.ok(); })
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! # Failure modes and redelivery
//! A consumer that dies leaves its entries pending; after `reclaim_idle` any consumer of the
//! group takes them over and the store makes the copies duplicates. A failed `XACK` leaves
//! entries pending the same way (counted in the report's `settle_failures`). Dead letters are
//! written before the `XACK`, so a crash in between dead-letters an entry twice, never zero
//! times. With a delivery limit, records must outlive `max_deliveries × reclaim_idle`
//! (checked when the source opens); without one, an entry that never settles keeps coming back.
//!
//! Needs Redis 6.2 or later (`XAUTOCLAIM`); tested on 7.0. No TLS features are enabled.

mod error;
mod namespace;
mod store;
mod stream;

pub use error::Error;
pub use namespace::{MAX_NAMESPACE_BYTES, Namespace};
#[doc(hidden)]
pub use store::ClockOffset;
pub use store::{MAX_RESULT_BYTES, RedisStore, RedisStoreBuilder, ServerSettings};
pub use stream::{StreamConfig, StreamEntry, StreamSource};

/// A Redis stream consumer made idempotent: the shared driver over a [`StreamSource`], in
/// two-phase mode (`B` a store) or inbox mode (`B` a SQL inbox).
pub type StreamConsumer<B> = idem_core::Driver<StreamSource, B>;

/// The Redis client crate this adapter is built on (for `Client` and your own commands).
pub use redis;
