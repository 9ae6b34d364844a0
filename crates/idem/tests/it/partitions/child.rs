//! The child process of the partition tests: [`CONSUMERS`] consumers inside the namespace,
//! each under a supervisor that starts a new run when one ends with an error, as a service
//! manager would.

use std::time::Duration;

use idem::amqp::lapin::{Connection, ConnectionProperties};
use idem::consumer::{FetchFailures, Report, Source, SourceConfig};
use idem::engine::HandlerError;
use idem::extract::Envelope;
use idem::sqlx::{self, AssertSqlSafe};
use idem::{PostgresStore, Tx};
use rand::Rng;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::{
    CHILD_ENV, CONSUMERS, FETCH_FAILURES, IDLE_IN_TRANSACTION, LEASE, STORE_TIMEOUT, WEEK,
};

/// What the child consumes, and where its effects go.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum Mode {
    /// The PostgreSQL inbox: the ledger row commits with the marker.
    PgInbox { pg: String, schema: String },
    /// Two-phase over Redis: claim, the ledger row in a SQLite file of the child's host (an
    /// effect outside the store, which the partition does not cut), complete.
    RedisTwoPhase { redis: String, namespace: String, ledger: String },
}

/// Where the child's messages come from.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum Broker {
    /// A RabbitMQ queue.
    Amqp { url: String, queue: String },
    /// A Redis stream, read by the consumer group `partitions`.
    Stream { url: String, stream: String },
}

/// The child's instructions (JSON in [`CHILD_ENV`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct Spec {
    pub(super) broker: Broker,
    pub(super) mode: Mode,
}

impl Spec {
    /// The RabbitMQ queue of a spec that reads one.
    pub(super) fn queue(&self) -> &str {
        let Broker::Amqp { queue, .. } = &self.broker else { panic!("not a RabbitMQ spec") };
        queue
    }
}

/// The full chain of an error's messages, on one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    idem::ErrorChain(e).to_string().replace('\n', " ")
}

/// The child process's body: runs [`CONSUMERS`] supervised consumers until its stdin closes.
pub(super) async fn main() {
    let spec: Spec = serde_json::from_str(&std::env::var(CHILD_ENV).expect("instructions"))
        .expect("instructions parse");
    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(async move {
        idem_testkit::process::stdin_closed().await;
        let _ = stop_tx.send(true);
    });
    let consumers: Vec<_> =
        (0..CONSUMERS).map(|i| tokio::spawn(supervise(i, spec.clone(), stop.clone()))).collect();
    for c in consumers {
        c.await.unwrap();
    }
    println!("CHILD_DONE");
}

