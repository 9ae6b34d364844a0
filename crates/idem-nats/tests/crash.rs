//! Crash test on the real NATS server: 3 competing consumers over one SQLite database,
//! 4,000 unique messages plus 1,000 producer duplicates (same `Nats-Msg-Id`, sent after
//! JetStream's own duplicate window so they are really stored and delivered) plus one id reused
//! with a different body. One consumer's connection is dropped mid-handler (no ack); one
//! consumer is a child process that aborts between its commit and its acks.
//!
//! Passes when every key's effect is in the ledger (a table with no unique constraint) exactly
//! once (two-phase mode: once per downstream idempotency key — a handler killed after its effect
//! but before `complete` is re-run after its lease with `took_over_expired()` and the same
//! downstream key, which the callee deduplicates; that is the two-phase promise), the copies redelivered after the abort end as duplicates, the reused id is on the
//! dead-letter subject with its reason, and the consumer has nothing pending or unacked.
//!
//! Two-phase mode runs on both stores (`crash_two_phase_mode` on SQLite,
//! `crash_two_phase_mode_postgres` on PostgreSQL, in a schema of its own dropped afterwards);
//! inbox mode on SQLite. The ledger stays a SQLite table in every run: the handler's external
//! effect, outside the dedup store's transactions.

mod common;

use std::future::Future;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use common::{DUP_WINDOW, Env, PgSchema, header, nats_url, pg_url};
use idem_core::consumer::{Decided, Report, headers};
use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_core::{DedupStore, Inbox, InspectStore};
use idem_nats::{Delivery, JetStreamConfig, JetStreamConsumer};
use idem_sqlx::{PostgresStore, SqliteInbox, SqliteStore};
use idem_testkit::wait_for;
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use tokio::io::AsyncBufReadExt;
use tokio::sync::{oneshot, watch};

const UNIQUE: usize = 4_000;
const DUPLICATES: usize = 1_000;
const REUSED: &str = "o-7";
const CONSUMER: &str = "workers";
const ACK_WAIT: Duration = Duration::from_secs(2);
/// Consumer b hangs on its this-many-th new message: early, so that it happens while most of
/// the work is still queued even when b gets a small share of it.
const HANG_AFTER: usize = 40;
const CHILD_ENV: &str = "IDEM_NATS_CRASH_CHILD";
/// The child gathers this many deliveries (or what came within [`CHILD_GATHER`], well inside
/// `ACK_WAIT`) into one batch, and aborts after the first batch that commits 8 new effects.
const CHILD_BATCH: usize = 16;
const CHILD_GATHER: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Inbox,
    TwoPhase,
}

impl Mode {
    fn parse(s: &str) -> Self {
        if s == "inbox" { Mode::Inbox } else { Mode::TwoPhase }
    }
    fn name(self) -> &'static str {
        match self {
            Mode::Inbox => "inbox",
            Mode::TwoPhase => "two-phase",
        }
    }
}

/// Makes the handler hang (mid-effect, before writing) on its `after`-th message and say so.
struct Hang {
    after: usize,
    seen: AtomicUsize,
    hit: std::sync::Mutex<Option<oneshot::Sender<String>>>,
}

impl Hang {
    async fn maybe(&self, key: &str) {
        if self.seen.fetch_add(1, Ordering::SeqCst) + 1 == self.after {
            if let Some(tx) = self.hit.lock().expect("lock").take() {
                let _ = tx.send(key.to_owned());
            }
            std::future::pending::<()>().await;
        }
    }
}

/// Where two-phase mode keeps its dedup records (inbox mode always uses the SQLite file).
#[derive(Clone, Debug)]
enum Backend {
    Sqlite,
    Postgres { url: String, schema: String },
}

impl Backend {
    /// `sqlite` or `postgres,<schema>,<url>`, for the child's command line.
    fn spec(&self) -> String {
        match self {
            Backend::Sqlite => "sqlite".to_owned(),
            Backend::Postgres { url, schema } => format!("postgres,{schema},{url}"),
        }
    }
    fn parse(s: &str) -> Self {
        match s.splitn(3, ',').collect::<Vec<_>>()[..] {
            ["postgres", schema, url] => {
                Backend::Postgres { url: url.to_owned(), schema: schema.to_owned() }
            }
            _ => Backend::Sqlite,
        }
    }
}

