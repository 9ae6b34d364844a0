//! SQL stores and transactional inboxes for idem, on sqlx.
//!
//! - `sqlite` (default): [`SqliteStore`], the embedded default that needs no server, and
//!   [`SqliteInbox`], which records dedup markers inside the caller's own transaction.
//!
//! - `postgres`: [`PostgresStore`] and [`PostgresInbox`] (leases on the database clock; group
//!   commit through `claim_many`/`complete_many` over `unnest` arrays), and
//!   [`postgres::EntityTable`] for business tables that are their own marker.
//! - `mysql`: `MySqlStore` and `MySqlInbox` for MariaDB/MySQL.
//!
//! - Inboxes: each database's inbox implements [`idem_core::TxInbox`] with SQL alone;
//!   `Consumer::builder(source).inbox(store.inbox(retain))` runs a broker's batches through one
//!   database transaction each, on any of the three databases; the handler gets the
//!   transaction ([`Tx<PostgresInbox>`](idem_core::Tx), which dereferences to the connection).
//! - [`outbox`]: transactional outboxes on the three databases: a handler enqueues outgoing
//!   messages in its transaction ([`Enqueue`]), a relay publishes them afterwards.
//!
//! One table holds lease records and inbox markers alike, keyed by the 32-byte SHA-256 of the
//! key ([`idem_core::DedupKey::hash`]), with the raw scope and id beside it for display.

#[cfg(test)]
mod cells;
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
mod check;
pub mod outbox;
mod row;
mod serialization;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod tls;

#[cfg(feature = "sqlite")]
pub mod sqlite;

#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteInbox, SqliteOutbox, SqliteStore};

#[cfg(feature = "postgres")]
pub mod postgres;

#[cfg(feature = "postgres")]
pub use postgres::{PostgresInbox, PostgresOutbox, PostgresStore};

#[cfg(feature = "mysql")]
pub mod mysql;

#[cfg(feature = "mysql")]
pub use mysql::{MySqlInbox, MySqlOutbox, MySqlStore};

pub use outbox::Enqueue;
pub use serialization::is_serialization_failure;
/// The client these stores are built on, re-exported so callers use the same version.
pub use sqlx;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub use tls::TlsUnavailable;

/// Default table name.
pub const DEFAULT_TABLE: &str = "idem_records";

/// Largest stored result or reason the SQL stores accept.
pub const MAX_RESULT_BYTES: usize = 1 << 20;
