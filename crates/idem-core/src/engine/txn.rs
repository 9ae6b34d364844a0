//! What the transactional rounds (the inbox and the offset inbox) share: the store timeout over
//! a round's transaction, the pause between attempts, and the failures a round's deliveries
//! share when its transaction fails or its commit does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::batch::{Decided, Item};
use super::{Cause, Engine, FailureKind, Outcome};
use crate::StoreError;

impl<B> Engine<B> {
    /// `round`'s transaction(s), bounded by the store timeout: a transaction on a connection
    /// that went half-open (a network partition) is given up, its messages failed as
    /// transient. Safe: had it committed, the redeliveries are duplicates; if not, nothing of
    /// it is left.
    pub(crate) async fn bounded_tx<T, E>(
        &self,
        what: &'static str,
        round: &[Item],
        run: impl Future<Output = Vec<Decided<T, E>>>,
    ) -> Vec<Decided<T, E>> {
        match self.bounded(what, async { Ok(run.await) }).await {
            Ok(decided) => decided,
            Err(e) => {
                self.observe_store_error("commit", &e);
                failed_round(what, round, e)
            }
        }
    }

    /// After a failed commit nothing processed is durable: those become failures (transient,
    /// or `permanent` when the database says the commit can never succeed). Duplicates and
    /// conflicts were read from committed rows and stand.
    pub(crate) fn commit_failed<T, E>(
        &self,
        what: &'static str,
        decided: Vec<Decided<T, E>>,
        e: StoreError,
        permanent: bool,
    ) -> Vec<Decided<T, E>> {
        self.observe_store_error("commit", &e);
        tracing::warn!(target: "idem", error = %e, "{what} commit failed; nothing of the batch is committed");
        let kind = if permanent { FailureKind::Permanent } else { FailureKind::Transient };
        let shared = Arc::new(e);
        decided
            .into_iter()
            .map(|d| match d.outcome {
                Outcome::Processed(_) => Decided {
                    outcome: Outcome::failed(kind, Cause::Store(shared_error(what, &shared))),
                    ..d
                },
                _ => d,
            })
            .collect()
    }
}

/// Every message of a round whose transaction failed before any outcome was durable.
pub(crate) fn failed_round<T, E>(
    what: &'static str,
    round: &[Item],
    e: StoreError,
) -> Vec<Decided<T, E>> {
    tracing::warn!(target: "idem", error = %e, "{what} transaction failed; retrying its messages");
    let shared = Arc::new(e);
    round
        .iter()
        .map(|(i, _)| Decided {
            index: *i,
            outcome: Outcome::transient(shared_error(what, &shared)),
            attempt: 0,
        })
        .collect()
}

/// One delivery's share of a failure of its batch's transaction.
fn shared_error(what: &'static str, e: &Arc<StoreError>) -> StoreError {
    StoreError::backend(what, e.is_retryable(), BatchFailed(Arc::clone(e)))
}

/// The failure shared by every delivery of a batch whose transaction failed.
#[derive(Debug, thiserror::Error)]
#[error("the transaction of this delivery's batch failed")]
struct BatchFailed(#[source] Arc<StoreError>);

/// A random pause that grows with the attempt (0.5–2.5 ms at first, at most 160 ms), so that
/// two batches that deadlocked do not meet again in step.
pub(crate) fn backoff(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, RandomState};
    let ceiling = 1u64 << (attempt.min(7) + 10); // microseconds
    let draw = RandomState::new().hash_one((attempt, Instant::now()));
    Duration::from_micros(ceiling / 4 + draw % ceiling)
}
