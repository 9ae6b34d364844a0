//! Network partitions. The consumers run in a child process (this test binary again) inside a
//! network namespace of the test's own; they reach PostgreSQL, RabbitMQ and Redis through
//! TCP proxies of the test on the namespace's veth pair (`idem_testkit::netns`,
//! `idem_testkit::proxy`). Setting the pair's host side down cuts every connection without a
//! reset — they go half-open, as in a real partition — and setting it up heals it. The child
//! runs each consumer under a supervisor, as a service manager would: a run that ends with an
//! error is printed and a new run starts with new connections.
//!
//! - Under load, the link is cut for longer than the AMQP heartbeat timeout and the lease, then
//!   healed: every message's effect is in a ledger without a unique constraint exactly once (the
//!   PostgreSQL inbox), or once plus reruns the engine flagged as takeovers of an expired lease
//!   with the same downstream key (two-phase over Redis); the queue drains; the ledger grows
//!   again within [`RESUME_BOUND`] of the heal.
//! - Idle, the link is cut and stays down, or the broker connection is stalled (open, but
//!   nothing forwarded): the consumer notices within [`DETECT_BOUND`] (RabbitMQ: the
//!   heartbeat) or [`STREAM_DETECT_BOUND`] (a Redis stream: the consumer's bound on a fetch)
//!   and its run ends with an error saying so; after the heal it consumes again.
//! - One of two hosts is cut under load and stays cut: the other finishes every message
//!   exactly once, because PostgreSQL gives up the cut host's open transaction (whose inbox
//!   markers' row locks the other host's marks wait on) after [`IDLE_IN_TRANSACTION`]. Without
//!   that setting the other host waited past the 60 s limit (`idle in transaction` for the cut
//!   host, `Lock: transactionid` for the other, in `pg_stat_activity`).
//!
//! Under load the consumers are blocked in PostgreSQL reads while cut (sqlx sets no TCP
//! keepalive): they notice only after the heal; the AMQP heartbeat ends their broker
//! connections meanwhile, so the broker hands their deliveries to others.
//!
//! They need root and iproute2: otherwise they print `skipped: network namespaces unavailable
//! (<why>)`, and fail under `CI=true`.
#![cfg(all(feature = "amqp", feature = "postgres", feature = "redis"))]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed setup step is the test failing

use std::collections::HashMap;
use std::future::Future;
use std::net::{SocketAddr, ToSocketAddrs};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::PostgresStore;
use idem::amqp::AmqpPublisher;
use idem::amqp::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use idem::amqp::lapin::types::FieldTable;
use idem::amqp::lapin::{Connection, ConnectionProperties};
use idem::outbox::{OutboxId, Outgoing, Publisher};
use idem::sqlx::{self, AssertSqlSafe};
use idem_testkit::netns::Netns;
use idem_testkit::proxy::Proxy;
use rand::Rng;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;

const UNIQUE: usize = 2_000;
const DUPLICATES: usize = 400;
const WEEK: Duration = Duration::from_secs(7 * 86_400);
/// Consumers in the child process, each under its own supervisor.
const CONSUMERS: usize = 2;
/// The AMQP heartbeat the child asks for (seconds): lapin closes a connection that read nothing
/// for two of them, RabbitMQ one whose client sent nothing for two.
const HEARTBEAT: u64 = 2;
/// The two-phase lease: shorter than the partition, so the partition outlasts it.
const LEASE: Duration = Duration::from_secs(3);
/// How long the link stays cut under load: longer than the heartbeat timeout and the lease.
const PARTITION: Duration = Duration::from_secs(8);
/// From the heal to the ledger growing again. The worst case: a statement sent into the cut
/// link is retransmitted on TCP's back-off (0.2 s doubling: the retransmission after 8 s
/// down comes about 6.4 s after the one before), then the consumers' runs end on their dead
/// AMQP connections (the broker timeout, 5 s) and reconnect (a 250 ms restart delay).
const RESUME_BOUND: Duration = Duration::from_secs(20);
/// From the cut (or the stall) to an idle consumer's run ending: lapin gives up on the server
/// after two heartbeats without a byte and checks every half heartbeat (≤ 5 s with a 2 s
/// heartbeat), plus scheduling.
const DETECT_BOUND: Duration = Duration::from_secs(7);
/// From the cut to an idle Redis Streams consumer's run ending. A fetch blocked in its read is
/// given the idle wait (200 ms) plus the broker timeout (5 s here; 30 s by default) and then
/// ends the run; a fetch that fails instead (its reader connection given up, a new one cannot
/// connect: up to 5 s each) is tried [`FETCH_FAILURES`] times 500 ms apart: at worst
/// 5.2 + 3 × 5.5 s, plus scheduling.
const STREAM_DETECT_BOUND: Duration = Duration::from_secs(25);
/// The consumers' PostgreSQL sessions' `idle_in_transaction_session_timeout`: how long the
/// server keeps the transaction of a client that went silent (and the row locks of its inbox
/// markers). Above the longest pause inside a handler's transaction.
const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);
/// The consumers' store timeout: a PostgreSQL call or inbox transaction on a connection the
/// partition left half-open is given up after it (sqlx sets no TCP keepalive).
const STORE_TIMEOUT: Duration = Duration::from_secs(4);
/// A consumer host cut from PostgreSQL and RabbitMQ for good ends its runs within this of the
/// cut: the store timeout, then the broker verb on the dead channel (broker timeout 5 s).
const PG_DETECT_BOUND: Duration = Duration::from_secs(20);
/// Anything a scenario waits for that should take seconds.
const LIMIT: Duration = Duration::from_secs(60);
const CHILD_ENV: &str = "IDEM_PARTITION_CHILD";
/// Fetch failures in a row that end a run, 500 ms apart (RabbitMQ's lost connection ends it at
/// the first: it is fatal). The default, 10 a second apart, would take up to a minute.
const FETCH_FAILURES: u32 = 3;

