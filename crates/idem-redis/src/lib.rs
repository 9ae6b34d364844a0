//! Redis for **idem**: a dedup store ([`RedisStore`]) and a Redis Streams consumer adapter
//! ([`StreamConsumer`]).
//!
//! - [`RedisStore`] implements the [`DedupStore`](idem_core::DedupStore) contract with one Lua
//!   script per operation, leases on Redis' own clock and retention as native TTLs, under a
//!   validated, hash-tagged [`Namespace`]. At connect it refuses an evicting
//!   `maxmemory-policy` and warns when persistence is off.
//! - [`StreamConsumer`] reads a stream through a consumer group, runs each batch through the
//!   core [`Consumer`](idem_core::Consumer) engine and turns each outcome into `XACK`, a
//!   dead-letter entry, or leaving the entry pending for `XAUTOCLAIM`.
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
pub use stream::{Settled, StreamConsumer, StreamConsumerBuilder, StreamEntry};

/// The Redis client crate this adapter is built on (for `Client` and your own commands).
pub use redis;
