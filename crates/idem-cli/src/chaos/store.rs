//! The store side of a run: the dedup tables and the ledger the workers write their effects to.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context as _, bail};
use idem::redact::Redacted;
use idem::redis::redis::{self, AsyncCommands as _};
use idem::sqlx::{self, AssertSqlSafe};
use idem::{MySqlStore, PostgresStore, SqliteStore};

use super::verdict::Effect;
use crate::connect;

const ACCEPTED: &str = "a SQLite file, postgres://, mysql:// or redis://";

/// Where idem keeps its records during a run, as given by `--store`.
#[derive(Debug, Clone)]
pub(crate) enum StoreUrl {
    Sqlite(PathBuf),
    Postgres(String),
    /// One `mysql://` URL, or several separated by commas: the nodes of one cluster (Galera).
    MySql(String),
    Redis(String),
}

fn is_mysql(s: &str) -> bool {
    s.starts_with("mysql://") || s.starts_with("mariadb://")
}

impl StoreUrl {
    pub(crate) fn parse(s: &str) -> anyhow::Result<Self> {
        Ok(if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            Self::Postgres(s.to_owned())
        } else if is_mysql(s) {
            // `connect::mysql_pool` takes both, and names MariaDB when asked for it.
            if let Some(other) = s.split(',').find(|u| !is_mysql(u)) {
                bail!(
                    "--store: {} in a list of URLs; a list is for the nodes of one MySQL/MariaDB \
                     cluster, each mysql:// or mariadb://",
                    Redacted(other)
                )
            }
            Self::MySql(s.to_owned())
        } else if s.starts_with("redis://") || s.starts_with("rediss://") {
            Self::Redis(s.to_owned())
        } else if let Some(path) = s.strip_prefix("sqlite://") {
            Self::Sqlite(path.into())
        } else if s.contains("://") {
            bail!("--store {}: unsupported scheme; expected {ACCEPTED}", Redacted(s))
        } else {
            Self::Sqlite(s.into())
        })
    }
}

/// The run's names in the store, all derived from its tag.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    /// PostgreSQL schema; MySQL and SQLite table; Redis namespace.
    pub(crate) base: String,
}

impl Names {
    pub(crate) fn new(tag: &str) -> Self {
        Self { base: format!("idem_chaos_{tag}") }
    }

    pub(crate) fn ledger_table(&self, store: &StoreUrl) -> String {
        match store {
            StoreUrl::Postgres(_) => format!("\"{}\".ledger", self.base),
            _ => format!("{}_ledger", self.base),
        }
    }

    /// The Redis ledger list, inside the namespace so one `SCAN` finds everything of the run.
    pub(crate) fn redis_ledger(&self) -> String {
        format!("idem:{{{}}}:chaos-ledger", self.base)
    }
}

/// An open connection to the store, for setting up, reading the ledger and cleaning up.
pub(crate) enum Ledger {
    Pg(sqlx::PgPool),
    My(sqlx::MySqlPool),
    Sqlite(sqlx::SqlitePool),
    Redis(redis::aio::ConnectionManager),
}

pub(crate) async fn pg_pool(url: &str, max: u32) -> anyhow::Result<sqlx::PgPool> {
    connect::pg_pool(url, sqlx::postgres::PgPoolOptions::new().max_connections(max)).await
}

/// A pool on the first of `urls` (one URL, or several separated by commas) that answers; the
/// error names every one that did not. What a worker writes through.
pub(crate) async fn my_pool(urls: &str, max: u32) -> anyhow::Result<sqlx::MySqlPool> {
    first_answering(urls, sqlx::mysql::MySqlPoolOptions::new().max_connections(max)).await
}

/// As [`my_pool`], for the run's setup and verdict: on several nodes, each read waits until its
/// node has applied every write committed through the others (Galera applies them after
/// certifying them), so the verdict counts each effect wherever it committed. The workers keep
/// the server's default, as an application would.
async fn ledger_pool(urls: &str) -> anyhow::Result<sqlx::MySqlPool> {
    let options = sqlx::mysql::MySqlPoolOptions::new().max_connections(2);
    first_answering(urls, if urls.contains(',') { causal(options) } else { options }).await
}

/// Pool options whose connections read causally (`wsrep_sync_wait = 1`: Galera only).
fn causal(options: sqlx::mysql::MySqlPoolOptions) -> sqlx::mysql::MySqlPoolOptions {
    options.after_connect(|conn, _| {
        Box::pin(async move {
            sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1").execute(conn).await.map(drop)
        })
    })
}