/// Runs one consumer until `stop`, starting a new run whenever one ends with an error; prints
/// `RUN_ENDED <consumer> <error>` for each.
async fn supervise(i: usize, spec: Spec, mut stop: watch::Receiver<bool>) {
    loop {
        let mut rx = stop.clone();
        let stopped = async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        match consume_once(&spec, stopped).await {
            Ok(r) => {
                println!("STOPPED {i} processed={} duplicates={}", r.processed, r.duplicates);
                return;
            }
            Err(e) => println!("RUN_ENDED {i} {e}"),
        }
        // A service manager's restart delay, cut short when asked to stop.
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}

/// One run: connects, consumes until `stop`, closes. `Err` says why it ended early.
async fn consume_once(
    spec: &Spec,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<Report, String> {
    match &spec.broker {
        Broker::Amqp { url, queue } => {
            // The connect itself is bounded: during a partition it would wait for TCP's SYN
            // retries.
            let connecting = Connection::connect(url, ConnectionProperties::default());
            let conn = tokio::time::timeout(Duration::from_secs(5), connecting)
                .await
                .map_err(|_| "cannot connect to RabbitMQ: no answer within 5 s".to_owned())?
                .map_err(|e| format!("cannot connect to RabbitMQ: {}", chain(&e)))?;
            let config = idem::amqp::AmqpConfig::new(&conn, queue.as_str());
            let ended = run_mode(config, &spec.mode, stop).await;
            // Bounded: on a dead connection the close would wait for the heartbeat.
            let close = conn.close(200, "done".into());
            let _ = tokio::time::timeout(Duration::from_secs(1), close).await;
            ended
        }
        Broker::Stream { url, stream } => {
            let client = idem::redis::redis::Client::open(url.as_str()).unwrap();
            let me = format!("c-{}-{}", std::process::id(), rand::rng().random::<u32>());
            let config = idem::redis::StreamConfig::new(client, stream, "partitions", me);
            run_mode(config, &spec.mode, stop).await
        }
    }
}

/// Builds the consumer of `config` in `mode` and runs it until `stop`.
async fn run_mode<C: SourceConfig>(
    config: C,
    mode: &Mode,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<Report, String> {
    let builder = idem::Consumer::builder(config)
        .batch(32)
        .idle_wait(Duration::from_millis(200))
        .broker_timeout(Duration::from_secs(5))
        .store_timeout(STORE_TIMEOUT)
        .fetch_failures(FetchFailures::new(FETCH_FAILURES, Duration::from_millis(500)));
    match mode {
        Mode::PgInbox { pg, schema } => {
            // A transaction whose client went silent (a cut host) holds its inbox markers'
            // row locks, which other hosts' marks of the same keys wait on, until the server
            // gives it up: bounded here, as it should be in production.
            let opts: sqlx::postgres::PgConnectOptions = pg.parse().unwrap();
            let idle = format!("{}ms", IDLE_IN_TRANSACTION.as_millis());
            let opts = opts.options([("idle_in_transaction_session_timeout", idle.as_str())]);
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(4)
                .acquire_timeout(Duration::from_secs(5))
                .connect_with(opts)
                .await
                .map_err(|e| format!("cannot connect to PostgreSQL: {}", chain(&e)))?;
            let store = PostgresStore::new(pool).with_schema(schema).unwrap();
            let d = builder.inbox(store.inbox(WEEK)).scope("partitions").build().await;
            let d = d.map_err(|e| chain(&e))?;
            println!("CONSUMING");
            let table = format!("\"{schema}\".ledger");
            d.run(pg_writer(table), stop).await.map_err(|e| chain(&e))
        }
        Mode::RedisTwoPhase { redis, namespace, ledger } => {
            let store = idem::redis::RedisStore::builder(redis)
                .unwrap()
                .namespace(namespace)
                .unwrap()
                .response_timeout(Duration::from_secs(2))
                .connect()
                .await
                .map_err(|e| format!("cannot connect to Redis: {}", chain(&e)))?;
            let ledger = sqlite(ledger).await;
            let d = builder.store(store).scope("partitions").lease(LEASE).retain(WEEK).build();
            let d = d.await.map_err(|e| chain(&e))?;
            println!("CONSUMING");
            let handler = |ctx: idem::engine::Context, m: <C::Source as Source>::Delivery| {
                let id = m.message_id().unwrap_or_default().to_owned();
                let downstream = ctx.downstream_key().unwrap_or_default().to_owned();
                let took_over = i64::from(ctx.took_over_expired());
                let ledger = ledger.clone();
                async move {
                    sqlx::query("INSERT INTO ledger (id, downstream, took_over) VALUES (?, ?, ?)")
                        .bind(id)
                        .bind(downstream)
                        .bind(took_over)
                        .execute(&ledger)
                        .await
                        .map_err(|e| HandlerError::Transient(e.to_string()))?;
                    Ok::<(), HandlerError<String>>(())
                }
            };
            d.run(handler, stop).await.map_err(|e| chain(&e))
        }
    }
}

type HandlerFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), HandlerError<String>>> + Send>>;

fn pg_writer<M: Envelope>(
    table: String,
) -> impl Fn(Tx<idem::PostgresInbox>, M) -> HandlerFuture + Sync {
    move |mut tx, m| {
        let sql = format!("INSERT INTO {table} (id) VALUES ($1)");
        let id = m.message_id().unwrap_or_default().to_owned();
        Box::pin(async move {
            sqlx::query(AssertSqlSafe(sql))
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(|e| HandlerError::Transient(e.to_string()))?;
            Ok(())
        })
    }
}

/// The two-phase ledger: a SQLite file both processes open.
pub(super) async fn sqlite(file: &str) -> sqlx::SqlitePool {
    let url = format!("sqlite://{file}?mode=rwc");
    let pool =
        sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect(&url).await.unwrap();
    sqlx::query("PRAGMA busy_timeout = 30000").execute(&pool).await.unwrap();
    pool
}
