//! Batches: `claim_many` answers as single claims would, in order, at any size.

use idem_core::{
    Claim, ClaimRequest, Completion, DedupKey, FailKind, Lease, RecordState, StoreError,
};

use super::{Store, acquire, fp, req, retain, spent_copy, unique_key};
use crate::{Harness, TimeControl};

/// `claim_many` answers in order; a repeated key acquires once, its copies see it in progress or
/// in conflict.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
pub async fn claim_many_mixed_states_match_single_claims<S: Store, C: TimeControl>(
    h: Harness<S, C>,
) {
    let [n1, n2] = std::array::from_fn(|_| unique_key("conf-mixed"));
    let Mixed { done, released, expired, conflict, live, live_lease } =
        Mixed::make(&h, "conf-mixed").await;

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
    let (labels, leases) = labels(claims);
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

/// Keys in the states a batch meets (in `scope`): completed with the result `d`, released,
/// holding a lease that ran out, completed with fingerprint 1 (a conflict for any other), and
/// held under `live_lease`.
struct Mixed {
    done: DedupKey,
    released: DedupKey,
    expired: DedupKey,
    conflict: DedupKey,
    live: DedupKey,
    live_lease: Lease,
}

impl Mixed {
    async fn make<S: Store, C: TimeControl>(h: &Harness<S, C>, scope: &str) -> Self {
        let [done, released, expired, conflict, live] = std::array::from_fn(|_| unique_key(scope));
        let l = acquire(h, &req(h, &expired, fp(1))).await;
        drop(l); // a crash: the lease is left to run out
        h.time.advance(h.unit * 3).await;
        let l = acquire(h, &req(h, &done, fp(1))).await;
        h.store.complete(l, Some(b"d"), retain(h)).await.expect("complete");
        let l = acquire(h, &req(h, &released, fp(1))).await;
        h.store.release(l).await.expect("release");
        let l = acquire(h, &req(h, &conflict, fp(1))).await;
        h.store.complete(l, None, retain(h)).await.expect("complete");
        let live_lease = acquire(h, &req(h, &live, fp(1))).await;
        Self { done, released, expired, conflict, live, live_lease }
    }
}

/// Each claim's label (a lease by its attempt and what it took over; a completed record must
/// hold the result `d`), and the leases acquired, in order.
fn labels(claims: Vec<Claim>) -> (Vec<&'static str>, Vec<Lease>) {
    let mut leases = Vec::new();
    let labels = claims
        .into_iter()
        .map(|c| match c {
            Claim::Acquired(l) => {
                let label = match (l.attempt(), l.previous()) {
                    (1, None) => "new",
                    (2, Some(RecordState::Released)) => "after-release",
                    (2, Some(RecordState::InProgress)) => "takeover",
                    (2, Some(RecordState::Failed)) => "after-failure",
                    other => panic!("unexpected lease {other:?}"),
                };
                leases.push(l);
                label
            }
            Claim::Completed(r) if r.state == RecordState::InDoubt => "in-doubt",
            Claim::Completed(r) => {
                assert_eq!(r.result.as_deref(), Some(&b"d"[..]));
                "completed"
            }
            Claim::Conflict(_) => "conflict",
            Claim::InProgress { .. } => "in-progress",
        })
        .collect();
    (labels, leases)
}

/// A batch of distinct keys in every state (no key repeated: stores may decide such a batch in
/// one go) answers what single claims would, in order.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
pub async fn claim_many_distinct_mixed_states<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let [n1, failed, doubt] = std::array::from_fn(|_| unique_key("conf-distinct"));
    let Mixed { done, released, expired, conflict, live, live_lease } =
        Mixed::make(&h, "conf-distinct").await;
    let l = acquire(&h, &req(&h, &failed, fp(1))).await;
    h.store.fail(l, FailKind::Permanent, "bad", retain(&h)).await.expect("fail");
    let l = acquire(&h, &req(&h, &doubt, fp(1))).await;
    h.store.fail(l, FailKind::InDoubt, "unsure", retain(&h)).await.expect("fail");

    let batch = vec![
        req(&h, &n1, fp(1)),
        req(&h, &done, fp(1)),
        req(&h, &released, fp(1)),
        req(&h, &expired, fp(1)),
        req(&h, &conflict, fp(2)),
        req(&h, &live, fp(1)),
        req(&h, &failed, fp(1)),
        req(&h, &doubt, fp(1)),
        req(&h, &unique_key("conf-distinct"), None),
    ];
    let claims = h.store.claim_many(&batch).await.expect("claim_many");
    let (labels, leases) = labels(claims);
    assert_eq!(
        labels,
        [
            "new",
            "completed",
            "after-release",
            "takeover",
            "conflict",
            "in-progress",
            "after-failure",
            "in-doubt",
            "new"
        ]
    );
    for l in leases.into_iter().chain([live_lease]) {
        h.store.complete(l, None, retain(&h)).await.expect("complete");
    }
}

/// A batch larger than any single statement a store may build (1,200 keys) still answers every
/// key, in order.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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

