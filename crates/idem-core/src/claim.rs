//! Claims and leases: the values a store hands back.

use std::time::Duration;

use crate::{DedupKey, Fingerprint, Record, RecordState, Timestamp};

/// What a consumer asks a store to claim.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// The key to claim.
    pub key: DedupKey,
    /// Fingerprint of this delivery's payload; a different stored fingerprint is a conflict.
    pub fingerprint: Option<Fingerprint>,
    /// How long the lease lasts before another delivery may take it over.
    pub lease_for: Duration,
    /// How long the record is kept (from the claim; `complete` sets it again).
    pub retain_for: Duration,
    /// Whether a lease that ran out is taken over (`true`, the default). When `false`, such a
    /// key is answered [`Claim::InProgress`] with a zero `retry_after` and left as it is: the
    /// engine learns which keys of a batch a dead consumer held without holding them all, and
    /// then takes each over alone, right before its handler runs (see
    /// [`without_takeover`](Self::without_takeover)).
    pub takeover: bool,
}

impl ClaimRequest {
    /// A request with the given lease and retention.
    pub fn new(
        key: DedupKey,
        fingerprint: Option<Fingerprint>,
        lease_for: Duration,
        retain_for: Duration,
    ) -> Self {
        Self { key, fingerprint, lease_for, retain_for, takeover: true }
    }

    /// The same request, but one that does not take over an in-progress lease that ran out:
    /// the store answers [`Claim::InProgress`] with `retry_after` zero and the holder's attempt,
    /// and changes nothing. Released and failed records are claimed as usual.
    ///
    /// A batch that may hold several keys of a consumer that died must not take them all over
    /// at once: if one of them kills the process again, the others die with it, unrun, and
    /// each counts an attempt towards the crash-loop limit.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_core::{ClaimRequest, DedupKey};
    ///
    /// let key = DedupKey::new("billing", "o-1")?;
    /// let req = ClaimRequest::new(key, None, Duration::from_secs(30), Duration::from_secs(3600));
    /// assert!(req.takeover && !req.without_takeover().takeover);
    /// # Ok::<(), idem_core::KeyError>(())
    /// ```
    #[must_use]
    pub fn without_takeover(mut self) -> Self {
        self.takeover = false;
        self
    }
}

/// The answer to a claim. A value, never an error: each variant needs handling.
#[derive(Debug)]
#[must_use = "a claim must be matched: an acquired lease has to be completed or released"]
pub enum Claim {
    /// This caller owns the key until the lease runs out.
    Acquired(Lease),
    /// A terminal record exists (completed, or parked in doubt): this delivery is a duplicate.
    Completed(Record),
    /// Another consumer holds a live lease.
    InProgress {
        /// Time left on that lease, by the store's clock.
        retry_after: Duration,
        /// The holder's attempt number.
        attempt: u32,
    },
    /// The key is stored with a different fingerprint: same key, different content.
    Conflict(Record),
}

/// Proof of ownership of a key, returned by a claim and consumed by `complete`, `fail` or
/// `release`. Not `Clone`: one owner. Dropping it does nothing; the claim then expires on its own
/// and the next delivery takes it over.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a lease must be completed or released; dropped, it blocks the key until it expires"]
pub struct Lease {
    key: DedupKey,
    fingerprint: Option<Fingerprint>,
    token: u64,
    attempt: u32,
    until: Timestamp,
    previous: Option<RecordState>,
    deaths: u32,
}

impl Lease {
    /// For store implementations: a lease just granted.
    pub fn new(
        key: DedupKey,
        fingerprint: Option<Fingerprint>,
        token: u64,
        attempt: u32,
        until: Timestamp,
        previous: Option<RecordState>,
    ) -> Self {
        Self { key, fingerprint, token, attempt, until, previous, deaths: 0 }
    }

    /// For store implementations: the record's death count after this claim
    /// ([`Record::deaths`](crate::Record::deaths)); a store that does not set it reports 0, and
    /// the engine then never sees a crash loop.
    pub fn with_deaths(mut self, deaths: u32) -> Self {
        self.deaths = deaths;
        self
    }

    /// The leased key.
    pub fn key(&self) -> &DedupKey {
        &self.key
    }

    /// The fingerprint the key was claimed with.
    pub fn fingerprint(&self) -> Option<Fingerprint> {
        self.fingerprint
    }

    /// The fencing token: completing or releasing fails once a newer claim holds the key.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// 1 for the first claim; each takeover (expired lease, release, failure) adds one.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// How many holders of this key died holding it (their lease ran out), this claim's takeover
    /// included: what the crash-loop limit counts. Releases (a transient failure, a claim taken
    /// ahead and given back, a failed push) and failures never count.
    pub fn deaths(&self) -> u32 {
        self.deaths
    }

    /// When the lease ends, by the store's clock.
    pub fn until(&self) -> Timestamp {
        self.until
    }

    /// The state this claim took over from: `Some(InProgress)` means an earlier lease expired
    /// and its effect may or may not have happened.
    pub fn previous(&self) -> Option<RecordState> {
        self.previous
    }

    /// A second proof of the same claim, for trying a completion again after the store failed
    /// to answer (fencing makes a repeat of an applied completion fail, never apply twice).
    pub(crate) fn retry_copy(&self) -> Self {
        Self { key: self.key.clone(), ..*self }
    }

    /// Whether this claim took over a lease that ran out (a crashed or stuck consumer).
    pub fn took_over_expired(&self) -> bool {
        self.previous == Some(RecordState::InProgress)
    }

    /// For store implementations: record a successful `extend`.
    pub fn set_until(&mut self, until: Timestamp) {
        self.until = until;
    }
}

/// Why a lease ends without a result (see `DedupStore::fail`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailKind {
    /// Permanent failure: the message goes to the dead-letter queue; state `Failed`.
    Permanent,
    /// An expired lease was parked instead of run again; state `InDoubt`.
    InDoubt,
}

impl FailKind {
    /// The state a failed record gets.
    pub fn state(self) -> RecordState {
        match self {
            Self::Permanent => RecordState::Failed,
            Self::InDoubt => RecordState::InDoubt,
        }
    }
}

/// The fencing token for a new claim: above the key's previous token, and at least the store's
/// clock in microseconds. The clock term keeps tokens increasing even after a record was purged
/// and the key claimed afresh (a purge happens a whole retention period after the last claim).
pub fn next_token(previous: Option<u64>, now: Timestamp) -> u64 {
    let clock = u64::try_from(now.as_micros()).unwrap_or(0);
    previous.map_or(clock, |p| p.saturating_add(1)).max(clock).max(1)
}
