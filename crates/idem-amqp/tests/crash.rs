//! Crash tests on the real RabbitMQ: transactional-inbox mode and two-phase mode, each on
//! SQLite and on PostgreSQL.
//!
//! Three competing consumers take 5,000 messages: 4,000 unique ids, 999 producer duplicates
//! (same id, same body) and one id reused with a different body. Consumer A's connection is
//! cut (through a TCP proxy the test owns) while its handler is inside the transaction;
//! consumer C is a child process (this test binary re-run) that calls `std::process::abort()`
//! after its commit and before its ack. Consumer B survives. Pass: every unique id's row is in
//! the ledger (a table with no unique constraint) exactly once, the redelivered copies of the
//! two interrupted messages end as duplicates, the reused id is in the dead-letter queue with
//! its reason, and nothing is left in the queue or unacked.
//!
//! In two-phase mode the ledger row is the handler's effect and the engine records completion
//! afterwards; the cut falls after the effect and the abort after the completion, so exactly
//! once still holds there (a crash *between* effect and completion reruns the handler with the
//! same downstream key: that is what the key is for, and what the inbox mode avoids).
//!
//! On PostgreSQL every run gets a schema of its own (`idem_amqp_crash_<mode>_<pid>`) holding
//! both the store's table and the ledger; it is dropped afterwards, also when the test fails.
#![allow(clippy::unwrap_used, clippy::too_many_lines)]

mod common;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{Broker, DEFAULT_URL, PG_DEFAULT_URL, PgSchema};
use idem_amqp::lapin::options::BasicPublishOptions;
use idem_amqp::lapin::{BasicProperties, Connection, ConnectionProperties};
use idem_amqp::{AmqpConfig, AmqpConsumer, Delivery};
use idem_core::OutcomeKind;
use idem_core::consumer::{self, Report, Settlement};
use idem_core::engine::Verb;
use idem_core::engine::{Context, HandlerError};
use idem_core::{Inbox, Tx};
use idem_sqlx::{PostgresInbox, PostgresStore, SqliteInbox, SqliteStore};
use rand::seq::{IndexedRandom, SliceRandom};
use sqlx::postgres::PgPoolOptions;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;

const CHILD_ENV: &str = "IDEM_AMQP_CRASH_CHILD";
const UNIQUE: usize = 4_000;
const TOTAL: usize = 5_000;
const DROP_AT: usize = 40;
const ABORT_AT: usize = 60;
const LIMIT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
struct Seen {
    who: &'static str,
    key: String,
    outcome: String,
    redelivered: bool,
}

fn body(i: usize) -> Vec<u8> {
    format!(r#"{{"order":"order-{i:04}","cents":{}}}"#, 100 + i).into_bytes()
}

/// Each delivery's effect in inbox mode on SQLite: one ledger row (no unique constraint, so a
/// second effect shows), written in the batch's transaction.
async fn sqlite_ledger_write(
    mut tx: Tx<SqliteInbox>,
    m: Delivery,
    who: &'static str,
    cut: Cut,
) -> Result<(), HandlerError<String>> {
    let key = m.properties().message_id().as_ref().map(|s| s.to_string()).unwrap();
    sqlx::query("INSERT INTO ledger (key, body, who) VALUES (?, ?, ?)")
        .bind(&key)
        .bind(m.payload())
        .bind(who)
        .execute(&mut *tx)
        .await
        .map_err(|e| HandlerError::Transient(e.to_string()))?;
    hold_at_cut(cut, key).await;
    Ok(())
}

/// The same effect on PostgreSQL, in `<schema>.ledger`, inside the inbox's batch transaction.
async fn pg_ledger_write(
    mut tx: Tx<PostgresInbox>,
    m: Delivery,
    schema: String,
    who: &'static str,
    cut: Cut,
) -> Result<(), HandlerError<String>> {
    let key = m.properties().message_id().as_ref().map(|s| s.to_string()).unwrap();
    let sql = format!("INSERT INTO {schema}.ledger (key, body, who) VALUES ($1, $2, $3)");
    sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&key)
        .bind(m.payload())
        .bind(who)
        .execute(&mut *tx)
        .await
        .map_err(|e| HandlerError::Transient(e.to_string()))?;
    hold_at_cut(cut, key).await;
    Ok(())
}

