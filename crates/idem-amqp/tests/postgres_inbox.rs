//! Transactional-inbox mode on PostgreSQL (`run_postgres_inbox`): commit, then ack; a failed
//! write, even a failed SQL statement, rolls back only its own delivery.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Broker, PgSchema, reporter, wait_for};
use idem_amqp::{AmqpConsumer, AmqpMessage};
use idem_core::Consumer;
use idem_core::consumer::HandlerError;
use idem_sqlx::postgres::PgWrites;
use sqlx::postgres::{PgConnection, PgPoolOptions};
use tokio::sync::oneshot;

const LIMIT: Duration = Duration::from_secs(20);

fn write(conn: &mut PgConnection, m: AmqpMessage) -> PgWrites<'_, (), HandlerError<String>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO ledger VALUES ($1)")
            .bind(m.payload())
            .execute(&mut *conn)
            .await
            .map_err(|e| HandlerError::Transient(e.to_string()))?;
        match m.payload() {
            b"bad" => Err(HandlerError::Permanent("rejected by validation".to_owned())),
            b"flaky" if !m.redelivered() => Err(HandlerError::Transient("busy".to_owned())),
            // A failed statement aborts a PostgreSQL transaction until its savepoint is rolled
            // back: the deliveries after it in the batch must still commit.
            b"broken" => sqlx::query("SELECT 1 / 0")
                .execute(&mut *conn)
                .await
                .map(drop)
                .map_err(|e| HandlerError::Permanent(format!("sql: {e}"))),
            _ => Ok(()),
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_inbox_commits_then_acks_and_rolls_back_failed_writes() {
    let Some(url) = idem_testkit::service::require(
        "PostgreSQL",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ) else {
        return;
    };
    let Some(b) = Broker::new("pg-inbox").await else { return };
    let (guard, store) =
        PgSchema::create(&url, format!("idem_amqp_pg_inbox_{}", std::process::id())).await;
    let (pool, schema) = (guard.pool.clone(), guard.name.clone());
    guard.exec(&format!("CREATE TABLE {schema}.ledger (body BYTEA)")).await;
    // The writes name `ledger` unqualified: the inbox connections look in the test's schema.
    let writes_pool = PgPoolOptions::new()
        .max_connections(2)
        .after_connect({
            let schema = schema.clone();
            move |conn, _| {
                let sql = format!("SET search_path TO {schema}");
                Box::pin(async move {
                    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(conn).await.map(drop)
                })
            }
        })
        .connect(&url)
        .await
        .unwrap();

    // Published before the consumer starts, so they arrive together as one batch.
    for (id, body) in [
        ("a", &b"good"[..]),
        ("a", b"good"),
        ("b", b"bad"),
        ("c", b"flaky"),
        ("d", b"broken"),
        ("e", b"after"),
        ("a", b"reused"),
    ] {
        b.publish(Some(id), body, &[]).await;
    }
    let (hook, mut rx) = reporter();
    let engine = Consumer::builder(store.clone()).scope("pg-inbox").build().unwrap();
    let c = AmqpConsumer::builder(engine, b.queue())
        .prefetch(16)
        .batch(16, Duration::from_millis(200))
        .on_settle(hook)
        .connect(&b.conn)
        .await
        .unwrap();
    let inbox = store.inbox(Duration::from_secs(3600));
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        c.run_postgres_inbox(&inbox, &writes_pool, write, async move {
            let _ = stopped.await;
        })
        .await
    });
    let mut seen = Vec::new();
    wait_for(&mut rx, &mut seen, LIMIT, |s| s.len() == 8).await;
    let by = |k: &str| -> Vec<&'static str> {
        seen.iter().filter(|s| s.key.as_deref() == Some(k)).map(|s| s.outcome).collect()
    };
    assert_eq!(by("a"), ["processed", "duplicate", "conflict"], "{seen:#?}");
    assert_eq!(by("b"), ["failed_permanent"]);
    assert_eq!(by("c"), ["failed_transient", "processed"]);
    assert_eq!(by("d"), ["failed_permanent"]);
    assert_eq!(by("e"), ["processed"], "the delivery after the failed statement commits");
    stop.send(()).unwrap();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(stats.dead_lettered, 3, "{stats:?}");

    let rows: Vec<(Vec<u8>,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT body FROM {schema}.ledger ORDER BY body"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let rows: Vec<Vec<u8>> = rows.into_iter().map(|r| r.0).collect();
    assert_eq!(
        rows,
        [b"after".to_vec(), b"flaky".to_vec(), b"good".to_vec()],
        "failed writes rolled back"
    );
    assert_eq!(b.count(b.queue()).await, 0);
    let mut dlq: Vec<(Option<String>, Option<String>)> =
        b.drain_dlq().await.into_iter().map(|(id, reason, _)| (id, reason)).collect();
    dlq.sort();
    assert_eq!(dlq.len(), 3, "{dlq:?}");
    assert!(dlq[0].1.as_deref().unwrap().starts_with("conflict: key pg-inbox/a reused"), "{dlq:?}");
    assert_eq!(dlq[1].1.as_deref(), Some("handler failed: rejected by validation"));
    assert!(dlq[2].1.as_deref().unwrap().starts_with("handler failed: sql: "), "{dlq:?}");
    b.cleanup().await;
    guard.drop_now().await;
}
