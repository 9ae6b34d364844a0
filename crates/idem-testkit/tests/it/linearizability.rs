//! Concurrent histories against `MemoryStore` (and through `Batched`), checked for
//! linearizability against the store model; and the checker's self-check: two deliberately
//! broken stores it must catch.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use idem_core::{
    BatchConfig, Batched, Claim, ClaimRequest, Counts, DedupKey, DedupStore, FailKind,
    InspectStore, Lease, ListFilter, MemoryStore, Record, RecordState, StoreError, Timestamp,
};
use idem_testkit::linearize::{Config, check_store};

async fn assert_linearizable<S: DedupStore + InspectStore>(name: &str, store: S) {
    let cfg = Config::default();
    match check_store(Arc::new(store), &cfg).await {
        Ok(sum) => eprintln!("{name}: seed {} {sum:?}", cfg.seed),
        Err(v) => panic!("{name}: {v}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_is_linearizable() {
    assert_linearizable("memory", MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_memory_store_is_linearizable() {
    assert_linearizable("batched", Batched::new(MemoryStore::new(), BatchConfig::default())).await;
}

/// Runs histories against a broken store until the checker objects; fails if it never does.
async fn assert_caught(bug: Bug) {
    let cfg = Config { histories: 300, ..Config::default() };
    let store = Arc::new(Broken { inner: MemoryStore::new(), bug });
    match check_store(store, &cfg).await {
        Ok(sum) => panic!("{bug:?} went unnoticed over {sum:?} (seed {})", cfg.seed),
        Err(v) => eprintln!("{bug:?} caught: {v}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checker_catches_a_second_grant() {
    assert_caught(Bug::DoubleGrant).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checker_catches_an_unfenced_complete() {
    assert_caught(Bug::Unfenced).await;
}

/// A batch decided request by request, with other callers free to land in between (what
/// PostgreSQL, MariaDB and Redis's fast claim did before 2026-12-07): the strict model
/// objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checker_catches_a_batch_that_is_not_one_step() {
    assert_caught(Bug::SplitBatch).await;
}

#[derive(Debug, Clone, Copy)]
enum Bug {
    /// `claim_many` claims each request alone, yielding between two.
    SplitBatch,
    /// A claim of a key under a live lease answers `Acquired` too (a read-then-write claim).
    DoubleGrant,
    /// `complete` ignores the lease's token: it completes whatever lease holds the key now.
    Unfenced,
}

struct Broken {
    inner: MemoryStore,
    bug: Bug,
}

impl Broken {
    fn grant(&self, req: &ClaimRequest, claim: Claim) -> Claim {
        match (self.bug, claim) {
            (Bug::DoubleGrant, Claim::InProgress { attempt, .. }) => Claim::Acquired(Lease::new(
                req.key.clone(),
                req.fingerprint,
                0,
                attempt,
                Timestamp::from_micros(0),
                None,
            )),
            (_, c) => c,
        }
    }
}

impl DedupStore for Broken {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        Ok(self.grant(req, self.inner.claim(req).await?))
    }

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        if let Bug::SplitBatch = self.bug {
            let mut claims = Vec::with_capacity(reqs.len());
            for r in reqs {
                claims.push(self.inner.claim(r).await?);
                tokio::task::yield_now().await;
            }
            return Ok(claims);
        }
        let claims = self.inner.claim_many(reqs).await?;
        Ok(reqs.iter().zip(claims).map(|(r, c)| self.grant(r, c)).collect())
    }

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        let lease = match (self.bug, self.inner.get(lease.key()).await?) {
            (Bug::Unfenced, Some(rec)) if rec.state == RecordState::InProgress => Lease::new(
                lease.key().clone(),
                lease.fingerprint(),
                rec.token,
                lease.attempt(),
                lease.until(),
                lease.previous(),
            ),
            _ => lease,
        };
        self.inner.complete(lease, result, retain_for).await
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
}

impl InspectStore for Broken {
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
