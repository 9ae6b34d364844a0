//! Messages/s end to end through the JetStream adapter, beside the same fetch-and-ack loop with
//! no dedup at all, measured in one run on one stream (each mode reads it with its own durable
//! consumer).
//!
//! `cargo run --release -p idem-nats --example nats_bench -- [messages] [batch]`
//! (server from `IDEM_TEST_NATS_URL`, default `127.0.0.1:4222`; PostgreSQL from
//! `IDEM_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`, in a schema of
//! its own that is dropped at the end — the PostgreSQL rows are left out when it is down).

use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;
use idem_core::consumer::HandlerError;
use idem_core::{BatchConfig, Batched, Consumer, DedupStore, MemoryStore};
use idem_nats::{InboxConsumer, JetStreamConsumer, PgInboxConsumer, Settings};
use idem_sqlx::{PostgresStore, SqliteStore};
use sqlx::postgres::{PgPool, PgPoolOptions};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(20_000);
    let batch: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(64);
    let url = std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = async_nats::connect(&url).await?;
    let js = jetstream::new(client.clone());
    let sfx = format!("{:08x}", rand::random::<u32>());
    let name = format!("BENCH_{sfx}");
    let dlq = format!("bench.{sfx}.dlq");
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("bench.{sfx}.in"), dlq.clone()],
        ..Default::default()
    })
    .await?;
    let version = client.server_info().version;
    println!("NATS {version}; {n} messages, batch {batch}");

    let t = Instant::now();
    let mut acks = Vec::with_capacity(1024);
    for i in 0..n {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", format!("m-{i}").as_str());
        let body = format!(r#"{{"order":{i},"cents":{}}}"#, 100 + i);
        acks.push(js.publish_with_headers(format!("bench.{sfx}.in"), h, body.into()).await?);
        if acks.len() == 1024 {
            for a in acks.drain(..) {
                a.await?;
            }
        }
    }
    for a in acks.drain(..) {
        a.await?;
    }
    println!("published in {:.2?}", t.elapsed());

    let mut rows = Vec::new();
    let dir = tempfile::tempdir()?;
    // The baseline runs first and last, so warm-up and machine noise show in the same table.
    let pg = postgres(&sfx).await?;
    let mut modes = vec!["ack-only", "two-phase MemoryStore", "two-phase SqliteStore"];
    if pg.is_some() {
        modes.extend(["two-phase PostgresStore", "two-phase Batched<PostgresStore>"]);
    }
    modes.push("inbox SQLite");
    if pg.is_some() {
        modes.push("inbox PostgreSQL");
    }
    modes.push("ack-only (again)");
    for (i, mode) in modes.into_iter().enumerate() {
        let consumer = new_consumer(&js, &name, &sfx, &format!("bench{i}")).await?;
        let settings = Settings::new(&dlq).batch(batch).idle_wait(Duration::from_millis(200));
        let t = Instant::now();
        let done = match mode {
            "ack-only" | "ack-only (again)" => ack_only(&consumer, n, batch).await?,
            "two-phase MemoryStore" => {
                two_phase(&js, consumer, MemoryStore::new(), settings, n).await?
            }
            "two-phase SqliteStore" => {
                let store = SqliteStore::open(dir.path().join("two-phase.sqlite")).await?;
                two_phase(&js, consumer, store, settings, n).await?
            }
            "two-phase PostgresStore" => {
                let (pool, schema) = pg.as_ref().ok_or("no PostgreSQL")?;
                let store = PostgresStore::new(pool.clone()).with_schema(&format!("{schema}_a"))?;
                store.migrate().await?;
                two_phase(&js, consumer, store, settings, n).await?
            }
            "two-phase Batched<PostgresStore>" => {
                let (pool, schema) = pg.as_ref().ok_or("no PostgreSQL")?;
                let store = PostgresStore::new(pool.clone()).with_schema(&format!("{schema}_b"))?;
                store.migrate().await?;
                let store = Batched::new(store, BatchConfig::default());
                two_phase(&js, consumer, store, settings, n).await?
            }
            "inbox PostgreSQL" => {
                let (pool, schema) = pg.as_ref().ok_or("no PostgreSQL")?;
                let store = PostgresStore::new(pool.clone()).with_schema(&format!("{schema}_c"))?;
                store.migrate().await?;
                let c = PgInboxConsumer::new(
                    js.clone(),
                    consumer,
                    &store,
                    "bench",
                    Duration::from_secs(86_400),
                    settings,
                )
                .await?;
                let mut done = 0;
                while done < n {
                    let b = c.fetch().await?;
                    let v = c
                        .process(&b, |_conn, _d| {
                            Box::pin(async { Ok::<_, HandlerError<String>>(()) })
                        })
                        .await;
                    done += usize::try_from(c.settle(b, v).await.acked)?;
                }
                done
            }
            _ => {
                let store = SqliteStore::open(dir.path().join("inbox.sqlite")).await?;
                let c = InboxConsumer::new(
                    js.clone(),
                    consumer,
                    &store,
                    "bench",
                    Duration::from_secs(86_400),
                    settings,
                )
                .await?;
                let mut done = 0;
                while done < n {
                    let b = c.fetch().await?;
                    let v = c
                        .process(&b, |_conn, _d| {
                            Box::pin(async { Ok::<_, HandlerError<String>>(()) })
                        })
                        .await;
                    done += usize::try_from(c.settle(b, v).await.acked)?;
                }
                done
            }
        };
        let secs = t.elapsed().as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let rate = done as f64 / secs;
        println!("{mode:<34} {done} msgs in {secs:>6.2} s = {rate:>8.0} msgs/s");
        rows.push((mode, rate));
    }
    let base = (rows[0].1 + rows[rows.len() - 1].1) / 2.0;
    println!("\n| mode | msgs/s | vs ack-only (mean of both runs) |\n| --- | ---: | ---: |");
    for (mode, rate) in &rows {
        println!("| {mode} | {rate:.0} | {:.2} |", rate / base);
    }
    js.delete_stream(&name).await?;
    if let Some((pool, schema)) = pg {
        for s in ["a", "b", "c"] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema}_{s} CASCADE"
            )))
            .execute(&pool)
            .await?;
        }
    }
    Ok(())
}