/// At the `DROP_AT`th effect: tells the test (which cuts the connection) and waits for its go.
/// The row is written, nothing committed or acked yet (on PostgreSQL the batch's marks hold
/// their row locks, so a redelivery waits for the commit).
async fn hold_at_cut(cut: Cut, key: String) {
    if let Some((n, tell, go)) = cut
        && n.fetch_add(1, Ordering::SeqCst) + 1 == DROP_AT
    {
        tell.send(key).unwrap();
        go.notified().await;
    }
}

type Cut = Option<(Arc<AtomicUsize>, mpsc::UnboundedSender<String>, Arc<Notify>)>;

/// How the effect is made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The ledger row commits with the inbox marker.
    Inbox,
    /// The handler writes the ledger row under a lease; the engine then records completion.
    TwoPhase,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Inbox => "inbox",
            Self::TwoPhase => "two-phase",
        }
    }
}

/// The store under test, which also holds the ledger (a table with no unique constraint).
#[derive(Debug, Clone)]
enum Db {
    Sqlite(SqliteStore),
    /// The store in its own schema; the ledger is `<schema>.ledger`.
    Postgres(PostgresStore),
}

impl Db {
    /// Opens the same database again, as a separate consumer would (`spec` from
    /// [`Db::spec`]).
    async fn open(spec: &str) -> Self {
        match spec.split_once(':') {
            Some(("sqlite", path)) => Self::Sqlite(SqliteStore::open(path).await.unwrap()),
            Some(("postgres", schema)) => {
                let url = std::env::var("IDEM_TEST_POSTGRES_URL")
                    .unwrap_or_else(|_| PG_DEFAULT_URL.to_owned());
                let pool = PgPoolOptions::new().max_connections(4).connect(&url).await.unwrap();
                Self::Postgres(PostgresStore::new(pool).with_schema(schema).unwrap())
            }
            _ => panic!("bad store spec {spec:?}"),
        }
    }

    fn spec(&self, sqlite_path: &Path) -> String {
        match self {
            Self::Sqlite(_) => format!("sqlite:{}", sqlite_path.display()),
            Self::Postgres(s) => format!("postgres:{}", s.schema()),
        }
    }

