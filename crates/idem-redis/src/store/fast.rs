//! The script-free claim: `SET key <fresh record> NX GET PX <retention>` (Redis ≥ 7.0).
//!
//! One command both arbitrates and reads. When the key is absent, Redis writes the fresh
//! in-progress record and the claim is acquired. When it exists, Redis writes nothing and
//! returns the record: the answers that write nothing (completed, conflict, a lease clearly
//! still live) are decided here from it; every other case (an expired lease, a released or
//! failed record, a time too close to call) goes to the claim script, which decides on the
//! server as before. A claim is therefore never decided from a stale read: either Redis' own
//! `NX` decided it, or the record it returned was current at that instant and the answer writes
//! nothing.

use idem_core::{Claim, ClaimRequest, Lease, Record, RecordState, Timestamp};

use super::clock::Estimate;

/// The fresh record's times, all from the server clock estimate (plus the test offset).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fresh {
    pub(crate) now_us: i64,
    pub(crate) until_us: i64,
    pub(crate) expires_us: i64,
    /// The key's TTL in whole milliseconds, rounded up (as the scripts write it).
    pub(crate) ttl_ms: i64,
}

impl Fresh {
    pub(crate) fn new(req: &ClaimRequest, now_us: i64) -> Self {
        let lease = idem_core::time::duration_micros(req.lease_for);
        let keep = lease.max(idem_core::time::duration_micros(req.retain_for));
        let ttl_ms = ((keep + 999) / 1000).max(1);
        Self {
            // Tokens are at least 1, as the script writes them.
            now_us: now_us.max(1),
            until_us: now_us + lease,
            expires_us: now_us + keep,
            ttl_ms,
        }
    }

    /// The packed in-progress record, byte for byte what the claim script would write.
    pub(crate) fn pack(&self, req: &ClaimRequest) -> Vec<u8> {
        let fp: &[u8] = req.fingerprint.as_ref().map_or(&[], |f| &f.0[..]);
        let (scope, id) = (req.key.scope().as_bytes(), req.key.id().as_bytes());
        let mut v =
            Vec::with_capacity(2 + 4 + 40 + 4 + fp.len() + 1 + 4 + 8 + scope.len() + id.len());
        v.push(RecordState::InProgress.code().to_be_bytes()[1]);
        v.push((-1i8).to_be_bytes()[0]);
        v.extend(1u32.to_be_bytes());
        for t in [self.now_us, self.now_us, self.now_us, self.until_us, self.expires_us] {
            #[allow(clippy::cast_precision_loss)] // µs since 1970 are far below 2^53
            v.extend((t as f64).to_be_bytes());
        }
        for (i, field) in [fp, b"", scope, id].into_iter().enumerate() {
            if i == 1 {
                v.push(0); // no result
            }
            v.extend(u32::try_from(field.len()).unwrap_or(u32::MAX).to_be_bytes());
            v.extend(field);
        }
        v
    }

    /// The lease a successful `SET … NX` grants.
    pub(crate) fn lease(&self, req: &ClaimRequest) -> Lease {
        Lease::new(
            req.key.clone(),
            req.fingerprint,
            u64::try_from(self.now_us).unwrap_or(1),
            1,
            Timestamp::from_micros(self.until_us),
            None,
        )
    }
}

