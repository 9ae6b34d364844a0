//! MySQL / MariaDB: the store and its transactional inbox.
//!
//! The store is split by concept: its type, settings and error classification here; `setup`
//! (connect, migrate, the startup check); `claim` (claims and completions: the
//! [`DedupStore`](idem_core::DedupStore) calls); `inspect` (the operator's reads and forced
//! changes).

mod claim;
mod inbox;
mod inspect;
mod outbox;
mod positions;
mod setup;
mod sql;

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::time::ClockSkew;
use idem_core::{Identifier, IdentifierError, StoreError};
use sqlx::mysql::{MySqlDatabaseError, MySqlPool};

pub use inbox::MySqlInbox;
pub use outbox::MySqlOutbox;

use crate::DEFAULT_TABLE;
use sql::{Binds, Sql};

/// Longest table name (the derived index name must fit MySQL's 64-byte limit).
pub const MAX_TABLE_NAME: usize = 52;

/// Rows per claim statement (MySQL allows 65,535 placeholders; a row takes 12).
const MAX_ROWS: usize = 1000;

/// The MySQL / MariaDB store.
///
/// A claim is one `INSERT … ON DUPLICATE KEY UPDATE` whose assignments apply only when the row
/// is claimable, stamping it with a random per-claim `owner`; the row read back (a locking read
/// in the same transaction) says whether this claim won. No check-then-insert, no
/// `SELECT … FOR UPDATE` on a row that may not exist (gap locks), no `INSERT IGNORE`. A fresh
/// key is one `INSERT … RETURNING`; `claim_many` is one transaction of multi-row statements, so
/// a batch is one atomic step. Leases use the
/// server clock (`NOW(6)`). Keys are the `BINARY(32)` hash column, so collations and trailing
/// spaces never merge keys.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore};
/// use idem_sqlx::MySqlStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let store = MySqlStore::connect("mysql://root@127.0.0.1:3306/test").await?;
/// store.migrate().await?; // once: creates the table (a consumer's build checks it)
/// let req = ClaimRequest::new(DedupKey::new("orders", "o-1")?, None,
///                             Duration::from_secs(30), Duration::from_secs(86_400));
/// if let Claim::Acquired(lease) = store.claim(&req).await? {
///     store.complete(lease, Some(b"ok"), Duration::from_secs(86_400)).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    /// Whether the server takes `INSERT … RETURNING` (MariaDB ≥ 10.5); cleared on first refusal.
    returning: Arc<std::sync::atomic::AtomicBool>,
    table: Identifier,
    sql: Arc<Sql>,
    skew: ClockSkew,
}

impl std::fmt::Debug for MySqlStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlStore").field("table", &self.table).finish_non_exhaustive()
    }
}

/// A random, non-zero owner stamp for one claim.
fn nonce() -> i64 {
    static SEED: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let h = SEED.get_or_init(Default::default).hash_one(SEQ.fetch_add(1, Ordering::Relaxed));
    i64::try_from(h >> 1).unwrap_or(1).max(1)
}

impl MySqlStore {
    /// Wraps an existing pool with the default table name.
    pub fn new(pool: MySqlPool) -> Self {
        let table = Identifier::new("table name", DEFAULT_TABLE).expect("default is valid");
        Self {
            sql: Arc::new(Sql::new(table.as_str())),
            pool,
            table,
            skew: ClockSkew::new(),
            returning: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        }
    }

    /// Uses another table (letters, digits, `_`; at most [`MAX_TABLE_NAME`] bytes).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the problem.
    pub fn with_table_name(mut self, name: &str) -> Result<Self, IdentifierError> {
        let table = Identifier::with_limit("table name", name, MAX_TABLE_NAME)?;
        self.sql = Arc::new(Sql::new(table.as_str()));
        self.table = table;
        Ok(self)
    }

    /// Shifts the server clock by `skew` (tests move time this way instead of sleeping).
    #[must_use]
    pub fn with_clock_skew(mut self, skew: ClockSkew) -> Self {
        self.skew = skew;
        self
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// The table name.
    pub fn table(&self) -> &str {
        self.table.as_str()
    }

    /// A transactional inbox over the same table, keeping markers for `retain_for`.
    pub fn inbox(&self, retain_for: Duration) -> MySqlInbox {
        MySqlInbox::new(self.clone(), retain_for)
    }

    fn binds(&self) -> Binds {
        Binds::default().int("skew", Some(self.skew.micros()))
    }
}

/// Whether `e` is MySQL's duplicate-key error (1062): for business tables that are their own
/// marker (insert the row keyed by its business id; a duplicate key means a duplicate
/// delivery — then compare the stored fingerprint to tell a conflict).
pub fn is_duplicate_key(e: &sqlx::Error) -> bool {
    error_number(e) == Some(1062)
}

/// MySQL's error number, when the error came from the server.
pub(crate) fn error_number(e: &sqlx::Error) -> Option<u16> {
    match e {
        sqlx::Error::Database(db) => {
            db.try_downcast_ref::<MySqlDatabaseError>().map(|m| m.number())
        }
        _ => None,
    }
}

/// Classifies a driver error: deadlock (1213), lock wait timeout (1205), a lost connection and
/// pool timeouts are retryable. On a Galera cluster a transaction that lost certification to a
/// write committed through another node (at `COMMIT`, or aborted by it earlier) is a deadlock
/// too, and a node outside the primary component or still catching up refuses statements with
/// 1047 ("WSREP has not yet prepared node for application use"); neither committed anything.
pub(crate) fn backend(op: &'static str, e: sqlx::Error) -> StoreError {
    let retryable = matches!(error_number(&e), Some(1213 | 1205 | 1047 | 2006 | 2013))
        || matches!(e, sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed);
    StoreError::backend(op, retryable, e)
}
