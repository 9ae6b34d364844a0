//! PostgreSQL: the production store, its transactional inbox and the entity-as-marker helper.
//!
//! The store is split by concept: its type and settings here; `setup` (connect, migrate, the
//! startup check); `claim` (claims and completions: the [`DedupStore`](idem_core::DedupStore)
//! calls); `inspect` (the operator's reads and forced changes); `version` (the version guard).

mod claim;
mod entity;
mod inbox;
mod inspect;
mod outbox;
mod positions;
mod setup;
mod sql;
mod version;
mod wal;

use std::sync::Arc;
use std::time::Duration;

use idem_core::time::ClockSkew;
use idem_core::{Identifier, IdentifierError, StoreError};
use sqlx::postgres::PgPool;

pub use entity::EntityTable;
pub use inbox::PostgresInbox;
pub use outbox::PostgresOutbox;
pub use wal::{
    DEFAULT_WAL_PREFIX, DEFAULT_WAL_SLOT, PostgresWalOutbox, WalRelay, WalRelayBuilder,
    WalRelayError,
};

use crate::DEFAULT_TABLE;
use sql::Sql;

/// Default schema of the PostgreSQL store.
pub const DEFAULT_SCHEMA: &str = "idem";

/// Longest table name: derived names (`<table>_versions`, `<table>_expires_at`) must stay
/// within PostgreSQL's 63-byte identifier limit, which it would otherwise cut silently.
pub const MAX_TABLE_NAME: usize = 52;

/// The PostgreSQL store.
///
/// A claim is one statement — `INSERT … ON CONFLICT (key_hash) DO UPDATE … WHERE <claimable>
/// RETURNING` — so the row lock of the primary key arbitrates every race; `claim_many` is one
/// transaction: one statement over `unnest` arrays (and, when some keys were taken, one read of
/// their records, still locked by it), so a batch is one atomic step.
/// Leases and expiries are measured by the database clock
/// (`statement_timestamp()`), never by the consumers'. Records live in their own schema
/// (`idem` by default).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore};
/// use idem_sqlx::PostgresStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
/// store.migrate().await?; // once: creates the table (a consumer's build checks it)
/// let req = ClaimRequest::new(DedupKey::new("orders", "o-1")?, None,
///                             Duration::from_secs(30), Duration::from_secs(86_400));
/// if let Claim::Acquired(lease) = store.claim(&req).await? {
///     store.complete(lease, Some(b"ok"), Duration::from_secs(86_400)).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pool: PgPool,
    schema: Identifier,
    table: Identifier,
    sql: Arc<Sql>,
    skew: ClockSkew,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("schema", &self.schema)
            .field("table", &self.table)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Wraps an existing pool, with the default schema and table. Call
    /// [`PostgresStore::migrate`] unless your own migrations create the table
    /// (`migrations/postgres/` holds the same DDL).
    pub fn new(pool: PgPool) -> Self {
        let schema = Identifier::new("schema name", DEFAULT_SCHEMA).expect("default is valid");
        let table = Identifier::new("table name", DEFAULT_TABLE).expect("default is valid");
        Self {
            sql: Arc::new(Sql::new(schema.as_str(), table.as_str())),
            pool,
            schema,
            table,
            skew: ClockSkew::new(),
        }
    }

    /// Uses another schema (letters, digits, `_`; at most 63 bytes).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_schema(mut self, name: &str) -> Result<Self, IdentifierError> {
        self.schema = Identifier::new("schema name", name)?;
        self.sql = Arc::new(Sql::new(self.schema.as_str(), self.table.as_str()));
        Ok(self)
    }

    /// Uses another table (letters, digits, `_`; at most [`MAX_TABLE_NAME`] bytes).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, IdentifierError> {
        let table = Identifier::with_limit("table name", name, MAX_TABLE_NAME)?;
        self.table = table;
        self.sql = Arc::new(Sql::new(self.schema.as_str(), self.table.as_str()));
        Ok(self)
    }

    /// Shifts the database clock by `skew` (tests move time this way instead of sleeping).
    #[must_use]
    pub fn with_clock_skew(mut self, skew: ClockSkew) -> Self {
        self.skew = skew;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        self.schema.as_str()
    }

    /// The table name.
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// A transactional inbox over the same table, keeping markers for `retain_for`.
    pub fn inbox(&self, retain_for: Duration) -> PostgresInbox {
        PostgresInbox::new(self.clone(), retain_for)
    }

    fn skew(&self) -> i64 {
        self.skew.micros()
    }
}

/// Classifies a driver error: serialization failures, deadlocks, lost connections and pool
/// timeouts are retryable.
pub(crate) fn backend(op: &'static str, e: sqlx::Error) -> StoreError {
    let retryable = match &e {
        // 40001 serialization_failure, 40P01 deadlock_detected, 55P03 lock_not_available,
        // 57P01 admin_shutdown, 08xxx connection exceptions.
        sqlx::Error::Database(db) => db.code().is_some_and(|c| {
            matches!(c.as_ref(), "40001" | "40P01" | "55P03" | "57P01") || c.starts_with("08")
        }),
        sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed => true,
        _ => false,
    };
    StoreError::backend(op, retryable, e)
}
