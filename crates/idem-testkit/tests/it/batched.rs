//! `Batched` (group commit) coalesces concurrent calls and keeps per-message answers.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::sync::Arc;
use std::time::Duration;

use idem_core::{BatchConfig, Batched, Claim, ClaimRequest, DedupKey, DedupStore, MemoryStore};
use idem_testkit::faults::{FaultyStore, Op};

fn req(id: &str) -> ClaimRequest {
    let key = DedupKey::new("batched", id).unwrap();
    ClaimRequest::new(key, None, Duration::from_secs(30), Duration::from_secs(3600))
}

/// A store whose first `claim_many` waits at a gate, so the test decides what queues behind it.
#[derive(Clone)]
struct Gated {
    inner: MemoryStore,
    calls: Arc<std::sync::atomic::AtomicUsize>,
    entered: Arc<tokio::sync::Notify>,
    open: Arc<tokio::sync::Semaphore>,
}

impl DedupStore for Gated {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, idem_core::StoreError> {
        self.inner.claim(req).await
    }
    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, idem_core::StoreError> {
        if self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            self.entered.notify_one();
            let _permit = self.open.acquire().await.expect("gate open");
        }
        self.inner.claim_many(reqs).await
    }
    async fn complete(
        &self,
        lease: idem_core::Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), idem_core::StoreError> {
        self.inner.complete(lease, result, retain_for).await
    }
    async fn fail(
        &self,
        lease: idem_core::Lease,
        kind: idem_core::FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> Result<(), idem_core::StoreError> {
        self.inner.fail(lease, kind, reason, retain_for).await
    }
    async fn release(&self, lease: idem_core::Lease) -> Result<(), idem_core::StoreError> {
        self.inner.release(lease).await
    }
    async fn extend(
        &self,
        lease: &mut idem_core::Lease,
        by: Duration,
    ) -> Result<(), idem_core::StoreError> {
        self.inner.extend(lease, by).await
    }
    async fn purge(&self, limit: usize) -> Result<u64, idem_core::StoreError> {
        self.inner.purge(limit).await
    }
}

/// With one batch in flight, the 63 claims made while it runs leave together as the next batch:
/// two `claim_many` calls for 64 claims, every one answered. (Current-thread runtime: the test
/// task runs only when the others have yielded, so "queued" is exact.)
#[tokio::test]
async fn claims_made_during_a_batch_leave_together() {
    let gated = Gated {
        inner: MemoryStore::new(),
        calls: Arc::default(),
        entered: Arc::default(),
        open: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let store = Arc::new(Batched::new(gated.clone(), BatchConfig::default().max_in_flight(1)));
    let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let spawn = |i: usize| {
        let (store, queued) = (Arc::clone(&store), Arc::clone(&queued));
        tokio::spawn(async move {
            queued.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let Claim::Acquired(lease) = store.claim(&req(&format!("k{i}"))).await.unwrap() else {
                panic!("distinct keys must all be acquired");
            };
            store.complete(lease, Some(b"done"), Duration::from_secs(3600)).await.unwrap();
        })
    };
    let mut tasks = vec![spawn(0)];
    tokio::time::timeout(Duration::from_secs(10), gated.entered.notified()).await.unwrap();
    tasks.extend((1..64).map(spawn));
    tokio::time::timeout(Duration::from_secs(10), async {
        while queued.load(std::sync::atomic::Ordering::SeqCst) < 64 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap();
    gated.open.add_permits(1);
    for t in tasks {
        t.await.unwrap();
    }
    let calls = gated.calls.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        calls, 2,
        "64 claims went out as {calls} batches; expected 1 + the 63 queued behind it"
    );
}

/// Two deliveries of one key in flight together: exactly one acquires it, as without batching.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_twice_in_a_batch_has_one_winner() {
    let store = Arc::new(Batched::new(MemoryStore::new(), BatchConfig::default().max_in_flight(1)));
    let mut tasks = Vec::new();
    for _ in 0..16 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move { store.claim(&req("same")).await.unwrap() }));
    }
    let mut won = 0;
    for t in tasks {
        match t.await.unwrap() {
            Claim::Acquired(_lease) => won += 1,
            Claim::InProgress { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(won, 1);
}

/// A failed batch fails each of its callers with a retryable error, and applies nothing: the
/// same claims succeed afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_batch_fails_every_caller_and_applies_nothing() {
    let faulty = FaultyStore::new(MemoryStore::new());
    let store = Batched::new(faulty.clone(), BatchConfig::default());
    faulty.fail_next(Op::Claim, 1);
    let err = store.claim(&req("f1")).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert!(err.to_string().contains("claim"), "{err}");
    assert!(matches!(store.claim(&req("f1")).await.unwrap(), Claim::Acquired(_)));
}
