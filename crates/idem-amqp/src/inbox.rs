//! Transactional-inbox mode: the marker commits with the handler's writes, then the deliveries
//! are settled. One transaction per batch, a savepoint per delivery; SQLite and PostgreSQL.

use std::fmt::Display;
use std::sync::Arc;

use idem_core::consumer::{Cause, Conflict, Failure, FailureKind, HandlerError};
use idem_core::{DedupKey, DedupStore, Fingerprint, Outcome, StoreError};
use idem_sqlx::Mark;
use serde::de::DeserializeOwned;

use crate::{AmqpConsumer, AmqpMessage};

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

impl<S: DedupStore> AmqpConsumer<S> {
    /// The key and fingerprint from the engine's configuration, or the outcome of a delivery
    /// that has none (dead-lettered whatever the engine's missing-key policy).
    fn inbox_key<T, E>(
        &self,
        m: &AmqpMessage,
    ) -> Result<(DedupKey, Option<Fingerprint>), Outcome<T, E>> {
        let failed = |cause| Outcome::Failed(Failure { kind: FailureKind::Permanent, cause });
        let key = self.engine.key_of(m).map_err(|e| failed(e.into()))?;
        let fp = self.engine.fingerprint_of(m).map_err(|e| failed(Cause::Payload(e)))?;
        Ok((key, fp))
    }

    /// The outcome of a mark that was not first (no writes ran).
    fn not_first<T: DeserializeOwned, E>(
        &self,
        mark: Mark,
        key: DedupKey,
        fp: Option<Fingerprint>,
    ) -> Outcome<T, E> {
        match mark {
            Mark::Duplicate(rec) => {
                match rec.result.as_deref().map(serde_json::from_slice).transpose() {
                    Ok(v) => Outcome::Duplicate(v),
                    Err(e) => Outcome::Failed(Failure {
                        kind: FailureKind::Permanent,
                        cause: Cause::Decode(e),
                    }),
                }
            }
            Mark::Conflict(rec) => Outcome::Conflict(Box::new(Conflict {
                key,
                stored: rec.fingerprint,
                incoming: fp,
                stored_state: rec.state,
            })),
            // A two-phase consumer in the same scope holds a lease on the key.
            _ => Outcome::InProgressElsewhere { retry_after: self.min_delay },
        }
    }

    fn observe_inbox<T, E: Display>(&self, m: &AmqpMessage, outcome: &Outcome<T, E>) {
        let label = outcome.label();
        let scope = self.engine.scope().to_owned();
        metrics::counter!("idem_outcomes_total", "scope" => scope, "outcome" => label).increment(1);
        let key = m.properties().message_id().as_ref().map(|s| s.to_string()).unwrap_or_default();
        match outcome {
            Outcome::Failed(f) => tracing::warn!(target: "idem", scope = self.engine.scope(),
                %key, outcome = label, detail = %f.cause, "inbox delivery finished"),
            _ => tracing::debug!(target: "idem", scope = self.engine.scope(), %key,
                outcome = label, "inbox delivery finished"),
        }
    }
}

/// The outcome of writes that failed (their savepoint is rolled back).
fn failed_writes<T, E>(e: HandlerError<E>) -> Outcome<T, E> {
    let (kind, e) = match e {
        HandlerError::Transient(e) => (FailureKind::Transient, e),
        HandlerError::Permanent(e) => (FailureKind::Permanent, e),
    };
    Outcome::Failed(Failure { kind, cause: Cause::Handler(e) })
}

/// Outcomes after the batch's commit failed: nothing processed is durable, so requeue it.
fn commit_failed<T, E>(out: Vec<Outcome<T, E>>, e: &Arc<StoreError>) -> Vec<Outcome<T, E>> {
    out.into_iter()
        .map(|o| match o {
            Outcome::Processed(_) => transient_store(e),
            other => other,
        })
        .collect()
}

/// The failure shared by every delivery of a batch whose transaction failed.
#[derive(Debug, thiserror::Error)]
#[error("the inbox transaction of this delivery's batch failed")]
struct BatchFailed(#[source] Arc<StoreError>);

fn transient_store<T, E>(e: &Arc<StoreError>) -> Outcome<T, E> {
    Outcome::Failed(Failure {
        kind: FailureKind::Transient,
        cause: Cause::Store(StoreError::backend("inbox batch", true, BatchFailed(Arc::clone(e)))),
    })
}
