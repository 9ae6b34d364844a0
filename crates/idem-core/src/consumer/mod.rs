//! The consumer engine: claim, run the handler, record the outcome.

mod builder;
mod context;
mod outcome;

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

pub use builder::{ConfigError, ConsumerBuilder, ExpiredLeasePolicy, MissingKeyPolicy};
pub use context::Context;
pub use outcome::{Cause, Conflict, Disposition, Failure, FailureKind, HandlerError, Outcome};

use crate::extract::{Envelope, ExtractError};
use crate::{Claim, ClaimRequest, DedupKey, DedupStore, FailKind, KeyError, Lease, RecordState};
use builder::Config;

/// Makes a handler idempotent over a [`DedupStore`].
///
/// For each delivery: extract the key, fingerprint the payload, claim `(scope, key)` in the
/// store, then run the handler only if the claim was acquired, and record its completion before
/// returning. The returned [`Outcome`] says what to tell the broker
/// ([`Outcome::disposition`]); ack only after `process` returns.
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
pub struct Consumer<S> {
    store: S,
    cfg: Arc<Config>,
}

impl<S: Clone> Clone for Consumer<S> {
    fn clone(&self) -> Self {
        Self { store: self.store.clone(), cfg: Arc::clone(&self.cfg) }
    }
}

impl<S> std::fmt::Debug for Consumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("scope", &self.cfg.scope)
            .field("lease", &self.cfg.lease)
            .field("retain", &self.cfg.retain)
            .finish_non_exhaustive()
    }
}

enum Prepared<T, E> {
    Claim(ClaimRequest),
    Unkeyed,
    Done(Outcome<T, E>),
}