/// Waits until each node of a list that answers has applied the run's tables (Galera runs DDL
/// on the other nodes after the statement returned): a worker starting there would otherwise
/// find none. A causal read of the ledger does the waiting; a node that does not answer is
/// skipped (its workers move on to the next URL).
async fn created_everywhere(urls: &str, ledger: &str) -> anyhow::Result<()> {
    if !urls.contains(',') {
        return Ok(());
    }
    for url in urls.split(',') {
        let options = causal(sqlx::mysql::MySqlPoolOptions::new().max_connections(1));
        let Ok(pool) = connect::mysql_pool(url, options).await else { continue };
        let sql = format!("SELECT 1 FROM {ledger} LIMIT 0");
        sqlx::raw_sql(AssertSqlSafe(sql))
            .execute(&pool)
            .await
            .with_context(|| format!("the run's tables on {}", Redacted(url)))?;
        pool.close().await;
    }
    Ok(())
}

async fn first_answering(
    urls: &str,
    options: sqlx::mysql::MySqlPoolOptions,
) -> anyhow::Result<sqlx::MySqlPool> {
    if !urls.contains(',') {
        return connect::mysql_pool(urls, options).await;
    }
    let mut failures = Vec::new();
    for url in urls.split(',') {
        match connect::mysql_pool(url, options.clone()).await {
            Ok(pool) => return Ok(pool),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    bail!("no --store URL answered: {}", failures.join("; "))
}

/// `--store` as shown: each URL of a list without its password (one `Redacted` over the whole
/// list would take everything up to the last `@` for the first URL's user).
pub(crate) fn shown(store: &str) -> String {
    store.split(',').map(|u| Redacted(u).to_string()).collect::<Vec<_>>().join(",")
}

/// The `--store` a worker gets: a list of URLs turned so that worker `i` (in the order they are
/// started, replacements included) tries URL `i mod n` first, then the ones after it.
pub(crate) fn for_worker(store: &str) -> String {
    static STARTED: AtomicUsize = AtomicUsize::new(0);
    if !(is_mysql(store) && store.contains(',')) {
        return store.to_owned();
    }
    let urls: Vec<&str> = store.split(',').collect();
    let first = STARTED.fetch_add(1, Ordering::Relaxed) % urls.len();
    let (head, tail) = urls.split_at(first);
    [tail, head].concat().join(",")
}

pub(crate) async fn sqlite_pool(path: &PathBuf) -> anyhow::Result<sqlx::SqlitePool> {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    // One connection per process (SQLite has one writer); a generous busy timeout because
    // another worker may hold the write lock while it is stopped (--stall).
    let opts = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(30));
    connect::sqlite_pool(opts, SqlitePoolOptions::new().max_connections(1)).await
}

impl Ledger {
    /// Creates the run's dedup table(s) and its ledger.
    pub(crate) async fn create(store: &StoreUrl, names: &Names) -> anyhow::Result<Self> {
        let ledger = names.ledger_table(store);
        Ok(match store {
            StoreUrl::Postgres(url) => {
                let pool = pg_pool(url, 2).await?;
                let sql = format!("CREATE SCHEMA \"{}\"", names.base);
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(&pool).await?;
                PostgresStore::new(pool.clone()).with_schema(&names.base)?.migrate().await?;
                let sql = format!("CREATE TABLE {ledger} (id TEXT NOT NULL, body TEXT NOT NULL)");
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(&pool).await?;
                Self::Pg(pool)
            }
            StoreUrl::MySql(url) => {
                let pool = ledger_pool(url).await?;
                MySqlStore::new(pool.clone()).with_table_name(&names.base)?.migrate().await?;
                let sql = format!(
                    "CREATE TABLE {ledger} (id VARCHAR(128) NOT NULL, body VARCHAR(16) NOT NULL)"
                );
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(&pool).await?;
                created_everywhere(url, &ledger).await?;
                Self::My(pool)
            }
            StoreUrl::Sqlite(path) => {
                let pool = sqlite_pool(path).await?;
                SqliteStore::new(pool.clone()).with_table_name(&names.base)?.migrate().await?;
                let sql = format!("CREATE TABLE {ledger} (id TEXT NOT NULL, body TEXT NOT NULL)");
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(&pool).await?;
                Self::Sqlite(pool)
            }
            StoreUrl::Redis(url) => Self::Redis(connect::redis_manager(url).await?),
        })
    }

    /// Every effect so far.
    pub(crate) async fn effects(
        &self,
        store: &StoreUrl,
        names: &Names,
    ) -> anyhow::Result<Vec<Effect>> {
        let sql = format!("SELECT id, body FROM {}", names.ledger_table(store));
        let rows: Vec<(String, String)> = match self {
            Self::Pg(pool) => sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await?,
            Self::My(pool) => sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await?,
            Self::Sqlite(pool) => sqlx::query_as(AssertSqlSafe(sql)).fetch_all(pool).await?,
            Self::Redis(conn) => {
                let items: Vec<String> = conn.clone().lrange(names.redis_ledger(), 0, -1).await?;
                return items.iter().map(|s| parse_redis_effect(s)).collect();
            }
        };
        Ok(rows.into_iter().map(|(id, body)| Effect { id, body, attempt: None }).collect())
    }

    /// Drops everything the run created in the store.
    /// Rows in the offset inbox's positions table (the store's `<table>_positions`).
    pub(crate) async fn position_rows(
        &self,
        store: &StoreUrl,
        names: &Names,
    ) -> anyhow::Result<i64> {
        let _ = store;
        let base = &names.base;
        Ok(match self {
            Self::Pg(pool) => {
                let sql = format!("SELECT count(*) FROM \"{base}\".idem_records_positions");
                sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(pool).await?
            }
            Self::My(pool) => {
                let sql = format!("SELECT count(*) FROM {base}_positions");
                sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(pool).await?
            }
            Self::Sqlite(pool) => {
                let sql = format!("SELECT count(*) FROM {base}_positions");
                sqlx::query_scalar(AssertSqlSafe(sql)).fetch_one(pool).await?
            }
            Self::Redis(_) => 0,
        })
    }

    pub(crate) async fn drop_all(&self, store: &StoreUrl, names: &Names) -> anyhow::Result<()> {
        let base = &names.base;
        match self {
            Self::Pg(pool) => {
                let sql = format!("DROP SCHEMA \"{base}\" CASCADE");
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
            }
            Self::My(pool) => {
                let sql =
                    format!("DROP TABLE {base}, {base}_positions, {}", names.ledger_table(store));
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
            }
            Self::Sqlite(pool) => {
                let sql = format!(
                    "DROP TABLE {base}; DROP TABLE IF EXISTS {base}_positions; DROP TABLE {}",
                    names.ledger_table(store)
                );
                sqlx::raw_sql(AssertSqlSafe(sql)).execute(pool).await?;
            }
            Self::Redis(conn) => {
                let mut conn = conn.clone();
                let pattern = format!("idem:{{{base}}}:*");
                let keys: Vec<String> = {
                    let mut it: redis::AsyncIter<'_, String> = conn.scan_match(&pattern).await?;
                    let mut keys = Vec::new();
                    while let Some(k) = futures_util::StreamExt::next(&mut it).await {
                        keys.push(k?);
                    }
                    keys
                };
                for chunk in keys.chunks(500) {
                    let _: () = conn.del(chunk).await?;
                }
            }
        }
        Ok(())
    }
}

/// `<id>:<attempt>:<body>`, as the two-phase worker pushes it.
fn parse_redis_effect(s: &str) -> anyhow::Result<Effect> {
    let mut parts = s.rsplitn(3, ':');
    let (Some(body), Some(attempt), Some(id)) = (parts.next(), parts.next(), parts.next()) else {
        bail!("ledger entry {s:?} is not <id>:<attempt>:<body>")
    };
    let attempt = attempt.parse().with_context(|| format!("ledger entry {s:?}: attempt"))?;
    Ok(Effect { id: id.to_owned(), body: body.to_owned(), attempt: Some(attempt) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_store_urls() {
        assert!(matches!(StoreUrl::parse("x.db"), Ok(StoreUrl::Sqlite(_))));
        assert!(
            matches!(StoreUrl::parse("mariadb://root@h/test"), Ok(StoreUrl::MySql(u)) if u.starts_with("mariadb://"))
        );
        let e = StoreUrl::parse("mongodb://h").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("postgres://") && e.contains("redis://"), "{e}");
        let nodes = "mysql://root@a:3311/test,mysql://root@b:3312/test";
        assert!(matches!(StoreUrl::parse(nodes), Ok(StoreUrl::MySql(u)) if u == nodes));
        let e = StoreUrl::parse("mysql://root@a/test,redis://b").err().map(|e| e.to_string());
        assert!(e.unwrap_or_default().contains("redis://b"));
    }

    #[test]
    fn workers_take_the_urls_in_turn() {
        let nodes = "mysql://a,mysql://b,mysql://c";
        let firsts: Vec<String> = (0..6)
            .map(|_| for_worker(nodes).split(',').next().unwrap_or_default().to_owned())
            .collect();
        // Each worker gets every URL, its own first; over any three workers, each one first.
        assert!(for_worker(nodes).split(',').count() == 3);
        for w in firsts.windows(3) {
            let mut w = w.to_vec();
            w.sort();
            assert_eq!(w, ["mysql://a", "mysql://b", "mysql://c"]);
        }
        assert_eq!(for_worker("mysql://a"), "mysql://a");
        assert_eq!(for_worker("x.db"), "x.db");
    }

    #[test]
    fn lists_are_shown_url_by_url() {
        let shown = shown("mysql://u:Planted1@a:1/t,mysql://u:Planted2@b:2/t");
        assert!(!shown.contains("Planted"), "{shown}");
        assert!(shown.contains("@a:1/t,") && shown.ends_with("@b:2/t"), "{shown}");
    }

    #[test]
    fn parses_redis_effects() {
        let e = parse_redis_effect("t-000001:2:original").ok();
        assert_eq!(e.map(|e| (e.id, e.attempt)), Some(("t-000001".into(), Some(2))));
        assert!(parse_redis_effect("nonsense").is_err());
    }
}