/// A dedup store the crash test can open in each of its processes.
trait TestStore: DedupStore + InspectStore + Sized + 'static {
    /// Opens the store (creating its table if missing).
    fn open(db: &str, backend: &Backend) -> impl Future<Output = Self> + Send;
}

impl TestStore for SqliteStore {
    async fn open(db: &str, _: &Backend) -> Self {
        open_store(db).await
    }
}

impl TestStore for PostgresStore {
    async fn open(_: &str, backend: &Backend) -> Self {
        let Backend::Postgres { url, schema } = backend else { panic!("not PostgreSQL") };
        let pool =
            PgPoolOptions::new().max_connections(4).connect(url).await.expect("postgres pool");
        let store = PostgresStore::new(pool).with_schema(schema).expect("schema name");
        store.migrate().await.expect("migrate");
        store
    }
}

enum Adapter<S> {
    Inbox(JetStreamConsumer<Inbox<SqliteInbox>>),
    TwoPhase(JetStreamConsumer<S>, SqlitePool),
}

async fn ledger_pool(db: &str) -> SqlitePool {
    let opts = SqliteConnectOptions::new()
        .filename(db)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    SqlitePoolOptions::new().max_connections(1).connect_with(opts).await.expect("ledger pool")
}

async fn open_store(db: &str) -> SqliteStore {
    let opts = SqliteConnectOptions::new()
        .filename(db)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
        .busy_timeout(Duration::from_secs(10));
    SqliteStore::open_with(opts).await.expect("open store")
}

impl<S: TestStore> Adapter<S> {
    async fn open(
        mode: Mode,
        js: jetstream::Context,
        pull: PullConsumer,
        db: &str,
        dlq: &str,
        backend: &Backend,
    ) -> Self {
        let config = JetStreamConfig::new(js, pull, dlq);
        let common = |b: idem_core::consumer::Builder<JetStreamConfig>| {
            b.batch(64).idle_wait(Duration::from_millis(200))
        };
        match mode {
            Mode::Inbox => Adapter::Inbox(
                common(JetStreamConsumer::builder(config))
                    .inbox(open_store(db).await.inbox(Duration::from_secs(86_400)))
                    .scope("crash")
                    .build()
                    .await
                    .expect("inbox consumer"),
            ),
            Mode::TwoPhase => {
                let nats = common(JetStreamConsumer::builder(config))
                    .store(S::open(db, backend).await)
                    .scope("crash")
                    .lease(ACK_WAIT)
                    // Lease heartbeat, and with it JetStream Progress, on the same beat.
                    .heartbeat(ACK_WAIT / 4)
                    .retain(Duration::from_secs(86_400))
                    .build()
                    .await
                    .expect("adapter");
                Adapter::TwoPhase(nats, ledger_pool(db).await)
            }
        }
    }

    async fn fetch(&self) -> Vec<Delivery> {
        let r = match self {
            Adapter::Inbox(c) => c.fetch().await,
            Adapter::TwoPhase(c, _) => c.fetch().await,
        };
        r.unwrap_or_else(|e| {
            eprintln!("fetch failed (retrying): {e}");
            Vec::new()
        })
    }

