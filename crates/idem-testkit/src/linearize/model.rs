//! The sequential contract of a [`DedupStore`](idem_core::DedupStore) (and the operator's
//! `force_release` / `force_fail` of [`InspectStore`](idem_core::InspectStore)), over a few
//! keys of one scope.
//!
//! # What is modelled
//! Every operation's answer kind and the fields the contract fixes: a claim is acquired (with
//! its attempt, what it took over and the fingerprint the lease carries), a duplicate (the
//! record's state, attempt, fingerprint and stored result), in progress (the holder's attempt)
//! or a conflict (the stored record's state, attempt and fingerprint: the key's current record,
//! even when the batch's own earlier request just acquired it); `claim_many` decides its
//! requests in order, atomically (or atomically per key, where a store says so); `complete`, `fail`, `release` and `extend` succeed only for
//! the key's latest lease while it is in progress, and fail with `LeaseLost` otherwise;
//! `force_release` answers whether a record existed, `force_fail` whether it failed one.
//!
//! # What is not
//! - **Time.** Leases and retention are long enough never to run out within a history, so no
//!   lease expires, no record expires and `purge` deletes nothing (which it must not: every
//!   record is under a live lease or within its retention). Expiry, takeover of an expired
//!   lease and purge of expired records are the conformance suite's cases, on a controlled
//!   clock.
//! - **Token values.** The model cannot predict them; a lease is an opaque handle
//!   ([`LeaseId`]: the operation that acquired it). Fencing is checked by its effect: an
//!   operation on a superseded or finished lease must answer `LeaseLost` and change nothing.
//! - Lease ends and `retry_after` (clock readings), `extend`'s new end, and the record's
//!   timestamps.

use idem_core::{FailKind, RecordState};

use super::Model;

/// A lease as the model knows it: which operation of the history acquired it and, for a
/// `claim_many`, which request of the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseId {
    /// Index of the acquiring operation in the history.
    pub op: usize,
    /// Index of the request in its batch (0 for `claim`).
    pub slot: usize,
}

/// An operation of a history. Keys are indices into the history's few keys, fingerprints
/// indices into a few payloads (`None`: claimed without a fingerprint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreOp {
    /// `claim`.
    Claim {
        /// Key index.
        key: usize,
        /// Fingerprint index.
        fp: Option<u8>,
    },
    /// `claim_many`, requests as `(key, fingerprint)`.
    ClaimMany(Vec<(usize, Option<u8>)>),
    /// The requests of one `claim_many` for one key, when a store applies a batch as one
    /// atomic step per key ([`Batches::PerKey`](super::Batches::PerKey)): decided together,
    /// in batch order.
    ClaimKey {
        /// Key index.
        key: usize,
        /// The batch's operation.
        op: usize,
        /// Each request's place in the batch and its fingerprint index, in batch order.
        reqs: Vec<(usize, Option<u8>)>,
    },
    /// `complete` with `result`.
    Complete {
        /// The lease.
        lease: LeaseId,
        /// The result stored.
        result: String,
    },
    /// `fail`.
    Fail {
        /// The lease.
        lease: LeaseId,
        /// Permanent or in doubt.
        kind: FailKind,
        /// The reason stored.
        reason: String,
    },
    /// `release`.
    Release {
        /// The lease.
        lease: LeaseId,
    },
    /// `extend`.
    Extend {
        /// The lease.
        lease: LeaseId,
    },
    /// `InspectStore::force_release`.
    ForceRelease {
        /// Key index.
        key: usize,
    },
    /// `InspectStore::force_fail` with `reason`.
    ForceFail {
        /// Key index.
        key: usize,
        /// The reason stored.
        reason: String,
    },
    /// `purge`.
    Purge,
}

impl StoreOp {
    /// The lease this operation uses, if any.
    pub fn lease(&self) -> Option<LeaseId> {
        match self {
            Self::Complete { lease, .. }
            | Self::Fail { lease, .. }
            | Self::Release { lease }
            | Self::Extend { lease } => Some(*lease),
            _ => None,
        }
    }
}

