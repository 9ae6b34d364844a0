//! The conformance cases. Each takes a fresh [`Harness`] and panics on a contract violation.
//!
//! Leases are `2 × unit`, retention `100 × unit`; time moves only through the harness's
//! [`TimeControl`], never by sleeping.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_core::{
    Claim, ClaimRequest, DedupKey, DedupStore, FailKind, Fingerprint, InspectStore, Lease,
    ListFilter, RecordState, StoreError,
};

use crate::{Harness, TimeControl};

/// Bounds every case needs of a store.
pub trait Store: DedupStore + InspectStore + Clone + Send + Sync + 'static {}
impl<T: DedupStore + InspectStore + Clone + Send + Sync + 'static> Store for T {}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A key unique to this process run, so cases sharing a store never collide.
pub fn unique_key(scope: &str) -> DedupKey {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    DedupKey::new(scope, format!("k-{pid}-{n}")).expect("valid test key")
}

fn fp(n: u8) -> Option<Fingerprint> {
    Some(Fingerprint::of_bytes(&[n]))
}

fn req<S, C>(h: &Harness<S, C>, key: &DedupKey, fingerprint: Option<Fingerprint>) -> ClaimRequest {
    ClaimRequest::new(key.clone(), fingerprint, h.unit * 2, h.unit * 100)
}

fn retain<S, C>(h: &Harness<S, C>) -> Duration {
    h.unit * 100
}

async fn acquire<S: Store, C>(h: &Harness<S, C>, r: &ClaimRequest) -> Lease {
    match h.store.claim(r).await.expect("claim") {
        Claim::Acquired(l) => l,
        other => panic!("expected Acquired for {}, got {other:?}", r.key),
    }
}

/// A second claim of a leased key does not acquire it.
pub async fn claim_is_exclusive<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let lease = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!(lease.attempt(), 1);
    assert_eq!(lease.previous(), None);
    match h.store.claim(&req(&h, &k, fp(1))).await.expect("claim") {
        Claim::InProgress { retry_after, attempt } => {
            assert_eq!(attempt, 1);
            assert!(retry_after > Duration::ZERO && retry_after <= h.unit * 2, "{retry_after:?}");
        }
        other => panic!("second claim must see InProgress, got {other:?}"),
    }
    h.store.release(lease).await.expect("release");
}

/// 64 concurrent claims of one key: exactly one acquires.
pub async fn concurrent_claims_have_one_winner<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let r = req(&h, &k, fp(1));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let store = h.store.clone();
        let r = r.clone();
        tasks.push(tokio::spawn(async move { store.claim(&r).await }));
    }
    let mut winners = Vec::new();
    let mut busy = 0;
    for t in tasks {
        match t.await.expect("task").expect("claim") {
            Claim::Acquired(l) => winners.push(l),
            Claim::InProgress { .. } => busy += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one winner of 64 concurrent claims");
    assert_eq!(busy, 63);
    for l in winners {
        h.store.complete(l, None, retain(&h)).await.expect("complete");
    }
}

/// A completed key answers Completed with the stored result.
pub async fn completed_is_duplicate_with_result<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let lease = acquire(&h, &req(&h, &k, fp(1))).await;
    h.store.complete(lease, Some(b"receipt-1"), retain(&h)).await.expect("complete");
    match h.store.claim(&req(&h, &k, fp(1))).await.expect("claim") {
        Claim::Completed(rec) => {
            assert_eq!(rec.state, RecordState::Completed);
            assert_eq!(rec.result.as_deref(), Some(&b"receipt-1"[..]));
            assert_eq!(rec.scope, k.scope());
            assert_eq!(rec.id, k.id());
            assert_eq!(rec.key_hash, k.hash());
        }
        other => panic!("expected Completed, got {other:?}"),
    }
    // Even after the lease time passed, a completed key stays a duplicate.
    h.time.advance(h.unit * 5).await;
    assert!(matches!(
        h.store.claim(&req(&h, &k, fp(1))).await.expect("claim"),
        Claim::Completed(_)
    ));
}

