//! Transactional-inbox mode on SQLite and PostgreSQL (commit, then ack; a failed write, even a
//! failed SQL statement, rolls back only its own delivery), and dead-lettering that never loses
//! a message.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{Broker, PgSchema, reporter, wait_for};
use idem_amqp::{AmqpConfig, AmqpConsumer, Delivery, Topology};
use idem_core::MemoryStore;
use idem_core::Tx;
use idem_core::engine::HandlerError;
use idem_core::engine::Verb;
use idem_sqlx::{PostgresInbox, SqliteInbox, SqliteStore};
use tokio::sync::oneshot;

const LIMIT: Duration = Duration::from_secs(20);

/// What the handler does with each body once its row is written.
fn verdict(m: &Delivery) -> Result<(), HandlerError<String>> {
    match m.payload() {
        b"bad" => Err(HandlerError::Permanent("rejected by validation".to_owned())),
        b"flaky" if !m.redelivered() => Err(HandlerError::Transient("busy".to_owned())),
        _ => Ok(()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_commits_then_acks_and_rolls_back_failed_writes() {
    let Some(b) = Broker::new("inbox").await else { return };
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("inbox.sqlite")).await.unwrap();
    sqlx::query("CREATE TABLE ledger (body BLOB)").execute(store.pool()).await.unwrap();
    let (hook, mut rx) = reporter();
    let c = AmqpConsumer::builder(AmqpConfig::new(&b.conn, b.queue()))
        .inbox(store.inbox(Duration::from_secs(3600)))
        .scope("inbox")
        .on_settle(hook)
        .build()
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let handler = |mut tx: Tx<SqliteInbox>, m: Delivery| async move {
            sqlx::query("INSERT INTO ledger VALUES (?)")
                .bind(m.payload())
                .execute(&mut *tx)
                .await
                .map_err(|e| HandlerError::Transient(e.to_string()))?;
            verdict(&m)
        };
        c.run(handler, async move {
            let _ = stopped.await;
        })
        .await
    });
    b.publish(Some("a"), b"good", &[]).await;
    b.publish(Some("a"), b"good", &[]).await;
    b.publish(Some("b"), b"bad", &[]).await;
    b.publish(Some("c"), b"flaky", &[]).await;
    let mut seen = Vec::new();
    wait_for(&mut rx, &mut seen, LIMIT, |s| s.len() == 5).await;
    let by = |k: &str| -> Vec<&'static str> {
        seen.iter().filter(|s| s.key.as_deref() == Some(k)).map(|s| s.outcome).collect()
    };
    assert_eq!(by("a"), ["processed", "duplicate"]);
    assert_eq!(by("b"), ["failed_permanent"]);
    assert_eq!(by("c"), ["failed_transient", "processed"]);
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    let rows: Vec<(Vec<u8>,)> = sqlx::query_as("SELECT body FROM ledger ORDER BY body")
        .fetch_all(store.pool())
        .await
        .unwrap();
    let rows: Vec<Vec<u8>> = rows.into_iter().map(|r| r.0).collect();
    assert_eq!(rows, [b"flaky".to_vec(), b"good".to_vec()], "failed writes rolled back");
    assert_eq!(b.count(b.queue()).await, 0);
    let dlq = b.drain_dlq().await;
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].1.as_deref(), Some("handler failed: rejected by validation"));
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_inbox_commits_then_acks_and_rolls_back_failed_writes() {
    let Some(url) = idem_testkit::service::require(
        "PostgreSQL",
        "IDEM_TEST_POSTGRES_URL",
        common::PG_DEFAULT_URL,
    ) else {
        return;
    };
    let Some(b) = Broker::new("pg-inbox").await else { return };
    let (guard, store) =
        PgSchema::create(&url, format!("idem_amqp_pg_inbox_{}", common::suffix())).await;
    let (pool, schema) = (guard.pool.clone(), guard.name.clone());
    guard.exec(&format!("CREATE TABLE {schema}.ledger (body BYTEA)")).await;

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
    let c = AmqpConsumer::builder(
        AmqpConfig::new(&b.conn, b.queue()).prefetch(16).batch_wait(Duration::from_millis(200)),
    )
    .inbox(store.inbox(Duration::from_secs(3600)))
    .scope("pg-inbox")
    .batch(16)
    .on_settle(hook)
    .build()
    .await
    .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let insert = format!("INSERT INTO {schema}.ledger VALUES ($1)");
    let task = tokio::spawn(async move {
        let handler = |mut tx: Tx<PostgresInbox>, m: Delivery| {
            let insert = insert.clone();
            async move {
                sqlx::query(sqlx::AssertSqlSafe(insert))
                    .bind(m.payload())
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| HandlerError::Transient(e.to_string()))?;
                if m.payload() == b"broken" {
                    // A failed statement aborts a PostgreSQL transaction until its savepoint is
                    // rolled back: the deliveries after it in the batch must still commit.
                    return sqlx::query("SELECT 1 / 0")
                        .execute(&mut *tx)
                        .await
                        .map(drop)
                        .map_err(|e| HandlerError::Permanent(format!("sql: {e}")));
                }
                verdict(&m)
            }
        };
        c.run(handler, async move {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_dead_letter_is_requeued_not_acked() {
    let Some(b) = Broker::new("unroutable").await else { return };
    // A dead-letter exchange with nothing bound: the confirmed, mandatory copy comes back.
    let topology =
        Topology::for_queue(b.queue()).with_dead_letter(format!("{}.nowhere", b.queue()), None);
    let (hook, mut rx) = reporter();
    let c = AmqpConsumer::builder(AmqpConfig::new(&b.conn, b.queue()).topology(topology.clone()))
        .store(MemoryStore::new())
        .scope("unroutable")
        .on_settle(hook)
        .build()
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        c.run(
            |_ctx, _m| async { Err::<(), _>(HandlerError::Permanent("poison".to_owned())) },
            async move {
                let _ = stopped.await;
            },
        )
        .await
    });
    b.publish(Some("p"), b"x", &[]).await;
    let mut seen = Vec::new();
    wait_for(&mut rx, &mut seen, LIMIT, |s| s.len() >= 2).await;
    assert_eq!(seen[0].verb, Verb::Retry { after: None }, "the failed copy turns into a retry");
    assert!(seen[1].redelivered, "the message came back instead of being acked away");
    assert_eq!(
        seen[1].outcome, "failed_permanent",
        "a failed record is re-claimed, not a duplicate"
    );
    stop.send(()).unwrap();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(stats.dead_lettered, 0);
    assert!(stats.retried >= 2 && stats.dead_letter_failures >= 2, "{stats:?}");
    b.wait_count(b.queue(), 1, LIMIT).await;
    let _ = b.ch.exchange_delete(topology.dead_letter_exchange().into(), Default::default()).await;
    b.cleanup().await;
}
