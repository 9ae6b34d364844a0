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

/// The Redis store and the Redis Streams consumer adapter (feature `redis`); `idem::redis::redis`
/// is the client crate they are built on.
#[cfg(feature = "redis")]
pub use idem_redis as redis;
