//! Transactional-inbox mode, and dead-lettering that never loses a message.
#![cfg(feature = "sqlite")]
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{Broker, reporter, wait_for};
use idem_amqp::{Action, AmqpConsumer, AmqpMessage, Topology};
use idem_core::consumer::HandlerError;
use idem_core::{Consumer, MemoryStore};
use idem_sqlx::{SqliteStore, Writes};
use sqlx::sqlite::SqliteConnection;
use tokio::sync::oneshot;

const LIMIT: Duration = Duration::from_secs(20);

fn write(conn: &mut SqliteConnection, m: AmqpMessage) -> Writes<'_, (), HandlerError<String>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO ledger VALUES (?)")
            .bind(m.payload())
            .execute(&mut *conn)
            .await
            .map_err(|e| HandlerError::Transient(e.to_string()))?;
        match m.payload() {
            b"bad" => Err(HandlerError::Permanent("rejected by validation".to_owned())),
            b"flaky" if !m.redelivered() => Err(HandlerError::Transient("busy".to_owned())),
            _ => Ok(()),
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_commits_then_acks_and_rolls_back_failed_writes() {
    let Some(b) = Broker::new("inbox").await else { return };
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("inbox.sqlite")).await.unwrap();
    sqlx::query("CREATE TABLE ledger (body BLOB)").execute(store.pool()).await.unwrap();
    let (hook, mut rx) = reporter();
    let engine = Consumer::builder(store.clone()).scope("inbox").build().unwrap();
    let c =
        AmqpConsumer::builder(engine, b.queue()).on_settle(hook).connect(&b.conn).await.unwrap();
    let inbox = store.inbox(Duration::from_secs(3600));
    let (stop, stopped) = oneshot::channel::<()>();
    let pool = store.pool().clone();
    let task = tokio::spawn(async move {
        c.run_inbox(&inbox, &pool, write, async move {
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
async fn an_unroutable_dead_letter_is_requeued_not_acked() {
    let Some(b) = Broker::new("unroutable").await else { return };
    // A dead-letter exchange with nothing bound: the confirmed, mandatory copy comes back.
    let topology =
        Topology::for_queue(b.queue()).with_dead_letter(format!("{}.nowhere", b.queue()), None);
    let (hook, mut rx) = reporter();
    let engine = Consumer::builder(MemoryStore::new()).scope("unroutable").build().unwrap();
    let c = AmqpConsumer::builder(engine, b.queue())
        .topology(topology.clone())
        .on_settle(hook)
        .connect(&b.conn)
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(c.run(
        |_ctx, _m| async { Err::<(), _>(HandlerError::Permanent("poison".to_owned())) },
        async move {
            let _ = stopped.await;
        },
    ));
    b.publish(Some("p"), b"x", &[]).await;
    let mut seen = Vec::new();
    wait_for(&mut rx, &mut seen, LIMIT, |s| s.len() >= 2).await;
    assert!(matches!(seen[0].action, Action::DeadLetter { .. }));
    assert!(seen[1].redelivered, "the message came back instead of being acked away");
    assert_eq!(
        seen[1].outcome, "failed_permanent",
        "a failed record is re-claimed, not a duplicate"
    );
    stop.send(()).unwrap();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(stats.dead_lettered, 0);
    assert!(stats.requeued >= 2, "{stats:?}");
    b.wait_count(b.queue(), 1, LIMIT).await;
    let _ = b.ch.exchange_delete(topology.dead_letter_exchange().into(), Default::default()).await;
    b.cleanup().await;
}