    /// Decides the batch: effects committed, nothing acked yet.
    async fn process(
        &self,
        batch: Vec<Delivery>,
        who: &str,
        hang: Option<Arc<Hang>>,
    ) -> Decided<Delivery> {
        let decided = match self {
            Adapter::Inbox(c) => {
                c.decide(batch, |mut tx, d| {
                    let who = who.to_owned();
                    let hang = hang.clone();
                    async move {
                        let key = d.message_id().unwrap_or_default().to_owned();
                        if let Some(h) = hang {
                            h.maybe(&key).await;
                        }
                        sqlx::query("INSERT INTO ledger (msg_key, body, consumer, downstream_key, took_over) VALUES (?, ?, ?, ?, 0)")
                            .bind(&key)
                            .bind(String::from_utf8_lossy(d.payload()).into_owned())
                            .bind(who)
                            .bind(&key)
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| HandlerError::Transient(e.to_string()))?;
                        Ok::<_, HandlerError<String>>(())
                    }
                })
                .await
            }
            Adapter::TwoPhase(c, ledger) => {
                c.decide(batch, |ctx, d| {
                    let hang = hang.clone();
                    async move {
                        let key = d.message_id().unwrap_or_default().to_owned();
                        if let Some(h) = hang {
                            h.maybe(&key).await;
                        }
                        // The external effect, carrying the downstream idempotency key.
                        sqlx::query("INSERT INTO ledger (msg_key, body, consumer, downstream_key, took_over) VALUES (?, ?, ?, ?, ?)")
                            .bind(&key)
                            .bind(String::from_utf8_lossy(d.payload()).into_owned())
                            .bind(who)
                            .bind(ctx.downstream_key().unwrap_or_default())
                            .bind(ctx.took_over_expired())
                            .execute(ledger)
                            .await
                            .map_err(|e| HandlerError::Transient(e.to_string()))?;
                        Ok::<_, HandlerError<String>>(())
                    }
                })
                .await
            }
        };
        decided.expect("decide")
    }

    async fn settle(&self, decided: Decided<Delivery>) -> Report {
        let r = match self {
            Adapter::Inbox(c) => c.settle(decided).await,
            Adapter::TwoPhase(c, _) => c.settle(decided).await,
        };
        r.expect("settle")
    }

    /// Fetch, process, settle until `stop` turns true.
    async fn run(
        &self,
        who: &str,
        hang: Option<Arc<Hang>>,
        mut stop: watch::Receiver<bool>,
    ) -> Report {
        let mut total = Report::default();
        while !*stop.borrow() {
            let batch = tokio::select! {
                b = self.fetch() => b,
                _ = stop.changed() => break,
            };
            if batch.is_empty() {
                continue;
            }
            let decided = self.process(batch, who, hang.clone()).await;
            total += self.settle(decided).await;
        }
        total
    }
}

/// Entry point of the child consumer process (does nothing unless started by the crash test):
/// processes batches normally until one commits at least 8 new effects, then aborts before
/// sending that batch's acks.
#[tokio::test(flavor = "current_thread")]
async fn crash_child_process_entry() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let parts: Vec<&str> = spec.split('|').collect();
    let [mode, url, stream, dlq, db, backend] = parts[..] else { panic!("bad child spec {spec}") };
    let (mode, backend) = (Mode::parse(mode), Backend::parse(backend));
    match backend {
        Backend::Sqlite => child::<SqliteStore>(mode, url, stream, dlq, db, &backend).await,
        Backend::Postgres { .. } => {
            child::<PostgresStore>(mode, url, stream, dlq, db, &backend).await;
        }
    }
}

async fn child<S: TestStore>(
    mode: Mode,
    url: &str,
    stream: &str,
    dlq: &str,
    db: &str,
    backend: &Backend,
) {
    let client = async_nats::connect(url).await.expect("child connect");
    let js = jetstream::new(client);
    let pull: PullConsumer = js
        .get_stream(stream)
        .await
        .expect("stream")
        .get_consumer(CONSUMER)
        .await
        .expect("consumer");
    let adapter = Adapter::<S>::open(mode, js, pull, db, dlq, backend).await;
    println!("READY");
    let mut total = 0;
    loop {
        // Gather a batch of CHILD_BATCH, or what came within CHILD_GATHER: when the consumers
        // keep up with the producer each fetch holds only what is pending (often one or two
        // messages), and a child waiting for a single fetch of 8 new ones could see none.
        let mut batch = Vec::new();
        let started = tokio::time::Instant::now();
        while batch.len() < CHILD_BATCH && (batch.is_empty() || started.elapsed() < CHILD_GATHER) {
            batch.extend(adapter.fetch().await);
        }
        let n = batch.len();
        let decided = adapter.process(batch, "child", None).await;
        let committed = decided.report().processed;
        total += committed;
        println!("BATCH {n} {committed} {total}");
        if committed >= 8 {
            println!("COMMITTED {committed} {total}");
            std::process::abort(); // between commit and ack
        }
        adapter.settle(decided).await;
    }
}

