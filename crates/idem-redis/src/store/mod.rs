//! `RedisStore`: the dedup contract on Redis: a script-free fresh claim, and one Lua script
//! for every other read-decide-write.

mod check;
mod clock;
mod coalesce;
mod codec;
mod conn;
mod decode;
mod fast;
mod inspect;
mod scripts;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::time::duration_micros;
use idem_core::{
    Claim, ClaimRequest, Completion, DedupKey, DedupStore, FailKind, Lease, StoreError, Timestamp,
};
use redis::cluster::ClusterClient;
use redis::{Client, Script, Value};

pub use check::ServerSettings;
pub(crate) use conn::Deployment;
pub use conn::RedisConnection;

use crate::{Error, Namespace};

/// Largest stored result or reason, in bytes.
pub const MAX_RESULT_BYTES: usize = 1 << 20;

/// A dedup store on Redis: a standalone server ([`RedisStore::builder`]) or a Redis Cluster
/// ([`RedisStore::cluster_builder`]), where each namespace lives on the node owning its hash
/// slot (see [`Namespace`]).
///
/// - **A fresh key costs one plain command.** On Redis ≥ 7.0 a claim is first
///   `SET key <in-progress record> NX GET PX <retention>`: Redis itself arbitrates between
///   concurrent claimers, and when the key exists it returns the record without writing. The
///   answers that write nothing (completed, conflict, a lease clearly live) are decided from that
///   record; every other case (an expired lease, a released or failed record, a deadline within
///   a few milliseconds) goes to the claim script. The fresh record is stamped from an estimate
///   of the **server's** clock (its `TIME`, re-read every 5 s, plus the monotonic time since).
/// - **Atomic per key.** Every other read-decide-write (a takeover, complete, fail, release,
///   extend) is one Lua script that reads Redis' own `TIME`: nothing runs in between.
///   `claim_many` is one pipeline of those `SET`s, then one script for the keys it left open.
/// - **Fenced.** The record keeps its fencing token and attempt; the finishing scripts compare
///   the token and change nothing when it moved on.
/// - **Completions** are one fenced script each (without `TIME` when the fast path's clock
///   estimate is fresh), pipelined on the shared connection with everything else; see
///   [`RedisStoreBuilder::coalesce_completions`] to group them into fewer scripts.
/// - **Retention is the key's native TTL**: each write sets `PEXPIRE` to the record's expiry, so
///   Redis deletes records itself and [`DedupStore::purge`] has nothing to do (it returns 0).
/// - **Pipelining.** The store holds one multiplexed connection (reconnecting; on a cluster,
///   one per node); clones share it, so concurrent claims travel pipelined on one socket.
/// - **Replication is asynchronous** unless [`RedisStoreBuilder::wait_for_replicas`] is set:
///   see its documentation for what a failover can lose.
///
/// [`RedisStoreBuilder::connect`] refuses a server (on a cluster, any master) whose
/// `maxmemory-policy` can evict records and warns when persistence is off (see
/// [`RedisStoreBuilder::allow_eviction`]).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore};
/// use idem_redis::RedisStore;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::builder("redis://127.0.0.1:6379/")?.namespace("orders")?.connect().await?;
/// let req = ClaimRequest::new(DedupKey::new("billing", "o-1")?, None,
///                             Duration::from_secs(30), Duration::from_secs(86_400));
/// let Claim::Acquired(lease) = store.claim(&req).await? else { unreachable!() };
/// store.complete(lease, Some(b"ok"), Duration::from_secs(86_400)).await?;
/// assert!(matches!(store.claim(&req).await?, Claim::Completed(_)));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    conn: RedisConnection,
    ns: Namespace,
    scripts: Arc<Scripts>,
    offset: Option<ClockOffset>,
    /// `None` when claims always run the script (Redis < 7.0, or turned off).
    clock: Option<Arc<clock::ServerClock>>,
    replication: Option<Replication>,
    coalesce: bool,
    completes: Arc<coalesce::Queue>,
    waits: Arc<coalesce::Waits>,
}

/// `WAIT` after each write: at least `replicas` acknowledgements within `timeout`.
#[derive(Debug, Clone, Copy)]
struct Replication {
    replicas: u32,
    timeout: Duration,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("namespace", &self.ns).finish_non_exhaustive()
    }
}

struct Scripts {
    claim: Script,
    claim_many: Script,
    finish: Script,
    complete_many: Script,
    release: Script,
    extend: Script,
    force_release: Script,
    force_fail: Script,
    purge: Script,
    now: Script,
}

