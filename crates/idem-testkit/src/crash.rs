//! The crash suite, run against every broker adapter by
//! [`crash_conformance!`](crate::crash_conformance) over the broker-source harness
//! ([`SourceHarness`] and [`CrashHarness`]), in inbox mode (the ledger commits with the marker,
//! SQLite) and two-phase mode (the ledger is an effect outside the store, which is SQLite too).
//!
//! One destination gets 1,000 orders, 100 producer retries of them and one order id reused with
//! another body. Then, in turn:
//! 1. **abort between commit and ack**: a child process (this test binary run again) consumes
//!    and calls `std::process::abort()` from the settle hook once 8 of its deliveries are
//!    durable — effects committed, nothing acknowledged;
//! 2. **SIGKILL mid-handler**: a child process consuming one message at a time hangs inside its
//!    third handler, before the effect, and is killed;
//! 3. **connection cut mid-handler**: a consumer of this process is dropped — its connection
//!    closed with nothing acknowledged — while one of its handlers is inside its effect;
//! 4. two consumers drain the destination.
//!
//! The store's records are in SQLite files, or (`crash_conformance!(…, postgres)`) in a
//! PostgreSQL schema of the run's own, dropped afterwards; in two-phase mode the ledger stays a
//! SQLite file either way: an effect outside the store.
//!
//! Passes when every order's effect is in the ledger (a table with no unique constraint)
//! exactly once, the aborted deliveries came back and were found done (duplicates), the key
//! hung on was processed afterwards (in two-phase mode as a takeover of the dead consumer's
//! lease, with the same downstream key), the reused id was dead-lettered (twice at most: a crash
//! between the copy and the ack repeats the copy, never loses it), and nothing is left unsettled.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure is the test failing

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::consumer::{Builder, Consumer, Report, Settlement, Source, SourceConfig, headers};
use idem_core::engine::{Context, HandlerError};
use idem_core::extract::Envelope;
use idem_core::inbox::{Inbox, Tx, TxInbox};
use idem_core::{DedupStore, OutcomeKind};
use idem_sqlx::{PostgresStore, SqliteStore};
use sqlx::AssertSqlSafe;
use tokio::io::AsyncBufReadExt;

use crate::source::{BoxFuture, DropSql, SourceHarness, rand_u64};

/// A broker harness a child process can attach to: the crash suite's children consume the
/// destination the parent made.
pub trait CrashHarness: SourceHarness + 'static {
    /// What a child needs to reach the same destination (its names), on one line.
    fn spec(&self) -> String;

    /// The harness for `spec`, in a child process: the same destination, which the child never
    /// deletes.
    fn attach(spec: &str) -> BoxFuture<'static, Self>;
}

type DeliveryOf<H> = <<H as SourceHarness>::Source as Source>::Delivery;
type Hook<M> = Box<dyn Fn(&Settlement<'_, M>) + Send + Sync>;
/// Told each handler run's key and number before its effect; `true` makes that handler hang.
type Started = Arc<dyn Fn(&str, usize) -> bool + Send + Sync>;

const ORDERS: usize = 1_000;
const RETRIES: usize = 100;
const REUSED: &str = "o-7";
/// The aborting child stops once this many of its deliveries are durable.
const ABORT_AFTER: usize = 8;
/// The hanging child hangs in its this-many-th handler run, before the effect.
const HANG_AT: usize = 3;
/// The cut consumer is dropped inside its this-many-th handler run.
const CUT_AT: usize = 5;
const LEASE: Duration = Duration::from_secs(2);
/// The crash-loop scenario's key whose handler aborts the process.
const POISON: &str = "o-poison";
/// The crash-loop limit every consumer of the suite runs with.
const POISON_LIMIT: u32 = 3;
/// Orders published around the poison message.
const POISON_ORDERS: usize = 200;
const DAY: Duration = Duration::from_secs(86_400);
/// How long a child may go without printing a line it is expected to print.
const LIMIT: Duration = Duration::from_secs(120);
/// How long the drain may go without progress — a new effect, a message settled for good, or
/// the broker reporting everything settled — before the scenario fails, showing what it saw. A
/// slow machine slows progress down; only a stuck consumer stops it.
const STALL: Duration = Duration::from_secs(60);
const PG_VAR: &str = "IDEM_TEST_POSTGRES_URL";
const PG_DEFAULT: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The child's instructions: `<role>|<mode>|<records>|<store>|<ledger>|<harness spec>`.
pub const CHILD_ENV: &str = "IDEM_CRASH_CHILD";

/// Inbox mode (the ledger row commits with the marker) or two-phase mode (the ledger row is an
/// external effect; the store records the completion after it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The transactional inbox.
    Inbox,
    /// Two-phase over the store, the ledger in a SQLite file of its own.
    TwoPhase,
}

