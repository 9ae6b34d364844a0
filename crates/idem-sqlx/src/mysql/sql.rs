//! The MySQL/MariaDB statements. MySQL has only positional `?` placeholders and no `RETURNING`
//! on upserts, so statements are written with named parameters (`:hash`) and compiled once into
//! `?` text plus the order in which to bind the names.

use std::collections::HashMap;
use std::sync::Arc;

use sqlx::mysql::{MySql, MySqlArguments};
use sqlx::query::Query;

use crate::row::COLUMNS;

/// "Now" by the server clock in microseconds, plus the test skew. `NOW(6)` is fixed for the
/// duration of a statement, so every use inside one statement agrees.
const NOW: &str = "(CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED) + :skew)";

/// A statement compiled from named parameters.
#[derive(Debug)]
pub(super) struct Stmt {
    pub text: Arc<str>,
    order: Vec<&'static str>,
}

/// One bound value.
#[derive(Debug, Clone)]
pub(super) enum V {
    Bytes(Option<Vec<u8>>),
    Text(String),
    Int(Option<i64>),
}

/// Named values for one execution.
#[derive(Debug, Default)]
pub(super) struct Binds(HashMap<&'static str, V>);

impl Binds {
    pub(super) fn bytes(mut self, name: &'static str, v: Option<&[u8]>) -> Self {
        self.0.insert(name, V::Bytes(v.map(<[u8]>::to_vec)));
        self
    }
    pub(super) fn text(mut self, name: &'static str, v: &str) -> Self {
        self.0.insert(name, V::Text(v.to_owned()));
        self
    }
    pub(super) fn int(mut self, name: &'static str, v: Option<i64>) -> Self {
        self.0.insert(name, V::Int(v));
        self
    }
}

const NAMES: &[&str] = &[
    "hash",
    "scope",
    "id",
    "fp",
    "skew",
    "lease",
    "keep",
    "owner",
    "token",
    "state",
    "result",
    "by",
    "limit",
    "list_state",
];

impl Stmt {
    /// Replaces `{now}` and each `:name` (from [`NAMES`]) with `?`, recording the order.
    fn compile(sql: &str) -> Self {
        let sql = sql.replace("{now}", NOW);
        let (mut text, mut order) = (String::with_capacity(sql.len()), Vec::new());
        let mut rest = sql.as_str();
        while let Some(at) = rest.find(':') {
            text.push_str(&rest[..at]);
            let after = &rest[at + 1..];
            let name = NAMES
                .iter()
                .filter(|n| {
                    after.starts_with(**n)
                        && !after[n.len()..]
                            .starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
                })
                .max_by_key(|n| n.len());
            match name {
                Some(n) => {
                    text.push('?');
                    order.push(*n);
                    rest = &after[n.len()..];
                }
                None => {
                    text.push(':');
                    rest = after;
                }
            }
        }
        text.push_str(rest);
        Self { text: text.into(), order }
    }

    /// The query with every parameter bound in order. A name missing from `binds` binds NULL.
    pub(super) fn query<'q>(&'q self, binds: &Binds) -> Query<'q, MySql, MySqlArguments> {
        let mut q = sqlx::query(sqlx::AssertSqlSafe(Arc::clone(&self.text)));
        for name in &self.order {
            q = match binds.0.get(name) {
                Some(V::Bytes(b)) => q.bind(b.clone()),
                Some(V::Text(t)) => q.bind(t.clone()),
                Some(V::Int(i)) => q.bind(*i),
                None => q.bind(None::<i64>),
            };
        }
        q
    }
}

/// No scope given, or exactly `:scope`. The column's collation (MariaDB's default
/// `utf8mb4_general_ci`, MySQL 8's `utf8mb4_0900_ai_ci`) ignores case, and MariaDB's pads
/// trailing spaces, so `scope = :scope` alone would merge `Billing`, `billing` and `billing `.
/// The byte comparison decides; the plain one is kept before it because every byte-equal pair is
/// also collation-equal, so it loses no row and leaves an index on `scope` usable. A
/// `COLLATE utf8mb4_bin` would not do: it pads spaces too, and MySQL's no-pad
/// `utf8mb4_0900_bin` is unknown to MariaDB.
const SCOPE_IS: &str =
    "(:scope IS NULL OR (scope = :scope AND CAST(scope AS BINARY) = CAST(:scope AS BINARY)))";

