//! The inbox decider: one transaction per round of distinct keys, over any [`TxInbox`].

use std::fmt::Display;
use std::future::Future;
use std::time::Instant;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::batch::{Decided, Item, Round};
use super::two_phase::CrashLoop;
use super::txn::{backoff, failed_round};
use super::{Engine, Handler, HandlerError, Outcome};
use crate::answer::{Answer, outcome_of};
use crate::extract::{Envelope, Redelivery};
use crate::inbox::tx::{Lender, kept};
use crate::inbox::{Inbox, Savepoint, Tx, TxInbox, WrongCount};
use crate::{Claim, ClaimRequest, DedupKey, DedupStore, Fingerprint, StoreError};

/// What the transaction is called in errors and logs.
const WHAT: &str = "inbox";

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

impl<I, H, M, T, E> Round<T, E> for InboxRound<'_, '_, I, H, M>
where
    I: TxInbox,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Handler<Tx<I>, M, Value = T, Error = E>,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
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
            // Redeliveries run after the rest, one at a time, each under a crash note.
            let notes = self.inbox().crash_note_store();
            let (suspects, round): (Vec<Item>, Vec<Item>) =
                round.into_iter().partition(|(i, r)| {
                    notes.is_some()
                        && r.is_some()
                        && self.msgs[*i].redelivery() != Redelivery::First
                });
            let mut decided = Vec::with_capacity(round.len() + suspects.len());
            if I::ANSWERS_AT_COMMIT {
                // One message per transaction: its marker is written with its effects.
                for item in round {
                    let one = std::slice::from_ref(&item);
                    decided.extend(self.engine.bounded_tx(WHAT, one, self.round(one, None)).await);
                }
            } else if !round.is_empty() {
                decided = self.engine.bounded_tx(WHAT, &round, self.round(&round, None)).await;
            }
            if let Some(notes) = notes {
                for item in suspects {
                    decided.extend(self.suspect(notes, item).await);
                }
            }
            decided
        }
    }
}

/// The crash note of `key`: a key of its own (the scope gains a suffix) in the markers' store.
fn note_key(key: &DedupKey) -> Result<DedupKey, crate::KeyError> {
    DedupKey::with_limit(format!("{}{NOTE_SUFFIX}", key.scope()), key.id(), usize::MAX)
}

/// What a crash note's scope adds to its message's.
const NOTE_SUFFIX: &str = ":crash-note";

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