/// A pool on the benchmark's PostgreSQL (16 connections, as `PostgresStore::connect`) and the
/// prefix of its schemas, or `None` when the server does not answer.
async fn postgres(sfx: &str) -> Result<Option<(PgPool, String)>> {
    let Some(url) = idem_testkit::service::require(
        "PostgreSQL",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ) else {
        return Ok(None);
    };
    let pool = PgPoolOptions::new().max_connections(16).connect(&url).await?;
    let version: String = sqlx::query_scalar("SHOW server_version").fetch_one(&pool).await?;
    let sync: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&pool).await?;
    println!("PostgreSQL {version} (synchronous_commit = {sync})");
    Ok(Some((pool, format!("idem_nats_bench_{sfx}"))))
}

/// Two-phase mode over `store`: fetch, claim the batch, run the no-op handlers, record, ack.
async fn two_phase<S: DedupStore>(
    js: &jetstream::Context,
    consumer: PullConsumer,
    store: S,
    settings: Settings,
    n: usize,
) -> Result<usize> {
    let dedup = Consumer::builder(store).scope("bench").build()?;
    let c = JetStreamConsumer::new(js.clone(), consumer, dedup, settings).await?;
    let mut done = 0;
    while done < n {
        let b = c.fetch().await?;
        let v = c.process(&b, |_ctx, _d| async { Ok::<_, HandlerError<String>>(()) }).await;
        done += usize::try_from(c.settle(b, v).await.acked)?;
    }
    Ok(done)
}

async fn new_consumer(
    js: &jetstream::Context,
    stream: &str,
    sfx: &str,
    durable: &str,
) -> Result<PullConsumer> {
    let durable = durable.to_owned();
    Ok(js
        .get_stream(stream)
        .await?
        .create_consumer(pull::Config {
            durable_name: Some(durable),
            filter_subject: format!("bench.{sfx}.in"),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_deliver: 5,
            ..Default::default()
        })
        .await?)
}

/// The baseline: the same fetch strategy (up to `batch` pending now, else wait for one) and an
/// ack per message, with no dedup at all.
async fn ack_only(consumer: &PullConsumer, n: usize, batch: usize) -> Result<usize> {
    let mut done = 0;
    while done < n {
        let mut msgs = consumer.fetch().max_messages(batch).messages().await?;
        let mut got = Vec::with_capacity(batch);
        while let Some(m) = msgs.next().await {
            got.push(m?);
        }
        if got.is_empty() {
            let mut one = consumer
                .batch()
                .max_messages(1)
                .expires(Duration::from_millis(200))
                .messages()
                .await?;
            while let Some(m) = one.next().await {
                got.push(m?);
            }
        }
        let acks = got.iter().map(|m| m.ack());
        for r in futures_util::future::join_all(acks).await {
            r?;
        }
        done += got.len();
    }
    Ok(done)
}
