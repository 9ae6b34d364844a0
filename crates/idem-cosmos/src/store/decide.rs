//! The claim decision: given what is stored, what to answer and what to write. Pure, so the
//! store can apply it as one ETag-conditional write and decide again when the write loses a race.

use idem_core::claim::next_token;
use idem_core::{Claim, ClaimRequest, Lease, Record, RecordState, Timestamp};

/// What a claim answers, and the record to write first (none when the answer changes nothing).
pub(crate) struct Decision {
    pub(crate) claim: Claim,
    pub(crate) write: Option<Record>,
}

/// Decides `req` against `stored` at `now`, as `MemoryStore` does: expired or absent → a fresh
/// record at attempt 1; a different fingerprint → conflict; completed or in doubt → duplicate;
/// a live lease → in progress; otherwise a takeover at `attempt + 1`.
pub(crate) fn decide(stored: Option<Record>, req: &ClaimRequest, now: Timestamp) -> Decision {
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
                created_at: now,
                updated_at: now,
                lease_until: Some(until),
                expires_at: keep,
            };
            let lease = Lease::new(req.key.clone(), req.fingerprint, token, 1, until, None);
            return Decision { claim: Claim::Acquired(lease), write: Some(rec) };
        }
    };
    if let (Some(stored), Some(asked)) = (rec.fingerprint, req.fingerprint)
        && stored != asked
    {
        return Decision { claim: Claim::Conflict(rec), write: None };
    }
    match rec.state {
        RecordState::Completed | RecordState::InDoubt => {
            Decision { claim: Claim::Completed(rec), write: None }
        }
        RecordState::InProgress if rec.is_leased_at(now) => Decision {
            claim: Claim::InProgress {
                retry_after: rec.lease_until.unwrap_or(now).since(now),
                attempt: rec.attempt,
            },
            write: None,
        },
        previous => {
            let mut rec = rec;
            rec.previous = Some(previous);
            rec.attempt = rec.attempt.saturating_add(1);
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
            );
            Decision { claim: Claim::Acquired(lease), write: Some(rec) }
        }
    }
}
