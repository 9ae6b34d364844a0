//! The SQLite statements, built once per table name (a validated identifier).

use std::sync::Arc;

use idem_core::Identifier;

use crate::row::COLUMNS;

// ?5 is "now" by the store's clock in every statement that has it.
/// Retention passed and no live lease: the record is gone in all but storage.
const DEAD: &str = "(expires_at <= ?5 AND NOT (state = 0 AND lease_until > ?5))";
/// Released, failed, or in progress with a lease that ran out (only when `may` — the claim's
/// takeover flag — is true), and no conflicting fingerprint.
fn takeover(may: &str) -> String {
    format!(
        "((state IN (2, 3) OR (state = 0 AND lease_until <= ?5 AND {may})) \
         AND (fingerprint IS NULL OR ?4 IS NULL OR fingerprint = ?4))"
    )
}

pub(super) struct Sql {
    pub t: String,
    pub ddl: Vec<String>,
    /// The second schema step: adds `deaths` (SQLite has no `ADD COLUMN IF NOT EXISTS`:
    /// `migrate` runs it when the column is missing).
    pub add_deaths: String,
    pub claim: Arc<str>,
    pub mark: Arc<str>,
    pub select: Arc<str>,
    pub finish: Arc<str>,
    pub release: Arc<str>,
    pub extend: Arc<str>,
    pub purge: Arc<str>,
    pub force_release: Arc<str>,
    pub force_fail: Arc<str>,
    pub count: Arc<str>,
    pub list: Arc<str>,
    pub set_result: Arc<str>,
    pub advance: Arc<str>,
    pub version_of: Arc<str>,
}

