//! The two-phase decider, over any [`DedupStore`]: claim, run the handler under a lease,
//! record the completion.

use std::fmt::Display;
use std::future::Future;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

use super::ahead::Ahead;
use super::batch::{Decided, Item, Round};
use super::complete::{Decision, Ran, close, completed};
use super::prepare::Prepared;
use super::ride::{Driver, Ticket, TicketId};
use super::{
    Cause, Context, Engine, ExpiredLeasePolicy, FailureKind, Handler, HandlerError, Outcome,
};
use crate::answer::{Answer, outcome_of};
use crate::extract::Envelope;
use crate::telemetry::TAKEOVERS_TOTAL;
use crate::{Claim, ClaimRequest, DedupStore, FailKind, Lease, StoreError};

impl<S: DedupStore> Engine<S> {
    /// Processes one delivery. Every call ends in exactly one [`Outcome`]; store failures are
    /// [`Outcome::Failed`] with [`Cause::Store`], never a panic or a silent ack.
    ///
    /// The handler runs at most once per call, and only while this call holds the key's lease.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped while the handler runs, the key stays claimed until its lease
    /// runs out, and the next delivery takes it over (attempt + 1).
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
                let outcome = self.run_unkeyed(Context::unkeyed(), handler).await;
                self.observe(None, correlation, &outcome, 1);
                return outcome;
            }
            Prepared::Done(outcome) => {
                self.observe(None, correlation, &outcome, 0);
                return outcome;
            }
        };
        let started = Instant::now();
        let claim = self.bounded("claim", self.store.claim(&req)).await;
        self.observe_claim(started);
        if let Err(e) = &claim {
            self.observe_store_error("claim", e);
        }
        let Decision { span, attempt, ran } = self.decide(claim, &req, handler, correlation).await;
        let outcome = match ran {
            Ran::Done(o) => o,
            Ran::Complete { lease, value, stored } => {
                let done = self.complete_retrying(lease, stored.as_deref(), self.cfg.retain).await;
                completed(value, done)
            }
        };
        close(&span, attempt, &outcome);
        self.observe(Some(&req.key), correlation, &outcome, attempt);
        outcome
    }

    /// Processes deliveries fetched together: one `claim_many` round trip per round of
    /// distinct keys, the acquired handlers concurrently, then one `complete_many` for their
    /// completions (one commit on the SQL stores: group commit). A key repeated inside the batch
    /// runs once; its later copies are duplicates once the first completes. Outcomes are in
    /// message order.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped midway, claims stay in progress until their leases run out.
    pub async fn process_batch<'m, M, H>(
        &self,
        msgs: &'m [M],
        handler: H,
    ) -> Vec<Outcome<H::Value, H::Error>>
    where
        M: Envelope + Sync,
        H: Handler<Context, &'m M>,
    {
        let by_index = |ctx: Context, i: usize| handler(ctx, &msgs[i]);
        self.decide_in_rounds(msgs, &TwoPhase::new(self, &by_index, msgs), Vec::new(), None).await
    }

    /// The claims of a round: one `claim_many`, or one claim each when the batch call fails
    /// (each message then gets its own answer, or its own error).
    pub(super) async fn claim_all(&self, reqs: &[ClaimRequest]) -> Vec<Result<Claim, StoreError>> {
        let started = Instant::now();
        let batch = self.bounded("claim_many", self.store.claim_many(reqs)).await;
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
        let claims = reqs.iter().map(|r| self.bounded("claim", self.store.claim(r)));
        let claims = futures_util::future::join_all(claims).await;
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
            match outcome_of(claim, req) {
                Answer::Settled(o, attempt) => (Ran::Done(o), attempt),
                Answer::Run(lease) => {
                    let attempt = lease.attempt();
                    (self.run(lease, handler).await, attempt)
                }
            }
        }
        .instrument(span.clone())
        .await;
        Decision { span, attempt, ran }
    }

    async fn run<T, E, F, Fut>(&self, lease: Lease, handler: F) -> Ran<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: Display,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let cfg = &self.cfg;
        let mut lease = match self.admit(lease, cfg.retain).await {
            Ok(lease) => lease,
            Err(refusal) => return Ran::Done(refusal.outcome()),
        };
        let ctx = Context::of(&lease);
        let result = self.drive(&mut lease, cfg.lease, handler(ctx)).await;
        match result {
            Ok(value) => {
                let stored = self.encode_result(lease.key(), &value);
                Ran::Complete { lease, value, stored }
            }
            Err(HandlerError::Transient(e)) => {
                self.release_quietly(lease, "after a transient failure").await;
                Ran::Done(Outcome::failed(FailureKind::Transient, Cause::Handler(e)))
            }
            Err(HandlerError::Permanent(e)) => {
                let mut reason = e.to_string();
                truncate_utf8(&mut reason, 4096);
                self.fail_quietly(lease, FailKind::Permanent, &reason, cfg.retain).await;
                Ran::Done(Outcome::failed(FailureKind::Permanent, Cause::Handler(e)))
            }
        }
    }

    /// The takeover rule, for every acquired lease: one taken over from an expired lease runs
    /// again, unless the expired-lease policy parks it in doubt or its deaths reached the
    /// crash-loop limit; then the key is failed (for `retain`) and the lease given back as the
    /// refusal's cause.
    pub(super) async fn admit(&self, lease: Lease, retain: Duration) -> Result<Lease, Refusal> {
        let cfg = &self.cfg;
        if !lease.took_over_expired() {
            return Ok(lease);
        }
        let attempt = lease.attempt();
        let park = cfg.expired_lease == ExpiredLeasePolicy::Park;
        let crash_loop = if park { None } else { self.crash_loop(lease.deaths()) };
        let policy = match (park, crash_loop) {
            (true, _) => "park",
            (false, Some(_)) => "crash_loop",
            (false, None) => "run",
        };
        metrics::counter!(TAKEOVERS_TOTAL, "scope" => cfg.scope.clone(), "policy" => policy)
            .increment(1);
        let (kind, cause, refusal) = match crash_loop {
            _ if park => (
                FailKind::InDoubt,
                Cause::<String>::InDoubt { attempt },
                Refusal::InDoubt { attempt },
            ),
            Some(c) => (FailKind::Permanent, c.cause::<String>(), Refusal::CrashLoop(c)),
            None => return Ok(lease),
        };
        match self.fail_bounded(lease, kind, &cause.to_string(), retain).await {
            Ok(()) => Err(refusal),
            Err(e) => Err(Refusal::Store(e)),
        }
    }

    /// Gives a lease back (bounded); a failure is logged: the key frees itself when the lease
    /// runs out.
    pub(super) async fn release_quietly(&self, lease: Lease, when: &'static str) {
        let key = lease.key().to_string();
        if let Err(e) = self.bounded("release", self.store.release(lease)).await {
            self.observe_store_error("release", &e);
            tracing::warn!(target: "idem", %key, error = %e, when,
                "could not release the claim; it frees itself when the lease ends");
        }
    }

    /// Records a failure (bounded); a failure to record it is logged: the key frees itself
    /// when the lease runs out.
    pub(super) async fn fail_quietly(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain: Duration,
    ) {
        let key = lease.key().to_string();
        if let Err(e) = self.fail_bounded(lease, kind, reason, retain).await {
            tracing::warn!(target: "idem", %key, error = %e,
                "could not record the failure; the key frees itself when the lease ends");
        }
    }

    /// Records a failure, bounded by the store timeout; a store error is counted.
    pub(super) async fn fail_bounded(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain: Duration,
    ) -> Result<(), StoreError> {
        let done = self.bounded("fail", self.store.fail(lease, kind, reason, retain)).await;
        if let Err(e) = &done {
            self.observe_store_error("fail", e);
        }
        done
    }

    /// Runs the handler, extending the lease on every heartbeat tick when one is configured.
    ///
    /// The heartbeat runs beside the handler, never instead of it: awaiting `extend` while the
    /// handler is not polled would deadlock a handler that holds what `extend` needs (the one
    /// connection of a SQLite pool, say) until the pool's acquire timeout.
    pub(super) async fn drive<Fut: Future>(
        &self,
        lease: &mut Lease,
        lease_for: Duration,
        fut: Fut,
    ) -> Fut::Output {
        let Some(every) = self.cfg.heartbeat else { return fut.await };
        let beat = async {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                if let Err(e) = self.store.extend(lease, lease_for).await {
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

/// The two-phase round: one `claim_many`, the handlers of the acquired keys concurrently (and
/// those of messages without a key), one `complete_many`.
/// The handler takes the message's index in the batch, so no borrow of it appears in the
/// handler's signature.
pub(super) struct TwoPhase<'e, S, H, M> {
    engine: &'e Engine<S>,
    handler: &'e H,
    msgs: &'e [M],
    /// The decision's seat for claims riding on its completion (a consumer's decisions).
    driver: Option<&'e Driver>,
}

impl<'e, S, H, M> TwoPhase<'e, S, H, M> {
    pub(super) fn new(engine: &'e Engine<S>, handler: &'e H, msgs: &'e [M]) -> Self {
        Self { engine, handler, msgs, driver: None }
    }

    /// Carries the claims riding with `driver` on the round's first completion.
    pub(super) fn carrying(mut self, driver: Option<&'e Driver>) -> Self {
        self.driver = driver;
        self
    }
}

impl<S: DedupStore> Engine<S> {
    /// A seat for claims ahead to ride on this decision's completion, when the store sends a
    /// completion and claims in one write.
    pub(super) fn carpool_seat(&self, ticket: TicketId) -> Option<Driver> {
        self.store.combines_writes().then(|| self.rides.drive(ticket))
    }

    /// A ticket for a batch just fetched: coming, when the store sends a completion and claims
    /// in one write.
    pub(super) fn ticket(&self) -> Ticket {
        match self.store.combines_writes() {
            true => self.rides.ticket(),
            false => Ticket::new(),
        }
    }
}

impl<S: DedupStore, H, M> TwoPhase<'_, S, H, M> {
    /// The claims of `reqs`: those taken ahead when they answer exactly these requests (their
    /// leases extended to a full lease when old, the keys they left open claimed now), else
    /// one `claim_many` now (releasing what was taken ahead for nothing).
    async fn claims(
        &self,
        reqs: &[ClaimRequest],
        ahead: Option<Ahead>,
    ) -> Vec<Result<Claim, StoreError>> {
        let engine = self.engine;
        let Some(ahead) = ahead else { return engine.claim_all(reqs).await };
        let (mut taken, old) = match ahead.take_for(reqs, engine.lease()) {
            Ok(taken) => taken,
            Err(other) => {
                engine.drop_ahead(other).await;
                return engine.claim_all(reqs).await;
            }
        };
        if old {
            // Extended, not released and claimed again: the answer stays the one taken ahead.
            let extend = taken.iter_mut().map(|slot| async move {
                if let Some(Ok(Claim::Acquired(lease))) = slot
                    && let Err(e) = engine.store.extend(lease, engine.lease()).await
                {
                    engine.observe_store_error("extend", &e);
                    *slot = None;
                }
            });
            futures_util::future::join_all(extend).await;
        }
        let open: Vec<usize> = (0..taken.len()).filter(|&i| taken[i].is_none()).collect();
        if !open.is_empty() {
            let again: Vec<ClaimRequest> = open.iter().map(|&i| reqs[i].clone()).collect();
            for (i, c) in open.into_iter().zip(engine.claim_all(&again).await) {
                taken[i] = Some(c);
            }
        }
        taken
            .into_iter()
            .map(|c| c.unwrap_or_else(|| Err(StoreError::backend("claim_many", true, Unanswered))))
            .collect()
    }
}

/// A claim that got no answer (not expected: every open slot of a claim taken ahead is claimed
/// again, and a single claim answers once).
#[derive(Debug, thiserror::Error)]
#[error("no answer for a key claimed ahead")]
struct Unanswered;

impl<S, M, T, E, H> Round<T, E> for TwoPhase<'_, S, H, M>
where
    S: DedupStore,
    M: Envelope + Sync,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
    H: Handler<Context, usize, Value = T, Error = E>,
{
    type Ahead = Ahead;

    // The trait's future is `Send + '_` over the handler's types; an `async fn` here would
    // need those types to outlive the borrow, which they need not.
    #[allow(clippy::manual_async_fn)]
    fn decide(
        &self,
        round: Vec<Item>,
        ahead: Option<Ahead>,
    ) -> impl Future<Output = Vec<Decided<T, E>>> + Send + '_ {
        async move {
            let (engine, handler, msgs) = (self.engine, self.handler, self.msgs);
            let mut keyed = Vec::with_capacity(round.len());
            let mut unkeyed = Vec::new();
            for (i, req) in round {
                match req {
                    Some(req) => keyed.push((i, req)),
                    None => unkeyed.push(i),
                }
            }
            let unkeyed_runs = unkeyed.into_iter().map(|i| async move {
                let outcome = engine.run_unkeyed(Context::unkeyed(), |ctx| handler(ctx, i)).await;
                Decided { index: i, outcome, attempt: 1 }
            });
            let unkeyed_runs = futures_util::future::join_all(unkeyed_runs);
            let keyed_runs = async {
                if keyed.is_empty() {
                    if let Some(unused) = ahead {
                        engine.drop_ahead(unused).await;
                    }
                    return Vec::new();
                }
                // Claimed without takeover: a key whose lease ran out (its holder died or hung)
                // answers in progress with no time left and stays as it is.
                let reqs: Vec<ClaimRequest> =
                    keyed.iter().map(|(_, r)| r.clone().without_takeover()).collect();
                let claims = self.claims(&reqs, ahead).await;
                let (suspects, rest): (Vec<_>, Vec<_>) =
                    keyed.into_iter().zip(claims).partition(|(_, c)| suspect(c));
                let decide = |((i, req), claim): ((usize, ClaimRequest), _)| async move {
                    let m = &msgs[i];
                    let d =
                        engine.decide(claim, &req, |ctx| handler(ctx, i), m.correlation_id()).await;
                    (i, d)
                };
                let _solo = (!suspects.is_empty()).then(|| Solo::enter(engine));
                let decided = futures_util::future::join_all(rest.into_iter().map(decide)).await;
                let mut done = engine.complete_all(decided, self.driver).await;
                // Takeovers of expired leases run alone, one after another, once the rest of
                // the round is recorded, each claimed (taken over) only when its turn comes: if
                // one of them kills the process again, no other key is held by it, so only
                // that key's attempt count grows towards the crash-loop limit.
                for ((i, req), _) in solo_order(suspects) {
                    let claim = engine.claim_all(std::slice::from_ref(&req)).await.pop();
                    let claim = claim
                        .unwrap_or_else(|| Err(StoreError::backend("claim", true, Unanswered)));
                    let decided = vec![decide(((i, req), claim)).await];
                    done.extend(engine.complete_all(decided, self.driver).await);
                }
                done
            };
            let (mut done, keyed) = futures_util::future::join(unkeyed_runs, keyed_runs).await;
            done.extend(keyed);
            done
        }
    }
}