/// One claim's answer, reduced to what the model can predict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// `Claim::Acquired`.
    Acquired {
        /// The lease's attempt.
        attempt: u32,
        /// What it took over.
        previous: Option<RecordState>,
        /// The fingerprint the lease carries (`Some(u8::MAX)`: not one of the history's).
        fp: Option<u8>,
    },
    /// `Claim::Completed`.
    Completed {
        /// The record's state (completed or in doubt).
        state: RecordState,
        /// Its attempt.
        attempt: u32,
        /// Its fingerprint.
        fp: Option<u8>,
        /// Its stored result or reason (as text: the histories store text).
        result: Option<String>,
    },
    /// `Claim::InProgress`.
    InProgress {
        /// The holder's attempt.
        attempt: u32,
    },
    /// `Claim::Conflict`.
    Conflict {
        /// The stored record's state.
        state: RecordState,
        /// Its attempt.
        attempt: u32,
        /// Its fingerprint.
        fp: Option<u8>,
    },
}

/// An operation's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreRet {
    /// A claim's answers (one for `claim`), in request order.
    Claims(Vec<Answer>),
    /// `Ok(())` of a lease operation.
    Ok,
    /// `StoreError::LeaseLost`.
    LeaseLost,
    /// `force_release` / `force_fail`'s boolean.
    Changed(bool),
    /// `purge`'s count.
    Purged(u64),
}

/// A key's record in the model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rec {
    state: RecordState,
    fp: Option<u8>,
    attempt: u32,
    /// The latest lease, while in progress (cleared otherwise, so equal records hash equal).
    holder: Option<LeaseId>,
    result: Option<String>,
}

/// The sequential store over `keys` keys: the reference semantics of
/// [`MemoryStore`](idem_core::MemoryStore) and `idem_core::claim_rule::apply` with no clock.
#[derive(Debug, Clone, Copy)]
pub struct StoreModel {
    /// How many keys the history uses.
    pub keys: usize,
}

impl StoreModel {
    fn claim(recs: &mut [Option<Rec>], key: usize, fp: Option<u8>, id: LeaseId) -> Answer {
        let Some(rec) = recs[key].as_mut() else {
            recs[key] = Some(Rec {
                state: RecordState::InProgress,
                fp,
                attempt: 1,
                holder: Some(id),
                result: None,
            });
            return Answer::Acquired { attempt: 1, previous: None, fp };
        };
        if let (Some(stored), Some(asked)) = (rec.fp, fp)
            && stored != asked
        {
            return Answer::Conflict { state: rec.state, attempt: rec.attempt, fp: rec.fp };
        }
        match rec.state {
            RecordState::Completed | RecordState::InDoubt => Answer::Completed {
                state: rec.state,
                attempt: rec.attempt,
                fp: rec.fp,
                result: rec.result.clone(),
            },
            // Leases never run out within a history: in progress is always live.
            RecordState::InProgress => Answer::InProgress { attempt: rec.attempt },
            previous => {
                rec.state = RecordState::InProgress;
                rec.attempt += 1;
                rec.fp = rec.fp.or(fp);
                rec.holder = Some(id);
                rec.result = None;
                Answer::Acquired { attempt: rec.attempt, previous: Some(previous), fp: rec.fp }
            }
        }
    }

    /// The record `lease` may change: the key's, while that lease is its latest and in progress.
    fn fenced(recs: &mut [Option<Rec>], lease: LeaseId) -> Option<&mut Rec> {
        recs.iter_mut()
            .flatten()
            .find(|r| r.state == RecordState::InProgress && r.holder == Some(lease))
    }