impl<I, H, M, T, E> InboxRound<'_, '_, I, H, M>
where
    I: TxInbox,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Handler<Tx<I>, M, Value = T, Error = E>,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    fn inbox(&self) -> &I {
        self.engine.store().inner()
    }

    /// A redelivered message, alone: its crash note claimed outside any transaction (a death
    /// of the process that ran it last is counted by that claim), then its own transaction —
    /// unless the deaths reached the crash-loop limit and the mark would run it — then the
    /// note given back. A message the broker says was delivered before
    /// ([`Redelivery::Again`]) counts one death more than its note holds: a process may have
    /// died running the batch it came in, before any note was written (first deliveries write
    /// none). A [`Redelivery::Possible`] one (Kafka) counts only the deaths its notes saw.
    async fn suspect(&self, notes: &impl DedupStore, item: Item) -> Vec<Decided<T, E>> {
        let one = std::slice::from_ref(&item);
        let unnoted = || self.engine.bounded_tx(WHAT, one, self.round(one, None));
        let Some(req) = &item.1 else { return unnoted().await };
        let Ok(key) = note_key(&req.key) else { return unnoted().await };
        let note = ClaimRequest::new(key, None, self.engine.lease(), self.inbox().retention());
        let lease = match self.engine.bounded("note", notes.claim(&note)).await {
            Ok(Claim::Acquired(lease)) => lease,
            Ok(Claim::InProgress { retry_after, .. }) => {
                // Another consumer runs it, or the last one's note has not run out yet.
                let outcome = Outcome::InProgressElsewhere { retry_after };
                return vec![Decided { index: item.0, outcome, attempt: 0 }];
            }
            Ok(_) => return unnoted().await,
            Err(e) => {
                self.engine.observe_store_error("note", &e);
                return failed_round(WHAT, one, e);
            }
        };
        let again = u32::from(self.msgs[item.0].redelivery() == Redelivery::Again);
        let deaths = lease.deaths().saturating_add(again);
        let stop = self.engine.crash_loop(deaths);
        tracing::debug!(target: "idem", key = %req.key, deaths,
            "a redelivered message runs alone under its crash note");
        let decided = self.engine.bounded_tx(WHAT, one, self.round(one, stop)).await;
        if let Err(e) = self.engine.bounded("note", notes.release(lease)).await {
            self.engine.observe_store_error("note", &e);
            tracing::debug!(target: "idem", error = %e, "giving a crash note back failed; it runs out with its lease");
        }
        decided
    }

    /// The fast path, and after a handler failure the savepoint path for the rest; the whole
    /// round again when the database aborted its transaction to keep it serializable.
    async fn round(&self, round: &[Item], stop: Option<CrashLoop>) -> Vec<Decided<T, E>> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let e = match self.fast(round, stop).await {
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
                return failed_round(WHAT, round, e);
            }
            self.engine.count_tx_retry();
            tracing::debug!(target: "idem", error = %e, attempt,
                "inbox batch transaction aborted to keep it serializable; running the batch again");
            tokio::time::sleep(backoff(attempt + 2)).await;
        }
    }

    /// Begin, mark all, run the handlers of the acquired keys in delivery order, store their
    /// results, commit. With `stop` (a suspect's round of one, at the crash-loop limit) a key
    /// the mark acquires is not run: the transaction is rolled back and the message failed as
    /// a crash loop.
    async fn fast(&self, round: &[Item], stop: Option<CrashLoop>) -> Fast<T, E> {
        let inbox = self.inbox();
        let all_failed = |e: StoreError| Fast::Done(failed_round(WHAT, round, e));
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
                    tokio::time::sleep(backoff(attempt)).await;
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
                        Answer::Run(_) => {
                            if let Some(crash_loop) = stop {
                                if let Some(tx) = lender.take()
                                    && let Err(e) = inbox.rollback(tx).await
                                {
                                    tracing::debug!(target: "idem", error = %e, "rolling back a crash loop's mark");
                                }
                                let outcome = crash_loop.outcome();
                                decided.push(Decided { index: *i, outcome, attempt: 1 });
                                return Fast::Done(decided);
                            }
                            Some(req.key.clone())
                        }
                    }
                }
                None => {
                    self.engine.count_unkeyed();
                    None
                }
            };
            let Some(tx) = lender.lend(key.clone()) else { return all_failed(kept(WHAT)) };
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
        let Some(mut tx) = lender.take() else { return all_failed(kept(WHAT)) };
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
            Err(e) => {
                let permanent = I::is_permanent(&e);
                Fast::Done(self.engine.commit_failed(WHAT, decided, e, permanent))
            }
        }
    }

    /// The savepoint path: each message marked and handled inside its own savepoint, in
    /// key-hash order (so its row locks are taken in the one global order too), one commit.
    /// `Err` when the database aborted the transaction to keep it serializable.
    async fn one_by_one(&self, round: &[Item]) -> Result<Vec<Decided<T, E>>, StoreError> {
        let inbox = self.inbox();
        let failed_round = |round: &[Item], e: StoreError| {
            if I::is_serialization_failure(&e) { Err(e) } else { Ok(failed_round(WHAT, round, e)) }
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
            let Some(mut tx) = lender.take() else { return failed_round(round, kept(WHAT)) };
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
                    let Some(mut tx) = lender.take() else {
                        return failed_round(round, kept(WHAT));
                    };
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
        let Some(tx) = lender.take() else { return failed_round(round, kept(WHAT)) };
        let started = Instant::now();
        let committed = inbox.commit(tx).await;
        self.engine.observe_complete(started);
        match committed {
            Ok(_) => Ok(decided),
            Err(e) if I::is_serialization_failure(&e) => Err(e),
            Err(e) => {
                let permanent = I::is_permanent(&e);
                Ok(self.engine.commit_failed(WHAT, decided, e, permanent))
            }
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
            return Err((Outcome::transient(kept(WHAT)), 1));
        };
        let v = match (self.handler)(tx, self.msgs[i].clone()).await {
            Ok(v) => v,
            Err(e) => return Err((Outcome::from_handler_error(e), 1)),
        };
        let stored = key.and_then(|k| {
            self.engine.encode_result(k, &v).filter(|b| b != b"null").map(|b| (k.clone(), b))
        });
        let Some(mut tx) = lender.take() else { return Err((Outcome::transient(kept(WHAT)), 1)) };
        let kept_result = match &stored {
            Some(item) => {
                self.inbox().set_results(I::connection(&mut tx), std::slice::from_ref(item)).await
            }
            None => Ok(()),
        };
        lender.put(tx);
        match kept_result {
            Ok(()) => Ok((Outcome::Processed(v), 1)),
            Err(e) => Err((Outcome::transient(e), 1)),
        }
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