/// One scenario at a time: the detection and resume times are measured, and two children
/// sharing 2 cores would measure each other.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn pg_url() -> Option<String> {
    idem_testkit::service::require(
        "postgres",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
}

fn amqp_url() -> Option<String> {
    idem_testkit::service::require(
        "amqp",
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    )
}

fn redis_url() -> Option<String> {
    idem_testkit::service::require("redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/")
}

#[path = "partitions/child.rs"]
mod child;
use child::{Broker, Mode, Spec, sqlite};

/// The child process's entry: the consumers of [`child`], until its stdin closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the child process of the partition tests; run by them, not alone"]
async fn partition_child() {
    child::main().await;
}

// ---------------------------------------------------------------------------------------------
// The parent: namespace, proxies, the child, the ledger.

/// A namespace with one proxy per server on its host address.
struct Net {
    ns: Netns,
    amqp: Proxy,
    pg: Proxy,
    redis: Proxy,
}

/// `url` with its `host:port` replaced by `proxy`'s address.
fn through(url: &str, proxy: &Proxy) -> String {
    let hp = idem_testkit::service::host_port(url);
    assert!(url.contains(&hp), "{url} names its port");
    url.replacen(&hp, &proxy.addr().to_string(), 1)
}

fn upstream(url: &str) -> SocketAddr {
    idem_testkit::service::host_port(url).to_socket_addrs().unwrap().next().unwrap()
}

impl Net {
    /// `None` (skipped) without namespaces or servers.
    async fn new() -> Option<(Self, String, String, String)> {
        let (pg, amqp, redis) = (pg_url()?, amqp_url()?, redis_url()?);
        let ns = idem_testkit::netns::require()?;
        let host = ns.host_ip();
        let amqp_p = Proxy::start((host, 0), upstream(&amqp)).await.unwrap();
        let pg_p = Proxy::start((host, 0), upstream(&pg)).await.unwrap();
        let redis_p = Proxy::start((host, 0), upstream(&redis)).await.unwrap();
        Some((Self { ns, amqp: amqp_p, pg: pg_p, redis: redis_p }, pg, amqp, redis))
    }

    /// The child's AMQP URL: through the proxy, with the test's heartbeat.
    fn amqp_url(&self, amqp: &str) -> String {
        let sep = if amqp.contains('?') { '&' } else { '?' };
        format!("{}{sep}heartbeat={HEARTBEAT}&connection_timeout=3000", through(amqp, &self.amqp))
    }
}

/// The child process inside the namespace and the lines it printed, with when they arrived.
struct Child {
    process: tokio::process::Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    /// Reads the child's stdout into `lines` until it closes.
    reader: tokio::task::JoinHandle<()>,
}

