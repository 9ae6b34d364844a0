//! Group commit: [`Batched`] coalesces the claims and completions of many concurrent in-flight
//! messages into one `claim_many` / `complete_many` call — one statement and one commit on the
//! SQL stores — with the same answer per message as an unbatched call.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::store::Completion;
use crate::{
    Claim, ClaimRequest, Counts, DedupKey, DedupStore, FailKind, InspectStore, Lease, ListFilter,
    Record, StoreError,
};

/// How [`Batched`] groups calls.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct BatchConfig {
    /// Most calls in one batch (default 256).
    pub max_batch: usize,
    /// Batches of one kind in flight at once (default 2): while they run, new calls queue and
    /// go out together in the next batch. Keep it at or below the store's connection pool size.
    /// Fewer in flight means bigger batches and fewer commits: on PostgreSQL at 32 tasks, 2
    /// carried about 1.6× the claim + complete throughput of 4 (`docs/BENCHMARKS.md`).
    pub max_in_flight: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        Self { max_batch: 256, max_in_flight: 2 }
    }
}

impl BatchConfig {
    /// Sets the largest batch (at least 1).
    #[must_use]
    pub fn max_batch(mut self, n: usize) -> Self {
        self.max_batch = n.max(1);
        self
    }

    /// Sets how many batches of one kind may be in flight (at least 1).
    #[must_use]
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n.max(1);
        self
    }
}

type ClaimJob = (ClaimRequest, oneshot::Sender<Result<Claim, StoreError>>);
type CompleteJob = (Completion, oneshot::Sender<Result<(), StoreError>>);

/// A store wrapper that turns concurrent `claim` and `complete` calls into batches.
///
/// There is no timer: the first call goes out at once, and calls made while batches are in
/// flight queue and leave together when a batch slot frees up. At one message at a time it adds
/// a channel hop and nothing else; at 32 concurrent messages one durable commit carries many
/// claims. Answers are exactly those of the inner store's `claim_many` / `complete_many`: two
/// deliveries of one key in one batch are decided in order, so at most one acquires it.
///
/// Other calls (`fail`, `release`, `extend`, `purge`, `claim_many`, inspection) go straight to
/// the inner store.
///
/// ```
/// use std::time::Duration;
/// use idem_core::{BatchConfig, Batched, Claim, ClaimRequest, DedupKey, DedupStore, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = Batched::new(MemoryStore::new(), BatchConfig::default());
/// let req = ClaimRequest::new(DedupKey::new("orders", "o-1")?, None,
///                             Duration::from_secs(30), Duration::from_secs(3600));
/// let Claim::Acquired(lease) = store.claim(&req).await? else { unreachable!() };
/// store.complete(lease, Some(b"ok"), Duration::from_secs(3600)).await?;
/// # Ok(()) }
/// ```
pub struct Batched<S> {
    inner: Arc<S>,
    claims: mpsc::UnboundedSender<ClaimJob>,
    completes: mpsc::UnboundedSender<CompleteJob>,
}

impl<S> Clone for Batched<S> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            claims: self.claims.clone(),
            completes: self.completes.clone(),
        }
    }
}

impl<S> std::fmt::Debug for Batched<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batched").finish_non_exhaustive()
    }
}

impl<S: DedupStore + 'static> Batched<S> {
    /// Wraps `inner`, starting one batching task for claims and one for completions; they end
    /// when the last clone of the wrapper is dropped.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn new(inner: S, config: BatchConfig) -> Self {
        let inner = Arc::new(inner);
        let (claims, claim_rx) = mpsc::unbounded_channel();
        let (completes, complete_rx) = mpsc::unbounded_channel();
        tokio::spawn(run_claims(Arc::clone(&inner), claim_rx, config));
        tokio::spawn(run_completes(Arc::clone(&inner), complete_rx, config));
        Self { inner, claims, completes }
    }
}

impl<S> Batched<S> {
    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }
}

