//! The consumer engine: claim, run the handler, record the outcome.

mod backend;
mod builder;
mod complete;
mod context;
mod outcome;

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

pub use backend::Backend;
pub use builder::{ConfigError, ConsumerBuilder, ExpiredLeasePolicy, MissingKeyPolicy};
pub use context::Context;
pub use outcome::{
    Cause, Conflict, Disposition, Failure, FailureKind, HandlerError, Outcome, OutcomeKind,
};

use crate::extract::{Envelope, ExtractError};
use crate::telemetry::{
    self, CLAIM_DURATION_SECONDS, COMPLETE_DURATION_SECONDS, MISSING_KEY_TOTAL, OUTCOMES_TOTAL,
    TAKEOVERS_TOTAL,
};
use crate::{
    Claim, ClaimRequest, DedupKey, DedupStore, FailKind, KeyError, Lease, RecordState, StoreError,
};
use builder::Config;
use complete::completed;

type BoxFuture<'a, T> = std::pin::Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Makes a handler idempotent over a [`DedupStore`] (two-phase) or a transactional inbox.
///
/// For each delivery: extract the key, fingerprint the payload, claim `(scope, key)` in the
/// store, then run the handler only if the claim was acquired, and record its completion before
/// returning. The returned [`Outcome`] says what to tell the broker
/// ([`Outcome::disposition`]); ack only after `process` returns.
///
/// Over a transactional inbox (`Consumer::builder(store.inbox(retain))`) the engine marks keys
/// inside one database transaction with the handler's own writes; broker adapters drive it
/// through [`Consumer::decide_batch`].
///
/// ```
/// use idem_core::{Consumer, MemoryStore, Outcome, extract::Message, consumer::HandlerError};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let consumer = Consumer::builder(MemoryStore::new()).scope("billing").build()?;
/// let msg = Message::new(br#"{"order":"o-1","cents":1200}"#.to_vec()).with_message_id("o-1");
///
/// let charge = |ctx: idem_core::consumer::Context| async move {
///     // Pass ctx.downstream_key() to the payment API as its idempotency key.
///     Ok::<_, HandlerError<std::io::Error>>(format!("charged at attempt {}", ctx.attempt()))
/// };
/// assert!(matches!(consumer.process(&msg, charge).await, Outcome::Processed(_)));
/// // The redelivery is a duplicate and gets the stored result back.
/// match consumer.process(&msg, charge).await {
///     Outcome::Duplicate(Some(r)) => assert_eq!(r, "charged at attempt 1"),
///     other => panic!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
pub struct Consumer<B> {
    store: B,
    cfg: Arc<Config>,
}

impl<B: Clone> Clone for Consumer<B> {
    fn clone(&self) -> Self {
        Self { store: self.store.clone(), cfg: Arc::clone(&self.cfg) }
    }
}

impl<B> std::fmt::Debug for Consumer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("scope", &self.cfg.scope)
            .field("lease", &self.cfg.lease)
            .field("retain", &self.cfg.retain)
            .finish_non_exhaustive()
    }
}

/// A delivery made ready for its claim: the request, or an outcome decided without the store.
#[derive(Debug)]
#[non_exhaustive]
pub enum Prepared<T, E> {
    /// Claim (or mark) this key with this fingerprint.
    Claim(ClaimRequest),
    /// The message has no key and the policy processes such messages without dedup.
    Unkeyed,
    /// Decided already: no usable key, or a payload the fingerprint cannot read.
    Done(Outcome<T, E>),
}

/// What became of an acquired claim's handler: its outcome, or a completion still to record.
enum Ran<T, E> {
    Done(Outcome<T, E>),
    Complete { lease: Lease, value: T, stored: Option<Vec<u8>> },
}

/// One delivery being decided: its span (closed with the outcome) and what it knows so far.
struct Decision<T, E> {
    span: tracing::Span,
    attempt: u32,
    ran: Ran<T, E>,
}