/// `complete_many` answers each completion as `complete` would: a spent lease (completed
/// before, or twice in the batch) is told `LeaseLost`, the others complete, and the first
/// completion's result stays.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
pub async fn complete_many_tells_a_spent_lease_it_is_lost<S: Store, C: TimeControl>(
    h: Harness<S, C>,
) {
    let spent = unique_key("conf-complete-many");
    let fresh = unique_key("conf-complete-many");
    let twice = unique_key("conf-complete-many");
    let l = acquire(&h, &req(&h, &spent, fp(1))).await;
    let repeat = spent_copy(&l);
    h.store.complete(l, Some(b"first"), retain(&h)).await.expect("complete");
    let lf = acquire(&h, &req(&h, &fresh, fp(1))).await;
    let lt = acquire(&h, &req(&h, &twice, fp(1))).await;
    let twice_copy = spent_copy(&lt);
    let done = |lease, result: &[u8]| Completion {
        lease,
        result: Some(result.to_vec()),
        retain_for: retain(&h),
    };
    let answers = h
        .store
        .complete_many(vec![
            done(repeat, b"again"),
            done(lf, b"fresh"),
            done(lt, b"twice-1"),
            done(twice_copy, b"twice-2"),
        ])
        .await
        .expect("complete_many");
    let lost = |r: &Result<(), StoreError>| matches!(r, Err(StoreError::LeaseLost { .. }));
    assert_eq!(answers.len(), 4);
    assert!(lost(&answers[0]), "a spent lease completing again: {:?}", answers[0]);
    assert!(answers[1].is_ok(), "a live lease: {:?}", answers[1]);
    assert!(answers[2].is_ok(), "the first of a lease twice in the batch: {:?}", answers[2]);
    assert!(lost(&answers[3]), "the second of a lease twice in the batch: {:?}", answers[3]);
    for (key, result) in [(&spent, &b"first"[..]), (&fresh, b"fresh")] {
        match h.store.claim(&req(&h, key, fp(1))).await.expect("claim") {
            Claim::Completed(rec) => assert_eq!(rec.result.as_deref(), Some(result), "{key}"),
            other => panic!("{key} must be completed, got {other:?}"),
        }
    }
}

/// `complete_and_claim` answers each half as `complete_many` and `claim_many` would: a live
/// lease completes and a spent one is told `LeaseLost`; a single fresh key and a batch over keys
/// in several states are claimed in order.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
pub async fn complete_and_claim_answers_both_halves<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let [live, spent, fresh, n, done, conflict] =
        std::array::from_fn(|_| unique_key("conf-complete-claim"));
    let l = acquire(&h, &req(&h, &spent, fp(1))).await;
    let repeat = spent_copy(&l);
    h.store.complete(l, None, retain(&h)).await.expect("complete");
    let l = acquire(&h, &req(&h, &done, fp(1))).await;
    h.store.complete(l, Some(b"d"), retain(&h)).await.expect("complete");
    let l = acquire(&h, &req(&h, &conflict, fp(1))).await;
    h.store.complete(l, None, retain(&h)).await.expect("complete");
    let live_lease = acquire(&h, &req(&h, &live, fp(1))).await;
    let done_with = |lease, result: &[u8]| Completion {
        lease,
        result: Some(result.to_vec()),
        retain_for: retain(&h),
    };

    // One completion and one fresh key: the shape of a consumer at one message in flight.
    let items = vec![done_with(live_lease, b"live"), done_with(repeat, b"again")];
    let (completed, claims) = h.store.complete_and_claim(items, &[req(&h, &fresh, fp(1))]).await;
    let completed = completed.expect("complete half");
    assert!(completed[0].is_ok(), "a live lease: {:?}", completed[0]);
    assert!(
        matches!(completed[1], Err(StoreError::LeaseLost { .. })),
        "a spent lease: {:?}",
        completed[1]
    );
    let mut claims = claims.expect("claim half");
    let fresh_lease = match (claims.pop(), claims.is_empty()) {
        (Some(Claim::Acquired(l)), true) => l,
        other => panic!("a fresh key alone must be acquired, got {other:?}"),
    };
    assert_eq!(fresh_lease.key(), &fresh);

    // The fresh lease completes while a batch in every state is claimed.
    let batch = vec![
        req(&h, &n, fp(1)),
        req(&h, &done, fp(1)),
        req(&h, &conflict, fp(2)),
        req(&h, &n, fp(1)),
        req(&h, &live, fp(1)),
    ];
    let items = vec![done_with(fresh_lease, b"fresh")];
    let (completed, claims) = h.store.complete_and_claim(items, &batch).await;
    assert!(completed.expect("complete half")[0].is_ok());
    let claims = claims.expect("claim half");
    assert_eq!(claims.len(), 5);
    let mut it = claims.into_iter();
    let Some(Claim::Acquired(ln)) = it.next() else { panic!("a new key must be acquired") };
    assert_eq!(ln.key(), &n);
    match it.next() {
        Some(Claim::Completed(r)) => assert_eq!(r.result.as_deref(), Some(&b"d"[..])),
        other => panic!("a completed key: {other:?}"),
    }
    assert!(matches!(it.next(), Some(Claim::Conflict(_))), "other content");
    assert!(matches!(it.next(), Some(Claim::InProgress { .. })), "a repeat in the batch");
    match it.next() {
        Some(Claim::Completed(r)) => assert_eq!(r.result.as_deref(), Some(&b"live"[..])),
        other => panic!("the key completed by the first call: {other:?}"),
    }
    for (key, result) in [(&fresh, &b"fresh"[..]), (&live, b"live")] {
        match h.store.claim(&req(&h, key, fp(1))).await.expect("claim") {
            Claim::Completed(rec) => assert_eq!(rec.result.as_deref(), Some(result), "{key}"),
            other => panic!("{key} must be completed, got {other:?}"),
        }
    }
    h.store.complete(ln, None, retain(&h)).await.expect("complete n");
    let (completed, claims) = h.store.complete_and_claim(Vec::new(), &[]).await;
    assert!(completed.expect("nothing to complete").is_empty());
    assert!(claims.expect("nothing to claim").is_empty());
}
