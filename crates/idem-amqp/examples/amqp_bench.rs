//! Messages/s end to end through the RabbitMQ adapter, beside a bare lapin loop (same prefetch,
//! same batches, acks sent together, no dedup), measured in one run.
//!
//! `cargo run --release -p idem-amqp --example amqp_bench -- [messages] [batch] [in flight]`
//!
//! For each mode a fresh queue is filled with N unique messages (publishing is not timed),
//! then the clock runs until every message is acknowledged. The handler does nothing, so the
//! figures are the price of the broker round trips and of idempotency. The prefetch is twice
//! the batch per batch in flight. Broker: `IDEM_TEST_AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`); PostgreSQL: `IDEM_TEST_POSTGRES_URL`, in a schema
//! of its own dropped at the end; MariaDB: `IDEM_TEST_MYSQL_URL`, in a table of its own (rows of
//! a server that is down are left out).
//!
//! Beside each inbox, the *bare durable loop* on the same database: what a user would write
//! without idem (a batch, `BEGIN`, one multi-row `INSERT … ON CONFLICT DO NOTHING` of its
//! message ids, `COMMIT`, the batch's acks), pipelined as the adapter's lanes are.
//! `IDEM_BENCH_PIPELINE=0` turns pipelining off on both sides.

use std::time::{Duration, Instant};

use futures_util::{FutureExt, StreamExt};
use idem_amqp::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idem_amqp::lapin::types::FieldTable;
use idem_amqp::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idem_amqp::{AmqpConfig, AmqpConsumer, Topology};
use idem_core::consumer::Builder;
use idem_core::engine::HandlerError;
use idem_core::{Backend, MemoryStore};
use idem_sqlx::{MySqlStore, PostgresStore, SqliteStore};
use idem_testkit::bare::{BareBroker, BareMarks, durable_lane, pipelined};
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgPool, PgPoolOptions};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const DAY: Duration = Duration::from_secs(86_400);

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(10_000);
    let batch: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(64);
    let lanes: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1);
    let prefetch = u16::try_from(3 * batch * lanes).unwrap_or(u16::MAX);
    let url = std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let sfx = format!("{:08x}", rand::random::<u32>());
    println!(
        "RabbitMQ; {n} messages, batch {batch}, {lanes} batch(es) in flight, prefetch {prefetch}"
    );

    let dir = tempfile::tempdir()?;
    let pg = postgres(&sfx).await?;
    let my = mysql(&sfx).await?;
    // The baseline runs first and last, so warm-up and machine noise show in the same table.
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
    if let Ok(only) = std::env::var("IDEM_BENCH_MODES") {
        let only: Vec<&str> = only.split(',').collect();
        modes.retain(|m| m.starts_with("ack-only") || only.iter().any(|o| m.contains(o)));
    }
    let mut rows = Vec::new();
    for mode in modes {
        let queue = fill(&ch, n).await?;
        let config = AmqpConfig::new(&conn, &queue).prefetch(prefetch);
        let run = Run { batch, lanes, n };
        let t = Instant::now();
        let done = match mode {
            "ack-only" | "ack-only (again)" => ack_only(&conn, &queue, n, batch, prefetch).await?,
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
                bare_durable(&conn, &queue, &marks, &run, prefetch).await?
            }
            "two-phase MemoryStore" => {
                run.driven(AmqpConsumer::builder(config).store(MemoryStore::new())).await?
            }
            "two-phase SqliteStore" => {
                let store = SqliteStore::open(dir.path().join("two-phase.sqlite")).await?;
                run.driven(AmqpConsumer::builder(config).store(store)).await?
            }
            "two-phase PostgresStore" => {
                let (pool, schema) = pg.as_ref().ok_or("no PostgreSQL")?;
                let store = PostgresStore::new(pool.clone()).with_schema(&format!("{schema}_a"))?;
                store.migrate().await?;
                run.driven(AmqpConsumer::builder(config).store(store)).await?
            }
            "inbox PostgreSQL" => {
                let (pool, schema) = pg.as_ref().ok_or("no PostgreSQL")?;
                let store = PostgresStore::new(pool.clone()).with_schema(&format!("{schema}_c"))?;
                store.migrate().await?;
                run.driven(AmqpConsumer::builder(config).inbox(store.inbox(DAY))).await?
            }
            "inbox MySQL" => {
                let (pool, table) = my.as_ref().ok_or("no MySQL")?;
                let store = MySqlStore::new(pool.clone()).with_table_name(table)?;
                store.migrate().await?;
                run.driven(AmqpConsumer::builder(config).inbox(store.inbox(DAY))).await?
            }
            _ => {
                let store = SqliteStore::open(dir.path().join("inbox.sqlite")).await?;
                run.driven(AmqpConsumer::builder(config).inbox(store.inbox(DAY))).await?
            }
        };
        let secs = t.elapsed().as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let rate = done as f64 / secs;
        println!("{mode:<34} {done} msgs in {secs:>6.2} s = {rate:>8.0} msgs/s");
        rows.push((mode, rate));
        cleanup(&ch, &queue).await;
    }
    let base = (rows[0].1 + rows[rows.len() - 1].1) / 2.0;
    println!("\n| mode | msgs/s | vs ack-only (mean of both runs) |\n| --- | ---: | ---: |");
    for (mode, rate) in &rows {
        println!("| {mode} | {rate:.0} | {:.2} |", rate / base);
    }
    if let Some((pool, schema)) = pg {
        for s in ["a", "c"] {
            let sql = format!("DROP SCHEMA IF EXISTS {schema}_{s} CASCADE");
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pool).await?;
        }
    }
    if let Some((pool, table)) = my {
        let sql = format!("DROP TABLE IF EXISTS `{table}`");
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pool).await?;
    }
    conn.close(200, "".into()).await?;
    Ok(())
}