/// A released key is claimed again at once, with attempt + 1.
pub async fn release_allows_reclaim<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let first = acquire(&h, &req(&h, &k, fp(1))).await;
    let token = first.token();
    h.store.release(first).await.expect("release");
    let second = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!(second.attempt(), 2);
    assert_eq!(second.previous(), Some(RecordState::Released));
    assert!(!second.took_over_expired());
    assert!(second.token() > token);
    h.store.complete(second, None, retain(&h)).await.expect("complete");
}

/// After the lease runs out, the next claim takes over with attempt + 1.
pub async fn expired_lease_is_taken_over<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let first = acquire(&h, &req(&h, &k, fp(1))).await;
    h.time.advance(h.unit * 3).await;
    let second = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!(second.attempt(), 2);
    assert!(second.took_over_expired());
    assert!(second.token() > first.token());
    // The old holder is fenced out.
    assert!(matches!(
        h.store.complete(first, Some(b"stale"), retain(&h)).await,
        Err(StoreError::LeaseLost { .. })
    ));
    h.store.complete(second, Some(b"fresh"), retain(&h)).await.expect("complete");
    let rec = h.store.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.result.as_deref(), Some(&b"fresh"[..]));
    assert_eq!(rec.attempt, 2);
}

/// Before the lease runs out, nobody takes it over.
pub async fn live_lease_is_not_taken_over<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let first = acquire(&h, &req(&h, &k, fp(1))).await;
    h.time.advance(h.unit).await;
    assert!(matches!(
        h.store.claim(&req(&h, &k, fp(1))).await.expect("claim"),
        Claim::InProgress { .. }
    ));
    // A lease that ran out but was not taken over may still complete.
    h.time.advance(h.unit * 2).await;
    h.store.complete(first, None, retain(&h)).await.expect("complete after expiry, no takeover");
}

/// A stale lease can neither complete nor release, and changes nothing.
pub async fn stale_lease_cannot_complete_or_release<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let first = acquire(&h, &req(&h, &k, fp(1))).await;
    let mut first_b = {
        // Expire, take over, expire again, take over: the first lease is two tokens behind.
        h.time.advance(h.unit * 3).await;
        acquire(&h, &req(&h, &k, fp(1))).await
    };
    let before = h.store.get(&k).await.expect("get").expect("record");
    assert!(matches!(h.store.release(first).await, Err(StoreError::LeaseLost { .. })));
    let after = h.store.get(&k).await.expect("get").expect("record");
    assert_eq!(before, after, "a failed release must change nothing");

    h.time.advance(h.unit * 3).await;
    let third = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!(third.attempt(), 3);
    assert!(matches!(
        h.store.extend(&mut first_b, h.unit).await,
        Err(StoreError::LeaseLost { .. })
    ));
    assert!(matches!(
        h.store.fail(first_b, FailKind::Permanent, "x", retain(&h)).await,
        Err(StoreError::LeaseLost { .. })
    ));
    let rec = h.store.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.state, RecordState::InProgress);
    assert_eq!(rec.token, third.token());
    h.store.complete(third, None, retain(&h)).await.expect("complete");
}

/// Tokens grow with every claim of a key.
pub async fn fencing_tokens_strictly_increase<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let mut last = 0;
    for _ in 0..5 {
        let l = acquire(&h, &req(&h, &k, fp(1))).await;
        assert!(l.token() > last, "token {} not above {last}", l.token());
        last = l.token();
        h.store.release(l).await.expect("release");
    }
}

/// `extend` moves the lease end so a takeover waits longer.
pub async fn extend_keeps_the_lease<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let mut lease = acquire(&h, &req(&h, &k, fp(1))).await;
    let before = lease.until();
    h.time.advance(h.unit).await;
    h.store.extend(&mut lease, h.unit * 4).await.expect("extend");
    assert!(lease.until() > before);
    h.time.advance(h.unit * 2).await; // past the original end, before the extended one
    assert!(matches!(
        h.store.claim(&req(&h, &k, fp(1))).await.expect("claim"),
        Claim::InProgress { .. }
    ));
    h.store.complete(lease, None, retain(&h)).await.expect("complete");
}