/// Whether a claim without takeover found a lease that ran out: its holder died or hung while
/// the handler ran, maybe because of this very message.
fn suspect(claim: &Result<Claim, StoreError>) -> bool {
    matches!(claim, Ok(Claim::InProgress { retry_after, .. }) if retry_after.is_zero())
}

/// The order takeovers run in: fewest attempts first (a message that keeps killing the process
/// has the most), and among equal attempts in delivery order on even attempts, in reverse on
/// odd ones. Redeliveries come back in the same order, so a message fetched after a poison
/// message of the same batch, stuck behind it once, runs before it on the next round instead
/// of dying with it until both reach the limit.
fn solo_order(mut suspects: Vec<Suspect>) -> Vec<Suspect> {
    let attempt = |c: &Result<Claim, StoreError>| match c {
        Ok(Claim::InProgress { attempt, .. }) => *attempt,
        _ => 0,
    };
    suspects.sort_by(|((i, _), a), ((j, _), b)| {
        let (x, y) = (attempt(a), attempt(b));
        x.cmp(&y).then(if x % 2 == 0 { i.cmp(j) } else { j.cmp(i) })
    });
    suspects
}

/// A round's takeovers waiting to run or running alone; while any exists, the engine takes no
/// claims ahead.
struct Solo<'e>(&'e std::sync::atomic::AtomicUsize);