    fn apply(&self, recs: &mut [Option<Rec>], id: usize, op: &StoreOp) -> StoreRet {
        match op {
            StoreOp::Claim { key, fp } => {
                StoreRet::Claims(vec![Self::claim(recs, *key, *fp, LeaseId { op: id, slot: 0 })])
            }
            StoreOp::ClaimKey { key, op, reqs } => StoreRet::Claims(
                reqs.iter()
                    .map(|(slot, fp)| {
                        Self::claim(recs, *key, *fp, LeaseId { op: *op, slot: *slot })
                    })
                    .collect(),
            ),
            StoreOp::ClaimMany(reqs) => StoreRet::Claims(
                reqs.iter()
                    .enumerate()
                    .map(|(slot, (key, fp))| Self::claim(recs, *key, *fp, LeaseId { op: id, slot }))
                    .collect(),
            ),
            StoreOp::Complete { lease, result } => {
                Self::finish(recs, *lease, RecordState::Completed, Some(result))
            }
            StoreOp::Fail { lease, kind, reason } => {
                Self::finish(recs, *lease, kind.state(), Some(reason))
            }
            StoreOp::Release { lease } => match Self::fenced(recs, *lease) {
                Some(rec) => {
                    rec.state = RecordState::Released;
                    rec.holder = None;
                    StoreRet::Ok
                }
                None => StoreRet::LeaseLost,
            },
            StoreOp::Extend { lease } => match Self::fenced(recs, *lease) {
                Some(_) => StoreRet::Ok,
                None => StoreRet::LeaseLost,
            },
            StoreOp::ForceRelease { key } => match recs[*key].as_mut() {
                Some(rec) => {
                    rec.state = RecordState::Released;
                    rec.holder = None;
                    StoreRet::Changed(true)
                }
                None => StoreRet::Changed(false),
            },
            StoreOp::ForceFail { key, reason } => match recs[*key].as_mut() {
                Some(rec) if rec.state != RecordState::Completed => {
                    rec.state = RecordState::Failed;
                    rec.holder = None;
                    rec.result = Some(reason.clone());
                    StoreRet::Changed(true)
                }
                _ => StoreRet::Changed(false),
            },
            StoreOp::Purge => StoreRet::Purged(0),
        }
    }

    fn finish(
        recs: &mut [Option<Rec>],
        lease: LeaseId,
        state: RecordState,
        result: Option<&String>,
    ) -> StoreRet {
        match Self::fenced(recs, lease) {
            Some(rec) => {
                rec.state = state;
                rec.holder = None;
                rec.result = result.cloned();
                StoreRet::Ok
            }
            None => StoreRet::LeaseLost,
        }
    }
}

impl Model for StoreModel {
    type State = Vec<Option<Rec>>;
    type Op = StoreOp;
    type Ret = StoreRet;

    fn init(&self) -> Self::State {
        vec![None; self.keys]
    }

    fn step(
        &self,
        state: &Self::State,
        id: usize,
        op: &StoreOp,
        ret: Option<&StoreRet>,
    ) -> Option<Self::State> {
        let mut next = state.clone();
        let answer = self.apply(&mut next, id, op);
        ret.is_none_or(|r| *r == answer).then_some(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_claim_is_in_progress_and_stale_complete_is_fenced() {
        let m = StoreModel { keys: 1 };
        let mut s = m.init();
        let first = m.apply(&mut s, 0, &StoreOp::Claim { key: 0, fp: Some(0) });
        assert_eq!(
            first,
            StoreRet::Claims(vec![Answer::Acquired { attempt: 1, previous: None, fp: Some(0) }])
        );
        let second = m.apply(&mut s, 1, &StoreOp::Claim { key: 0, fp: None });
        assert_eq!(second, StoreRet::Claims(vec![Answer::InProgress { attempt: 1 }]));
        let lease = LeaseId { op: 0, slot: 0 };
        assert_eq!(m.apply(&mut s, 2, &StoreOp::Release { lease }), StoreRet::Ok);
        let again = m.apply(&mut s, 3, &StoreOp::Claim { key: 0, fp: None });
        assert_eq!(
            again,
            StoreRet::Claims(vec![Answer::Acquired {
                attempt: 2,
                previous: Some(RecordState::Released),
                fp: Some(0)
            }])
        );
        let stale = StoreOp::Complete { lease, result: "r".to_owned() };
        assert_eq!(m.apply(&mut s, 4, &stale), StoreRet::LeaseLost);
    }

    #[test]
    fn claim_many_decides_repeats_in_order() {
        let m = StoreModel { keys: 1 };
        let mut s = m.init();
        let ret = m.apply(&mut s, 0, &StoreOp::ClaimMany(vec![(0, Some(0)), (0, Some(1))]));
        let StoreRet::Claims(answers) = ret else { panic!("claims") };
        assert!(matches!(answers[0], Answer::Acquired { attempt: 1, .. }));
        assert!(matches!(answers[1], Answer::Conflict { state: RecordState::InProgress, .. }));
    }
}
