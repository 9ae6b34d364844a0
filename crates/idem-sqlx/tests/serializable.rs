//! PostgreSQL at `SERIALIZABLE` (the connections' default, as `ALTER DATABASE … SET
//! default_transaction_isolation` would make it): the inbox and the store keep effects exact
//! while the database aborts transactions to keep them serializable, and the inbox runs an
//! aborted batch again by itself.
//!
//! A binary of its own: it counts retries with a process-global metrics recorder.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used, clippy::expect_used)] // test setup: a failure is the test failing

#[path = "it/common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::engine::HandlerError;
use idem_core::extract::Message;
use idem_core::inbox::{Inbox, Tx};
use idem_core::{Engine, OutcomeKind};
use idem_sqlx::{PostgresInbox, PostgresStore};
use idem_testkit::Harness;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const KEYS: usize = 300;
const CONSUMERS: usize = 6;

/// A pool whose every transaction is `SERIALIZABLE`.
async fn serializable_pool(url: &str) -> sqlx::PgPool {
    let opts: PgConnectOptions = url.parse().unwrap();
    let opts = opts.options([("default_transaction_isolation", "serializable")]);
    PgPoolOptions::new().max_connections(16).connect_with(opts).await.unwrap()
}

fn snapshotter() -> &'static Snapshotter {
    static SNAP: std::sync::OnceLock<Snapshotter> = std::sync::OnceLock::new();
    SNAP.get_or_init(|| {
        let recorder = DebuggingRecorder::new();
        let snap = recorder.snapshotter();
        recorder.install().expect("the only recorder of this test binary");
        snap
    })
}

/// The sum of counter `name` over its label sets.
fn counter(name: &str) -> u64 {
    snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(k, ..)| k.key().name() == name)
        .map(|(.., v)| if let DebugValue::Counter(n) = v { n } else { 0 })
        .sum()
}

