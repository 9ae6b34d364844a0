//! Errors of the Redis store's setup and of the streams source.

/// Why a [`RedisStore`](crate::RedisStore) could not be built, or what the streams source
/// could not do. Errors of store operations are [`idem_core::StoreError`]; per-entry failures
/// of the streams source are outcomes, counted in the consumer's report.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The server could not be reached or refused a command.
    #[error("Redis `{op}` failed")]
    Redis {
        /// What was being done (`"connect"`, `"INFO memory"`, `"XGROUP CREATE"`, `"XACK"`).
        op: &'static str,
        /// The client's error.
        #[source]
        source: redis::RedisError,
    },
    /// The URL asks for TLS (`rediss://`, `valkeys://`) but this build has no TLS: it is
    /// refused rather than connected in plaintext.
    #[error(
        "{scheme}:// asks for TLS, which this build lacks: enable the feature `rustls` of \
         idem-redis (`rustls` of the idem facade)"
    )]
    TlsUnavailable {
        /// The URL's scheme.
        scheme: String,
    },
    /// The server may evict keys under memory pressure, which would silently forget dedup
    /// records and let duplicates through.
    #[error(
        "Redis maxmemory-policy is `{policy}`, which can evict dedup records and let duplicates \
         through; run `CONFIG SET maxmemory-policy noeviction` (and persist it in redis.conf), or, \
         accepting that risk, build the store with `.allow_eviction(true)`"
    )]
    EvictingPolicy {
        /// The policy the server reported.
        policy: String,
    },
    /// A check of one Redis Cluster master failed (its eviction policy, say).
    #[error("Redis Cluster master {node}: {source}")]
    ClusterNode {
        /// The master's address (`host:port`).
        node: String,
        /// What failed there.
        #[source]
        source: Box<Error>,
    },
    /// A store operation the setup needs failed (reading the server's clock).
    #[error("Redis `{op}` failed during setup: {source}")]
    Store {
        /// The operation.
        op: &'static str,
        /// The store's error.
        #[source]
        source: idem_core::StoreError,
    },
    /// The namespace is not usable inside a Redis key.
    #[error("Redis namespace {value:?} is invalid: {reason}")]
    InvalidNamespace {
        /// The rejected value.
        value: String,
        /// The rule it breaks.
        reason: &'static str,
    },
    /// A command that failed for several entries at once (a dead-letter pipeline).
    #[error("Redis `{op}` failed")]
    Shared {
        /// The command.
        op: &'static str,
        /// The client's error, shared by the entries it concerned.
        #[source]
        source: std::sync::Arc<redis::RedisError>,
    },
    /// A blocking read got no answer within its block time and a margin: its connection is
    /// dropped, and the next read opens another.
    #[error("Redis `{op}` got no answer within {after:?}")]
    Timeout {
        /// The command.
        op: &'static str,
        /// How long it was given.
        after: std::time::Duration,
    },
    /// The dedup retention is shorter than the stream's redelivery window (about
    /// `max_deliveries × reclaim_idle`).
    #[error(transparent)]
    Retention(#[from] idem_core::retention::RetentionTooShort),
    /// The dead-letter stream is the consumed stream: every dead letter would be read back by
    /// the group as a new entry and processed.
    #[error(
        "the dead-letter stream `{dead_letter}` is the consumed stream `{stream}`: every dead \
         letter would be read back by the group as a new entry and processed; dead-letter to \
         another key (the default is `<stream>:dead-letter`)"
    )]
    DeadLetterLoop {
        /// The dead-letter stream's key.
        dead_letter: String,
        /// The consumed stream's key.
        stream: String,
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
