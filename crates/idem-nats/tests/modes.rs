//! Every mode through the same builder calls, on the real server: two-phase over a store, and
//! the transactional inbox on SQLite, PostgreSQL and MariaDB. Each run: 20 orders, 5 producer
//! retries (after JetStream's duplicate window, so really delivered twice), one id reused with
//! another body. Each order's effect exactly once, the reused id dead-lettered, nothing pending.

mod common;

use std::future::Future;
use std::time::Duration;

use common::{Env, header, nats_url, wait_for};
use idem_core::consumer::HandlerError;
use idem_core::driver::headers;
use idem_core::extract::Envelope;
use idem_core::{Backend, Consumer};
use idem_nats::{Delivery, JetStream, JetStreamConsumer};
use idem_sqlx::{MySqlStore, PostgresStore, SqliteStore, Tx};
use sqlx::AssertSqlSafe;

const ORDERS: usize = 20;
const DAY: Duration = Duration::from_secs(86_400);

/// Publishes the workload, runs a consumer over `backend` with `handler` until every order has
/// one effect (`effects()`) and the conflict is dead-lettered, then checks the counts.
async fn exercise<B, H, Fut, C, CFut>(env: &Env, name: &str, backend: B, handler: H, effects: C)
where
    B: Backend,
    H: Fn(B::Ctx, Delivery) -> Fut + Sync,
    Fut: Future<Output = Result<(), HandlerError<String>>> + Send,
    C: Fn() -> CFut,
    CFut: Future<Output = (i64, i64)>,
{
    let pull = env.consumer(name, Duration::from_secs(5), 10).await;
    // The same calls whatever the backend: the broker side, the store or inbox, the scope.
    let consumer =
        JetStreamConsumer::builder(JetStream::new(env.js.clone(), pull, &env.dlq_subject))
            .engine(Consumer::builder(backend).scope(name).retain(DAY).build().expect("engine"))
            .batch(8)
            .idle_wait(Duration::from_millis(100))
            .build()
            .await
            .expect("consumer");
    let body = |i: usize| format!(r#"{{"order":{i}}}"#);
    let mut last = tokio::time::Instant::now();
    for i in 0..ORDERS {
        env.publish(&format!("o-{i}"), body(i).as_bytes()).await;
    }
    for i in 0..5 {
        env.retry(&format!("o-{i}"), body(i).as_bytes(), &mut last).await;
    }
    env.retry("o-7", br#"{"order":"other"}"#, &mut last).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = consumer.run(&handler, async {
        let _ = stopped.await;
    });
    let watch = async {
        wait_for("every effect, the dead letter, nothing pending", Duration::from_secs(30), || {
            let effects = effects();
            async {
                effects.await.0 == ORDERS as i64
                    && !env.dead_letters().await.is_empty()
                    && env.pending(name).await == (0, 0)
            }
        })
        .await;
        stop.send(()).expect("stop");
    };
    let (report, ()) = tokio::join!(run, watch);
    let report = report.expect("run");
    let (distinct, rows) = effects().await;
    assert_eq!((distinct, rows), (ORDERS as i64, ORDERS as i64), "{name}: an effect ran twice");
    assert_eq!(report.processed, ORDERS as u64, "{name}: {report}");
    assert_eq!(report.duplicates, 5, "{name}: {report}");
    assert_eq!((report.conflicts, report.dead_lettered), (1, 1), "{name}: {report}");
    let dl = env.dead_letters().await;
    assert_eq!(header(&dl[0], headers::ORIGINAL_MESSAGE_ID), Some("o-7"));
    assert_eq!(header(&dl[0], headers::OUTCOME), Some("conflict"));
}

fn id(d: &Delivery) -> String {
    d.message_id().unwrap_or_default().to_owned()
}

fn transient(e: sqlx::Error) -> HandlerError<String> {
    HandlerError::Transient(e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_on_a_store() {
    let Some(url) = nats_url() else { return };
    let env = Env::new(&url).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.expect("store");
    // The effect lives outside the store: a ledger the handler writes through its own pool.
    let ledger = sqlx::SqlitePool::connect(&format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("ledger.sqlite").display()
    ))
    .await
    .expect("ledger");
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL)").execute(&ledger).await.expect("table");
    let handler = |_ctx, d: Delivery| {
        let ledger = ledger.clone();
        async move {
            sqlx::query("INSERT INTO ledger VALUES (?)")
                .bind(id(&d))
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
            .expect("count")
    };
    exercise(&env, "two-phase", store, handler, effects).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_sqlite() {
    let Some(url) = nats_url() else { return };
    let env = Env::new(&url).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("shop.sqlite")).await.expect("store");
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL)").execute(store.pool()).await.expect("t");
    let handler = |mut tx: Tx<sqlx::Sqlite>, d: Delivery| async move {
        sqlx::query("INSERT INTO ledger VALUES (?)")
            .bind(id(&d))
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
            .expect("count")
    };
    exercise(&env, "inbox-sqlite", store.inbox(DAY), handler, effects).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_postgres() {
    let Some(url) = nats_url() else { return };
    let Some(pg) = common::pg_url() else { return };
    let env = Env::new(&url).await;
    let schema = common::PgSchema::new(&pg, &format!("idem_nats_modes_{}", common::suffix()));
    let store = PostgresStore::connect(&pg).await.expect("pg");
    let store = store.with_schema(&schema.name).expect("schema");
    store.migrate().await.expect("migrate");
    let ledger = format!("\"{}\".ledger", schema.name);
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE {ledger} (k TEXT NOT NULL)")))
        .execute(store.pool())
        .await
        .expect("table");
    let insert = format!("INSERT INTO {ledger} VALUES ($1)");
    let handler = |mut tx: Tx<sqlx::Postgres>, d: Delivery| {
        let insert = insert.clone();
        async move {
            sqlx::query(AssertSqlSafe(insert))
                .bind(id(&d))
                .execute(&mut *tx)
                .await
                .map_err(transient)?;
            Ok(())
        }
    };
    let pool = store.pool().clone();
    let count = format!("SELECT COUNT(DISTINCT k), COUNT(*) FROM {ledger}");
    let effects = || {
        let (pool, count) = (pool.clone(), count.clone());
        async move { sqlx::query_as(AssertSqlSafe(count)).fetch_one(&pool).await.expect("count") }
    };
    exercise(&env, "inbox-postgres", store.inbox(DAY), handler, effects).await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_mysql() {
    let Some(url) = nats_url() else { return };
    let Some(my) = idem_testkit::service::require(
        "MySQL",
        "IDEM_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    ) else {
        return;
    };
    let env = Env::new(&url).await;
    let table = format!("idem_nats_modes_{}", common::suffix());
    let store = MySqlStore::connect(&my).await.expect("mysql");
    let store = store.with_table_name(&table).expect("table name");
    store.migrate().await.expect("migrate");
    let _drop = DropTables { url: my.clone(), tables: format!("`{table}`, `{table}_ledger`") };
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL)")))
        .execute(store.pool())
        .await
        .expect("ledger");
    let insert = format!("INSERT INTO `{table}_ledger` VALUES (?)");
    let handler = |mut tx: Tx<sqlx::MySql>, d: Delivery| {
        let insert = insert.clone();
        async move {
            sqlx::query(AssertSqlSafe(insert))
                .bind(id(&d))
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
        async move { sqlx::query_as(AssertSqlSafe(count)).fetch_one(&pool).await.expect("count") }
    };
    exercise(&env, "inbox-mysql", store.inbox(DAY), handler, effects).await;
    env.cleanup().await;
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
