//! `--store`: one of the four stores, opened for an operator (no table is created).

use std::path::Path;

use anyhow::{Context as _, bail};
use idem::mysql::MySqlStore;
use idem::postgres::PostgresStore;
use idem::redact::Redacted;
use idem::redis::RedisStore;
use idem::sqlite::SqliteStore;
use idem::sqlx;
use idem::{Counts, DedupKey, DedupStore, InspectStore, ListFilter, Record, StoreError};

use crate::connect::{self, CONNECT_TIMEOUT};

const SCHEMES: &str = "postgres://, postgresql://, mysql://, mariadb:// or redis://";

/// Where the store is.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct StoreArgs {
    /// The store the consumers use: a SQLite file, or a postgres://, postgresql://, mysql://,
    /// mariadb:// or redis:// URL. Or set IDEM_STORE, which keeps a password out of the shell
    /// history and `ps`; its value is never shown, and passwords in messages show as ***.
    #[arg(long, value_name = "FILE|URL", env = "IDEM_STORE", hide_env_values = true)]
    store: String,
    /// PostgreSQL schema of the table.
    #[arg(long, default_value = "idem")]
    schema: String,
    /// Table name (SQLite, PostgreSQL, MySQL/MariaDB).
    #[arg(long, default_value = "idem_records")]
    table: String,
    /// Redis namespace: records live under `idem:{<prefix>}:`.
    #[arg(long, visible_alias = "namespace", default_value = "default")]
    prefix: String,
}

/// `--store` where a verb can do without one (`idem dlq show`: the record is extra).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct StoreOptions {
    /// The store the consumers use, to show the dead letter's record: a SQLite file, or a
    /// postgres://, postgresql://, mysql://, mariadb:// or redis:// URL (or IDEM_STORE).
    #[arg(long, value_name = "FILE|URL", env = "IDEM_STORE", hide_env_values = true)]
    store: Option<String>,
    /// PostgreSQL schema of the table.
    #[arg(long, default_value = "idem")]
    schema: String,
    /// Table name (SQLite, PostgreSQL, MySQL/MariaDB).
    #[arg(long, default_value = "idem_records")]
    table: String,
    /// Redis namespace: records live under `idem:{<prefix>}:`.
    #[arg(long, visible_alias = "namespace", default_value = "default")]
    prefix: String,
}

impl StoreOptions {
    /// The store, when one was given.
    pub(crate) fn args(&self) -> Option<StoreArgs> {
        let store = self.store.clone()?;
        Some(StoreArgs {
            store,
            schema: self.schema.clone(),
            table: self.table.clone(),
            prefix: self.prefix.clone(),
        })
    }
}

/// One of the four stores, behind the operations the operator verbs need.
pub(crate) enum OpsStore {
    Sqlite(SqliteStore),
    Postgres(PostgresStore),
    MySql(MySqlStore),
    Redis(RedisStore),
}

/// Runs `$e` with `$s` bound to whichever store it is.
macro_rules! each {
    ($self:ident, $s:ident => $e:expr) => {
        match $self {
            OpsStore::Sqlite($s) => $e,
            OpsStore::Postgres($s) => $e,
            OpsStore::MySql($s) => $e,
            OpsStore::Redis($s) => $e,
        }
    };
}

impl OpsStore {
    pub(crate) async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        each!(self, s => s.get(key).await)
    }

    pub(crate) async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        each!(self, s => s.list(filter).await)
    }

    pub(crate) async fn count(&self, scope: Option<&str>) -> Result<Counts, StoreError> {
        each!(self, s => s.count(scope).await)
    }

    pub(crate) async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        each!(self, s => s.force_release(key).await)
    }

    pub(crate) async fn force_fail(
        &self,
        key: &DedupKey,
        reason: &str,
    ) -> Result<bool, StoreError> {
        each!(self, s => s.force_fail(key, reason).await)
    }

    pub(crate) async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        each!(self, s => s.purge(limit).await)
    }
}