impl<S: DedupStore> Consumer<S> {
    /// Starts a builder over `store`.
    pub fn builder(store: S) -> ConsumerBuilder<S> {
        ConsumerBuilder::new(store)
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The consumer's scope.
    pub fn scope(&self) -> &str {
        &self.cfg.scope
    }

    /// How long a claim holds a key.
    pub fn lease(&self) -> std::time::Duration {
        self.cfg.lease
    }

    /// How long completed records are kept (adapters check it against their broker's
    /// redelivery window at startup).
    pub fn retain(&self) -> std::time::Duration {
        self.cfg.retain
    }

    /// The fingerprint this consumer would record for `msg` (adapters whose writes go through
    /// a transactional inbox instead of [`Consumer::process`] need it).
    ///
    /// # Errors
    /// The parse error when the fingerprint spec needs JSON and the payload is not JSON.
    pub fn fingerprint_of<M: Envelope>(
        &self,
        msg: &M,
    ) -> Result<Option<crate::Fingerprint>, serde_json::Error> {
        self.cfg.fingerprint.fingerprint(msg.payload())
    }

    /// The lease heartbeat interval, if one is set. Broker adapters extend the broker's own ack
    /// deadline on the same beat.
    pub fn heartbeat(&self) -> Option<std::time::Duration> {
        self.cfg.heartbeat
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
        let correlation = msg.correlation_id().map(str::to_owned);
        let req = match self.prepare(msg) {
            Prepared::Claim(req) => req,
            Prepared::Unkeyed => return self.run_unkeyed(handler, correlation.as_deref()).await,
            Prepared::Done(outcome) => {
                self.observe(None, correlation.as_deref(), &outcome, 0);
                return outcome;
            }
        };
        let started = Instant::now();
        let claim = self.store.claim(&req).await;
        self.observe_claim(started);
        self.settle(claim, &req, handler, correlation.as_deref()).await
    }

    /// Processes deliveries fetched together: one `claim_many` round trip for the batch, then the
    /// acquired handlers run concurrently. A key repeated inside the batch runs once; its later
    /// copies become duplicates once the first completes. Outcomes are in message order.
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
            async move { (i, self.run_unkeyed(|ctx| handler(ctx, m), m.correlation_id()).await) }
        });
        for (i, o) in futures_util::future::join_all(unkeyed_runs).await {
            outcomes[i] = Some(o);
        }

        while !pending.is_empty() {
            let reqs: Vec<ClaimRequest> = pending.iter().map(|(_, r)| r.clone()).collect();
            let started = Instant::now();
            let claims = match self.store.claim_many(&reqs).await {
                Ok(c) if c.len() == reqs.len() => Some(c),
                Ok(c) => {
                    tracing::error!(target: "idem", asked = reqs.len(), got = c.len(),
                        "store answered a batch with the wrong number of claims; claiming one by one");
                    None
                }
                Err(e) => {
                    tracing::warn!(target: "idem", error = %e, "batch claim failed; claiming one by one");
                    None
                }
            };
            self.observe_claim(started);
            let Some(claims) = claims else {
                // One claim per message gives each its own answer (or its own error).
                let runs = pending.drain(..).map(|(i, req)| {
                    let m = &msgs[i];
                    async move {
                        let claim = self.store.claim(&req).await;
                        (
                            i,
                            self.settle(claim, &req, |ctx| handler(ctx, m), m.correlation_id())
                                .await,
                        )
                    }
                });
                for (i, o) in futures_util::future::join_all(runs).await {
                    outcomes[i] = Some(o);
                }
                break;
            };
            let mut acquired_here = std::collections::HashSet::new();
            let mut deferred = Vec::new();
            let mut runs = Vec::new();
            for ((i, req), claim) in pending.drain(..).zip(claims) {
                let hash = req.key.hash();
                match claim {
                    Claim::Acquired(_) => {
                        acquired_here.insert(hash);
                    }
                    Claim::InProgress { .. } if acquired_here.contains(&hash) => {
                        // The same key earlier in this batch holds the lease: decide this copy
                        // after that one finishes.
                        deferred.push((i, req));
                        continue;
                    }
                    _ => {}
                }
                let m = &msgs[i];
                runs.push(async move {
                    let o = self.settle(Ok(claim), &req, |ctx| handler(ctx, m), m.correlation_id());
                    (i, o.await)
                });
            }
            for (i, o) in futures_util::future::join_all(runs).await {
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

    fn prepare<M: Envelope, T, E>(&self, msg: &M) -> Prepared<T, E> {
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

    async fn settle<T, E, F, Fut>(
        &self,
        claim: Result<Claim, crate::StoreError>,
        req: &ClaimRequest,
        handler: F,
        correlation: Option<&str>,
    ) -> Outcome<T, E>
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
        let (outcome, attempt) = async {
            match claim {
                Err(e) => (Outcome::failed(FailureKind::Transient, Cause::Store(e)), 0),
                Ok(Claim::Completed(rec)) if rec.state == RecordState::InDoubt => (
                    Outcome::failed(
                        FailureKind::Permanent,
                        Cause::InDoubt { attempt: rec.attempt },
                    ),
                    rec.attempt,
                ),
                Ok(Claim::Completed(rec)) => {
                    let decoded = rec.result.as_deref().map(serde_json::from_slice).transpose();
                    match decoded {
                        Ok(r) => (Outcome::Duplicate(r), rec.attempt),
                        Err(e) => {
                            (Outcome::failed(FailureKind::Permanent, Cause::Decode(e)), rec.attempt)
                        }
                    }
                }
                Ok(Claim::Conflict(rec)) => (
                    Outcome::Conflict(Box::new(Conflict {
                        key: key.clone(),
                        stored: rec.fingerprint,
                        incoming: req.fingerprint,
                        stored_state: rec.state,
                    })),
                    rec.attempt,
                ),
                Ok(Claim::InProgress { retry_after, attempt }) => {
                    (Outcome::InProgressElsewhere { retry_after }, attempt)
                }
                Ok(Claim::Acquired(lease)) => {
                    let attempt = lease.attempt();
                    (self.run(lease, handler).await, attempt)
                }
            }
        }
        .instrument(span.clone())
        .await;
        span.record("attempt", attempt);
        span.record("outcome", outcome.label());
        self.observe(Some(key), correlation, &outcome, attempt);
        outcome
    }

    async fn run<T, E, F, Fut>(&self, mut lease: Lease, handler: F) -> Outcome<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: Display,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let cfg = &self.cfg;
        let attempt = lease.attempt();
        if lease.took_over_expired() && cfg.expired_lease == ExpiredLeasePolicy::Park {
            let reason = Cause::<String>::InDoubt { attempt }.to_string();
            if let Err(e) = self.store.fail(lease, FailKind::InDoubt, &reason, cfg.retain).await {
                return Outcome::failed(FailureKind::Transient, Cause::Store(e));
            }
            return Outcome::failed(FailureKind::Permanent, Cause::InDoubt { attempt });
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
                let stored = match serde_json::to_vec(&value) {
                    Ok(b) if b.len() <= cfg.max_result_bytes => Some(b),
                    Ok(b) => {
                        tracing::warn!(target: "idem", key = %lease.key(), len = b.len(),
                            limit = cfg.max_result_bytes,
                            "handler result larger than max_result_bytes; duplicates will carry no result");
                        None
                    }
                    Err(e) => {
                        tracing::warn!(target: "idem", key = %lease.key(), error = %e,
                            "handler result does not serialize; duplicates will carry no result");
                        None
                    }
                };
                match self.store.complete(lease, stored.as_deref(), cfg.retain).await {
                    Ok(()) => Outcome::Processed(value),
                    Err(e) => Outcome::failed(FailureKind::Transient, Cause::Store(e)),
                }
            }
            Err(HandlerError::Transient(e)) => {
                let key = lease.key().to_string();
                if let Err(re) = self.store.release(lease).await {
                    tracing::warn!(target: "idem", %key, error = %re,
                        "could not release the claim after a transient failure; it frees itself when the lease ends");
                }
                Outcome::failed(FailureKind::Transient, Cause::Handler(e))
            }
            Err(HandlerError::Permanent(e)) => {
                let key = lease.key().to_string();
                let mut reason = e.to_string();
                truncate_utf8(&mut reason, 4096);
                if let Err(fe) =
                    self.store.fail(lease, FailKind::Permanent, &reason, cfg.retain).await
                {
                    tracing::warn!(target: "idem", %key, error = %fe,
                        "could not record the permanent failure; the key frees itself when the lease ends");
                }
                Outcome::failed(FailureKind::Permanent, Cause::Handler(e))
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

    async fn run_unkeyed<T, E, F, Fut>(
        &self,
        handler: F,
        correlation: Option<&str>,
    ) -> Outcome<T, E>
    where
        E: Display,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        metrics::counter!("idem_missing_key_total", "scope" => self.cfg.scope.clone()).increment(1);
        let ctx =
            Context { key: None, downstream_key: None, attempt: 1, token: 0, took_over: false };
        let outcome = match handler(ctx).await {
            Ok(v) => Outcome::Processed(v),
            Err(HandlerError::Transient(e)) => {
                Outcome::failed(FailureKind::Transient, Cause::Handler(e))
            }
            Err(HandlerError::Permanent(e)) => {
                Outcome::failed(FailureKind::Permanent, Cause::Handler(e))
            }
        };
        self.observe(None, correlation, &outcome, 1);
        outcome
    }

    fn observe_claim(&self, started: Instant) {
        metrics::histogram!("idem_claim_duration_seconds", "scope" => self.cfg.scope.clone())
            .record(started.elapsed().as_secs_f64());
    }

    fn observe<T, E: Display>(
        &self,
        key: Option<&DedupKey>,
        correlation: Option<&str>,
        outcome: &Outcome<T, E>,
        attempt: u32,
    ) {
        let label = outcome.label();
        metrics::counter!("idem_outcomes_total", "scope" => self.cfg.scope.clone(), "outcome" => label)
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
