//! The store's claim rule as a pure function, for stores that read a record, apply it, and write it
//! back conditionally (a mutex, an ETag `If-Match`, a compare-and-set): given what is stored,
//! what the claim answers and which record to write.
//!
//! [`MemoryStore`](crate::MemoryStore) and the Cosmos DB store both apply it, so the rules
//! below exist once. Stores that apply them inside the server (SQL upserts, Redis scripts) encode
//! the same rules in their statements, and the conformance suite holds them all to it.

use crate::claim::next_token;
use crate::{Claim, ClaimRequest, Lease, Record, RecordState, Timestamp};

/// What a claim answers, and the record to write first (none when the answer changes nothing).
#[derive(Debug)]
#[must_use = "a ruling's record must be written before its claim is answered"]
#[non_exhaustive]
pub struct Ruling {
    /// The answer, valid once `write` (if any) is stored.
    pub claim: Claim,
    /// The record to store in place of `stored`; a store that writes conditionally and loses
    /// the race must read again and apply the rule again.
    pub write: Option<Record>,
}

/// The rule for `req` against `stored` at `now`:
/// - absent or expired → a fresh record at attempt 1 (a new fencing token, above the old one);
/// - a fingerprint different from the stored one → [`Claim::Conflict`] (when both are known);
/// - completed or in doubt → [`Claim::Completed`];
/// - in progress under a live lease → [`Claim::InProgress`] with the lease's remaining time;
/// - in progress under a lease that ran out, for a request without takeover →
///   [`Claim::InProgress`] with a zero remaining time;
/// - otherwise (released, failed, an expired lease) → a takeover at `attempt + 1`; taking over
///   an expired lease also adds one to `deaths` (its holder died holding it).
///
/// ```
/// use std::time::Duration;
/// use idem_core::claim_rule::apply;
/// use idem_core::{Claim, ClaimRequest, DedupKey, Timestamp};
///
/// let req = ClaimRequest::new(DedupKey::new("billing", "o-1")?, None, Duration::from_secs(30), Duration::from_secs(3600));
/// let now = Timestamp::from_micros(1_000_000);
/// let first = apply(None, &req, now);
/// assert!(matches!(first.claim, Claim::Acquired(_)));
/// let again = apply(first.write.as_ref(), &req, now);
/// assert!(matches!(again.claim, Claim::InProgress { .. }) && again.write.is_none());
/// # Ok::<(), idem_core::KeyError>(())
/// ```
pub fn apply(stored: Option<&Record>, req: &ClaimRequest, now: Timestamp) -> Ruling {
    let until = now.plus(req.lease_for);
    let keep = now.plus(req.retain_for.max(req.lease_for));
    let rec = match stored {
        Some(rec) if !rec.is_expired_at(now) => rec,
        other => {
            let token = next_token(other.map(|r| r.token), now);
            let rec = Record {
                key_hash: req.key.hash(),
                scope: req.key.scope().to_owned(),
                id: req.key.id().to_owned(),
                state: RecordState::InProgress,
                fingerprint: req.fingerprint,
                result: None,
                attempt: 1,
                token,
                previous: None,
                // A fresh record forgets the expired one's count.
                deaths: 0,
                created_at: now,
                updated_at: now,
                lease_until: Some(until),
                expires_at: keep,
            };
            let lease = Lease::new(req.key.clone(), req.fingerprint, token, 1, until, None);
            return Ruling { claim: Claim::Acquired(lease), write: Some(rec) };
        }
    };
    if let (Some(stored), Some(asked)) = (rec.fingerprint, req.fingerprint)
        && stored != asked
    {
        return Ruling { claim: Claim::Conflict(rec.clone()), write: None };
    }
    match rec.state {
        RecordState::Completed | RecordState::InDoubt => {
            Ruling { claim: Claim::Completed(rec.clone()), write: None }
        }
        RecordState::InProgress if rec.is_leased_at(now) || !req.takeover => Ruling {
            claim: Claim::InProgress {
                retry_after: rec.lease_until.unwrap_or(now).since(now),
                attempt: rec.attempt,
            },
            write: None,
        },
        previous => {
            let mut rec = rec.clone();
            rec.previous = Some(previous);
            rec.attempt = rec.attempt.saturating_add(1);
            if previous == RecordState::InProgress {
                rec.deaths = rec.deaths.saturating_add(1);
            }
            rec.token = next_token(Some(rec.token), now);
            rec.state = RecordState::InProgress;
            rec.fingerprint = rec.fingerprint.or(req.fingerprint);
            rec.result = None;
            rec.updated_at = now;
            rec.lease_until = Some(until);
            rec.expires_at = rec.expires_at.max(keep);
            let lease = Lease::new(
                req.key.clone(),
                rec.fingerprint,
                rec.token,
                rec.attempt,
                until,
                Some(previous),
            )
            .with_deaths(rec.deaths);
            Ruling { claim: Claim::Acquired(lease), write: Some(rec) }
        }
    }
}