/// Same key, different fingerprint: conflict, in every state.
pub async fn fingerprint_mismatch_is_conflict<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let lease = acquire(&h, &req(&h, &k, fp(1))).await;
    match h.store.claim(&req(&h, &k, fp(2))).await.expect("claim") {
        Claim::Conflict(rec) => assert_eq!(rec.fingerprint, fp(1)),
        other => panic!("in progress + other payload must conflict, got {other:?}"),
    }
    h.store.complete(lease, None, retain(&h)).await.expect("complete");
    assert!(matches!(h.store.claim(&req(&h, &k, fp(2))).await.expect("claim"), Claim::Conflict(_)));
    // The conflict changed nothing: the original is still a duplicate.
    assert!(matches!(
        h.store.claim(&req(&h, &k, fp(1))).await.expect("claim"),
        Claim::Completed(_)
    ));

    // A released key does not let other content in either.
    let k2 = unique_key("conf");
    let l2 = acquire(&h, &req(&h, &k2, fp(1))).await;
    h.store.release(l2).await.expect("release");
    assert!(matches!(
        h.store.claim(&req(&h, &k2, fp(2))).await.expect("claim"),
        Claim::Conflict(_)
    ));
}

/// Without a fingerprint on either side there is nothing to compare.
pub async fn missing_fingerprint_never_conflicts<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let lease = acquire(&h, &req(&h, &k, None)).await;
    h.store.complete(lease, None, retain(&h)).await.expect("complete");
    assert!(matches!(
        h.store.claim(&req(&h, &k, fp(9))).await.expect("claim"),
        Claim::Completed(_)
    ));
}

/// The same id in two scopes is two keys.
pub async fn scopes_isolate<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let a = unique_key("conf-a");
    let b = DedupKey::new("conf-b", a.id()).expect("key");
    let la = acquire(&h, &req(&h, &a, fp(1))).await;
    let lb = acquire(&h, &req(&h, &b, fp(2))).await; // different content: no conflict across scopes
    h.store.complete(la, Some(b"a"), retain(&h)).await.expect("complete a");
    assert!(
        h.store.get(&b).await.expect("get").is_some_and(|r| r.state == RecordState::InProgress)
    );
    h.store.complete(lb, Some(b"b"), retain(&h)).await.expect("complete b");
    let ca = h.store.count(Some("conf-a")).await.expect("count");
    assert!(ca.completed >= 1);
    let listed = h.store.list(&ListFilter::new(1000).scope("conf-b")).await.expect("list");
    assert!(listed.iter().all(|r| r.scope == "conf-b"));
    assert!(listed.iter().any(|r| r.id == b.id()));
}

/// Purge removes expired records only: never a live lease, never one within retention.
pub async fn purge_removes_only_expired<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let short = unique_key("conf-purge");
    let long = unique_key("conf-purge");
    let live = unique_key("conf-purge");
    let l = acquire(&h, &req(&h, &short, fp(1))).await;
    h.store.complete(l, None, h.unit).await.expect("complete short");
    let l = acquire(&h, &req(&h, &long, fp(1))).await;
    h.store.complete(l, None, h.unit * 100).await.expect("complete long");
    // A live lease whose record retention is short: still untouchable while leased.
    let live_req = ClaimRequest::new(live.clone(), fp(1), h.unit * 50, h.unit);
    let live_lease = acquire(&h, &live_req).await;
    h.time.advance(h.unit * 3).await;
    let mut purged = 0;
    loop {
        let n = h.store.purge(1000).await.expect("purge");
        purged += n;
        if n < 1000 {
            break;
        }
    }
    assert!(purged >= 1);
    assert!(h.store.get(&short).await.expect("get").is_none(), "expired record must be purged");
    assert!(h.store.get(&long).await.expect("get").is_some(), "record within retention purged");
    assert!(h.store.get(&live).await.expect("get").is_some(), "live lease purged");
    h.store.complete(live_lease, None, retain(&h)).await.expect("live lease still completes");
}