impl<B> Consumer<B> {
    /// Starts a builder over `store`: a [`DedupStore`] (two-phase) or a transactional inbox.
    pub fn builder(store: B) -> ConsumerBuilder<B> {
        ConsumerBuilder::new(store)
    }

    /// The store (or inbox).
    pub fn store(&self) -> &B {
        &self.store
    }

    /// The consumer's scope.
    pub fn scope(&self) -> &str {
        &self.cfg.scope
    }

    /// How long a claim holds a key.
    pub fn lease(&self) -> Duration {
        self.cfg.lease
    }

    /// How long completed records are kept (adapters check it against their broker's
    /// redelivery window at startup). An inbox keeps its markers for its own retention.
    pub fn retain(&self) -> Duration {
        self.cfg.retain
    }

    /// The lease heartbeat interval, if one is set. Broker adapters extend the broker's own ack
    /// deadline on the same beat.
    pub fn heartbeat(&self) -> Option<Duration> {
        self.cfg.heartbeat
    }

    /// The fingerprint this consumer would record for `msg`.
    ///
    /// # Errors
    /// The parse error when the fingerprint spec needs JSON and the payload is not JSON.
    pub fn fingerprint_of<M: Envelope>(
        &self,
        msg: &M,
    ) -> Result<Option<crate::Fingerprint>, serde_json::Error> {
        self.cfg.fingerprint.fingerprint(msg.payload())
    }

    /// The key this consumer would use for `msg`.
    ///
    /// # Errors
    /// [`KeyFailure`]: what would fail the delivery (missing or invalid key).
    pub fn key_of<M: Envelope>(&self, msg: &M) -> Result<DedupKey, KeyFailure> {
        let id = self.cfg.extractor.extract(msg as &dyn Envelope).map_err(|e| {
            if e.is_missing() { KeyFailure::Missing(e) } else { KeyFailure::Extract(e) }
        })?;
        DedupKey::with_limit(self.cfg.scope.clone(), id, self.cfg.max_key_bytes)
            .map_err(KeyFailure::Invalid)
    }

    /// The key and fingerprint of `msg` as a claim request, or the outcome that needs no store
    /// (a missing key under [`MissingKeyPolicy::Reject`], an invalid key, a payload that is not
    /// JSON when the fingerprint needs JSON). For backends and adapters; [`Consumer::process`]
    /// calls it itself.
    pub fn prepare<M: Envelope, T, E>(&self, msg: &M) -> Prepared<T, E> {
        let key = match self.key_of(msg) {
            Ok(k) => k,
            Err(KeyFailure::Missing(_))
                if self.cfg.missing_key == MissingKeyPolicy::ProcessWithoutDedup =>
            {
                return Prepared::Unkeyed;
            }
            Err(e) => return Prepared::Done(Outcome::failed(FailureKind::Permanent, e.into())),
        };
        match self.cfg.fingerprint.fingerprint(msg.payload()) {
            Ok(fp) => Prepared::Claim(ClaimRequest::new(key, fp, self.cfg.lease, self.cfg.retain)),
            Err(e) => Prepared::Done(Outcome::failed(FailureKind::Permanent, Cause::Payload(e))),
        }
    }

    /// The handler result as it is stored for duplicates: its JSON, or `None` (with a warning)
    /// when it does not serialize or is larger than the consumer's `max_result_bytes`, the one
    /// result limit of both modes.
    pub fn encode_result<T: Serialize>(&self, key: &DedupKey, value: &T) -> Option<Vec<u8>> {
        match serde_json::to_vec(value) {
            Ok(b) if b.len() <= self.cfg.max_result_bytes => Some(b),
            Ok(b) => {
                tracing::warn!(target: "idem", %key, len = b.len(),
                    limit = self.cfg.max_result_bytes,
                    "handler result larger than max_result_bytes; duplicates will carry no result");
                None
            }
            Err(e) => {
                tracing::warn!(target: "idem", %key, error = %e,
                    "handler result does not serialize; duplicates will carry no result");
                None
            }
        }
    }

