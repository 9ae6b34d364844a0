//! The PostgreSQL statements, built once per (schema, table): both are validated identifiers,
//! quoted so their case is kept.

use std::sync::Arc;

use crate::row::COLUMNS;

/// "Now" by the database clock in microseconds, plus the test skew bound at `$p`.
/// `statement_timestamp()` is constant within a statement and current inside a long transaction.
fn now(p: u8) -> String {
    format!("((extract(epoch FROM statement_timestamp()) * 1000000)::bigint + ${p}::bigint)")
}

/// Retention passed and no live lease. `EXCLUDED.updated_at` is "now" in the upserts.
const DEAD: &str = "(r.expires_at <= EXCLUDED.updated_at \
     AND NOT (r.state = 0 AND r.lease_until > EXCLUDED.updated_at))";
/// Released, failed, or in progress with a lease that ran out (only when `may` — the claim's
/// takeover flag — is true); no conflicting fingerprint.
fn takeover(may: &str) -> String {
    format!(
        "((r.state IN (2, 3) OR (r.state = 0 AND r.lease_until <= EXCLUDED.updated_at AND {may})) \
         AND (r.fingerprint IS NULL OR EXCLUDED.fingerprint IS NULL OR r.fingerprint = EXCLUDED.fingerprint))"
    )
}

pub(super) struct Sql {
    pub ddl: Vec<String>,
    /// The second schema step: adds `deaths`.
    pub add_deaths: String,
    pub claim: Arc<str>,
    pub mark: Arc<str>,
    pub claim_many: Arc<str>,
    pub mark_many: Arc<str>,
    pub claim_many_losers: Arc<str>,
    pub set_results: Arc<str>,
    pub complete_many: Arc<str>,
    pub select: Arc<str>,
    pub finish: Arc<str>,
    pub release: Arc<str>,
    pub extend: Arc<str>,
    pub purge: Arc<str>,
    pub force_release: Arc<str>,
    pub force_fail: Arc<str>,
    pub count: Arc<str>,
    pub list: Arc<str>,
    pub advance: Arc<str>,
    pub version_of: Arc<str>,
}

