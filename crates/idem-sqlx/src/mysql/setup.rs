//! Setting a MySQL / MariaDB store up: connecting, creating its table, and the startup check a
//! consumer's `build` runs.

use idem_core::StoreError;
use sqlx::AssertSqlSafe;
use sqlx::mysql::MySqlPoolOptions;

use super::{MySqlStore, backend};

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
    ///
    /// # Cancel safety
    /// Cancel safe: dropped before it returns, the pool it was opening is dropped with it.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = MySqlPoolOptions::new()
            .max_connections(16)
            .connect_with(crate::tls::mysql_options(url)?)
            .await
            .map_err(|e| backend("connect", e))?;
        Ok(Self::new(pool))
    }

    /// Creates the table if it does not exist (idempotent).
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: MySQL commits each DDL statement on its own, so a dropped call
    /// may leave part of it done; every statement is `IF NOT EXISTS`, so running it again
    /// finishes the job.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        for stmt in &self.sql.ddl {
            sqlx::query(AssertSqlSafe(stmt.as_str()))
                .execute(&self.pool)
                .await
                .map_err(|e| backend("migrate", e))?;
        }
        let has_deaths: i64 = sqlx::query_scalar(
            "SELECT COUNT(*) FROM information_schema.columns \
             WHERE table_schema = DATABASE() AND table_name = ? AND column_name = 'deaths'",
        )
        .bind(self.table.as_str())
        .fetch_one(&self.pool)
        .await
        .map_err(|e| backend("migrate", e))?;
        if has_deaths == 0 {
            match sqlx::query(AssertSqlSafe(self.sql.add_deaths.as_str())).execute(&self.pool).await
            {
                // 1060, duplicate column: another process migrating at the same time added it.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42S21") => {}
                done => {
                    done.map_err(|e| backend("migrate", e))?;
                }
            }
        }
        Ok(())
    }

    /// The DDL [`MySqlStore::migrate`] runs on a new database, for users who own their
    /// migrations, in two steps (as shipped in `migrations/mysql/`): the tables, then
    /// `ALTER TABLE … ADD COLUMN deaths …`, which a database that has the first step applies
    /// once.
    pub fn schema_sql(&self) -> String {
        self.sql.ddl.iter().chain([&self.sql.add_deaths]).map(|s| format!("{s};\n")).collect()
    }

    /// Startup checks, run by a consumer's `build` ([`DedupStore::check`](idem_core::DedupStore::check)). Fails when the
    /// table does not exist in the connection's database or lacks a column
    /// ([`StoreError::NotMigrated`], naming the table and `MySqlStore::migrate()`). Returns, and
    /// logs, a warning when `innodb_flush_log_at_trx_commit` is not 1 (a committed marker may
    /// vanish in a crash) or when the key column is not `binary(32)` (a text column would let
    /// collations merge keys).
    ///
    /// # Errors
    /// [`StoreError::NotMigrated`]; backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
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
}
