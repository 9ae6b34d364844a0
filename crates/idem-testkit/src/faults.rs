//! Fault injection: a store wrapper that fails chosen operations on demand.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use idem_core::{Claim, ClaimRequest, DedupStore, FailKind, Lease, StoreError};

/// Which operation to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Op {
    /// `claim` and `claim_many`.
    Claim,
    /// `complete`.
    Complete,
    /// `release`.
    Release,
    /// `fail`.
    Fail,
}

#[derive(Debug, Default)]
struct Counters {
    fail_claim: AtomicU32,
    fail_complete: AtomicU32,
    fail_release: AtomicU32,
    fail_fail: AtomicU32,
    /// Calls that never answer, per [`Op`] (in its declaration order).
    hang: [AtomicU32; 4],
    claims: AtomicU64,
    claim_many_calls: AtomicU64,
    completes: AtomicU64,
}

/// Wraps a store; [`FaultyStore::fail_next`] makes the next `n` calls of an operation fail with
/// a retryable backend error *without reaching the inner store*, as a dropped connection would.
/// Also counts calls, so tests can assert round trips.
#[derive(Debug, Clone)]
pub struct FaultyStore<S> {
    inner: S,
    c: Arc<Counters>,
}

impl<S> FaultyStore<S> {
    /// Wraps `inner` with no faults armed.
    pub fn new(inner: S) -> Self {
        Self { inner, c: Arc::default() }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Fails the next `n` calls of `op`.
    pub fn fail_next(&self, op: Op, n: u32) {
        self.slot(op).store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` calls of `op` never answer, as a connection a network partition left
    /// half-open would (nothing reaches the inner store).
    pub fn hang_next(&self, op: Op, n: u32) {
        self.c.hang[op as usize].store(n, Ordering::SeqCst);
    }

    /// Never returns when a hang of `op` is armed (and disarms one).
    async fn hang(&self, op: Op) {
        let slot = &self.c.hang[op as usize];
        if slot.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok() {
            std::future::pending::<()>().await;
        }
    }

    /// `claim` calls so far (each key of a `claim_many` counts once too).
    pub fn claims(&self) -> u64 {
        self.c.claims.load(Ordering::SeqCst)
    }

    /// `claim_many` calls so far.
    pub fn claim_many_calls(&self) -> u64 {
        self.c.claim_many_calls.load(Ordering::SeqCst)
    }

    /// Successful `complete` calls so far.
    pub fn completes(&self) -> u64 {
        self.c.completes.load(Ordering::SeqCst)
    }

    fn slot(&self, op: Op) -> &AtomicU32 {
        match op {
            Op::Claim => &self.c.fail_claim,
            Op::Complete => &self.c.fail_complete,
            Op::Release => &self.c.fail_release,
            Op::Fail => &self.c.fail_fail,
        }
    }

    fn trip(&self, op: Op, name: &'static str) -> Result<(), StoreError> {
        let slot = self.slot(op);
        let armed = slot.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if armed.is_ok() {
            return Err(StoreError::backend(name, true, format!("injected fault in {name}")));
        }
        Ok(())
    }
}

impl<S: DedupStore> DedupStore for FaultyStore<S> {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        self.hang(Op::Claim).await;
        self.trip(Op::Claim, "claim")?;
        self.c.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(req).await
    }

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        self.hang(Op::Claim).await;
        self.trip(Op::Claim, "claim_many")?;
        self.c.claim_many_calls.fetch_add(1, Ordering::SeqCst);
        self.c.claims.fetch_add(reqs.len() as u64, Ordering::SeqCst);
        self.inner.claim_many(reqs).await
    }

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.hang(Op::Complete).await;
        self.trip(Op::Complete, "complete")?;
        self.inner.complete(lease, result, retain_for).await?;
        self.c.completes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    async fn fail(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.trip(Op::Fail, "fail")?;
        self.inner.fail(lease, kind, reason, retain_for).await
    }

    async fn release(&self, lease: Lease) -> Result<(), StoreError> {
        self.trip(Op::Release, "release")?;
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

impl<S: idem_core::InspectStore> idem_core::InspectStore for FaultyStore<S> {
    async fn get(
        &self,
        key: &idem_core::DedupKey,
    ) -> Result<Option<idem_core::Record>, StoreError> {
        self.inner.get(key).await
    }

    async fn list(
        &self,
        filter: &idem_core::ListFilter,
    ) -> Result<Vec<idem_core::Record>, StoreError> {
        self.inner.list(filter).await
    }

    async fn count(&self, scope: Option<&str>) -> Result<idem_core::Counts, StoreError> {
        self.inner.count(scope).await
    }

    async fn force_release(&self, key: &idem_core::DedupKey) -> Result<bool, StoreError> {
        self.inner.force_release(key).await
    }

    async fn force_fail(
        &self,
        key: &idem_core::DedupKey,
        reason: &str,
    ) -> Result<bool, StoreError> {
        self.inner.force_fail(key, reason).await
    }
}
