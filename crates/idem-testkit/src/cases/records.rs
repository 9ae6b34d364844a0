//! What becomes of records: retention and purge, failures, operator changes, inspection,
//! size limits.

use std::sync::atomic::Ordering;

use idem_core::{Claim, ClaimRequest, DedupKey, FailKind, ListFilter, RecordState, StoreError};

use super::{SEQ, Store, acquire, fp, req, retain, unique_key};
use crate::{Harness, TimeControl};

/// Purge removes expired records only: never a live lease, never one within retention.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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

/// A failed record is re-claimed (dead-letter resubmission runs again); an in-doubt one stays.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
