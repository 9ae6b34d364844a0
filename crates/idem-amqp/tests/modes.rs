//! Every mode through the same builder calls, on the real RabbitMQ: two-phase over a store,
//! and the transactional inbox on SQLite, PostgreSQL and MariaDB. Each run: 20 orders, 5
//! producer retries (same id, same body), one id reused with another body. Each order's effect
//! exactly once, the reused id dead-lettered with its reason, nothing left in the queue.
#![allow(clippy::unwrap_used)]

mod common;

use std::future::Future;
use std::time::Duration;

use common::Broker;
use idem_amqp::{AmqpConfig, AmqpConsumer, AmqpMessage};
use idem_core::consumer::HandlerError;
use idem_core::{Backend, Consumer};
use idem_sqlx::{MySqlStore, SqliteStore, Tx};
use sqlx::AssertSqlSafe;

const ORDERS: usize = 20;
const DAY: Duration = Duration::from_secs(86_400);
const LIMIT: Duration = Duration::from_secs(30);

/// Publishes the workload, runs a consumer over `backend` with `handler` until every order has
/// one effect (`effects()`) and the conflict is dead-lettered, then checks the counts.
async fn exercise<B, H, Fut, C, CFut>(b: &Broker, name: &str, backend: B, handler: H, effects: C)
where
    B: Backend,
    H: Fn(B::Ctx, AmqpMessage) -> Fut + Sync,
    Fut: Future<Output = Result<(), HandlerError<String>>> + Send,
    C: Fn() -> CFut,
    CFut: Future<Output = (i64, i64)>,
{
    let body = |i: usize| format!(r#"{{"order":{i}}}"#);
    for i in 0..ORDERS {
        b.publish(Some(&format!("o-{i}")), body(i).as_bytes(), &[]).await;
    }
    for i in 0..5 {
        b.publish(Some(&format!("o-{i}")), body(i).as_bytes(), &[]).await;
    }
    b.publish(Some("o-7"), br#"{"order":"other"}"#, &[]).await;
    // The same calls whatever the backend: the broker side, the store or inbox, the scope.
    let consumer = AmqpConsumer::builder(AmqpConfig::new(&b.conn, b.queue()))
        .engine(Consumer::builder(backend).scope(name).retain(DAY).build().unwrap())
        .batch(8)
        .idle_wait(Duration::from_millis(100))
        .build()
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = consumer.run(&handler, async {
        let _ = stopped.await;
    });
    let watch = async {
        let deadline = tokio::time::Instant::now() + LIMIT;
        while effects().await.0 < ORDERS as i64 || b.count(b.dead_letter_queue()).await == 0 {
            assert!(tokio::time::Instant::now() < deadline, "{name}: not done in {LIMIT:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.send(()).unwrap();
    };
    let (report, ()) = tokio::join!(run, watch);
    let report = report.unwrap();
    let (distinct, rows) = effects().await;
    assert_eq!((distinct, rows), (ORDERS as i64, ORDERS as i64), "{name}: an effect ran twice");
    assert_eq!(report.processed, ORDERS as u64, "{name}: {report}");
    assert_eq!(report.duplicates, 5, "{name}: {report}");
    assert_eq!((report.conflicts, report.dead_lettered), (1, 1), "{name}: {report}");
    assert_eq!(b.count(b.queue()).await, 0, "{name}: nothing left in the queue");
    let dlq = b.drain_dlq().await;
    assert_eq!(dlq.len(), 1, "{name}: {dlq:?}");
    assert_eq!(dlq[0].0.as_deref(), Some("o-7"));
    assert!(dlq[0].1.as_deref().unwrap().starts_with(&format!("conflict: key {name}/o-7")));
}

fn id(m: &AmqpMessage) -> String {
    m.properties().message_id().as_ref().map(ToString::to_string).unwrap_or_default()
}

fn transient(e: sqlx::Error) -> HandlerError<String> {
    HandlerError::Transient(e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_on_a_store() {
    let Some(b) = Broker::new("modes-2p").await else { return };
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
    // The effect lives outside the store: a ledger the handler writes through its own pool.
    let ledger = sqlx::SqlitePool::connect(&format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("ledger.sqlite").display()
    ))
    .await
    .unwrap();
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL)").execute(&ledger).await.unwrap();
    let handler = |_ctx, m: AmqpMessage| {
        let ledger = ledger.clone();
        async move {
            sqlx::query("INSERT INTO ledger VALUES (?)")
                .bind(id(&m))
                .execute(&ledger)
                .await
                .map_err(transient)?;
            Ok(())
        }
    };
    let effects = || async {
        sqlx::query_as("SELECT COUNT(DISTINCT k), COUNT(*) FROM ledger")
            .fetch_one(&ledger)
            .await
            .unwrap()
    };
    exercise(&b, "two-phase", store, handler, effects).await;
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_sqlite() {
    let Some(b) = Broker::new("modes-sqlite").await else { return };
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("shop.sqlite")).await.unwrap();
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL)").execute(store.pool()).await.unwrap();
    let handler = |mut tx: Tx<sqlx::Sqlite>, m: AmqpMessage| async move {
        sqlx::query("INSERT INTO ledger VALUES (?)")
            .bind(id(&m))
            .execute(&mut *tx)
            .await
            .map_err(transient)?;
        Ok(())
    };
    let pool = store.pool().clone();
    let effects = || async {
        sqlx::query_as("SELECT COUNT(DISTINCT k), COUNT(*) FROM ledger")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    exercise(&b, "inbox-sqlite", store.inbox(DAY), handler, effects).await;
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_postgres() {
    let Some(pg) = idem_testkit::service::require(
        "PostgreSQL",
        "IDEM_TEST_POSTGRES_URL",
        common::PG_DEFAULT_URL,
    ) else {
        return;
    };
    let Some(b) = Broker::new("modes-pg").await else { return };
    let (guard, store) =
        common::PgSchema::create(&pg, format!("idem_amqp_modes_{}", common::suffix())).await;
    let ledger = format!("{}.ledger", guard.name);
    guard.exec(&format!("CREATE TABLE {ledger} (k TEXT NOT NULL)")).await;
    let insert = format!("INSERT INTO {ledger} VALUES ($1)");
    let handler = |mut tx: Tx<sqlx::Postgres>, m: AmqpMessage| {
        let insert = insert.clone();
        async move {
            sqlx::query(AssertSqlSafe(insert))
                .bind(id(&m))
                .execute(&mut *tx)
                .await
                .map_err(transient)?;
            Ok(())
        }
    };
    let pool = guard.pool.clone();
    let count = format!("SELECT COUNT(DISTINCT k), COUNT(*) FROM {ledger}");
    let effects = || {
        let (pool, count) = (pool.clone(), count.clone());
        async move { sqlx::query_as(AssertSqlSafe(count)).fetch_one(&pool).await.unwrap() }
    };
    exercise(&b, "inbox-postgres", store.inbox(DAY), handler, effects).await;
    b.cleanup().await;
    guard.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_mysql() {
    let Some(my) = idem_testkit::service::require(
        "MySQL",
        "IDEM_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    ) else {
        return;
    };
    let Some(b) = Broker::new("modes-mysql").await else { return };
    let table = format!("idem_amqp_modes_{}", common::suffix());
    let store = MySqlStore::connect(&my).await.unwrap();
    let store = store.with_table_name(&table).unwrap();
    store.migrate().await.unwrap();
    let _drop = DropTables { url: my.clone(), tables: format!("`{table}`, `{table}_ledger`") };
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL)")))
        .execute(store.pool())
        .await
        .unwrap();
    let insert = format!("INSERT INTO `{table}_ledger` VALUES (?)");
    let handler = |mut tx: Tx<sqlx::MySql>, m: AmqpMessage| {
        let insert = insert.clone();
        async move {
            sqlx::query(AssertSqlSafe(insert))
                .bind(id(&m))
                .execute(&mut *tx)
                .await
                .map_err(transient)?;
            Ok(())
        }
    };
    let pool = store.pool().clone();
    let count = format!("SELECT COUNT(DISTINCT k), COUNT(*) FROM `{table}_ledger`");
    let effects = || {
        let (pool, count) = (pool.clone(), count.clone());
        async move { sqlx::query_as(AssertSqlSafe(count)).fetch_one(&pool).await.unwrap() }
    };
    exercise(&b, "inbox-mysql", store.inbox(DAY), handler, effects).await;
    b.cleanup().await;
}

/// Drops the test's MariaDB tables, panics included.
struct DropTables {
    url: String,
    tables: String,
}

impl Drop for DropTables {
    fn drop(&mut self) {
        let (url, sql) = (self.url.clone(), format!("DROP TABLE IF EXISTS {}", self.tables));
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            rt.block_on(async move {
                use sqlx::Connection as _;
                if let Ok(mut c) = sqlx::MySqlConnection::connect(&url).await {
                    let _ = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut c).await;
                }
            });
        })
        .join();
    }
}