/// Retention passed and no live lease, against `now`.
fn dead(now: &str) -> String {
    format!("(expires_at <= {now} AND NOT (state = 0 AND lease_until > {now}))")
}

/// Released, failed, or leased past its end (only when `may`: the claim's takeover flag, as
/// SQL), with no conflicting fingerprint (new one `fp`).
fn takeover(now: &str, fp: &str, may: &str) -> String {
    format!(
        "((state IN (2, 3) OR (state = 0 AND lease_until <= {now} AND {may})) \
         AND (fingerprint IS NULL OR {fp} IS NULL OR fingerprint = {fp}))"
    )
}

pub(super) struct Sql {
    pub ddl: Vec<String>,
    /// The second schema step: adds `deaths` (MySQL has no `ADD COLUMN IF NOT EXISTS`:
    /// `migrate` runs it when the column is missing).
    pub add_deaths: String,
    pub t: String,
    pub insert_marker: Stmt,
    pub insert_claim: Stmt,
    pub take_marker: Stmt,
    pub select: Stmt,
    pub select_locked: Stmt,
    pub finish: Stmt,
    pub release: Stmt,
    pub extend: Stmt,
    pub lease_until: Stmt,
    pub purge: Stmt,
    pub force_release: Stmt,
    pub force_fail: Stmt,
    pub count: Stmt,
    pub list: Stmt,
    pub set_result: Stmt,
}