    /// Records how long a claim (or a batch of marks) took, in `idem_claim_duration_seconds`.
    pub fn observe_claim(&self, started: Instant) {
        telemetry::observe_duration(CLAIM_DURATION_SECONDS, &self.cfg.scope, started);
    }

    /// Records how long a completion (or an inbox batch's commit) took, in
    /// `idem_complete_duration_seconds`.
    pub fn observe_complete(&self, started: Instant) {
        telemetry::observe_duration(COMPLETE_DURATION_SECONDS, &self.cfg.scope, started);
    }

    /// Counts a failed store call in `idem_store_errors_total{scope, op, retryable}`; `op`
    /// names the call (`claim`, `complete_many`, `commit`, …). For backends; the engine's own
    /// calls are counted already.
    pub fn observe_store_error(&self, op: &'static str, e: &StoreError) {
        telemetry::store_error(&self.cfg.scope, op, e);
    }

    /// Emits a finished delivery's `tracing` event and its `idem_outcomes_total` count: what
    /// every path of the engine does once an outcome is decided (backends call it too).
    pub fn observe<T, E: Display>(
        &self,
        key: Option<&DedupKey>,
        correlation: Option<&str>,
        outcome: &Outcome<T, E>,
        attempt: u32,
    ) {
        let label = outcome.kind().as_str();
        metrics::counter!(OUTCOMES_TOTAL, "scope" => self.cfg.scope.clone(), "outcome" => label)
            .increment(1);
        let scope = self.cfg.scope.as_str();
        let key = key.map_or("", DedupKey::id);
        let correlation_id = correlation.unwrap_or("");
        match outcome {
            Outcome::Conflict(c) => tracing::warn!(target: "idem", scope, key, correlation_id,
                outcome = label, attempt, detail = %c, "delivery finished"),
            Outcome::Failed(f) => tracing::warn!(target: "idem", scope, key, correlation_id,
                outcome = label, attempt, detail = %f.cause, "delivery finished"),
            _ => tracing::debug!(target: "idem", scope, key, correlation_id, outcome = label,
                attempt, "delivery finished"),
        }
    }

    /// Runs a handler for a message without a key (the missing-key policy processes such
    /// messages without dedup) and counts it in `idem_missing_key_total`.
    pub async fn run_unkeyed<C, T, E, F, Fut>(
        &self,
        ctx: C,
        handler: F,
        correlation: Option<&str>,
    ) -> Outcome<T, E>
    where
        E: Display,
        F: FnOnce(C) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        metrics::counter!(MISSING_KEY_TOTAL, "scope" => self.cfg.scope.clone()).increment(1);
        let outcome = match handler(ctx).await {
            Ok(v) => Outcome::Processed(v),
            Err(e) => Outcome::from_handler_error(e),
        };
        self.observe(None, correlation, &outcome, 1);
        outcome
    }
}

impl<B: Backend> Consumer<B> {
    /// Decides a batch of owned messages with whatever this consumer's store is: claims, runs
    /// and records in two-phase mode, one transaction in inbox mode. What broker adapters call;
    /// outcomes are in message order, and every effect they acknowledge is durable.
    pub async fn decide_batch<M, H, Fut, T, E>(
        &self,
        batch: &[M],
        handler: &H,
    ) -> Vec<Outcome<T, E>>
    where
        M: Envelope + Clone + Send + Sync + 'static,
        H: Fn(B::Ctx, M) -> Fut + Sync,
        Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
        T: Serialize + DeserializeOwned + Send,
        E: Display + Send,
    {
        // Boxed as `dyn Future + Send`: the Send proof is made here, with the lifetimes known.
        // Left to the caller, rustc must prove it for every lifetime of the backend's future
        // and fails ("implementation of `Send` is not general enough") for a spawned run.
        let fut: BoxFuture<'_, Vec<Outcome<T, E>>> = Box::pin(B::decide(self, batch, handler));
        fut.await
    }
}

