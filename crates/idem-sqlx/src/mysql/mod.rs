//! MySQL / MariaDB: the store and its transactional inbox.

mod inbox;
mod outbox;
mod sql;

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::time::{ClockSkew, duration_micros};
use idem_core::{
    Claim, ClaimRequest, Completion, Counts, DedupKey, DedupStore, FailKind, Fingerprint,
    Identifier, IdentifierError, InspectStore, Lease, ListFilter, Record, RecordState, StoreError,
    Timestamp,
};
use sqlx::mysql::{MySqlConnection, MySqlDatabaseError, MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::{AssertSqlSafe, Row};

pub use inbox::MySqlInbox;
pub use outbox::MySqlOutbox;

use crate::row::{Loser, classify_loser, decode_row, fenced, i64_of};
use crate::{DEFAULT_TABLE, MAX_RESULT_BYTES};
use sql::{Binds, Sql};

/// Longest table name (the derived index name must fit MySQL's 64-byte limit).
pub const MAX_TABLE_NAME: usize = 52;

/// Rows per claim statement (MySQL allows 65,535 placeholders; a row takes 12).
const MAX_ROWS: usize = 1000;

/// The MySQL / MariaDB store.
///
/// A claim is one `INSERT … ON DUPLICATE KEY UPDATE` whose assignments apply only when the row
/// is claimable, stamping it with a random per-claim `owner`; the row read back says whether
/// this claim won. No check-then-insert, no `SELECT … FOR UPDATE` on a row that may not exist
/// (gap locks), no `INSERT IGNORE`. `claim_many` is one multi-row statement. Leases use the
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
    /// Connects a pool of 16 connections to `url`. Creates nothing: choose the table
    /// ([`with_table_name`](Self::with_table_name)), then create it once with
    /// [`migrate`](Self::migrate) (or your own migrations, from
    /// [`schema_sql`](Self::schema_sql)). A consumer's `build` runs [`check`](Self::check),
    /// which fails naming `migrate()` when the table is missing.
    ///
    /// TLS (feature `rustls`) is set in the URL:
    /// `mysql://app@db.example:3306/app?ssl-mode=VERIFY_IDENTITY&ssl-ca=/etc/ca.pem`, with
    /// `ssl-cert=…&ssl-key=…` for a client certificate. Without the feature, `REQUIRED` and
    /// stricter are refused, never downgraded.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when the server cannot be reached, the TLS handshake fails, or
    /// the URL asks for TLS this build lacks.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = MySqlPoolOptions::new()
            .max_connections(16)
            .connect_with(crate::tls::mysql_options(url)?)
            .await
            .map_err(|e| backend("connect", e))?;
        Ok(Self::new(pool))
    }

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

    /// Creates the table if it does not exist (idempotent).
    ///
    /// # Errors
    /// Backend errors.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        for stmt in &self.sql.ddl {
            sqlx::query(AssertSqlSafe(stmt.as_str()))
                .execute(&self.pool)
                .await
                .map_err(|e| backend("migrate", e))?;
        }
        Ok(())
    }

    /// The DDL [`MySqlStore::migrate`] runs, for users who own their migrations.
    pub fn schema_sql(&self) -> String {
        self.sql.ddl.iter().map(|s| format!("{s};\n")).collect()
    }

    /// Startup checks, run by a consumer's `build` ([`DedupStore::check`]). Fails when the
    /// table does not exist in the connection's database or lacks a column
    /// ([`StoreError::NotMigrated`], naming the table and `MySqlStore::migrate()`). Returns, and
    /// logs, a warning when `innodb_flush_log_at_trx_commit` is not 1 (a committed marker may
    /// vanish in a crash) or when the key column is not `binary(32)` (a text column would let
    /// collations merge keys).
    ///
    /// # Errors
    /// [`StoreError::NotMigrated`]; backend errors.
    pub async fn check(&self) -> Result<Vec<String>, StoreError> {
        let columns: Vec<(String, String)> = sqlx::query_as(
            "SELECT CAST(column_name AS CHAR), CAST(column_type AS CHAR) \
             FROM information_schema.columns \
             WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind(self.table.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(|e| backend("check", e))?;
        let names: Vec<String> = columns.iter().map(|(n, _)| n.clone()).collect();
        let table = format!("`{}`", self.table);
        if let Some(e) =
            crate::check::unmigrated(table, &names, &["owner"], "MySqlStore::migrate()")
        {
            return Err(e);
        }
        let mut warnings = Vec::new();
        let flush: Option<(String, String)> =
            sqlx::query_as("SHOW VARIABLES LIKE 'innodb_flush_log_at_trx_commit'")
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| backend("check", e))?;
        if let Some((_, v)) = flush
            && v != "1"
        {
            warnings.push(format!(
                "innodb_flush_log_at_trx_commit is {v}, not 1: a dedup marker acknowledged as \
                 committed may vanish in a crash, and its message would then run twice"
            ));
        }
        let key_type = columns.iter().find(|(n, _)| n.eq_ignore_ascii_case("key_hash"));
        if let Some((_, other)) = key_type.filter(|(_, t)| t != "binary(32)") {
            warnings.push(format!(
                "{}.key_hash is `{other}`, not `binary(32)`: keys are 32-byte hashes and must be \
                 compared as bytes (a text column lets collations merge keys); recreate the \
                 table from MySqlStore::schema_sql()",
                self.table
            ));
        }
        for w in &warnings {
            tracing::warn!(target: "idem::mysql", "{w}");
        }
        Ok(warnings)
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

    async fn fetch(
        &self,
        conn: &mut MySqlConnection,
        key: &DedupKey,
        locked: bool,
    ) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let stmt = if locked { &self.sql.select_locked } else { &self.sql.select };
        let row = stmt
            .query(&self.binds().bytes("hash", Some(&key.hash().0)))
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| backend("get", e))?;
        let Some(row) = row else { return Ok(None) };
        let now: i64 = row.try_get(14).map_err(|e| backend("get", e))?;
        Ok(Some((decode_row(&row)?, Timestamp::from_micros(now))))
    }

    /// One claim statement over distinct keys, then the rows read back: for each request, its
    /// answer, or `None` when the record changed under it and it must be tried again.
    async fn claim_round(&self, reqs: &[&ClaimRequest]) -> Result<Vec<Option<Claim>>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("claim", e))?;
        let rows = self.upsert_round(&mut conn, reqs, RecordState::InProgress).await?;
        Ok(rows
            .into_iter()
            .zip(reqs)
            .map(|(row, req)| {
                let (won, rec, now) = row?;
                if won {
                    return Some(Claim::Acquired(Lease::new(
                        req.key.clone(),
                        rec.fingerprint,
                        rec.token,
                        rec.attempt,
                        rec.lease_until.unwrap_or(now),
                        rec.previous,
                    )));
                }
                lost(rec, req.fingerprint, now)
            })
            .collect())
    }

    /// One upsert of distinct keys into `state` (in progress: a claim; completed: an inbox
    /// mark), rows in key-hash order so concurrent batches lock them in one order, then the
    /// rows read back (a locking read: inside a transaction it sees the latest commit). For
    /// each request: whether it won, its record and the database's now; `None` when its row is
    /// gone (purged meanwhile).
    pub(crate) async fn upsert_round(
        &self,
        conn: &mut MySqlConnection,
        reqs: &[&ClaimRequest],
        state: RecordState,
    ) -> Result<Vec<Option<(bool, Record, Timestamp)>>, StoreError> {
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by_key(|&i| reqs[i].key.hash().0);
        let mut first: HashMap<[u8; 32], (usize, i64)> = HashMap::new();
        let skew = self.skew.micros();
        let mut unique = Vec::new();
        for &i in &order {
            let h = reqs[i].key.hash().0;
            if let std::collections::hash_map::Entry::Vacant(e) = first.entry(h) {
                e.insert((i, nonce()));
                unique.push(i);
            }
        }
        let leased = state == RecordState::InProgress;
        let mut q = sqlx::query(AssertSqlSafe(self.sql.claim_many(unique.len(), state)));
        for &i in &unique {
            let r = reqs[i];
            let (_, owner) = first[&r.key.hash().0];
            q = q
                .bind(r.key.hash().0.to_vec())
                .bind(r.key.scope().to_owned())
                .bind(r.key.id().to_owned())
                .bind(r.fingerprint.map(|f| f.0.to_vec()))
                .bind(skew)
                .bind(skew)
                .bind(skew)
                .bind(skew)
                .bind(leased.then(|| duration_micros(r.lease_for)))
                .bind(skew)
                .bind(duration_micros(r.retain_for.max(r.lease_for)))
                .bind(owner);
        }
        q.execute(&mut *conn).await.map_err(|e| backend("claim", e))?;
        let mut sel =
            sqlx::query(AssertSqlSafe(self.sql.select_many(unique.len(), !leased))).bind(skew);
        for &i in &unique {
            sel = sel.bind(reqs[i].key.hash().0.to_vec());
        }
        let rows = sel.fetch_all(&mut *conn).await.map_err(|e| backend("claim", e))?;
        let mut found: HashMap<[u8; 32], (Record, i64, Timestamp)> = HashMap::new();
        for row in &rows {
            let get = |e| backend("claim", e);
            let rec = decode_row(row)?;
            let owner: i64 = row.try_get(13).map_err(get)?;
            let now: i64 = row.try_get(14).map_err(get)?;
            found.insert(rec.key_hash.0, (rec, owner, Timestamp::from_micros(now)));
        }
        Ok(reqs
            .iter()
            .enumerate()
            .map(|(i, req)| {
                let h = req.key.hash().0;
                let (rec, owner, now) = found.get(&h)?;
                let (first_i, mine) = first[&h];
                let won = first_i == i && *owner == mine && rec.state == state;
                Some((won, rec.clone(), *now))
            })
            .collect())
    }

    async fn finish(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        state: RecordState,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        StoreError::check_len("result", result.map_or(0, <[u8]>::len), MAX_RESULT_BYTES)?;
        let b = self
            .binds()
            .int("state", Some(i64::from(state.code())))
            .bytes("result", result)
            .int("keep", Some(duration_micros(retain_for)))
            .bytes("hash", Some(&lease.key().hash().0))
            .int("token", Some(i64_of(lease.token(), "token")?));
        let done = self
            .sql
            .finish
            .query(&b)
            .execute(&mut *conn)
            .await
            .map_err(|e| backend("complete", e))?;
        fenced(done.rows_affected(), lease)
    }
}

