//! The inbox decider: one transaction per round of distinct keys, over any [`TxInbox`].

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::tx::Lender;
use super::{Inbox, Savepoint, Tx, TxInbox};
use crate::engine::answer::{Answer, outcome_of};
use crate::engine::batch::{Decided, Item, Round};
use crate::engine::{Cause, Engine, FailureKind, HandlerError, Outcome};
use crate::extract::Envelope;
use crate::{Claim, ClaimRequest, DedupKey, Fingerprint, StoreError};

/// How many times a round is marked before a retryable error fails it (its messages are then
/// retried by the broker).
const MARK_ATTEMPTS: u32 = 8;
/// How many times a round's whole transaction runs when the database aborts it to keep it
/// serializable (at a savepoint, a result write or the commit) before its messages are left
/// to the broker's retry.
const TX_ATTEMPTS: u32 = 5;

/// The inbox round: a batch's messages and the handler, over an engine on `Inbox<I>`.
pub(crate) struct InboxRound<'e, 'm, I, H, M> {
    pub(crate) engine: &'e Engine<Inbox<I>>,
    pub(crate) handler: &'e H,
    pub(crate) msgs: &'m [M],
}

impl<I, H, M, Fut, T, E> Round<T, E> for InboxRound<'_, '_, I, H, M>
where
    I: TxInbox,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Fn(Tx<I>, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    // The trait's future is `Send + '_` over the handler's types; an `async fn` here would
    // need those types to outlive the borrow, which they need not.
    #[allow(clippy::manual_async_fn)]
    fn decide(&self, round: Vec<Item>) -> impl Future<Output = Vec<Decided<T, E>>> + Send + '_ {
        async move {
            if !I::ANSWERS_AT_COMMIT {
                return self.bounded_round(&round).await;
            }
            // One message per transaction: its marker is written with its effects.
            let mut decided = Vec::with_capacity(round.len());
            for item in round {
                decided.extend(self.bounded_round(std::slice::from_ref(&item)).await);
            }
            decided
        }
    }
}

/// How the fast path of a round ended.
enum Fast<T, E> {
    Done(Vec<Decided<T, E>>),
    HandlerFailed {
        at: usize,
        error: HandlerError<E>,
    },
    /// The database aborted the transaction to keep it serializable: nothing is committed.
    Serialization(StoreError),
}

