//! The offset inbox's decider: one transaction per batch, positions locked, each partition
//! walked in offset order.

use std::collections::{HashMap, HashSet};
use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{OffsetInbox, Partition, TxPositions};
use crate::engine::answer::{Answer, outcome_of};
use crate::engine::prepare::Prepared;
use crate::engine::{Cause, Engine, FailureKind, HandlerError, Outcome};
use crate::extract::Envelope;
use crate::inbox::Tx;
use crate::inbox::tx::Lender;
use crate::{Claim, ClaimRequest, DedupKey, KeyHash, StoreError};

/// How many times a batch's transaction is begun again after a retryable store error before
/// its messages are retried by the broker instead.
const STORE_ATTEMPTS: u32 = 8;

/// Where one message sits, owned.
struct Place {
    log: String,
    partition: i32,
    offset: i64,
    from: Option<i64>,
}

/// What the walk of a batch decided for one message before anything runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Below the stored position: acked, not run.
    Behind,
    /// Read after a message of its partition that is not settled: retried, not run.
    Waits,
    /// Runs (its key marked first when markers are on).
    Run,
    /// The same key as an earlier message that runs in this transaction.
    Repeat(usize),
}

/// A message of the batch that waits for an earlier one of its partition.
#[derive(Debug, thiserror::Error)]
#[error("waits for an earlier message of partition {partition} of `{log}` to settle")]
struct Waiting {
    log: String,
    partition: i32,
}

/// A delivery that does not come from an ordered log.
#[derive(Debug, thiserror::Error)]
#[error("the offset inbox needs deliveries from an ordered log (no log position)")]
struct NotALog;

/// A handler kept its `Tx` beyond its future.
#[derive(Debug, thiserror::Error)]
#[error("an offset-inbox handler kept its transaction beyond its future; the batch is rolled back")]
struct Kept;