/// Where the store keeps its records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Records {
    /// A SQLite file.
    Sqlite,
    /// A PostgreSQL schema of the run's own (`IDEM_TEST_POSTGRES_URL`).
    Postgres,
}

/// How one consumer of the scenario behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Abort,
    Hang,
    Cut,
    Survivor,
    /// Aborts the process whenever the poison key's handler starts.
    Poison,
}

/// Where the scenario keeps its records and its ledger.
#[derive(Debug, Clone)]
struct Files {
    mode: Mode,
    records: Records,
    /// The store's SQLite file, or its PostgreSQL schema (inbox mode: the ledger too).
    store: String,
    /// The ledger's SQLite file (two-phase mode).
    ledger: String,
}

/// The ledger: one row per effect, no unique constraint.
enum Ledger {
    Sqlite(sqlx::SqlitePool),
    Postgres(sqlx::PgPool, String),
}

impl Files {
    /// The ledger's table and its parameter placeholder, as the handler writes it.
    fn insert(&self) -> String {
        match (self.mode, self.records) {
            (Mode::Inbox, Records::Postgres) => {
                format!("INSERT INTO {}.ledger (k, took_over) VALUES ($1, $2)", self.store)
            }
            (Mode::Inbox, Records::Sqlite) => {
                "INSERT INTO ledger (k, took_over) VALUES (?, ?)".to_owned()
            }
            (Mode::TwoPhase, _) => {
                "INSERT INTO ledger (k, took_over, attempt) VALUES (?, ?, ?)".to_owned()
            }
        }
    }

    async fn sqlite(file: &str) -> sqlx::SqlitePool {
        let url = format!("sqlite://{file}?mode=rwc");
        let pool =
            sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect(&url).await.unwrap();
        sqlx::query("PRAGMA busy_timeout = 30000").execute(&pool).await.unwrap();
        pool
    }

    async fn ledger(&self) -> Ledger {
        match (self.mode, self.records) {
            (Mode::TwoPhase, _) => Ledger::Sqlite(Self::sqlite(&self.ledger).await),
            (Mode::Inbox, Records::Sqlite) => Ledger::Sqlite(Self::sqlite(&self.store).await),
            (Mode::Inbox, Records::Postgres) => {
                let pool = sqlx::PgPool::connect(&pg_url()).await.unwrap();
                Ledger::Postgres(pool, format!("{}.ledger", self.store))
            }
        }
    }

    async fn postgres(&self) -> PostgresStore {
        PostgresStore::connect(&pg_url()).await.unwrap().with_schema(&self.store).unwrap()
    }
}

impl Ledger {
    /// Creates the ledger table. No unique constraint: a second effect for one key would be a
    /// second row.
    async fn create(&self) {
        let sql = "CREATE TABLE ledger (k TEXT NOT NULL, took_over BIGINT NOT NULL, \
                   attempt BIGINT NOT NULL DEFAULT 1)";
        match self {
            Self::Sqlite(p) => {
                sqlx::raw_sql(sql).execute(p).await.unwrap();
            }
            Self::Postgres(p, t) => {
                sqlx::raw_sql(AssertSqlSafe(sql.replace("ledger", t))).execute(p).await.unwrap();
            }
        }
    }

    /// Rows per key.
    async fn effects(&self) -> HashMap<String, i64> {
        let sql = "SELECT k, COUNT(*) FROM ledger GROUP BY k";
        let rows: Vec<(String, i64)> = match self {
            Self::Sqlite(p) => sqlx::query_as(sql).fetch_all(p).await.unwrap(),
            Self::Postgres(p, t) => {
                sqlx::query_as(AssertSqlSafe(sql.replace("ledger", t))).fetch_all(p).await.unwrap()
            }
        };
        rows.into_iter().collect()
    }