impl<I, H, M, Fut, T, E> InboxRound<'_, '_, I, H, M>
where
    I: TxInbox,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Fn(Tx<I>, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    fn inbox(&self) -> &I {
        self.engine.store().inner()
    }

    /// [`round`](Self::round) bounded by the store timeout: a transaction on a connection that
    /// went half-open (a network partition) is given up, its messages failed as transient.
    /// Safe: had it committed, the redeliveries are duplicates; if not, nothing of it is left.
    async fn bounded_round(&self, round: &[Item]) -> Vec<Decided<T, E>> {
        let run = async { Ok::<_, StoreError>(self.round(round).await) };
        match self.engine.bounded("inbox transaction", run).await {
            Ok(decided) => decided,
            Err(e) => {
                self.engine.observe_store_error("commit", &e);
                failed_round(round, e)
            }
        }
    }

    /// The fast path, and after a handler failure the savepoint path for the rest; the whole
    /// round again when the database aborted its transaction to keep it serializable.
    async fn round(&self, round: &[Item]) -> Vec<Decided<T, E>> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let e = match self.fast(round).await {
                Fast::Done(decided) => return decided,
                Fast::Serialization(e) => e,
                Fast::HandlerFailed { at, error } => {
                    let rest: Vec<Item> = round.iter().filter(|(i, _)| *i != at).cloned().collect();
                    let decided =
                        if rest.is_empty() { Ok(Vec::new()) } else { self.one_by_one(&rest).await };
                    match decided {
                        Ok(mut decided) => {
                            decided.push(Decided {
                                index: at,
                                outcome: Outcome::from_handler_error(error),
                                attempt: 1,
                            });
                            return decided;
                        }
                        Err(e) => e,
                    }
                }
            };
            self.engine.observe_store_error("commit", &e);
            if attempt >= TX_ATTEMPTS {
                tracing::warn!(target: "idem", error = %e, attempt,
                    "inbox batch transaction aborted by the database again; leaving its messages to the broker's retry");
                return failed_round(round, e);
            }
            self.engine.count_tx_retry();
            tracing::debug!(target: "idem", error = %e, attempt,
                "inbox batch transaction aborted to keep it serializable; running the batch again");
            tokio::time::sleep(mark_backoff(attempt + 2)).await;
        }
    }

    /// Begin, mark all, run the handlers of the acquired keys in delivery order, store their
    /// results, commit.
    async fn fast(&self, round: &[Item]) -> Fast<T, E> {
        let inbox = self.inbox();
        let all_failed = |e: StoreError| Fast::Done(failed_round(round, e));
        let keyed: Vec<(DedupKey, Option<Fingerprint>)> = round
            .iter()
            .filter_map(|(_, r)| r.as_ref().map(|r| (r.key.clone(), r.fingerprint)))
            .collect();
        let mut attempt = 0;
        let (tx, marks) = loop {
            attempt += 1;
            let mut tx = match inbox.begin().await {
                Ok(tx) => tx,
                Err(e) => return all_failed(e),
            };
            let started = Instant::now();
            let marked = if keyed.is_empty() {
                Ok(Vec::new())
            } else {
                inbox.mark_many(I::connection(&mut tx), &keyed).await
            };
            match marked {
                Ok(m) if m.len() == keyed.len() => {
                    self.engine.observe_claim(started);
                    break (tx, m);
                }
                Ok(_) => return all_failed(StoreError::backend("mark_many", true, WrongCount)),
                // No handler has run yet, so marking again is free: concurrent batches on InnoDB
                // deadlock on the index gaps their new markers share whatever the key order, and
                // a busy SQLite or a serialization failure clears the same way.
                Err(e) if e.is_retryable() && attempt < MARK_ATTEMPTS => {
                    self.engine.observe_store_error("mark_many", &e);
                    tracing::debug!(target: "idem", error = %e, attempt,
                        "marking the batch failed with a retryable error; marking again");
                    if let Err(e) = inbox.rollback(tx).await {
                        tracing::debug!(target: "idem", error = %e, "rollback after a failed mark");
                    }
                    tokio::time::sleep(mark_backoff(attempt)).await;
                }
                Err(e) => {
                    self.engine.observe_store_error("mark_many", &e);
                    return all_failed(e);
                }
            }
        };
        let lender = Lender::<I>::new(tx);
        let mut marks = marks.into_iter();
        let mut decided = Vec::with_capacity(round.len());
        let mut results = Vec::new();
        // The keyed messages whose handler ran, for answers given at commit.
        let mut ran = Vec::new();
        for (i, req) in round {
            let key = match req {
                Some(req) => {
                    let Some(claim) = marks.next() else {
                        return all_failed(StoreError::backend("mark_many", true, WrongCount));
                    };
                    match outcome_of(Ok(claim), req) {
                        Answer::Settled(outcome, attempt) => {
                            decided.push(Decided { index: *i, outcome, attempt });
                            continue;
                        }
                        Answer::Run(_) => Some(req.key.clone()),
                    }
                }
                None => {
                    self.engine.count_unkeyed();
                    None
                }
            };
            let Some(tx) = lender.lend(key.clone()) else { return all_failed(kept()) };
            match (self.handler)(tx, self.msgs[*i].clone()).await {
                Ok(v) => {
                    if let Some(key) = &key {
                        if let Some(bytes) =
                            self.engine.encode_result(key, &v).filter(|b| b != b"null")
                        {
                            results.push((key.clone(), bytes));
                        }
                        ran.push(decided.len());
                    }
                    decided.push(Decided { index: *i, outcome: Outcome::Processed(v), attempt: 1 });
                }
                Err(error) => {
                    // Roll back now rather than on drop: the next transaction (a SQLite writer
                    // above all) must not wait for it.
                    if let Some(tx) = lender.take()
                        && let Err(e) = inbox.rollback(tx).await
                    {
                        tracing::warn!(target: "idem", error = %e, "rolling back the inbox batch failed");
                    }
                    return Fast::HandlerFailed { at: *i, error };
                }
            }
        }
        let Some(mut tx) = lender.take() else { return all_failed(kept()) };
        if !results.is_empty()
            && let Err(e) = inbox.set_results(I::connection(&mut tx), &results).await
        {
            if I::is_serialization_failure(&e) {
                return Fast::Serialization(e);
            }
            return all_failed(e);
        }
        let started = Instant::now();
        let committed = inbox.commit(tx).await;
        self.engine.observe_complete(started);
        match committed {
            Ok(None) => Fast::Done(decided),
            Ok(Some(answers)) => Fast::Done(answered_at_commit(decided, &ran, answers, round)),
            Err(e) if I::is_serialization_failure(&e) => Fast::Serialization(e),
            Err(e) => Fast::Done(self.commit_failed(decided, e)),
        }
    }

    /// The savepoint path: each message marked and handled inside its own savepoint, in
    /// key-hash order (so its row locks are taken in the one global order too), one commit.
    /// `Err` when the database aborted the transaction to keep it serializable.
    async fn one_by_one(&self, round: &[Item]) -> Result<Vec<Decided<T, E>>, StoreError> {
        let inbox = self.inbox();
        let failed_round = |round: &[Item], e: StoreError| {
            if I::is_serialization_failure(&e) { Err(e) } else { Ok(failed_round(round, e)) }
        };
        let tx = match inbox.begin().await {
            Ok(tx) => tx,
            Err(e) => return failed_round(round, e),
        };
        let mut order: Vec<&Item> = round.iter().collect();
        order.sort_by_key(|(i, r)| (r.as_ref().map(|r| r.key.hash().0), *i));
        let lender = Lender::<I>::new(tx);
        let mut decided = Vec::with_capacity(round.len());
        let mut open = false;
        for (i, req) in order {
            let Some(mut tx) = lender.take() else { return failed_round(round, kept()) };
            // The previous savepoint is released only now: a message that kept its writes
            // needs no statement of its own after them.
            let step = if open { Savepoint::ReleaseAndSet } else { Savepoint::Set };
            let marked = match inbox.savepoint(I::connection(&mut tx), step).await {
                Err(e) => return failed_round(round, e),
                Ok(()) => match req {
                    Some(req) => {
                        let item = [(req.key.clone(), req.fingerprint)];
                        let claims = inbox.mark_many(I::connection(&mut tx), &item).await;
                        Some(claims.and_then(|mut c| {
                            c.pop().ok_or_else(|| StoreError::backend("mark", true, WrongCount))
                        }))
                    }
                    None => None,
                },
            };
            lender.put(tx);
            open = true;
            let outcome = match (marked, req) {
                (Some(claim), Some(req)) => match outcome_of(claim, req) {
                    Answer::Settled(o @ Outcome::Failed(_), attempt) => Err((o, attempt)),
                    Answer::Settled(o, attempt) => Ok((o, attempt)),
                    Answer::Run(_) => self.run_one(&lender, *i, Some(&req.key)).await,
                },
                _ => {
                    self.engine.count_unkeyed();
                    self.run_one(&lender, *i, None).await
                }
            };
            let (outcome, attempt) = match outcome {
                Ok(o) => o,
                Err(o) => {
                    // Roll back this message's marker and writes alone.
                    let Some(mut tx) = lender.take() else { return failed_round(round, kept()) };
                    let undone = inbox.savepoint(I::connection(&mut tx), Savepoint::RollBack).await;
                    lender.put(tx);
                    if let Err(e) = undone {
                        return failed_round(round, e);
                    }
                    o
                }
            };
            decided.push(Decided { index: *i, outcome, attempt });
        }
        let Some(tx) = lender.take() else { return failed_round(round, kept()) };
        let started = Instant::now();
        let committed = inbox.commit(tx).await;
        self.engine.observe_complete(started);
        match committed {
            Ok(_) => Ok(decided),
            Err(e) if I::is_serialization_failure(&e) => Err(e),
            Err(e) => Ok(self.commit_failed(decided, e)),
        }
    }

    /// One handler inside the savepoint path: `Ok` keeps its writes, `Err` rolls them back.
    #[allow(clippy::type_complexity)]
    async fn run_one(
        &self,
        lender: &Lender<I>,
        i: usize,
        key: Option<&DedupKey>,
    ) -> Result<(Outcome<T, E>, u32), (Outcome<T, E>, u32)> {
        let Some(tx) = lender.lend(key.cloned()) else {
            return Err((transient(kept()), 1));
        };
        let v = match (self.handler)(tx, self.msgs[i].clone()).await {
            Ok(v) => v,
            Err(e) => return Err((Outcome::from_handler_error(e), 1)),
        };
        let stored = key.and_then(|k| {
            self.engine.encode_result(k, &v).filter(|b| b != b"null").map(|b| (k.clone(), b))
        });
        let Some(mut tx) = lender.take() else { return Err((transient(kept()), 1)) };
        let kept_result = match &stored {
            Some(item) => {
                self.inbox().set_results(I::connection(&mut tx), std::slice::from_ref(item)).await
            }
            None => Ok(()),
        };
        lender.put(tx);
        match kept_result {
            Ok(()) => Ok((Outcome::Processed(v), 1)),
            Err(e) => Err((transient(e), 1)),
        }
    }

    /// After a failed commit nothing processed is durable: those become failures (transient,
    /// or permanent when the inbox says the commit can never succeed). Duplicates and conflicts
    /// were read from committed markers and stand.
    fn commit_failed(&self, decided: Vec<Decided<T, E>>, e: StoreError) -> Vec<Decided<T, E>> {
        self.engine.observe_store_error("commit", &e);
        tracing::warn!(target: "idem", error = %e, "inbox commit failed; nothing of the batch is committed");
        let kind =
            if I::is_permanent(&e) { FailureKind::Permanent } else { FailureKind::Transient };
        let shared = Arc::new(e);
        decided
            .into_iter()
            .map(|d| match d.outcome {
                Outcome::Processed(_) => Decided {
                    outcome: Outcome::failed(kind, Cause::Store(shared_error(&shared))),
                    ..d
                },
                _ => d,
            })
            .collect()
    }
}

