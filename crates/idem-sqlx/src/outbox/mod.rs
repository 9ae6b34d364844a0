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
use idem_core::inbox::{Tx, TxInbox};
use idem_core::outbox::{OutboxError, OutboxId, OutboxMessage, Outgoing, Pending, Ticket};

use crate::row::{nullable, required};

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
    fn next_id(&mut self) -> OutboxId;
}

impl<DB, I> Enqueue<DB> for Tx<I>
where
    DB: sqlx::Database,
    I: TxInbox<Connection = DB::Connection>,
{
    fn connection(&mut self) -> &mut DB::Connection {
        self
    }

    fn next_id(&mut self) -> OutboxId {
        self.next_outbox_id()
    }
}

impl<DB: sqlx::Database> Enqueue<DB> for sqlx::Transaction<'_, DB> {
    fn connection(&mut self) -> &mut DB::Connection {
        self
    }

    fn next_id(&mut self) -> OutboxId {
        OutboxId::random()
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

            fn next_id(&mut self) -> OutboxId {
                OutboxId::random()
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
#[cfg_attr(test, derive(Debug, Clone))]
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
            OutboxId::from_stored(self.id),
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
    let decode = |r: &R| -> Result<Leased, StoreError> {
        Ok(Leased {
            seq: required(r, 0, "seq")?,
            token: required(r, 1, "token")?,
            failures: required(r, 2, "failures")?,
            id: required(r, 3, "message_id")?,
            destination: required(r, 4, "destination")?,
            payload: required(r, 5, "payload")?,
            headers: required(r, 6, "headers")?,
            ordering_key: nullable(r, 7, "ordering_key")?,
        })
    };
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        out.push(decode(r)?.into_pending()?);
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

/// Unsent rows from `(seq, message_id, destination, state, failures, last_error)` rows, the
/// columns every store's `unsent` query selects (state 2 is parked).
pub(crate) fn unsent_of(
    rows: impl IntoIterator<Item = (i64, String, String, i64, i64, Option<String>)>,
) -> Vec<idem_core::outbox::UnsentRow> {
    rows.into_iter()
        .map(|(seq, id, destination, state, failures, last_error)| {
            let failures = u32::try_from(failures).unwrap_or(0);
            idem_core::outbox::UnsentRow::new(
                seq,
                id,
                destination,
                state == 2,
                failures,
                last_error,
            )
        })
        .collect()
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

/// Property tests of the leased-row decoder: values in and out of their domains, of the right
/// SQL type or not (512 cases each; see `docs/RELIABILITY.md`).
#[cfg(test)]
mod props {
    use idem_core::outbox::encode_headers;
    use proptest::collection::vec;
    use proptest::option;
    use proptest::prelude::*;

    use super::*;
    use crate::cells::config;
    #[cfg(feature = "sqlite")]
    use crate::cells::{Cell, for_rows, with_swaps};

    /// Header lists, and their stored text.
    fn pairs() -> impl Strategy<Value = Vec<(String, String)>> {
        vec((".{0,4}", ".{0,4}"), 0..4)
    }

    /// Stored header text that is not a JSON array of string pairs: a cut-off encoding,
    /// trailing bytes, other shapes.
    fn bad_headers() -> impl Strategy<Value = String> {
        prop_oneof![
            (pairs(), any::<prop::sample::Index>()).prop_map(|(p, cut)| {
                let text = encode_headers(&p);
                let mut end = cut.index(text.len());
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                text[..end].to_owned()
            }),
            (pairs(), r"[x,\]}]{1,3}")
                .prop_map(|(p, junk)| format!("{}{junk}", encode_headers(&p))),
            prop::sample::select(vec![
                r#"{"a":"b"}"#,
                "null",
                r#""x""#,
                r#"[["a"]]"#,
                r#"[["a","b","c"]]"#,
                r#"[[1,"b"]]"#,
                r#"[["a",null]]"#,
                r#"[{"a":"b"}]"#,
                "[[]]",
            ])
            .prop_map(str::to_owned),
        ]
    }

    /// A leased row and, when its headers are well formed, the headers it holds.
    fn leased() -> impl Strategy<Value = (Leased, Option<Vec<(String, String)>>)> {
        let headers = prop_oneof![
            3 => pairs().prop_map(|p| (encode_headers(&p), Some(p))),
            1 => bad_headers().prop_map(|t| (t, None)),
        ];
        let failures = prop_oneof![
            4 => 0..=i64::from(u32::MAX),
            1 => prop::sample::select(vec![-1, i64::from(u32::MAX) + 1, i64::MIN, i64::MAX]),
        ];
        let text = ".{0,6}";
        (
            (any::<i64>(), any::<i64>(), failures, text, text),
            (vec(any::<u8>(), 0..16), headers, option::of(text)),
        )
            .prop_map(
                |(
                    (seq, token, failures, id, destination),
                    (payload, (headers, pairs), ordering_key),
                )| {
                    let row = Leased {
                        seq,
                        token,
                        failures,
                        id,
                        destination,
                        payload,
                        headers,
                        ordering_key,
                    };
                    (row, pairs)
                },
            )
    }

    proptest! {
        #![proptest_config(config())]

        /// A leased row decodes to the message it holds, exactly, or fails as corrupt naming
        /// the failure count or the headers.
        #[test]
        fn leased_values_decode_exactly_or_are_corrupt((row, pairs) in leased()) {
            let failures_ok = u32::try_from(row.failures).is_ok();
            match (row.clone().into_pending(), failures_ok, pairs) {
                (Ok(p), true, Some(pairs)) => {
                    prop_assert_eq!(p.ticket, Ticket { row: row.seq, token: row.token });
                    prop_assert_eq!(i64::from(p.failures), row.failures);
                    prop_assert_eq!(p.message.id().as_str(), row.id.as_str());
                    prop_assert_eq!(p.message.destination(), row.destination.as_str());
                    prop_assert_eq!(p.message.payload(), row.payload.as_slice());
                    prop_assert_eq!(p.message.headers(), pairs.as_slice());
                    prop_assert_eq!(p.message.ordering_key(), row.ordering_key.as_deref());
                }
                (Err(StoreError::Corrupt { what }), false, _) => {
                    prop_assert!(what.starts_with("outbox failures"), "{}", what);
                }
                (Err(StoreError::Corrupt { what }), true, None) => {
                    prop_assert!(what.starts_with("outbox headers"), "{}", what);
                }
                (got, failures_ok, pairs) => {
                    prop_assert!(false, "{got:?} (failures ok: {failures_ok}, headers {pairs:?})");
                }
            }
        }
    }

    #[cfg(feature = "sqlite")]
    fn cells_of(r: &Leased) -> Vec<Cell> {
        vec![
            Cell::Int(r.seq),
            Cell::Int(r.token),
            Cell::Int(r.failures),
            Cell::Text(r.id.clone()),
            Cell::Text(r.destination.clone()),
            Cell::Blob(r.payload.clone()),
            Cell::Text(r.headers.clone()),
            r.ordering_key.clone().map_or(Cell::Null, Cell::Text),
        ]
    }

    /// The row `cells` hold when each has its column's declared type (or is text where bytes
    /// belong); `None` when one does not.
    #[cfg(feature = "sqlite")]
    fn leased_of(cells: &[Cell]) -> Option<Leased> {
        let int = |c: &Cell| if let Cell::Int(v) = c { Some(*v) } else { None };
        let text = |c: &Cell| if let Cell::Text(s) = c { Some(s.clone()) } else { None };
        Some(Leased {
            seq: int(&cells[0])?,
            token: int(&cells[1])?,
            failures: int(&cells[2])?,
            id: text(&cells[3])?,
            destination: text(&cells[4])?,
            payload: cells[5].bytes()?,
            headers: text(&cells[6])?,
            ordering_key: match &cells[7] {
                Cell::Null => None,
                c => Some(text(c)?),
            },
        })
    }

    /// Real SQLite rows with any value of any type in any of the 8 columns: `pending_of` gives
    /// the message they hold, exactly, or corrupt.
    #[cfg(feature = "sqlite")]
    #[test]
    fn sqlite_leased_rows_of_any_types_decode_exactly_or_are_corrupt() {
        let cells = leased().prop_map(|(row, _)| cells_of(&row));
        for_rows(with_swaps(cells, 8), |cells, row| {
            match (pending_of(vec![row]), leased_of(cells).map(Leased::into_pending)) {
                (Ok(got), Some(Ok(want))) => {
                    prop_assert_eq!(got.len(), 1);
                    prop_assert_eq!(got[0].ticket, want.ticket);
                    prop_assert_eq!(got[0].failures, want.failures);
                    prop_assert_eq!(&got[0].message, &want.message);
                }
                (Err(StoreError::Corrupt { .. }), None | Some(Err(StoreError::Corrupt { .. }))) => {
                }
                (got, want) => prop_assert!(false, "{got:?}, expected {want:?} from {cells:?}"),
            }
            Ok(())
        });
    }
}
