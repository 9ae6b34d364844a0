//! Every mode through the same builder calls on a real Redis: two-phase over a store (this
//! crate's `RedisStore`, and `SqliteStore`) and the transactional inbox on SQLite, PostgreSQL and
//! MariaDB. Each run: 20 orders, 5 producer duplicates, one id reused with another body. Each
//! order's effect exactly once, the reused id dead-lettered, nothing pending.

mod common;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{DropSql, fresh_sql_name, group_state, wait_for};
use idem_core::consumer::HandlerError;
use idem_core::driver::headers;
use idem_core::extract::Envelope;
use idem_core::{Backend, Consumer};
use idem_redis::{GROUP_FIELD, StreamConfig, StreamConsumer, StreamEntry};
use idem_sqlx::{MySqlStore, PostgresStore, SqliteStore, Tx};
use redis::AsyncCommands;
use sqlx::AssertSqlSafe;

const ORDERS: usize = 20;
const TOTAL: usize = 26;
const DAY: Duration = Duration::from_secs(86_400);

/// Writes the workload to a stream of its own, runs a consumer over `backend` with `handler`
/// until every entry was read and nothing is pending, then checks the effects (`effects()`:
/// distinct keys, rows) and the dead letter.
async fn exercise<B, H, Fut, C, CFut>(url: &str, name: &str, backend: B, handler: H, effects: C)
where
    B: Backend,
    H: Fn(B::Ctx, StreamEntry) -> Fut + Sync,
    Fut: Future<Output = Result<(), HandlerError<String>>> + Send,
    C: Fn() -> CFut,
    CFut: Future<Output = (i64, i64)>,
{
    let stream = common::fresh_name(name);
    let _cleanup = common::Cleanup { url: url.to_owned(), patterns: vec![format!("{stream}*")] };
    let client = redis::Client::open(url).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("conn");
    let body = |i: usize| format!(r#"{{"order":{i}}}"#);
    let mut entries: Vec<(String, String)> =
        (0..ORDERS).map(|i| (format!("o-{i}"), body(i))).collect();
    for i in 0..5 {
        entries.push((format!("o-{i}"), body(i)));
    }
    entries.push(("o-7".to_owned(), r#"{"order":"other"}"#.to_owned()));
    for (id, payload) in &entries {
        let _: String = conn
            .xadd(&stream, "*", &[("message_id", id.as_str()), ("payload", payload.as_str())])
            .await
            .expect("xadd");
    }
    // The same calls whatever the backend: the broker side, the store or inbox, the scope.
    let consumer = StreamConsumer::builder(StreamConfig::new(client.clone(), &stream, name, "c1"))
        .engine(Consumer::builder(backend).scope(name).retain(DAY).build().expect("engine"))
        .batch(8)
        .idle_wait(Duration::from_millis(100))
        .build()
        .await
        .expect("consumer");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = consumer.run(&handler, async {
        let _ = stopped.await;
    });
    let watch = async {
        wait_for("every entry read and acknowledged", Duration::from_secs(30), || {
            let (mut conn, stream) = (conn.clone(), &stream);
            async move { group_state(&mut conn, stream, name).await == Some((0, TOTAL)) }
        })
        .await;
        stop.send(()).expect("stop");
    };
    let (report, ()) = tokio::join!(run, watch);
    let report = report.expect("run");
    assert_eq!(effects().await, (ORDERS as i64, ORDERS as i64), "{name}: an effect ran twice");
    assert_eq!(report.processed, ORDERS as u64, "{name}: {report}");
    assert_eq!((report.duplicates, report.conflicts), (5, 1), "{name}: {report}");
    assert_eq!((report.acked, report.dead_lettered), (25, 1), "{name}: {report}");
    let dead: redis::streams::StreamRangeReply =
        conn.xrange_all(format!("{stream}:dead-letter")).await.expect("xrange");
    assert_eq!(dead.ids.len(), 1, "{name}");
    let field = |k: &str| dead.ids[0].get::<String>(k).unwrap_or_else(|| panic!("{name}: no {k}"));
    assert_eq!(field("message_id"), "o-7");
    assert_eq!(field(headers::OUTCOME), "conflict");
    assert_eq!(field(headers::SCOPE), name);
    assert_eq!(field(headers::SOURCE), stream);
    assert_eq!(field(GROUP_FIELD), name);
}

fn id(e: &StreamEntry) -> String {
    e.message_id().unwrap_or_default().to_owned()
}

fn transient(e: sqlx::Error) -> HandlerError<String> {
    HandlerError::Transient(e.to_string())
}

/// An effect outside any store: a ledger that counts every run.
type Ledger = Arc<Mutex<HashMap<String, i64>>>;

fn counts(ledger: &Ledger) -> (i64, i64) {
    let l = ledger.lock().expect("ledger");
    (i64::try_from(l.len()).unwrap_or(-1), l.values().sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_on_the_redis_store() {
    let Some(url) = common::url() else { return };
    let (store, _offset, _cleanup) = common::store(&url, "modes-2p").await;
    let ledger = Ledger::default();
    let handler = |_ctx, e: StreamEntry| {
        let ledger = Arc::clone(&ledger);
        async move {
            *ledger.lock().expect("ledger").entry(id(&e)).or_default() += 1;
            Ok(())
        }
    };
    exercise(&url, "two-phase-redis", store, handler, || async { counts(&ledger) }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_on_sqlite() {
    let Some(url) = common::url() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.expect("store");
    let ledger = Ledger::default();
    let handler = |_ctx, e: StreamEntry| {
        let ledger = Arc::clone(&ledger);
        async move {
            *ledger.lock().expect("ledger").entry(id(&e)).or_default() += 1;
            Ok(())
        }
    };
    exercise(&url, "two-phase-sqlite", store, handler, || async { counts(&ledger) }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_sqlite() {
    let Some(url) = common::url() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("shop.sqlite")).await.expect("store");
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL)").execute(store.pool()).await.expect("t");
    let handler = |mut tx: Tx<sqlx::Sqlite>, e: StreamEntry| async move {
        sqlx::query("INSERT INTO ledger VALUES (?)")
            .bind(id(&e))
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
    exercise(&url, "inbox-sqlite", store.inbox(DAY), handler, effects).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_postgres() {
    let Some(url) = common::url() else { return };
    let Some(pg) = idem_testkit::service::require(
        "PostgreSQL",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ) else {
        return;
    };
    let schema = fresh_sql_name("idem_redis_modes");
    let _drop =
        DropSql { url: pg.clone(), sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
    let store =
        PostgresStore::connect(&pg).await.expect("pg").with_schema(&schema).expect("schema");
    store.migrate().await.expect("migrate");
    let ledger = format!("\"{schema}\".ledger");
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE {ledger} (k TEXT NOT NULL)")))
        .execute(store.pool())
        .await
        .expect("table");
    let insert = format!("INSERT INTO {ledger} VALUES ($1)");
    let handler = |mut tx: Tx<sqlx::Postgres>, e: StreamEntry| {
        let insert = insert.clone();
        async move {
            sqlx::query(AssertSqlSafe(insert))
                .bind(id(&e))
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
    exercise(&url, "inbox-postgres", store.inbox(DAY), handler, effects).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_mysql() {
    let Some(url) = common::url() else { return };
    let Some(my) = idem_testkit::service::require(
        "MySQL",
        "IDEM_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    ) else {
        return;
    };
    let table = fresh_sql_name("idem_redis_modes");
    let _drop = DropSql {
        url: my.clone(),
        sql: format!("DROP TABLE IF EXISTS `{table}`, `{table}_ledger`"),
    };
    let store = MySqlStore::connect(&my).await.expect("mysql");
    let store = store.with_table_name(&table).expect("table name");
    store.migrate().await.expect("migrate");
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL)")))
        .execute(store.pool())
        .await
        .expect("ledger");
    let insert = format!("INSERT INTO `{table}_ledger` VALUES (?)");
    let handler = |mut tx: Tx<sqlx::MySql>, e: StreamEntry| {
        let insert = insert.clone();
        async move {
            sqlx::query(AssertSqlSafe(insert))
                .bind(id(&e))
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
    exercise(&url, "inbox-mysql", store.inbox(DAY), handler, effects).await;
}
