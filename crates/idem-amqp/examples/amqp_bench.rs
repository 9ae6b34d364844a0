//! Messages per second through the adapter against the local broker, beside an ack-only loop,
//! in one run.
//!
//! ```text
//! cargo run --release -p idem-amqp --features sqlite,postgres --example amqp_bench -- 10000
//! ```
//!
//! For each mode a fresh queue is filled with N unique messages (publishing is not timed), then
//! the clock runs from the first delivery until the last is settled. Same prefetch (64) and
//! batch (32) everywhere; the handler does nothing, so the figures are the price of the
//! broker round trips and of idempotency. Broker: `IDEM_AMQP_URL`; PostgreSQL:
//! `IDEM_POSTGRES_URL` (each PostgreSQL mode gets a schema of its own, dropped afterwards).
#![allow(clippy::unwrap_used, clippy::cast_precision_loss)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use idem_amqp::lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idem_amqp::lapin::types::FieldTable;
use idem_amqp::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idem_amqp::{AmqpConsumer, AmqpMessage, Report, Topology};
use idem_core::consumer::HandlerError;
use idem_core::{BatchConfig, Batched, Consumer, DedupStore, MemoryStore};
use idem_sqlx::postgres::PgWrites;
use idem_sqlx::{PostgresStore, SqliteStore, Writes};
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::sqlite::SqliteConnection;
use tokio::sync::Notify;

const PREFETCH: u16 = 64;
const BATCH: usize = 32;

#[tokio::main]
async fn main() {
    let n: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(10_000);
    let url = std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let conn = Connection::connect(&url, ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let pg_url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pg = PgPoolOptions::new().max_connections(16).connect(&pg_url).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    println!("| mode | messages | seconds | msgs/s | vs ack-only |");
    println!("| --- | ---: | ---: | ---: | ---: |");
    let mut base = 0.0;
    for mode in [
        "ack-only (lapin, no dedup)",
        "adapter + MemoryStore",
        "adapter two-phase + SqliteStore",
        "adapter inbox + SqliteInbox",
        "adapter two-phase + PostgresStore",
        "adapter two-phase + Batched<PostgresStore>",
        "adapter inbox + PostgresInbox",
    ] {
        let queue = fill(&ch, n).await;
        let secs = match mode {
            "ack-only (lapin, no dedup)" => ack_only(&conn, &queue, n).await,
            "adapter + MemoryStore" => adapter(&conn, &queue, n, MemoryStore::new(), None).await,
            "adapter two-phase + SqliteStore" => {
                let store = SqliteStore::open(dir.path().join("two-phase.sqlite")).await.unwrap();
                adapter(&conn, &queue, n, store, None).await
            }
            "adapter inbox + SqliteInbox" => {
                let store = SqliteStore::open(dir.path().join("inbox.sqlite")).await.unwrap();
                sqlx::query("CREATE TABLE effects (id TEXT)").execute(store.pool()).await.unwrap();
                adapter(&conn, &queue, n, store.clone(), Some(Inbox::Sqlite(store))).await
            }
            "adapter two-phase + PostgresStore" => {
                let store = pg_store(&pg, "two_phase").await;
                let secs = adapter(&conn, &queue, n, store.clone(), None).await;
                drop_schema(&pg, store.schema()).await;
                secs
            }
            "adapter two-phase + Batched<PostgresStore>" => {
                let store = pg_store(&pg, "batched").await;
                let batched = Batched::new(store.clone(), BatchConfig::default());
                let secs = adapter(&conn, &queue, n, batched, None).await;
                drop_schema(&pg, store.schema()).await;
                secs
            }
            _ => {
                let store = pg_store(&pg, "inbox").await;
                let sql = format!("CREATE TABLE {}.effects (id TEXT)", store.schema());
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pg).await.unwrap();
                let secs =
                    adapter(&conn, &queue, n, store.clone(), Some(Inbox::Postgres(store.clone())))
                        .await;
                drop_schema(&pg, store.schema()).await;
                secs
            }
        };
        let rate = n as f64 / secs;
        if base == 0.0 {
            base = rate;
        }
        println!("| {mode} | {n} | {secs:.2} | {rate:.0} | {:.2}× |", rate / base);
        cleanup(&ch, &queue).await;
    }
    conn.close(200, "".into()).await.unwrap();
}

/// A store in a fresh schema `idem_bench_<tag>_<pid>`.
async fn pg_store(pool: &PgPool, tag: &str) -> PostgresStore {
    let schema = format!("idem_bench_{tag}_{}", std::process::id());
    drop_schema(pool, &schema).await;
    let store = PostgresStore::new(pool.clone()).with_schema(&schema).unwrap();
    store.migrate().await.unwrap();
    store
}

async fn drop_schema(pool: &PgPool, schema: &str) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {schema} CASCADE")))
        .execute(pool)
        .await
        .unwrap();
}