    /// Rows per key and attempt (two-phase mode).
    async fn attempts(&self) -> HashMap<(String, i64), i64> {
        let Self::Sqlite(p) = self else { return HashMap::new() };
        let sql = "SELECT k, attempt, COUNT(*) FROM ledger GROUP BY k, attempt";
        let rows: Vec<(String, i64, i64)> = sqlx::query_as(sql).fetch_all(p).await.unwrap();
        rows.into_iter().map(|(k, a, n)| ((k, a), n)).collect()
    }

    /// Whether `key`'s effect was made by a takeover of an expired lease.
    async fn took_over(&self, key: &str) -> bool {
        let Self::Sqlite(p) = self else { return false };
        let sql = "SELECT took_over FROM ledger WHERE k = ?";
        sqlx::query_scalar::<_, i64>(sql).bind(key).fetch_one(p).await.unwrap() == 1
    }
}

fn pg_url() -> String {
    std::env::var(PG_VAR).unwrap_or_else(|_| PG_DEFAULT.to_owned())
}

/// The settings every consumer of the scenario shares.
fn configure<C: SourceConfig>(
    b: Builder<C>,
    batch: usize,
    hook: Hook<<C::Source as Source>::Delivery>,
) -> Builder<C> {
    b.scope("crash").batch(batch).idle_wait(Duration::from_millis(100)).on_settle(hook)
}

/// Counts handler runs and asks `started` whether this one hangs.
struct Runs {
    n: AtomicUsize,
    started: Started,
}

impl Runs {
    /// Counts a run of `m`: its key, and whether it hangs before its effect.
    fn start(&self, m: &impl Envelope) -> (String, bool) {
        let key = m.message_id().unwrap_or_default().to_owned();
        let run = self.n.fetch_add(1, Ordering::SeqCst) + 1;
        let hang = (self.started)(&key, run);
        (key, hang)
    }
}

async fn hang_if(hang: bool) {
    if hang {
        std::future::pending::<()>().await;
    }
}

/// Consumes the harness's destination in `files.mode` as `role` until `shutdown`; `hook` sees
/// every settlement; `started` is told each handler run's key and number, before its effect,
/// and answers whether that handler hangs there (never returns).
async fn consume<H: CrashHarness>(
    h: &H,
    files: &Files,
    role: Role,
    hook: Hook<DeliveryOf<H>>,
    started: Started,
    shutdown: impl Future<Output = ()> + Send,
) -> Report {
    let batch = match role {
        Role::Hang | Role::Cut => 1,
        Role::Poison => 8,
        Role::Abort | Role::Survivor => 32,
    };
    let mut b = configure(Consumer::builder(h.config()), batch, hook);
    if role == Role::Poison {
        // The other scenarios keep the default (5): on Kafka their keys are taken over by
        // several consumers and rebalances, and a claim taken ahead and dropped unused counts
        // as an attempt too.
        b = b.crash_loop_limit(POISON_LIMIT);
    }
    let runs = Runs { n: AtomicUsize::new(0), started };
    let insert = files.insert();
    match (files.mode, files.records) {
        (Mode::Inbox, Records::Sqlite) => {
            let store = SqliteStore::open(&files.store).await.unwrap();
            inbox::<_, _, sqlx::Sqlite>(b.inbox(store.inbox(DAY)), &insert, &runs, shutdown).await
        }
        (Mode::Inbox, Records::Postgres) => {
            let store = files.postgres().await;
            inbox::<_, _, sqlx::Postgres>(b.inbox(store.inbox(DAY)), &insert, &runs, shutdown).await
        }
        (Mode::TwoPhase, records) => {
            let Ledger::Sqlite(ledger) = files.ledger().await else { unreachable!() };
            if records == Records::Sqlite {
                let store = SqliteStore::open(&files.store).await.unwrap();
                two_phase(b.store(store), ledger, &insert, &runs, shutdown).await
            } else {
                two_phase(b.store(files.postgres().await), ledger, &insert, &runs, shutdown).await
            }
        }
    }
}