impl Sql {
    pub(super) fn new(table: &Identifier) -> Self {
        let t = table.as_str();
        // Upsert for a claim: a new row, or a takeover of a dead or re-claimable one. When the
        // WHERE is false nothing changes and nothing is returned: the caller lost.
        // In SQLite's upsert, unqualified columns are the existing row's values before the update.
        let upsert = |state: u8, lease: &str, may: &str| {
            let takeover = takeover(may);
            format!(
                "INSERT INTO {t} ({COLUMNS}) VALUES (?1, ?2, ?3, {state}, ?4, NULL, 1, ?8, NULL, ?5, ?5, {lease}, ?7, 0) \
                 ON CONFLICT (key_hash) DO UPDATE SET \
                   attempt = CASE WHEN {DEAD} THEN 1 ELSE attempt + 1 END, \
                   deaths = CASE WHEN {DEAD} THEN 0 WHEN state = 0 THEN deaths + 1 ELSE deaths END, \
                   prev_state = CASE WHEN {DEAD} THEN NULL ELSE state END, \
                   created_at = CASE WHEN {DEAD} THEN excluded.created_at ELSE created_at END, \
                   expires_at = CASE WHEN {DEAD} THEN excluded.expires_at ELSE max(expires_at, excluded.expires_at) END, \
                   fingerprint = CASE WHEN {DEAD} THEN excluded.fingerprint ELSE coalesce(fingerprint, excluded.fingerprint) END, \
                   token = max(token + 1, excluded.token), \
                   state = excluded.state, result = NULL, updated_at = excluded.updated_at, \
                   lease_until = excluded.lease_until \
                 WHERE {DEAD} OR {takeover} \
                 RETURNING attempt, token, prev_state, fingerprint, deaths, key_hash"
            )
        };
        let s = |x: String| -> Arc<str> { x.into() };
        Self {
            t: t.to_owned(),
            ddl: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                       key_hash BLOB NOT NULL PRIMARY KEY CHECK (length(key_hash) = 32), \
                       scope TEXT NOT NULL, \
                       key_id TEXT NOT NULL, \
                       state INTEGER NOT NULL, \
                       fingerprint BLOB, \
                       result BLOB, \
                       attempt INTEGER NOT NULL, \
                       token INTEGER NOT NULL, \
                       prev_state INTEGER, \
                       created_at INTEGER NOT NULL, \
                       updated_at INTEGER NOT NULL, \
                       lease_until INTEGER, \
                       expires_at INTEGER NOT NULL\
                     ) WITHOUT ROWID"
                ),
                format!("CREATE INDEX IF NOT EXISTS {t}_expires_at ON {t} (expires_at)"),
                format!(
                    "CREATE TABLE IF NOT EXISTS {t}_versions (\
                       entity_hash BLOB NOT NULL PRIMARY KEY CHECK (length(entity_hash) = 32), \
                       scope TEXT NOT NULL, entity_id TEXT NOT NULL, \
                       version INTEGER NOT NULL, updated_at INTEGER NOT NULL\
                     ) WITHOUT ROWID"
                ),
                // The offset inbox's positions: the next offset per (scope, log, partition).
                format!(
                    "CREATE TABLE IF NOT EXISTS {t}_positions (\
                       scope TEXT NOT NULL, log TEXT NOT NULL, part INTEGER NOT NULL, \
                       next_offset INTEGER, PRIMARY KEY (scope, log, part)\
                     ) WITHOUT ROWID"
                ),
            ],
            add_deaths: format!("ALTER TABLE {t} ADD COLUMN deaths INTEGER NOT NULL DEFAULT 0"),
            claim: s(upsert(0, "?6", "?9")),
            // An inbox marker is a claim that is completed at once: no lease.
            mark: s(upsert(1, "NULL", "1")),
            select: s(format!("SELECT {COLUMNS} FROM {t} WHERE key_hash = ?1")),
            finish: s(format!(
                "UPDATE {t} SET state = ?3, result = ?4, updated_at = ?5, lease_until = NULL, expires_at = ?6 \
                 WHERE key_hash = ?1 AND token = ?2 AND state = 0"
            )),
            release: s(format!(
                "UPDATE {t} SET state = 2, updated_at = ?3, lease_until = NULL \
                 WHERE key_hash = ?1 AND token = ?2 AND state = 0"
            )),
            extend: s(format!(
                "UPDATE {t} SET lease_until = ?3, expires_at = max(expires_at, ?3), updated_at = ?4 \
                 WHERE key_hash = ?1 AND token = ?2 AND state = 0"
            )),
            purge: s(format!(
                "DELETE FROM {t} WHERE key_hash IN (SELECT key_hash FROM {t} \
                 WHERE expires_at <= ?1 AND NOT (state = 0 AND lease_until > ?1) LIMIT ?2)"
            )),
            force_release: s(format!(
                "UPDATE {t} SET state = 2, token = max(token + 1, ?2), lease_until = NULL, updated_at = ?2 \
                 WHERE key_hash = ?1"
            )),
            force_fail: s(format!(
                "UPDATE {t} SET state = 3, result = ?3, token = max(token + 1, ?2), lease_until = NULL, \
                 updated_at = ?2 WHERE key_hash = ?1 AND state <> 1"
            )),
            count: s(format!(
                "SELECT state, count(*), \
                   sum(CASE WHEN expires_at <= ?2 AND NOT (state = 0 AND lease_until > ?2) THEN 1 ELSE 0 END) \
                 FROM {t} WHERE (?1 IS NULL OR scope = ?1) GROUP BY state"
            )),
            list: s(format!(
                "SELECT {COLUMNS} FROM {t} WHERE (?1 IS NULL OR scope = ?1) AND (?2 IS NULL OR state = ?2) \
                 ORDER BY updated_at DESC LIMIT ?3"
            )),
            set_result: s(format!("UPDATE {t} SET result = ?2 WHERE key_hash = ?1 AND state = 1")),
            advance: s(format!(
                "INSERT INTO {t}_versions (entity_hash, scope, entity_id, version, updated_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5) \
                 ON CONFLICT (entity_hash) DO UPDATE SET version = excluded.version, updated_at = excluded.updated_at \
                 WHERE excluded.version > version"
            )),
            version_of: s(format!("SELECT version FROM {t}_versions WHERE entity_hash = ?1")),
        }
    }

    /// The inbox's batch mark: one multi-row upsert of `n` rows, in the order bound, answering
    /// the winners' hashes. Anonymous parameters, per row: hash, scope, id, fp, token, now, now,
    /// expiry (numbered ones cost SQLite a scan of every name for each bind: quadratic in the
    /// batch). The takeover tests read `excluded`, since each row has its own fingerprint.
    pub(super) fn mark_many(&self, n: usize) -> String {
        let t = &self.t;
        let rows = vec!["(?, ?, ?, 1, ?, NULL, 1, ?, NULL, ?, ?, NULL, ?, 0)"; n];
        let now = "excluded.updated_at";
        let dead = format!("(expires_at <= {now} AND NOT (state = 0 AND lease_until > {now}))");
        let takeover = format!(
            "((state IN (2, 3) OR (state = 0 AND lease_until <= {now})) \
             AND (fingerprint IS NULL OR excluded.fingerprint IS NULL OR fingerprint = excluded.fingerprint))"
        );
        format!(
            "INSERT INTO {t} ({COLUMNS}) VALUES {} \
             ON CONFLICT (key_hash) DO UPDATE SET \
               attempt = CASE WHEN {dead} THEN 1 ELSE attempt + 1 END, \
               deaths = CASE WHEN {dead} THEN 0 WHEN state = 0 THEN deaths + 1 ELSE deaths END, \
               prev_state = CASE WHEN {dead} THEN NULL ELSE state END, \
               created_at = CASE WHEN {dead} THEN excluded.created_at ELSE created_at END, \
               expires_at = CASE WHEN {dead} THEN excluded.expires_at ELSE max(expires_at, excluded.expires_at) END, \
               fingerprint = CASE WHEN {dead} THEN excluded.fingerprint ELSE coalesce(fingerprint, excluded.fingerprint) END, \
               token = max(token + 1, excluded.token), \
               state = excluded.state, result = NULL, updated_at = excluded.updated_at, \
               lease_until = excluded.lease_until \
             WHERE {dead} OR {takeover} \
             RETURNING key_hash",
            rows.join(", ")
        )
    }

    /// Claims `n` distinct keys in one call of `n` claim upserts, run in order (one hop to the
    /// connection's thread); each winner returns its row, with its key hash last. The statements
    /// take anonymous parameters (sqlx binds a numbered parameter of a later statement only
    /// after as many anonymous ones as the parameters numbered below it): bind, per statement,
    /// the single claim's parameters in the order [`claim_params`](Self::claim_params) lists.
    pub(super) fn claim_many(&self, n: usize) -> String {
        vec![anonymous(&self.claim).0; n].join(";")
    }

    /// The single claim's parameter numbers (`?1` … `?9`) in the order the anonymous statement
    /// of [`claim_many`](Self::claim_many) takes them.
    pub(super) fn claim_params(&self) -> Vec<u8> {
        anonymous(&self.claim).1
    }

    /// Completes `n` leases in one call of `n` statements (one hop to the connection's thread),
    /// each returning the (hash, token) it completed (a stale token or a finished record matches
    /// nothing). Anonymous parameters, per statement: now, expiry, result, hash, token.
    pub(super) fn complete_many(&self, n: usize) -> String {
        let one = format!(
            "UPDATE {t} SET state = 1, updated_at = ?, lease_until = NULL, expires_at = ?, \
             result = ? WHERE key_hash = ? AND token = ? AND state = 0 RETURNING key_hash, token;",
            t = self.t
        );
        one.repeat(n)
    }

    /// The records of `n` keys (bound in order).
    pub(super) fn select_many(&self, n: usize) -> String {
        let marks = vec!["?"; n].join(", ");
        format!("SELECT {COLUMNS} FROM {} WHERE key_hash IN ({marks})", self.t)
    }
}

