//! `RedisStore`: the dedup contract on Redis: a script-free fresh claim, and one Lua script
//! for every other read-decide-write.

mod builder;
mod check;
mod clock;
mod coalesce;
mod codec;
mod conn;
mod decode;
mod fast;
mod inspect;
mod replication;
mod scripts;

use std::sync::Arc;
use std::time::Duration;

use idem_core::time::duration_micros;
use idem_core::{
    Claim, ClaimRequest, CompleteAndClaim, Completion, DedupKey, DedupStore, FailKind, Lease,
    StoreError, Timestamp,
};
use redis::Value;

pub use builder::{ClockOffset, RedisStoreBuilder};
pub use check::ServerSettings;
pub(crate) use conn::Deployment;
pub use conn::RedisConnection;

use crate::Namespace;

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
///   `claim_many` is one script for the batch, which tries those `SET`s and decides the rest in
///   the same atomic step.
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
    scripts: Arc<scripts::Scripts>,
    offset: Option<ClockOffset>,
    /// `None` when claims always run the script (Redis < 7.0, or turned off).
    clock: Option<Arc<clock::ServerClock>>,
    replication: Option<replication::Replication>,
    coalesce: bool,
    completes: Arc<coalesce::Queue>,
    waits: Arc<coalesce::Waits>,
    /// What [`RedisStoreBuilder::allow_eviction`] said, for [`DedupStore::check`].
    allow_eviction: bool,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("namespace", &self.ns).finish_non_exhaustive()
    }
}

impl RedisStore {
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
            .arg(u8::from(req.takeover))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend("claim", e))?;
        decode::claim(&v, req)
    }

    /// Claims through the batch script, in order; with the fast claim's clock estimate, each
    /// key is first offered its fresh record (`SET … NX GET` inside the script).
    async fn claim_many_script(
        &self,
        reqs: &[ClaimRequest],
        est: Option<clock::Estimate>,
    ) -> Result<Vec<Claim>, StoreError> {
        let inv = self.claim_many_invocation(reqs, est);
        let v: Value =
            inv.invoke_async(&mut self.conn.clone()).await.map_err(|e| backend("claim_many", e))?;
        decode::claims(&v, reqs)
    }

    /// The batch claim script's invocation for `reqs`.
    fn claim_many_invocation(
        &self,
        reqs: &[ClaimRequest],
        est: Option<clock::Estimate>,
    ) -> redis::ScriptInvocation<'_> {
        let mut inv = self.scripts.claim_many.prepare_invoke();
        inv.arg(self.offset_us());
        for r in reqs {
            let fresh = est.map(|e| fast::Fresh::new(r, e.now_us));
            inv.key(self.record_key(&r.key))
                .arg(r.key.scope())
                .arg(r.key.id())
                .arg(r.fingerprint.as_ref().map_or(&[][..], |f| &f.0[..]))
                .arg(duration_micros(r.lease_for))
                .arg(duration_micros(r.retain_for))
                .arg(u8::from(r.takeover))
                .arg(fresh.as_ref().map_or_else(Vec::new, |f| f.pack(r)))
                .arg(fresh.map_or(0, |f| f.ttl_ms));
        }
        inv
    }

    /// The fast claim's `SET`.
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

    /// The answer to a fast `SET … NX GET`'s `reply`, or, when the record it found needs the
    /// read-decide-write, the claim script's.
    async fn fresh_or_script(
        &self,
        req: &ClaimRequest,
        fresh: &fast::Fresh,
        est: clock::Estimate,
        reply: &Value,
    ) -> Result<Claim, StoreError> {
        match Self::fast_answer(req, fresh, est, reply)? {
            Some(answer) => Ok(answer),
            None => self.claim_script(req).await,
        }
    }

    /// Sends a batch of completions as one script (no coalescing), then `WAIT`s if asked.
    pub(crate) async fn complete_now(
        &self,
        items: &[Completion],
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut batch = self.completion_script(items);
        if !batch.sent.is_empty() {
            let done: Vec<i64> = batch
                .inv
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(|e| backend("complete", e))?;
            self.replicated("complete").await?;
            batch.answer(items, done)?;
        }
        Ok(batch.answers())
    }

    /// The completion script's invocation for `items` (those too large answered already).
    fn completion_script(&self, items: &[Completion]) -> CompletionScript<'_> {
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
        CompletionScript { inv, out, sent }
    }

    /// Completes `items` and claims `reqs` in one pipeline (see
    /// [`DedupStore::complete_and_claim`]): the completion script, then the claims — one fresh
    /// `SET … NX GET` for a single request with the clock estimate, the batch claim script
    /// otherwise. A script the server lost (`NOSCRIPT`) and a fresh claim that needs the
    /// script are sent again on their own.
    async fn complete_and_claim_now(
        &self,
        items: &[Completion],
        reqs: &[ClaimRequest],
    ) -> CompleteAndClaim {
        let est = match self.estimate().await {
            Ok(est) => est,
            Err(e) => return (Err(e.copy_for("complete")), Err(e)),
        };
        let mut batch = self.completion_script(items);
        let fresh = match (reqs, est) {
            ([req], Some(est)) => Some((req, fast::Fresh::new(req, est.now_us), est)),
            _ => None,
        };
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        if !batch.sent.is_empty() {
            pipe.invoke_script(&batch.inv);
        }
        match &fresh {
            Some((req, f, _)) => pipe.add_command(self.fresh_set(req, f)),
            None => pipe.invoke_script(&self.claim_many_invocation(reqs, est)),
        };
        let mut replies: Vec<redis::RedisResult<Value>> =
            match pipe.query_async(&mut self.conn.clone()).await {
                Ok(r) => r,
                Err(e) => {
                    let e = backend("complete_and_claim", e);
                    return (Err(e.copy_for("complete")), Err(e.copy_for("claim_many")));
                }
            };
        let expected = 1 + usize::from(!batch.sent.is_empty());
        if replies.len() != expected {
            let e = StoreError::Corrupt {
                what: format!("a pipeline of {expected} answered {}", replies.len()),
            };
            return (Err(e.copy_for("complete")), Err(e));
        }
        let claimed = replies.pop();
        let done = match replies.pop() {
            None => Ok(batch.answers()),
            Some(Err(e)) if is_noscript(&e) => self.complete_now(items).await,
            Some(Err(e)) => Err(backend("complete", e)),
            Some(Ok(v)) => match redis::from_redis_value::<Vec<i64>>(v) {
                Ok(done) => batch.answer(items, done).map(|()| batch.answers()),
                Err(e) => Err(StoreError::Corrupt { what: format!("complete_many: {e}") }),
            },
        };
        let claims = match (claimed, fresh) {
            (Some(Ok(reply)), Some((req, f, est))) => {
                self.fresh_or_script(req, &f, est, &reply).await.map(|a| vec![a])
            }
            (Some(Ok(v)), None) => decode::claims(&v, reqs),
            (Some(Err(e)), _) if is_noscript(&e) => self.claim_many_script(reqs, est).await,
            (Some(Err(e)), _) => Err(backend("claim_many", e)),
            (None, _) => Err(StoreError::Corrupt { what: "a claim without an answer".into() }),
        };
        let acquired =
            claims.as_ref().is_ok_and(|c| c.iter().any(|a| matches!(a, Claim::Acquired(_))));
        let completed = done.as_ref().is_ok_and(|d| d.iter().any(Result::is_ok));
        if (acquired || completed)
            && let Err(e) = self.replicated("complete_and_claim").await
        {
            return (Err(e.copy_for("complete")), Err(e));
        }
        (done, claims)
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

/// The completion script for a batch, and its answers so far.
struct CompletionScript<'a> {
    inv: redis::ScriptInvocation<'a>,
    /// One per item: answered already (too large) or `None`, sent.
    out: Vec<Option<Result<(), StoreError>>>,
    /// The indices of the items in the script.
    sent: Vec<usize>,
}