    /// Creates the ledger: deliberately no unique constraint, so a second effect shows up as a
    /// second row.
    async fn create_ledger(&self) {
        match self {
            Self::Sqlite(s) => {
                sqlx::query(
                    "CREATE TABLE ledger (key TEXT NOT NULL, body BLOB NOT NULL, who TEXT NOT NULL)",
                )
                .execute(s.pool())
                .await
                .unwrap();
            }
            Self::Postgres(s) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                    "CREATE TABLE {}.ledger (key TEXT NOT NULL, body BYTEA NOT NULL, who TEXT NOT NULL)",
                    s.schema()
                )))
                .execute(s.pool())
                .await
                .unwrap();
            }
        }
    }

    /// One ledger row, outside any transaction (the two-phase effect).
    async fn insert(&self, key: &str, body: &[u8], who: &str) -> Result<(), sqlx::Error> {
        match self {
            Self::Sqlite(s) => {
                sqlx::query("INSERT INTO ledger (key, body, who) VALUES (?, ?, ?)")
                    .bind(key)
                    .bind(body)
                    .bind(who)
                    .execute(s.pool())
                    .await?;
            }
            Self::Postgres(s) => {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO {}.ledger (key, body, who) VALUES ($1, $2, $3)",
                    s.schema()
                )))
                .bind(key)
                .bind(body)
                .bind(who)
                .execute(s.pool())
                .await?;
            }
        }
        Ok(())
    }

    /// Distinct keys in the ledger.
    async fn distinct_keys(&self) -> i64 {
        match self {
            Self::Sqlite(s) => sqlx::query_scalar("SELECT COUNT(DISTINCT key) FROM ledger")
                .fetch_one(s.pool())
                .await
                .unwrap(),
            Self::Postgres(s) => sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT COUNT(DISTINCT key) FROM {}.ledger",
                s.schema()
            )))
            .fetch_one(s.pool())
            .await
            .unwrap(),
        }
    }

    /// Per key: one of its bodies and how many rows it has.
    async fn rows(&self) -> Vec<(String, Vec<u8>, i64)> {
        match self {
            Self::Sqlite(s) => {
                sqlx::query_as("SELECT key, MIN(body), COUNT(*) FROM ledger GROUP BY key")
                    .fetch_all(s.pool())
                    .await
                    .unwrap()
            }
            Self::Postgres(s) => sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT key, (array_agg(body))[1], COUNT(*) FROM {}.ledger GROUP BY key",
                s.schema()
            )))
            .fetch_all(s.pool())
            .await
            .unwrap(),
        }
    }

    async fn start(&self, conn: &Connection, queue: &str, mode: Mode, hook: Hook) -> Started {
        // A verb pending on a lost connection ends the run after 5 s (lapin once left an ack
        // pending forever after the cut: A never stopped).
        let builder = AmqpConsumer::builder(
            AmqpConfig::new(conn, queue)
                .prefetch(16)
                .retry_delay(Duration::from_millis(100), Duration::from_millis(500)),
        )
        .batch(8)
        .broker_timeout(Duration::from_secs(5))
        .on_settle(hook);
        let day = Duration::from_secs(86_400);
        match (self, mode) {
            (Self::Sqlite(s), Mode::Inbox) => Started::SqliteInbox(
                builder.inbox(s.inbox(day)).scope("crash").build().await.unwrap(),
            ),
            (Self::Postgres(s), Mode::Inbox) => {
                Started::PgInbox(builder.inbox(s.inbox(day)).scope("crash").build().await.unwrap())
            }
            (Self::Sqlite(s), Mode::TwoPhase) => Started::SqliteTwoPhase(
                builder.store(s.clone()).scope("crash").build().await.unwrap(),
            ),
            (Self::Postgres(s), Mode::TwoPhase) => {
                Started::PgTwoPhase(builder.store(s.clone()).scope("crash").build().await.unwrap())
            }
        }
    }
}

type Hook = Box<dyn Fn(&Settlement<'_, Delivery>) + Send + Sync>;

/// A connected consumer in one of the modes, on one of the stores.
enum Started {
    SqliteInbox(AmqpConsumer<Inbox<SqliteInbox>>),
    PgInbox(AmqpConsumer<Inbox<PostgresInbox>>),
    SqliteTwoPhase(AmqpConsumer<SqliteStore>),
    PgTwoPhase(AmqpConsumer<PostgresStore>),
}

/// The two-phase handler: the ledger row is the effect, written under the lease.
fn two_phase_handler(
    db: Db,
    who: &'static str,
    cut: Cut,
) -> impl Fn(Context, Delivery) -> BoxedRun + Send + Sync {
    move |_ctx, m: Delivery| {
        let (db, cut) = (db.clone(), cut.clone());
        Box::pin(async move {
            let key = m.properties().message_id().as_ref().map(|s| s.to_string()).unwrap();
            db.insert(&key, m.payload(), who)
                .await
                .map_err(|e| HandlerError::Transient(e.to_string()))?;
            if let Some((n, tell, go)) = cut
                && n.fetch_add(1, Ordering::SeqCst) + 1 == DROP_AT
            {
                // Mid-handler: the effect is done, its completion not yet recorded.
                tell.send(key).unwrap();
                go.notified().await;
            }
            Ok(())
        })
    }
}

type BoxedRun =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), HandlerError<String>>> + Send>>;

