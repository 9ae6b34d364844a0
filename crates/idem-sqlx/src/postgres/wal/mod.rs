//! The WAL outbox on PostgreSQL: outgoing messages written into the write-ahead log with
//! `pg_logical_emit_message`, in the caller's transaction, and read back in commit order from
//! a logical replication slot by a [`WalRelay`].
//!
//! No table, no leases, no purge: a message exists only in the WAL, from its commit until the
//! relay advances the slot past it (after the broker confirmed it). See
//! `docs/adr/0008-wal-outbox.md` for what this promises and costs.

mod frame;
mod pgoutput;
mod relay;

use idem_core::outbox::{OutboxError, OutboxId, Outgoing};
use idem_core::{Identifier, IdentifierError, StoreError};
use sqlx::postgres::PgPool;
use sqlx::{AssertSqlSafe, Postgres};

pub use relay::{WalRelay, WalRelayBuilder, WalRelayError};

use super::{PostgresStore, backend};
use crate::outbox::{Enqueue, prepare};

/// Default slot (and publication) name of a [`PostgresWalOutbox`].
pub const DEFAULT_WAL_SLOT: &str = "idem_outbox";
/// Default prefix of the WAL messages a [`PostgresWalOutbox`] emits.
pub const DEFAULT_WAL_PREFIX: &str = "idem_outbox";

/// The transactional outbox in PostgreSQL's write-ahead log.
///
/// [`enqueue`](Self::enqueue) calls `pg_logical_emit_message(true, prefix, message)` on the
/// caller's connection: the message is part of their transaction, and exists only if it
/// commits. A [`WalRelay`] reads committed messages from the logical replication slot
/// ([`create_slot`](Self::create_slot) makes it; the server needs `wal_level = logical`),
/// publishes them in commit order and advances the slot past what the broker confirmed.
///
/// ```no_run
/// use idem_core::outbox::Outgoing;
/// use idem_sqlx::postgres::PostgresWalOutbox;
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = PostgresWalOutbox::new(pool.clone()).with_slot_name("orders_outbox")?;
/// outbox.create_slot().await?; // once; idempotent
/// let mut tx = pool.begin().await?;
/// sqlx::query("INSERT INTO orders (id) VALUES ('o-1')").execute(&mut *tx).await?;
/// outbox.enqueue(&mut tx, Outgoing::new("orders.accepted", r#"{"order":"o-1"}"#)).await?;
/// tx.commit().await?; // the order and the message commit together
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresWalOutbox {
    pool: PgPool,
    slot: Identifier,
    prefix: Identifier,
}

impl std::fmt::Debug for PostgresWalOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresWalOutbox")
            .field("slot", &self.slot)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// A WAL outbox on this store's pool, with the default slot and prefix.
    pub fn wal_outbox(&self) -> PostgresWalOutbox {
        PostgresWalOutbox::new(self.pool().clone())
    }
}

/// A slot name PostgreSQL accepts: lower-case letters, digits and `_`, at most 63 bytes.
fn slot_name(name: &str) -> Result<Identifier, IdentifierError> {
    let id = Identifier::new("slot name", name)?;
    if name.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err(IdentifierError::Invalid { field: "slot name", value: name.to_owned() });
    }
    Ok(id)
}