impl<'e> Solo<'e> {
    fn enter<S>(engine: &'e Engine<S>) -> Self {
        engine.solo.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self(&engine.solo)
    }
}

impl Drop for Solo<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

impl<S> Engine<S> {
    /// Whether a round's takeovers are waiting to run alone (see [`Solo`]).
    pub(super) fn solo_running(&self) -> bool {
        self.solo.load(std::sync::atomic::Ordering::SeqCst) > 0
    }
}

impl<B> Engine<B> {
    /// The crash-loop rule, once for every mode: a key whose holders died `deaths` times is not
    /// run again once that reaches the limit.
    pub(super) fn crash_loop(&self, deaths: u32) -> Option<CrashLoop> {
        let limit = self.cfg.crash_loop_limit;
        (deaths >= limit).then_some(CrashLoop { deaths, limit })
    }
}

/// A key past the crash-loop limit: its deaths and the limit.
#[derive(Debug, Clone, Copy)]
pub(super) struct CrashLoop {
    pub(super) deaths: u32,
    pub(super) limit: u32,
}

impl CrashLoop {
    /// Why the key failed.
    pub(super) fn cause<E>(self) -> Cause<E> {
        Cause::CrashLoop { deaths: self.deaths, limit: self.limit }
    }

    /// The outcome of a delivery refused for it: dead-lettered.
    pub(super) fn outcome<T, E>(self) -> Outcome<T, E> {
        Outcome::failed(FailureKind::Permanent, self.cause())
    }
}

/// Why an acquired lease does not run.
pub(super) enum Refusal {
    /// The takeover rule failed the key: past the crash-loop limit.
    CrashLoop(CrashLoop),
    /// The takeover rule parked the key in doubt.
    InDoubt { attempt: u32 },
    /// Recording either failed.
    Store(StoreError),
}

impl Refusal {
    /// The outcome of a delivery refused this way.
    fn outcome<T, E>(self) -> Outcome<T, E> {
        match self {
            Self::CrashLoop(c) => c.outcome(),
            Self::InDoubt { attempt } => {
                Outcome::failed(FailureKind::Permanent, Cause::InDoubt { attempt })
            }
            Self::Store(e) => Outcome::failed(FailureKind::Transient, Cause::Store(e)),
        }
    }
}

/// A keyed message of a round (its index and request) with the answer that found its lease
/// expired.
type Suspect = ((usize, ClaimRequest), Result<Claim, StoreError>);

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}