impl Sql {
    pub(super) fn new(schema: &str, table: &str) -> Self {
        let t = format!("\"{schema}\".\"{table}\"");
        let v = format!("\"{schema}\".\"{table}_versions\"");
        // `may`: whether an expired lease may be taken over (a claim binds it as $8).
        let on_conflict = |may: &str| {
            format!(
                "ON CONFLICT (key_hash) DO UPDATE SET \
               attempt = CASE WHEN {DEAD} THEN 1 ELSE r.attempt + 1 END, \
               deaths = CASE WHEN {DEAD} THEN 0 WHEN r.state = 0 THEN r.deaths + 1 ELSE r.deaths END, \
               prev_state = CASE WHEN {DEAD} THEN NULL ELSE r.state END, \
               created_at = CASE WHEN {DEAD} THEN EXCLUDED.created_at ELSE r.created_at END, \
               expires_at = CASE WHEN {DEAD} THEN EXCLUDED.expires_at ELSE GREATEST(r.expires_at, EXCLUDED.expires_at) END, \
               fingerprint = CASE WHEN {DEAD} THEN EXCLUDED.fingerprint ELSE COALESCE(r.fingerprint, EXCLUDED.fingerprint) END, \
               token = GREATEST(r.token + 1, EXCLUDED.token), \
               state = EXCLUDED.state, result = NULL, updated_at = EXCLUDED.updated_at, \
               lease_until = EXCLUDED.lease_until \
             WHERE {DEAD} OR {takeover}",
                takeover = takeover(may)
            )
        };
        // $1 hash, $2 scope, $3 id, $4 fingerprint, $5 skew, $6 lease µs (NULL: no lease), $7 keep
        // µs; a claim's $8: whether it takes over an expired lease.
        let upsert = |state: u8, may: &str| {
            let on_conflict = on_conflict(may);
            format!(
                "INSERT INTO {t} AS r ({COLUMNS}) \
                 SELECT $1::bytea, $2::text, $3::text, {state}, $4::bytea, NULL, 1, n.now, NULL, n.now, n.now, \
                        n.now + $6::bigint, n.now + $7::bigint, 0 \
                 FROM (SELECT {now} AS now) n {on_conflict} \
                 RETURNING attempt, token, prev_state, fingerprint, lease_until, deaths",
                now = now(5)
            )
        };
        let s = |x: String| -> Arc<str> { x.into() };
        let prefixed =
            COLUMNS.split(", ").map(|c| format!("ins.{c}")).collect::<Vec<_>>().join(", ");

        Self {
            ddl: vec![
                format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\""),
                format!(
                    "CREATE TABLE IF NOT EXISTS {t} (\
                       key_hash BYTEA NOT NULL PRIMARY KEY CHECK (octet_length(key_hash) = 32), \
                       scope TEXT NOT NULL, \
                       key_id TEXT NOT NULL, \
                       state BIGINT NOT NULL, \
                       fingerprint BYTEA, \
                       result BYTEA, \
                       attempt BIGINT NOT NULL, \
                       token BIGINT NOT NULL, \
                       prev_state BIGINT, \
                       created_at BIGINT NOT NULL, \
                       updated_at BIGINT NOT NULL, \
                       lease_until BIGINT, \
                       expires_at BIGINT NOT NULL)"
                ),
                format!("CREATE INDEX IF NOT EXISTS \"{table}_expires_at\" ON {t} (expires_at)"),
                format!(
                    "CREATE TABLE IF NOT EXISTS {v} (\
                       entity_hash BYTEA NOT NULL PRIMARY KEY CHECK (octet_length(entity_hash) = 32), \
                       scope TEXT NOT NULL, entity_id TEXT NOT NULL, \
                       version BIGINT NOT NULL, updated_at BIGINT NOT NULL)"
                ),
                // The offset inbox's positions: the next offset per (scope, log, partition).
                format!(
                    "CREATE TABLE IF NOT EXISTS \"{schema}\".\"{table}_positions\" (\
                       scope TEXT NOT NULL, log TEXT NOT NULL, part INTEGER NOT NULL, \
                       next_offset BIGINT, PRIMARY KEY (scope, log, part))"
                ),
            ],
            add_deaths: format!(
                "ALTER TABLE {t} ADD COLUMN IF NOT EXISTS deaths BIGINT NOT NULL DEFAULT 0"
            ),
            claim: s(upsert(0, "$8::boolean")),
            // An inbox marker is a claim completed at once (bound with a NULL lease).
            mark: s(upsert(1, "true")),
            // Keys are unique within the arrays (the caller folds repeats). Only the winners
            // come back; the losers are read by `claim_many_losers` when there are any.
            claim_many: s(format!(
                "WITH n AS (SELECT {now} AS now), \
                 ins AS (\
                   INSERT INTO {t} AS r ({COLUMNS}) \
                   SELECT q.h, q.s, q.i, 0, q.fp, NULL, 1, n.now, NULL, n.now, n.now, n.now + q.lease, n.now + q.keep, 0 \
                   FROM unnest($1::bytea[], $2::text[], $3::text[], $4::bytea[], $6::bigint[], $7::bigint[]) \
                        AS q(h, s, i, fp, lease, keep), n \
                   {on_conflict} RETURNING {COLUMNS}) \
                 SELECT true, {prefixed}, (SELECT now FROM n) FROM ins",
                now = now(5),
                on_conflict = on_conflict("$8::boolean")
            )),
            // The inbox's batch mark: the same upsert, completed at once (NULL leases), answering
            // only the winners' hashes (a winner needs nothing else; losers are read apart).
            mark_many: s(format!(
                "INSERT INTO {t} AS r ({COLUMNS}) \
                 SELECT q.h, q.s, q.i, 1, q.fp, NULL, 1, n.now, NULL, n.now, n.now, NULL, n.now + q.keep, 0 \
                 FROM unnest($1::bytea[], $2::text[], $3::text[], $4::bytea[], $6::bigint[]) \
                      AS q(h, s, i, fp, keep), (SELECT {now} AS now) n \
                 {on_conflict} RETURNING r.key_hash",
                now = now(5),
                on_conflict = on_conflict("true")
            )),
            // Run unprepared, so it is planned with its array every time: as a cached generic
            // plan made while the table was tiny it scanned the whole table once grown.
            claim_many_losers: s(format!(
                "SELECT false, {COLUMNS}, {now} FROM {t} WHERE key_hash = ANY($1::bytea[])",
                now = now(2)
            )),
            complete_many: s(format!(
                "UPDATE {t} AS r SET state = 1, result = u.res, updated_at = n.now, lease_until = NULL, \
                   expires_at = n.now + u.keep \
                 FROM unnest($1::bytea[], $2::bigint[], $3::bytea[], $4::bigint[]) AS u(h, tok, res, keep), \
                      (SELECT {now} AS now) n \
                 WHERE r.key_hash = u.h AND r.token = u.tok AND r.state = 0 \
                 RETURNING r.key_hash, r.token",
                now = now(5)
            )),
            select: s(format!(
                "SELECT {COLUMNS}, {now} FROM {t} WHERE key_hash = $1",
                now = now(2)
            )),
            finish: s(format!(
                "UPDATE {t} SET state = $3, result = $4, updated_at = {now}, lease_until = NULL, \
                   expires_at = {now} + $6::bigint \
                 WHERE key_hash = $1 AND token = $2 AND state = 0",
                now = now(5)
            )),
            release: s(format!(
                "UPDATE {t} SET state = 2, updated_at = {now}, lease_until = NULL \
                 WHERE key_hash = $1 AND token = $2 AND state = 0",
                now = now(3)
            )),
            extend: s(format!(
                "UPDATE {t} SET lease_until = {now} + $4::bigint, \
                   expires_at = GREATEST(expires_at, {now} + $4::bigint), updated_at = {now} \
                 WHERE key_hash = $1 AND token = $2 AND state = 0 RETURNING lease_until",
                now = now(3)
            )),
            // SKIP LOCKED: rows a claim is taking over right now are left for the next purge.
            // Oldest first, which also walks the expires_at index from its start and stops at
            // the limit, even when the planner has no statistics (a young table).
            purge: s(format!(
                "DELETE FROM {t} WHERE key_hash IN (SELECT key_hash FROM {t} \
                 WHERE expires_at <= {now} AND NOT (state = 0 AND lease_until > {now}) \
                 ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)",
                now = now(1)
            )),
            force_release: s(format!(
                "UPDATE {t} SET state = 2, token = GREATEST(token + 1, {now}), lease_until = NULL, \
                   updated_at = {now} WHERE key_hash = $1",
                now = now(2)
            )),
            force_fail: s(format!(
                "UPDATE {t} SET state = 3, result = $3, token = GREATEST(token + 1, {now}), \
                   lease_until = NULL, updated_at = {now} WHERE key_hash = $1 AND state <> 1",
                now = now(2)
            )),
            count: s(format!(
                "SELECT state, count(*), \
                   sum(CASE WHEN expires_at <= {now} AND NOT (state = 0 AND lease_until > {now}) THEN 1 ELSE 0 END)::bigint \
                 FROM {t} WHERE ($1::text IS NULL OR scope = $1) GROUP BY state",
                now = now(2)
            )),
            list: s(format!(
                "SELECT {COLUMNS} FROM {t} WHERE ($1::text IS NULL OR scope = $1) \
                 AND ($2::bigint IS NULL OR state = $2) ORDER BY updated_at DESC LIMIT $3"
            )),
            // Run unprepared (an array join, like complete_many).
            set_results: s(format!(
                "UPDATE {t} AS r SET result = u.res \
                 FROM unnest($1::bytea[], $2::bytea[]) AS u(h, res) \
                 WHERE r.key_hash = u.h AND r.state = 1"
            )),
            advance: s(format!(
                "INSERT INTO {v} AS g (entity_hash, scope, entity_id, version, updated_at) \
                 VALUES ($1, $2, $3, $4, {now}) \
                 ON CONFLICT (entity_hash) DO UPDATE SET version = EXCLUDED.version, \
                   updated_at = EXCLUDED.updated_at WHERE EXCLUDED.version > g.version",
                now = now(5)
            )),
            version_of: s(format!("SELECT version FROM {v} WHERE entity_hash = $1")),
        }
    }
}