impl Child {
    fn spawn(ns: &Netns, spec: &Spec) -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = ns.command(exe);
        let entry = idem_testkit::process::child_entry(module_path!(), "partition_child");
        cmd.args([entry.as_str(), "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, serde_json::to_string(spec).unwrap())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut process = cmd.spawn().expect("spawn the child in the namespace");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let (out, seen) = (process.stdout.take().unwrap(), Arc::clone(&lines));
        let reader = tokio::spawn(async move {
            let mut out = BufReader::new(out).lines();
            while let Ok(Some(l)) = out.next_line().await {
                // libtest prints `test … ... ` on the same line first.
                let l = l.rsplit("... ").next().unwrap_or(&l).to_owned();
                seen.lock().unwrap().push((Instant::now(), l));
            }
        });
        Self { process, lines, reader }
    }

    /// The lines starting with `prefix` that arrived after `since`.
    fn after(&self, since: Instant, prefix: &str) -> Vec<(Instant, String)> {
        let lines = self.lines.lock().unwrap();
        lines.iter().filter(|(t, l)| *t >= since && l.starts_with(prefix)).cloned().collect()
    }

    /// Closes the child's stdin (its stop signal) and waits for it to finish its runs.
    async fn stop(mut self) -> Vec<String> {
        drop(self.process.stdin.take());
        let status = tokio::time::timeout(LIMIT, self.process.wait())
            .await
            .expect("the child stops when asked")
            .unwrap();
        // The process has exited, but its last lines may still be in the pipe: read to its end
        // before looking (a `CHILD_DONE` printed just before the exit was once missed).
        tokio::time::timeout(LIMIT, self.reader)
            .await
            .expect("the child's stdout closes when it exits")
            .unwrap();
        let lines: Vec<String> = self.lines.lock().unwrap().iter().map(|l| l.1.clone()).collect();
        assert!(status.success(), "the child failed: {lines:?}");
        lines
    }
}

/// A durable queue of `ids` (persistent messages, confirmed).
async fn queue(amqp: &str, ids: &[String]) -> String {
    let queue = format!("idem.partition.{}", rand::rng().random::<u32>());
    let conn = Connection::connect(amqp, ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await
        .unwrap();
    let publisher = AmqpPublisher::new(ch).await.unwrap().persistent(true);
    let messages: Vec<_> = ids
        .iter()
        .map(|id| {
            Outgoing::new(&queue, id.clone())
                .id(OutboxId::new(id).unwrap())
                .into_message(OutboxId::random)
        })
        .collect();
    for chunk in messages.chunks(500) {
        for r in publisher.publish(chunk).await {
            r.expect("published with confirms");
        }
    }
    let _ = conn.close(200, "done".into()).await;
    queue
}

/// Messages ready in `queue`; `None` when it does not exist. Unacknowledged ones are not
/// counted.
async fn ready(amqp: &str, queue: &str) -> Option<u32> {
    let conn = Connection::connect(amqp, ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let opts = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::durable() };
    let info = ch.queue_declare(queue.into(), opts, FieldTable::default()).await.ok();
    let _ = conn.close(200, "done".into()).await;
    info.map(|i| i.message_count())
}

/// Messages ready in the work queue and in its delay queue (retries of a key found in
/// progress elsewhere wait there); unacknowledged ones are not counted.
async fn backlog(amqp: &str, queue: &str) -> u32 {
    let delayed = ready(amqp, &format!("{queue}.idem.delay")).await.unwrap_or(0);
    ready(amqp, queue).await.expect("the work queue exists") + delayed
}

/// Deletes the work queue and the companions the consumer declared (delay queue, dead-letter
/// exchange and queue) when dropped, also when the test failed.
fn queue_guard(amqp: &str, queue: &str) -> Defer {
    let (amqp, queue) = (amqp.to_owned(), queue.to_owned());
    defer(move || async move {
        use idem::amqp::lapin::options::ExchangeDeleteOptions;
        let Ok(conn) = Connection::connect(&amqp, ConnectionProperties::default()).await else {
            return;
        };
        for q in [queue.clone(), format!("{queue}.idem.delay"), format!("{queue}.idem.dlq")] {
            // A channel each: deleting a queue that was never declared closes the channel.
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
            }
        }
        if let Ok(ch) = conn.create_channel().await {
            let dlx = format!("{queue}.idem.dlx");
            let _ = ch.exchange_delete(dlx.as_str().into(), ExchangeDeleteOptions::default()).await;
        }
        let _ = conn.close(200, "done".into()).await;
    })
}

/// Nothing was dead-lettered: no message here is a conflict or a poison.
async fn assert_no_dead_letters(amqp: &str, queue: &str) {
    let dead = ready(amqp, &format!("{queue}.idem.dlq")).await.unwrap_or(0);
    assert_eq!(dead, 0, "nothing is dead-lettered");
}

type Job = Box<dyn FnOnce() -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Runs its job when dropped — also when the test failed — on a runtime of its own, so what a
/// scenario made on the shared servers is deleted either way.
struct Defer(Option<Job>);

fn defer<F: Future<Output = ()> + Send + 'static>(
    job: impl FnOnce() -> F + Send + 'static,
) -> Defer {
    Defer(Some(Box::new(move || Box::pin(job()))))
}

impl Drop for Defer {
    fn drop(&mut self) {
        let Some(job) = self.0.take() else { return };
        // A thread of its own: dropped inside the test's runtime, which cannot block on it.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
            if let Ok(rt) = rt {
                rt.block_on(job());
            }
        })
        .join();
    }
}