impl Scripts {
    fn new() -> Self {
        Self {
            claim: Script::new(&scripts::claim()),
            claim_many: Script::new(&scripts::claim_many()),
            finish: Script::new(&scripts::finish()),
            complete_many: Script::new(&scripts::complete_many()),
            release: Script::new(&scripts::release()),
            extend: Script::new(&scripts::extend()),
            force_release: Script::new(&scripts::force_release()),
            force_fail: Script::new(&scripts::force_fail()),
            purge: Script::new(&scripts::purge()),
            now: Script::new(&scripts::now()),
        }
    }
}

/// A shift added to Redis' `TIME` in every script: lets a test move the store's clock forward
/// (leases run out, retention passes) without sleeping. **For tests only.**
///
/// Why an offset and not a fake clock: the store must read the server's clock (R6), so tests
/// cannot replace it; they can only add to it. Records the offset makes expire early are not
/// yet deleted by Redis' TTL (which runs on the real clock), so a store with an offset treats
/// them as expired in its scripts and [`DedupStore::purge`] deletes them with a bounded scan.
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
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder(url)?.connect().await
    }

    /// The namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// The shared multiplexed connection (clone it to run your own commands on it).
    pub fn connection(&self) -> &RedisConnection {
        &self.conn
    }

    /// Whether fresh claims take the script-free `SET … NX GET` path.
    pub fn fast_claim(&self) -> bool {
        self.clock.is_some()
    }

    /// The Redis key of a dedup key's record.
    pub fn record_key(&self, key: &DedupKey) -> String {
        format!("{}{}", self.ns.key_prefix(), key.hash())
    }

    /// The store's clock: Redis `TIME` (plus a test offset, if any).
    ///
    /// # Errors
    /// Backend errors.
    pub async fn now(&self) -> Result<Timestamp, StoreError> {
        Ok(Timestamp::from_micros(self.server_time(self.offset_us()).await?))
    }

    /// `TIME` (µs) plus `offset`, from the node holding the namespace (the key only routes).
    async fn server_time(&self, offset: i64) -> Result<i64, StoreError> {
        self.scripts
            .now
            .key(self.ns.key_prefix())
            .arg(offset)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend("now", e))
    }

    /// Reads the server clock for the fast claim path (without the test offset: it is added
    /// when the estimate is used, so moving it takes effect at once).
    async fn anchor_clock(&self) -> Result<Option<clock::Estimate>, StoreError> {
        let Some(clock) = &self.clock else { return Ok(None) };
        let sent = Instant::now();
        let server = self.server_time(0).await?;
        clock.anchor(server, sent, Instant::now());
        Ok(clock.estimate())
    }

    /// The server clock estimate (test offset included) for a fast claim, re-anchored when
    /// old; `None` when claims go to the script.
    async fn estimate(&self) -> Result<Option<clock::Estimate>, StoreError> {
        let Some(clock) = &self.clock else { return Ok(None) };
        let est = match clock.estimate() {
            Some(e) => Some(e),
            None if clock.should_refresh() => self.anchor_clock().await?,
            None => match clock.estimate_within(2 * clock::REFRESH) {
                Some(e) => Some(e),
                None => self.anchor_clock().await?,
            },
        };
        Ok(est.map(|e| clock::Estimate { now_us: e.now_us + self.offset_us(), ..e }))
    }

    fn offset_us(&self) -> i64 {
        self.offset.as_ref().map_or(0, ClockOffset::micros)
    }

    /// With [`RedisStoreBuilder::wait_for_replicas`]: waits for a `WAIT` sent after this
    /// caller's write (one `WAIT` covers every earlier write on the connection, so concurrent
    /// callers share one: see [`coalesce::replicated`]).
    async fn replicated(&self, op: &'static str) -> Result<(), StoreError> {
        if self.replication.is_none() {
            return Ok(());
        }
        coalesce::replicated(self, op).await
    }

    /// One `WAIT` on the namespace's master: an error when fewer replicas acknowledged.
    pub(crate) async fn wait_once(&self, op: &'static str) -> Result<(), StoreError> {
        let Some(r) = self.replication else { return Ok(()) };
        let ms = u64::try_from(r.timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let v = self
            .conn
            .on_slot_master(
                self.ns.key_prefix(),
                redis::cmd("WAIT").arg(r.replicas).arg(ms).clone(),
            )
            .await
            .map_err(|e| backend(op, e))?;
        let acked = decode::int_reply(&v, "WAIT reply")?;
        if acked < i64::from(r.replicas) {
            return Err(StoreError::backend(
                op,
                true,
                format!(
                    "Redis acknowledged the write on {acked} of the {} replicas asked for within \
                     {:?} (WAIT): it may be lost if the master fails now",
                    r.replicas, r.timeout
                ),
            ));
        }
        Ok(())
    }

    /// One claim through the script.
    async fn claim_script(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let v: Value = self
            .scripts
            .claim
            .key(self.record_key(&req.key))
            .arg(req.key.scope())
            .arg(req.key.id())
            .arg(req.fingerprint.as_ref().map_or(&[][..], |f| &f.0[..]))
            .arg(duration_micros(req.lease_for))
            .arg(duration_micros(req.retain_for))
            .arg(self.offset_us())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend("claim", e))?;
        decode::claim(&v, req)
    }

    /// Claims through the batch script, in order.
    async fn claim_many_script(&self, reqs: &[&ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        let mut inv = self.scripts.claim_many.prepare_invoke();
        inv.arg(self.offset_us());
        for r in reqs {
            inv.key(self.record_key(&r.key))
                .arg(r.key.scope())
                .arg(r.key.id())
                .arg(r.fingerprint.as_ref().map_or(&[][..], |f| &f.0[..]))
                .arg(duration_micros(r.lease_for))
                .arg(duration_micros(r.retain_for));
        }
        let v: Value =
            inv.invoke_async(&mut self.conn.clone()).await.map_err(|e| backend("claim_many", e))?;
        decode::claims(&v, reqs)
    }

    /// The fast claim's `SET`, for a pipeline or alone.
    fn fresh_set(&self, req: &ClaimRequest, fresh: &fast::Fresh) -> redis::Cmd {
        let mut c = redis::cmd("SET");
        c.arg(self.record_key(&req.key))
            .arg(fresh.pack(req))
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(fresh.ttl_ms);
        c
    }

    /// What a fast `SET … NX GET` reply decides: `Some` answer, or `None` for the script.
    fn fast_answer(
        req: &ClaimRequest,
        fresh: &fast::Fresh,
        est: clock::Estimate,
        reply: &Value,
    ) -> Result<Option<Claim>, StoreError> {
        Ok(match decode::record(reply, req.key.hash())? {
            None => Some(Claim::Acquired(fresh.lease(req))),
            Some(rec) => fast::decide(rec, req, est),
        })
    }

    /// Sends a batch of completions as one script (no coalescing), then `WAIT`s if asked.
    pub(crate) async fn complete_now(
        &self,
        items: &[Completion],
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut out: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(items.len());
        let mut inv = self.scripts.complete_many.prepare_invoke();
        // With the fast path's clock estimate the script skips `TIME` (one call fewer).
        let now = self.clock.as_ref().and_then(|c| c.estimate());
        inv.arg(self.offset_us())
            .arg(now.map_or(String::new(), |e| (e.now_us + self.offset_us()).to_string()));
        let mut sent = Vec::new();
        for (i, c) in items.iter().enumerate() {
            let result = c.result.as_deref();
            if let Err(e) =
                StoreError::check_len("result", result.map_or(0, <[u8]>::len), MAX_RESULT_BYTES)
            {
                out.push(Some(Err(e)));
                continue;
            }
            out.push(None);
            sent.push(i);
            inv.key(self.record_key(c.lease.key()))
                .arg(c.lease.token())
                .arg(if result.is_some() { "1" } else { "0" })
                .arg(result.unwrap_or_default())
                .arg(duration_micros(c.retain_for));
        }
        if !sent.is_empty() {
            let done: Vec<i64> = inv
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(|e| backend("complete", e))?;
            if done.len() != sent.len() {
                return Err(StoreError::Corrupt {
                    what: format!("complete_many answered {} of {}", done.len(), sent.len()),
                });
            }
            self.replicated("complete").await?;
            for (i, ok) in sent.into_iter().zip(done) {
                out[i] = Some(fenced(ok == 1, &items[i].lease));
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    async fn finish(
        &self,
        op: &'static str,
        lease: &Lease,
        state: i16,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        let field = if op == "fail" { "reason" } else { "result" };
        StoreError::check_len(field, result.map_or(0, <[u8]>::len), MAX_RESULT_BYTES)?;
        let ok: i64 = self
            .scripts
            .finish
            .key(self.record_key(lease.key()))
            .arg(lease.token())
            .arg(state)
            .arg(if result.is_some() { "1" } else { "0" })
            .arg(result.unwrap_or_default())
            .arg(duration_micros(retain_for))
            .arg(self.offset_us())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend(op, e))?;
        fenced(ok == 1, lease)?;
        self.replicated(op).await
    }
}

fn fenced(ok: bool, lease: &Lease) -> Result<(), StoreError> {
    if ok { Ok(()) } else { Err(StoreError::LeaseLost { key: lease.key().to_string() }) }
}

/// Wraps a client error; connection problems and timeouts are retryable.
pub(crate) fn backend(op: &'static str, e: redis::RedisError) -> StoreError {
    let retryable =
        e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal();
    StoreError::backend(op, retryable, e)
}

impl DedupStore for RedisStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        if let Some(est) = self.estimate().await? {
            let fresh = fast::Fresh::new(req, est.now_us);
            let reply: Value = self
                .fresh_set(req, &fresh)
                .query_async(&mut self.conn.clone())
                .await
                .map_err(|e| backend("claim", e))?;
            if let Some(answer) = Self::fast_answer(req, &fresh, est, &reply)? {
                if matches!(answer, Claim::Acquired(_)) {
                    self.replicated("claim").await?;
                }
                return Ok(answer);
            }
        }
        let answer = self.claim_script(req).await?;
        if matches!(answer, Claim::Acquired(_)) {
            self.replicated("claim").await?;
        }
        Ok(answer)
    }

    /// One pipeline of fast `SET`s (one round trip), then one script for the keys they left
    /// open; without the fast path, one script for the batch. A key repeated in the batch sees
    /// its earlier occurrence's claim either way.
    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let mut answers: Vec<Option<Claim>> = Vec::with_capacity(reqs.len());
        if let Some(est) = self.estimate().await? {
            let fresh: Vec<fast::Fresh> =
                reqs.iter().map(|r| fast::Fresh::new(r, est.now_us)).collect();
            let mut pipe = redis::pipe();
            for (r, f) in reqs.iter().zip(&fresh) {
                pipe.add_command(self.fresh_set(r, f));
            }
            let replies: Vec<Value> = pipe
                .query_async(&mut self.conn.clone())
                .await
                .map_err(|e| backend("claim_many", e))?;
            if replies.len() != reqs.len() {
                return Err(StoreError::Corrupt {
                    what: format!("{} answers to {} claims", replies.len(), reqs.len()),
                });
            }
            for ((r, f), v) in reqs.iter().zip(&fresh).zip(&replies) {
                answers.push(Self::fast_answer(r, f, est, v)?);
            }
        } else {
            answers.resize_with(reqs.len(), || None);
        }
        let open: Vec<&ClaimRequest> =
            reqs.iter().zip(&answers).filter(|(_, a)| a.is_none()).map(|(r, _)| r).collect();
        if !open.is_empty() {
            let mut decided = self.claim_many_script(&open).await?.into_iter();
            for a in answers.iter_mut().filter(|a| a.is_none()) {
                *a = decided.next();
            }
        }
        if answers.iter().any(|a| matches!(a, Some(Claim::Acquired(_)))) {
            self.replicated("claim_many").await?;
        }
        answers
            .into_iter()
            .map(|a| {
                a.ok_or_else(|| StoreError::Corrupt { what: "claim without an answer".into() })
            })
            .collect()
    }

    /// One script (or, with [`RedisStoreBuilder::coalesce_completions`], coalesced with the
    /// completions queued behind those in flight).
    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        StoreError::check_len("result", result.map_or(0, <[u8]>::len), MAX_RESULT_BYTES)?;
        let item = Completion { lease, result: result.map(<[u8]>::to_vec), retain_for };
        if self.coalesce {
            return coalesce::complete(self, item).await;
        }
        let mut answers = self.complete_now(std::slice::from_ref(&item)).await?;
        answers.pop().unwrap_or_else(|| {
            Err(StoreError::Corrupt { what: "a completion without an answer".into() })
        })
    }

    /// One script for the batch: one round trip, one atomic step.
    async fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        self.complete_now(&items).await
    }

    async fn fail(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.finish("fail", &lease, kind.state().code(), Some(reason.as_bytes()), retain_for).await
    }

    async fn release(&self, lease: Lease) -> Result<(), StoreError> {
        let ok: i64 = self
            .scripts
            .release
            .key(self.record_key(lease.key()))
            .arg(lease.token())
            .arg(self.offset_us())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend("release", e))?;
        fenced(ok == 1, &lease)?;
        self.replicated("release").await
    }

    async fn extend(&self, lease: &mut Lease, by: Duration) -> Result<(), StoreError> {
        let until: i64 = self
            .scripts
            .extend
            .key(self.record_key(lease.key()))
            .arg(lease.token())
            .arg(duration_micros(by))
            .arg(self.offset_us())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend("extend", e))?;
        fenced(until >= 0, lease)?;
        lease.set_until(Timestamp::from_micros(until));
        self.replicated("extend").await
    }

    /// Returns 0 at once: each record carries a native TTL at its expiry, so Redis deletes it
    /// itself. (A store with a test [`ClockOffset`] deletes, with a bounded scan, the records
    /// its shifted clock made expire before their TTL.)
    async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        if self.offset.is_none() {
            tracing::debug!(target: "idem", "purge: nothing to do, Redis expires records by TTL");
            return Ok(0);
        }
        self.purge_shifted(limit).await
    }
}