/// The failure shared by every delivery of a batch whose transaction failed.
#[derive(Debug, thiserror::Error)]
#[error("the offset-inbox transaction of this delivery's batch failed")]
struct BatchFailed(#[source] Arc<StoreError>);

/// How one attempt at the batch's transaction ended.
enum Attempt<T, E> {
    /// Committed (or failed to commit): every message's outcome.
    Done(Vec<(usize, Outcome<T, E>)>),
    /// This message failed (its handler, or its mark): rolled back; run the batch again
    /// without it and without the rest of its partition.
    Fix(usize, Outcome<T, E>),
    /// A retryable store error before any handler ran: begin again.
    Again(StoreError),
}

/// Decides `batch` over an offset inbox; outcomes in batch order.
pub(crate) async fn decide<I, M, H, Fut, T, E>(
    engine: &Engine<OffsetInbox<I>>,
    batch: &[M],
    handler: &H,
) -> Vec<Outcome<T, E>>
where
    I: TxPositions,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Fn(Tx<I>, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    let markers = engine.store().markers();
    let mut fixed: HashMap<usize, Outcome<T, E>> = HashMap::new();
    let mut places = Vec::with_capacity(batch.len());
    let mut reqs: Vec<Option<ClaimRequest>> = Vec::with_capacity(batch.len());
    let mut keys: Vec<Option<DedupKey>> = Vec::with_capacity(batch.len());
    for (i, m) in batch.iter().enumerate() {
        places.push(m.log_position().map(|p| Place {
            log: p.log.to_owned(),
            partition: p.partition,
            offset: p.offset,
            from: p.from,
        }));
        if places[i].is_none() {
            fixed.insert(i, permanent(StoreError::backend("offset inbox", false, NotALog)));
        }
        let (req, key) = if markers {
            match engine.prepare::<M, T, E>(m) {
                Prepared::Claim(req) => {
                    let key = req.key.clone();
                    (Some(req), Some(key))
                }
                Prepared::Unkeyed => (None, None),
                Prepared::Done(o) => {
                    fixed.entry(i).or_insert(o);
                    (None, None)
                }
            }
        } else {
            (None, engine.key_of(m).ok())
        };
        reqs.push(req);
        keys.push(key);
    }
    // Each partition's messages in offset order; partitions sorted (one lock order).
    let mut order: Vec<usize> = (0..batch.len()).filter(|i| places[*i].is_some()).collect();
    order.sort_by(|a, b| {
        let (pa, pb) = (place(&places, *a), place(&places, *b));
        (pa.log.as_str(), pa.partition, pa.offset).cmp(&(pb.log.as_str(), pb.partition, pb.offset))
    });
    let round = Round { engine, batch, handler, places: &places, reqs: &reqs, keys: &keys, order };
    let mut errors = 0;
    let decided = loop {
        let done: HashSet<usize> = fixed.keys().copied().collect();
        match round.attempt(&done).await {
            Attempt::Done(d) => break d,
            Attempt::Fix(i, o) => {
                fixed.insert(i, o);
            }
            Attempt::Again(e) if e.is_retryable() && errors + 1 < STORE_ATTEMPTS => {
                errors += 1;
                engine.observe_store_error("offset inbox", &e);
                tracing::debug!(target: "idem", error = %e, attempt = errors,
                    "the offset inbox's transaction failed with a retryable error; again");
                tokio::time::sleep(backoff(errors)).await;
            }
            Attempt::Again(e) => {
                engine.observe_store_error("offset inbox", &e);
                tracing::warn!(target: "idem", error = %e,
                    "offset inbox transaction failed; retrying its messages");
                let shared = Arc::new(e);
                break round.order.iter().map(|&i| (i, transient(shared_error(&shared)))).collect();
            }
        }
    };
    let mut out: Vec<Option<Outcome<T, E>>> = batch.iter().map(|_| None).collect();
    for (i, o) in decided.into_iter().chain(fixed) {
        out[i].get_or_insert(o);
    }
    out.into_iter()
        .enumerate()
        .map(|(i, o)| {
            let o = o.unwrap_or_else(|| transient(StoreError::backend("offset inbox", true, Kept)));
            let attempt = u32::from(matches!(o, Outcome::Processed(_)));
            engine.observe(keys[i].as_ref(), batch[i].correlation_id(), &o, attempt);
            o
        })
        .collect()
}

fn place(places: &[Option<Place>], i: usize) -> &Place {
    places[i].as_ref().expect("only messages with a place are ordered")
}

struct Round<'a, I, M, H> {
    engine: &'a Engine<OffsetInbox<I>>,
    batch: &'a [M],
    handler: &'a H,
    places: &'a [Option<Place>],
    reqs: &'a [Option<ClaimRequest>],
    keys: &'a [Option<DedupKey>],
    /// Indices of the messages with a place, by (log, partition, offset).
    order: Vec<usize>,
}