/// The answers of an inbox that marks at commit replace the provisional ones: a marker that
/// existed makes the run a duplicate or a conflict (its writes were not committed).
fn answered_at_commit<T: DeserializeOwned, E>(
    mut decided: Vec<Decided<T, E>>,
    ran: &[usize],
    answers: Vec<Claim>,
    round: &[Item],
) -> Vec<Decided<T, E>> {
    for (&at, claim) in ran.iter().zip(answers) {
        let d = &mut decided[at];
        let Some(req) = round.iter().find(|(i, _)| *i == d.index).and_then(|(_, r)| r.as_ref())
        else {
            continue;
        };
        if let Answer::Settled(outcome, attempt) = outcome_of(Ok(claim), req) {
            d.outcome = outcome;
            d.attempt = attempt;
        }
    }
    decided
}

/// A random pause that grows with the attempt (0.5–2.5 ms at first, at most 160 ms), so that
/// two batches that deadlocked do not meet again in step.
fn mark_backoff(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, RandomState};
    let ceiling = 1u64 << (attempt.min(7) + 10); // microseconds
    let draw = RandomState::new().hash_one((attempt, Instant::now()));
    Duration::from_micros(ceiling / 4 + draw % ceiling)
}

fn transient<T, E>(e: StoreError) -> Outcome<T, E> {
    Outcome::failed(FailureKind::Transient, Cause::Store(e))
}