fn lost(rec: Record, fingerprint: Option<Fingerprint>, now: Timestamp) -> Option<Claim> {
    match classify_loser(rec, fingerprint, now)? {
        Loser::Done(rec) => Some(Claim::Completed(rec)),
        Loser::Conflict(rec) => Some(Claim::Conflict(rec)),
        Loser::Leased(rec) => Some(Claim::InProgress {
            retry_after: rec.lease_until.unwrap_or(now).since(now),
            attempt: rec.attempt,
        }),
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
/// pool timeouts are retryable.
pub(crate) fn backend(op: &'static str, e: sqlx::Error) -> StoreError {
    let retryable = matches!(error_number(&e), Some(1213 | 1205 | 2006 | 2013))
        || matches!(e, sqlx::Error::PoolTimedOut | sqlx::Error::Io(_) | sqlx::Error::WorkerCrashed);
    StoreError::backend(op, retryable, e)
}

impl MySqlStore {
    /// The fresh-key fast path: a plain `INSERT … RETURNING`. `None` when the key exists (or the
    /// server has no `RETURNING`): decide it with the upsert.
    async fn try_insert(&self, req: &ClaimRequest) -> Result<Option<Lease>, StoreError> {
        if !self.returning.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let b = self
            .binds()
            .bytes("hash", Some(&req.key.hash().0))
            .text("scope", req.key.scope())
            .text("id", req.key.id())
            .bytes("fp", req.fingerprint.as_ref().map(|f| &f.0[..]))
            .int("lease", Some(duration_micros(req.lease_for)))
            .int("keep", Some(duration_micros(req.retain_for.max(req.lease_for))))
            .int("owner", Some(nonce()));
        match self.sql.insert_claim.query(&b).fetch_one(&self.pool).await {
            Ok(row) => {
                let get = |e| backend("claim", e);
                let token: i64 = row.try_get(0).map_err(get)?;
                let until: Option<i64> = row.try_get(1).map_err(get)?;
                Ok(Some(Lease::new(
                    req.key.clone(),
                    req.fingerprint,
                    u64::try_from(token)
                        .map_err(|_| StoreError::Corrupt { what: format!("token {token}") })?,
                    1,
                    Timestamp::from_micros(until.unwrap_or_default()),
                    None,
                )))
            }
            Err(e) if is_duplicate_key(&e) => Ok(None),
            // 1064: a server without INSERT … RETURNING (MySQL): use the upsert from now on.
            Err(e) if error_number(&e) == Some(1064) => {
                self.returning.store(false, Ordering::Relaxed);
                Ok(None)
            }
            Err(e) => Err(backend("claim", e)),
        }
    }
}

impl DedupStore for MySqlStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        if let Some(lease) = self.try_insert(req).await? {
            return Ok(Claim::Acquired(lease));
        }
        for _ in 0..8 {
            if let Some(Some(claim)) = self.claim_round(&[req]).await?.pop() {
                return Ok(claim);
            }
        }
        Err(StoreError::backend("claim", true, "record kept changing under the claim (8 tries)"))
    }

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        let mut out = Vec::with_capacity(reqs.len());
        for chunk in reqs.chunks(MAX_ROWS) {
            let refs: Vec<&ClaimRequest> = chunk.iter().collect();
            for (answer, req) in self.claim_round(&refs).await?.into_iter().zip(chunk) {
                match answer {
                    Some(claim) => out.push(claim),
                    None => out.push(self.claim(req).await?),
                }
            }
        }
        Ok(out)
    }

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("complete", e))?;
        self.finish(&mut conn, &lease, RecordState::Completed, result, retain_for).await
    }

    /// One statement (one commit) for the batch; a second read only when some did not apply.
    async fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut out: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(items.len());
        let mut todo = Vec::new();
        for (i, c) in items.iter().enumerate() {
            let len = c.result.as_ref().map_or(0, Vec::len);
            match StoreError::check_len("result", len, MAX_RESULT_BYTES) {
                Err(e) => out.push(Some(Err(e))),
                Ok(()) => {
                    out.push(None);
                    todo.push(i);
                }
            }
        }
        let skew = self.skew.micros();
        for chunk in todo.chunks(MAX_ROWS) {
            let mut q = sqlx::query(AssertSqlSafe(self.sql.complete_many(chunk.len())));
            for &i in chunk {
                let c = &items[i];
                q = q
                    .bind(c.lease.key().hash().0.to_vec())
                    .bind(i64_of(c.lease.token(), "token")?)
                    .bind(c.result.clone())
                    .bind(duration_micros(c.retain_for));
            }
            let done = q
                .bind(skew)
                .bind(skew)
                .execute(&self.pool)
                .await
                .map_err(|e| backend("complete_many", e))?;
            if usize::try_from(done.rows_affected()).unwrap_or(0) == chunk.len() {
                for &i in chunk {
                    out[i] = Some(Ok(()));
                }
                continue;
            }
            // Some leases were stale: a row completed with our token is ours.
            let mut sel = sqlx::query(AssertSqlSafe(self.sql.tokens_of(chunk.len())));
            for &i in chunk {
                sel = sel.bind(items[i].lease.key().hash().0.to_vec());
            }
            let rows = sel.fetch_all(&self.pool).await.map_err(|e| backend("complete_many", e))?;
            let mut applied = std::collections::HashSet::new();
            for row in &rows {
                let get = |e| backend("complete_many", e);
                let (h, tok, state): (Vec<u8>, i64, i64) = (
                    row.try_get(0).map_err(get)?,
                    row.try_get(1).map_err(get)?,
                    row.try_get(2).map_err(get)?,
                );
                if state == i64::from(RecordState::Completed.code()) {
                    applied.insert((h, tok));
                }
            }
            for &i in chunk {
                let l = &items[i].lease;
                let mine = (l.key().hash().0.to_vec(), i64::try_from(l.token()).unwrap_or(-1));
                out[i] = Some(if applied.contains(&mine) {
                    Ok(())
                } else {
                    Err(StoreError::LeaseLost { key: l.key().to_string() })
                });
            }
        }
        Ok(out
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| Err(StoreError::backend("complete_many", false, "not decided")))
            })
            .collect())
    }

    async fn fail(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("fail", e))?;
        self.finish(&mut conn, &lease, kind.state(), Some(reason.as_bytes()), retain_for).await
    }

    async fn release(&self, lease: Lease) -> Result<(), StoreError> {
        let b = self
            .binds()
            .bytes("hash", Some(&lease.key().hash().0))
            .int("token", Some(i64_of(lease.token(), "token")?));
        let done = self
            .sql
            .release
            .query(&b)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("release", e))?;
        fenced(done.rows_affected(), &lease)
    }

    async fn extend(&self, lease: &mut Lease, by: Duration) -> Result<(), StoreError> {
        let b = self
            .binds()
            .int("by", Some(duration_micros(by)))
            .bytes("hash", Some(&lease.key().hash().0))
            .int("token", Some(i64_of(lease.token(), "token")?));
        let done = self
            .sql
            .extend
            .query(&b)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("extend", e))?;
        fenced(done.rows_affected(), lease)?;
        let until: Option<i64> = self
            .sql
            .lease_until
            .query(&b)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| backend("extend", e))?
            .map(|r| r.try_get::<Option<i64>, _>(0))
            .transpose()
            .map_err(|e| backend("extend", e))?
            .flatten();
        let Some(until) = until else {
            return Err(StoreError::LeaseLost { key: lease.key().to_string() });
        };
        lease.set_until(Timestamp::from_micros(until));
        Ok(())
    }

    async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        let b = self.binds().int("limit", Some(i64::try_from(limit).unwrap_or(i64::MAX)));
        let done =
            self.sql.purge.query(&b).execute(&self.pool).await.map_err(|e| backend("purge", e))?;
        Ok(done.rows_affected())
    }

    async fn check(&self) -> Result<Vec<String>, StoreError> {
        MySqlStore::check(self).await
    }
}