/// `sql` with every numbered parameter `?N` made anonymous (`?`), and the numbers in the order
/// they appeared.
fn anonymous(sql: &str) -> (String, Vec<u8>) {
    let mut out = String::with_capacity(sql.len());
    let mut order = Vec::new();
    let mut chars = sql.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        out.push(c);
        if c != '?' {
            continue;
        }
        let start = i + 1;
        let mut end = start;
        while let Some(&(j, d)) = chars.peek() {
            if !d.is_ascii_digit() {
                break;
            }
            end = j + 1;
            chars.next();
        }
        if let Ok(n) = sql[start..end].parse() {
            order.push(n);
        }
    }
    (out, order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbered_parameters_become_anonymous_in_order() {
        let (sql, order) = anonymous("a = ?1 AND b = ?9 AND c = ?1 AND d = ?2");
        assert_eq!(sql, "a = ? AND b = ? AND c = ? AND d = ?");
        assert_eq!(order, [1, 9, 1, 2]);
    }

    #[test]
    fn the_batch_claim_takes_every_claim_parameter() {
        let s = Sql::new(&Identifier::new("table", "idem_records").expect("valid"));
        let order = s.claim_params();
        assert!((1..=9).all(|n| order.contains(&n)), "{order:?}");
        let sql = s.claim_many(3);
        assert_eq!(sql.matches('?').count(), 3 * order.len());
        assert!(!sql.contains("?1"), "no numbered parameter is left");
    }
}
