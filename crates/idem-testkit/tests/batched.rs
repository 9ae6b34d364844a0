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

/// 64 concurrent claims with one batch in flight: they share a handful of `claim_many` calls,
/// and every one is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_share_round_trips() {
    let faulty = FaultyStore::new(MemoryStore::new());
    let store = Arc::new(Batched::new(faulty.clone(), BatchConfig::default().max_in_flight(1)));
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let mut tasks = Vec::new();
    for i in 0..64 {
        let (store, barrier) = (Arc::clone(&store), Arc::clone(&barrier));
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let Claim::Acquired(lease) = store.claim(&req(&format!("k{i}"))).await.unwrap() else {
                panic!("distinct keys must all be acquired");
            };
            store.complete(lease, Some(b"done"), Duration::from_secs(3600)).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(faulty.claims(), 64);
    assert_eq!(faulty.completes(), 64);
    let calls = faulty.claim_many_calls();
    assert!(calls < 64, "64 concurrent claims went out as {calls} batches: nothing was coalesced");
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
