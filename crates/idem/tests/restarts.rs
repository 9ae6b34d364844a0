//! Servers restarting under load. Three consumers process 5,000 unique messages plus 1,000
//! duplicates (20 %) into a ledger that has no dedup of its own; once a third of the ledger is
//! written, one server is restarted. Each consumer runs under a supervisor, as a service
//! manager would run it: when its run stops with an error, the error is recorded and a new run
//! starts with new connections. The test passes when every unique message has exactly one
//! ledger row, the queue is drained and every consumer stopped when asked; it fails when the
//! ledger stalls (a consumer that hangs) for longer than the deadline.
//!
//! Shared servers (PostgreSQL, MariaDB, RabbitMQ) are restarted with `.ci/services.sh restart`,
//! which needs root and disturbs anything else using them: those tests run under `CI=true` or
//! with `IDEM_TEST_RESTART_SERVERS=1`, and say `skipped` otherwise. Redis and NATS run as
//! private servers of the test, on a free port, and are restarted by it.
//!
//! A binary of its own: `cargo test` runs one test binary at a time, so no other crate's or
//! subject's test is using a shared server while these restart it.
#![cfg(all(
    feature = "amqp",
    feature = "nats",
    feature = "kafka",
    feature = "postgres",
    feature = "mysql",
    feature = "redis"
))]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed setup step is the test failing

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::consumer::{Report, SourceConfig};
use idem::engine::HandlerError;
use idem::extract::Envelope;
use idem::outbox::{OutboxId, OutboxMessage, Outgoing, Publisher};
use idem::sqlx::{self, AssertSqlSafe};
use idem::{MySqlStore, PostgresStore, Tx};
use rand::Rng;
use tokio::sync::watch;

const UNIQUE: usize = 5_000;
const DUPLICATES: usize = 1_000;
const WEEK: Duration = Duration::from_secs(7 * 86_400);
const CONSUMERS: usize = 3;
/// How long the ledger may go without growing before the run counts as hung.
const STALL: Duration = Duration::from_secs(90);

/// One restart at a time: they restart servers every other test of this file uses.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
type HandlerFuture = BoxFut<'static, Result<(), HandlerError<String>>>;

fn env_url(service: &str, var: &str, default: &str) -> Option<String> {
    idem_testkit::service::require(service, var, default)
}

fn pg_url() -> Option<String> {
    env_url("postgres", "IDEM_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test")
}