async fn run_consumer(
    c: Started,
    db: Db,
    who: &'static str,
    cut: Cut,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<Report, consumer::Error<idem_amqp::Error>> {
    match c {
        Started::SqliteInbox(c) => {
            let handler = |tx, m| sqlite_ledger_write(tx, m, who, cut.clone());
            c.run(handler, shutdown).await
        }
        Started::PgInbox(c) => {
            let Db::Postgres(store) = db else { panic!("a PostgreSQL inbox on {db:?}") };
            let schema = store.schema().to_owned();
            let handler = |tx, m| pg_ledger_write(tx, m, schema.clone(), who, cut.clone());
            c.run(handler, shutdown).await
        }
        Started::SqliteTwoPhase(c) => c.run(two_phase_handler(db, who, cut), shutdown).await,
        Started::PgTwoPhase(c) => c.run(two_phase_handler(db, who, cut), shutdown).await,
    }
}

fn seen_hook(who: &'static str, tx: mpsc::UnboundedSender<Seen>) -> Hook {
    Box::new(move |r: &Settlement<'_, Delivery>| {
        let _ = tx.send(Seen {
            who,
            key: r.key.map(|k| k.id().to_owned()).unwrap_or_default(),
            outcome: r.outcome.as_str().to_owned(),
            redelivered: r.message.redelivered(),
        });
    })
}

/// A TCP proxy to the broker whose connections the test can cut.
struct Proxy {
    addr: String,
    tasks: Arc<std::sync::Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let tasks = Arc::new(std::sync::Mutex::new(Vec::new()));
        let t = Arc::clone(&tasks);
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let up = upstream.clone();
                let h = tokio::spawn(async move {
                    let mut server = TcpStream::connect(up).await.unwrap();
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
                t.lock().unwrap().push(h);
            }
        });
        Self { addr, tasks, accept }
    }

    /// Drops both sockets of every proxied connection: the broker sees the client vanish.
    fn cut(&self) {
        self.accept.abort();
        for h in self.tasks.lock().unwrap().drain(..) {
            h.abort();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_consumers_a_cut_connection_and_an_aborted_process_give_exactly_once_effects() {
    scenario(Mode::Inbox, Kind::Sqlite).await;
}

/// Two-phase: the cut and the abort both fall after the effect is done (the abort after its
/// completion is recorded), so the ledger still shows each effect once; the cut consumer's
/// redelivered message meets A's live lease (the test holds A until it has) and goes round the
/// delay queue until A's completion is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_phase_three_consumers_a_cut_connection_and_an_aborted_process() {
    scenario(Mode::TwoPhase, Kind::Sqlite).await;
}

/// The inbox scenario on `PostgresInbox`, the ledger in the test's
/// own schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inbox_on_postgres_three_consumers_a_cut_connection_and_an_aborted_process() {
    scenario(Mode::Inbox, Kind::Postgres).await;
}

/// The two-phase scenario on `PostgresStore`, the ledger a table in the test's own schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_phase_on_postgres_three_consumers_a_cut_connection_and_an_aborted_process() {
    scenario(Mode::TwoPhase, Kind::Postgres).await;
}

/// Which store the scenario runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Sqlite,
    Postgres,
}