/// Inbox mode: the ledger row is written on the batch's transaction.
async fn inbox<C, I, DB>(
    b: Builder<C, Inbox<I>>,
    insert: &str,
    runs: &Runs,
    shutdown: impl Future<Output = ()> + Send,
) -> Report
where
    C: SourceConfig,
    DB: sqlx::Database,
    I: TxInbox<Connection = DB::Connection>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'q> i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    let consumer = b.build().await.expect("inbox consumer");
    let handler = |mut tx: Tx<I>, m: <C::Source as Source>::Delivery| {
        let (key, hang) = runs.start(&m);
        let insert = insert.to_owned();
        async move {
            hang_if(hang).await;
            sqlx::query(AssertSqlSafe(insert))
                .bind(key)
                .bind(0_i64)
                .execute(&mut *tx)
                .await
                .map_err(|e| HandlerError::Transient(e.to_string()))?;
            Ok::<_, HandlerError<String>>(())
        }
    };
    consumer.run(handler, shutdown).await.expect("run")
}

/// Two-phase mode: the ledger row is an effect outside the store, counted, never deduplicated.
async fn two_phase<C: SourceConfig, S: DedupStore>(
    b: Builder<C, S>,
    ledger: sqlx::SqlitePool,
    insert: &str,
    runs: &Runs,
    shutdown: impl Future<Output = ()> + Send,
) -> Report {
    let consumer = b.lease(LEASE).retain(DAY).build().await.expect("two-phase consumer");
    let handler = |ctx: Context, m: <C::Source as Source>::Delivery| {
        let (key, hang) = runs.start(&m);
        let (ledger, insert) = (ledger.clone(), insert.to_owned());
        async move {
            hang_if(hang).await;
            sqlx::query(AssertSqlSafe(insert))
                .bind(key)
                .bind(i64::from(ctx.took_over_expired()))
                .bind(i64::from(ctx.attempt()))
                .execute(&ledger)
                .await
                .map_err(|e| HandlerError::Transient(e.to_string()))?;
            Ok::<_, HandlerError<String>>(())
        }
    };
    consumer.run(handler, shutdown).await.expect("run")
}

/// The child process's entry: aborts after its commits, or hangs in a handler until killed.
///
/// # Cancel safety
/// Never returns; the process ends by abort or SIGKILL.
pub async fn child<H: CrashHarness>() {
    crate::process::log_from_env();
    let spec = std::env::var(CHILD_ENV).expect("started by a crash test, with its instructions");
    let parts: Vec<&str> = spec.splitn(6, '|').collect();
    let [role, mode, records, store, ledger, harness] = parts[..] else {
        panic!("bad child instructions {spec}")
    };
    let role = match role {
        "abort" => Role::Abort,
        "poison" => Role::Poison,
        _ => Role::Hang,
    };
    let files = Files {
        mode: if mode == "inbox" { Mode::Inbox } else { Mode::TwoPhase },
        records: if records == "postgres" { Records::Postgres } else { Records::Sqlite },
        store: store.to_owned(),
        ledger: ledger.to_owned(),
    };
    // Never dropped: a child that panics must not delete the parent's destination.
    let h = std::mem::ManuallyDrop::new(H::attach(harness).await);
    let durable = AtomicUsize::new(0);
    let hook: Hook<DeliveryOf<H>> = Box::new(move |s| {
        let key = s.message.message_id().unwrap_or_default();
        match s.outcome {
            OutcomeKind::Duplicate => println!("DUPLICATE {key}"),
            OutcomeKind::FailedPermanent if role == Role::Poison => println!("DEAD {key}"),
            OutcomeKind::Processed if role == Role::Abort => {
                println!("COMMITTED {key}");
                if durable.fetch_add(1, Ordering::SeqCst) + 1 == ABORT_AFTER {
                    // Every effect so far is durable; no acknowledgement has been sent.
                    std::process::abort();
                }
            }
            _ => {}
        }
    });
    let started: Started = Arc::new(move |key, run| {
        if role == Role::Poison && key == POISON {
            println!("ABORT {key}");
            std::process::abort();
        }
        let hang = role == Role::Hang && run == HANG_AT;
        if hang {
            println!("HUNG {key}"); // the parent kills the process on this line
        }
        hang
    });
    consume(&*h, &files, role, hook, started, std::future::pending()).await;
}