fn mysql_url() -> Option<String> {
    env_url("mariadb", "IDEM_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
}

fn amqp_url() -> Option<String> {
    env_url("amqp", "IDEM_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
}

/// Whether this run may restart the shared servers.
fn may_restart_shared(what: &str) -> bool {
    let allowed = idem_testkit::service::in_ci()
        || std::env::var("IDEM_TEST_RESTART_SERVERS").is_ok_and(|v| v == "1");
    if !allowed {
        eprintln!(
            "skipped: restarting the shared {what} needs CI=true or IDEM_TEST_RESTART_SERVERS=1"
        );
    }
    allowed
}

/// `.ci/services.sh restart <what>`, which returns once the server answers again.
async fn restart_shared(what: &str) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.ci/services.sh");
    let out = tokio::process::Command::new("bash")
        .arg(&script)
        .args(["restart", what])
        .output()
        .await
        .expect("run .ci/services.sh");
    assert!(
        out.status.success(),
        "restarting {what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The full chain of an error's messages, so a recorded error says what happened.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    idem::ErrorChain(e).to_string()
}

fn messages(destination: &str, ids: &[String]) -> Vec<OutboxMessage> {
    ids.iter()
        .map(|id| {
            Outgoing::new(destination, id.clone())
                .id(OutboxId::new(id).unwrap())
                .into_message(OutboxId::random)
        })
        .collect()
}

/// A server of the test's own on a free port, restartable on the same port and directory.
struct Private {
    program: String,
    args: Vec<String>,
    port: u16,
    dir: tempfile::TempDir,
    child: Option<tokio::process::Child>,
}

impl Private {
    /// Starts `program` with `args`, where `{port}` and `{dir}` are replaced; `None` (skip)
    /// when it is not installed, outside CI.
    async fn start(program: &str, args: &[&str]) -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let dir = tempfile::tempdir().unwrap();
        let dir_s = dir.path().to_str().unwrap().to_owned();
        let args = args
            .iter()
            .map(|a| a.replace("{port}", &port.to_string()).replace("{dir}", &dir_s))
            .collect();
        let mut s = Self { program: program.to_owned(), args, port, dir, child: None };
        if let Err(e) = s.spawn().await {
            assert!(!idem_testkit::service::in_ci(), "{program} not runnable: {e}");
            eprintln!("skipped: {program} not runnable ({e})");
            return None;
        }
        Some(s)
    }

    async fn spawn(&mut self) -> std::io::Result<()> {
        let log = std::fs::File::create(self.dir.path().join("server.log"))?;
        let child = tokio::process::Command::new(&self.program)
            .args(&self.args)
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .current_dir(self.dir.path())
            .kill_on_drop(true)
            .spawn()?;
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        idem_testkit::wait_for(
            &format!("{} on {addr}", self.program),
            Duration::from_secs(30),
            || {
                let addr = addr.clone();
                async move { tokio::net::TcpStream::connect(addr).await.is_ok() }
            },
        )
        .await;
        Ok(())
    }

    /// Stops the server (SIGKILL when `kill`, else SIGTERM and wait), keeps it down for `down`
    /// (as a real restart would be), then starts it again.
    async fn restart(&mut self, kill: bool, down: Duration) {
        let mut child = self.child.take().unwrap();
        if kill {
            child.kill().await.unwrap();
        } else {
            let pid = child.id().unwrap().to_string();
            let sent = tokio::process::Command::new("kill").args(["-TERM", &pid]).status().await;
            assert!(sent.unwrap().success(), "kill -TERM {pid}");
            tokio::time::timeout(Duration::from_secs(30), child.wait())
                .await
                .expect("the server stops on SIGTERM")
                .unwrap();
        }
        tokio::time::sleep(down).await;
        self.spawn().await.unwrap();
    }
}

/// Where the consumers' effects go: one row per handler run, no unique constraint.
#[derive(Clone)]
enum Ledger {
    Pg { pool: sqlx::PgPool, table: String },
    My { pool: sqlx::MySqlPool, table: String },
}

impl Ledger {
    /// (rows, distinct ids); an error while its server restarts.
    async fn count(&self) -> Result<(i64, i64), sqlx::Error> {
        match self {
            Self::Pg { pool, table } => {
                let sql = format!("SELECT count(*), count(DISTINCT id) FROM {table}");
                sqlx::query_as(AssertSqlSafe(sql)).fetch_one(pool).await
            }
            Self::My { pool, table } => {
                let sql = format!("SELECT count(*), count(DISTINCT id) FROM {table}");
                sqlx::query_as(AssertSqlSafe(sql)).fetch_one(pool).await
            }
        }
    }
}

/// The dedup side of one scenario.
#[derive(Clone)]
enum StoreSpec {
    /// The PostgreSQL inbox: marker and ledger row in one transaction.
    PgInbox { url: String, schema: String },
    /// The MariaDB inbox, likewise.
    MyInbox { url: String, table: String },
    /// Two-phase on Redis: claim, ledger row (its own autocommit), complete.
    Redis { url: String, namespace: String, ledger: Ledger },
}

/// The broker side of one scenario.
#[derive(Clone)]
enum BrokerSpec {
    Rabbit { url: String, queue: String },
    Nats { url: String, subject: String },
    Kafka { brokers: String, topic: String },
}

fn stream(subject: &str) -> String {
    subject.replace(['.', '-'], "_").to_uppercase()
}

async fn pg_pool(url: &str) -> Result<sqlx::PgPool, sqlx::Error> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
}

async fn my_pool(url: &str) -> Result<sqlx::MySqlPool, sqlx::Error> {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
}

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