/// Drops the PostgreSQL schema when dropped.
fn schema_guard(pg: &str, schema: &str) -> Defer {
    let (pg, sql) = (pg.to_owned(), format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"));
    defer(move || async move {
        use sqlx::Connection as _;
        if let Ok(mut c) = sqlx::PgConnection::connect(&pg).await {
            let _ = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut c).await;
        }
    })
}

/// Deletes the Redis keys matching `pattern` when dropped.
fn redis_guard(url: &str, pattern: String) -> Defer {
    let url = url.to_owned();
    defer(move || async move {
        use idem::redis::redis;
        let Ok(client) = redis::Client::open(url) else { return };
        let Ok(mut c) = client.get_multiplexed_async_connection().await else { return };
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(pattern).query_async(&mut c).await.unwrap_or_default();
        if !keys.is_empty() {
            let _: Result<(), _> = redis::cmd("DEL").arg(&keys).query_async(&mut c).await;
        }
    })
}

/// Where the parent reads the effects: rows per message id.
enum Ledger {
    Pg { pool: sqlx::PgPool, schema: String },
    Sqlite { pool: sqlx::SqlitePool, _dir: tempfile::TempDir },
}

impl Ledger {
    /// A PostgreSQL schema with the inbox's table and a ledger without a unique constraint.
    async fn pg(url: &str) -> Self {
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(url).await;
        let pool = pool.unwrap();
        let schema = format!("idem_partition_{}", rand::rng().random::<u32>());
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE SCHEMA \"{schema}\"; CREATE TABLE \"{schema}\".ledger (id TEXT NOT NULL)"
        )))
        .execute(&pool)
        .await
        .unwrap();
        PostgresStore::new(pool.clone()).with_schema(&schema).unwrap().migrate().await.unwrap();
        Self::Pg { pool, schema }
    }

    /// Drops a PostgreSQL ledger's schema when dropped.
    fn guard(&self, pg: &str) -> Option<Defer> {
        let Self::Pg { schema, .. } = self else { return None };
        Some(schema_guard(pg, schema))
    }

    /// A SQLite ledger in a temporary directory, with the downstream key and takeover flag.
    async fn sqlite() -> (Self, String) {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("ledger.sqlite").to_string_lossy().into_owned();
        let pool = sqlite(&file).await;
        let sql = "CREATE TABLE ledger (id TEXT NOT NULL, downstream TEXT NOT NULL, \
                   took_over BIGINT NOT NULL)";
        sqlx::raw_sql(sql).execute(&pool).await.unwrap();
        (Self::Sqlite { pool, _dir: dir }, file)
    }

    /// (rows, distinct ids).
    async fn count(&self) -> (i64, i64) {
        let sql = "SELECT count(*), count(DISTINCT id) FROM ledger";
        match self {
            Self::Pg { pool, schema } => {
                let sql = sql.replace("ledger", &format!("\"{schema}\".ledger"));
                sqlx::query_as(AssertSqlSafe(sql)).fetch_one(pool).await.unwrap()
            }
            Self::Sqlite { pool, .. } => sqlx::query_as(sql).fetch_one(pool).await.unwrap(),
        }
    }
}

/// Waits until the ledger has `n` distinct ids; when it got there.
async fn ledger_reaches(ledger: &Ledger, n: i64, what: &str) -> Instant {
    idem_testkit::wait_for(what, LIMIT, || async { ledger.count().await.1 >= n }).await;
    Instant::now()
}

/// What a partition under load measured.
struct UnderLoad {
    /// From the cut to the first run that ended with an error.
    detected: Option<Duration>,
    /// From the heal to the ledger growing again.
    resumed: Duration,
    /// Distinct ids in the ledger at the cut and at the heal.
    at_cut: i64,
    at_heal: i64,
    runs_ended: Vec<String>,
    /// Children started after the first one stopped, to drain what it handed back.
    drains: usize,
}

