#![doc = include_str!("../../../README.md")]

pub use idem_core::*;

/// The embedded store and transactional inbox on SQLite (feature `sqlite`, on by default).
#[cfg(feature = "sqlite")]
pub mod sqlite {
    pub use idem_sqlx::sqlite::*;
    pub use idem_sqlx::{InboxError, InboxOutcome, Mark};
}

#[cfg(feature = "sqlite")]
pub use idem_sqlx::{SqliteInbox, SqliteStore};

/// The NATS JetStream consumer adapter (feature `nats`).
#[cfg(feature = "nats")]
pub use idem_nats as nats;
