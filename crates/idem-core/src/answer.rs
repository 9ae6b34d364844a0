//! A store's answer turned into an outcome: written once, for claims and inbox marks alike.

use serde::de::DeserializeOwned;

use crate::outcome::{Cause, Conflict, FailureKind, Outcome};
use crate::{Claim, ClaimRequest, Lease, RecordState, StoreError};

/// What a claim (or a mark) means for the delivery that asked.
#[derive(Debug)]
pub(crate) enum Answer<T, E> {
    /// The key is this delivery's: run the handler.
    Run(Lease),
    /// Decided without the handler, with the attempt the store reported.
    Settled(Outcome<T, E>, u32),
}

/// The answer to `req` from `claim`: a store failure is a transient failure; a completed record
/// a duplicate with its stored result (or, parked in doubt, a permanent failure); another
/// fingerprint a conflict; a live lease elsewhere a retry after its remaining time.
pub(crate) fn outcome_of<T: DeserializeOwned, E>(
    claim: Result<Claim, StoreError>,
    req: &ClaimRequest,
) -> Answer<T, E> {
    match claim {
        Err(e) => Answer::Settled(Outcome::failed(FailureKind::Transient, Cause::Store(e)), 0),
        Ok(Claim::Acquired(lease)) => Answer::Run(lease),
        Ok(Claim::Completed(rec)) if rec.state == RecordState::InDoubt => Answer::Settled(
            Outcome::failed(FailureKind::Permanent, Cause::InDoubt { attempt: rec.attempt }),
            rec.attempt,
        ),
        Ok(Claim::Completed(rec)) => {
            let decoded = rec.result.as_deref().map(serde_json::from_slice).transpose();
            let outcome = match decoded {
                Ok(r) => Outcome::Duplicate(r),
                Err(e) => Outcome::failed(FailureKind::Permanent, Cause::Decode(e)),
            };
            Answer::Settled(outcome, rec.attempt)
        }
        Ok(Claim::Conflict(rec)) => Answer::Settled(
            Outcome::Conflict(Box::new(Conflict {
                key: req.key.clone(),
                stored: rec.fingerprint,
                incoming: req.fingerprint,
                stored_state: rec.state,
            })),
            rec.attempt,
        ),
        Ok(Claim::InProgress { retry_after, attempt }) => {
            Answer::Settled(Outcome::InProgressElsewhere { retry_after }, attempt)
        }
    }
}