/// `purge(limit)` deletes at most `limit`.
pub async fn purge_is_bounded<S: Store, C: TimeControl>(h: Harness<S, C>) {
    for _ in 0..5 {
        let k = unique_key("conf-bound");
        let l = acquire(&h, &req(&h, &k, None)).await;
        h.store.complete(l, None, h.unit).await.expect("complete");
    }
    h.time.advance(h.unit * 2).await;
    let n = h.store.purge(2).await.expect("purge");
    assert!(n <= 2, "purge(2) deleted {n}");
    assert_eq!(n, 2);
}

/// A record past its retention is claimed as new (attempt 1), with a token still above the old one.
pub async fn expired_record_is_claimed_afresh<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let l = acquire(&h, &req(&h, &k, fp(1))).await;
    let old_token = l.token();
    h.store.complete(l, None, h.unit).await.expect("complete");
    h.time.advance(h.unit * 3).await;
    let l = acquire(&h, &req(&h, &k, fp(2))).await; // new content is fine: the old record expired
    assert_eq!(l.attempt(), 1);
    assert!(l.token() > old_token);
    h.store.complete(l, None, retain(&h)).await.expect("complete");
}

/// `claim_many` answers in order; a repeated key acquires once, its copies see it in progress or
/// in conflict.
pub async fn claim_many_in_order_with_repeats<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let a = unique_key("conf-batch");
    let b = unique_key("conf-batch");
    let done = unique_key("conf-batch");
    let l = acquire(&h, &req(&h, &done, fp(1))).await;
    h.store.complete(l, Some(b"r"), retain(&h)).await.expect("complete");
    let batch = vec![
        req(&h, &a, fp(1)),
        req(&h, &b, fp(1)),
        req(&h, &a, fp(1)),
        req(&h, &done, fp(1)),
        req(&h, &a, fp(2)),
    ];
    let claims = h.store.claim_many(&batch).await.expect("claim_many");
    assert_eq!(claims.len(), 5);
    let mut it = claims.into_iter();
    let (Some(Claim::Acquired(la)), Some(Claim::Acquired(lb))) = (it.next(), it.next()) else {
        panic!("first two must acquire")
    };
    assert_eq!(la.key(), &a);
    assert_eq!(lb.key(), &b);
    assert!(matches!(it.next(), Some(Claim::InProgress { .. })), "repeat of a");
    assert!(matches!(it.next(), Some(Claim::Completed(_))), "completed key");
    assert!(matches!(it.next(), Some(Claim::Conflict(_))), "repeat of a with other content");
    h.store.complete(la, None, retain(&h)).await.expect("complete a");
    h.store.complete(lb, None, retain(&h)).await.expect("complete b");
    assert!(h.store.claim_many(&[]).await.expect("empty batch").is_empty());
}

/// A batch over keys in every state answers what single claims would, in order.
pub async fn claim_many_mixed_states_match_single_claims<S: Store, C: TimeControl>(
    h: Harness<S, C>,
) {
    let [n1, n2, done, released, expired, conflict, live] =
        std::array::from_fn(|_| unique_key("conf-mixed"));
    let l = acquire(&h, &req(&h, &expired, fp(1))).await;
    drop(l); // a crash: the lease is left to run out
    h.time.advance(h.unit * 3).await;
    let l = acquire(&h, &req(&h, &done, fp(1))).await;
    h.store.complete(l, Some(b"d"), retain(&h)).await.expect("complete");
    let l = acquire(&h, &req(&h, &released, fp(1))).await;
    h.store.release(l).await.expect("release");
    let l = acquire(&h, &req(&h, &conflict, fp(1))).await;
    h.store.complete(l, None, retain(&h)).await.expect("complete");
    let live_lease = acquire(&h, &req(&h, &live, fp(1))).await;

    let batch = vec![
        req(&h, &n1, fp(1)),
        req(&h, &done, fp(1)),
        req(&h, &released, fp(1)),
        req(&h, &expired, fp(1)),
        req(&h, &conflict, fp(2)),
        req(&h, &live, fp(1)),
        req(&h, &n1, fp(1)),
        req(&h, &n2, None),
        req(&h, &released, fp(1)),
    ];
    let claims = h.store.claim_many(&batch).await.expect("claim_many");
    let mut leases = Vec::new();
    let mut labels = Vec::new();
    for c in claims {
        labels.push(match c {
            Claim::Acquired(l) => {
                let label = match (l.attempt(), l.previous()) {
                    (1, None) => "new",
                    (2, Some(RecordState::Released)) => "after-release",
                    (2, Some(RecordState::InProgress)) => "takeover",
                    other => panic!("unexpected lease {other:?}"),
                };
                leases.push(l);
                label
            }
            Claim::Completed(r) => {
                assert_eq!(r.result.as_deref(), Some(&b"d"[..]));
                "completed"
            }
            Claim::Conflict(_) => "conflict",
            Claim::InProgress { .. } => "in-progress",
        });
    }
    assert_eq!(
        labels,
        [
            "new",
            "completed",
            "after-release",
            "takeover",
            "conflict",
            "in-progress",
            "in-progress",
            "new",
            "in-progress"
        ]
    );
    for l in leases.into_iter().chain([live_lease]) {
        h.store.complete(l, None, retain(&h)).await.expect("complete");
    }
}

