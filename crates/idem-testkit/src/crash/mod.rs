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

mod child;
mod parent;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idem_core::consumer::{Settlement, Source};
use idem_sqlx::{PostgresStore, SqliteStore};
use sqlx::AssertSqlSafe;

use crate::source::{BoxFuture, DropSql, SourceHarness, rand_u64};

pub use child::child;
use child::*;
pub use parent::{entry, poison, scenario};

/// A broker harness a child process can attach to: the crash suite's children consume the
/// destination the parent made.
pub trait CrashHarness: SourceHarness + 'static {
    /// What a child needs to reach the same destination (its names), on one line.
    fn spec(&self) -> String;

    /// The harness for `spec`, in a child process: the same destination, which the child never
    /// deletes.
    fn attach(spec: &str) -> BoxFuture<'static, Self>;
}

pub(super) type DeliveryOf<H> = <<H as SourceHarness>::Source as Source>::Delivery;
pub(super) type Hook<M> = Box<dyn Fn(&Settlement<'_, M>) + Send + Sync>;
/// Told each handler run's key and number before its effect; `true` makes that handler hang.
pub(super) type Started = Arc<dyn Fn(&str, usize) -> bool + Send + Sync>;

pub(super) const ORDERS: usize = 1_000;
pub(super) const RETRIES: usize = 100;
pub(super) const REUSED: &str = "o-7";
/// The aborting child stops once this many of its deliveries are durable.
pub(super) const ABORT_AFTER: usize = 8;
/// The hanging child hangs in its this-many-th handler run, before the effect.
pub(super) const HANG_AT: usize = 3;
/// The cut consumer is dropped inside its this-many-th handler run.
pub(super) const CUT_AT: usize = 5;
pub(super) const LEASE: Duration = Duration::from_secs(2);
/// The crash-loop scenario's key whose handler aborts the process.
pub(super) const POISON: &str = "o-poison";
/// The crash-loop limit every consumer of the suite runs with.
pub(super) const POISON_LIMIT: u32 = 3;
/// Orders published around the poison message.
pub(super) const POISON_ORDERS: usize = 200;
pub(super) const DAY: Duration = Duration::from_secs(86_400);
/// How long a child may go without printing a line it is expected to print.
pub(super) const LIMIT: Duration = Duration::from_secs(120);
/// How long the drain may go without progress — a new effect, a message settled for good, or
/// the broker reporting everything settled — before the scenario fails, showing what it saw. A
/// slow machine slows progress down; only a stuck consumer stops it.
pub(super) const STALL: Duration = Duration::from_secs(60);
pub(super) const PG_VAR: &str = "IDEM_TEST_POSTGRES_URL";
pub(super) const PG_DEFAULT: &str = "postgres://postgres@127.0.0.1:5432/test";
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

    /// The run's records in `mode`: SQLite files in `dir`, or a fresh PostgreSQL schema named
    /// `prefix_<random>` (migrated; dropped when the returned guard is). `None` when PostgreSQL
    /// is unreachable outside CI (the case is skipped).
    async fn create(
        mode: Mode,
        records: Records,
        dir: &std::path::Path,
        prefix: &str,
    ) -> Option<(Self, Option<DropSql>)> {
        let p = |f: &str| dir.join(f).to_string_lossy().into_owned();
        let mut files =
            Files { mode, records, store: p("idem.sqlite"), ledger: p("ledger.sqlite") };
        if records == Records::Postgres {
            let url = crate::service::require("PostgreSQL", PG_VAR, PG_DEFAULT)?;
            files.store = format!("{prefix}_{:016x}", rand_u64());
            let sql = format!("DROP SCHEMA IF EXISTS {} CASCADE", files.store);
            let guard = DropSql { url, sql };
            files.postgres().await.migrate().await.unwrap();
            return Some((files, Some(guard)));
        }
        SqliteStore::open(&files.store).await.unwrap(); // creates the records table
        Some((files, None))
    }

    /// A child's instructions ([`CHILD_ENV`]) for `role` on the harness `spec`.
    fn child_spec(&self, role: &str, harness: &str) -> String {
        let mode = if self.mode == Mode::Inbox { "inbox" } else { "two-phase" };
        let records = if self.records == Records::Postgres { "postgres" } else { "sqlite" };
        format!("{role}|{mode}|{records}|{}|{}|{harness}", self.store, self.ledger)
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

/// Defines the crash suite in the calling test file: `crash_inbox_mode` and
/// `crash_two_phase_mode` on fresh harnesses from `$make` (an async closure taking the case's
/// name and returning `Option<harness>`, as for
/// [`source_conformance!`](crate::source_conformance)), `crash_loop_is_dead_lettered` (see
/// [`poison`]; `crash_loop_is_dead_lettered_inbox` the same in inbox mode on PostgreSQL),
/// and the `crash_child` entry their child processes run (ignored when run alone).
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
            let (mode, records) = ($crate::crash::Mode::TwoPhase, $crate::crash::Records::Sqlite);
            $crate::crash::poison::<$harness>(h, mode, records, &entry).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn crash_loop_is_dead_lettered_inbox() {
            let Some(h) = ($make)("crash_loop_is_dead_lettered_inbox").await else { return };
            let entry = $crate::crash::entry(module_path!());
            let (mode, records) = ($crate::crash::Mode::Inbox, $crate::crash::Records::Postgres);
            $crate::crash::poison::<$harness>(h, mode, records, &entry).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        #[ignore = "a crash test's child process; run by the crash tests, not alone"]
        async fn crash_child() {
            $crate::crash::child::<$harness>().await;
        }
    };
}