/// Runs the child on `spec`, cuts the link for [`PARTITION`] once a third of the ledger is
/// written, heals it, and waits for every id's effect and a drained queue.
async fn partition_under_load(net: &Net, spec: &Spec, ledger: &Ledger, amqp: &str) -> UnderLoad {
    let child = Child::spawn(&net.ns, spec);
    ledger_reaches(ledger, (UNIQUE / 3) as i64, "a third of the ledger before the cut").await;
    let at_cut = ledger.count().await.1;
    let cut = Instant::now();
    net.ns.cut();
    // The partition's length is the fault itself, not a wait for a condition.
    tokio::time::sleep(PARTITION).await;
    let at_heal = ledger.count().await.1;
    let healed = Instant::now();
    net.ns.heal();
    let resumed = ledger_reaches(ledger, at_heal + 1, "the ledger growing after the heal").await;
    ledger_reaches(ledger, UNIQUE as i64, "every id's effect").await;
    idem_testkit::wait_for("the queue drained", LIMIT, || async {
        backlog(amqp, spec.queue()).await == 0
    })
    .await;
    let detected = child.after(cut, "RUN_ENDED").first().map(|(t, _)| *t - cut);
    let runs_ended = child.after(cut, "RUN_ENDED").into_iter().map(|(_, l)| l).collect();
    let lines = child.stop().await;
    // A consumer between runs (its last one ended on the dead connection) stops without a
    // report: the child ending is what counts.
    assert!(lines.iter().any(|l| l == "CHILD_DONE"), "{lines:?}");
    // Consumers that stop hand back what they had fetched ahead (RabbitMQ counts only ready
    // messages, so the wait above did not see them): another child drains until none is.
    let mut drains = 0;
    while backlog(amqp, spec.queue()).await > 0 {
        drains += 1;
        assert!(drains <= 5, "the queue never settles");
        let again = Child::spawn(&net.ns, spec);
        idem_testkit::wait_for("the queue drained again", LIMIT, || async {
            backlog(amqp, spec.queue()).await == 0
        })
        .await;
        again.stop().await;
    }
    UnderLoad { detected, resumed: resumed - healed, at_cut, at_heal, runs_ended, drains }
}

fn report(name: &str, m: &UnderLoad, rows: i64, distinct: i64) {
    println!(
        "{name}: {rows} ledger rows, {distinct} distinct of {UNIQUE} ({DUPLICATES} duplicates \
         delivered); cut at {} for {PARTITION:?}, {} at the heal; first run ended {:?} after \
         the cut; ledger growing again {:.2} s after the heal; {} runs ended with an error; \
         {} extra drains",
        m.at_cut,
        m.at_heal,
        m.detected,
        m.resumed.as_secs_f64(),
        m.runs_ended.len(),
        m.drains
    );
    for l in &m.runs_ended {
        println!("  {l}");
    }
}

/// RabbitMQ in front of the PostgreSQL inbox, the link cut under load for longer than the
/// heartbeat timeout, then healed: every effect exactly once, nothing lost, the queue drained,
/// the ledger growing again within [`RESUME_BOUND`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_inbox_partitioned_under_load_then_healed() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((net, pg, amqp, _)) = Net::new().await else { return };
    let tag = format!("p{}", rand::rng().random::<u32>());
    let queue =
        queue(&amqp, &idem_testkit::workload::ids_with_duplicates(&tag, UNIQUE, DUPLICATES)).await;
    let _queue_gone = queue_guard(&amqp, &queue);
    let ledger = Ledger::pg(&pg).await;
    let _schema_gone = ledger.guard(&pg);
    let Ledger::Pg { schema, .. } = &ledger else { unreachable!() };
    let spec = Spec {
        broker: Broker::Amqp { url: net.amqp_url(&amqp), queue: queue.clone() },
        mode: Mode::PgInbox { pg: through(&pg, &net.pg), schema: schema.clone() },
    };
    let m = partition_under_load(&net, &spec, &ledger, &amqp).await;
    let (rows, distinct) = ledger.count().await;
    report("postgres inbox, link cut under load", &m, rows, distinct);
    assert!(m.at_heal >= m.at_cut, "the ledger never shrinks");
    assert_eq!(distinct, UNIQUE as i64, "every message has its effect");
    assert_eq!(rows, UNIQUE as i64, "no effect twice");
    assert!(m.detected.is_some(), "no run noticed the partition");
    assert!(m.resumed <= RESUME_BOUND, "resumed {:?} after the heal", m.resumed);
    assert_no_dead_letters(&amqp, &queue).await;
}