async fn count(pool: &SqlitePool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.expect("count")
}

async fn crash<S: TestStore>(url: &str, mode: Mode, backend: Backend) {
    let url = url.to_owned();
    let _ = tracing_subscriber::fmt().with_env_filter("idem=warn").with_test_writer().try_init();
    let env = Env::new(&url).await;
    env.consumer(CONSUMER, ACK_WAIT, 20).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("crash.sqlite").to_string_lossy().into_owned();
    let ledger = ledger_pool(&db).await;
    // No unique constraint: a second effect for one key would show as a second row.
    sqlx::query(
        "CREATE TABLE ledger (msg_key TEXT NOT NULL, body TEXT NOT NULL, consumer TEXT NOT NULL, \
         downstream_key TEXT NOT NULL, took_over INTEGER NOT NULL)",
    )
    .execute(&ledger)
    .await
    .expect("ledger table");
    S::open(&db, &backend).await; // creates the dedup table before three processes race to

    // The child process: a real process that aborts between its commit and its acks.
    let exe = std::env::current_exe().expect("current exe");
    let child_err = dir.path().join("child.stderr");
    let mut child = tokio::process::Command::new(exe)
        .args(["crash_child_process_entry", "--exact", "--nocapture", "--test-threads=1"])
        .env(
            CHILD_ENV,
            format!(
                "{}|{url}|{}|{}|{db}|{}",
                mode.name(),
                env.name,
                env.dlq_subject,
                backend.spec()
            ),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::from(std::fs::File::create(&child_err).expect("child stderr file")))
        .kill_on_drop(true)
        .spawn()
        .expect("spawn child");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(l) = lines.next_line().await.expect("child stdout") {
            // libtest prints `test … ` on the same line first.
            if l.ends_with("READY") {
                return;
            }
        }
        panic!("child exited before it was ready");
    })
    .await
    .expect("child ready");
    // The child's last lines, for the failure message if it never aborts.
    let child_tail = Arc::new(std::sync::Mutex::new(std::collections::VecDeque::new()));
    let tail = Arc::clone(&child_tail);
    let child_done = tokio::spawn(async move {
        let mut committed = None;
        while let Ok(Some(l)) = lines.next_line().await {
            {
                let mut t = tail.lock().expect("tail");
                if t.len() == 20 {
                    t.pop_front();
                }
                t.push_back(l.clone());
            }
            if let Some((_, n)) = l.split_once("COMMITTED ")
                && let Some((last, total)) = n.trim().split_once(' ')
            {
                committed = last.parse::<i64>().ok().zip(total.parse::<i64>().ok());
            }
        }
        (child.wait().await.expect("child wait"), committed)
    });

    let (stop_tx, stop) = watch::channel(false);
    let spawn_consumer = |who: &'static str, hang: Option<Arc<Hang>>| {
        let url = url.clone();
        let (name, dlq, db) = (env.name.clone(), env.dlq_subject.clone(), db.clone());
        let (stop, backend) = (stop.clone(), backend.clone());
        async move {
            let client = async_nats::connect(&url).await.expect("connect");
            let js = jetstream::new(client.clone());
            let pull =
                js.get_stream(&name).await.expect("s").get_consumer(CONSUMER).await.expect("c");
            let adapter = Adapter::<S>::open(mode, js, pull, &db, &dlq, &backend).await;
            let task = tokio::spawn(async move { adapter.run(who, hang, stop).await });
            (client, task)
        }
    };
    let (hit_tx, hit_rx) = oneshot::channel();
    let hang = Arc::new(Hang {
        after: HANG_AFTER,
        seen: AtomicUsize::new(0),
        hit: std::sync::Mutex::new(Some(hit_tx)),
    });
    let (_a_client, a) = spawn_consumer("a", None).await;
    let (b_client, b) = spawn_consumer("b", Some(Arc::clone(&hang))).await;
    // As soon as b hangs mid-handler — inside its inbox transaction, so holding SQLite's write
    // lock — drop its connection without acking and start a replacement, while the producer
    // goes on: left hanging, b would block every other writer until the producer is done.
    let b2_start = spawn_consumer("b2", None);
    let reaper = tokio::spawn(async move {
        let Ok(key) = tokio::time::timeout(Duration::from_secs(120), hit_rx).await else {
            return Err(b.is_finished());
        };
        b.abort();
        let _ = b.await;
        b_client.drain().await.expect("drop b's connection");
        Ok((key.expect("hit"), b2_start.await))
    });

    // Producer: originals, then its retries of every fourth one after the duplicate window.
    let mut sent_at = Vec::with_capacity(UNIQUE);
    for i in 0..UNIQUE {
        env.publish(
            &format!("o-{i}"),
            format!(r#"{{"order":{i},"cents":{}}}"#, 100 + i).as_bytes(),
        )
        .await;
        sent_at.push(tokio::time::Instant::now());
    }
    for j in 0..DUPLICATES {
        let i = j * (UNIQUE / DUPLICATES);
        let mut at = sent_at[i];
        env.retry(
            &format!("o-{i}"),
            format!(r#"{{"order":{i},"cents":{}}}"#, 100 + i).as_bytes(),
            &mut at,
        )
        .await;
    }

    let (hung_key, (_b2_client, b2)) = match reaper.await.expect("reaper") {
        Ok(x) => x,
        Err(b_finished) => {
            let per: Vec<(String, i64)> =
                sqlx::query_as("SELECT consumer, COUNT(*) FROM ledger GROUP BY consumer")
                    .fetch_all(&ledger)
                    .await
                    .expect("per consumer");
            panic!(
                "b did not reach its {HANG_AFTER}th new message in 120 s: it ran {} handlers; \
                 ledger rows per consumer {per:?}; pending {:?}; b finished: {b_finished}",
                hang.seen.load(Ordering::SeqCst),
                env.pending(CONSUMER).await,
            );
        }
    };

    // The reused id, sent once its first body is committed (so the later one is the conflict).
    wait_for("the first o-7 committed", Duration::from_secs(60), || async {
        count(&ledger, "SELECT COUNT(*) FROM ledger WHERE msg_key = 'o-7'").await > 0
    })
    .await;
    tokio::time::sleep(DUP_WINDOW * 3).await; // a producer reusing the id after JetStream's window
    env.publish(REUSED, br#"{"order":7,"cents":999999}"#).await;

    let Ok(joined) = tokio::time::timeout(Duration::from_secs(60), child_done).await else {
        panic!(
            "the child did not abort within 60 s of the last message: its last lines {:?}, \
             its stderr {:?}",
            child_tail.lock().expect("tail"),
            std::fs::read_to_string(&child_err).unwrap_or_default(),
        );
    };
    let (status, child_committed) = joined.expect("join");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(6), "the child must die by abort(): {status:?}");
    let (child_committed, child_total) = child_committed.expect("child reported its commit");
    assert!(child_committed >= 8);

    wait_for(
        "all effects, the dead letter and an empty consumer",
        Duration::from_secs(120),
        || async {
            count(&ledger, "SELECT COUNT(DISTINCT msg_key) FROM ledger").await == UNIQUE as i64
                && !env.dead_letters().await.is_empty()
                && env.pending(CONSUMER).await == (0, 0)
        },
    )
    .await;
    stop_tx.send(true).expect("stop");
    let ra = a.await.expect("a");
    let rb2 = b2.await.expect("b2");

    // Exactly once: one row per key (two-phase: per downstream key, re-runs only after a
    // takeover), each with its first body.
    let reruns = count(&ledger, "SELECT COUNT(*) - COUNT(DISTINCT msg_key) FROM ledger").await;
    let bad: Vec<(String, String)> = sqlx::query_as(
        "SELECT msg_key, group_concat(consumer) FROM ledger GROUP BY msg_key \
         HAVING COUNT(*) > 1 AND (?1 OR COUNT(DISTINCT downstream_key) > 1 OR SUM(took_over) < COUNT(*) - 1) LIMIT 10",
    )
    .bind(mode == Mode::Inbox)
    .fetch_all(&ledger)
    .await
    .expect("twice");
    assert!(bad.is_empty(), "effects ran twice (key, consumers): {bad:?}");
    assert_eq!(
        count(&ledger, "SELECT COUNT(DISTINCT downstream_key) FROM ledger").await,
        UNIQUE as i64
    );
    if mode == Mode::Inbox {
        assert_eq!(reruns, 0);
    }
    let bodies: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT body FROM ledger WHERE msg_key = ?")
            .bind(REUSED)
            .fetch_all(&ledger)
            .await
            .expect("o-7");
    assert_eq!(bodies, [r#"{"order":7,"cents":107}"#]);
    let hung: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM ledger WHERE msg_key = ? AND consumer != 'b'")
            .bind(&hung_key)
            .fetch_one(&ledger)
            .await
            .expect("hung key");
    assert_eq!(hung, 1, "the message b hung on was processed once by another consumer");
    assert_eq!(
        count(&ledger, "SELECT COUNT(*) FROM ledger WHERE consumer = 'child' AND took_over = 0")
            .await,
        child_total
    );

    // The child's committed batch came back (no ack) and ended as duplicates, like the
    // producer's retries.
    let survivors = {
        let mut r = ra;
        r += rb2;
        r
    };
    assert!(
        survivors.duplicates >= u64::try_from(child_committed).expect("count"),
        "redelivered copies did not end as duplicates: {survivors}"
    );
    assert_eq!(survivors.conflicts, 1, "{survivors}");
    assert_eq!(survivors.settle_failures + survivors.dead_letter_failures, 0, "{survivors}");

    // The reused id is on the dead-letter subject with its reason.
    let dl = env.dead_letters().await;
    assert_eq!(dl.len(), 1, "exactly one dead letter");
    assert_eq!(header(&dl[0], headers::ORIGINAL_MESSAGE_ID), Some(REUSED));
    assert_eq!(header(&dl[0], headers::OUTCOME), Some("conflict"));
    assert!(
        header(&dl[0], headers::REASON)
            .is_some_and(|r| r.starts_with("conflict: key crash/o-7 reused"))
    );
    assert_eq!(&dl[0].payload[..], br#"{"order":7,"cents":999999}"#);
    assert_eq!(env.pending(CONSUMER).await, (0, 0));
    if mode == Mode::TwoPhase {
        // The records are in the store under test (PostgreSQL or SQLite), one per key.
        let counts = S::open(&db, &backend).await.count(Some("crash")).await.expect("count");
        assert_eq!(counts.completed, UNIQUE as u64, "{counts:?}");
        assert_eq!(counts.total(), UNIQUE as u64, "{counts:?}");
    }
    eprintln!(
        "{} crash test on {backend:?}: child committed {child_total} ({child_committed} unacked) then aborted; b hung on {hung_key}; {reruns} re-runs after takeover; survivors: {survivors}",
        mode.name()
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_inbox_mode() {
    let Some(url) = nats_url() else { return };
    crash::<SqliteStore>(&url, Mode::Inbox, Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_two_phase_mode() {
    let Some(url) = nats_url() else { return };
    crash::<SqliteStore>(&url, Mode::TwoPhase, Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_two_phase_mode_postgres() {
    let Some(url) = nats_url() else { return };
    let Some(pg) = pg_url() else { return };
    let schema = PgSchema::new(&pg, &format!("idem_nats_crash_{}", common::suffix()));
    let backend = Backend::Postgres { url: pg, schema: schema.name.clone() };
    crash::<PostgresStore>(&url, Mode::TwoPhase, backend).await;
}
