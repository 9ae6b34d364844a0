//! Decoding rows and the types shared by every SQL backend.

use idem_core::{Fingerprint, KeyHash, Record, RecordState, StoreError, Timestamp};

/// The answer of an inbox `mark`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
#[must_use = "a duplicate or conflict must not be written again"]
pub enum Mark {
    /// The marker is new in this transaction: do the writes, then commit.
    First,
    /// A committed marker exists: skip the writes (and ack).
    Duplicate(Record),
    /// A marker exists with a different fingerprint: dead-letter, never drop.
    Conflict(Record),
    /// A lease record holds the key (a two-phase consumer in the same scope is running it).
    InProgress(Record),
}

/// What `process` did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
#[must_use]
pub enum InboxOutcome<T> {
    /// The writes ran and committed with the marker; the value they returned.
    Processed(T),
    /// Already processed; the stored result if one was stored.
    Duplicate(Option<T>),
    /// Same key, different payload.
    Conflict(Record),
    /// A lease record holds the key.
    InProgress(Record),
}

/// Errors of the inbox's `process` convenience.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError<E> {
    /// The store failed; the transaction was rolled back.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The caller's writes failed; the transaction was rolled back and no marker remains.
    #[error("inbox writes failed; rolled back")]
    Writes(#[source] E),
}

pub(crate) fn i64_of(v: u64, what: &'static str) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::Corrupt { what: format!("{what} {v} exceeds i64") })
}

pub(crate) struct RawRecord {
    pub key_hash: Vec<u8>,
    pub scope: String,
    pub key_id: String,
    pub state: i64,
    pub fingerprint: Option<Vec<u8>>,
    pub result: Option<Vec<u8>>,
    pub attempt: i64,
    pub token: i64,
    pub prev_state: Option<i64>,
    pub created_at: i64,
    pub updated_at: i64,
    pub lease_until: Option<i64>,
    pub expires_at: i64,
}

impl RawRecord {
    pub(crate) fn decode(self) -> Result<Record, StoreError> {
        let corrupt = |what: String| StoreError::Corrupt { what };
        let state = |code: i64| {
            RecordState::from_code(code)
                .ok_or_else(|| corrupt(format!("unknown state code {code}")))
        };
        Ok(Record {
            key_hash: KeyHash::from_slice(&self.key_hash)
                .map_err(|n| corrupt(format!("key hash of {n} bytes, expected 32")))?,
            scope: self.scope,
            id: self.key_id,
            state: state(self.state)?,
            fingerprint: self
                .fingerprint
                .map(|f| {
                    Fingerprint::from_slice(&f)
                        .map_err(|n| corrupt(format!("fingerprint of {n} bytes, expected 32")))
                })
                .transpose()?,
            result: self.result,
            attempt: u32::try_from(self.attempt)
                .map_err(|_| corrupt(format!("attempt {}", self.attempt)))?,
            token: u64::try_from(self.token)
                .map_err(|_| corrupt(format!("token {}", self.token)))?,
            previous: self.prev_state.map(state).transpose()?,
            created_at: Timestamp::from_micros(self.created_at),
            updated_at: Timestamp::from_micros(self.updated_at),
            lease_until: self.lease_until.map(Timestamp::from_micros),
            expires_at: Timestamp::from_micros(self.expires_at),
        })
    }
}
