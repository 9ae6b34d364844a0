//! Inbox mode on the real server: a custom key extractor, in-batch duplicates, failures that
//! roll back alone, and messages without a key.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use common::{Env, header, nats_url, wait_for};
use idem_core::consumer::HandlerError;
use idem_core::extract::{Envelope, Header};
use idem_nats::{InboxConsumer, Report, Settings, headers};
use idem_sqlx::SqliteStore;

async fn publish(env: &Env, order: Option<&str>, body: &str) {
    let mut h = HeaderMap::new();
    if let Some(o) = order {
        h.insert("Order-Id", o);
    }
    env.js
        .publish_with_headers(format!("{}.m", env.subject), h, body.to_owned().into())
        .await
        .expect("publish")
        .await
        .expect("ack");
}

#[tokio::test]
async fn inbox_batches_commit_together_and_failures_roll_back_alone() {
    let Some(url) = nats_url() else { return };
    let env = Env::new(&url).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("inbox.sqlite")).await.expect("store");
    sqlx::query("CREATE TABLE effects (k TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("table");
    let pull = env.consumer("inbox", Duration::from_secs(30), 4).await;
    let inbox = InboxConsumer::new(
        env.js.clone(),
        pull,
        &store,
        "inbox",
        Duration::from_secs(86_400),
        Settings::new(&env.dlq_subject).retry_delay(Duration::from_millis(50)),
    )
    .await
    .expect("inbox")
    .with_key(Header::new("order-id")); // the key is a business header, not Nats-Msg-Id

    publish(&env, Some("o-1"), r#"{"n":1}"#).await;
    publish(&env, Some("o-1"), r#"{"n":1}"#).await; // same key in the same batch
    publish(&env, Some("o-2"), r#"{"n":2}"#).await; // fails once (transient)
    publish(&env, Some("o-3"), r#"{"n":3}"#).await; // fails permanently
    publish(&env, None, r#"{"n":4}"#).await; // no key: dead-lettered
    publish(&env, Some("o-5"), r#"{"n":5}"#).await;

    let tries = AtomicU32::new(0);
    let mut total = Report::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while total.acked < 4 || total.dead_lettered < 2 {
        assert!(tokio::time::Instant::now() < deadline, "not settled: {total}");
        let batch = inbox.fetch().await.expect("fetch");
        let v = inbox
            .process(&batch, |conn, d| {
                let k = d.header("order-id").unwrap_or_default().to_owned();
                let attempt = if k == "o-2" { tries.fetch_add(1, Ordering::SeqCst) } else { 0 };
                Box::pin(async move {
                    // The write happens before the failure: the savepoint must undo it.
                    sqlx::query("INSERT INTO effects (k) VALUES (?)")
                        .bind(&k)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| HandlerError::Transient(e.to_string()))?;
                    match k.as_str() {
                        "o-2" if attempt == 0 => Err(HandlerError::Transient("db busy".to_owned())),
                        "o-3" => Err(HandlerError::Permanent("no such product".to_owned())),
                        _ => Ok(k),
                    }
                })
            })
            .await;
        total += inbox.settle(batch, v).await;
    }
    assert_eq!((total.processed, total.duplicates, total.acked), (3, 1, 4), "{total}");
    assert_eq!(total.dead_lettered, 2, "{total}");
    let effects: Vec<String> = sqlx::query_scalar("SELECT k FROM effects ORDER BY k")
        .fetch_all(store.pool())
        .await
        .expect("effects");
    assert_eq!(effects, ["o-1", "o-2", "o-5"], "a failed message's writes were kept");

    let dl = env.dead_letters().await;
    let reasons: Vec<&str> = dl.iter().filter_map(|m| header(m, headers::REASON)).collect();
    assert!(reasons.contains(&"handler failed: no such product"), "{reasons:?}");
    assert!(reasons.iter().any(|r| r.contains("no dedup key")), "{reasons:?}");
    wait_for("nothing pending", Duration::from_secs(5), || async {
        env.pending("inbox").await == (0, 0)
    })
    .await;
    env.cleanup().await;
}

#[tokio::test]
async fn inbox_run_commits_then_acks_until_shutdown() {
    let Some(url) = nats_url() else { return };
    let env = Env::new(&url).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path().join("run.sqlite")).await.expect("store");
    sqlx::query("CREATE TABLE effects (k TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .expect("table");
    let pull = env.consumer("inbox-run", Duration::from_secs(30), 4).await;
    let inbox = InboxConsumer::new(
        env.js.clone(),
        pull,
        &store,
        "inbox-run",
        Duration::from_secs(86_400),
        Settings::new(&env.dlq_subject).batch(8).idle_wait(Duration::from_millis(100)),
    )
    .await
    .expect("inbox");
    for i in 0..30 {
        publish(&env, Some(&format!("k-{}", i % 20)), &format!(r#"{{"k":{}}}"#, i % 20)).await;
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        let inbox = inbox.with_key(Header::new("Order-Id"));
        inbox
            .run(
                |conn, d| {
                    let k = d.header("order-id").unwrap_or_default().to_owned();
                    Box::pin(async move {
                        sqlx::query("INSERT INTO effects (k) VALUES (?)")
                            .bind(k)
                            .execute(&mut *conn)
                            .await
                            .map_err(|e| HandlerError::Transient(e.to_string()))?;
                        Ok::<_, HandlerError<String>>(())
                    })
                },
                async {
                    let _ = stopped.await;
                },
            )
            .await
    });
    wait_for("all acked", Duration::from_secs(10), || async {
        env.pending("inbox-run").await == (0, 0)
    })
    .await;
    stop.send(()).expect("stop");
    let report = run.await.expect("join").expect("run");
    assert_eq!((report.processed, report.duplicates, report.acked), (20, 10, 30), "{report}");
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM effects")
        .fetch_one(store.pool())
        .await
        .expect("n");
    assert_eq!(rows, 20);
    env.cleanup().await;
}