/// The answer for an existing record when it writes nothing and the clock estimate is far
/// enough from every deadline; `None` sends the claim to the script.
pub(crate) fn decide(rec: Record, req: &ClaimRequest, est: Estimate) -> Option<Claim> {
    let now = est.now_us;
    let clearly_after = |t: Timestamp| t.as_micros() > now + est.margin_us;
    let clearly_live =
        rec.state == RecordState::InProgress && rec.lease_until.is_some_and(clearly_after);
    if !clearly_after(rec.expires_at) && !clearly_live {
        return None; // retention over (or nearly): the script may claim it afresh
    }
    if let (Some(stored), Some(mine)) = (rec.fingerprint, req.fingerprint)
        && stored != mine
    {
        return Some(Claim::Conflict(rec));
    }
    match rec.state {
        RecordState::Completed | RecordState::InDoubt => Some(Claim::Completed(rec)),
        RecordState::InProgress if clearly_live => {
            let left = rec.lease_until.map_or(0, |t| t.as_micros() - now);
            Some(Claim::InProgress {
                retry_after: std::time::Duration::from_micros(u64::try_from(left).unwrap_or(0)),
                attempt: rec.attempt,
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use idem_core::{DedupKey, Fingerprint, KeyHash};

    use super::*;
    use crate::store::codec;

    fn req(fp: Option<[u8; 32]>) -> ClaimRequest {
        ClaimRequest::new(
            DedupKey::new("orders", "o-1é").unwrap(),
            fp.map(Fingerprint),
            Duration::from_secs(30),
            Duration::from_secs(3600),
        )
    }

    fn est(now_us: i64) -> Estimate {
        Estimate { now_us, margin_us: 1_000 }
    }

    #[test]
    fn the_packed_fresh_record_decodes_as_the_script_writes_it() {
        let r = req(Some([9; 32]));
        let f = Fresh::new(&r, 1_796_280_526_751_527);
        let rec = codec::record(&f.pack(&r), KeyHash([1; 32])).unwrap();
        assert_eq!(rec.state, RecordState::InProgress);
        assert_eq!(rec.previous, None);
        assert_eq!((rec.attempt, rec.token), (1, 1_796_280_526_751_527));
        assert_eq!(rec.lease_until.unwrap().as_micros(), 1_796_280_526_751_527 + 30_000_000);
        assert_eq!(rec.expires_at.as_micros(), 1_796_280_526_751_527 + 3_600_000_000);
        assert_eq!((rec.scope.as_str(), rec.id.as_str()), ("orders", "o-1é"));
        assert_eq!(rec.fingerprint, Some(Fingerprint([9; 32])));
        assert_eq!(rec.result, None);
        assert_eq!(f.ttl_ms, 3_600_000);
    }

    fn stored(state: RecordState, lease_end: Option<i64>, expires: i64, fp: u8) -> Record {
        let r = req(Some([fp; 32]));
        let mut rec = codec::record(&Fresh::new(&r, 1_000).pack(&r), KeyHash([1; 32])).unwrap();
        rec.state = state;
        rec.lease_until = lease_end.map(Timestamp::from_micros);
        rec.expires_at = Timestamp::from_micros(expires);
        rec
    }

    #[test]
    fn decides_only_what_writes_nothing_and_is_far_from_a_deadline() {
        let mine = req(Some([1; 32]));
        let now = 10_000_000;
        let done = stored(RecordState::Completed, None, now + 60_000_000, 1);
        assert!(matches!(decide(done, &mine, est(now)), Some(Claim::Completed(_))));
        let other = stored(RecordState::Completed, None, now + 60_000_000, 2);
        assert!(matches!(decide(other, &mine, est(now)), Some(Claim::Conflict(_))));
        let live = stored(RecordState::InProgress, Some(now + 5_000_000), now + 60_000_000, 1);
        match decide(live, &mine, est(now)) {
            Some(Claim::InProgress { retry_after, attempt: 1 }) => {
                assert_eq!(retry_after, Duration::from_secs(5));
            }
            other => panic!("{other:?}"),
        }
        // To the script: an expired lease, a lease ending within the margin, a released or
        // failed record, a retention that is over or nearly over (even with a conflict).
        for (rec, why) in [
            (stored(RecordState::InProgress, Some(now - 1), now + 60_000_000, 1), "expired"),
            (stored(RecordState::InProgress, Some(now + 500), now + 60_000_000, 1), "margin"),
            (stored(RecordState::Released, None, now + 60_000_000, 1), "released"),
            (stored(RecordState::Failed, None, now + 60_000_000, 1), "failed"),
            (stored(RecordState::Completed, None, now + 500, 1), "retention ending"),
            (stored(RecordState::Completed, None, now - 500, 2), "expired conflict"),
        ] {
            assert!(decide(rec, &mine, est(now)).is_none(), "{why}");
        }
    }
}