fn my_writer<M: Envelope>(
    table: String,
) -> impl Fn(Tx<idem::MySqlInbox>, M) -> HandlerFuture + Sync {
    move |mut tx, m| {
        let sql = format!("INSERT INTO {table} (id) VALUES (?)");
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

/// One run of one consumer: opens its connections, runs until `stop`, closes. `Err` says why
/// it ended early (the supervisor records it and starts a new run).
async fn run_once<C: SourceConfig>(
    config: C,
    store: &StoreSpec,
    stop: impl Future<Output = ()> + Send,
) -> Result<Report, String> {
    let err = |e: &(dyn std::error::Error + 'static)| chain(e);
    let builder = idem::Consumer::builder(config).batch(32).idle_wait(Duration::from_millis(100));
    match store {
        StoreSpec::PgInbox { url, schema } => {
            let pool = pg_pool(url).await.map_err(|e| err(&e))?;
            let store = PostgresStore::new(pool).with_schema(schema).unwrap();
            let d = builder.inbox(store.inbox(WEEK)).scope("restarts").build().await;
            let d = d.map_err(|e| err(&e))?;
            d.run(pg_writer(format!("\"{schema}\".ledger")), stop).await.map_err(|e| err(&e))
        }
        StoreSpec::MyInbox { url, table } => {
            let pool = my_pool(url).await.map_err(|e| err(&e))?;
            let store = MySqlStore::new(pool).with_table_name(table).unwrap();
            let d = builder.inbox(store.inbox(WEEK)).scope("restarts").build().await;
            let d = d.map_err(|e| err(&e))?;
            d.run(my_writer(format!("{table}_ledger")), stop).await.map_err(|e| err(&e))
        }
        StoreSpec::Redis { url, namespace, ledger } => {
            let store = idem::redis::RedisStore::builder(url)
                .unwrap()
                .namespace(namespace)
                .unwrap()
                .response_timeout(Duration::from_secs(2))
                .connect()
                .await
                .map_err(|e| err(&e))?;
            let Ledger::Pg { pool, table } = ledger else { unreachable!("a PostgreSQL ledger") };
            let d = builder.store(store).scope("restarts").build().await;
            let d = d.map_err(|e| err(&e))?;
            let handler =
                |_ctx: idem::engine::Context,
                 m: <C::Source as idem::consumer::Source>::Delivery| {
                    let sql = format!("INSERT INTO {table} (id) VALUES ($1)");
                    let id = m.message_id().unwrap_or_default().to_owned();
                    let pool = pool.clone();
                    async move {
                        sqlx::query(AssertSqlSafe(sql))
                            .bind(id)
                            .execute(&pool)
                            .await
                            .map_err(|e| HandlerError::Transient(e.to_string()))?;
                        Ok::<(), HandlerError<String>>(())
                    }
                };
            d.run(handler, stop).await.map_err(|e| err(&e))
        }
    }
}

/// Opens the broker side, then runs once.
async fn consume_once(
    broker: &BrokerSpec,
    store: &StoreSpec,
    stop: impl Future<Output = ()> + Send,
) -> Result<Report, String> {
    match broker {
        BrokerSpec::Rabbit { url, queue } => {
            use idem::amqp::lapin::{Connection, ConnectionProperties};
            let conn = Connection::connect(url, ConnectionProperties::default())
                .await
                .map_err(|e| chain(&e))?;
            let ended =
                run_once(idem::amqp::AmqpConfig::new(&conn, queue.as_str()), store, stop).await;
            let _ = conn.close(200, "done".into()).await;
            ended
        }
        BrokerSpec::Nats { url, subject } => {
            use idem::nats::async_nats::{self, jetstream};
            let client = async_nats::ConnectOptions::new()
                .retry_on_initial_connect()
                .connect(url.as_str())
                .await
                .map_err(|e| chain(&e))?;
            let js = jetstream::new(client);
            let pull = js
                .get_consumer_from_stream("restarts", &stream(subject))
                .await
                .map_err(|e| chain(&e))?;
            let source = idem::nats::JetStreamConfig::new(js, pull, format!("{subject}.dlq"));
            run_once(source, store, stop).await
        }
        BrokerSpec::Kafka { brokers, topic } => {
            let config = idem::kafka::KafkaConfig::new(
                &kafka::config(brokers),
                &[topic.as_str()],
                format!("{topic}-dlq"),
            )
            .close_timeout(Duration::from_secs(5));
            run_once(config, store, stop).await
        }
    }
}

/// Runs one consumer until `stop` is set, starting a new run whenever one ends with an error;
/// returns the errors, in order, and the report of the run that ended when asked.
async fn supervise(
    broker: BrokerSpec,
    store: StoreSpec,
    mut stop: watch::Receiver<bool>,
) -> (Vec<String>, Report) {
    let mut errors = Vec::new();
    loop {
        let mut rx = stop.clone();
        let stopped = async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        match consume_once(&broker, &store, stopped).await {
            Ok(report) => return (errors, report),
            Err(e) => errors.push(e),
        }
        // A service manager's restart delay, cut short when the test stops.
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return (errors, Report::default()),
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}

/// What a scenario checks at the end: no lost effect, and (when `exactly_once`) no repeated one.
struct Expect {
    exactly_once: bool,
}

/// Feeds the queue, runs three supervised consumers, applies `fault` once a third of the
/// ledger is written, waits for the ledger to complete and the queue to drain, stops the
/// consumers and checks the ledger. Returns (rows, distinct).
#[allow(clippy::too_many_arguments)]
async fn scenario<F>(
    name: &str,
    broker: &BrokerSpec,
    store: &StoreSpec,
    ledger: &Ledger,
    publisher: impl Publisher,
    backlog: impl Fn() -> BoxFut<'static, Option<u64>>,
    fault: F,
    expect: Expect,
) -> (i64, i64)
where
    F: FnOnce() -> BoxFut<'static, ()>,
{
    let tag = format!("r{}", rand::rng().random::<u32>());
    let ids = idem_testkit::workload::ids_with_duplicates(&tag, UNIQUE, DUPLICATES);
    let destination = match broker {
        BrokerSpec::Rabbit { queue, .. } => queue.clone(),
        BrokerSpec::Nats { subject, .. } => subject.clone(),
        BrokerSpec::Kafka { topic, .. } => topic.clone(),
    };
    for chunk in messages(&destination, &ids).chunks(500) {
        for r in publisher.publish(chunk).await {
            r.expect("input published with confirms");
        }
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let consumers: Vec<_> = (0..CONSUMERS)
        .map(|_| tokio::spawn(supervise(broker.clone(), store.clone(), stop_rx.clone())))
        .collect();

    let started = tokio::time::Instant::now();
    let mut fault = Some(fault);
    let mut fault_at = None;
    let (mut last, mut last_change) = (-1, tokio::time::Instant::now());
    loop {
        // Polling the ledger for progress; the condition, not the pause, ends the loop.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Ok((_, distinct)) = ledger.count().await else { continue };
        if distinct != last {
            (last, last_change) = (distinct, tokio::time::Instant::now());
        }
        if distinct >= UNIQUE as i64 {
            break;
        }
        assert!(
            last_change.elapsed() < STALL,
            "{name}: the ledger stalled at {distinct} of {UNIQUE} for {STALL:?}"
        );
        if distinct >= (UNIQUE / 3) as i64
            && let Some(f) = fault.take()
        {
            fault_at = Some(distinct);
            f().await;
        }
    }
    idem_testkit::wait_for(&format!("{name}: queue drained"), Duration::from_secs(120), || {
        let n = backlog();
        async move { n.await == Some(0) }
    })
    .await;
    stop_tx.send(true).unwrap();
    let (mut errors, mut last_runs) = (Vec::new(), Report::default());
    for c in consumers {
        let (e, r) = tokio::time::timeout(Duration::from_secs(60), c)
            .await
            .expect("every consumer stops when asked")
            .unwrap();
        errors.push(e);
        last_runs += r;
    }
    assert_eq!(backlog().await, Some(0), "{name}: nothing handed back at the stop");
    let (rows, distinct) = ledger.count().await.unwrap();
    let runs_ended: usize = errors.iter().map(Vec::len).sum();
    println!(
        "{name}: {rows} ledger rows, {distinct} distinct of {UNIQUE}; fault at {fault_at:?}; \
         {runs_ended} consumer runs ended with an error; {:.1} s\n  the last runs: {} \
         processed, {} duplicates, {} in progress elsewhere, {} transient failures, {} retried",
        started.elapsed().as_secs_f64(),
        last_runs.processed,
        last_runs.duplicates,
        last_runs.in_progress,
        last_runs.failed_transient,
        last_runs.retried,
    );
    for (i, es) in errors.iter().enumerate() {
        for e in es {
            println!("  consumer {i} stopped: {e}");
            assert!(!e.trim().is_empty(), "an error without a message");
        }
    }
    assert!(fault_at.is_some(), "{name}: the run ended before the fault was applied");
    assert_eq!(distinct, UNIQUE as i64, "{name}: every message has its effect");
    if expect.exactly_once {
        assert_eq!(rows, UNIQUE as i64, "{name}: no effect ran twice");
    }
    (rows, distinct)
}

/// A PostgreSQL schema with a ledger table, dropped at the end.
async fn pg_schema(url: &str) -> (sqlx::PgPool, String) {
    let pool = pg_pool(url).await.unwrap();
    let schema = format!("idem_restart_{}", rand::rng().random::<u32>());
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE SCHEMA \"{schema}\"; CREATE TABLE \"{schema}\".ledger (id TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    (pool, schema)
}

async fn drop_pg_schema(pool: &sqlx::PgPool, schema: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(pool)
        .await
        .unwrap();
}

mod rabbit {
    use super::*;
    use idem::amqp::AmqpPublisher;
    use idem::amqp::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use idem::amqp::lapin::types::FieldTable;
    use idem::amqp::lapin::{Connection, ConnectionProperties};

    /// A durable queue and a publisher of persistent messages with confirms.
    pub(super) async fn queue(url: &str) -> (String, AmqpPublisher) {
        let queue = format!("idem.restart.{}", rand::rng().random::<u32>());
        let conn = Connection::connect(url, ConnectionProperties::default()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        let publisher = AmqpPublisher::new(ch).await.unwrap().persistent(true);
        (queue, publisher)
    }

    /// Messages in the queue not yet acknowledged; `None` while the broker is away.
    pub(super) fn backlog(url: String, queue: String) -> impl Fn() -> BoxFut<'static, Option<u64>> {
        move || {
            let (url, queue) = (url.clone(), queue.clone());
            Box::pin(async move {
                let conn = Connection::connect(&url, ConnectionProperties::default()).await.ok()?;
                let ch = conn.create_channel().await.ok()?;
                let opts = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::durable() };
                let info = ch
                    .queue_declare(queue.as_str().into(), opts, FieldTable::default())
                    .await
                    .ok()?;
                let _ = conn.close(200, "done".into()).await;
                // Unacknowledged deliveries are not in message_count: the consumers are stopped
                // only after this, so also require no consumer to hold any (see the caller).
                Some(u64::from(info.message_count()))
            })
        }
    }

    pub(super) async fn delete(url: &str, queue: &str) {
        let conn = Connection::connect(url, ConnectionProperties::default()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        let _ = ch.queue_delete(queue.into(), QueueDeleteOptions::default()).await;
    }
}

/// The shared `service` restarted under the PostgreSQL inbox with RabbitMQ in front; the pool,
/// once the test's schema is dropped, or `None` when skipped.
async fn shared_restart_under_pg_inbox(service: &'static str) -> Option<sqlx::PgPool> {
    let (Some(pg), Some(amqp)) = (pg_url(), amqp_url()) else { return None };
    if !may_restart_shared(service) {
        return None;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let (pool, schema) = pg_schema(&pg).await;
    PostgresStore::new(pool.clone()).with_schema(&schema).unwrap().migrate().await.unwrap();
    let (queue, publisher) = rabbit::queue(&amqp).await;
    let ledger = Ledger::Pg { pool: pool.clone(), table: format!("\"{schema}\".ledger") };
    scenario(
        &format!("{service} restart"),
        &BrokerSpec::Rabbit { url: amqp.clone(), queue: queue.clone() },
        &StoreSpec::PgInbox { url: pg.clone(), schema: schema.clone() },
        &ledger,
        publisher,
        rabbit::backlog(amqp.clone(), queue.clone()),
        || Box::pin(restart_shared(service)),
        Expect { exactly_once: true },
    )
    .await;
    rabbit::delete(&amqp, &queue).await;
    drop_pg_schema(&pool, &schema).await;
    Some(pool)
}

/// PostgreSQL restarted (`pg_ctlcluster … restart`) under the PostgreSQL inbox, RabbitMQ in front.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_under_load() {
    let Some(pool) = shared_restart_under_pg_inbox("postgres").await else { return };
    let started: (bool,) =
        sqlx::query_as("SELECT pg_postmaster_start_time() > now() - interval '10 minutes'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(started.0, "the server was restarted during the run");
}

/// MariaDB shut down and started again under the MariaDB inbox, RabbitMQ in front.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_restart_under_load() {
    let (Some(my), Some(amqp)) = (mysql_url(), amqp_url()) else { return };
    if !may_restart_shared("MariaDB") {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let pool = my_pool(&my).await.unwrap();
    let table = format!("idem_restart_{}", rand::rng().random::<u32>());
    MySqlStore::new(pool.clone()).with_table_name(&table).unwrap().migrate().await.unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE {table}_ledger (id VARCHAR(64) NOT NULL)")))
        .execute(&pool)
        .await
        .unwrap();
    let (queue, publisher) = rabbit::queue(&amqp).await;
    let ledger = Ledger::My { pool: pool.clone(), table: format!("{table}_ledger") };
    scenario(
        "mariadb restart",
        &BrokerSpec::Rabbit { url: amqp.clone(), queue: queue.clone() },
        &StoreSpec::MyInbox { url: my.clone(), table: table.clone() },
        &ledger,
        publisher,
        rabbit::backlog(amqp.clone(), queue.clone()),
        || Box::pin(restart_shared("mariadb")),
        Expect { exactly_once: true },
    )
    .await;
    rabbit::delete(&amqp, &queue).await;
    let pool = my_pool(&my).await.unwrap();
    let uptime: (String,) = sqlx::query_as(
        "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'UPTIME'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(uptime.0.parse::<u64>().unwrap() < 600, "the server was restarted during the run");
    sqlx::raw_sql(AssertSqlSafe(format!("DROP TABLE {table}, {table}_ledger")))
        .execute(&pool)
        .await
        .unwrap();
}

/// RabbitMQ's application stopped and started (`rabbitmqctl stop_app / start_app`) under the
/// PostgreSQL inbox: every consumer loses its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_restart_under_load() {
    shared_restart_under_pg_inbox("rabbitmq").await;
}

/// A private Redis with the AOF on (`appendfsync always`) killed with SIGKILL and started
/// again under the two-phase Redis store, RabbitMQ in front. Every acknowledged write is in the
/// AOF, so no record is lost; completions that fail while it is down are tried again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_with_aof_killed_under_load() {
    redis_scenario(true).await;
}

/// The same with persistence off: the restart forgets every record, so a duplicate delivered
/// after it whose first copy was processed before runs its handler again. Nothing is lost; the
/// repeated effects are counted and printed (docs/RELIABILITY.md records a run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_without_persistence_killed_under_load() {
    redis_scenario(false).await;
}

async fn redis_scenario(aof: bool) {
    let (Some(pg), Some(amqp)) = (pg_url(), amqp_url()) else { return };
    let persistence: &[&str] = if aof {
        &["--appendonly", "yes", "--appendfsync", "always"]
    } else {
        &["--appendonly", "no"]
    };
    let mut args = vec!["--port", "{port}", "--bind", "127.0.0.1", "--dir", "{dir}", "--save", ""];
    args.extend_from_slice(persistence);
    let Some(server) = Private::start("redis-server", &args).await else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let url = format!("redis://127.0.0.1:{}/", server.port);
    let (pool, schema) = pg_schema(&pg).await;
    let (queue, publisher) = rabbit::queue(&amqp).await;
    let ledger = Ledger::Pg { pool: pool.clone(), table: format!("\"{schema}\".ledger") };
    let server = Arc::new(tokio::sync::Mutex::new(server));
    use idem::redis::redis;
    let keys_lost = Arc::new(Mutex::new(None));
    let fault = {
        let (server, url, keys_lost) = (Arc::clone(&server), url.clone(), Arc::clone(&keys_lost));
        move || -> BoxFut<'static, ()> {
            Box::pin(async move {
                // A key written before the kill, which the consumers never touch: still there
                // after the restart only if the server kept what it had acknowledged.
                let _: () = redis_ask(&url, redis::cmd("SET").arg(SENTINEL).arg(1)).await;
                let before: i64 = redis_ask(&url, &redis::cmd("DBSIZE")).await;
                server.lock().await.restart(true, Duration::from_secs(1)).await;
                let kept: bool = redis_ask(&url, redis::cmd("EXISTS").arg(SENTINEL)).await;
                let after: i64 = redis_ask(&url, &redis::cmd("DBSIZE")).await;
                *keys_lost.lock().unwrap() = Some((before, after, kept));
            })
        }
    };
    let name = if aof { "redis (AOF) SIGKILL" } else { "redis (no persistence) SIGKILL" };
    let (rows, _) = scenario(
        name,
        &BrokerSpec::Rabbit { url: amqp.clone(), queue: queue.clone() },
        &StoreSpec::Redis {
            url: url.clone(),
            namespace: "restarts".into(),
            ledger: ledger.clone(),
        },
        &ledger,
        publisher,
        rabbit::backlog(amqp.clone(), queue.clone()),
        fault,
        Expect { exactly_once: aof },
    )
    .await;
    let (before, after, kept) = keys_lost.lock().unwrap().expect("the fault ran");
    println!(
        "{name}: {before} keys before the kill, {after} just after the restart; {} effects repeated",
        rows - UNIQUE as i64
    );
    if aof {
        assert!(kept, "the AOF kept what the server acknowledged before the kill");
        assert!(after >= before, "the AOF kept every record ({before} before, {after} after)");
    } else {
        assert!(!kept, "without persistence the restart forgets everything");
    }
    rabbit::delete(&amqp, &queue).await;
    drop_pg_schema(&pool, &schema).await;
}

const SENTINEL: &str = "idem-restart-sentinel";

/// `cmd`'s answer, once the server answers (a restarted Redis says LOADING until its AOF is read).
async fn redis_ask<T: idem::redis::redis::FromRedisValue>(
    url: &str,
    cmd: &idem::redis::redis::Cmd,
) -> T {
    use idem::redis::redis;
    let client = redis::Client::open(url).unwrap();
    let answer = Arc::new(Mutex::new(None));
    idem_testkit::wait_for("redis answers", Duration::from_secs(30), || {
        let (client, answer, cmd) = (client.clone(), Arc::clone(&answer), cmd.clone());
        async move {
            let Ok(mut c) = client.get_multiplexed_async_connection().await else { return false };
            let got: Result<T, _> = cmd.query_async(&mut c).await;
            got.map(|v| *answer.lock().unwrap() = Some(v)).is_ok()
        }
    })
    .await;
    answer.lock().unwrap().take().expect("set when answered")
}

/// A private NATS server with JetStream on disk, stopped (SIGTERM) and started again under the
/// PostgreSQL inbox: the client reconnects by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_under_load() {
    use idem::nats::JetStreamPublisher;
    use idem::nats::async_nats::{self, jetstream};
    let Some(pg) = pg_url() else { return };
    let args = ["-a", "127.0.0.1", "-p", "{port}", "-js", "-sd", "{dir}"];
    let Some(server) = Private::start("nats-server", &args).await else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let url = format!("127.0.0.1:{}", server.port);
    let subject = format!("restart.{}", rand::rng().random::<u32>());
    let js = jetstream::new(async_nats::connect(&url).await.unwrap());
    let s = js
        .create_stream(jetstream::stream::Config {
            name: stream(&subject),
            subjects: vec![subject.clone(), format!("{subject}.dlq")],
            duplicate_window: Duration::from_millis(100),
            // A bounded age: the consumer refuses a stream that keeps messages for ever.
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .unwrap();
    s.create_consumer(jetstream::consumer::pull::Config {
        durable_name: Some("restarts".into()),
        filter_subject: subject.clone(),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_secs(5),
        max_deliver: 100,
        ..Default::default()
    })
    .await
    .unwrap();
    let (pool, schema) = pg_schema(&pg).await;
    PostgresStore::new(pool.clone()).with_schema(&schema).unwrap().migrate().await.unwrap();
    let ledger = Ledger::Pg { pool: pool.clone(), table: format!("\"{schema}\".ledger") };
    let server = Arc::new(tokio::sync::Mutex::new(server));
    let backlog = {
        let (js, name) = (js.clone(), stream(&subject));
        move || -> BoxFut<'static, Option<u64>> {
            let (js, name) = (js.clone(), name.clone());
            Box::pin(async move {
                let mut c: jetstream::consumer::PullConsumer =
                    js.get_consumer_from_stream("restarts", &name).await.ok()?;
                let info = c.info().await.ok()?;
                Some(info.num_pending + info.num_ack_pending as u64)
            })
        }
    };
    let fault = {
        let server = Arc::clone(&server);
        move || -> BoxFut<'static, ()> {
            Box::pin(
                async move { server.lock().await.restart(false, Duration::from_secs(1)).await },
            )
        }
    };
    scenario(
        "nats restart",
        &BrokerSpec::Nats { url: url.clone(), subject: subject.clone() },
        &StoreSpec::PgInbox { url: pg.clone(), schema: schema.clone() },
        &ledger,
        JetStreamPublisher::new(js.clone()),
        backlog,
        fault,
        Expect { exactly_once: true },
    )
    .await;
    drop_pg_schema(&pool, &schema).await;
}

mod kafka {
    use super::*;
    use idem::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use idem::kafka::rdkafka::client::DefaultClientContext;
    use idem::kafka::rdkafka::config::ClientConfig;
    use idem::kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
    use idem::kafka::rdkafka::{Offset, TopicPartitionList};

    pub(super) const GROUP: &str = "restarts";
    pub(super) const PARTITIONS: i32 = 3;

    pub(super) fn config(brokers: &str) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", brokers)
            .set("group.id", GROUP)
            .set("session.timeout.ms", "6000")
            .set("heartbeat.interval.ms", "500")
            .set("max.poll.interval.ms", "30000")
            .set("topic.metadata.refresh.interval.ms", "1000");
        c
    }

    /// tansu is built by `.ci/services.sh`; `IDEM_TEST_TANSU` points at another binary.
    pub(super) fn binary() -> String {
        std::env::var("IDEM_TEST_TANSU").unwrap_or_else(|_| {
            let home = std::env::var("HOME").unwrap_or_default();
            let installed = format!("{home}/.cargo/bin/tansu");
            if Path::new(&installed).exists() { installed } else { "tansu".into() }
        })
    }

    pub(super) async fn create(brokers: &str, topic: &str) {
        let admin: AdminClient<DefaultClientContext> =
            ClientConfig::new().set("bootstrap.servers", brokers).create().unwrap();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        for t in [NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1))] {
            for r in admin.create_topics(&[t], &opts).await.unwrap() {
                r.unwrap();
            }
        }
        let dlq = format!("{topic}-dlq");
        for r in admin
            .create_topics(&[NewTopic::new(&dlq, 1, TopicReplication::Fixed(1))], &opts)
            .await
            .unwrap()
        {
            r.unwrap();
        }
        // The admin client's drop joins its thread: not on the runtime.
        std::thread::spawn(move || drop(admin));
    }

    /// Records of `topic` past the group's committed offsets; `None` while the broker is away.
    /// On a thread of its own: librdkafka calls block.
    pub(super) fn backlog(
        brokers: String,
        topic: String,
    ) -> impl Fn() -> BoxFut<'static, Option<u64>> {
        move || {
            let (brokers, topic) = (brokers.clone(), topic.clone());
            Box::pin(async move {
                let (tx, rx) = tokio::sync::oneshot::channel();
                std::thread::spawn(move || {
                    let c: BaseConsumer = config(&brokers).create().unwrap();
                    let mut tpl = TopicPartitionList::new();
                    for p in 0..PARTITIONS {
                        tpl.add_partition(&topic, p);
                    }
                    let t = Duration::from_secs(5);
                    let answer = c.committed_offsets(tpl, t).ok().and_then(|got| {
                        let mut left = 0u64;
                        for e in got.elements() {
                            let (_, high) = c.fetch_watermarks(&topic, e.partition(), t).ok()?;
                            let done = match e.offset() {
                                Offset::Offset(o) => o,
                                _ => 0,
                            };
                            left += u64::try_from(high - done).unwrap_or(0);
                        }
                        Some(left)
                    });
                    let _ = tx.send(answer);
                });
                rx.await.ok().flatten()
            })
        }
    }
}