async fn fill(ch: &Channel, n: u64) -> String {
    let queue = format!("idem-bench-{:016x}", rand::random::<u64>());
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await
        .unwrap();
    let mut confirms = Vec::new();
    for i in 0..n {
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(format!("m-{i}").into());
        let body = format!(r#"{{"order":{i},"cents":1200}}"#);
        let c = ch
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                props,
            )
            .await
            .unwrap();
        confirms.push(c);
        if confirms.len() == 1000 {
            for c in confirms.drain(..) {
                c.await.unwrap();
            }
        }
    }
    for c in confirms {
        c.await.unwrap();
    }
    queue
}

async fn ack_only(conn: &Connection, queue: &str, n: u64) -> f64 {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(PREFETCH, BasicQosOptions::default()).await.unwrap();
    let mut stream = ch
        .basic_consume(
            queue.into(),
            "bench".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut start = None;
    for _ in 0..n {
        let d = stream.next().await.unwrap().unwrap();
        start.get_or_insert_with(Instant::now);
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    let secs = start.unwrap().elapsed().as_secs_f64();
    ch.close(200, "".into()).await.unwrap();
    secs
}

async fn adapter<S: DedupStore + Clone + Send + Sync + 'static>(
    conn: &Connection,
    queue: &str,
    n: u64,
    store: S,
    inbox: Option<Inbox>,
) -> f64 {
    let settled = Arc::new(AtomicU64::new(0));
    let first = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let done = Arc::new(Notify::new());
    let (s, f, d) = (Arc::clone(&settled), Arc::clone(&first), Arc::clone(&done));
    let engine = Consumer::builder(store).scope("bench").build().unwrap();
    let c = AmqpConsumer::builder(engine, queue)
        .prefetch(PREFETCH)
        .batch(BATCH, Duration::from_millis(1))
        .on_settle(move |_r: &Report<'_>| {
            f.lock().unwrap().get_or_insert_with(Instant::now);
            if s.fetch_add(1, Ordering::SeqCst) + 1 == n {
                d.notify_one();
            }
        })
        .connect(conn)
        .await
        .unwrap();
    let shutdown = async move { done.notified().await };
    let stats = match inbox {
        None => {
            c.run(|_ctx, _m| async { Ok::<_, HandlerError<String>>(()) }, shutdown).await.unwrap()
        }
        Some(Inbox::Sqlite(store)) => {
            let inbox = store.inbox(Duration::from_secs(86_400));
            c.run_inbox(&inbox, store.pool(), effect, shutdown).await.unwrap()
        }
        Some(Inbox::Postgres(store)) => {
            let inbox = store.inbox(Duration::from_secs(86_400));
            let effect = pg_effect(format!("{}.effects", store.schema()));
            c.run_postgres_inbox(&inbox, store.pool(), effect, shutdown).await.unwrap()
        }
    };
    // The last batch's acks are sent once run returns.
    let secs = first.lock().unwrap().unwrap().elapsed().as_secs_f64();
    assert_eq!(stats.processed, n, "{stats:?}");
    secs
}

/// The PostgreSQL inbox's effect: one row in `table`.
fn pg_effect(
    table: String,
) -> impl for<'c> Fn(&'c mut PgConnection, AmqpMessage) -> PgWrites<'c, (), HandlerError<sqlx::Error>>
{
    move |conn: &mut PgConnection, m: AmqpMessage| {
        let sql = format!("INSERT INTO {table} VALUES ($1)");
        Box::pin(async move {
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(m.properties().message_id().as_ref().map(|s| s.to_string()))
                .execute(&mut *conn)
                .await
                .map_err(HandlerError::Transient)?;
            Ok(())
        }) as PgWrites<'_, (), HandlerError<sqlx::Error>>
    }
}

/// The inbox mode's database.
enum Inbox {
    Sqlite(SqliteStore),
    Postgres(PostgresStore),
}

fn effect(
    conn: &mut SqliteConnection,
    m: AmqpMessage,
) -> Writes<'_, (), HandlerError<sqlx::Error>> {
    Box::pin(async move {
        sqlx::query("INSERT INTO effects VALUES (?)")
            .bind(m.properties().message_id().as_ref().map(|s| s.to_string()))
            .execute(&mut *conn)
            .await
            .map_err(HandlerError::Transient)?;
        Ok(())
    })
}

async fn cleanup(ch: &Channel, queue: &str) {
    let t = Topology::for_queue(queue);
    for q in [t.queue(), t.delay_queue(), t.dead_letter_queue().unwrap_or_default()] {
        let _ = ch.queue_delete(q.into(), QueueDeleteOptions::default()).await;
    }
    let _ =
        ch.exchange_delete(t.dead_letter_exchange().into(), ExchangeDeleteOptions::default()).await;
}