/// Six consumers decide overlapping batches of 300 keys (each delivered twice, to different
/// consumers) through the PostgreSQL inbox at `SERIALIZABLE`. Each handler reads a bucket's
/// ledger rows and adds its own, and moves a shared total: the read-then-write pattern that
/// serializable snapshot isolation aborts (`40001`) at a statement or at `COMMIT`. Effects
/// are exact (one ledger row per key, the total equals the keys), every abort the engine saw
/// at its own statements was a whole-batch rerun, counted in `idem_tx_retries_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serializable_inbox_retries_aborted_batches_and_keeps_effects_exact() {
    snapshotter();
    let Some(url) = common::pg_url() else { return };
    let schema = common::unique("idem_ser");
    let _drop = common::DropSql {
        url: url.clone(),
        sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"),
    };
    let pool = serializable_pool(&url).await;
    let store = PostgresStore::new(pool.clone()).with_schema(&schema).unwrap();
    store.migrate().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{schema}\".ledger (k TEXT NOT NULL, bucket INT NOT NULL); \
         CREATE TABLE \"{schema}\".totals (id INT PRIMARY KEY, n BIGINT NOT NULL); \
         INSERT INTO \"{schema}\".totals VALUES (0, 0), (1, 0), (2, 0), (3, 0)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let on_serializable: Engine<Inbox<PostgresInbox>> =
        Engine::builder(Inbox::new(store.inbox(Duration::from_secs(86_400))))
            .scope("serializable")
            .build()
            .unwrap();

    // Every key twice, the copies to different consumers, in batches of 8.
    let mut deliveries: Vec<usize> = (0..KEYS).chain(0..KEYS).collect();
    deliveries.sort_by_key(|i| (i * 7919) % (2 * KEYS));
    let queue = Arc::new(Mutex::new(deliveries));
    let handler_aborts = Arc::new(Mutex::new(0_u64));
    let outcomes = Arc::new(Mutex::new(HashMap::<OutcomeKind, u64>::new()));
    let mut tasks = Vec::new();
    for _ in 0..CONSUMERS {
        let (engine, queue, schema) = (on_serializable.clone(), Arc::clone(&queue), schema.clone());
        let (aborts, outcomes) = (Arc::clone(&handler_aborts), Arc::clone(&outcomes));
        tasks.push(tokio::spawn(async move {
            loop {
                let mut batch: Vec<Message> = {
                    let mut q = queue.lock().unwrap();
                    let n = q.len().min(8);
                    q.drain(..n)
                        .map(|i| {
                            Message::new(format!(r#"{{"k":{i}}}"#))
                                .with_message_id(format!("k-{i}"))
                        })
                        .collect()
                };
                if batch.is_empty() {
                    return;
                }
                // A transient failure comes back, as a broker would redeliver it.
                while !batch.is_empty() {
                    let handler = |mut tx: Tx<PostgresInbox>, m: Message| {
                        let (schema, aborts) = (schema.clone(), Arc::clone(&aborts));
                        async move {
                            let k = m.message_id.clone().unwrap_or_default();
                            let bucket = i32::try_from(k.bytes().map(u32::from).sum::<u32>() % 4)
                                .unwrap_or(0);
                            let run = async {
                                let seen: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
                                    "SELECT count(*) FROM \"{schema}\".ledger WHERE bucket = $1"
                                )))
                                .bind(bucket)
                                .fetch_one(&mut *tx)
                                .await?;
                                sqlx::query(AssertSqlSafe(format!(
                                    "INSERT INTO \"{schema}\".ledger (k, bucket) VALUES ($1, $2)"
                                )))
                                .bind(&k)
                                .bind(bucket)
                                .execute(&mut *tx)
                                .await?;
                                sqlx::query(AssertSqlSafe(format!(
                                    "UPDATE \"{schema}\".totals SET n = n + 1 WHERE id = $1"
                                )))
                                .bind(i32::try_from(seen % 4).unwrap_or(0))
                                .execute(&mut *tx)
                                .await?;
                                Ok::<_, sqlx::Error>(())
                            };
                            run.await.map_err(|e| {
                                if idem_sqlx::is_serialization_failure(&e) {
                                    *aborts.lock().unwrap() += 1;
                                }
                                HandlerError::Transient(e.to_string())
                            })?;
                            Ok::<_, HandlerError<String>>(())
                        }
                    };
                    let outs = engine.decide_batch(&batch, &handler).await;
                    let mut retry = Vec::new();
                    for (m, o) in batch.into_iter().zip(outs) {
                        *outcomes.lock().unwrap().entry(o.kind()).or_default() += 1;
                        match o.kind() {
                            OutcomeKind::Processed | OutcomeKind::Duplicate => {}
                            OutcomeKind::FailedTransient | OutcomeKind::InProgressElsewhere => {
                                retry.push(m)
                            }
                            other => panic!("unexpected outcome {other}: {o:?}"),
                        }
                    }
                    batch = retry;
                }
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(180), t).await.unwrap().unwrap();
    }
    let per_key: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT k, count(*) FROM \"{schema}\".ledger GROUP BY k"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let total: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT sum(n)::BIGINT FROM \"{schema}\".totals"
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    let retries = counter("idem_tx_retries_total");
    println!(
        "outcomes {:?}; batch reruns after a serialization failure: {retries}; \
         handler statements aborted: {}",
        outcomes.lock().unwrap(),
        handler_aborts.lock().unwrap()
    );
    assert_eq!(per_key.len(), KEYS);
    assert!(per_key.iter().all(|(_, n)| *n == 1), "a key's effect twice: {per_key:?}");
    assert_eq!(total, KEYS as i64, "the totals moved once per key");
    // Seen 97 reruns and 430 aborted handler statements in one run; without the rerun (an
    // inbox that does not recognise its database's serialization failures) this is 0.
    assert!(retries > 0, "no batch was run again after a serialization failure");
}

/// The whole store contract on connections whose default isolation is `SERIALIZABLE`: each
/// store statement commits on its own, so the database may abort one (`40001`). A claim then
/// decides again (its aborted upsert changed nothing: `concurrent_claims_have_one_winner` once
/// failed CI on such an abort answered to the caller); other operations answer a retryable
/// error, never a wrong one.
mod store_contract {
    use super::*;

    idem_testkit::dedup_store_conformance!(server: || async {
        let url = common::pg_url()?;
        let schema = common::unique("idem_ser_conf");
        let skew = idem_core::time::ClockSkew::new();
        let store = PostgresStore::new(serializable_pool(&url).await)
            .with_schema(&schema)
            .expect("valid schema")
            .with_clock_skew(skew.clone());
        store.migrate().await.expect("migrate");
        let guard = common::DropSql { url, sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
        Some(Harness::new(store, skew, Duration::from_secs(10)).with_guard(guard))
    });
}
