//! Recording completions: retried while the store fails for a retryable reason, batched into
//! one `complete_many` (group commit) for a batch's decisions.

use std::fmt::Display;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::batch::Decided;
use super::ride::{Driver, Riders};
use super::{Cause, Engine, FailureKind, Outcome};
use crate::store::Completion;
use crate::telemetry::{self, COMPLETE_RETRIES_TOTAL};
use crate::{DedupStore, Lease, StoreError};

/// What became of an acquired claim's handler: its outcome, or a completion still to record.
pub(super) enum Ran<T, E> {
    Done(Outcome<T, E>),
    Complete { lease: Lease, value: T, stored: Option<Vec<u8>> },
}

/// One keyed delivery being decided: its span (closed with the outcome) and what it knows.
pub(super) struct Decision<T, E> {
    pub(super) span: tracing::Span,
    pub(super) attempt: u32,
    pub(super) ran: Ran<T, E>,
}

/// Records a decided delivery's attempt and outcome on its span.
pub(super) fn close<T, E>(span: &tracing::Span, attempt: u32, outcome: &Outcome<T, E>) {
    span.record("attempt", attempt);
    span.record("outcome", outcome.kind().as_str());
}

impl<S: DedupStore> Engine<S> {
    /// Completes a lease, trying again while the store fails for a retryable reason, for up to
    /// the configured completion retry (the effect has run: giving up would leave the key
    /// leased and its redelivered copy would run the handler again once the lease ran out).
    /// Fencing makes a repeat of a completion that did apply fail; it never applies twice.
    pub(super) async fn complete_retrying(
        &self,
        mut lease: Lease,
        stored: Option<&[u8]>,
        retain: Duration,
    ) -> Result<(), StoreError> {
        let mut pauses = RetryPauses::new(self.cfg.complete_retry);
        loop {
            let again = lease.retry_copy();
            let started = Instant::now();
            let done = self.bounded("complete", self.store.complete(lease, stored, retain)).await;
            self.observe_complete(started);
            if let Err(e) = &done {
                telemetry::store_error(&self.cfg.scope, "complete", e);
            }
            match done {
                Err(e) if e.is_retryable() => {
                    let Some(pause) = pauses.next(&e, &self.cfg.scope) else { return Err(e) };
                    tokio::time::sleep(pause).await;
                    lease = again;
                }
                done => return done,
            }
        }
    }

