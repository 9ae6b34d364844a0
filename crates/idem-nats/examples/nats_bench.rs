//! Messages/s end to end through the JetStream adapter, beside the same fetch-and-ack loop with
//! no dedup at all, measured in one run on one stream (each mode reads it with its own durable
//! consumer).
//!
//! `cargo run --release -p idem-nats --example nats_bench -- [messages] [batch] [in flight]`
//! (server from `IDEM_TEST_NATS_URL`, default `127.0.0.1:4222`; PostgreSQL from
//! `IDEM_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`, in a schema of
//! its own that is dropped at the end; MariaDB from `IDEM_TEST_MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`, in a table of its own — rows of a server that is down
//! are left out).
//!
//! Beside each inbox, the *bare durable loop* on the same database: the program a user would
//! write without idem (fetch a batch, `BEGIN`, one multi-row `INSERT … ON CONFLICT DO NOTHING`
//! of its message ids, `COMMIT`, ack), pipelined as the adapter's lanes are (the fetch of batch
//! k + 1 and the acks of batch k − 1 overlap batch k's transaction). `IDEM_BENCH_PIPELINE=0`
//! turns pipelining off on both sides.

use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, stream};
use futures_util::StreamExt;
use idem_core::consumer::Builder;
use idem_core::engine::HandlerError;
use idem_core::{Backend, MemoryStore};
use idem_nats::{JetStreamConfig, JetStreamConsumer};
use idem_sqlx::{MySqlStore, PostgresStore, SqliteStore};
use idem_testkit::bare::{BareBroker, BareMarks, durable_lane, pipelined};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgPool, PgPoolOptions};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(20_000);
    let batch: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(64);
    // Batches in flight at once, for the ack-only loop and the adapter alike.
    let lanes: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1);
    let url = std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = async_nats::connect(&url).await?;
    let js = jetstream::new(client.clone());
    let sfx = format!("{:08x}", rand::random::<u32>());
    let name = format!("BENCH_{sfx}");
    let dlq = format!("bench.{sfx}.dlq");
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("bench.{sfx}.in"), dlq.clone()],
        // A bounded age: the consumer refuses a stream that keeps messages for ever.
        max_age: Duration::from_secs(3600),
        ..Default::default()
    })
    .await?;
    let version = client.server_info().version;
    println!("NATS {version}; {n} messages, batch {batch}, {lanes} batch(es) in flight");

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
    let my = mysql(&sfx).await?;
    let mut modes = vec!["ack-only", "two-phase MemoryStore", "two-phase SqliteStore"];
    if pg.is_some() {
        modes.push("two-phase PostgresStore");
    }
    modes.extend(["inbox SQLite", "bare durable SQLite"]);
    if pg.is_some() {
        modes.extend(["inbox PostgreSQL", "bare durable PostgreSQL"]);
    }
    if my.is_some() {
        modes.extend(["inbox MySQL", "bare durable MySQL"]);
    }
    modes.push("ack-only (again)");
    // IDEM_BENCH_MODES=inbox,two-phase Post… keeps the modes whose names contain one of these
    // (for profiling one path); the ack-only rows stay, as the baseline.
    if let Ok(only) = std::env::var("IDEM_BENCH_MODES") {
        let only: Vec<&str> = only.split(',').collect();
        modes.retain(|m| m.starts_with("ack-only") || only.iter().any(|o| m.contains(o)));
    }
    for (i, mode) in modes.into_iter().enumerate() {
        let consumer = new_consumer(&js, &name, &sfx, &format!("bench{i}")).await?;
        let config = JetStreamConfig::new(js.clone(), consumer.clone(), &dlq);
        let t = Instant::now();
        let done = match mode {
            "ack-only" | "ack-only (again)" => {
                let done = std::sync::atomic::AtomicUsize::new(0);
                let loops = (0..lanes).map(|_| ack_only(&consumer, n, batch, &done));
                for r in futures_util::future::join_all(loops).await {
                    r?;
                }
                done.into_inner()
            }
            m if m.starts_with("bare durable") => {
                let marks = match m {
                    "bare durable PostgreSQL" => {
                        let (pool, schema) = pg.as_ref().ok_or("no PostgreSQL")?;
                        BareMarks::Postgres(pool.clone(), format!("{schema}_bare"))
                    }
                    "bare durable MySQL" => {
                        let (pool, table) = my.as_ref().ok_or("no MySQL")?;
                        BareMarks::MySql(pool.clone(), format!("{table}_bare"))
                    }
                    _ => {
                        let store = SqliteStore::open(dir.path().join("bare.sqlite")).await?;
                        BareMarks::Sqlite(store.pool().clone(), "bare".into())
                    }
                };
                marks.create().await?;
                let done = std::sync::atomic::AtomicUsize::new(0);
                let broker = NatsBare { consumer: &consumer, batch };
                let loops =
                    (0..lanes).map(|_| durable_lane(&broker, &marks, n, &done, pipelined()));
                let ended = futures_util::future::join_all(loops).await;
                marks.drop_table().await?;
                for r in ended {
                    r?;
                }
                done.into_inner()
            }
            "two-phase MemoryStore" => {
                driven(
                    JetStreamConsumer::builder(config).store(MemoryStore::new()),
                    lanes,
                    batch,
                    n,
                )
                .await?
            }
            "two-phase SqliteStore" => {
                let store = SqliteStore::open(dir.path().join("two-phase.sqlite")).await?;
                driven(JetStreamConsumer::builder(config).store(store), lanes, batch, n).await?
            }
            "two-phase PostgresStore" => {
                let (pool, schema) = pg.as_ref().ok_or("no PostgreSQL")?;
                let store = PostgresStore::new(pool.clone()).with_schema(&format!("{schema}_a"))?;
                store.migrate().await?;
                driven(JetStreamConsumer::builder(config).store(store), lanes, batch, n).await?
            }
            "inbox PostgreSQL" => {
                let (pool, schema) = pg.as_ref().ok_or("no PostgreSQL")?;
                let store = PostgresStore::new(pool.clone()).with_schema(&format!("{schema}_c"))?;
                store.migrate().await?;
                driven(JetStreamConsumer::builder(config).inbox(store.inbox(DAY)), lanes, batch, n)
                    .await?
            }
            "inbox MySQL" => {
                let (pool, table) = my.as_ref().ok_or("no MySQL")?;
                let store = MySqlStore::new(pool.clone()).with_table_name(table)?;
                store.migrate().await?;
                driven(JetStreamConsumer::builder(config).inbox(store.inbox(DAY)), lanes, batch, n)
                    .await?
            }
            _ => {
                let store = SqliteStore::open(dir.path().join("inbox.sqlite")).await?;
                driven(JetStreamConsumer::builder(config).inbox(store.inbox(DAY)), lanes, batch, n)
                    .await?
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
        for s in ["a", "c"] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema}_{s} CASCADE"
            )))
            .execute(&pool)
            .await?;
        }
    }
    if let Some((pool, table)) = my {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS `{table}`")))
            .execute(&pool)
            .await?;
    }
    Ok(())
}