impl StoreArgs {
    /// Opens the store and checks that its table exists. Never creates anything: an operator
    /// pointing at the wrong database should hear so, not get an empty table.
    ///
    /// # Errors
    /// Naming the problem: an unknown scheme, a missing SQLite file, a server that cannot be
    /// reached (with its address), a missing table.
    pub(crate) async fn open(&self) -> anyhow::Result<OpsStore> {
        let url = self.store.as_str();
        match url.split_once("://").map(|(scheme, _)| scheme) {
            Some("postgres" | "postgresql") => self.postgres(url).await,
            Some("mysql" | "mariadb") => self.mysql(url).await,
            Some("redis" | "rediss") => self.redis(url).await,
            Some(other) => bail!(
                "--store {}: unknown scheme {other:?}; expected a SQLite file or a {SCHEMES} URL",
                Redacted(url)
            ),
            None => self.sqlite(Path::new(url)).await,
        }
    }

    async fn sqlite(&self, path: &Path) -> anyhow::Result<OpsStore> {
        anyhow::ensure!(
            path.is_file(),
            "no SQLite database file at {} (give the file the consumers use, or a {SCHEMES} URL)",
            path.display()
        );
        let opts = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(false)
            .busy_timeout(CONNECT_TIMEOUT);
        let pool =
            connect::sqlite_pool(opts, sqlx::sqlite::SqlitePoolOptions::new().max_connections(1))
                .await?;
        let store = SqliteStore::new(pool.clone()).with_table_name(&self.table)?;
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1",
        )
        .bind(&self.table)
        .fetch_one(&pool)
        .await
        .with_context(|| format!("reading SQLite database {}", path.display()))?;
        if n == 0 {
            bail!(missing_table(&self.table, &format!("SQLite database {}", path.display())));
        }
        Ok(OpsStore::Sqlite(store))
    }

    async fn postgres(&self, url: &str) -> anyhow::Result<OpsStore> {
        let at = format!("PostgreSQL at {}", Redacted(url));
        let pool =
            connect::pg_pool(url, sqlx::postgres::PgPoolOptions::new().max_connections(2)).await?;
        let store = PostgresStore::new(pool.clone())
            .with_schema(&self.schema)?
            .with_table_name(&self.table)?;
        let found: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM information_schema.tables \
             WHERE table_schema = $1 AND table_name = $2)",
        )
        .bind(&self.schema)
        .bind(&self.table)
        .fetch_one(&pool)
        .await
        .with_context(|| format!("reading the catalog of {at}"))?;
        if !found {
            bail!(missing_table(&format!("{}.{}", self.schema, self.table), &at));
        }
        Ok(OpsStore::Postgres(store))
    }

    async fn mysql(&self, url: &str) -> anyhow::Result<OpsStore> {
        let at = format!("MySQL/MariaDB at {}", Redacted(url));
        let pool =
            connect::mysql_pool(url, sqlx::mysql::MySqlPoolOptions::new().max_connections(2))
                .await?;
        let store = MySqlStore::new(pool.clone()).with_table_name(&self.table)?;
        let n: i64 = sqlx::query_scalar(
            "SELECT CAST(count(*) AS SIGNED) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind(&self.table)
        .fetch_one(&pool)
        .await
        .with_context(|| format!("reading the catalog of {at}"))?;
        if n == 0 {
            bail!(missing_table(&self.table, &at));
        }
        Ok(OpsStore::MySql(store))
    }

    async fn redis(&self, url: &str) -> anyhow::Result<OpsStore> {
        let store = connect::redis_store(url, |builder| {
            // Operators may look at a server whose eviction policy consumers would refuse.
            Ok(builder.namespace(&self.prefix)?.allow_eviction(true))
        })
        .await?;
        Ok(OpsStore::Redis(store))
    }
}

fn missing_table(table: &str, at: &str) -> String {
    format!(
        "no table {table} in {at}: it is created by the store's migrate() (a consumer refuses \
         to start without it); check --table (and --schema for PostgreSQL)"
    )
}