async fn scenario(mode: Mode, kind: Kind) {
    let pg_url = match kind {
        Kind::Sqlite => None,
        Kind::Postgres => {
            let Some(url) = idem_testkit::service::require(
                "PostgreSQL",
                "IDEM_TEST_POSTGRES_URL",
                PG_DEFAULT_URL,
            ) else {
                return;
            };
            Some(url)
        }
    };
    let tag = format!("crash-{}-{kind:?}", mode.name()).to_lowercase();
    let Some(b) = Broker::new(&tag).await else { return };
    let dir = tempfile::tempdir().unwrap();
    let sqlite_path = dir.path().join("crash.sqlite");
    let (schema, store_a) = match &pg_url {
        None => (None, Db::Sqlite(SqliteStore::open(&sqlite_path).await.unwrap())),
        Some(url) => {
            let name =
                format!("idem_amqp_crash_{}_{}", mode.name(), std::process::id()).replace('-', "_");
            let (schema, store) = PgSchema::create(url, name).await;
            (Some(schema), Db::Postgres(store))
        }
    };
    let spec = store_a.spec(&sqlite_path);
    store_a.create_ledger().await;
    let store_b = Db::open(&spec).await;
    let (seen_tx, mut seen_rx) = mpsc::unbounded_channel();

    // A: through the proxy, cut mid-handler.
    let upstream = idem_testkit::service::host_port(&b.url);
    let proxy = Proxy::start(upstream.clone()).await;
    let conn_a = Connection::connect(
        &b.url.replace(&upstream, &proxy.addr),
        ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let a = store_a.start(&conn_a, b.queue(), mode, seen_hook("A", seen_tx.clone())).await;
    let (cut_tx, mut cut_rx) = mpsc::unbounded_channel();
    let go = Arc::new(Notify::new());
    let cut = Some((Arc::new(AtomicUsize::new(0)), cut_tx, Arc::clone(&go)));
    let task_a = tokio::spawn(run_consumer(a, store_a.clone(), "A", cut, std::future::pending()));

    // B: survives.
    let conn_b = b.connect().await;
    let (mut stop_b, mut task_b) =
        spawn_b(&conn_b, &store_b, b.queue(), mode, seen_tx.clone()).await;

    // C: a child process that aborts between commit and ack.
    let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["crash_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .env("IDEM_AMQP_CRASH_QUEUE", b.queue())
        .env("IDEM_AMQP_CRASH_MODE", mode.name())
        .env("IDEM_AMQP_CRASH_STORE", &spec)
        .env("IDEM_TEST_AMQP_URL", &b.url)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let (ready_tx, ready_rx) = oneshot::channel();
    let (abort_tx, abort_rx) = oneshot::channel();
    let stderr = child.stderr.take().unwrap();
    let child_seen = seen_tx.clone();
    tokio::spawn(async move {
        let mut lines = BufReader::new(stderr).lines();
        let (mut ready_tx, mut abort_tx) = (Some(ready_tx), Some(abort_tx));
        while let Ok(Some(line)) = lines.next_line().await {
            let f: Vec<&str> = line.split('\t').collect();
            match f.as_slice() {
                ["READY"] => drop(ready_tx.take().map(|t| t.send(()))),
                ["ABORT_KEY", k] => drop(abort_tx.take().map(|t| t.send((*k).to_owned()))),
                ["SEEN", k, o, r] => {
                    let _ = child_seen.send(Seen {
                        who: "C",
                        key: (*k).to_owned(),
                        outcome: (*o).to_owned(),
                        redelivered: *r == "true",
                    });
                }
                _ => eprintln!("child: {line}"),
            }
        }
    });
    tokio::time::timeout(LIMIT, ready_rx).await.unwrap().expect("child consumer is ready");

    // The producer: 4,000 ids, 999 duplicates of them, one id reused with another body last.
    let mut msgs: Vec<(String, Vec<u8>)> =
        (0..UNIQUE).map(|i| (format!("order-{i:04}"), body(i))).collect();
    let mut rng = rand::rng();
    let dups: Vec<(String, Vec<u8>)> =
        (0..TOTAL - UNIQUE - 1).map(|_| msgs.choose(&mut rng).unwrap().clone()).collect();
    msgs.extend(dups);
    msgs.shuffle(&mut rng);
    let reused = msgs[0].0.clone();
    let original_body = msgs[0].1.clone();
    let reused_body = br#"{"order":"reused","cents":999999}"#.to_vec();
    msgs.push((reused.clone(), reused_body.clone()));
    assert_eq!(msgs.len(), TOTAL);
    let bodies: HashMap<String, Vec<u8>> =
        (0..UNIQUE).map(|i| (format!("order-{i:04}"), body(i))).collect();
    let pub_ch = b.conn.create_channel().await.unwrap();
    pub_ch.confirm_select(Default::default()).await.unwrap();
    for chunk in msgs.chunks(500) {
        let mut confirms = Vec::new();
        for (id, body) in chunk {
            let props = BasicProperties::default()
                .with_delivery_mode(2)
                .with_message_id(id.as_str().into());
            confirms.push(
                pub_ch
                    .basic_publish(
                        "".into(),
                        b.queue().into(),
                        BasicPublishOptions::default(),
                        body,
                        props,
                    )
                    .await
                    .unwrap(),
            );
        }
        for c in confirms {
            assert!(c.await.unwrap().is_ack());
        }
    }

    // Cut A's connection while its handler is inside the transaction, then let it finish: its
    // commit happens, its ack cannot.
    let drop_key = tokio::time::timeout(LIMIT, cut_rx.recv()).await.unwrap().unwrap();
    proxy.cut();
    let mut seen: Vec<Seen> = Vec::new();
    if mode == Mode::TwoPhase {
        // A's lease is live and holds no database lock: hold A until the redelivered copy has
        // met the lease at another consumer, so the delay-queue path runs for certain.
        let met = |s: &Seen| s.key == drop_key && s.outcome == "in_progress_elsewhere";
        while !seen.iter().any(met) {
            let s = tokio::time::timeout(LIMIT, seen_rx.recv()).await.unwrap().unwrap();
            seen.push(s);
        }
    }
    go.notify_one();
    // Twice the limit: on a loaded machine (CI ran this beside three other scenarios) A once
    // had not stopped 60 s after its connection was cut; what it was doing is reported.
    let Ok(a_result) = tokio::time::timeout(2 * LIMIT, task_a).await else {
        while let Ok(s) = seen_rx.try_recv() {
            seen.push(s);
        }
        let a_seen: Vec<_> = seen.iter().filter(|s| s.who == "A").collect();
        panic!(
            "A did not stop within {:?} of its cut: its connection connected {}, errored {}, \
             closed {}; A settled {} deliveries since the cut, the last {:?}",
            2 * LIMIT,
            conn_a.status().connected(),
            conn_a.status().errored(),
            conn_a.status().closed(),
            a_seen.len(),
            a_seen.last(),
        );
    };
    let a_result = a_result.unwrap();
    assert!(a_result.is_err(), "A's run must fail once its connection is gone: {a_result:?}");
    eprintln!(
        "A stopped: {}",
        a_result.as_ref().err().map(ToString::to_string).unwrap_or_default()
    );

    let abort_key = tokio::time::timeout(LIMIT, abort_rx).await.unwrap().expect("child aborts");
    let status = tokio::time::timeout(LIMIT, child.wait()).await.unwrap().unwrap();
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(6), "the child died of SIGABRT: {status:?}");
    }

    // Wait until every unique id is processed, the reused one is dead-lettered and the queues
    // are empty; then stop B, and go again if it had to give deliveries back.
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        while let Ok(s) = seen_rx.try_recv() {
            seen.push(s);
        }
        // Consumers that died mid-batch committed deliveries they never reported, so the
        // ledger, not the reports, says when every unique id is done.
        let rows = store_b.distinct_keys().await;
        let conflicts = seen.iter().filter(|s| s.outcome == "conflict").count();
        if rows >= i64::try_from(UNIQUE).unwrap()
            && conflicts >= 1
            && b.count(b.queue()).await == 0
            && b.count(b.topology.delay_queue()).await == 0
        {
            let _ = stop_b.send(());
            let stats: Report = task_b.await.unwrap().unwrap();
            if stats.released == 0 {
                break;
            }
            (stop_b, task_b) = spawn_b(&conn_b, &store_b, b.queue(), mode, seen_tx.clone()).await;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not done in {LIMIT:?}: {} seen, {:?}, queue {}",
            seen.len(),
            seen.iter().fold(HashMap::<(&str, &str), usize>::new(), |mut m, s| {
                *m.entry((s.who, s.outcome.as_str())).or_default() += 1;
                m
            }),
            b.count(b.queue()).await
        );
        tokio::select! {
            Some(s) = seen_rx.recv() => seen.push(s),
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    while let Ok(s) = seen_rx.try_recv() {
        seen.push(s);
    }

    // Nothing unacked: every consumer is gone, so anything unacked would be ready again.
    assert_eq!(b.count(b.queue()).await, 0, "work queue empty");
    assert_eq!(b.count(b.topology.delay_queue()).await, 0, "delay queue empty");

    // Every unique id's effect exactly once, with its original body.
    let rows = store_b.rows().await;
    let twice: Vec<_> = rows.iter().filter(|r| r.2 != 1).map(|r| (&r.0, r.2)).collect();
    assert!(twice.is_empty(), "effects repeated: {twice:?}");
    assert_eq!(rows.len(), UNIQUE, "every unique id has its row");
    for (key, body, _) in &rows {
        assert_eq!(Some(body), bodies.get(key), "ledger body of {key}");
    }
    assert_eq!(bodies[&reused], original_body);
    // A processed outcome is reported at most once per id (a crashed consumer's batch may
    // have committed ids it never got to report; their redeliveries are duplicates).
    let processed: Vec<&Seen> = seen.iter().filter(|s| s.outcome == "processed").collect();
    let distinct: HashSet<&str> = processed.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(distinct.len(), processed.len(), "no id processed twice");
    assert!(processed.len() > UNIQUE - 2 * 16, "{} processed reports", processed.len());

    // The interrupted messages came back and ended as duplicates.
    for (what, key) in [("cut", &drop_key), ("aborted", &abort_key)] {
        let again: Vec<&Seen> = seen.iter().filter(|s| &s.key == key && s.redelivered).collect();
        assert!(!again.is_empty(), "the {what} message {key} was redelivered: {seen:?}");
        // In two-phase mode a redelivery may first meet the live lease (in progress elsewhere,
        // round the delay queue); every copy after the first processing ends as a duplicate.
        let copies: Vec<&Seen> = seen.iter().filter(|s| &s.key == key).collect();
        let processed_at = copies.iter().position(|s| s.outcome == "processed");
        let later = &copies[processed_at.map_or(0, |p| p + 1)..];
        assert!(
            later
                .iter()
                .all(|s| matches!(s.outcome.as_str(), "duplicate" | "in_progress_elsewhere")),
            "copies of the {what} message after its processing: {copies:?}"
        );
        assert!(
            copies.iter().any(|s| s.outcome == "duplicate"),
            "the {what} message ends as a duplicate: {copies:?}"
        );
        if mode == Mode::Inbox {
            // The one processing may itself be of a redelivered copy (the message was first
            // delivered to the consumer whose connection was cut); every other copy is a
            // duplicate.
            assert!(
                again.iter().filter(|s| s.outcome != "processed").all(|s| s.outcome == "duplicate"),
                "redelivered copies of the {what} message end as duplicates: {again:?}"
            );
        }
    }
    let dup_count = seen.iter().filter(|s| s.outcome == "duplicate").count();
    let waiting = seen.iter().filter(|s| s.outcome == "in_progress_elsewhere").count();
    match mode {
        Mode::Inbox => assert_eq!(waiting, 0, "no lease holders in inbox mode"),
        Mode::TwoPhase => assert!(waiting >= 1, "the cut message met A's live lease"),
    }
    assert_eq!(processed.len() + dup_count + waiting + 1, seen.len(), "no other outcome");
    assert!(dup_count >= TOTAL - UNIQUE - 1 + 2, "{dup_count} duplicates");
    let odd: Vec<&Seen> = seen
        .iter()
        .filter(|s| {
            !matches!(
                s.outcome.as_str(),
                "processed" | "duplicate" | "conflict" | "in_progress_elsewhere"
            )
        })
        .collect();
    assert!(odd.is_empty(), "no other outcomes expected: {odd:?}");

    // The reused id is in the dead-letter queue, with its reason.
    let dlq = b.drain_dlq().await;
    assert_eq!(dlq.len(), 1, "{dlq:?}");
    assert_eq!(dlq[0].0.as_deref(), Some(reused.as_str()));
    assert_eq!(dlq[0].2, reused_body);
    let reason = dlq[0].1.clone().unwrap();
    assert!(reason.starts_with(&format!("conflict: key crash/{reused} reused")), "{reason}");

    let mut by_who: HashMap<&str, usize> = HashMap::new();
    for s in &seen {
        *by_who.entry(s.who).or_default() += 1;
    }
    assert!(by_who.get("C").copied().unwrap_or(0) >= ABORT_AT, "C competed: {by_who:?}");
    println!(
        "crash test ({}, {kind:?}): {} deliveries settled {by_who:?}, {dup_count} duplicates, {waiting} in progress elsewhere, cut {drop_key}, aborted {abort_key}",
        mode.name(),
        seen.len()
    );
    let _ = conn_b.close(200, "".into()).await;
    b.cleanup().await;
    drop((store_a, store_b));
    if let Some(schema) = schema {
        schema.drop_now().await;
    }
}

async fn spawn_b(
    conn: &Connection,
    store: &Db,
    queue: &str,
    mode: Mode,
    seen: mpsc::UnboundedSender<Seen>,
) -> (oneshot::Sender<()>, JoinHandle<Result<Report, consumer::Error<idem_amqp::Error>>>) {
    let c = store.start(conn, queue, mode, seen_hook("B", seen)).await;
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(run_consumer(c, store.clone(), "B", None, async move {
        let _ = stopped.await;
    }));
    (stop, task)
}

/// Consumer C, run as a child process by the crash test: aborts after its `ABORT_AT`th commit,
/// before the ack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the crash test's child process; run by it, not alone"]
async fn crash_child() {
    assert!(std::env::var(CHILD_ENV).is_ok(), "run only as the crash test's child process");
    let queue = std::env::var("IDEM_AMQP_CRASH_QUEUE").unwrap();
    let spec = std::env::var("IDEM_AMQP_CRASH_STORE").unwrap();
    let url = std::env::var("IDEM_TEST_AMQP_URL").unwrap_or_else(|_| DEFAULT_URL.to_owned());
    let mode = match std::env::var("IDEM_AMQP_CRASH_MODE").as_deref() {
        Ok("two-phase") => Mode::TwoPhase,
        _ => Mode::Inbox,
    };
    child_main(&url, &queue, &spec, mode).await;
}

async fn child_main(url: &str, queue: &str, spec: &str, mode: Mode) {
    let store = Db::open(spec).await;
    let conn = Connection::connect(url, ConnectionProperties::default()).await.unwrap();
    let processed = AtomicUsize::new(0);
    let hook = move |r: &Settlement<'_, Delivery>| {
        let key = r.key.map(|k| k.id()).unwrap_or_default();
        eprintln!("SEEN\t{key}\t{}\t{}", r.outcome, r.message.redelivered());
        // The hook runs after the commit and before the ack: the crash window.
        if r.outcome == OutcomeKind::Processed
            && r.verb == &Verb::Ack
            && processed.fetch_add(1, Ordering::SeqCst) + 1 == ABORT_AT
        {
            eprintln!("ABORT_KEY\t{key}");
            std::process::abort();
        }
    };
    let c = store.start(&conn, queue, mode, Box::new(hook)).await;
    eprintln!("READY");
    let _ = run_consumer(c, store, "C", None, std::future::pending()).await;
    unreachable!("the child aborts before its queue runs dry");
}
