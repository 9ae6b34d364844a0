//! Stored records and their states.

use std::fmt;

use crate::{Fingerprint, KeyHash, Timestamp};

/// The state of a dedup record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecordState {
    /// Claimed under a lease; the effect may be running.
    InProgress,
    /// The effect is committed; the record may carry its result.
    Completed,
    /// The lease was given back (transient failure, operator release): the next delivery re-claims.
    Released,
    /// The handler failed permanently; the message was dead-lettered. A later delivery re-claims,
    /// so a message resubmitted from the dead-letter queue runs again.
    Failed,
    /// A lease expired while its effect may have run, and the consumer was configured to park such
    /// messages rather than run them again. Stays parked until an operator releases it.
    InDoubt,
}

impl RecordState {
    /// All states, in code order.
    pub const ALL: [RecordState; 5] =
        [Self::InProgress, Self::Completed, Self::Released, Self::Failed, Self::InDoubt];

    /// The small integer stores persist.
    pub const fn code(self) -> i16 {
        match self {
            Self::InProgress => 0,
            Self::Completed => 1,
            Self::Released => 2,
            Self::Failed => 3,
            Self::InDoubt => 4,
        }
    }

    /// The state for a persisted code.
    pub const fn from_code(code: i64) -> Option<Self> {
        Some(match code {
            0 => Self::InProgress,
            1 => Self::Completed,
            2 => Self::Released,
            3 => Self::Failed,
            4 => Self::InDoubt,
            _ => return None,
        })
    }

    /// Lower-case name used in logs, metrics and the CLI.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Completed => "completed",
            Self::Released => "released",
            Self::Failed => "failed",
            Self::InDoubt => "in_doubt",
        }
    }

    /// Parses [`RecordState::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One stored dedup record, as a store returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// What the store indexes.
    pub key_hash: KeyHash,
    /// The key's scope, kept for display.
    pub scope: String,
    /// The key's id, kept for display.
    pub id: String,
    /// Current state.
    pub state: RecordState,
    /// Fingerprint of the payload that first claimed the key.
    pub fingerprint: Option<Fingerprint>,
    /// The stored result (completed), or the reason (failed, in doubt).
    pub result: Option<Vec<u8>>,
    /// How many times the key was claimed since the record was created (1 for the first claim).
    pub attempt: u32,
    /// The fencing token of the latest claim; strictly increases per key.
    pub token: u64,
    /// The state the latest claim took the record over from, if it was a takeover.
    pub previous: Option<RecordState>,
    /// How many claims took the key over from a lease that ran out: holders that died (or
    /// stalled past their lease, which no other process can tell apart) while running it.
    /// Releases, failures and claims never add to it; a fresh record starts at 0.
    pub deaths: u32,
    /// When the record was created.
    pub created_at: Timestamp,
    /// When the record last changed.
    pub updated_at: Timestamp,
    /// End of the current lease (in progress only).
    pub lease_until: Option<Timestamp>,
    /// When the record may be purged.
    pub expires_at: Timestamp,
}

impl Record {
    /// A business row that is its own marker (an entity keyed by the message's key), as a
    /// completed record: its key and the fingerprint it was written with. Its times are not
    /// known (zero), and it carries no result.
    ///
    /// ```
    /// use idem_core::{DedupKey, Record, RecordState};
    ///
    /// let rec = Record::entity(&DedupKey::new("orders", "o-1")?, None);
    /// assert_eq!((rec.state, rec.id.as_str()), (RecordState::Completed, "o-1"));
    /// # Ok::<(), idem_core::KeyError>(())
    /// ```
    pub fn entity(key: &crate::DedupKey, fingerprint: Option<Fingerprint>) -> Self {
        let never = Timestamp::from_micros(0);
        Self {
            key_hash: key.hash(),
            scope: key.scope().to_owned(),
            id: key.id().to_owned(),
            state: RecordState::Completed,
            fingerprint,
            result: None,
            attempt: 1,
            token: 0,
            previous: None,
            deaths: 0,
            created_at: never,
            updated_at: never,
            lease_until: None,
            expires_at: never,
        }
    }

    /// Whether a live lease holds this record at `now`.
    pub fn is_leased_at(&self, now: Timestamp) -> bool {
        self.state == RecordState::InProgress && self.lease_until.is_some_and(|u| u > now)
    }

    /// Whether retention has passed and no live lease holds it: purge may remove it and a new
    /// claim starts afresh.
    pub fn is_expired_at(&self, now: Timestamp) -> bool {
        self.expires_at <= now && !self.is_leased_at(now)
    }
}
