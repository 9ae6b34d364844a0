//! Building a [`RedisStore`]: the server or cluster, the namespace, the checks at connect.

use std::sync::Arc;
use std::time::Duration;

use redis::Client;
use redis::cluster::ClusterClient;

use super::replication::Replication;
use super::scripts::Scripts;
use super::{Deployment, RedisConnection, RedisStore, ServerSettings, check, clock, coalesce};
use crate::{Error, Namespace};

/// A shift added to Redis' `TIME` in every script: lets a test move the store's clock forward
/// (leases run out, retention passes) without sleeping. **For tests only.**
///
/// Why an offset and not a fake clock: the store must read the server's clock, never the
/// consumer's, so tests cannot replace it; they can only add to it. Records the offset makes
/// expire early are not yet deleted by Redis' TTL (which runs on the real clock), so a store
/// with an offset treats them as expired in its scripts and
/// [`DedupStore::purge`](idem_core::DedupStore::purge) deletes them with a bounded scan.
#[doc(hidden)]
pub type ClockOffset = idem_core::time::ClockSkew;

/// Configures a [`RedisStore`]: the namespace, the eviction override, the connection.
#[must_use]
pub struct RedisStoreBuilder {
    target: Deployment,
    ns: Namespace,
    allow_eviction: bool,
    response_timeout: Duration,
    offset: Option<ClockOffset>,
    fast_claim: bool,
    replication: Option<Replication>,
    coalesce: bool,
}

