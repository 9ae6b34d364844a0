//! The conformance cases. Each takes a fresh [`Harness`] and panics on a contract violation.
//!
//! Leases are `2 × unit`, retention `100 × unit`; time moves only through the harness's
//! [`TimeControl`](crate::TimeControl), never by sleeping. The cases are grouped by what they
//! check: claims and leases, batches (`claim_many`), and what becomes of records (retention,
//! failures, operator changes, inspection).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, Fingerprint, InspectStore, Lease};

use crate::Harness;

mod batch;
mod lease;
mod records;

pub use batch::{
    claim_many_distinct_mixed_states, claim_many_in_order_with_repeats, claim_many_large_batch,
    claim_many_mixed_states_match_single_claims, complete_and_claim_answers_both_halves,
    complete_many_tells_a_spent_lease_it_is_lost,
};
pub use lease::{
    a_claim_without_takeover_leaves_an_expired_lease, claim_is_exclusive,
    completed_is_duplicate_with_result, concurrent_claims_have_one_winner,
    deaths_count_only_expired_takeovers, expired_lease_is_taken_over, extend_keeps_the_lease,
    fencing_tokens_strictly_increase, fingerprint_mismatch_is_conflict,
    live_lease_is_not_taken_over, missing_fingerprint_never_conflicts, release_allows_reclaim,
    scopes_isolate, stale_lease_cannot_complete_or_release,
};
pub use records::{
    expired_record_is_claimed_afresh, failed_is_reclaimable_in_doubt_is_not,
    force_fail_fences_the_holder, force_release_fences_the_holder, inspect_counts_and_lists,
    inspect_scope_filter_is_exact, oversized_result_is_refused, purge_is_bounded,
    purge_removes_only_expired,
};

/// Bounds every case needs of a store.
pub trait Store: DedupStore + InspectStore + Clone + Send + Sync + 'static {}
impl<T: DedupStore + InspectStore + Clone + Send + Sync + 'static> Store for T {}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A second handle on `l` (same token), as a caller holding on to a spent lease has.
pub(crate) fn spent_copy(l: &Lease) -> Lease {
    Lease::new(l.key().clone(), l.fingerprint(), l.token(), l.attempt(), l.until(), l.previous())
}

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