/// RabbitMQ in front of the two-phase Redis store, the link cut under load for longer than the
/// lease, then healed: every message has its effect; a message whose completion the cut
/// stopped is run again only as a takeover of its expired lease, with the same downstream key
/// (an effect keyed by it happens once); the queue drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_two_phase_partitioned_under_load_then_healed() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((net, _, amqp, redis)) = Net::new().await else { return };
    let tag = format!("r{}", rand::rng().random::<u32>());
    let queue =
        queue(&amqp, &idem_testkit::workload::ids_with_duplicates(&tag, UNIQUE, DUPLICATES)).await;
    let _queue_gone = queue_guard(&amqp, &queue);
    let (ledger, file) = Ledger::sqlite().await;
    let namespace = format!("idem-partition-{}", rand::rng().random::<u32>());
    let _keys_gone = redis_guard(&redis, format!("idem:{{{namespace}}}:*"));
    let spec = Spec {
        broker: Broker::Amqp { url: net.amqp_url(&amqp), queue: queue.clone() },
        mode: Mode::RedisTwoPhase {
            redis: through(&redis, &net.redis),
            namespace: namespace.clone(),
            ledger: file,
        },
    };
    let m = partition_under_load(&net, &spec, &ledger, &amqp).await;
    let (rows, distinct) = ledger.count().await;
    report("redis two-phase, link cut under load", &m, rows, distinct);
    let Ledger::Sqlite { pool, .. } = &ledger else { unreachable!() };
    let per_id: Vec<(String, i64, i64, i64)> = sqlx::query_as(
        "SELECT id, count(*), count(DISTINCT downstream), sum(took_over) FROM ledger GROUP BY id",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let reruns: HashMap<&str, i64> =
        per_id.iter().filter(|r| r.1 > 1).map(|r| (r.0.as_str(), r.1 - 1)).collect();
    println!("  {} effects repeated, on {} ids", rows - distinct, reruns.len());
    assert_eq!(distinct, UNIQUE as i64, "every message has its effect");
    for (id, runs, downstream, took_over) in &per_id {
        assert_eq!(*downstream, 1, "{id}: one downstream key across its {runs} runs");
        // A claim whose answer the cut lost makes even a first run a takeover: at least.
        assert!(*took_over >= runs - 1, "{id}: every rerun is a takeover of an expired lease");
    }
    assert!(m.detected.is_some(), "no run noticed the partition");
    assert!(m.resumed <= RESUME_BOUND, "resumed {:?} after the heal", m.resumed);
    assert_no_dead_letters(&amqp, &queue).await;
}

/// Which fault an idle consumer meets.
#[derive(Debug, Clone, Copy)]
enum Idle {
    /// The link goes down and stays down: its connections are half-open.
    Cut,
    /// The broker's proxy stops forwarding; TCP stays up (keepalive would see a live peer).
    Stall,
}

/// Which broker an idle consumer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdleOn {
    /// RabbitMQ: the consumer waits for deliveries on its connection; the heartbeat notices.
    Rabbit,
    /// A Redis stream: the consumer blocks in `XREADGROUP … BLOCK` for its idle wait; a fetch
    /// that outlasts the idle wait plus the broker timeout ends the run, and so do
    /// [`FETCH_FAILURES`] failed fetches in a row.
    Stream,
}

/// An idle consumer (nothing to read, blocked in its read from the broker) meets `fault`: its
/// run ends (within [`DETECT_BOUND`] on RabbitMQ, naming the lost heartbeat; within
/// [`STREAM_DETECT_BOUND`] on a Redis stream, saying the connection looks lost or naming the
/// Redis command that failed); once
/// healed it processes a new message. Returns (detection, resume) times.
async fn idle_consumer_notices(on: IdleOn, fault: Idle) -> Option<(Duration, Duration)> {
    let _one = ONE_AT_A_TIME.lock().await;
    let (net, pg, amqp, redis) = Net::new().await?;
    let ledger = Ledger::pg(&pg).await;
    let _schema_gone = ledger.guard(&pg);
    let Ledger::Pg { schema, .. } = &ledger else { unreachable!() };
    let mode = Mode::PgInbox { pg: through(&pg, &net.pg), schema: schema.clone() };
    let broker = match on {
        IdleOn::Rabbit => Broker::Amqp { url: net.amqp_url(&amqp), queue: queue(&amqp, &[]).await },
        IdleOn::Stream => Broker::Stream {
            url: through(&redis, &net.redis),
            stream: format!("idem-partition-{}", rand::rng().random::<u32>()),
        },
    };
    let spec = Spec { broker, mode };
    let _broker_gone = match &spec.broker {
        Broker::Amqp { queue, .. } => queue_guard(&amqp, queue),
        // The stream and its dead-letter stream.
        Broker::Stream { stream, .. } => redis_guard(&redis, format!("{stream}*")),
    };
    let spawned = Instant::now();
    let child = Child::spawn(&net.ns, &spec);
    // Idle: every consumer's source is open (consuming) and there is nothing to read, so each
    // is blocked in its read from the broker until the fault.
    idem_testkit::wait_for("the consumers consuming", LIMIT, || {
        let n = child.after(spawned, "CONSUMING").len();
        async move { n >= CONSUMERS }
    })
    .await;
    let fault_at = Instant::now();
    match fault {
        Idle::Cut => net.ns.cut(),
        Idle::Stall if on == IdleOn::Rabbit => net.amqp.stall(),
        Idle::Stall => net.redis.stall(),
    }
    // Each consumer's first run that ended (a restarted run may end again, on a connect).
    let firsts = || {
        let ended = child.after(fault_at, "RUN_ENDED");
        (0..CONSUMERS)
            .filter_map(|i| {
                let me = format!("RUN_ENDED {i} ");
                ended.iter().find(|(_, l)| l.starts_with(&me)).cloned()
            })
            .collect::<Vec<_>>()
    };
    idem_testkit::wait_for("every consumer noticed", LIMIT, || {
        let n = firsts().len();
        async move { n == CONSUMERS }
    })
    .await;
    let ended = firsts();
    let detected = ended.iter().map(|(t, _)| *t - fault_at).max().unwrap();
    for (_, l) in &ended {
        println!("  {l}");
        let why: &[&str] =
            if on == IdleOn::Rabbit { &["heartbeat"] } else { &["looks lost", "Redis `"] };
        assert!(why.iter().any(|w| l.contains(w)), "the error says one of {why:?}: {l}");
    }
    // Heal, then a new message is processed by a new run.
    let healed = Instant::now();
    match fault {
        Idle::Cut => net.ns.heal(),
        Idle::Stall => {
            let proxy = if on == IdleOn::Rabbit { &net.amqp } else { &net.redis };
            proxy.resume();
            // The stalled connections were given up on by the client; close them.
            proxy.close_all();
        }
    }
    let id = format!("i{}-0", rand::rng().random::<u32>());
    match &spec.broker {
        Broker::Amqp { queue, .. } => assert!(queue_publish(&amqp, queue, &id).await),
        Broker::Stream { stream, .. } => stream_publish(&redis, stream, &id).await,
    }
    ledger_reaches(&ledger, 1, "a message processed after the heal").await;
    let resumed = healed.elapsed();
    child.stop().await;
    assert_eq!(ledger.count().await, (1, 1));
    match &spec.broker {
        Broker::Amqp { queue, .. } => assert_no_dead_letters(&amqp, queue).await,
        Broker::Stream { stream, .. } => assert_no_dead_stream_letters(&redis, stream).await,
    }
    Some((detected, resumed))
}