/// Runs this test binary's child `entry` in `role` until it prints a line starting with
/// `until` (then kills it) or exits; returns its lines.
async fn run_child<H: CrashHarness>(
    entry: &str,
    h: &H,
    role: &str,
    files: &Files,
    until: Option<&str>,
) -> Vec<String> {
    let mode = if files.mode == Mode::Inbox { "inbox" } else { "two-phase" };
    let records = if files.records == Records::Postgres { "postgres" } else { "sqlite" };
    let (store, ledger, harness) = (&files.store, &files.ledger, h.spec());
    let spec = format!("{role}|{mode}|{records}|{store}|{ledger}|{harness}");
    crate::process::run_child(entry, (CHILD_ENV, &spec), until, LIMIT).await
}

type Outcomes = Arc<Mutex<Vec<(String, OutcomeKind)>>>;

/// Runs `consumers` survivors until every order has its effect and the broker is settled;
/// their hooks record every outcome.
async fn drain<H: CrashHarness>(
    h: &H,
    files: &Files,
    ledger: &Ledger,
    outcomes: &Outcomes,
    consumers: usize,
) -> Report {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let survivors = (0..consumers).map(|_| {
        let (outcomes, mut stopped) = (Arc::clone(outcomes), stopped.clone());
        let hook: Hook<DeliveryOf<H>> = Box::new(move |s| {
            let key = s.message.message_id().unwrap_or_default().to_owned();
            outcomes.lock().unwrap().push((key, s.outcome));
        });
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        consume(h, files, Role::Survivor, hook, Arc::new(|_, _| false), shutdown)
    });
    let watch = async {
        let mut watchdog = Watchdog::default();
        loop {
            let effects = ledger.effects().await;
            let (distinct, rows) = (effects.len(), effects.values().sum::<i64>());
            let settled = h.settled().await;
            if distinct == ORDERS && settled {
                break;
            }
            if watchdog.stalled((distinct, rows, finished(outcomes), settled)) {
                let missing: Vec<String> = (0..ORDERS)
                    .map(|i| format!("o-{i}"))
                    .filter(|k| !effects.contains_key(k))
                    .take(12)
                    .collect();
                panic!(
                    "no progress for {STALL:?}: {distinct} orders, {rows} rows, settled: {settled}; \
                     outcomes {}; missing e.g. {missing:?}; broker: {}",
                    tally(outcomes),
                    h.describe().await
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        stop.send(true).unwrap();
    };
    let (reports, ()) = tokio::join!(futures_util::future::join_all(survivors), watch);
    let mut all = Report::default();
    reports.into_iter().for_each(|r| all += r);
    all
}

/// Tells a wait that still makes progress from one that stopped: fed the state it watches on
/// every poll, it answers `true` once that state has not changed for [`STALL`].
struct Watchdog<T> {
    last: Option<T>,
    since: tokio::time::Instant,
}

impl<T> Default for Watchdog<T> {
    fn default() -> Self {
        Self { last: None, since: tokio::time::Instant::now() }
    }
}

impl<T: PartialEq> Watchdog<T> {
    fn stalled(&mut self, now: T) -> bool {
        if self.last.as_ref() != Some(&now) {
            (self.last, self.since) = (Some(now), tokio::time::Instant::now());
        }
        self.since.elapsed() > STALL
    }
}

/// How many outcomes settled a message for good (processed, duplicate, dead-lettered).
fn finished(outcomes: &Outcomes) -> usize {
    let done = |k: &OutcomeKind| {
        !matches!(k, OutcomeKind::InProgressElsewhere | OutcomeKind::FailedTransient)
    };
    outcomes.lock().unwrap().iter().filter(|(_, k)| done(k)).count()
}

/// The outcomes so far, counted by kind.
fn tally(outcomes: &Outcomes) -> String {
    let all = outcomes.lock().unwrap();
    OutcomeKind::ALL
        .iter()
        .map(|k| format!("{} {}", k.as_str(), all.iter().filter(|(_, o)| o == k).count()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The name of the child entry [`crash_conformance!`](crate::crash_conformance) defines in the
/// module `module_path` (as `module_path!()` gives it: the test binary's name first).
#[must_use]
pub fn entry(module_path: &str) -> String {
    crate::process::child_entry(module_path, "crash_child")
}

/// The scenario (see the module docs) on a fresh destination of `h`, the store's records in
/// `records`; `entry` is the name of the test that runs [`child`] in this binary.
///
/// # Panics
/// When a promise does not hold (the test failing), or when PostgreSQL is unreachable under
/// `CI=true` (locally the case is skipped).
///
/// # Cancel safety
/// Dropped midway, the children are killed with their handles and the PostgreSQL schema is
/// dropped; what was published stays on the harness's destination until the harness is dropped.
pub async fn scenario<H: CrashHarness>(h: H, mode: Mode, records: Records, entry: &str) {
    crate::process::log_from_env();
    let dir = tempfile::tempdir().unwrap();
    let p = |f: &str| dir.path().join(f).to_string_lossy().into_owned();
    let mut files = Files { mode, records, store: p("idem.sqlite"), ledger: p("ledger.sqlite") };
    let mut _drop = None;
    if records == Records::Postgres {
        let Some(url) = crate::service::require("PostgreSQL", PG_VAR, PG_DEFAULT) else { return };
        files.store = format!("idem_crash_{:016x}", rand_u64());
        let sql = format!("DROP SCHEMA IF EXISTS {} CASCADE", files.store);
        _drop = Some(DropSql { url, sql });
        files.postgres().await.migrate().await.unwrap();
    } else {
        SqliteStore::open(&files.store).await.unwrap(); // creates the records table
    }
    let ledger = files.ledger().await;
    ledger.create().await;
    for i in 0..ORDERS {
        h.publish(&format!("o-{i}"), format!(r#"{{"order":{i}}}"#).as_bytes()).await;
    }
    for i in (0..ORDERS).step_by(ORDERS / RETRIES) {
        h.publish(&format!("o-{i}"), format!(r#"{{"order":{i}}}"#).as_bytes()).await;
    }
    h.publish(REUSED, br#"{"order":"other"}"#).await;

    // 1. Abort between commit and ack.
    let aborted = run_child(entry, &h, "abort", &files, None).await;
    let committed: HashSet<String> =
        aborted.iter().filter_map(|l| l.strip_prefix("COMMITTED ")).map(str::to_owned).collect();
    assert_eq!(committed.len(), ABORT_AFTER, "{aborted:?}");
    // 2. SIGKILL mid-handler.
    let hung = run_child(entry, &h, "hang", &files, Some("HUNG ")).await;
    let hung_key = hung.last().and_then(|l| l.strip_prefix("HUNG ")).expect("hung key").to_owned();
    // 3. A connection cut mid-handler: the consumer is dropped while a handler is inside it,
    //    before its effect (a cut after the effect would be the two-phase rerun case).
    let (cut_tx, cut_rx) = tokio::sync::oneshot::channel::<String>();
    let cut_tx = Mutex::new(Some(cut_tx));
    let started: Started = Arc::new(move |key, run| {
        let cut = run == CUT_AT;
        if cut && let Some(tx) = cut_tx.lock().unwrap().take() {
            let _ = tx.send(key.to_owned());
        }
        cut
    });
    let cut = consume(&h, &files, Role::Cut, Box::new(|_| {}), started, std::future::pending());
    let cut_key = tokio::select! {
        _ = cut => panic!("the cut consumer stopped on its own"),
        key = cut_rx => key.expect("cut key"),
    };

    // 4. Two survivors drain; their hooks record every outcome. A consumer that stops gives
    //    back what it had fetched ahead (a broker that counts only ready messages saw none),
    //    so until the broker is settled after they stop, another one drains again.
    let outcomes: Outcomes = Arc::default();
    let mut report = drain(&h, &files, &ledger, &outcomes, 2).await;
    while !h.settled().await {
        report += drain(&h, &files, &ledger, &outcomes, 1).await;
    }

    // Exactly once: one effect per order, the hung and the cut orders included.
    let effects = ledger.effects().await;
    assert_eq!(effects.len(), ORDERS, "{report}");
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "effects not exactly once: {twice:?}; {report}");

    // The aborted deliveries came back and were found done.
    let outcomes = std::mem::take(&mut *outcomes.lock().unwrap());
    for key in &committed {
        let kinds: Vec<_> = outcomes.iter().filter(|(k, _)| k == key).map(|o| o.1).collect();
        assert!(!kinds.contains(&OutcomeKind::Processed), "{key} processed twice: {kinds:?}");
    }
    // Found done by the survivors or by the hanging child (which a broker that keeps order per
    // partition hands them first).
    let found_done: HashSet<&str> = outcomes
        .iter()
        .filter(|(_, o)| *o == OutcomeKind::Duplicate)
        .map(|(k, _)| k.as_str())
        .chain(hung.iter().filter_map(|l| l.strip_prefix("DUPLICATE ")))
        .collect();
    assert!(
        committed.iter().any(|k| found_done.contains(k.as_str())),
        "no aborted delivery came back as a duplicate"
    );
    // The hung and the cut keys were processed afterwards: in two-phase mode as takeovers of
    // the dead consumers' leases.
    for key in [&hung_key, &cut_key] {
        assert_eq!(effects.get(key), Some(&1), "{key}");
        if mode == Mode::TwoPhase {
            assert!(ledger.took_over(key).await, "{key} was not taken over after its lease");
        }
    }

    // The reused id is dead-lettered, once or twice, with the shared headers.
    let dead = h.dead_letters().await;
    assert!((1..=2).contains(&dead.len()), "{} dead letters: {dead:?}", dead.len());
    assert!(dead.iter().all(|d| d.message_id.as_deref() == Some(REUSED)), "{dead:?}");
    assert_eq!(dead[0].headers.get(headers::OUTCOME).map(String::as_str), Some("conflict"));
    assert!(h.settled().await, "something was left unsettled");
    h.cleanup().await;
}

/// The crash-loop scenario on a fresh destination of `h` (two-phase, records in SQLite): 200
/// orders with one poison message among them, whose handler calls `std::process::abort()`.
/// A supervisor starts a consumer process again each time one dies, as a service manager
/// would. Passes when the processes died exactly three times (the crash-loop limit these
/// consumers run with), the poison message was dead-lettered with a `crash loop` reason naming
/// the attempts, every other order's effect happened (repeats only as reruns under a later
/// attempt after a takeover, never twice under one attempt), nothing else was dead-lettered and
/// nothing is left unsettled.
///
/// # Panics
/// When a promise does not hold (the test failing).
///
/// # Cancel safety
/// Dropped midway, the running child is killed with its handle.
pub async fn poison<H: CrashHarness>(h: H, entry: &str) {
    crate::process::log_from_env();
    let dir = tempfile::tempdir().unwrap();
    let p = |f: &str| dir.path().join(f).to_string_lossy().into_owned();
    let files = Files {
        mode: Mode::TwoPhase,
        records: Records::Sqlite,
        store: p("idem.sqlite"),
        ledger: p("ledger.sqlite"),
    };
    SqliteStore::open(&files.store).await.unwrap();
    let ledger = files.ledger().await;
    ledger.create().await;
    for i in 0..POISON_ORDERS {
        if i == POISON_ORDERS / 10 {
            h.publish(POISON, br#"{"order":"poison"}"#).await;
        }
        h.publish(&format!("o-{i}"), format!(r#"{{"order":{i}}}"#).as_bytes()).await;
    }
    let spec = format!("poison|two-phase|sqlite|{}|{}|{}", files.store, files.ledger, h.spec());
    let mut watchdog = Watchdog::default();
    let mut crashes = 0;
    let mut printed = Vec::new();
    // Some harnesses take the dead letters they read: keep every copy seen.
    let dead = Mutex::new(Vec::new());
    loop {
        let mut child = crate::process::spawn_child(entry, &[(CHILD_ENV, &spec)]);
        let out = child.stdout.take().expect("stdout");
        let lines = tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(out).lines();
            let mut seen = Vec::new();
            while let Ok(Some(l)) = lines.next_line().await {
                seen.push(l.rsplit("... ").next().unwrap_or(&l).to_owned());
            }
            seen
        });
        // Until the child dies, or everything is settled with the poison dead-lettered.
        let (watchdog, crashes_so_far) = (&mut watchdog, crashes);
        let drained = async {
            let crashes = crashes_so_far;
            loop {
                let effects = ledger.effects().await.len();
                let (mut seen, mut settled) = (false, false);
                if effects == POISON_ORDERS {
                    let copies = h.dead_letters().await;
                    seen = {
                        let mut dead = dead.lock().unwrap();
                        dead.extend(copies);
                        !dead.is_empty()
                    };
                    settled = h.settled().await;
                    if seen && settled {
                        return;
                    }
                }
                if watchdog.stalled((effects, crashes, seen, settled)) {
                    panic!(
                        "no progress for {STALL:?}: {effects} of {POISON_ORDERS} orders, \
                         {crashes} crashes, dead letter seen: {seen}, settled: {settled}; \
                         broker: {}",
                        h.describe().await
                    );
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::select! {
            status = child.wait() => {
                assert!(!status.unwrap().success(), "a consumer ended by itself");
                crashes += 1;
                printed.extend(lines.await.unwrap());
                assert!(crashes <= POISON_LIMIT + 2, "{crashes} crashes: {printed:?}");
            }
            () = drained => {
                child.kill().await.unwrap();
                printed.extend(lines.await.unwrap());
                break;
            }
        }
    }
    let aborts = printed.iter().filter(|l| l.starts_with("ABORT ")).count();
    assert_eq!(
        (crashes, aborts),
        (POISON_LIMIT, POISON_LIMIT as usize),
        "the processes died once per attempt up to the limit: {printed:?}"
    );
    assert!(printed.iter().any(|l| l == &format!("DEAD {POISON}")), "{printed:?}");
    // Only the poison message was dead-lettered, with the crash loop and its attempts as the
    // reason.
    let dead = dead.into_inner().unwrap();
    assert!(!dead.is_empty());
    for d in &dead {
        assert_eq!(d.message_id.as_deref(), Some(POISON), "{dead:?}");
        let reason = d.headers.get(headers::REASON).map(String::as_str).unwrap_or_default();
        let want = format!("crash loop: {POISON_LIMIT} attempts");
        assert!(reason.contains(&want), "reason {reason:?} lacks {want:?}");
    }
    // Every other order's effect happened; a repeat is a rerun after a takeover (the process
    // died between an effect and its completion), never the same attempt twice.
    let effects = ledger.effects().await;
    assert!(!effects.contains_key(POISON), "the poison handler made its effect");
    assert_eq!(effects.len(), POISON_ORDERS);
    let twice: Vec<_> = ledger.attempts().await.into_iter().filter(|(_, n)| *n > 1).collect();
    assert!(twice.is_empty(), "effects repeated under one attempt: {twice:?}");
    assert!(h.settled().await, "something was left unsettled");
    h.cleanup().await;
}

/// Defines the crash suite in the calling test file: `crash_inbox_mode` and
/// `crash_two_phase_mode` on fresh harnesses from `$make` (an async closure taking the case's
/// name and returning `Option<harness>`, as for
/// [`source_conformance!`](crate::source_conformance)), `crash_loop_is_dead_lettered` (see
/// [`poison`]), and the `crash_child` entry their child processes run (ignored when run alone).
/// With `postgres` last, also
/// `crash_inbox_mode_postgres` and `crash_two_phase_mode_postgres`: the store's records in
/// PostgreSQL. The harness type must implement [`CrashHarness`]. It may be used once per
/// module (a second harness of the same broker goes in a module of its own).
///
/// ```ignore
/// idem_testkit::crash_conformance!(MyBroker, |name: &'static str| async move { MyBroker::new(name).await });
/// ```
#[macro_export]
macro_rules! crash_conformance {
    ($harness:ty, $make:expr) => {
        $crate::__crash_cases!($harness, $make;
            crash_inbox_mode: Inbox, Sqlite;
            crash_two_phase_mode: TwoPhase, Sqlite);
    };
    ($harness:ty, $make:expr, postgres) => {
        $crate::__crash_cases!($harness, $make;
            crash_inbox_mode: Inbox, Sqlite;
            crash_two_phase_mode: TwoPhase, Sqlite;
            crash_inbox_mode_postgres: Inbox, Postgres;
            crash_two_phase_mode_postgres: TwoPhase, Postgres);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __crash_cases {
    ($harness:ty, $make:expr; $($name:ident: $mode:ident, $records:ident);+) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some(h) = ($make)(stringify!($name)).await else { return };
                let (mode, records) =
                    ($crate::crash::Mode::$mode, $crate::crash::Records::$records);
                let entry = $crate::crash::entry(module_path!());
                $crate::crash::scenario::<$harness>(h, mode, records, &entry).await;
            }
        )+

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn crash_loop_is_dead_lettered() {
            let Some(h) = ($make)("crash_loop_is_dead_lettered").await else { return };
            let entry = $crate::crash::entry(module_path!());
            $crate::crash::poison::<$harness>(h, &entry).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "a crash test's child process; run by the crash tests, not alone"]
        async fn crash_child() {
            $crate::crash::child::<$harness>().await;
        }
    };
}