/// A batch larger than any single statement a store may build (1,200 keys) still answers every
/// key, in order.
pub async fn claim_many_large_batch<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let keys: Vec<DedupKey> = (0..1200).map(|_| unique_key("conf-large")).collect();
    let reqs: Vec<ClaimRequest> = keys.iter().map(|k| req(&h, k, None)).collect();
    let claims = h.store.claim_many(&reqs).await.expect("claim_many");
    assert_eq!(claims.len(), 1200);
    for (k, c) in keys.iter().zip(claims) {
        match c {
            Claim::Acquired(l) => assert_eq!(l.key(), k),
            other => panic!("{k}: {other:?}"),
        }
    }
    let again = h.store.claim_many(&reqs).await.expect("claim_many");
    assert!(again.iter().all(|c| matches!(c, Claim::InProgress { .. })));
}

/// A failed record is re-claimed (dead-letter resubmission runs again); an in-doubt one stays.
pub async fn failed_is_reclaimable_in_doubt_is_not<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let l = acquire(&h, &req(&h, &k, fp(1))).await;
    h.store.fail(l, FailKind::Permanent, "bad input", retain(&h)).await.expect("fail");
    let rec = h.store.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.state, RecordState::Failed);
    assert_eq!(rec.result.as_deref(), Some(&b"bad input"[..]));
    let l = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!(l.previous(), Some(RecordState::Failed));
    h.store.fail(l, FailKind::InDoubt, "lease expired", retain(&h)).await.expect("park");
    match h.store.claim(&req(&h, &k, fp(1))).await.expect("claim") {
        Claim::Completed(rec) => assert_eq!(rec.state, RecordState::InDoubt),
        other => panic!("in doubt must stay parked, got {other:?}"),
    }
}

/// An operator release fences out the current holder and lets the next delivery run.
pub async fn force_release_fences_the_holder<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let l = acquire(&h, &req(&h, &k, fp(1))).await;
    assert!(h.store.force_release(&k).await.expect("force_release"));
    assert!(matches!(
        h.store.complete(l, None, retain(&h)).await,
        Err(StoreError::LeaseLost { .. })
    ));
    let l = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!(l.previous(), Some(RecordState::Released));
    h.store.complete(l, None, retain(&h)).await.expect("complete");
    assert!(!h.store.force_release(&unique_key("conf")).await.expect("absent key"));
}