const DAY: Duration = Duration::from_secs(86_400);

/// The adapter in the mode `builder` was given (`.store(s)`: two-phase; `.inbox(i)`:
/// transactional) with a no-op handler, polled until `n` messages are acknowledged.
async fn driven<B: Backend>(
    builder: Builder<JetStreamConfig, B>,
    lanes: usize,
    batch: usize,
    n: usize,
) -> Result<usize> {
    let c = builder
        .scope("bench")
        .retain(DAY)
        .batch(batch)
        .concurrency(lanes)
        .pipeline(pipelined())
        // Short: at the end, batches still in flight wait this long for messages that never come.
        .idle_wait(Duration::from_millis(20))
        .build()
        .await?;
    let done = std::sync::atomic::AtomicUsize::new(0);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stop = std::sync::Mutex::new(Some(stop));
    let report = c
        .run(
            |_, _| {
                // Counted as handled; the run stops once every message was.
                if done.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 >= n
                    && let Some(s) = stop.lock().ok().and_then(|mut s| s.take())
                {
                    let _ = s.send(());
                }
                async { Ok::<_, HandlerError<String>>(()) }
            },
            async {
                let _ = stopped.await;
            },
        )
        .await?;
    #[allow(clippy::cast_precision_loss)]
    let mean = report.fetched as f64 / report.batches.max(1) as f64;
    println!("  ({} batches, {mean:.1} messages each)", report.batches);
    Ok(usize::try_from(report.acked)?)
}

/// A MariaDB pool and a table name for the inbox row, or `None` when the server does not
/// answer.
async fn mysql(sfx: &str) -> Result<Option<(MySqlPool, String)>> {
    let Some(url) = idem_testkit::service::require(
        "MySQL",
        "IDEM_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    ) else {
        return Ok(None);
    };
    let pool = MySqlPoolOptions::new().max_connections(16).connect(&url).await?;
    Ok(Some((pool, format!("idem_nats_bench_{sfx}"))))
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

/// The bare durable loop's broker side: the ack-only loop's fetch, one ack per message.
struct NatsBare<'a> {
    consumer: &'a PullConsumer,
    batch: usize,
}

impl BareBroker for NatsBare<'_> {
    type Msg = jetstream::Message;

    async fn fetch(&self) -> Result<Vec<jetstream::Message>> {
        let mut msgs = self.consumer.fetch().max_messages(self.batch).messages().await?;
        let mut got = Vec::with_capacity(self.batch);
        while let Some(m) = msgs.next().await {
            got.push(m?);
        }
        if got.is_empty() {
            let mut one = self
                .consumer
                .batch()
                .max_messages(1)
                .expires(Duration::from_millis(20))
                .messages()
                .await?;
            while let Some(m) = one.next().await {
                got.push(m?);
            }
        }
        Ok(got)
    }

    fn key(m: &jetstream::Message) -> String {
        let id = m.headers.as_ref().and_then(|h| h.get("Nats-Msg-Id"));
        id.map(|v| v.as_str().to_owned()).unwrap_or_default()
    }

    async fn ack(&self, msgs: Vec<jetstream::Message>) -> Result<()> {
        for r in futures_util::future::join_all(msgs.iter().map(|m| m.ack())).await {
            r?;
        }
        Ok(())
    }
}

/// The baseline: the same fetch strategy (up to `batch` pending now, else wait for one) and an
/// ack per message, with no dedup at all, until `done` (shared by the lanes) reaches `n`.
async fn ack_only(
    consumer: &PullConsumer,
    n: usize,
    batch: usize,
    done: &std::sync::atomic::AtomicUsize,
) -> Result<()> {
    use std::sync::atomic::Ordering::SeqCst;
    while done.load(SeqCst) < n {
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
        done.fetch_add(got.len(), SeqCst);
    }
    Ok(())
}