impl Sql {
    pub(super) fn new(table: &str) -> Self {
        let t = format!("`{table}`");
        // MySQL runs an UPDATE's assignments left to right, each seeing the values already
        // assigned, so the columns the `dead` test reads (`expires_at`, `lease_until`,
        // `state`) are assigned after every other use of it.
        let s = |x: String| Stmt::compile(&x);
        let taken_state = |state: &str, lease: &str| {
            let d = dead(NOW);
            format!(
                "attempt = IF({d}, 1, attempt + 1), \
                 deaths = IF({d}, 0, IF(state = 0, deaths + 1, deaths)), \
                 prev_state = IF({d}, NULL, state), \
                 created_at = IF({d}, {NOW}, created_at), \
                 fingerprint = IF({d}, :fp, COALESCE(fingerprint, :fp)), \
                 token = GREATEST(token + 1, {NOW}), result = NULL, owner = :owner, \
                 expires_at = IF({d}, {NOW} + :keep, GREATEST(expires_at, {NOW} + :keep)), \
                 lease_until = {lease}, state = {state}, updated_at = {NOW}"
            )
        };
        Self {
            ddl: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                   key_hash BINARY(32) NOT NULL PRIMARY KEY, \
                   scope TEXT NOT NULL, \
                   key_id TEXT NOT NULL, \
                   state BIGINT NOT NULL, \
                   fingerprint BINARY(32) NULL, \
                   result MEDIUMBLOB NULL, \
                   attempt BIGINT NOT NULL, \
                   token BIGINT NOT NULL, \
                   prev_state BIGINT NULL, \
                   created_at BIGINT NOT NULL, \
                   updated_at BIGINT NOT NULL, \
                   lease_until BIGINT NULL, \
                   expires_at BIGINT NOT NULL, \
                   owner BIGINT NOT NULL DEFAULT 0, \
                   KEY `{table}_expires_at` (expires_at)\
                 ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
                ),
                // The offset inbox's positions: the next offset per (scope, log, partition), as
                // bytes (a key of two utf8mb4 VARCHARs this long passes InnoDB's 3,072-byte limit).
                format!(
                    "CREATE TABLE IF NOT EXISTS `{table}_positions` (\
                   scope VARBINARY(512) NOT NULL, log VARBINARY(512) NOT NULL, part INT NOT NULL, \
                   next_offset BIGINT NULL, PRIMARY KEY (scope, log, part)\
                 ) ENGINE=InnoDB"
                ),
            ],
            add_deaths: format!(
                "ALTER TABLE {t} ADD COLUMN deaths BIGINT NOT NULL DEFAULT 0 AFTER expires_at"
            ),
            insert_marker: s(format!(
                "INSERT INTO {t} ({COLUMNS}, owner) VALUES (:hash, :scope, :id, 1, :fp, NULL, 1, \
                 {NOW}, NULL, {NOW}, {NOW}, NULL, {NOW} + :keep, 0, :owner)"
            )),
            // MariaDB ≥ 10.5: a fresh key is one round trip (MySQL lacks RETURNING here; the
            // store then falls back to the upsert path).
            insert_claim: s(format!(
                "INSERT INTO {t} ({COLUMNS}, owner) VALUES (:hash, :scope, :id, 0, :fp, NULL, 1, \
                 {NOW}, NULL, {NOW}, {NOW}, {NOW} + :lease, {NOW} + :keep, 0, :owner) \
                 RETURNING token, lease_until"
            )),
            take_marker: s(format!(
                "UPDATE {t} SET {} WHERE key_hash = :hash AND ({} OR {})",
                taken_state("1", "NULL"),
                dead(NOW),
                takeover(NOW, ":fp", "TRUE")
            )),
            select: s(format!("SELECT {COLUMNS}, owner, {NOW} FROM {t} WHERE key_hash = :hash")),
            select_locked: s(format!(
                "SELECT {COLUMNS}, owner, {NOW} FROM {t} WHERE key_hash = :hash LOCK IN SHARE MODE"
            )),
            finish: s(format!(
                "UPDATE {t} SET state = :state, result = :result, updated_at = {NOW}, \
                 lease_until = NULL, expires_at = {NOW} + :keep \
                 WHERE key_hash = :hash AND token = :token AND state = 0"
            )),
            release: s(format!(
                "UPDATE {t} SET state = 2, updated_at = {NOW}, lease_until = NULL \
                 WHERE key_hash = :hash AND token = :token AND state = 0"
            )),
            extend: s(format!(
                "UPDATE {t} SET lease_until = {NOW} + :by, \
                 expires_at = GREATEST(expires_at, {NOW} + :by), updated_at = {NOW} \
                 WHERE key_hash = :hash AND token = :token AND state = 0"
            )),
            lease_until: s(format!(
                "SELECT lease_until FROM {t} WHERE key_hash = :hash AND token = :token AND state = 0"
            )),
            purge: s(format!(
                "DELETE FROM {t} WHERE expires_at <= {NOW} AND NOT (state = 0 AND lease_until > {NOW}) \
                 ORDER BY expires_at LIMIT :limit"
            )),
            force_release: s(format!(
                "UPDATE {t} SET state = 2, token = GREATEST(token + 1, {NOW}), lease_until = NULL, \
                 updated_at = {NOW} WHERE key_hash = :hash"
            )),
            force_fail: s(format!(
                "UPDATE {t} SET state = 3, result = :result, token = GREATEST(token + 1, {NOW}), \
                 lease_until = NULL, updated_at = {NOW} WHERE key_hash = :hash AND state <> 1"
            )),
            count: s(format!(
                "SELECT state, CAST(count(*) AS SIGNED), \
                   CAST(COALESCE(sum(CASE WHEN {} THEN 1 ELSE 0 END), 0) AS SIGNED) \
                 FROM {t} WHERE {SCOPE_IS} GROUP BY state",
                dead(NOW)
            )),
            list: s(format!(
                "SELECT {COLUMNS} FROM {t} WHERE {SCOPE_IS} \
                 AND (:list_state IS NULL OR state = :list_state) ORDER BY updated_at DESC LIMIT :limit"
            )),
            set_result: s(format!(
                "UPDATE {t} SET result = :result WHERE key_hash = :hash AND state = 1"
            )),
            t,
        }
    }

    /// The claim (or, in state 1, inbox mark) upsert for `n` rows, bound positionally by the
    /// caller in row order: hash, scope, id, fp, skew…, lease (NULL for a mark), skew, keep,
    /// owner per row. Keys must be distinct and are best sorted, so concurrent batches lock
    /// rows in one order.
    /// `take_over`: whether a lease that ran out is taken over (every row of the statement).
    pub(super) fn claim_many(
        &self,
        n: usize,
        state: idem_core::RecordState,
        take_over: bool,
    ) -> String {
        let now = "(CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED) + ?)";
        let state = state.code();
        let row = format!(
            "(?, ?, ?, {state}, ?, NULL, 1, {now}, NULL, {now}, {now}, {now} + ?, {now} + ?, 0, ?)"
        );
        let rows = vec![row; n].join(", ");
        let vnow = "VALUES(updated_at)";
        let d = dead(vnow);
        let may = if take_over { "TRUE" } else { "FALSE" };
        let claimable = format!("({d} OR {})", takeover(vnow, "VALUES(fingerprint)", may));
        // Left-to-right assignments again: `owner` is decided first, on the old row, and
        // every later assignment follows it.
        let mine = "owner = VALUES(owner)";
        format!(
            "INSERT INTO {t} ({COLUMNS}, owner) VALUES {rows} ON DUPLICATE KEY UPDATE \
               owner = IF({claimable}, VALUES(owner), owner), \
               attempt = IF({mine}, IF({d}, 1, attempt + 1), attempt), \
               deaths = IF({mine}, IF({d}, 0, IF(state = 0, deaths + 1, deaths)), deaths), \
               prev_state = IF({mine}, IF({d}, NULL, state), prev_state), \
               created_at = IF({mine} AND {d}, VALUES(created_at), created_at), \
               fingerprint = IF({mine}, IF({d}, VALUES(fingerprint), COALESCE(fingerprint, VALUES(fingerprint))), fingerprint), \
               token = IF({mine}, GREATEST(token + 1, VALUES(token)), token), \
               result = IF({mine}, NULL, result), \
               expires_at = IF({mine}, IF({d}, VALUES(expires_at), GREATEST(expires_at, VALUES(expires_at))), expires_at), \
               lease_until = IF({mine}, VALUES(lease_until), lease_until), \
               updated_at = IF({mine}, VALUES(updated_at), updated_at), \
               state = IF({mine}, VALUES(state), state)",
            t = self.t
        )
    }

    /// Completes `n` leases in one statement: the batch joins the table on (hash, token).
    pub(super) fn complete_many(&self, n: usize) -> String {
        let now = "(CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED) + ?)";
        let first = "SELECT ? AS h, ? AS tok, ? AS res, ? AS keep";
        let rest = " UNION ALL SELECT ?, ?, ?, ?".repeat(n.saturating_sub(1));
        format!(
            "UPDATE {t} AS r JOIN ({first}{rest}) AS u ON r.key_hash = u.h AND r.token = u.tok \
             SET r.state = 1, r.result = u.res, r.updated_at = {now}, r.lease_until = NULL, \
                 r.expires_at = {now} + u.keep \
             WHERE r.state = 0",
            t = self.t
        )
    }

    /// Reads (hash, token, state, updated_at) of `n` keys, to tell which completions of a
    /// batch applied.
    pub(super) fn tokens_of(&self, n: usize) -> String {
        let marks = vec!["?"; n].join(", ");
        format!(
            "SELECT key_hash, token, state, updated_at FROM {} WHERE key_hash IN ({marks})",
            self.t
        )
    }

    /// Reads `n` keys back after an upsert; `locked` (inside a transaction): a locking read,
    /// which sees the latest committed rows rather than the transaction's snapshot.
    pub(super) fn select_many(&self, n: usize) -> String {
        let marks = vec!["?"; n].join(", ");
        format!(
            "SELECT {COLUMNS}, owner, CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED) + ? \
             FROM {} WHERE key_hash IN ({marks}) LOCK IN SHARE MODE",
            self.t
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiles_named_parameters() {
        let s = Stmt::compile("SELECT :hash, :hash, {now}, ':x', :keep FROM t WHERE a = :by");
        assert_eq!(s.order, ["hash", "hash", "skew", "keep", "by"]);
        assert!(!s.text.contains(":hash") && s.text.contains("':x'"), "{}", s.text);
        assert_eq!(s.text.matches('?').count(), 5);
    }
}