impl std::fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("namespace", &self.ns)
            .field("allow_eviction", &self.allow_eviction)
            .field("cluster", &matches!(self.target, Deployment::Cluster(_)))
            .field("fast_claim", &self.fast_claim)
            .field("replication", &self.replication)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    /// Records under `idem:{<name>}:` (default `default`). See [`Namespace`].
    ///
    /// # Errors
    /// [`Error::InvalidNamespace`].
    pub fn namespace(mut self, name: &str) -> Result<Self, Error> {
        self.ns = Namespace::new(name)?;
        Ok(self)
    }

    /// Accept a server whose `maxmemory-policy` may evict keys. Under memory pressure such a
    /// server deletes dedup records before their retention ends, and the next delivery of an
    /// evicted key runs its handler again. Off by default.
    pub fn allow_eviction(mut self, allow: bool) -> Self {
        self.allow_eviction = allow;
        self
    }

    /// How long one command may wait for its reply (default 5 s; a 1,000-key `claim_many` takes
    /// a few milliseconds).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Claim a fresh key with one `SET … NX GET` instead of the claim script (default on; used
    /// only when the server, or every cluster master, runs Redis ≥ 7.0). Turn it off to compare,
    /// or where a proxy in front of Redis refuses `SET` with both `NX` and `GET`.
    pub fn fast_claim(mut self, on: bool) -> Self {
        self.fast_claim = on;
        self
    }

    /// Coalesce concurrent `complete` calls (default off): while 4 completion scripts are in
    /// flight, further completions queue and leave together in the next script. Redis then
    /// runs fewer scripts, each with a fixed cost several times a `SET`'s, at the price of
    /// shallower pipelining. Worth it when Redis' CPU is the bottleneck (many consumer
    /// processes on one Redis); on one process and a Redis with CPU to spare, completions
    /// pipelined on the shared connection are faster (`docs/BENCHMARKS.md`). `claim_many` /
    /// `complete_many` (the batch path) are one round trip either way.
    pub fn coalesce_completions(mut self, on: bool) -> Self {
        self.coalesce = on;
        self
    }

    /// After every write (claim, completion, failure, release, extension), wait until at least
    /// `replicas` replicas acknowledged it, for at most `timeout` (Redis `WAIT`). Off by default.
    ///
    /// **What it buys.** Redis replicates asynchronously: a write acknowledged by a master that
    /// dies before forwarding it is gone once a replica takes over. For a claim, the new master
    /// has no record, so a redelivery runs the handler while the first run may still be going;
    /// for a completion, the key reads as in progress and, once the lease ends, a redelivery
    /// runs the handler again. With `wait_for_replicas(1, ..)` and one replica per master, an
    /// operation returns only after the replica has it, so a failover that promotes that
    /// replica keeps it.
    ///
    /// **What it does not.** `WAIT` is not a consensus write: if the acknowledging replica is
    /// not the one promoted, or the master fails while the write has reached no replica (the
    /// operation then returns an error, the message is not acknowledged, and the write may
    /// still be lost), the guarantee does not hold. Replicas' own persistence is their
    /// `appendonly` setting. A shortfall is a retryable error naming the counts.
    ///
    /// It costs a `WAIT` round trip per write (concurrent writes share one `WAIT`): 0.44–0.67×
    /// the asynchronous throughput in `docs/BENCHMARKS.md`. `replicas` 0 turns it off.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idem_redis::RedisStore;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idem_redis::Error> {
    /// let store = RedisStore::cluster_builder(["redis://127.0.0.1:7000/"])?
    ///     .namespace("payments")?
    ///     .wait_for_replicas(1, Duration::from_millis(500)) // each write on a replica first
    ///     .connect()
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn wait_for_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.replication = (replicas > 0).then_some(Replication { replicas, timeout });
        self
    }

    /// Adds a test-controlled offset to the server's clock. For tests only: see [`ClockOffset`].
    #[doc(hidden)]
    pub fn clock_offset(mut self, offset: ClockOffset) -> Self {
        self.offset = Some(offset);
        self
    }

    /// Connects and checks the server's settings (on a cluster, those of every master that serves
    /// slots; a master added but not yet given slots holds no keys and is not checked): refuses an
    /// evicting `maxmemory-policy` (unless [`allow_eviction`](Self::allow_eviction)), logs a
    /// warning when neither RDB snapshots nor the AOF are on (a restart then forgets every
    /// record).
    ///
    /// # Errors
    /// [`Error::Redis`] when the server cannot be reached; [`Error::EvictingPolicy`];
    /// [`Error::ClusterNode`] naming the cluster master that failed a check.
    ///
    /// # Cancel safety
    /// Cancel safe: it writes nothing to the server, and the connections it opened close when
    /// the call is dropped.
    pub async fn connect(self) -> Result<RedisStore, Error> {
        crate::tls::ensure_crypto_provider();
        let (conn, all_support_fast) = match self.target {
            Deployment::Single(client) => {
                let cfg = redis::aio::ConnectionManagerConfig::new()
                    .set_response_timeout(Some(self.response_timeout))
                    .set_number_of_retries(3);
                let mut conn = client
                    .get_connection_manager_with_config(cfg)
                    .await
                    .map_err(Error::redis("connect"))?;
                let settings = ServerSettings::read(&mut conn).await?;
                settings.enforce(self.allow_eviction)?;
                (RedisConnection::single(conn), settings.supports_set_nx_get())
            }
            Deployment::Cluster(client) => {
                let conn = client.get_async_connection().await.map_err(Error::redis("connect"))?;
                let conn = RedisConnection::cluster(conn);
                let masters = check::check_masters(&conn, self.allow_eviction).await?;
                (conn, masters.iter().all(ServerSettings::supports_set_nx_get))
            }
        };
        let store = RedisStore {
            conn,
            ns: self.ns,
            scripts: Arc::new(Scripts::new()),
            offset: self.offset,
            clock: (self.fast_claim && all_support_fast)
                .then(|| Arc::new(clock::ServerClock::default())),
            replication: self.replication,
            coalesce: self.coalesce,
            completes: Arc::new(coalesce::Queue::default()),
            waits: Arc::new(coalesce::Waits::default()),
            allow_eviction: self.allow_eviction,
        };
        if store.clock.is_some() {
            store.anchor_clock().await.map_err(|e| Error::Store { op: "TIME", source: e })?;
        }
        Ok(store)
    }
}