/// Takes the first queued job, waits for a batch slot, then drains what queued meanwhile.
async fn next_batch<J>(
    rx: &mut mpsc::UnboundedReceiver<J>,
    slots: &Arc<Semaphore>,
    max: usize,
) -> Option<(Vec<J>, tokio::sync::OwnedSemaphorePermit)> {
    let first = rx.recv().await?;
    let permit = Arc::clone(slots).acquire_owned().await.ok()?;
    let mut batch = vec![first];
    while batch.len() < max {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
    Some((batch, permit))
}

async fn run_claims<S: DedupStore + 'static>(
    inner: Arc<S>,
    mut rx: mpsc::UnboundedReceiver<ClaimJob>,
    config: BatchConfig,
) {
    let slots = Arc::new(Semaphore::new(config.max_in_flight));
    while let Some((batch, permit)) = next_batch(&mut rx, &slots, config.max_batch).await {
        let inner = Arc::clone(&inner);
        tokio::spawn(async move {
            let (reqs, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            match inner.claim_many(&reqs).await {
                Ok(claims) if claims.len() == replies.len() => {
                    for (reply, claim) in replies.into_iter().zip(claims) {
                        if let Err(Ok(Claim::Acquired(lease))) = reply.send(Ok(claim)) {
                            // The caller went away (cancelled): give the key back now rather
                            // than leaving it blocked until the lease runs out.
                            let _ = inner.release(lease).await;
                        }
                    }
                }
                Ok(claims) => {
                    let e = StoreError::Corrupt {
                        what: format!("claim_many answered {} of {}", claims.len(), replies.len()),
                    };
                    for reply in replies {
                        let _ = reply.send(Err(e.copy_for("claim")));
                    }
                }
                Err(e) => {
                    for reply in replies {
                        let _ = reply.send(Err(e.copy_for("claim")));
                    }
                }
            }
            drop(permit);
        });
    }
}

async fn run_completes<S: DedupStore + 'static>(
    inner: Arc<S>,
    mut rx: mpsc::UnboundedReceiver<CompleteJob>,
    config: BatchConfig,
) {
    let slots = Arc::new(Semaphore::new(config.max_in_flight));
    while let Some((batch, permit)) = next_batch(&mut rx, &slots, config.max_batch).await {
        let inner = Arc::clone(&inner);
        tokio::spawn(async move {
            let (items, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
            let n = items.len();
            match inner.complete_many(items).await {
                Ok(done) if done.len() == n => {
                    for (reply, r) in replies.into_iter().zip(done) {
                        let _ = reply.send(r);
                    }
                }
                Ok(done) => {
                    let e = StoreError::Corrupt {
                        what: format!("complete_many answered {} of {n}", done.len()),
                    };
                    for reply in replies {
                        let _ = reply.send(Err(e.copy_for("complete")));
                    }
                }
                Err(e) => {
                    for reply in replies {
                        let _ = reply.send(Err(e.copy_for("complete")));
                    }
                }
            }
            drop(permit);
        });
    }
}

fn stopped(op: &'static str) -> StoreError {
    StoreError::backend(op, false, "the batching task has stopped (its runtime shut down)")
}

impl<S: DedupStore + 'static> DedupStore for Batched<S> {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.claims.send((req.clone(), tx)).map_err(|_| stopped("claim"))?;
        rx.await.map_err(|_| stopped("claim"))?
    }

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        self.inner.claim_many(reqs).await
    }

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        let (tx, rx) = oneshot::channel();
        let item = Completion { lease, result: result.map(<[u8]>::to_vec), retain_for };
        self.completes.send((item, tx)).map_err(|_| stopped("complete"))?;
        rx.await.map_err(|_| stopped("complete"))?
    }

    async fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        self.inner.complete_many(items).await
    }

    async fn fail(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.inner.fail(lease, kind, reason, retain_for).await
    }

    async fn release(&self, lease: Lease) -> Result<(), StoreError> {
        self.inner.release(lease).await
    }

    async fn extend(&self, lease: &mut Lease, by: Duration) -> Result<(), StoreError> {
        self.inner.extend(lease, by).await
    }

    async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        self.inner.purge(limit).await
    }

    async fn check(&self) -> Result<Vec<String>, StoreError> {
        self.inner.check().await
    }
}

impl<S: InspectStore + 'static> InspectStore for Batched<S> {
    async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(key).await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        self.inner.list(filter).await
    }

    async fn count(&self, scope: Option<&str>) -> Result<Counts, StoreError> {
        self.inner.count(scope).await
    }

    async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        self.inner.force_release(key).await
    }

    async fn force_fail(&self, key: &DedupKey, reason: &str) -> Result<bool, StoreError> {
        self.inner.force_fail(key, reason).await
    }
}
