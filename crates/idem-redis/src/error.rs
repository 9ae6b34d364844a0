//! Errors from setting up the Redis store and the streams adapter.

/// Why a [`RedisStore`](crate::RedisStore) or [`StreamConsumer`](crate::StreamConsumer) could
/// not be built. Errors of store operations are [`idem_core::StoreError`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server could not be reached or refused a command during setup.
    #[error("Redis setup failed during `{op}`")]
    Redis {
        /// What was being done (`"connect"`, `"INFO memory"`, `"XGROUP CREATE"`).
        op: &'static str,
        /// The client's error.
        #[source]
        source: redis::RedisError,
    },
    /// The server may evict keys under memory pressure, which would silently forget dedup
    /// records and let duplicates through (R14).
    #[error(
        "Redis maxmemory-policy is `{policy}`, which can evict dedup records and let duplicates \
         through; run `CONFIG SET maxmemory-policy noeviction` (and persist it in redis.conf), or, \
         accepting that risk, build the store with `.allow_eviction(true)`"
    )]
    EvictingPolicy {
        /// The policy the server reported.
        policy: String,
    },
    /// The namespace is not usable inside a Redis key.
    #[error("Redis namespace {value:?} is invalid: {reason}")]
    InvalidNamespace {
        /// The rejected value.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// A setting of the streams adapter is missing or invalid.
    #[error("stream consumer setting `{field}` {problem}")]
    Config {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
}

impl Error {
    pub(crate) fn redis(op: &'static str) -> impl FnOnce(redis::RedisError) -> Self {
        move |source| Self::Redis { op, source }
    }
}
