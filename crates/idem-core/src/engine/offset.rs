//! The offset inbox's round: one transaction, the partitions' positions locked, each
//! partition walked in offset order from its stored position.

use std::collections::{HashMap, HashSet};
use std::fmt::Display;
use std::future::Future;
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::batch::{Decided, Item, Round, waiting};
use super::txn::backoff;
use super::{Cause, Engine, FailureKind, Handler, Outcome};
use crate::answer::{Answer, outcome_of};
use crate::extract::{Envelope, LogPosition};
use crate::inbox::tx::{Lender, kept};
use crate::inbox::{OffsetInbox, Partition, Tx, TxPositions, WrongCount};
use crate::{Claim, StoreError};

/// How many times a round's transaction is begun again after a retryable store error before
/// its messages are retried by the broker instead.
const STORE_ATTEMPTS: u32 = 8;

/// What the transaction is called in errors and logs.
const WHAT: &str = "offset inbox";

/// What the walk of a round decided for one message before anything runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Below the stored position: acked, not run.
    Behind,
    /// Read after a message of its partition that is not settled: retried, not run.
    Waits,
    /// Runs (its key marked first when markers are on).
    Run,
}

/// A delivery that does not come from an ordered log.
#[derive(Debug, thiserror::Error)]
#[error("the offset inbox needs deliveries from an ordered log (no log position)")]
struct NotALog;

/// How one attempt at the round's transaction ended.
enum Attempt<T, E> {
    /// Committed (or failed to commit): every message's outcome.
    Done(Vec<Decided<T, E>>),
    /// This message failed (its handler, or its mark): rolled back; run the round again
    /// without it and without the rest of its partition.
    Fix(Decided<T, E>),
    /// A retryable store error before any handler ran: begin again.
    Again(StoreError),
}

/// The offset-inbox round: a batch's messages and the handler, over an engine on
/// `OffsetInbox<I>`. Its rounds follow each partition's offsets ([`Round::ORDERED`]).
pub(crate) struct OffsetRound<'e, I, H, M> {
    pub(crate) engine: &'e Engine<OffsetInbox<I>>,
    pub(crate) handler: &'e H,
    pub(crate) msgs: &'e [M],
}

impl<I, H, M, T, E> Round<T, E> for OffsetRound<'_, I, H, M>
where
    I: TxPositions,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Handler<Tx<I>, M, Value = T, Error = E>,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    const ORDERED: bool = true;

    fn keyed(&self) -> bool {
        self.engine.store().markers()
    }

    type Ahead = std::convert::Infallible;

    // The trait's future is `Send + '_` over the handler's types; an `async fn` here would
    // need those types to outlive the borrow, which they need not.
    #[allow(clippy::manual_async_fn)]
    fn decide(
        &self,
        round: Vec<Item>,
        _: Option<Self::Ahead>,
    ) -> impl Future<Output = Vec<Decided<T, E>>> + Send + '_ {
        async move {
            let (mut order, not_logs): (Vec<Item>, Vec<Item>) =
                round.into_iter().partition(|(i, _)| self.msgs[*i].log_position().is_some());
            order.sort_by(|(a, _), (b, _)| {
                let (pa, pb) = (self.place(*a), self.place(*b));
                (pa.log, pa.partition, pa.offset).cmp(&(pb.log, pb.partition, pb.offset))
            });
            let mut decided = if order.is_empty() {
                Vec::new()
            } else {
                self.engine.bounded_tx(WHAT, &order, self.attempts(&order)).await
            };
            decided.extend(not_logs.into_iter().map(|(index, _)| Decided {
                index,
                outcome: Outcome::failed(
                    FailureKind::Permanent,
                    Cause::Store(StoreError::backend(WHAT, false, NotALog)),
                ),
                attempt: 0,
            }));
            decided
        }
    }
}

