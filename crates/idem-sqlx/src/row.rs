//! Decoding rows and the types shared by every SQL backend.

use idem_core::{Fingerprint, KeyHash, Lease, Record, RecordState, StoreError, Timestamp};
use sqlx::{ColumnIndex, Decode, Row, Type};

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

/// Why a claim or mark that did not write lost.
pub(crate) enum Loser {
    /// Completed or parked in doubt.
    Done(Record),
    /// Stored with another fingerprint.
    Conflict(Record),
    /// Under a live lease.
    Leased(Record),
}

/// Classifies the record a lost write found; `None` when it is claimable again (retry).
pub(crate) fn classify_loser(
    rec: Record,
    fingerprint: Option<idem_core::Fingerprint>,
    now: Timestamp,
) -> Option<Loser> {
    if rec.is_expired_at(now) {
        return None;
    }
    if let (Some(stored), Some(asked)) = (rec.fingerprint, fingerprint)
        && stored != asked
    {
        return Some(Loser::Conflict(rec));
    }
    match rec.state {
        RecordState::Completed | RecordState::InDoubt => Some(Loser::Done(rec)),
        RecordState::InProgress if rec.is_leased_at(now) => Some(Loser::Leased(rec)),
        _ => None,
    }
}

/// The mark a lost write found: duplicate, conflict or in progress; `None` when the record is
/// claimable again (mark again).
pub(crate) fn mark_of(
    rec: Record,
    fingerprint: Option<idem_core::Fingerprint>,
    now: Timestamp,
) -> Option<Mark> {
    Some(match classify_loser(rec, fingerprint, now)? {
        Loser::Done(r) => Mark::Duplicate(r),
        Loser::Conflict(r) => Mark::Conflict(r),
        Loser::Leased(r) => Mark::InProgress(r),
    })
}

pub(crate) fn fenced(rows: u64, lease: &Lease) -> Result<(), StoreError> {
    if rows == 1 { Ok(()) } else { Err(StoreError::LeaseLost { key: lease.key().to_string() }) }
}

/// Decodes the 13 record columns, in [`COLUMNS`] order, on any driver.
pub(crate) fn decode_row<'r, R>(row: &'r R) -> Result<Record, StoreError>
where
    R: Row,
    usize: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
    Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    String: Decode<'r, R::Database> + Type<R::Database>,
{
    let raw = (|| -> Result<RawRecord, sqlx::Error> {
        Ok(RawRecord {
            key_hash: row.try_get(0)?,
            scope: row.try_get(1)?,
            key_id: row.try_get(2)?,
            state: row.try_get(3)?,
            fingerprint: row.try_get(4)?,
            result: row.try_get(5)?,
            attempt: row.try_get(6)?,
            token: row.try_get(7)?,
            prev_state: row.try_get(8)?,
            created_at: row.try_get(9)?,
            updated_at: row.try_get(10)?,
            lease_until: row.try_get(11)?,
            expires_at: row.try_get(12)?,
        })
    })()
    .map_err(|e| StoreError::backend("decode", false, e))?;
    raw.decode()
}

/// Columns in the order every record `SELECT` returns them (all SQL backends).
pub(crate) const COLUMNS: &str = "key_hash, scope, key_id, state, fingerprint, result, attempt, \
     token, prev_state, created_at, updated_at, lease_until, expires_at";

/// The outcome of `process` when the mark settles the delivery (`None` for [`Mark::First`]:
/// run the writes).
pub(crate) fn settled<T: serde::de::DeserializeOwned>(
    mark: Mark,
) -> Result<Option<InboxOutcome<T>>, StoreError> {
    Ok(Some(match mark {
        Mark::First => return Ok(None),
        Mark::Duplicate(rec) => InboxOutcome::Duplicate(
            rec.result
                .as_deref()
                .map(serde_json::from_slice)
                .transpose()
                .map_err(|e| StoreError::Corrupt { what: format!("stored result: {e}") })?,
        ),
        Mark::Conflict(rec) => InboxOutcome::Conflict(rec),
        Mark::InProgress(rec) => InboxOutcome::InProgress(rec),
    }))
}

/// Sums `(state, count, expired)` rows of a count query, on any driver.
pub(crate) fn counts_of<'r, R>(rows: &'r [R]) -> Result<idem_core::Counts, StoreError>
where
    R: Row,
    usize: ColumnIndex<R>,
    i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let mut counts = idem_core::Counts::default();
    for row in rows {
        let get = |e| StoreError::backend("count", false, e);
        let code: i64 = row.try_get(0).map_err(get)?;
        let n: i64 = row.try_get(1).map_err(get)?;
        let expired: i64 = row.try_get(2).map_err(get)?;
        let state = RecordState::from_code(code)
            .ok_or_else(|| StoreError::Corrupt { what: format!("unknown state code {code}") })?;
        counts.add(state, u64::try_from(n).unwrap_or(0));
        counts.expired += u64::try_from(expired).unwrap_or(0);
    }
    Ok(counts)
}