struct Run {
    batch: usize,
    lanes: usize,
    n: usize,
}

impl Run {
    /// The adapter in the mode `builder` was given (`.store(s)`: two-phase; `.inbox(i)`:
    /// transactional) with a no-op handler, until `n` messages are acknowledged.
    async fn driven<B: Backend>(&self, builder: Builder<AmqpConfig<'_>, B>) -> Result<usize> {
        let c = builder
            .scope("bench")
            .retain(DAY)
            .batch(self.batch)
            .concurrency(self.lanes)
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
                    if done.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 >= self.n
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
}

/// A fresh durable queue holding `n` unique persistent messages (publisher confirms awaited).
async fn fill(ch: &Channel, n: usize) -> Result<String> {
    let queue = format!("idem-bench-{:016x}", rand::random::<u64>());
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await?;
    let mut confirms = Vec::new();
    for i in 0..n {
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(format!("m-{i}").into());
        let body = format!(r#"{{"order":{i},"cents":1200}}"#);
        confirms.push(
            ch.basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await?,
        );
        if confirms.len() == 1000 {
            for c in confirms.drain(..) {
                c.await?;
            }
        }
    }
    for c in confirms {
        c.await?;
    }
    Ok(queue)
}

/// The baseline: the same prefetch, batches of what has arrived (up to `batch`, waiting for
/// the first), the batch's acks sent together; no dedup.
async fn ack_only(
    conn: &Connection,
    queue: &str,
    n: usize,
    batch: usize,
    prefetch: u16,
) -> Result<usize> {
    let ch = conn.create_channel().await?;
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let mut stream = ch
        .basic_consume(
            queue.into(),
            "bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut done = 0;
    while done < n {
        let mut got = vec![stream.next().await.ok_or("stream ended")??];
        while got.len() < batch {
            match stream.next().now_or_never() {
                Some(d) => got.push(d.ok_or("stream ended")??),
                None => break,
            }
        }
        let acks = got.iter().map(|d| d.ack(BasicAckOptions::default()));
        for r in futures_util::future::join_all(acks).await {
            r?;
        }
        done += got.len();
    }
    ch.close(200, "".into()).await?;
    Ok(done)
}

/// The bare durable loop's broker side: the ack-only loop's batches (what has arrived, up to
/// `batch`, waiting up to 20 ms for the first), acks sent together.
struct AmqpBare {
    stream: tokio::sync::Mutex<idem_amqp::lapin::Consumer>,
    batch: usize,
}

impl BareBroker for AmqpBare {
    type Msg = idem_amqp::lapin::message::Delivery;

    async fn fetch(&self) -> Result<Vec<Self::Msg>> {
        let mut stream = self.stream.lock().await;
        let first = tokio::time::timeout(Duration::from_millis(20), stream.next()).await;
        let Ok(first) = first else { return Ok(Vec::new()) };
        let mut got = vec![first.ok_or("stream ended")??];
        while got.len() < self.batch {
            match stream.next().now_or_never() {
                Some(d) => got.push(d.ok_or("stream ended")??),
                None => break,
            }
        }
        Ok(got)
    }

    fn key(d: &Self::Msg) -> String {
        d.properties.message_id().as_ref().map(ToString::to_string).unwrap_or_default()
    }

    async fn ack(&self, msgs: Vec<Self::Msg>) -> Result<()> {
        let acks = msgs.iter().map(|d| d.ack(BasicAckOptions::default()));
        for r in futures_util::future::join_all(acks).await {
            r?;
        }
        Ok(())
    }
}

/// The bare durable loop: `run.lanes` lanes on one channel with the same prefetch.
async fn bare_durable(
    conn: &Connection,
    queue: &str,
    marks: &BareMarks,
    run: &Run,
    prefetch: u16,
) -> Result<usize> {
    marks.create().await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
    let stream = ch
        .basic_consume(
            queue.into(),
            "bare".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let broker = AmqpBare { stream: tokio::sync::Mutex::new(stream), batch: run.batch };
    let done = std::sync::atomic::AtomicUsize::new(0);
    let lanes = (0..run.lanes).map(|_| durable_lane(&broker, marks, run.n, &done, pipelined()));
    let ended = futures_util::future::join_all(lanes).await;
    marks.drop_table().await?;
    ch.close(200, "".into()).await?;
    for r in ended {
        r?;
    }
    Ok(done.into_inner())
}

async fn cleanup(ch: &Channel, queue: &str) {
    let t = Topology::for_queue(queue);
    for q in [t.queue(), t.delay_queue(), t.dead_letter_queue().unwrap_or_default()] {
        let _ = ch.queue_delete(q.into(), QueueDeleteOptions::default()).await;
    }
    let _ =
        ch.exchange_delete(t.dead_letter_exchange().into(), ExchangeDeleteOptions::default()).await;
}

/// A MariaDB pool and a table name, or `None` when the server does not answer.
async fn mysql(sfx: &str) -> Result<Option<(MySqlPool, String)>> {
    let Some(url) = idem_testkit::service::require(
        "MySQL",
        "IDEM_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    ) else {
        return Ok(None);
    };
    let pool = MySqlPoolOptions::new().max_connections(16).connect(&url).await?;
    Ok(Some((pool, format!("idem_amqp_bench_{sfx}"))))
}

/// A pool on PostgreSQL (16 connections) and the prefix of the bench's schemas, or `None` when
/// the server does not answer.
async fn postgres(sfx: &str) -> Result<Option<(PgPool, String)>> {
    let Some(url) = idem_testkit::service::require(
        "PostgreSQL",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ) else {
        return Ok(None);
    };
    let pool = PgPoolOptions::new().max_connections(16).connect(&url).await?;
    Ok(Some((pool, format!("idem_amqp_bench_{sfx}"))))
}