/// `XADD` of one message with the stream source's default fields.
async fn stream_publish(url: &str, stream: &str, id: &str) {
    use idem::redis::redis;
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let _: String = redis::cmd("XADD")
        .arg(stream)
        .arg("*")
        .arg("message_id")
        .arg(id)
        .arg("payload")
        .arg(r#"{"n":1}"#)
        .query_async(&mut c)
        .await
        .unwrap();
}

/// Nothing was dead-lettered to the stream's dead-letter stream.
async fn assert_no_dead_stream_letters(url: &str, stream: &str) {
    use idem::redis::redis;
    let client = redis::Client::open(url).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let dead = format!("{stream}:dead-letter");
    let dead_letters: u64 = redis::cmd("XLEN").arg(&dead).query_async(&mut c).await.unwrap();
    assert_eq!(dead_letters, 0, "nothing is dead-lettered");
}

async fn queue_publish(amqp: &str, queue: &str, id: &str) -> bool {
    let conn = Connection::connect(amqp, ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let publisher = AmqpPublisher::new(ch).await.unwrap().persistent(true);
    let m = Outgoing::new(queue, id.to_owned())
        .id(OutboxId::new(id).unwrap())
        .into_message(OutboxId::random);
    let ok = publisher.publish(&[m]).await.into_iter().all(|r| r.is_ok());
    let _ = conn.close(200, "done".into()).await;
    ok
}

/// The link of an idle consumer goes down and stays down: its connections are half-open (no
/// reset, no FIN). The AMQP heartbeat ends its run within [`DETECT_BOUND`]; after the heal a
/// new run consumes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_consumer_notices_a_half_open_link() {
    let Some((detected, resumed)) = idle_consumer_notices(IdleOn::Rabbit, Idle::Cut).await else {
        return;
    };
    println!(
        "half-open link: every idle consumer's run ended {:.2} s after the cut (bound {DETECT_BOUND:?}, \
         heartbeat {HEARTBEAT} s); a new message processed {:.2} s after the heal",
        detected.as_secs_f64(),
        resumed.as_secs_f64()
    );
    assert!(detected <= DETECT_BOUND, "noticed after {detected:?}");
}

/// The broker connection of an idle consumer stalls: open, acknowledged by TCP, but no byte
/// forwarded (a hung broker or middlebox; TCP keepalive cannot see it). The AMQP heartbeat
/// ends its run within [`DETECT_BOUND`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_consumer_notices_a_stalled_broker_connection() {
    let Some((detected, resumed)) = idle_consumer_notices(IdleOn::Rabbit, Idle::Stall).await else {
        return;
    };
    println!(
        "stalled broker connection: every idle consumer's run ended {:.2} s after the stall \
         (bound {DETECT_BOUND:?}); a new message processed {:.2} s after the resume",
        detected.as_secs_f64(),
        resumed.as_secs_f64()
    );
    assert!(detected <= DETECT_BOUND, "noticed after {detected:?}");
}