/// A handler kept its `Tx` beyond its future: the transaction cannot be finished.
fn kept() -> StoreError {
    StoreError::backend(
        "inbox",
        true,
        "an inbox handler kept its transaction beyond its future; the batch is rolled back",
    )
}

/// Every message of a round whose transaction failed before any outcome was durable.
fn failed_round<T, E>(round: &[Item], e: StoreError) -> Vec<Decided<T, E>> {
    tracing::warn!(target: "idem", error = %e, "inbox batch transaction failed; retrying its messages");
    let shared = Arc::new(e);
    round
        .iter()
        .map(|(i, _)| Decided { index: *i, outcome: transient(shared_error(&shared)), attempt: 0 })
        .collect()
}

fn shared_error(e: &Arc<StoreError>) -> StoreError {
    StoreError::backend("inbox batch", e.is_retryable(), BatchFailed(Arc::clone(e)))
}

/// The failure shared by every delivery of a batch whose transaction failed.
#[derive(Debug, thiserror::Error)]
#[error("the inbox transaction of this delivery's batch failed")]
struct BatchFailed(#[source] Arc<StoreError>);

#[derive(Debug, thiserror::Error)]
#[error("the inbox answered with the wrong number of marks")]
pub(super) struct WrongCount;

/// One message in its own transaction: what [`TxInbox::process`] does.
pub(super) async fn process_one<I, T, E, F, Fut>(
    inbox: &I,
    key: &DedupKey,
    fingerprint: Option<Fingerprint>,
    writes: F,
) -> Outcome<T, E>
where
    I: TxInbox,
    T: Serialize + DeserializeOwned,
    F: FnOnce(Tx<I>) -> Fut,
    Fut: Future<Output = Result<T, HandlerError<E>>>,
{
    let req = ClaimRequest::new(key.clone(), fingerprint, Duration::ZERO, inbox.retention());
    let mut tx = match inbox.begin().await {
        Ok(tx) => tx,
        Err(e) => return transient(e),
    };
    let item = [(key.clone(), fingerprint)];
    let claim = inbox
        .mark_many(I::connection(&mut tx), &item)
        .await
        .and_then(|mut c| c.pop().ok_or_else(|| StoreError::backend("mark", true, WrongCount)));
    if let Answer::Settled(outcome, _) = outcome_of(claim, &req) {
        // Nothing was written: dropping the transaction rolls back its mark.
        let _ = inbox.rollback(tx).await;
        return outcome;
    }
    let lender = Lender::<I>::new(tx);
    let Some(lent) = lender.lend(Some(key.clone())) else { return transient(kept()) };
    let value = match writes(lent).await {
        Ok(v) => v,
        Err(e) => {
            if let Some(tx) = lender.take() {
                let _ = inbox.rollback(tx).await;
            }
            return Outcome::from_handler_error(e);
        }
    };
    let Some(mut tx) = lender.take() else { return transient(kept()) };
    if let Ok(bytes) = serde_json::to_vec(&value)
        && bytes != b"null"
    {
        match inbox.set_results(I::connection(&mut tx), &[(key.clone(), bytes)]).await {
            Ok(()) => {}
            // Too large to keep: committed without it, duplicates carry no result.
            Err(StoreError::TooLarge { .. }) => {}
            Err(e) => return transient(e),
        }
    }
    match inbox.commit(tx).await {
        Ok(None) => Outcome::Processed(value),
        Ok(Some(mut answers)) => match answers.pop() {
            Some(Claim::Acquired(_)) | None => Outcome::Processed(value),
            Some(other) => match outcome_of(Ok(other), &req) {
                Answer::Settled(outcome, _) => outcome,
                Answer::Run(_) => Outcome::Processed(value),
            },
        },
        Err(e) if I::is_permanent(&e) => Outcome::failed(FailureKind::Permanent, Cause::Store(e)),
        Err(e) => transient(e),
    }
}