impl<I, H, M, T, E> OffsetRound<'_, I, H, M>
where
    I: TxPositions,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Handler<Tx<I>, M, Value = T, Error = E>,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    fn place(&self, i: usize) -> LogPosition<'_> {
        self.msgs[i].log_position().expect("only messages with a place are ordered")
    }

    /// The round's transaction until it commits: again without a message that failed, again
    /// after a retryable error before any handler ran.
    async fn attempts(&self, order: &[Item]) -> Vec<Decided<T, E>> {
        let mut fixed: HashMap<usize, Decided<T, E>> = HashMap::new();
        let mut errors = 0;
        loop {
            let done: HashSet<usize> = fixed.keys().copied().collect();
            match self.attempt(order, &done).await {
                Attempt::Done(mut decided) => {
                    decided.extend(fixed.into_values());
                    return decided;
                }
                Attempt::Fix(d) => {
                    fixed.insert(d.index, d);
                }
                Attempt::Again(e) if e.is_retryable() && errors + 1 < STORE_ATTEMPTS => {
                    errors += 1;
                    self.engine.observe_store_error(WHAT, &e);
                    tracing::debug!(target: "idem", error = %e, attempt = errors,
                        "the offset inbox's transaction failed with a retryable error; again");
                    tokio::time::sleep(backoff(errors)).await;
                }
                Attempt::Again(e) => {
                    self.engine.observe_store_error(WHAT, &e);
                    let rest: Vec<Item> =
                        order.iter().filter(|(i, _)| !done.contains(i)).cloned().collect();
                    let mut decided = super::txn::failed_round(WHAT, &rest, e);
                    decided.extend(fixed.into_values());
                    return decided;
                }
            }
        }
    }

    /// One transaction over the round, minus the messages already decided (`fixed`).
    async fn attempt(&self, order: &[Item], fixed: &HashSet<usize>) -> Attempt<T, E> {
        let inbox = self.engine.store().inner();
        let scope = self.engine.scope();
        let mut parts: Vec<Partition<'_>> = Vec::new();
        for (i, _) in order {
            let p = self.place(*i);
            if parts.last() != Some(&(p.log, p.partition)) {
                parts.push((p.log, p.partition));
            }
        }
        let mut tx = match inbox.begin().await {
            Ok(tx) => tx,
            Err(e) => return Attempt::Again(e),
        };
        let started = Instant::now();
        let stored = match inbox.lock_positions(I::connection(&mut tx), scope, &parts).await {
            Ok(s) if s.len() == parts.len() => s,
            Ok(_) => return Attempt::Again(StoreError::backend(WHAT, true, WrongCount)),
            Err(e) => return Attempt::Again(e),
        };
        let stored: HashMap<Partition<'_>, Option<i64>> =
            parts.iter().copied().zip(stored).collect();
        let plans = self.plan(order, fixed, &stored);
        // Mark the keys of the messages that run, in one call.
        let marked: Vec<(usize, (crate::DedupKey, Option<crate::Fingerprint>))> = plans
            .iter()
            .filter(|(_, p)| *p == Plan::Run)
            .filter_map(|((i, r), _)| r.as_ref().map(|r| (*i, (r.key.clone(), r.fingerprint))))
            .collect();
        let mut marks: HashMap<usize, Claim> = HashMap::new();
        if !marked.is_empty() {
            let items: Vec<_> = marked.iter().map(|(_, item)| item.clone()).collect();
            match inbox.mark_many(I::connection(&mut tx), &items).await {
                Ok(c) if c.len() == marked.len() => {
                    marks.extend(marked.iter().map(|(i, _)| *i).zip(c));
                }
                Ok(_) => return Attempt::Again(StoreError::backend(WHAT, true, WrongCount)),
                Err(e) => return Attempt::Again(e),
            }
        }
        self.engine.observe_claim(started);
        let lender = Lender::<I>::new(tx);
        let mut decided: Vec<Decided<T, E>> = Vec::with_capacity(plans.len());
        let mut next: HashMap<Partition<'_>, i64> = HashMap::new();
        for (&(i, ref req), plan) in plans {
            let p = self.place(i);
            let (outcome, attempt) = match plan {
                Plan::Behind => {
                    decided.push(Decided {
                        index: i,
                        outcome: Outcome::Duplicate(None),
                        attempt: 0,
                    });
                    continue;
                }
                Plan::Waits => {
                    let outcome = Outcome::transient(waiting(p.log, p.partition));
                    decided.push(Decided { index: i, outcome, attempt: 0 });
                    continue;
                }
                Plan::Run => {
                    let settled = match (marks.remove(&i), req) {
                        (Some(claim), Some(req)) => match outcome_of::<T, E>(Ok(claim), req) {
                            Answer::Run(_) => None,
                            Answer::Settled(o @ Outcome::Duplicate(_), attempt) => {
                                Some((o, attempt))
                            }
                            // A conflict, a key leased elsewhere: not run, and nothing after
                            // it in its partition may pass it.
                            Answer::Settled(outcome, attempt) => {
                                let d = Decided { index: i, outcome, attempt };
                                return self.undo(&lender, d).await;
                            }
                        },
                        _ => None,
                    };
                    match settled {
                        Some(settled) => settled,
                        None => match self.run(&lender, i, req.is_some()).await {
                            Ok(o) => (o, 1),
                            Err(outcome) => {
                                let d = Decided { index: i, outcome, attempt: 1 };
                                return self.undo(&lender, d).await;
                            }
                        },
                    }
                }
            };
            next.insert((p.log, p.partition), p.offset + 1);
            decided.push(Decided { index: i, outcome, attempt });
        }
        let Some(mut tx) = lender.take() else { return Attempt::Again(kept(WHAT)) };
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
            Err(e) => {
                let permanent = I::is_permanent(&e);
                Attempt::Done(self.engine.commit_failed(WHAT, decided, e, permanent))
            }
        }
    }

    /// Runs message `i`'s handler with the transaction (`keyed`: its key was marked): `Err`
    /// when it failed.
    async fn run(
        &self,
        lender: &Lender<I>,
        i: usize,
        keyed: bool,
    ) -> Result<Outcome<T, E>, Outcome<T, E>> {
        let msg = &self.msgs[i];
        let Some(tx) = lender.lend(self.engine.key_of(msg).ok()) else {
            return Err(Outcome::transient(kept(WHAT)));
        };
        if !keyed && self.engine.store().markers() {
            self.engine.count_unkeyed();
        }
        match (self.handler)(tx, msg.clone()).await {
            Ok(v) => Ok(Outcome::Processed(v)),
            Err(e) => Err(Outcome::from_handler_error(e)),
        }
    }

    /// Rolls the transaction back after a message failed.
    async fn undo(&self, lender: &Lender<I>, failed: Decided<T, E>) -> Attempt<T, E> {
        // Now rather than on drop: the next transaction (a SQLite writer above all) must not
        // wait for it.
        if let Some(tx) = lender.take()
            && let Err(e) = self.engine.store().inner().rollback(tx).await
        {
            tracing::warn!(target: "idem", error = %e, "rolling back the offset-inbox batch failed");
        }
        Attempt::Fix(failed)
    }

    /// Walks each partition in offset order from its stored position, as if every message
    /// that runs succeeds (one that fails rolls the attempt back).
    fn plan<'o>(
        &self,
        order: &'o [Item],
        fixed: &HashSet<usize>,
        stored: &HashMap<Partition<'_>, Option<i64>>,
    ) -> Vec<(&'o Item, Plan)> {
        let mut plans = Vec::with_capacity(order.len());
        let mut cur: Option<i64> = None;
        let mut blocked = false;
        let mut at: Option<Partition<'_>> = None;
        for item in order {
            let p = self.place(item.0);
            let part = (p.log, p.partition);
            if at != Some(part) {
                at = Some(part);
                cur = stored.get(&part).copied().flatten();
                blocked = false;
            }
            if fixed.contains(&item.0) {
                // Failed, to be retried or dead-lettered: nothing after it may pass it.
                blocked = true;
                continue;
            }
            if cur.is_some_and(|c| p.offset < c) {
                plans.push((item, Plan::Behind));
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
                plans.push((item, Plan::Waits));
                continue;
            }
            cur = Some(p.offset + 1);
            plans.push((item, Plan::Run));
        }
        plans
    }
}
