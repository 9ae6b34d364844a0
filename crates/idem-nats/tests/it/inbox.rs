//! Inbox mode on the real server: a custom key extractor, in-batch duplicates, failures that
//! roll back alone, and messages without a key.

use crate::common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_nats::HeaderMap;
use common::{Env, header, nats_url};
use idem_core::consumer::{Report, headers};
use idem_core::engine::HandlerError;
use idem_core::extract::{Envelope, Header};
use idem_core::{Inbox, Tx};
use idem_nats::{Delivery, JetStreamConfig, JetStreamConsumer};
use idem_sqlx::{PostgresInbox, SqliteStore};
use idem_testkit::wait_for;

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
    let inbox = JetStreamConsumer::builder(
        JetStreamConfig::new(env.js.clone(), pull, &env.dlq_subject)
            .retry_delay(Duration::from_millis(50)),
    )
    .inbox(store.inbox(Duration::from_secs(86_400)))
    .scope("inbox")
    .key(Header::new("order-id")) // the key is a business header, not Nats-Msg-Id
    .build()
    .await
    .expect("inbox");

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
        total += inbox
            .poll(|mut tx, d| {
                let k = d.header("order-id").unwrap_or_default().to_owned();
                let attempt = if k == "o-2" { tries.fetch_add(1, Ordering::SeqCst) } else { 0 };
                async move {
                    // The write happens before the failure: the rollback must undo it.
                    sqlx::query("INSERT INTO effects (k) VALUES (?)")
                        .bind(&k)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| HandlerError::Transient(e.to_string()))?;
                    match k.as_str() {
                        "o-2" if attempt == 0 => Err(HandlerError::Transient("db busy".to_owned())),
                        "o-3" => Err(HandlerError::Permanent("no such product".to_owned())),
                        _ => Ok(k),
                    }
                }
            })
            .await
            .expect("poll");
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
    let inbox =
        JetStreamConsumer::builder(JetStreamConfig::new(env.js.clone(), pull, &env.dlq_subject))
            .inbox(store.inbox(Duration::from_secs(86_400)))
            .scope("inbox-run")
            .key(Header::new("Order-Id"))
            .batch(8)
            .idle_wait(Duration::from_millis(100))
            .build()
            .await
            .expect("inbox");
    for i in 0..30 {
        publish(&env, Some(&format!("k-{}", i % 20)), &format!(r#"{{"k":{}}}"#, i % 20)).await;
    }
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(async move {
        inbox
            .run(
                |mut tx, d| async move {
                    let k = d.header("order-id").unwrap_or_default().to_owned();
                    sqlx::query("INSERT INTO effects (k) VALUES (?)")
                        .bind(k)
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| HandlerError::Transient(e.to_string()))?;
                    Ok::<_, HandlerError<String>>(())
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

/// Inbox mode on PostgreSQL: two competing consumers, producer retries after JetStream's window,
/// a reused id with another body, and a consumer that commits a batch and never acks it (as if
/// it died between commit and ack). Every key's write exactly once, the unacked batch comes back
/// as duplicates, the reused id is dead-lettered, nothing pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_inbox_commits_then_acks_and_redeliveries_are_duplicates() {
    use common::{PgSchema, pg_url};
    use idem_sqlx::{PostgresInbox, PostgresStore};
    use sqlx::AssertSqlSafe;
    use sqlx::postgres::PgPoolOptions;
    use tokio::sync::watch;

    const UNIQUE: usize = 200;
    const RETRIES: usize = 50;
    let Some(url) = nats_url() else { return };
    let Some(pg) = pg_url() else { return };
    let schema = PgSchema::new(&pg, &format!("idem_nats_inbox_{}", common::suffix()));
    let pool = PgPoolOptions::new().max_connections(4).connect(&pg).await.expect("pg pool");
    let store = PostgresStore::new(pool.clone()).with_schema(&schema.name).expect("schema");
    store.migrate().await.expect("migrate");
    let ledger = format!("\"{}\".ledger", schema.name);
    // No unique constraint: a second write for one key would show as a second row.
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {ledger} (k TEXT NOT NULL, body TEXT NOT NULL, consumer TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .expect("ledger");

    let env = Env::new(&url).await;
    env.consumer("pg", Duration::from_secs(2), 10).await;
    let open = || async {
        let pull = env
            .js
            .get_stream(&env.name)
            .await
            .expect("stream")
            .get_consumer("pg")
            .await
            .expect("consumer");
        let config = JetStreamConfig::new(env.js.clone(), pull, &env.dlq_subject)
            .retry_delay(Duration::from_millis(50));
        JetStreamConsumer::builder(config)
            .inbox(store.inbox(Duration::from_secs(86_400)))
            .scope("pg-inbox")
            .batch(32)
            .idle_wait(Duration::from_millis(200))
            .build()
            .await
            .expect("pg inbox")
    };
    let body = |i: usize| format!(r#"{{"order":{i},"cents":{}}}"#, 100 + i);
    let mut last = tokio::time::Instant::now();
    for i in 0..UNIQUE {
        env.publish(&format!("o-{i}"), body(i).as_bytes()).await;
        last = tokio::time::Instant::now();
    }
    for j in 0..RETRIES {
        let i = j * (UNIQUE / RETRIES);
        env.retry(&format!("o-{i}"), body(i).as_bytes(), &mut last).await;
    }
    // The dying consumer: commits one batch, never acks it.
    let dying = open().await;
    let mut died = Report::default();
    while died.processed == 0 {
        let batch = dying.fetch().await.expect("fetch");
        let decided =
            dying.decide(batch, |tx, d| pg_write(tx, d, &ledger, "dying")).await.expect("decide");
        died = decided.report();
        drop(decided); // no settle: no ack, redelivered after ack_wait
    }
    drop(dying);
    // The reused id, with another body, from a producer reusing it after JetStream's window.
    env.retry("o-7", br#"{"order":7,"cents":999999}"#, &mut last).await;

    let (stop_tx, stop) = watch::channel(false);
    let run = |who: &'static str,
               c: JetStreamConsumer<Inbox<PostgresInbox>>,
               mut stop: watch::Receiver<bool>| {
        let ledger = ledger.clone();
        async move {
            let stopped = async move {
                let _ = stop.wait_for(|s| *s).await;
            };
            c.run(|tx, d| pg_write(tx, d, &ledger, who), stopped).await.expect("run")
        }
    };
    let b = tokio::spawn(run("b", open().await, stop.clone()));
    let c = tokio::spawn(run("c", open().await, stop));
    let count = |sql: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql)).fetch_one(&pool).await.expect("count")
        }
    };
    wait_for(
        "every key written, the dead letter, nothing pending",
        Duration::from_secs(60),
        || async {
            count(format!("SELECT COUNT(DISTINCT k) FROM {ledger}")).await == UNIQUE as i64
                && !env.dead_letters().await.is_empty()
                && env.pending("pg").await == (0, 0)
        },
    )
    .await;
    stop_tx.send(true).expect("stop");
    let mut survivors = b.await.expect("b");
    survivors += c.await.expect("c");

    assert_eq!(
        count(format!("SELECT COUNT(*) FROM {ledger}")).await,
        UNIQUE as i64,
        "a key written twice"
    );
    assert_eq!(
        count(format!("SELECT COUNT(*) FROM {ledger} WHERE consumer = 'dying'")).await,
        i64::try_from(died.processed).expect("n"),
        "the dying consumer's commit stands"
    );
    assert_eq!(survivors.processed + died.processed, UNIQUE as u64, "{survivors}");
    assert!(
        survivors.duplicates >= RETRIES as u64 + died.processed,
        "the unacked batch and the retries must end as duplicates: {survivors}"
    );
    assert_eq!(survivors.conflicts, 1, "{survivors}");
    let dl = env.dead_letters().await;
    assert_eq!(dl.len(), 1, "exactly one dead letter");
    assert_eq!(header(&dl[0], headers::ORIGINAL_MESSAGE_ID), Some("o-7"));
    assert_eq!(header(&dl[0], headers::OUTCOME), Some("conflict"));
    assert_eq!(&dl[0].payload[..], br#"{"order":7,"cents":999999}"#);
    assert_eq!(env.pending("pg").await, (0, 0));
    eprintln!("pg inbox: the dying consumer committed {died}; survivors: {survivors}");
    env.cleanup().await;
}

/// The handler's write in the PostgreSQL inbox test: one ledger row, in the batch transaction.
async fn pg_write(
    mut tx: Tx<PostgresInbox>,
    d: Delivery,
    ledger: &str,
    who: &'static str,
) -> Result<(), HandlerError<String>> {
    let sql = format!("INSERT INTO {ledger} (k, body, consumer) VALUES ($1, $2, $3)");
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(d.message_id().unwrap_or_default())
        .bind(String::from_utf8_lossy(d.payload()).into_owned())
        .bind(who)
        .execute(&mut *tx)
        .await
        .map_err(|e| HandlerError::Transient(e.to_string()))?;
    Ok(())
}