impl CompletionScript<'_> {
    /// Takes the script's reply (1: completed, else the lease was lost) for the items sent.
    fn answer(&mut self, items: &[Completion], done: Vec<i64>) -> Result<(), StoreError> {
        if done.len() != self.sent.len() {
            return Err(StoreError::Corrupt {
                what: format!("complete_many answered {} of {}", done.len(), self.sent.len()),
            });
        }
        for (&i, ok) in self.sent.iter().zip(done) {
            self.out[i] = Some(fenced(ok == 1, &items[i].lease));
        }
        Ok(())
    }

    /// Every item's answer, in order.
    fn answers(self) -> Vec<Result<(), StoreError>> {
        self.out.into_iter().flatten().collect()
    }
}

/// Whether the server did not know a script (flushed, or restarted without it).
fn is_noscript(e: &redis::RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
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
    /// A round trip to the server (every master serving slots, on a cluster) reading its
    /// settings: an evicting `maxmemory-policy` (unless allowed) is an error, persistence off a
    /// warning. What `idem serve`'s `/readyz` asks.
    async fn check(&self) -> Result<Vec<String>, StoreError> {
        let settings = if self.conn.is_cluster() {
            check::read_masters(&self.conn).await
        } else {
            check::ServerSettings::read(&mut self.conn.clone())
                .await
                .map(|s| vec![(String::new(), s)])
        };
        let settings = settings.map_err(|e| StoreError::backend("check", true, e))?;
        let mut warnings = Vec::new();
        for (node, s) in settings {
            let on = if node.is_empty() { String::new() } else { format!(" on {node}") };
            if !s.is_noeviction() && !self.allow_eviction {
                let e = crate::Error::EvictingPolicy { policy: s.maxmemory_policy.clone() };
                return Err(StoreError::backend("check", false, e));
            }
            if s.is_persistent() == Some(false) {
                warnings
                    .push(format!("Redis persistence is off{on}: a restart forgets every record"));
            }
        }
        Ok(warnings)
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let answer = match self.estimate().await? {
            Some(est) => {
                let fresh = fast::Fresh::new(req, est.now_us);
                let reply: Value = self
                    .fresh_set(req, &fresh)
                    .query_async(&mut self.conn.clone())
                    .await
                    .map_err(|e| backend("claim", e))?;
                self.fresh_or_script(req, &fresh, est, &reply).await?
            }
            None => self.claim_script(req).await?,
        };
        if matches!(answer, Claim::Acquired(_)) {
            self.replicated("claim").await?;
        }
        Ok(answer)
    }

    /// One script: the batch is one atomic step (the fast claim's `SET … NX GET` inside it). A
    /// batch of one is a single [`claim`](DedupStore::claim): a plain `SET` when the key is fresh.
    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        if let [req] = reqs {
            return self.claim(req).await.map(|a| vec![a]);
        }
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let est = self.estimate().await?;
        let answers = self.claim_many_script(reqs, est).await?;
        if answers.iter().any(|a| matches!(a, Claim::Acquired(_))) {
            self.replicated("claim_many").await?;
        }
        Ok(answers)
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

    /// One pipeline: the completion script and the claims, one round trip.
    fn combines_writes(&self) -> bool {
        true
    }

    async fn complete_and_claim(
        &self,
        items: Vec<Completion>,
        reqs: &[ClaimRequest],
    ) -> CompleteAndClaim {
        if reqs.is_empty() {
            return (self.complete_many(items).await, Ok(Vec::new()));
        }
        self.complete_and_claim_now(&items, reqs).await
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