impl<I, M, H, Fut, T, E> Round<'_, I, M, H>
where
    I: TxPositions,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Fn(Tx<I>, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    /// One transaction over the batch, minus the messages already decided (`fixed`).
    async fn attempt(&self, fixed: &HashSet<usize>) -> Attempt<T, E> {
        let inbox = self.engine.store().inner();
        let scope = self.engine.scope();
        let mut parts: Vec<Partition<'_>> = Vec::new();
        for &i in &self.order {
            let p = place(self.places, i);
            if parts.last() != Some(&(p.log.as_str(), p.partition)) {
                parts.push((p.log.as_str(), p.partition));
            }
        }
        let mut tx = match inbox.begin().await {
            Ok(tx) => tx,
            Err(e) => return Attempt::Again(e),
        };
        let started = Instant::now();
        let stored = match inbox.lock_positions(I::connection(&mut tx), scope, &parts).await {
            Ok(s) if s.len() == parts.len() => s,
            Ok(_) => return Attempt::Again(wrong_count()),
            Err(e) => return Attempt::Again(e),
        };
        let stored: HashMap<Partition<'_>, Option<i64>> =
            parts.iter().copied().zip(stored).collect();
        let plans = self.plan(fixed, &stored);
        // Mark the keys of the messages that run, in one call.
        let marked: Vec<usize> = plans
            .iter()
            .filter(|(i, p)| *p == Plan::Run && self.reqs[*i].is_some())
            .map(|(i, _)| *i)
            .collect();
        let mut marks: HashMap<usize, Claim> = HashMap::new();
        if !marked.is_empty() {
            let items: Vec<_> = marked
                .iter()
                .filter_map(|&i| self.reqs[i].as_ref().map(|r| (r.key.clone(), r.fingerprint)))
                .collect();
            match inbox.mark_many(I::connection(&mut tx), &items).await {
                Ok(c) if c.len() == marked.len() => marks.extend(marked.iter().copied().zip(c)),
                Ok(_) => return Attempt::Again(wrong_count()),
                Err(e) => return Attempt::Again(e),
            }
        }
        self.engine.observe_claim(started);
        let lender = Lender::<I>::new(tx);
        let mut decided: Vec<(usize, Outcome<T, E>)> = Vec::with_capacity(plans.len());
        let mut next: HashMap<Partition<'_>, i64> = HashMap::new();
        for (i, plan) in plans {
            let p = place(self.places, i);
            let outcome = match plan {
                Plan::Behind => {
                    decided.push((i, Outcome::Duplicate(None)));
                    continue;
                }
                Plan::Waits => {
                    let waiting = Waiting { log: p.log.clone(), partition: p.partition };
                    decided
                        .push((i, transient(StoreError::backend("offset inbox", true, waiting))));
                    continue;
                }
                // Its first copy ran or was a duplicate in this transaction.
                Plan::Repeat(_) => Outcome::Duplicate(None),
                Plan::Run => {
                    let settled = match (marks.remove(&i), &self.reqs[i]) {
                        (Some(claim), Some(req)) => match outcome_of::<T, E>(Ok(claim), req) {
                            Answer::Run(_) => None,
                            Answer::Settled(o @ Outcome::Duplicate(_), _) => Some(o),
                            // A conflict, a key leased elsewhere: not run, and nothing after
                            // it in its partition may pass it.
                            Answer::Settled(o, _) => return self.undo(&lender, i, o).await,
                        },
                        _ => None,
                    };
                    match settled {
                        Some(o) => o,
                        None => match self.run(&lender, i).await {
                            Ok(o) => o,
                            Err(o) => return self.undo(&lender, i, o).await,
                        },
                    }
                }
            };
            next.insert((p.log.as_str(), p.partition), p.offset + 1);
            decided.push((i, outcome));
        }
        let Some(mut tx) = lender.take() else {
            return Attempt::Again(StoreError::backend("offset inbox", false, Kept));
        };
        let moves: Vec<(Partition<'_>, i64)> = next
            .into_iter()
            .filter(|(part, n)| stored.get(part).copied().flatten().is_none_or(|s| *n > s))
            .collect();
        if !moves.is_empty()
            && let Err(e) = inbox.advance(I::connection(&mut tx), scope, &moves).await
        {
            return Attempt::Again(e);
        }
        let started = Instant::now();
        let committed = inbox.commit(tx).await;
        self.engine.observe_complete(started);
        match committed {
            Ok(_) => Attempt::Done(decided),
            Err(e) => Attempt::Done(self.commit_failed(decided, e)),
        }
    }

    /// Runs message `i`'s handler with the transaction: `Err` when it failed.
    async fn run(&self, lender: &Lender<I>, i: usize) -> Result<Outcome<T, E>, Outcome<T, E>> {
        let Some(tx) = lender.lend(self.keys[i].clone()) else {
            return Err(transient(StoreError::backend("offset inbox", false, Kept)));
        };
        if self.reqs[i].is_none() && self.engine.store().markers() {
            self.engine.count_unkeyed();
        }
        match (self.handler)(tx, self.batch[i].clone()).await {
            Ok(v) => Ok(Outcome::Processed(v)),
            Err(e) => Err(Outcome::from_handler_error(e)),
        }
    }

    /// Rolls the transaction back after message `i` failed with `outcome`.
    async fn undo(&self, lender: &Lender<I>, i: usize, outcome: Outcome<T, E>) -> Attempt<T, E> {
        // Now rather than on drop: the next transaction (a SQLite writer above all) must not
        // wait for it.
        if let Some(tx) = lender.take()
            && let Err(e) = self.engine.store().inner().rollback(tx).await
        {
            tracing::warn!(target: "idem", error = %e, "rolling back the offset-inbox batch failed");
        }
        Attempt::Fix(i, outcome)
    }

    /// Walks each partition in offset order from its stored position, as if every message
    /// that runs succeeds (one that fails rolls the attempt back).
    fn plan(
        &self,
        fixed: &HashSet<usize>,
        stored: &HashMap<Partition<'_>, Option<i64>>,
    ) -> Vec<(usize, Plan)> {
        let mut plans = Vec::with_capacity(self.order.len());
        let mut cur: Option<i64> = None;
        let mut blocked = false;
        let mut at: Option<Partition<'_>> = None;
        let mut first_of: HashMap<KeyHash, usize> = HashMap::new();
        for &i in &self.order {
            let p = place(self.places, i);
            let part = (p.log.as_str(), p.partition);
            if at != Some(part) {
                at = Some(part);
                cur = stored.get(&part).copied().flatten();
                blocked = false;
            }
            if fixed.contains(&i) {
                // Failed, to be retried or dead-lettered: nothing after it may pass it.
                blocked = true;
                continue;
            }
            if cur.is_some_and(|c| p.offset < c) {
                plans.push((i, Plan::Behind));
                continue;
            }
            // Contiguous: the message read before it is at or below the position.
            let contiguous = match (p.from, cur) {
                (None, _) => true,
                (Some(f), Some(c)) => f <= c,
                (Some(_), None) => false,
            };
            if blocked || !contiguous {
                blocked = true;
                plans.push((i, Plan::Waits));
                continue;
            }
            let plan = match &self.reqs[i] {
                Some(req) => match first_of.get(&req.key.hash()) {
                    Some(&first) => Plan::Repeat(first),
                    None => {
                        first_of.insert(req.key.hash(), i);
                        Plan::Run
                    }
                },
                None => Plan::Run,
            };
            cur = Some(p.offset + 1);
            plans.push((i, plan));
        }
        plans
    }

    /// After a failed commit nothing processed is durable: those become failures (transient,
    /// or permanent when the inbox says the commit can never succeed). Duplicates stand.
    fn commit_failed(
        &self,
        decided: Vec<(usize, Outcome<T, E>)>,
        e: StoreError,
    ) -> Vec<(usize, Outcome<T, E>)> {
        self.engine.observe_store_error("commit", &e);
        tracing::warn!(target: "idem", error = %e,
            "offset inbox commit failed; nothing of the batch is committed");
        let kind =
            if I::is_permanent(&e) { FailureKind::Permanent } else { FailureKind::Transient };
        let shared = Arc::new(e);
        decided
            .into_iter()
            .map(|(i, o)| match o {
                Outcome::Processed(_) => {
                    (i, Outcome::failed(kind, Cause::Store(shared_error(&shared))))
                }
                o => (i, o),
            })
            .collect()
    }
}

fn transient<T, E>(e: StoreError) -> Outcome<T, E> {
    Outcome::failed(FailureKind::Transient, Cause::Store(e))
}

fn permanent<T, E>(e: StoreError) -> Outcome<T, E> {
    Outcome::failed(FailureKind::Permanent, Cause::Store(e))
}

fn shared_error(e: &Arc<StoreError>) -> StoreError {
    StoreError::backend("offset inbox batch", e.is_retryable(), BatchFailed(Arc::clone(e)))
}

fn wrong_count() -> StoreError {
    StoreError::backend("offset inbox", true, "the store answered with the wrong number of rows")
}

/// A random pause that grows with the attempt (0.5–2.5 ms at first, at most 160 ms).
fn backoff(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, RandomState};
    let ceiling = 1u64 << (attempt.min(7) + 10); // microseconds
    let draw = RandomState::new().hash_one((attempt, Instant::now()));
    Duration::from_micros(ceiling / 4 + draw % ceiling)
}