/// An operator failure fences out the current holder, replaces an in-doubt record's reason
/// with the operator's, leaves the key re-claimable, and never touches a completed record.
pub async fn force_fail_fences_the_holder<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let l = acquire(&h, &req(&h, &k, fp(1))).await;
    assert!(h.store.force_fail(&k, "operator: held too long").await.expect("force_fail"));
    assert!(matches!(
        h.store.complete(l, None, retain(&h)).await,
        Err(StoreError::LeaseLost { .. })
    ));
    let rec = h.store.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.state, RecordState::Failed);
    assert_eq!(rec.lease_until, None);
    assert_eq!(rec.result.as_deref(), Some(&b"operator: held too long"[..]));

    // The case it exists for: a parked in-doubt record the operator has checked.
    let l = acquire(&h, &req(&h, &k, fp(1))).await;
    let token = l.token();
    h.store.fail(l, FailKind::InDoubt, "lease expired", retain(&h)).await.expect("park");
    assert!(h.store.force_fail(&k, "checked: not applied").await.expect("force_fail"));
    let rec = h.store.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.state, RecordState::Failed);
    assert!(rec.token > token, "the token moves on: {} after {token}", rec.token);
    assert_eq!(rec.result.as_deref(), Some(&b"checked: not applied"[..]));
    let l = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!(l.previous(), Some(RecordState::Failed));
    h.store.complete(l, None, retain(&h)).await.expect("complete");
    // A completed record is left alone, decided in the store's one write: its effect happened.
    assert!(!h.store.force_fail(&k, "too late").await.expect("force_fail on completed"));
    let rec = h.store.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.state, RecordState::Completed, "a completed record stays completed");
    assert!(!h.store.force_fail(&unique_key("conf"), "absent").await.expect("absent key"));
}

/// `count` and `list` see what was written.
pub async fn inspect_counts_and_lists<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let scope = format!("conf-inspect-{}", SEQ.fetch_add(1, Ordering::Relaxed));
    let k1 = DedupKey::new(scope.clone(), "1").expect("key");
    let k2 = DedupKey::new(scope.clone(), "2").expect("key");
    let l1 = acquire(&h, &req(&h, &k1, None)).await;
    let l2 = acquire(&h, &req(&h, &k2, None)).await;
    h.store.complete(l1, None, retain(&h)).await.expect("complete");
    let c = h.store.count(Some(&scope)).await.expect("count");
    assert_eq!((c.in_progress, c.completed, c.total()), (1, 1, 2));
    let done = h
        .store
        .list(&ListFilter::new(10).scope(scope.clone()).state(RecordState::Completed))
        .await
        .expect("list");
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].id, "1");
    h.store.release(l2).await.expect("release");
    let c = h.store.count(Some(&scope)).await.expect("count");
    assert_eq!(c.released, 1);
}

/// `count` and `list` filtered by scope match the scope byte for byte: scopes differing only
/// by case or a trailing space are counted and listed apart (a text comparison under a
/// case-insensitive or space-padding collation would merge them).
pub async fn inspect_scope_filter_is_exact<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let base = format!("conf-scope-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
    // 1, 2 and 3 records, so a merge of any two shows in the numbers.
    let scopes = [format!("{base}-Billing"), format!("{base}-billing"), format!("{base}-billing ")];
    for (n, scope) in scopes.iter().enumerate() {
        for i in 0..=n {
            let k = DedupKey::new(scope.clone(), i.to_string()).expect("key");
            let l = acquire(&h, &req(&h, &k, None)).await;
            h.store.complete(l, None, retain(&h)).await.expect("complete");
        }
    }
    for (n, scope) in scopes.iter().enumerate() {
        let c = h.store.count(Some(scope)).await.expect("count");
        assert_eq!(c.total(), u64::try_from(n + 1).expect("small"), "count of {scope:?}: {c:?}");
        let listed = h.store.list(&ListFilter::new(10).scope(scope.clone())).await.expect("list");
        let got: Vec<&str> = listed.iter().map(|r| r.scope.as_str()).collect();
        assert_eq!(got, vec![scope.as_str(); n + 1], "list of scope {scope:?}");
    }
}

/// A result above the store's limit is refused with `TooLarge`, and the lease is not consumed
/// in the store (the key stays in progress).
pub async fn oversized_result_is_refused<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf");
    let l = acquire(&h, &req(&h, &k, None)).await;
    let huge = vec![b'x'; 64 << 20];
    match h.store.complete(l, Some(&huge), retain(&h)).await {
        Err(StoreError::TooLarge { field, len, limit }) => {
            assert_eq!(field, "result");
            assert_eq!(len, huge.len());
            assert!(limit < len);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    let rec = h.store.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.state, RecordState::InProgress);
}