    /// [`complete_retrying`](Self::complete_retrying) for a batch: one answer per completion,
    /// in order. A retryable failure of the whole `complete_many`, or of single completions,
    /// is tried again for the completions it concerns.
    /// The first try carries the claims riding with `driver` (see [`ride`](super::ride)).
    async fn complete_many_retrying(
        &self,
        items: Vec<Completion>,
        driver: Option<&Driver>,
    ) -> Vec<Result<(), StoreError>> {
        let mut answers: Vec<Option<Result<(), StoreError>>> = items.iter().map(|_| None).collect();
        let mut pending: Vec<(usize, Completion)> = items.into_iter().enumerate().collect();
        let mut pauses = RetryPauses::new(self.cfg.complete_retry);
        let mut riders = match driver {
            Some(d) => Some(d.take().await).filter(|r| !r.is_empty()),
            None => None,
        };
        while !pending.is_empty() {
            let again: Vec<(usize, Completion)> = pending
                .iter()
                .map(|(i, c)| {
                    let copy = Completion {
                        lease: c.lease.retry_copy(),
                        result: c.result.clone(),
                        retain_for: c.retain_for,
                    };
                    (*i, copy)
                })
                .collect();
            let n = pending.len();
            let batch = pending.into_iter().map(|(_, c)| c).collect();
            let started = Instant::now();
            let done = match riders.take() {
                None => self.bounded("complete_many", self.store.complete_many(batch)).await,
                Some(riders) => self.complete_carrying(batch, riders).await,
            };
            self.observe_complete(started);
            let got = match done {
                Ok(r) if r.len() == n => {
                    // Each completion that failed is one failed store write.
                    for e in r.iter().filter_map(|a| a.as_ref().err()) {
                        telemetry::store_error(&self.cfg.scope, "complete_many", e);
                    }
                    r
                }
                Ok(r) => {
                    tracing::error!(target: "idem", asked = n, got = r.len(),
                        "store answered complete_many with the wrong number of results");
                    let e = StoreError::backend("complete_many", true, WrongCount);
                    telemetry::store_error(&self.cfg.scope, "complete_many", &e);
                    shared_failure(n, e).collect()
                }
                Err(e) => {
                    telemetry::store_error(&self.cfg.scope, "complete_many", &e);
                    shared_failure(n, e).collect()
                }
            };
            let mut retry = Vec::new();
            let mut first_retryable = None;
            for ((i, copy), answer) in again.into_iter().zip(got) {
                match answer {
                    Err(e) if e.is_retryable() => {
                        retry.push((i, copy));
                        answers[i] = Some(Err(e));
                        first_retryable.get_or_insert(i);
                    }
                    done => answers[i] = Some(done),
                }
            }
            let Some(first) = first_retryable else { break };
            let pause = match &answers[first] {
                Some(Err(e)) => pauses.next(e, &self.cfg.scope),
                _ => None,
            };
            let Some(pause) = pause else { break };
            tokio::time::sleep(pause).await;
            pending = retry;
        }
        answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| Err(StoreError::backend("complete_many", true, WrongCount)))
            })
            .collect()
    }

    /// `complete_many` of `batch` with the claims of `riders` in the same write
    /// ([`DedupStore::complete_and_claim`]), each rider answered. Riders whose claims failed
    /// (or the whole call timed out) are dropped unanswered: they claim again, alone.
    async fn complete_carrying(
        &self,
        batch: Vec<Completion>,
        riders: Riders,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let reqs = riders.requests();
        let both = self.store.complete_and_claim(batch, &reqs);
        let (done, claims) = self.bounded("complete_and_claim", async { Ok(both.await) }).await?;
        match claims {
            Ok(c) if c.len() == reqs.len() => riders.answer(c),
            Ok(_) => {
                let e = StoreError::backend("claim_many", true, WrongCount);
                self.observe_store_error("claim_many", &e);
            }
            Err(e) => self.observe_store_error("claim_many", &e),
        }
        done
    }

    /// Records the completions of a round's decisions in one `complete_many` (group commit),
    /// then closes each decision with its outcome. The first carries the claims riding with
    /// `driver`.
    pub(super) async fn complete_all<T, E: Display>(
        &self,
        decided: Vec<(usize, Decision<T, E>)>,
        driver: Option<&Driver>,
    ) -> Vec<Decided<T, E>> {
        let mut completions = Vec::new();
        let mut waiting = Vec::with_capacity(decided.len());
        for (i, Decision { span, attempt, ran }) in decided {
            let state = match ran {
                Ran::Complete { lease, value, stored } => {
                    completions.push(Completion {
                        lease,
                        result: stored,
                        retain_for: self.cfg.retain,
                    });
                    Err(value)
                }
                Ran::Done(o) => Ok(o),
            };
            waiting.push((i, span, attempt, state));
        }
        let mut answers = match completions.len() {
            0 => Vec::new().into_iter(),
            _ => self.complete_many_retrying(completions, driver).await.into_iter(),
        };
        waiting
            .into_iter()
            .map(|(index, span, attempt, state)| {
                let outcome = state.unwrap_or_else(|value| {
                    let done = answers.next().unwrap_or_else(|| {
                        Err(StoreError::backend("complete_many", true, WrongCount))
                    });
                    completed(value, done)
                });
                close(&span, attempt, &outcome);
                Decided { index, outcome, attempt }
            })
            .collect()
    }
}

/// The pauses between tries of a completion: 25 ms, doubling up to 1 s, while the next try
/// would start within the limit.
struct RetryPauses {
    deadline: tokio::time::Instant,
    pause: Duration,
}

impl RetryPauses {
    fn new(limit: Duration) -> Self {
        Self { deadline: tokio::time::Instant::now() + limit, pause: Duration::from_millis(25) }
    }

    /// The pause before the next try after `e`, or `None` when the limit is reached.
    fn next(&mut self, e: &StoreError, scope: &str) -> Option<Duration> {
        let pause = self.pause;
        if tokio::time::Instant::now() + pause > self.deadline {
            return None;
        }
        self.pause = (pause * 2).min(Duration::from_secs(1));
        tracing::warn!(target: "idem", scope, error = %e, ?pause,
            "recording a completion failed; trying again");
        metrics::counter!(COMPLETE_RETRIES_TOTAL, "scope" => scope.to_owned()).increment(1);
        Some(pause)
    }
}

/// The outcome of a handler whose completion was (or was not) recorded.
pub(super) fn completed<T, E>(value: T, done: Result<(), StoreError>) -> Outcome<T, E> {
    match done {
        Ok(()) => Outcome::Processed(value),
        Err(e) => Outcome::failed(FailureKind::Transient, Cause::Store(e)),
    }
}

/// `n` copies of one batch failure, each with its own error: the first the failure itself,
/// the others pointing at it.
fn shared_failure(n: usize, e: StoreError) -> std::vec::IntoIter<Result<(), StoreError>> {
    let retryable = e.is_retryable();
    let shared = Arc::new(e);
    (0..n)
        .map(|_| Err(StoreError::backend("complete_many", retryable, Arc::clone(&shared))))
        .collect::<Vec<_>>()
        .into_iter()
}

#[derive(Debug, thiserror::Error)]
#[error("the store answered with the wrong number of results")]
struct WrongCount;
