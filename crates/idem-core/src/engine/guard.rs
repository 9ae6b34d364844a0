//! Guarded work that is not a broker delivery (an HTTP request, a step): the two-phase path's
//! claim, takeover rule, heartbeat and recording, with the caller deciding what is kept.

use std::future::Future;
use std::time::Instant;

use super::two_phase::Refusal;
use super::{Context, Engine};
use crate::{Claim, ClaimRequest, DedupStore, FailKind, StoreError};

/// What guarded work asks the engine to record when it ends ([`Engine::guard`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum Finish<R> {
    /// Complete the key with `stored` as its result: later claims answer with it. Recorded
    /// like a handler's completion (bounded by the store timeout, retried for the completion
    /// retry).
    Keep {
        /// The result to keep (the caller's own encoding).
        stored: Vec<u8>,
        /// What the caller answers.
        answer: R,
    },
    /// Record nothing and give the key back: the next attempt runs again (a transient
    /// failure, an answer not worth keeping).
    Release(R),
    /// It ran, but its result cannot be kept (larger than the store takes): park the key in
    /// doubt with `reason`. It never runs again on its own; an operator can release it.
    Park {
        /// Why, kept in the record for operators.
        reason: String,
        /// What the caller answers.
        answer: R,
    },
}

/// What became of guarded work ([`Engine::guard`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum Guarded<R> {
    /// The work ran under the key's lease; `recorded` says whether its [`Finish`] was
    /// recorded (when not, the key frees itself when the lease runs out, and a later attempt
    /// runs again).
    Ran {
        /// The work's answer.
        answer: R,
        /// The attempt it ran as (1 for the first claim).
        attempt: u32,
        /// Whether the finish was recorded.
        recorded: Result<(), StoreError>,
    },
    /// Not run: the store's answer for a key that is not this caller's — completed (a
    /// duplicate: its record carries the kept result, or is parked in doubt), in progress
    /// elsewhere, or claimed with another fingerprint. Never [`Claim::Acquired`].
    Answered(Claim),
    /// Not run: the key's holders died running it (their leases ran out) as often as the
    /// engine's [crash-loop limit](crate::engine::EngineBuilder::crash_loop_limit) allows; the
    /// key is failed (a later attempt claims it again).
    CrashLoop {
        /// Holders that died running it.
        deaths: u32,
        /// The limit.
        limit: u32,
    },
    /// Not run: the key's lease had run out and the engine's
    /// [expired-lease policy](crate::engine::EngineBuilder::on_expired_lease) parks such keys in doubt.
    InDoubt {
        /// The attempt that found the lease expired.
        attempt: u32,
    },
    /// Not run: the claim failed or outlasted the store timeout (or recording a refusal did).
    Failed(StoreError),
}

impl<S: DedupStore> Engine<S> {
    /// Runs `work` at most once per key, on the engine's rules: claims `req` (bounded by the
    /// store timeout), applies the takeover rule (crash-loop limit, expired-lease policy),
    /// runs `work` under the lease (extended on the heartbeat), and records what it asks
    /// ([`Finish`]): a completion with the kept result (retried for the completion retry),
    /// a release, or a parked key. The lease and retention are the request's.
    ///
    /// What the HTTP layer (`idem-http`) decides through; for broker deliveries use
    /// [`process`](Self::process), whose results are the handler's serialized value.
    ///
    /// ```
    /// use idem_core::engine::{Finish, Guarded};
    /// use idem_core::{ClaimRequest, DedupKey, Engine, MemoryStore};
    /// use std::time::Duration;
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let engine = Engine::builder(MemoryStore::new()).scope("http").build()?;
    /// let req = ClaimRequest::new(DedupKey::new("http", "k-1")?, None,
    ///     Duration::from_secs(30), Duration::from_secs(3600));
    /// let work = |_ctx| async { Finish::Keep { stored: b"201 created".to_vec(), answer: "ran" } };
    /// assert!(matches!(engine.guard(&req, work).await, Guarded::Ran { answer: "ran", .. }));
    /// // Again: answered from the record, not run.
    /// match engine.guard(&req, work).await {
    ///     Guarded::Answered(idem_core::Claim::Completed(rec)) => {
    ///         assert_eq!(rec.result.as_deref(), Some(&b"201 created"[..]));
    ///     }
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped while `work` runs, the key stays claimed until its lease runs
    /// out, and the next attempt takes it over (attempt + 1). Callers that must answer a
    /// claimed key (an HTTP client that disconnects) run this on a task of its own.
    pub async fn guard<R, F, Fut>(&self, req: &ClaimRequest, work: F) -> Guarded<R>
    where
        F: FnOnce(Context) -> Fut,
        Fut: Future<Output = Finish<R>>,
    {
        let started = Instant::now();
        let claim = self.bounded("claim", self.store.claim(req)).await;
        self.observe_claim(started);
        let lease = match claim {
            Ok(Claim::Acquired(lease)) => lease,
            Ok(answer) => return Guarded::Answered(answer),
            Err(e) => {
                self.observe_store_error("claim", &e);
                return Guarded::Failed(e);
            }
        };
        let mut lease = match self.admit(lease, req.retain_for).await {
            Ok(lease) => lease,
            Err(Refusal::CrashLoop(c)) => {
                return Guarded::CrashLoop { deaths: c.deaths, limit: c.limit };
            }
            Err(Refusal::InDoubt { attempt }) => return Guarded::InDoubt { attempt },
            Err(Refusal::Store(e)) => return Guarded::Failed(e),
        };
        let attempt = lease.attempt();
        let ctx = Context::of(&lease);
        let finish = self.drive(&mut lease, req.lease_for, work(ctx)).await;
        let (answer, recorded) = match finish {
            Finish::Keep { stored, answer } => {
                let done = self.complete_retrying(lease, Some(&stored), req.retain_for).await;
                (answer, done)
            }
            Finish::Release(answer) => {
                self.release_quietly(lease, "after work that keeps nothing").await;
                (answer, Ok(()))
            }
            Finish::Park { reason, answer } => {
                tracing::warn!(target: "idem", key = %lease.key(), %reason, "key parked in doubt");
                let done =
                    self.fail_bounded(lease, FailKind::InDoubt, &reason, req.retain_for).await;
                (answer, done)
            }
        };
        Guarded::Ran { answer, attempt, recorded }
    }
}
