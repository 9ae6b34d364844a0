//! Every mode through the same builder calls, on a real Kafka-protocol broker (tansu):
//! two-phase over a store, and the transactional inbox on SQLite, PostgreSQL and MariaDB. Each
//! run: 20 orders, 5 producer duplicates, one id reused with another body, over 2 partitions.
//! Each order's effect exactly once, the reused id dead-lettered, the commits at the end.
#![allow(clippy::unwrap_used)]

mod common;

use std::future::Future;
use std::time::Duration;

use common::Topics;
use idem_core::consumer::HandlerError;
use idem_core::extract::Envelope;
use idem_core::{Backend, Consumer};
use idem_kafka::{Delivery, Kafka, KafkaConsumer};
use idem_sqlx::{MySqlStore, SqliteStore, Tx};
use sqlx::AssertSqlSafe;

const ORDERS: usize = 20;
const LIMIT: Duration = Duration::from_secs(60);

/// Produces the workload to a topic of its own, runs a consumer over `backend` with `handler`
/// until the commits reach the end, then checks the effects (`effects()`: distinct keys, rows)
/// and the dead letter.
async fn exercise<B, H, Fut, C, CFut>(brokers: &str, name: &str, backend: B, handler: H, effects: C)
where
    B: Backend,
    H: Fn(B::Ctx, Delivery) -> Fut + Sync,
    Fut: Future<Output = Result<(), HandlerError<String>>> + Send,
    C: Fn() -> CFut,
    CFut: Future<Output = (i64, i64)>,
{
    let sfx = common::suffix();
    let (topic, dlq, group) =
        (format!("idem-{name}-{sfx}"), format!("idem-{name}-{sfx}-dlq"), format!("g-{sfx}"));
    let _topics = Topics::create(brokers, &[(&topic, 2), (&dlq, 1)]).await;
    let body = |i: usize| format!(r#"{{"order":{i}}}"#).into_bytes();
    let mut recs: Vec<(String, Vec<u8>)> =
        (0..ORDERS).map(|i| (format!("o-{i}"), body(i))).collect();
    for i in 0..5 {
        recs.push((format!("o-{i}"), body(i)));
    }
    recs.push(("o-7".to_owned(), br#"{"order":"other"}"#.to_vec()));
    let ends = common::produce(&common::producer(brokers), &topic, &recs, None).await;
    // The same calls whatever the backend: the broker side, the store or inbox, the scope.
    let consumer = KafkaConsumer::builder(Kafka::new(
        &common::config(brokers, &group),
        &[topic.as_str()],
        &dlq,
    ))
    .engine(Consumer::builder(backend).scope(name).build().unwrap())
    .batch(8)
    .idle_wait(Duration::from_millis(200))
    .build()
    .await
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = consumer.run(&handler, async {
        let _ = stopped.await;
    });
    let watch = async {
        common::eventually(LIMIT, "every partition committed to its end", || async {
            let got = common::committed(brokers, &group, &topic, 2).await;
            (got.len() == ends.len() && got.iter().all(|(p, o)| ends.get(p) == Some(o)))
                .then_some(())
        })
        .await;
        stop.send(()).unwrap();
    };
    let (report, ()) = tokio::join!(run, watch);
    let report = report.unwrap();
    assert_eq!(effects().await, (ORDERS as i64, ORDERS as i64), "{name}: an effect ran twice");
    assert_eq!(report.processed, ORDERS as u64, "{name}: {report}");
    assert!(report.duplicates >= 5, "{name}: {report}");
    assert!(report.conflicts >= 1 && report.dead_lettered >= 1, "{name}: {report}");
    let dead = common::read_all(brokers, &dlq, 1).await;
    assert_eq!(dead[0].1["message-id"], "o-7");
    assert_eq!(dead[0].1["idem-outcome"], "conflict");
}

fn id(d: &Delivery) -> String {
    d.message_id().unwrap_or_default().to_owned()
}

fn transient(e: sqlx::Error) -> HandlerError<String> {
    HandlerError::Transient(e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_on_a_store() {
    let Some(brokers) = common::brokers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
    let ledger = sqlx::SqlitePool::connect(&format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("ledger.sqlite").display()
    ))
    .await
    .unwrap();
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL)").execute(&ledger).await.unwrap();
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
            .unwrap()
    };
    exercise(&brokers, "two-phase", store, handler, effects).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_sqlite() {
    let Some(brokers) = common::brokers() else { return };
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("shop.sqlite")).await.unwrap();
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL)").execute(store.pool()).await.unwrap();
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
            .unwrap()
    };
    exercise(&brokers, "inbox-sqlite", store.inbox(Duration::from_secs(86_400)), handler, effects)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_postgres() {
    let (Some(brokers), Some(pg)) = (common::brokers(), common::pg_url()) else { return };
    let (schema, store) =
        common::PgSchema::create(&pg, format!("idem_kafka_modes_{}", common::suffix())).await;
    let ledger = format!("{}.ledger", schema.name);
    let insert = format!("INSERT INTO {ledger} (key, body, who) VALUES ($1, '', 'modes')");
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
    let count = format!("SELECT COUNT(DISTINCT key), COUNT(*) FROM {ledger}");
    let effects = || {
        let (pool, count) = (schema.pool.clone(), count.clone());
        async move { sqlx::query_as(AssertSqlSafe(count)).fetch_one(&pool).await.unwrap() }
    };
    let inbox = store.inbox(Duration::from_secs(86_400));
    exercise(&brokers, "inbox-postgres", inbox, handler, effects).await;
    schema.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_on_mysql() {
    let Some(brokers) = common::brokers() else { return };
    let Some(my) = idem_testkit::service::require(
        "MySQL",
        "IDEM_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    ) else {
        return;
    };
    let table = format!("idem_kafka_modes_{}", common::suffix());
    let store = MySqlStore::connect(&my).await.unwrap().with_table_name(&table).unwrap();
    store.migrate().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE `{table}_ledger` (k VARCHAR(64) NOT NULL)")))
        .execute(store.pool())
        .await
        .unwrap();
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
        async move { sqlx::query_as(AssertSqlSafe(count)).fetch_one(&pool).await.unwrap() }
    };
    let inbox = store.inbox(Duration::from_secs(86_400));
    exercise(&brokers, "inbox-mysql", inbox, handler, effects).await;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE `{table}`, `{table}_ledger`")))
        .execute(&pool)
        .await
        .unwrap();
}