impl<S: DedupStore> Consumer<S> {
    /// Processes one delivery. Every call ends in exactly one [`Outcome`]; store failures are
    /// [`Outcome::Failed`] with [`Cause::Store`], never a panic or a silent ack.
    ///
    /// The handler runs at most once per call, and only while this call holds the key's lease.
    pub async fn process<M, T, E, F, Fut>(&self, msg: &M, handler: F) -> Outcome<T, E>
    where
        M: Envelope,
        T: Serialize + DeserializeOwned,
        E: Display,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let correlation = msg.correlation_id();
        let req = match self.prepare(msg) {
            Prepared::Claim(req) => req,
            Prepared::Unkeyed => {
                return self.run_unkeyed(Context::unkeyed(), handler, correlation).await;
            }
            Prepared::Done(outcome) => {
                self.observe(None, correlation, &outcome, 0);
                return outcome;
            }
        };
        let started = Instant::now();
        let claim = self.store.claim(&req).await;
        self.observe_claim(started);
        if let Err(e) = &claim {
            self.observe_store_error("claim", e);
        }
        let Decision { span, attempt, ran } = self.decide(claim, &req, handler, correlation).await;
        let outcome = match ran {
            Ran::Done(o) => o,
            Ran::Complete { lease, value, stored } => {
                let done = self.complete_retrying(lease, stored.as_deref()).await;
                completed(value, done)
            }
        };
        self.finish(span, attempt, outcome, &req.key, correlation)
    }

    /// Processes deliveries fetched together: one `claim_many` round trip for the batch, the
    /// acquired handlers concurrently, then one `complete_many` for their completions (one
    /// commit on the SQL stores: group commit). A key repeated inside the batch runs once; its
    /// later copies become duplicates once the first completes. Outcomes are in message order.
    pub async fn process_batch<'m, M, T, E, F, Fut>(
        &self,
        msgs: &'m [M],
        handler: F,
    ) -> Vec<Outcome<T, E>>
    where
        M: Envelope,
        T: Serialize + DeserializeOwned,
        E: Display,
        F: Fn(Context, &'m M) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let mut outcomes: Vec<Option<Outcome<T, E>>> = msgs.iter().map(|_| None).collect();
        let mut pending: Vec<(usize, ClaimRequest)> = Vec::new();
        let mut unkeyed = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            match self.prepare(m) {
                Prepared::Claim(req) => pending.push((i, req)),
                Prepared::Unkeyed => unkeyed.push(i),
                Prepared::Done(o) => {
                    self.observe(None, m.correlation_id(), &o, 0);
                    outcomes[i] = Some(o);
                }
            }
        }
        let handler = &handler;
        let unkeyed_runs = unkeyed.iter().map(|&i| {
            let m = &msgs[i];
            async move {
                let o =
                    self.run_unkeyed(Context::unkeyed(), |ctx| handler(ctx, m), m.correlation_id());
                (i, o.await)
            }
        });
        for (i, o) in futures_util::future::join_all(unkeyed_runs).await {
            outcomes[i] = Some(o);
        }

        while !pending.is_empty() {
            let claims = self.claim_all(&pending).await;
            let mut acquired_here = std::collections::HashSet::new();
            let mut deferred = Vec::new();
            let mut runs = Vec::new();
            for ((i, req), claim) in pending.drain(..).zip(claims) {
                let hash = req.key.hash();
                match claim {
                    Ok(Claim::Acquired(_)) => {
                        acquired_here.insert(hash);
                    }
                    Ok(Claim::InProgress { .. }) if acquired_here.contains(&hash) => {
                        // The same key earlier in this batch holds the lease: decide this copy
                        // after that one's completion is recorded.
                        deferred.push((i, req));
                        continue;
                    }
                    _ => {}
                }
                let m = &msgs[i];
                runs.push(async move {
                    let d =
                        self.decide(claim, &req, |ctx| handler(ctx, m), m.correlation_id()).await;
                    (i, req, d)
                });
            }
            let decided = futures_util::future::join_all(runs).await;
            for (i, _, o) in self.complete_all(decided, msgs).await {
                outcomes[i] = Some(o);
            }
            pending = deferred;
        }
        // Every index was decided above: prepared, run, or deferred until nothing is deferred.
        outcomes
            .into_iter()
            .map(|o| o.expect("every message of the batch has an outcome"))
            .collect()
    }

    /// The claims of a batch: one `claim_many`, or one claim each when the batch call fails
    /// (each message then gets its own answer, or its own error).
    async fn claim_all(&self, pending: &[(usize, ClaimRequest)]) -> Vec<Result<Claim, StoreError>> {
        let reqs: Vec<ClaimRequest> = pending.iter().map(|(_, r)| r.clone()).collect();
        let started = Instant::now();
        let batch = self.store.claim_many(&reqs).await;
        self.observe_claim(started);
        match batch {
            Ok(c) if c.len() == reqs.len() => return c.into_iter().map(Ok).collect(),
            Ok(c) => {
                tracing::error!(target: "idem", asked = reqs.len(), got = c.len(),
                    "store answered a batch with the wrong number of claims; claiming one by one");
            }
            Err(e) => {
                self.observe_store_error("claim_many", &e);
                tracing::warn!(target: "idem", error = %e, "batch claim failed; claiming one by one");
            }
        }
        let claims = futures_util::future::join_all(reqs.iter().map(|r| self.store.claim(r))).await;
        for e in claims.iter().filter_map(|c| c.as_ref().err()) {
            self.observe_store_error("claim", e);
        }
        claims
    }

    /// Turns a claim into a decision: the outcome of a claim that was not acquired, or the
    /// handler's run under an acquired lease (its completion still to record).
    async fn decide<T, E, F, Fut>(
        &self,
        claim: Result<Claim, StoreError>,
        req: &ClaimRequest,
        handler: F,
        correlation: Option<&str>,
    ) -> Decision<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: Display,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let key = &req.key;
        let span = tracing::info_span!(
            target: "idem",
            "idem.delivery",
            scope = %key.scope(),
            key = %key.id(),
            correlation_id = correlation.unwrap_or(""),
            attempt = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let (ran, attempt) = async {
            let done = |o| Ran::Done(o);
            match claim {
                Err(e) => (done(Outcome::failed(FailureKind::Transient, Cause::Store(e))), 0),
                Ok(Claim::Completed(rec)) if rec.state == RecordState::InDoubt => (
                    done(Outcome::failed(
                        FailureKind::Permanent,
                        Cause::InDoubt { attempt: rec.attempt },
                    )),
                    rec.attempt,
                ),
                Ok(Claim::Completed(rec)) => {
                    let decoded = rec.result.as_deref().map(serde_json::from_slice).transpose();
                    let o = match decoded {
                        Ok(r) => Outcome::Duplicate(r),
                        Err(e) => Outcome::failed(FailureKind::Permanent, Cause::Decode(e)),
                    };
                    (done(o), rec.attempt)
                }
                Ok(Claim::Conflict(rec)) => (
                    done(Outcome::Conflict(Box::new(Conflict {
                        key: key.clone(),
                        stored: rec.fingerprint,
                        incoming: req.fingerprint,
                        stored_state: rec.state,
                    }))),
                    rec.attempt,
                ),
                Ok(Claim::InProgress { retry_after, attempt }) => {
                    (done(Outcome::InProgressElsewhere { retry_after }), attempt)
                }
                Ok(Claim::Acquired(lease)) => {
                    let attempt = lease.attempt();
                    (self.run(lease, handler).await, attempt)
                }
            }
        }
        .instrument(span.clone())
        .await;
        Decision { span, attempt, ran }
    }

    /// Closes a decided delivery: its span's fields, its event and metrics.
    fn finish<T, E: Display>(
        &self,
        span: tracing::Span,
        attempt: u32,
        outcome: Outcome<T, E>,
        key: &DedupKey,
        correlation: Option<&str>,
    ) -> Outcome<T, E> {
        span.record("attempt", attempt);
        span.record("outcome", outcome.kind().as_str());
        self.observe(Some(key), correlation, &outcome, attempt);
        outcome
    }

    async fn run<T, E, F, Fut>(&self, mut lease: Lease, handler: F) -> Ran<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: Display,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let cfg = &self.cfg;
        let attempt = lease.attempt();
        let park = cfg.expired_lease == ExpiredLeasePolicy::Park;
        if lease.took_over_expired() {
            let policy = if park { "park" } else { "run" };
            metrics::counter!(TAKEOVERS_TOTAL, "scope" => cfg.scope.clone(), "policy" => policy)
                .increment(1);
        }
        if lease.took_over_expired() && park {
            let reason = Cause::<String>::InDoubt { attempt }.to_string();
            if let Err(e) = self.store.fail(lease, FailKind::InDoubt, &reason, cfg.retain).await {
                self.observe_store_error("fail", &e);
                return Ran::Done(Outcome::failed(FailureKind::Transient, Cause::Store(e)));
            }
            return Ran::Done(Outcome::failed(FailureKind::Permanent, Cause::InDoubt { attempt }));
        }
        let ctx = Context {
            downstream_key: Some(lease.key().downstream_key()),
            key: Some(lease.key().clone()),
            attempt,
            token: lease.token(),
            took_over: lease.took_over_expired(),
        };
        let result = self.drive(&mut lease, handler(ctx)).await;
        match result {
            Ok(value) => {
                let stored = self.encode_result(lease.key(), &value);
                Ran::Complete { lease, value, stored }
            }
            Err(HandlerError::Transient(e)) => {
                let key = lease.key().to_string();
                if let Err(re) = self.store.release(lease).await {
                    self.observe_store_error("release", &re);
                    tracing::warn!(target: "idem", %key, error = %re,
                        "could not release the claim after a transient failure; it frees itself when the lease ends");
                }
                Ran::Done(Outcome::failed(FailureKind::Transient, Cause::Handler(e)))
            }
            Err(HandlerError::Permanent(e)) => {
                let key = lease.key().to_string();
                let mut reason = e.to_string();
                truncate_utf8(&mut reason, 4096);
                if let Err(fe) =
                    self.store.fail(lease, FailKind::Permanent, &reason, cfg.retain).await
                {
                    self.observe_store_error("fail", &fe);
                    tracing::warn!(target: "idem", %key, error = %fe,
                        "could not record the permanent failure; the key frees itself when the lease ends");
                }
                Ran::Done(Outcome::failed(FailureKind::Permanent, Cause::Handler(e)))
            }
        }
    }

    /// Runs the handler, extending the lease on every heartbeat tick when one is configured.
    ///
    /// The heartbeat runs beside the handler, never instead of it: awaiting `extend` while the
    /// handler is not polled would deadlock a handler that holds what `extend` needs (the one
    /// connection of a SQLite pool, say) until the pool's acquire timeout.
    async fn drive<Fut: Future>(&self, lease: &mut Lease, fut: Fut) -> Fut::Output {
        let Some(every) = self.cfg.heartbeat else { return fut.await };
        let beat = async {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                if let Err(e) = self.store.extend(lease, self.cfg.lease).await {
                    self.observe_store_error("extend", &e);
                    tracing::warn!(target: "idem", key = %lease.key(), error = %e, "lease heartbeat failed");
                }
            }
        };
        tokio::select! {
            biased;
            out = fut => out,
            _ = beat => unreachable!("the heartbeat loop never ends"),
        }
    }
}

/// Why a message yields no usable key.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyFailure {
    /// The message carries no key where the extractor looks.
    #[error(transparent)]
    Missing(ExtractError),
    /// The key is there but unreadable (wrong JSON type, not JSON).
    #[error(transparent)]
    Extract(ExtractError),
    /// The key is malformed (empty, too long, NUL).
    #[error("invalid dedup key: {0}")]
    Invalid(KeyError),
}

impl<E> From<KeyFailure> for Cause<E> {
    fn from(f: KeyFailure) -> Self {
        match f {
            KeyFailure::Missing(e) => Cause::MissingKey(e),
            KeyFailure::Extract(e) => Cause::Extract(e),
            KeyFailure::Invalid(e) => Cause::InvalidKey(e),
        }
    }
}

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}
