//! Forgetting `migrate()` is loud: `connect` creates nothing, a consumer's `build` fails naming
//! the table and `migrate()`, and a batch that fails on a missing table says why in its report.
//! On the real servers (PostgreSQL, MariaDB) and SQLite files.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::common;

use std::time::Duration;

use idem_core::consumer::{BuildError, MemoryQueue};
use idem_core::inbox::{Inbox, TxInbox};
use idem_core::{Consumer, DedupStore, StoreError};

const DAY: Duration = Duration::from_secs(86_400);

type Built<B> = Result<Consumer<MemoryQueue, B>, BuildError<std::convert::Infallible>>;

/// Builds a two-phase consumer over `store` on an in-process queue.
async fn build<S: DedupStore>(store: S) -> Built<S> {
    Consumer::builder(MemoryQueue::new()).store(store).scope("orders").build().await
}

/// Builds an inbox consumer over `inbox` on an in-process queue.
async fn build_inbox<I: TxInbox>(inbox: I) -> Built<Inbox<I>> {
    Consumer::builder(MemoryQueue::new()).inbox(inbox).scope("orders").build().await
}

/// The refusal of a store whose table is missing: its message names `table` and `migrate`.
fn assert_unmigrated<T>(
    built: Result<T, BuildError<std::convert::Infallible>>,
    table: &str,
    migrate: &str,
) {
    let Err(e) = built else { panic!("built without the table {table}") };
    assert!(matches!(e, BuildError::Store(StoreError::NotMigrated { .. })), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains(&format!("table {table} does not exist")) && text.contains(migrate),
        "{text}"
    );
}

/// A table made before the `deaths` column existed (here: the column dropped from a migrated
/// one, with a completed record in it): the startup check names the column, `migrate()` adds
/// it, and the record reads back with 0 deaths and is still a duplicate.
async fn an_old_table_gains_deaths<S, D, M>(store: S, drop_column: D, migrate: M)
where
    S: DedupStore + idem_core::InspectStore + Clone,
    D: std::future::Future<Output = ()>,
    M: std::future::Future<Output = Result<(), StoreError>>,
{
    use idem_core::{Claim, ClaimRequest, DedupKey};
    let key = DedupKey::new("orders", "o-old").unwrap();
    let req = ClaimRequest::new(key.clone(), None, Duration::from_secs(30), DAY);
    let Claim::Acquired(lease) = store.claim(&req).await.unwrap() else { panic!("not acquired") };
    store.complete(lease, Some(b"done"), DAY).await.unwrap();
    drop_column.await;
    let Err(e) = build(store.clone()).await else { panic!("built without the deaths column") };
    assert!(e.to_string().contains("lacks the columns deaths"), "{e}");
    migrate.await.expect("migrate adds the column");
    build(store.clone()).await.expect("built after migrate");
    let rec = store.get(&key).await.unwrap().expect("the record survived");
    assert_eq!((rec.deaths, rec.result.as_deref()), (0, Some(&b"done"[..])));
    assert!(matches!(store.claim(&req).await.unwrap(), Claim::Completed(_)));
}

