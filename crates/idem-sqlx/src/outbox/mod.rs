//! Transactional outboxes: outgoing messages enqueued in the caller's transaction, beside the
//! inbox marker and the business rows, and published afterwards by a
//! [`Relay`](idem_core::outbox::Relay).
//!
//! - [`PostgresOutbox`](crate::PostgresOutbox): leases by `FOR UPDATE SKIP LOCKED` and wakes
//!   relays with `LISTEN/NOTIFY`.
//! - [`MySqlOutbox`](crate::MySqlOutbox): leases by `FOR UPDATE SKIP LOCKED` (MySQL 8,
//!   MariaDB 10.6+).
//! - [`SqliteOutbox`](crate::SqliteOutbox): leases under SQLite's write lock.
//!
//! Each is an [`OutboxStore`](idem_core::outbox::OutboxStore) for the relay, and each enqueues
//! through [`Enqueue`]: in an inbox handler pass its [`Tx`] (ids derived from the inbound key,
//! the same on every run of the handler), elsewhere a `sqlx::Transaction` or a connection
//! (random ids).
//!
//! The table (default `idem_outbox`) keeps one row per message: pending (0), sent (1) or
//! parked (2), with its lease, fencing token, failure count, next attempt and last error. A
//! message id is unique: enqueueing an id that is already in the table changes nothing.

// Without a database feature only the public types are used.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]

use idem_core::StoreError;
use idem_core::outbox::{MessageId, OutboxError, OutboxMessage, Outgoing, Pending, Ticket};

use crate::Tx;

/// Default outbox table name.
pub const DEFAULT_OUTBOX_TABLE: &str = "idem_outbox";

/// The longest failure reason kept in a row.
pub(crate) const MAX_REASON_BYTES: usize = 1000;

/// Where an outbox enqueues: a connection inside the caller's transaction, and where the
/// message ids come from.
///
/// - [`Tx`] (what an inbox handler gets): ids derived from the key of the message being
///   handled and a per-handler sequence, so a handler that runs again after a rollback
///   enqueues the same ids.
/// - `sqlx::Transaction` and the drivers' connections: random ids.
///
/// A message given its own id ([`Outgoing::id`]) keeps it either way.
pub trait Enqueue<DB: sqlx::Database>: Send {
    /// The connection to write on.
    fn connection(&mut self) -> &mut DB::Connection;

    /// The id for the next message without one.
    fn next_id(&mut self) -> MessageId;
}

impl<DB: sqlx::Database> Enqueue<DB> for Tx<DB> {
    fn connection(&mut self) -> &mut DB::Connection {
        self
    }

    fn next_id(&mut self) -> MessageId {
        self.next_message_id()
    }
}

impl<DB: sqlx::Database> Enqueue<DB> for sqlx::Transaction<'_, DB> {
    fn connection(&mut self) -> &mut DB::Connection {
        self
    }

    fn next_id(&mut self) -> MessageId {
        MessageId::random()
    }
}

#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(unused_macros)
)]
macro_rules! enqueue_on_connection {
    ($db:ty, $conn:ty) => {
        impl Enqueue<$db> for $conn {
            fn connection(&mut self) -> &mut $conn {
                self
            }

            fn next_id(&mut self) -> MessageId {
                MessageId::random()
            }
        }
    };
}

#[cfg(feature = "postgres")]
enqueue_on_connection!(sqlx::Postgres, sqlx::postgres::PgConnection);
#[cfg(feature = "mysql")]
enqueue_on_connection!(sqlx::MySql, sqlx::mysql::MySqlConnection);
#[cfg(feature = "sqlite")]
enqueue_on_connection!(sqlx::Sqlite, sqlx::sqlite::SqliteConnection);

/// Validates `msg` and settles its id.
pub(crate) fn prepare<DB: sqlx::Database>(
    to: &mut impl Enqueue<DB>,
    msg: Outgoing,
) -> Result<OutboxMessage, OutboxError> {
    msg.validate()?;
    Ok(msg.into_message(|| to.next_id()))
}

/// A reason cut to [`MAX_REASON_BYTES`] on a character boundary.
pub(crate) fn cut(reason: &str) -> &str {
    if reason.len() <= MAX_REASON_BYTES {
        return reason;
    }
    let mut end = MAX_REASON_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

/// A leased row's columns, as the claim statements return them.
struct Leased {
    seq: i64,
    token: i64,
    failures: i64,
    id: String,
    destination: String,
    payload: Vec<u8>,
    headers: String,
    ordering_key: Option<String>,
}

impl Leased {
    fn into_pending(self) -> Result<Pending, StoreError> {
        let failures = u32::try_from(self.failures).map_err(|_| StoreError::Corrupt {
            what: format!("outbox failures {}", self.failures),
        })?;
        let headers = idem_core::outbox::decode_headers(&self.headers)?;
        let message = OutboxMessage::from_parts(
            MessageId::from_stored(self.id),
            self.destination,
            self.payload,
            headers,
            self.ordering_key,
        );
        Ok(Pending::new(Ticket { row: self.seq, token: self.token }, failures, message))
    }
}

/// Leased rows as the claim statements return them — `seq, token, failures, message_id,
/// destination, payload, headers, ordering_key`, `failures` as a 64-bit integer — in row order.
pub(crate) fn pending_of<R>(rows: Vec<R>) -> Result<Vec<Pending>, StoreError>
where
    R: sqlx::Row,
    usize: sqlx::ColumnIndex<R>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> Vec<u8>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    let decode = |r: &R| -> Result<Leased, sqlx::Error> {
        Ok(Leased {
            seq: r.try_get(0)?,
            token: r.try_get(1)?,
            failures: r.try_get(2)?,
            id: r.try_get(3)?,
            destination: r.try_get(4)?,
            payload: r.try_get(5)?,
            headers: r.try_get(6)?,
            ordering_key: r.try_get(7)?,
        })
    };
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let leased = decode(r)
            .map_err(|e| StoreError::Corrupt { what: format!("leased outbox row: {e}") })?;
        out.push(leased.into_pending()?);
    }
    out.sort_by_key(|p| p.ticket.row);
    Ok(out)
}

/// Counts from `(state, count)` rows.
pub(crate) fn counts_of(
    rows: impl IntoIterator<Item = (i64, i64)>,
) -> Result<idem_core::outbox::OutboxCounts, StoreError> {
    let mut c = idem_core::outbox::OutboxCounts::default();
    for (state, n) in rows {
        let n = u64::try_from(n).unwrap_or(0);
        match state {
            0 => c.pending += n,
            1 => c.sent += n,
            2 => c.parked += n,
            other => return Err(StoreError::Corrupt { what: format!("outbox state {other}") }),
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_cut_on_a_character_boundary() {
        let long = "é".repeat(600);
        let c = cut(&long);
        assert!(c.len() <= MAX_REASON_BYTES && c.len() >= MAX_REASON_BYTES - 1);
        assert_eq!(cut("short"), "short");
    }
}
