//! `RedisStore`: the dedup contract on Redis, one Lua script per operation.

mod check;
mod codec;
mod decode;
mod inspect;
mod scripts;

use std::sync::Arc;
use std::time::Duration;

use idem_core::time::duration_micros;
use idem_core::{
    Claim, ClaimRequest, Completion, DedupKey, DedupStore, FailKind, Lease, StoreError, Timestamp,
};
use redis::aio::ConnectionManager;
use redis::{Client, Script, Value};

pub use check::ServerSettings;

use crate::{Error, Namespace};

/// Largest stored result or reason, in bytes.
pub const MAX_RESULT_BYTES: usize = 1 << 20;

/// A dedup store on Redis (standalone, or a cluster node through one hash-tagged namespace).
///
/// - **Atomic per key.** Claim, complete, fail, release and extend are each one Lua script: the
///   read-decide-write runs on the server with nothing in between. `claim_many` is one script
///   over the whole batch: one round trip, applied as one step.
/// - **Fenced.** The record keeps its fencing token and attempt; the finishing scripts compare
///   the token and change nothing when it moved on.
/// - **Whose clock.** Every script reads Redis' own `TIME`; consumer clocks are never compared.
/// - **Retention is the key's native TTL**: each write sets `PEXPIRE` to the record's expiry, so
///   Redis deletes records itself and [`DedupStore::purge`] has nothing to do (it returns 0).
/// - **Pipelining.** The store holds one multiplexed [`ConnectionManager`] (reconnecting);
///   clones share it, so concurrent claims from many tasks travel pipelined on one socket.
///
/// [`RedisStore::connect`] refuses a server whose `maxmemory-policy` can evict records and warns
/// when persistence is off (see [`RedisStoreBuilder::allow_eviction`]).
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
    conn: ConnectionManager,
    ns: Namespace,
    scripts: Arc<Scripts>,
    offset: Option<ClockOffset>,
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
    client: Client,
    ns: Namespace,
    allow_eviction: bool,
    response_timeout: Duration,
    offset: Option<ClockOffset>,
}

impl std::fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("namespace", &self.ns)
            .field("allow_eviction", &self.allow_eviction)
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

    /// Adds a test-controlled offset to the server's clock. For tests only: see [`ClockOffset`].
    #[doc(hidden)]
    pub fn clock_offset(mut self, offset: ClockOffset) -> Self {
        self.offset = Some(offset);
        self
    }

    /// Connects and checks the server's settings: refuses an evicting `maxmemory-policy`
    /// (unless [`allow_eviction`](Self::allow_eviction)), logs a warning when neither RDB
    /// snapshots nor the AOF are on (a restart then forgets every record).
    ///
    /// # Errors
    /// [`Error::Redis`] when the server cannot be reached; [`Error::EvictingPolicy`].
    pub async fn connect(self) -> Result<RedisStore, Error> {
        let cfg = redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.response_timeout))
            .set_number_of_retries(3);
        let mut conn = self
            .client
            .get_connection_manager_with_config(cfg)
            .await
            .map_err(Error::redis("connect"))?;
        let settings = ServerSettings::read(&mut conn).await?;
        settings.enforce(self.allow_eviction)?;
        Ok(RedisStore { conn, ns: self.ns, scripts: Arc::new(Scripts::new()), offset: self.offset })
    }
}

impl RedisStore {
    /// A builder for the server at `url` (`redis://host:port/db`).
    ///
    /// # Errors
    /// [`Error::Redis`] when the URL does not parse.
    pub fn builder(url: &str) -> Result<RedisStoreBuilder, Error> {
        Ok(Self::builder_for(Client::open(url).map_err(Error::redis("open"))?))
    }

    /// A builder over an existing client.
    pub fn builder_for(client: Client) -> RedisStoreBuilder {
        RedisStoreBuilder {
            client,
            ns: Namespace::default(),
            allow_eviction: false,
            response_timeout: Duration::from_secs(5),
            offset: None,
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
    pub fn connection(&self) -> &ConnectionManager {
        &self.conn
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
        let v: i64 = self
            .scripts
            .now
            .arg(self.offset_us())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend("now", e))?;
        Ok(Timestamp::from_micros(v))
    }

    fn offset_us(&self) -> i64 {
        self.offset.as_ref().map_or(0, ClockOffset::micros)
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
        fenced(ok == 1, lease)
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

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
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

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.finish(
            "complete",
            &lease,
            idem_core::RecordState::Completed.code(),
            result,
            retain_for,
        )
        .await
    }

    /// One script for the batch: one round trip, one atomic step.
    async fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut out: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(items.len());
        let mut inv = self.scripts.complete_many.prepare_invoke();
        inv.arg(self.offset_us());
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
                .map_err(|e| backend("complete_many", e))?;
            if done.len() != sent.len() {
                return Err(StoreError::Corrupt {
                    what: format!("complete_many answered {} of {}", done.len(), sent.len()),
                });
            }
            for (i, ok) in sent.into_iter().zip(done) {
                out[i] = Some(fenced(ok == 1, &items[i].lease));
            }
        }
        Ok(out.into_iter().flatten().collect())
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
        fenced(ok == 1, &lease)
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
        Ok(())
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