/// Five messages against a table dropped after the consumer was built: every one fails
/// (transiently, so it is retried), and the report says which store error.
#[cfg(any(feature = "postgres", feature = "mysql"))]
async fn fails_with_the_reason<B: idem_core::Backend>(
    consumer: Consumer<MemoryQueue, B>,
    queue: &MemoryQueue,
    why: &str,
) {
    for i in 0..5 {
        queue.push(format!("o-{i}"), "{}");
    }
    let handler = |_, _| async { Ok::<_, idem_core::engine::HandlerError<String>>(()) };
    let report = consumer.poll(handler).await.unwrap();
    assert_eq!((report.failed_transient, report.retried), (5, 5), "{report}");
    let text = report.to_string();
    assert!(text.contains("failed 5 (transient 5, permanent 0)") && text.contains(why), "{text}");
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use idem_sqlx::PostgresStore;
    use sqlx::Connection as _;

    /// Drops the database when dropped, on a connection of its own: `DROP DATABASE` must run
    /// alone, never inside the implicit transaction of a multi-statement query.
    struct DropDatabase {
        url: String,
        db: String,
    }

    impl Drop for DropDatabase {
        fn drop(&mut self) {
            let (url, db) = (self.url.clone(), self.db.clone());
            let _ = std::thread::spawn(move || {
                let rt =
                    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async move {
                    if let Ok(mut c) = sqlx::PgConnection::connect(&url).await {
                        let sql = format!("DROP DATABASE IF EXISTS \"{db}\" WITH (FORCE)");
                        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut c).await;
                    }
                });
            })
            .join();
        }
    }

    /// `url` with its database replaced by `db`.
    fn with_database(url: &str, db: &str) -> String {
        let (base, query) = url.split_once('?').map_or((url, ""), |(b, q)| (b, q));
        let (server, _) = base.rsplit_once('/').unwrap();
        if query.is_empty() { format!("{server}/{db}") } else { format!("{server}/{db}?{query}") }
    }

    #[tokio::test]
    async fn connect_creates_nothing_and_build_names_the_missing_table() {
        let Some(url) = common::pg_url() else { return };
        let db = common::unique("idem_connect");
        let mut admin = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{db}\"")))
            .execute(&mut admin)
            .await
            .unwrap();
        let _drop = DropDatabase { url: url.clone(), db: db.clone() };

        let store = PostgresStore::connect(&with_database(&url, &db)).await.unwrap();
        let schemas: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.schemata WHERE schema_name = 'idem'",
        )
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!(schemas, 0, "connect created the default schema");

        let shop = store.clone().with_schema("shop").unwrap();
        assert_unmigrated(
            build(shop.clone()).await,
            "\"shop\".\"idem_records\"",
            "PostgresStore::migrate()",
        );
        assert_unmigrated(
            build_inbox(shop.inbox(DAY)).await,
            "\"shop\".\"idem_records\"",
            "PostgresStore::migrate()",
        );
        shop.migrate().await.unwrap();
        build(shop.clone()).await.expect("two-phase after migrate");
        build_inbox(shop.inbox(DAY)).await.expect("inbox after migrate");
        let default_schema: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.schemata WHERE schema_name = 'idem'",
        )
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!(default_schema, 0, "only the schema asked for was created");
        store.pool().close().await;
    }

    #[tokio::test]
    async fn an_old_table_gains_deaths_on_migrate() {
        let Some(url) = common::pg_url() else { return };
        let schema = common::unique("idem_deaths");
        let store = PostgresStore::connect(&url).await.unwrap().with_schema(&schema).unwrap();
        let _drop =
            common::DropSql { url, sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
        store.migrate().await.unwrap();
        let drop_column = format!("ALTER TABLE \"{schema}\".idem_records DROP COLUMN deaths");
        let pool = store.pool().clone();
        let drop_it = async move {
            sqlx::raw_sql(sqlx::AssertSqlSafe(drop_column)).execute(&pool).await.unwrap();
        };
        super::an_old_table_gains_deaths(store.clone(), drop_it, store.migrate()).await;
    }

    #[tokio::test]
    async fn a_table_without_the_store_columns_is_refused_naming_them() {
        let Some(url) = common::pg_url() else { return };
        let schema = common::unique("idem_cols");
        let store = PostgresStore::connect(&url).await.unwrap().with_schema(&schema).unwrap();
        let _drop =
            common::DropSql { url, sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA \"{schema}\"; CREATE TABLE \"{schema}\".idem_records \
             (key_hash BYTEA PRIMARY KEY, scope TEXT, key_id TEXT)"
        )))
        .execute(store.pool())
        .await
        .unwrap();
        let Err(e) = build(store).await else { panic!("built on a partial table") };
        let text = e.to_string();
        assert!(text.contains("lacks the columns state, fingerprint, result"), "{text}");
    }

    #[tokio::test]
    async fn every_message_failing_on_a_dropped_table_reports_why() {
        let Some(url) = common::pg_url() else { return };
        let schema = common::unique("idem_drop");
        let store = PostgresStore::connect(&url).await.unwrap().with_schema(&schema).unwrap();
        let _drop =
            common::DropSql { url, sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
        store.migrate().await.unwrap();
        let drop_table = format!("DROP TABLE \"{schema}\".idem_records");

        let queue = MemoryQueue::new();
        let two_phase = Consumer::builder(queue.clone())
            .store(store.clone())
            .scope("orders")
            .build()
            .await
            .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop_table)).execute(store.pool()).await.unwrap();
        fails_with_the_reason(two_phase, &queue, "does not exist").await;

        store.migrate().await.unwrap();
        let queue = MemoryQueue::new();
        let inbox = Consumer::builder(queue.clone())
            .inbox(store.inbox(DAY))
            .scope("orders")
            .build()
            .await
            .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE \"{schema}\".idem_records")))
            .execute(store.pool())
            .await
            .unwrap();
        fails_with_the_reason(inbox, &queue, "does not exist").await;
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use idem_sqlx::MySqlStore;
    use sqlx::Connection as _;

    fn with_database(url: &str, db: &str) -> String {
        let (base, query) = url.split_once('?').map_or((url, ""), |(b, q)| (b, q));
        let (server, _) = base.rsplit_once('/').unwrap();
        if query.is_empty() { format!("{server}/{db}") } else { format!("{server}/{db}?{query}") }
    }

    #[tokio::test]
    async fn connect_creates_nothing_and_build_names_the_missing_table() {
        let Some(url) = common::mysql_url() else { return };
        let db = common::unique("idem_connect");
        let mut admin = sqlx::MySqlConnection::connect(&url).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE `{db}`")))
            .execute(&mut admin)
            .await
            .unwrap();
        let _drop =
            common::DropSql { url: url.clone(), sql: format!("DROP DATABASE IF EXISTS `{db}`") };

        let store = MySqlStore::connect(&with_database(&url, &db)).await.unwrap();
        let tables: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = DATABASE()",
        )
        .fetch_one(store.pool())
        .await
        .unwrap();
        assert_eq!(tables, 0, "connect created a table");

        let orders = store.clone().with_table_name("orders_keys").unwrap();
        assert_unmigrated(build(orders.clone()).await, "`orders_keys`", "MySqlStore::migrate()");
        assert_unmigrated(
            build_inbox(orders.inbox(DAY)).await,
            "`orders_keys`",
            "MySqlStore::migrate()",
        );
        orders.migrate().await.unwrap();
        build(orders.clone()).await.expect("two-phase after migrate");
        build_inbox(orders.inbox(DAY)).await.expect("inbox after migrate");
        store.pool().close().await;
    }

    #[tokio::test]
    async fn an_old_table_gains_deaths_on_migrate() {
        let Some(url) = common::mysql_url() else { return };
        let table = common::unique("idem_deaths");
        let store = MySqlStore::connect(&url).await.unwrap().with_table_name(&table).unwrap();
        let _drop = common::DropSql {
            url,
            sql: format!("DROP TABLE IF EXISTS `{table}`, `{table}_positions`"),
        };
        store.migrate().await.unwrap();
        let drop_column = format!("ALTER TABLE `{table}` DROP COLUMN deaths");
        let pool = store.pool().clone();
        let drop_it = async move {
            sqlx::raw_sql(sqlx::AssertSqlSafe(drop_column)).execute(&pool).await.unwrap();
        };
        super::an_old_table_gains_deaths(store.clone(), drop_it, store.migrate()).await;
    }

    #[tokio::test]
    async fn every_message_failing_on_a_dropped_table_reports_why() {
        let Some(url) = common::mysql_url() else { return };
        let table = common::unique("idem_drop");
        let store = MySqlStore::connect(&url).await.unwrap().with_table_name(&table).unwrap();
        let _drop = common::DropSql {
            url,
            sql: format!("DROP TABLE IF EXISTS `{table}`, `{table}_positions`"),
        };
        store.migrate().await.unwrap();
        let queue = MemoryQueue::new();
        let consumer = Consumer::builder(queue.clone())
            .store(store.clone())
            .scope("orders")
            .build()
            .await
            .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE `{table}`")))
            .execute(store.pool())
            .await
            .unwrap();
        fails_with_the_reason(consumer, &queue, "doesn't exist").await;
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use idem_sqlx::SqliteStore;

    #[tokio::test]
    async fn a_table_never_migrated_is_refused_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let opened = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
        build(opened.clone()).await.expect("open() creates its default table");
        let other = SqliteStore::new(opened.pool().clone()).with_table_name("orders_keys").unwrap();
        assert_unmigrated(build(other.clone()).await, "\"orders_keys\"", "SqliteStore::migrate()");
        assert_unmigrated(
            build_inbox(other.inbox(DAY)).await,
            "\"orders_keys\"",
            "SqliteStore::migrate()",
        );
        other.migrate().await.unwrap();
        build_inbox(other.inbox(DAY)).await.expect("inbox after migrate");
    }

    #[tokio::test]
    async fn an_old_table_gains_deaths_on_migrate() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
        let drop_column = format!("ALTER TABLE {} DROP COLUMN deaths", store.table());
        let pool = store.pool().clone();
        let drop_it = async move {
            sqlx::raw_sql(sqlx::AssertSqlSafe(drop_column)).execute(&pool).await.unwrap();
        };
        super::an_old_table_gains_deaths(store.clone(), drop_it, store.migrate()).await;
    }

    /// A store migrated before the offset inbox existed has no positions table: the
    /// consumer's build says which `migrate()` to run instead of failing at the first batch.
    #[tokio::test]
    async fn a_store_without_the_positions_table_is_refused_at_build() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
        let drop_it = format!("DROP TABLE {}_positions", store.table());
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop_it)).execute(store.pool()).await.unwrap();
        let built = Consumer::builder(MemoryQueue::new())
            .offset_inbox(idem_core::inbox::OffsetInbox::new(store.inbox(DAY)))
            .scope("offsets")
            .build()
            .await;
        match built {
            Err(BuildError::Store(e @ StoreError::NotMigrated { .. })) => {
                assert!(e.to_string().contains("migrate()"), "{e}");
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
    }
}
