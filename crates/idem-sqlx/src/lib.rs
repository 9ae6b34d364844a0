//! SQL stores and transactional inboxes for idem, on sqlx.
//!
//! - `sqlite` (default): [`SqliteStore`], the embedded default that needs no server, and
//!   [`SqliteInbox`], which records dedup markers inside the caller's own transaction.
//!
//! One table holds lease records and inbox markers alike, keyed by the 32-byte SHA-256 of the
//! key ([`idem_core::DedupKey::hash`]), with the raw scope and id beside it for display.

mod row;

#[cfg(feature = "sqlite")]
pub mod sqlite;

#[cfg(feature = "sqlite")]
pub use sqlite::{SqliteInbox, SqliteStore, Writes};

pub use row::{InboxError, InboxOutcome, Mark};

/// Default table name.
pub const DEFAULT_TABLE: &str = "idem_records";

/// Largest stored result or reason the SQL stores accept.
pub const MAX_RESULT_BYTES: usize = 1 << 20;
