//! Idempotent jobs: a scheduled or retried job that runs at most once per key.
//!
//! A job is keyed by what it covers — its name and its run period, such as
//! `("nightly-invoices", "2026-12-02")` — never by when it was started. It runs on the
//! [`Engine`] with no payload: the first run claims the period under a lease, runs and
//! completes it; a later run of the same period gets the stored result back; an overlapping run
//! waits or skips ([`Overlap`]); a crashed run's lease runs out and the next run takes over with
//! `attempt + 1`.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::engine::{ConfigError, Context, HandlerError};
use crate::extract::Message;
use crate::{DedupStore, Engine, FingerprintSpec, Outcome};

/// What a run does when another run of the same period holds the lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Overlap {
    /// Return [`Outcome::InProgressElsewhere`] at once (the default): the scheduler tries again
    /// at its next tick.
    Skip,
    /// Wait for the other run to finish, checking every `poll` (or sooner when its lease ends),
    /// for at most `timeout`; then return what the other run stored, or run if it released the
    /// period or crashed. After `timeout`, [`Outcome::InProgressElsewhere`].
    Wait {
        /// How often to check again.
        poll: Duration,
        /// How long to wait in all.
        timeout: Duration,
    },
}

/// A job that runs at most once per period.
///
/// ```
/// use idem_core::{MemoryStore, Outcome, engine::HandlerError, job::Job};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let job = Job::builder(MemoryStore::new(), "nightly-invoices").build()?;
/// let send = |_ctx| async { Ok::<_, HandlerError<String>>(42_u32) }; // invoices sent
/// assert!(matches!(job.run("2026-12-02", send).await, Outcome::Processed(42)));
/// // The scheduler fires again (a retry, a second replica): the period is already done.
/// assert!(matches!(job.run("2026-12-02", send).await, Outcome::Duplicate(Some(42))));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Job<S> {
    engine: Engine<S>,
    overlap: Overlap,
}

impl<S: DedupStore> Job<S> {
    /// A builder for the job `name` (its scope in the store) over `store`.
    pub fn builder(store: S, name: impl Into<String>) -> JobBuilder<S> {
        JobBuilder {
            inner: Engine::builder(store)
                .scope(name)
                .fingerprint(FingerprintSpec::None)
                .lease(Duration::from_secs(300))
                .retain(Duration::from_secs(90 * 86_400)),
            overlap: Overlap::Skip,
        }
    }

    /// The job's name.
    pub fn name(&self) -> &str {
        self.engine.scope()
    }

    /// Runs the job for `period` unless that period already ran.
    ///
    /// - [`Outcome::Processed`]: this call ran it; the result is stored.
    /// - [`Outcome::Duplicate`]: the period already ran; the stored result.
    /// - [`Outcome::InProgressElsewhere`]: another run holds it (after waiting, with
    ///   [`Overlap::Wait`]).
    /// - [`Outcome::Failed`]: the job failed (a transient failure released the period for the
    ///   next run; a permanent one is recorded and the next run tries again) or the store failed.
    ///
    /// The handler's [`Context`] carries the attempt number, whether it took over a crashed run
    /// ([`Context::took_over_expired`]) and a downstream idempotency key for external calls.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped after its claim, the period stays in progress until the lease
    /// runs out, and the next run then takes it over.
    pub async fn run<T, E, F, Fut>(&self, period: &str, handler: F) -> Outcome<T, E>
    where
        T: Serialize + DeserializeOwned,
        E: std::fmt::Display,
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let msg = Message::new(Vec::new()).with_message_id(period);
        let deadline = match self.overlap {
            Overlap::Wait { timeout, .. } => Some(tokio::time::Instant::now() + timeout),
            Overlap::Skip => None,
        };
        // The handler runs at most once: `process` calls it only when it acquired the period,
        // and that ends the loop.
        let mut handler = Some(handler);
        loop {
            let outcome = self
                .engine
                .process(&msg, |ctx| match handler.take() {
                    Some(h) => h(ctx),
                    None => unreachable!("the handler runs once: acquiring ends the loop"),
                })
                .await;
            let (
                Outcome::InProgressElsewhere { retry_after },
                Some(deadline),
                Overlap::Wait { poll, .. },
            ) = (&outcome, deadline, self.overlap)
            else {
                return outcome;
            };
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return outcome;
            }
            let pause = poll.min(*retry_after).max(Duration::from_millis(1));
            tokio::time::sleep_until((now + pause).min(deadline)).await;
        }
    }
}

/// Builds a [`Job`]. Defaults: lease 5 minutes, retention 90 days, [`Overlap::Skip`].
#[must_use]
pub struct JobBuilder<S> {
    inner: crate::engine::EngineBuilder<S>,
    overlap: Overlap,
}

impl<S: DedupStore> JobBuilder<S> {
    /// How long a run holds its period before another run may take it over (a crashed run is
    /// taken over this long after it claimed, or after its last heartbeat).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.inner = self.inner.lease(lease);
        self
    }

    /// How long a finished period is remembered; a run of an older period runs again.
    pub fn retain(mut self, retain: Duration) -> Self {
        self.inner = self.inner.retain(retain);
        self
    }

    /// Extends the lease every `interval` while the job runs, so a long job keeps its period and
    /// only a crashed one is taken over.
    pub fn heartbeat(mut self, interval: Duration) -> Self {
        self.inner = self.inner.heartbeat(interval);
        self
    }

    /// What an overlapping run does.
    pub fn overlap(mut self, overlap: Overlap) -> Self {
        self.overlap = overlap;
        self
    }

    /// Validates the configuration.
    ///
    /// # Errors
    /// [`ConfigError`] for an invalid name or a zero lease or retention.
    pub fn build(self) -> Result<Job<S>, ConfigError> {
        Ok(Job { engine: self.inner.build()?, overlap: self.overlap })
    }
}
