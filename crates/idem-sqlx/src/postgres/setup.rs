//! Setting a PostgreSQL store up: connecting, creating its schema and table, and the startup
//! check a consumer's `build` runs.

use idem_core::StoreError;
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPoolOptions;

use super::{PostgresStore, backend};

impl PostgresStore {
    /// Connects a pool of 16 connections to `url`. Creates nothing: choose the schema and
    /// table ([`with_schema`](Self::with_schema), [`with_table_name`](Self::with_table_name)),
    /// then create them once with [`migrate`](Self::migrate) (or your own migrations, from
    /// [`schema_sql`](Self::schema_sql)). A consumer's `build` runs [`check`](Self::check),
    /// which fails naming `migrate()` when the table is missing.
    ///
    /// TLS (feature `rustls`) is set in the URL, as libpq does:
    /// `postgres://app@db.example:5432/app?sslmode=verify-full&sslrootcert=/etc/ca.pem`, with
    /// `sslcert=…&sslkey=…` for a client certificate. `verify-full` checks the chain and the host
    /// name; `require` only encrypts (libpq's meaning). Without the feature, `require` and
    /// stricter are refused, never downgraded.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when the server cannot be reached, the TLS handshake fails, or
    /// the URL asks for TLS this build lacks ([`TlsUnavailable`](crate::TlsUnavailable) as the
    /// source).
    ///
    /// # Cancel safety
    /// Cancel safe: dropped before it returns, the pool it was opening is dropped with it.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .connect_with(crate::tls::pg_options(url)?)
            .await
            .map_err(|e| backend("connect", e))?;
        Ok(Self::new(pool))
    }

    /// Creates the schema, tables and index if they do not exist. Idempotent, and safe when
    /// several processes start at once (it holds an advisory lock while it runs).
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: the DDL runs in one transaction, rolled back if it is dropped.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut tx = self.pool.begin().await.map_err(|e| backend("migrate", e))?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1))")
            .bind(format!("idem-migrate:{}.{}", self.schema, self.table))
            .execute(&mut *tx)
            .await
            .map_err(|e| backend("migrate", e))?;
        for stmt in self.sql.ddl.iter().chain([&self.sql.add_deaths]) {
            sqlx::query(AssertSqlSafe(stmt.as_str()))
                .execute(&mut *tx)
                .await
                .map_err(|e| backend("migrate", e))?;
        }
        tx.commit().await.map_err(|e| backend("migrate", e))
    }

    /// The DDL [`PostgresStore::migrate`] runs, for users who own their migrations, in two
    /// steps (as shipped in `migrations/postgres/`): the tables, then
    /// `ALTER TABLE … ADD COLUMN IF NOT EXISTS deaths …`.
    pub fn schema_sql(&self) -> String {
        self.sql.ddl.iter().chain([&self.sql.add_deaths]).map(|s| format!("{s};\n")).collect()
    }

    /// Startup checks, run by a consumer's `build` ([`DedupStore::check`](idem_core::DedupStore::check)). Fails when the
    /// table does not exist in the schema or lacks a column ([`StoreError::NotMigrated`],
    /// naming the table and `PostgresStore::migrate()`). Returns, and logs with
    /// `tracing::warn!`, each problem that lets the store work but weakens a guarantee:
    /// `synchronous_commit` off (a committed marker may vanish in a crash, and the message then
    /// runs twice), or a key column that is not `bytea` (hashes compared as text may collate).
    ///
    /// # Errors
    /// [`StoreError::NotMigrated`]; backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    pub async fn check(&self) -> Result<Vec<String>, StoreError> {
        let columns: Vec<(String, String)> = sqlx::query_as(
            "SELECT column_name::text, data_type::text FROM information_schema.columns \
             WHERE table_schema = $1 AND table_name = $2",
        )
        .bind(self.schema.as_str())
        .bind(self.table.as_str())
        .fetch_all(&self.pool)
        .await
        .map_err(|e| backend("check", e))?;
        let names: Vec<String> = columns.iter().map(|(n, _)| n.clone()).collect();
        let table = format!("\"{}\".\"{}\"", self.schema, self.table);
        if let Some(e) = crate::check::unmigrated(table, &names, &[], "PostgresStore::migrate()") {
            return Err(e);
        }
        let mut warnings = Vec::new();
        let sync: String = sqlx::query_scalar("SELECT current_setting('synchronous_commit')")
            .fetch_one(&self.pool)
            .await
            .map_err(|e| backend("check", e))?;
        if sync == "off" {
            warnings.push(
                "PostgreSQL synchronous_commit is off: a dedup marker acknowledged as committed \
                 may vanish in a server crash, and its message would then run twice; set \
                 synchronous_commit = on for the idem connections"
                    .to_owned(),
            );
        }
        let key_type = columns.iter().find(|(n, _)| n == "key_hash").map(|(_, t)| t.as_str());
        if let Some(other) = key_type.filter(|t| *t != "bytea") {
            warnings.push(format!(
                "{}.{}.key_hash is `{other}`, not `bytea`: keys are 32-byte hashes and must be \
                 compared as bytes; recreate the table from PostgresStore::schema_sql()",
                self.schema, self.table
            ));
        }
        for w in &warnings {
            tracing::warn!(target: "idem::postgres", "{w}");
        }
        Ok(warnings)
    }
}
