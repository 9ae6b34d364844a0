//! Claims and leases: exclusivity, takeover, fencing, fingerprints, scopes.

use std::time::Duration;

use idem_core::{Claim, DedupKey, FailKind, ListFilter, RecordState, StoreError};

use super::{Store, acquire, fp, req, retain, unique_key};
use crate::{Harness, TimeControl};

/// A second claim of a leased key does not acquire it.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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

/// Deaths count the claims that took over a lease that ran out, and nothing else: a release,
/// a failure and the claims after them leave the count as it was; single and batch claims
/// count alike; the record keeps it through completion.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
pub async fn deaths_count_only_expired_takeovers<S: Store, C: TimeControl>(h: Harness<S, C>) {
    let k = unique_key("conf-deaths");
    let first = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!(first.deaths(), 0);
    h.store.release(first).await.expect("release");
    let second = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!((second.attempt(), second.deaths()), (2, 0), "a release is no death");
    h.store.fail(second, FailKind::Permanent, "boom", retain(&h)).await.expect("fail");
    let third = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!((third.attempt(), third.deaths()), (3, 0), "a failure is no death");
    drop(third); // its holder dies
    h.time.advance(h.unit * 3).await;
    let fourth = acquire(&h, &req(&h, &k, fp(1))).await;
    assert!(fourth.took_over_expired());
    assert_eq!((fourth.attempt(), fourth.deaths()), (4, 1));
    drop(fourth);
    h.time.advance(h.unit * 3).await;
    let batch = h.store.claim_many(&[req(&h, &k, fp(1))]).await.expect("claim_many");
    let Some(Claim::Acquired(fifth)) = batch.into_iter().next() else { panic!("not acquired") };
    assert_eq!((fifth.attempt(), fifth.deaths()), (5, 2), "claim_many counts deaths too");
    h.store.release(fifth).await.expect("release");
    let sixth = acquire(&h, &req(&h, &k, fp(1))).await;
    assert_eq!((sixth.attempt(), sixth.deaths()), (6, 2), "the count outlives a release");
    h.store.complete(sixth, None, retain(&h)).await.expect("complete");
    let rec = h.store.get(&k).await.expect("get").expect("record");
    assert_eq!((rec.attempt, rec.deaths, rec.state), (6, 2, RecordState::Completed));
}

/// A request without takeover leaves a lease that ran out to its holder: `claim` and
/// `claim_many` answer it in progress with no time left and the holder's attempt, and change
/// nothing (the holder may still complete). A fresh key and a released one are claimed as usual.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
pub async fn a_claim_without_takeover_leaves_an_expired_lease<S: Store, C: TimeControl>(
    h: Harness<S, C>,
) {
    let (held, fresh, released) =
        (unique_key("conf-nt"), unique_key("conf-nt"), unique_key("conf-nt"));
    let first = acquire(&h, &req(&h, &held, fp(1))).await;
    let gone = acquire(&h, &req(&h, &released, fp(1))).await;
    h.store.release(gone).await.expect("release");
    h.time.advance(h.unit * 3).await;
    let expired = |c: &Claim| matches!(c, Claim::InProgress { retry_after, attempt: 1 } if retry_after.is_zero());
    let single = h.store.claim(&req(&h, &held, fp(1)).without_takeover()).await.expect("claim");
    assert!(expired(&single), "claim without takeover of an expired lease: {single:?}");
    let batch = h
        .store
        .claim_many(&[
            req(&h, &fresh, fp(1)).without_takeover(),
            req(&h, &held, fp(1)).without_takeover(),
            req(&h, &released, fp(1)).without_takeover(),
        ])
        .await
        .expect("claim_many");
    assert!(matches!(&batch[0], Claim::Acquired(l) if l.attempt() == 1), "fresh: {:?}", batch[0]);
    assert!(expired(&batch[1]), "claim_many without takeover: {:?}", batch[1]);
    assert!(
        matches!(&batch[2], Claim::Acquired(l) if l.attempt() == 2 && !l.took_over_expired()),
        "released: {:?}",
        batch[2]
    );
    // Nothing changed: the first holder still completes, and the key is done.
    h.store.complete(first, Some(b"first"), retain(&h)).await.expect("the holder completes");
    assert!(matches!(
        h.store.claim(&req(&h, &held, fp(1))).await.expect("claim"),
        Claim::Completed(rec) if rec.attempt == 1
    ));
    for c in batch {
        if let Claim::Acquired(l) = c {
            h.store.complete(l, None, retain(&h)).await.expect("complete");
        }
    }
}

/// Before the lease runs out, nobody takes it over.
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
///
/// # Cancel safety
/// Dropped midway, the case leaves its records in the harness's store, which the harness
/// cleans up.
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