/// The link of an idle Redis Streams consumer goes down and stays down. Its blocking read gets
/// no answer: the consumer's bound on a fetch, or its fetch-failure policy, ends the run
/// within [`STREAM_DETECT_BOUND`]; after the heal a new run consumes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_stream_consumer_notices_a_half_open_link() {
    let Some((detected, resumed)) = idle_consumer_notices(IdleOn::Stream, Idle::Cut).await else {
        return;
    };
    println!(
        "half-open link, Redis Streams: every idle consumer's run ended {:.2} s after the cut \
         (bound {STREAM_DETECT_BOUND:?}, broker timeout 5 s, {FETCH_FAILURES} failed fetches); \
         a new message processed {:.2} s after the heal",
        detected.as_secs_f64(),
        resumed.as_secs_f64()
    );
    assert!(detected <= STREAM_DETECT_BOUND, "noticed after {detected:?}");
}

/// Two consumer hosts on the PostgreSQL inbox; one is cut under load and stays cut. The
/// broker takes its deliveries back after the heartbeat timeout and the other host must finish
/// every message exactly once, which it can only do once PostgreSQL has given up the cut
/// host's open transaction (its inbox markers hold row locks the other host's marks wait on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_host_finishes_while_another_stays_partitioned() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some((cut_net, pg, amqp, _)) = Net::new().await else { return };
    let Some((ok_net, ..)) = Net::new().await else { return };
    let tag = format!("h{}", rand::rng().random::<u32>());
    let queue =
        queue(&amqp, &idem_testkit::workload::ids_with_duplicates(&tag, UNIQUE, DUPLICATES)).await;
    let _queue_gone = queue_guard(&amqp, &queue);
    let ledger = Ledger::pg(&pg).await;
    let _schema_gone = ledger.guard(&pg);
    let Ledger::Pg { schema, .. } = &ledger else { unreachable!() };
    let spec = |net: &Net| Spec {
        broker: Broker::Amqp { url: net.amqp_url(&amqp), queue: queue.clone() },
        mode: Mode::PgInbox { pg: through(&pg, &net.pg), schema: schema.clone() },
    };
    let (cut_spec, ok_spec) = (spec(&cut_net), spec(&ok_net));
    let cut_host = Child::spawn(&cut_net.ns, &cut_spec);
    let ok_host = Child::spawn(&ok_net.ns, &ok_spec);
    ledger_reaches(&ledger, (UNIQUE / 3) as i64, "a third of the ledger before the cut").await;
    let at_cut = ledger.count().await.1;
    let cut = Instant::now();
    cut_net.ns.cut();
    ledger_reaches(&ledger, UNIQUE as i64, "every id's effect from the other host").await;
    let finished = cut.elapsed();
    // The cut host notices while still cut: its consumers were blocked in PostgreSQL reads
    // that never answer; the store timeout gives them up and the run ends on the dead channel.
    idem_testkit::wait_for("the cut host's runs to end", PG_DETECT_BOUND, || async {
        !cut_host.after(cut, "RUN_ENDED").is_empty()
    })
    .await;
    let noticed = cut_host.after(cut, "RUN_ENDED")[0].0.duration_since(cut);
    assert!(noticed <= PG_DETECT_BOUND, "the cut host noticed after {noticed:?}");
    idem_testkit::wait_for("the queue drained", LIMIT, || async {
        backlog(&amqp, &queue).await == 0
    })
    .await;
    let lines = ok_host.stop().await;
    let ok_runs_ended = lines.iter().filter(|l| l.starts_with("RUN_ENDED")).count();
    // Heal so the cut host can see its stop signal through; it finds nothing left.
    cut_net.ns.heal();
    cut_host.stop().await;
    let (rows, distinct) = ledger.count().await;
    println!(
        "one of two hosts cut for good at {at_cut} of {UNIQUE}: the other finished every \
         effect {:.2} s after the cut ({rows} rows, {distinct} distinct; {ok_runs_ended} of its \
         runs ended with an error); the cut host's first run ended {:.2} s after the cut",
        finished.as_secs_f64(),
        noticed.as_secs_f64()
    );
    assert_eq!(distinct, UNIQUE as i64, "every message has its effect");
    assert_eq!(rows, UNIQUE as i64, "no effect twice");
    assert_no_dead_letters(&amqp, &queue).await;
}