impl RedisStore {
    /// A builder for the server at `url`: `redis://[user:password@]host:port/db`, or
    /// `rediss://…` for TLS (the crate feature `rustls`), verified against the OS trust store.
    /// For your own CA or a client certificate, build the client with
    /// [`Client::build_with_tls`] and use [`builder_for`](Self::builder_for).
    ///
    /// # Errors
    /// [`Error::Redis`] when the URL does not parse; [`Error::TlsUnavailable`] for `rediss://`
    /// in a build without TLS.
    pub fn builder(url: &str) -> Result<RedisStoreBuilder, Error> {
        Ok(Self::builder_for(crate::tls::client(url)?))
    }

    /// A builder over an existing client: one made with [`Client::build_with_tls`] carries a
    /// custom CA and a client certificate.
    ///
    /// ```no_run
    /// # #[cfg(feature = "rustls")]
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// use idem_redis::RedisStore;
    /// use redis::{Client, ClientTlsConfig, TlsCertificates};
    ///
    /// let certs = TlsCertificates {
    ///     client_tls: Some(ClientTlsConfig {
    ///         client_cert: std::fs::read("client.pem")?,
    ///         client_key: std::fs::read("client.key")?,
    ///     }),
    ///     root_cert: Some(std::fs::read("ca.pem")?),
    /// };
    /// let client = Client::build_with_tls("rediss://cache.internal:6380/", certs)?;
    /// let store = RedisStore::builder_for(client).namespace("billing")?.connect().await?;
    /// # let _ = store; Ok(()) }
    /// ```
    pub fn builder_for(client: Client) -> RedisStoreBuilder {
        Self::builder_with(Deployment::Single(Box::new(client)))
    }

    /// A builder for a Redis Cluster reached through any of `nodes` (`redis://host:port/`; the
    /// rest of the cluster is discovered). Records of a namespace live on the master owning its
    /// hash slot; run several namespaces to spread consumers over the masters.
    ///
    /// ```no_run
    /// use idem_redis::RedisStore;
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idem_redis::Error> {
    /// let store = RedisStore::cluster_builder(["redis://127.0.0.1:7000/", "redis://127.0.0.1:7001/"])?
    ///     .namespace("orders")?
    ///     .connect()
    ///     .await?;
    /// # let _ = store; Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Redis`] when a URL does not parse.
    pub fn cluster_builder<I, T>(nodes: I) -> Result<RedisStoreBuilder, Error>
    where
        I: IntoIterator<Item = T>,
        T: redis::IntoConnectionInfo,
    {
        let client = ClusterClient::builder(nodes)
            .response_timeout(Duration::from_secs(5))
            .connection_timeout(Duration::from_secs(5))
            .retries(6)
            .build()
            .map_err(Error::redis("open cluster"))?;
        Ok(Self::builder_with(Deployment::Cluster(Box::new(client))))
    }

    /// [`cluster_builder`](Self::cluster_builder) over an existing cluster client: one built
    /// with [`ClusterClientBuilder::certs`](redis::cluster::ClusterClientBuilder::certs) carries
    /// a custom CA and a client certificate for `rediss://` nodes.
    pub fn cluster_builder_for(client: ClusterClient) -> RedisStoreBuilder {
        Self::builder_with(Deployment::Cluster(Box::new(client)))
    }

    fn builder_with(target: Deployment) -> RedisStoreBuilder {
        RedisStoreBuilder {
            target,
            ns: Namespace::default(),
            allow_eviction: false,
            response_timeout: Duration::from_secs(5),
            offset: None,
            fast_claim: true,
            replication: None,
            coalesce: false,
        }
    }

    /// Connects to `url` with the default namespace, refusing an evicting server.
    ///
    /// # Errors
    /// As [`RedisStoreBuilder::connect`].
    ///
    /// # Cancel safety
    /// As [`RedisStoreBuilder::connect`]: cancel safe.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder(url)?.connect().await
    }
}