/// A private tansu (the Kafka-protocol broker) storing in a SQLite file, stopped (SIGTERM) and
/// started again under the PostgreSQL inbox: librdkafka reconnects by itself and the group
/// resumes from its committed offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_restart_under_load() {
    use idem::kafka::KafkaPublisher;
    use idem::kafka::rdkafka::config::ClientConfig;
    let Some(pg) = pg_url() else { return };
    // The shared broker answering means tansu is installed (.ci/services.sh may still be
    // building it on a new machine: this waits for it).
    let shared = "IDEM_TEST_KAFKA_BROKERS";
    if idem_testkit::service::require("Kafka (tansu)", shared, "127.0.0.1:9092").is_none() {
        return;
    }
    let tansu = kafka::binary();
    let args = [
        "broker",
        "--listener-url",
        "tcp://127.0.0.1:{port}",
        "--advertised-listener-url",
        "tcp://127.0.0.1:{port}",
        "--storage-engine",
        // Relative to the working directory, which is the server's directory.
        "sqlite://tansu.db",
    ];
    let Some(server) = Private::start(&tansu, &args).await else { return };
    let _one = ONE_AT_A_TIME.lock().await;
    let brokers = format!("127.0.0.1:{}", server.port);
    let topic = format!("restart-{}", rand::rng().random::<u32>());
    kafka::create(&brokers, &topic).await;
    // One record per batch: tansu 0.6.0 skips records when a fetch starts inside a batch.
    let mut pc = ClientConfig::new();
    pc.set("bootstrap.servers", &brokers).set("batch.num.messages", "1").set("linger.ms", "5");
    let publisher = KafkaPublisher::with_config(&pc).unwrap();
    let (pool, schema) = pg_schema(&pg).await;
    PostgresStore::new(pool.clone()).with_schema(&schema).unwrap().migrate().await.unwrap();
    let ledger = Ledger::Pg { pool: pool.clone(), table: format!("\"{schema}\".ledger") };
    let server = Arc::new(tokio::sync::Mutex::new(server));
    let fault = {
        let server = Arc::clone(&server);
        move || -> BoxFut<'static, ()> {
            Box::pin(
                async move { server.lock().await.restart(false, Duration::from_secs(1)).await },
            )
        }
    };
    scenario(
        "kafka (tansu) restart",
        &BrokerSpec::Kafka { brokers: brokers.clone(), topic: topic.clone() },
        &StoreSpec::PgInbox { url: pg.clone(), schema: schema.clone() },
        &ledger,
        publisher,
        kafka::backlog(brokers.clone(), topic.clone()),
        fault,
        Expect { exactly_once: true },
    )
    .await;
    drop_pg_schema(&pool, &schema).await;
}
