//! What every path of the engine reports: the outcome's event and count, store timings and
//! errors, and the stored form of a result.

use std::fmt::Display;
use std::future::Future;
use std::time::Instant;

use serde::Serialize;

use super::{Engine, HandlerError, Outcome};
use crate::telemetry::{
    self, CLAIM_DURATION_SECONDS, COMPLETE_DURATION_SECONDS, MISSING_KEY_TOTAL, OUTCOMES_TOTAL,
    TX_RETRIES_TOTAL,
};
use crate::{DedupKey, StoreError};

impl<B> Engine<B> {
    /// The handler result as it is stored for duplicates: its JSON, or `None` (with a warning)
    /// when it does not serialize or is larger than `max_result_bytes`, the one result limit of
    /// both modes.
    pub(crate) fn encode_result<T: Serialize>(&self, key: &DedupKey, value: &T) -> Option<Vec<u8>> {
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

    /// Records how long a claim (or a batch of marks) took.
    pub(crate) fn observe_claim(&self, started: Instant) {
        telemetry::observe_duration(CLAIM_DURATION_SECONDS, &self.cfg.scope, started);
    }

    /// Records how long a completion (or an inbox batch's commit) took.
    pub(crate) fn observe_complete(&self, started: Instant) {
        telemetry::observe_duration(COMPLETE_DURATION_SECONDS, &self.cfg.scope, started);
    }

    /// Counts a failed store call in `idem_store_errors_total{scope, op, retryable}`.
    pub(crate) fn observe_store_error(&self, op: &'static str, e: &StoreError) {
        telemetry::store_error(&self.cfg.scope, op, e);
    }

    /// A finished delivery's `tracing` event and its `idem_outcomes_total` count.
    pub(crate) fn observe<T, E: Display>(
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

    /// `fut`, a store call, bounded by the store timeout: past it, a retryable
    /// [`StoreError`] saying so (the connection may be half-open).
    pub(crate) async fn bounded<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let limit = self.cfg.store_timeout;
        let Some(deadline) = tokio::time::Instant::now().checked_add(limit) else {
            return fut.await;
        };
        match tokio::time::timeout_at(deadline, fut).await {
            Ok(answer) => answer,
            Err(_) => Err(StoreError::backend(op, true, TimedOut(limit))),
        }
    }

    /// Counts an inbox batch transaction run again after the database aborted it to keep it
    /// serializable, in `idem_tx_retries_total`.
    pub(crate) fn count_tx_retry(&self) {
        metrics::counter!(TX_RETRIES_TOTAL, "scope" => self.cfg.scope.clone()).increment(1);
    }

    /// Counts a message without a key, processed without dedup as the missing-key policy
    /// says, in `idem_missing_key_total`.
    pub(crate) fn count_unkeyed(&self) {
        metrics::counter!(MISSING_KEY_TOTAL, "scope" => self.cfg.scope.clone()).increment(1);
    }

    /// Runs a handler for a message without a key ([`count_unkeyed`](Self::count_unkeyed));
    /// the caller observes the outcome.
    pub(crate) async fn run_unkeyed<C, T, E, F, Fut>(&self, ctx: C, handler: F) -> Outcome<T, E>
    where
        F: FnOnce(C) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        self.count_unkeyed();
        match handler(ctx).await {
            Ok(v) => Outcome::Processed(v),
            Err(e) => Outcome::from_handler_error(e),
        }
    }
}

/// A store call or an inbox transaction that outlived the store timeout.
#[derive(Debug, thiserror::Error)]
#[error(
    "no answer within the store timeout ({0:?}): the connection may be half-open (a network \
     partition drops packets without a reset); given up, to be retried"
)]
pub(crate) struct TimedOut(pub(crate) std::time::Duration);
