//! Claims that ride on a completion: on a store that sends a completion and claims in one write,
//! a pipelined consumer at one message in flight claims message k + 1 in the write that
//! completes message k — one write per message — and a claim never waits for a decision that
//! will not complete.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::consumer::{MemoryDelivery, MemoryQueue};
use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_core::{
    Claim, ClaimRequest, CompleteAndClaim, Completion, Consumer, DedupStore, FailKind, Lease,
    MemoryStore, StoreError,
};

/// `MemoryStore` that says it combines writes, and counts the writes it is asked for.
#[derive(Clone, Default)]
struct Counting {
    inner: MemoryStore,
    combines: bool,
    claims: Arc<AtomicUsize>,
    completions: Arc<AtomicUsize>,
    both: Arc<AtomicUsize>,
    /// Claims carried by `complete_and_claim`.
    carried: Arc<AtomicUsize>,
}

impl DedupStore for Counting {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(req).await
    }
    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim_many(reqs).await
    }
    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.completions.fetch_add(1, Ordering::SeqCst);
        self.inner.complete(lease, result, retain_for).await
    }
    async fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        self.completions.fetch_add(1, Ordering::SeqCst);
        self.inner.complete_many(items).await
    }
    fn combines_writes(&self) -> bool {
        self.combines
    }
    async fn complete_and_claim(
        &self,
        items: Vec<Completion>,
        reqs: &[ClaimRequest],
    ) -> CompleteAndClaim {
        self.both.fetch_add(1, Ordering::SeqCst);
        self.carried.fetch_add(reqs.len(), Ordering::SeqCst);
        (self.inner.complete_many(items).await, self.inner.claim_many(reqs).await)
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

fn id_of(m: &MemoryDelivery) -> String {
    m.message_id().unwrap_or_default().to_owned()
}

/// Runs `q` to the end through one pipelined lane of batch 1; the handler works 1 ms per
/// message (`pause`) or never yields. Answers each message id's handler runs.
async fn drain(
    q: &MemoryQueue,
    store: &Counting,
    pause: bool,
) -> (idem_core::consumer::Report, HashMap<String, u32>) {
    let c: Consumer<MemoryQueue, Counting> = Consumer::builder(q.clone())
        .store(store.clone())
        .scope("orders")
        .batch(1)
        .pipeline(true)
        .idle_wait(Duration::from_millis(20))
        .build()
        .await
        .unwrap();
    let runs = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    let count = runs.clone();
    let handler = move |_, m: MemoryDelivery| {
        *count.lock().unwrap().entry(id_of(&m)).or_default() += 1;
        async move {
            if pause {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok::<_, HandlerError<String>>(id_of(&m))
        }
    };
    let report = tokio::time::timeout(Duration::from_secs(20), c.run(handler, q.drained()))
        .await
        .expect("a consumer whose claims ride never stalls")
        .unwrap();
    let runs = runs.lock().unwrap().clone();
    (report, runs)
}

#[tokio::test]
async fn one_message_in_flight_sends_one_write_per_message() {
    one_write_per_message(true).await;
}

/// A handler that never yields leaves no time for the next batch to be fetched while it runs:
/// its completion waits for the batch already fetched to post its claims.
#[tokio::test]
async fn a_handler_that_never_yields_still_carries_the_next_claim() {
    one_write_per_message(false).await;
}

async fn one_write_per_message(pause: bool) {
    let q = MemoryQueue::new();
    for i in 0..50 {
        q.push(format!("o-{i:02}"), "{}");
    }
    let store = Counting { combines: true, ..Counting::default() };
    let (report, runs) = drain(&q, &store, pause).await;
    assert_eq!((report.processed, report.acked), (50, 50));
    assert_eq!(runs.len(), 50);
    assert!(runs.values().all(|&n| n == 1), "{runs:?}");
    let (both, alone_claims, alone_completions) = (
        store.both.load(Ordering::SeqCst),
        store.claims.load(Ordering::SeqCst),
        store.completions.load(Ordering::SeqCst),
    );
    // Message 1's claim goes alone (nothing to ride on), message 50's completion too (nothing
    // left to claim); every other message is one write. A rider that missed a completion (the
    // next fetch came back late) goes alone: a few are allowed on a slow machine.
    assert!(both >= 45, "{both} of 49 writes carried a claim");
    assert_eq!(store.carried.load(Ordering::SeqCst), both, "one claim per carried write");
    assert_eq!(both + alone_claims, 50, "each message claimed once");
    assert_eq!(both + alone_completions, 50, "each message completed once");
}

#[tokio::test]
async fn without_combined_writes_claims_go_alone() {
    let q = MemoryQueue::new();
    for i in 0..20 {
        q.push(format!("o-{i:02}"), "{}");
    }
    let store = Counting::default();
    let (report, _) = drain(&q, &store, true).await;
    assert_eq!(report.processed, 20);
    assert_eq!(store.both.load(Ordering::SeqCst), 0);
    assert_eq!(store.claims.load(Ordering::SeqCst), 20);
}

/// Duplicates complete nothing: the claims waiting to ride must go alone when the decision
/// ends, or the lane would wait for ever.
#[tokio::test]
async fn claims_go_alone_when_no_completion_comes() {
    let q = MemoryQueue::new();
    q.push("o-1", "{}");
    for _ in 0..30 {
        q.push("o-dup", "{}");
    }
    let store = Counting { combines: true, ..Counting::default() };
    let (report, runs) = drain(&q, &store, true).await;
    assert_eq!(report.processed + report.duplicates, 31);
    assert_eq!((report.processed, report.duplicates), (2, 29));
    assert_eq!(runs.get("o-dup"), Some(&1));
}