impl PostgresWalOutbox {
    /// The WAL outbox on `pool`, slot and publication [`DEFAULT_WAL_SLOT`], messages under
    /// [`DEFAULT_WAL_PREFIX`].
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            slot: Identifier::new("slot name", DEFAULT_WAL_SLOT).expect("default is valid"),
            prefix: Identifier::new("prefix", DEFAULT_WAL_PREFIX).expect("default is valid"),
        }
    }

    /// Reads from another slot, with a publication of the same name (lower-case letters,
    /// digits, `_`; at most 63 bytes). One slot per relay; each slot receives every message
    /// of the database, so slots that share a database should use different prefixes.
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_slot_name(mut self, name: &str) -> Result<Self, IdentifierError> {
        self.slot = slot_name(name)?;
        Ok(self)
    }

    /// Emits and reads messages under another prefix (letters, digits, `_`; at most 63
    /// bytes). The relay skips messages with other prefixes.
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_prefix(mut self, prefix: &str) -> Result<Self, IdentifierError> {
        self.prefix = Identifier::new("prefix", prefix)?;
        Ok(self)
    }

    /// The slot name (also the publication's).
    pub fn slot(&self) -> &str {
        self.slot.as_str()
    }

    /// The message prefix.
    pub fn prefix(&self) -> &str {
        self.prefix.as_str()
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Writes `msg` into the WAL on the caller's connection, inside their transaction: it is
    /// relayed only if that transaction commits. Returns its id.
    ///
    /// # Errors
    /// A field over its limit ([`OutboxError`] names it); backend errors (roll back).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is decoded before the caller's transaction commits.
    pub async fn enqueue(
        &self,
        to: &mut impl Enqueue<Postgres>,
        msg: Outgoing,
    ) -> Result<OutboxId, OutboxError> {
        let m = prepare(to, msg)?;
        sqlx::query("SELECT pg_logical_emit_message(true, $1, $2::bytea)")
            .bind(self.prefix.as_str())
            .bind(frame::encode(&m))
            .execute(to.connection())
            .await
            .map_err(|e| backend("wal outbox enqueue", e))?;
        Ok(m.id().clone())
    }

    /// Enqueues `messages` in a transaction of their own (random ids where none is given).
    ///
    /// # Errors
    /// A message that breaks a limit (nothing is enqueued); backend errors.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped mid-way, the messages may or may not be committed.
    pub async fn send(&self, messages: Vec<Outgoing>) -> Result<Vec<OutboxId>, OutboxError> {
        let mut tx = self.pool.begin().await.map_err(|e| backend("wal outbox send", e))?;
        let mut ids = Vec::with_capacity(messages.len());
        for m in messages {
            ids.push(self.enqueue(&mut tx, m).await?);
        }
        tx.commit().await.map_err(|e| backend("wal outbox send", e))?;
        Ok(ids)
    }

    /// Creates the publication (with no tables: only messages are decoded) and the logical
    /// replication slot (plugin `pgoutput`) if missing. Idempotent, and safe when several
    /// processes start at once. Messages committed before the slot exists are never relayed:
    /// create it before the first enqueue (as `idem migrate` creates tables).
    ///
    /// # Errors
    /// Backend errors; `wal_level` is not `logical` (the server must be restarted with it).
    ///
    /// # Cancel safety
    /// Cancel safe: run it again.
    pub async fn create_slot(&self) -> Result<(), StoreError> {
        let op = "wal outbox create_slot";
        let mut conn = self.pool.acquire().await.map_err(|e| backend(op, e))?;
        let level: String = sqlx::query_scalar("SHOW wal_level")
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| backend(op, e))?;
        if level != "logical" {
            return Err(StoreError::backend(op, false, WalLevel { found: level }));
        }
        // A session lock: a slot cannot be created inside a transaction that wrote.
        let lock = format!("idem-wal-slot:{}", self.slot);
        sqlx::query("SELECT pg_advisory_lock(hashtext($1))")
            .bind(&lock)
            .execute(&mut *conn)
            .await
            .map_err(|e| backend(op, e))?;
        let made = async {
            let exists: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
            )
            .bind(self.slot.as_str())
            .fetch_one(&mut *conn)
            .await?;
            if !exists {
                sqlx::query(AssertSqlSafe(format!("CREATE PUBLICATION \"{}\"", self.slot)))
                    .execute(&mut *conn)
                    .await?;
            }
            sqlx::query(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput') \
                 WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
            )
            .bind(self.slot.as_str())
            .execute(&mut *conn)
            .await
            .map(drop)
        }
        .await;
        let unlocked = sqlx::query("SELECT pg_advisory_unlock(hashtext($1))")
            .bind(&lock)
            .execute(&mut *conn)
            .await;
        made.map_err(|e| backend(op, e))?;
        unlocked.map(drop).map_err(|e| backend(op, e))
    }

    /// Drops the slot and its publication if they exist. **Messages not yet relayed are
    /// lost**, and the WAL the slot retained is freed. Fails while a relay is reading the slot.
    ///
    /// # Errors
    /// Backend errors (a relay holds the slot: `55006`).
    ///
    /// # Cancel safety
    /// Cancel safe: run it again.
    pub async fn drop_slot(&self) -> Result<(), StoreError> {
        let op = "wal outbox drop_slot";
        sqlx::query(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = $1",
        )
        .bind(self.slot.as_str())
        .execute(&self.pool)
        .await
        .map_err(|e| backend(op, e))?;
        sqlx::query(AssertSqlSafe(format!("DROP PUBLICATION IF EXISTS \"{}\"", self.slot)))
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|e| backend(op, e))
    }

    /// How many bytes of WAL the slot holds back: `pg_current_wal_lsn() -
    /// confirmed_flush_lsn`, the WAL written since the relay's last advance (messages not yet
    /// confirmed, and other writes the server cannot recycle meanwhile). `None` when the slot
    /// does not exist.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn lag_bytes(&self) -> Result<Option<u64>, StoreError> {
        let lag: Option<Option<i64>> = sqlx::query_scalar(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots \
             WHERE slot_name = $1",
        )
        .bind(self.slot.as_str())
        .fetch_optional(&self.pool)
        .await
        .map_err(|e| backend("wal outbox lag", e))?;
        Ok(lag.map(|l| l.and_then(|l| u64::try_from(l).ok()).unwrap_or(0)))
    }
}

/// The server's `wal_level` is not `logical`.
#[derive(Debug, thiserror::Error)]
#[error(
    "wal_level is {found}, the WAL outbox needs logical: ALTER SYSTEM SET wal_level = logical, then restart PostgreSQL"
)]
struct WalLevel {
    found: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_are_what_postgres_accepts() {
        assert!(slot_name("orders_outbox_2").is_ok());
        for bad in ["", "Orders", "a-b", "1a", "a b", &"a".repeat(64)] {
            assert!(slot_name(bad).is_err(), "{bad:?}");
        }
    }
}