impl InspectStore for MySqlStore {
    async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("get", e))?;
        Ok(self.fetch(&mut conn, key, false).await?.map(|(r, _)| r))
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        let mut b = self
            .binds()
            .int("list_state", filter.state.map(|s| i64::from(s.code())))
            .int("limit", Some(i64::try_from(filter.limit).unwrap_or(i64::MAX)));
        if let Some(scope) = &filter.scope {
            b = b.text("scope", scope);
        }
        let rows: Vec<MySqlRow> =
            self.sql.list.query(&b).fetch_all(&self.pool).await.map_err(|e| backend("list", e))?;
        rows.iter().map(decode_row).collect()
    }

    async fn count(&self, scope: Option<&str>) -> Result<Counts, StoreError> {
        let mut b = self.binds();
        if let Some(scope) = scope {
            b = b.text("scope", scope);
        }
        let rows = self
            .sql
            .count
            .query(&b)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("count", e))?;
        crate::row::counts_of(&rows)
    }

    async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let b = self.binds().bytes("hash", Some(&key.hash().0));
        let done = self
            .sql
            .force_release
            .query(&b)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("force_release", e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn force_fail(&self, key: &DedupKey, reason: &str) -> Result<bool, StoreError> {
        StoreError::check_len("reason", reason.len(), MAX_RESULT_BYTES)?;
        let b = self
            .binds()
            .bytes("hash", Some(&key.hash().0))
            .bytes("result", Some(reason.as_bytes()));
        let done = self
            .sql
            .force_fail
            .query(&b)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("force_fail", e))?;
        Ok(done.rows_affected() == 1)
    }
}
