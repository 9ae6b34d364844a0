//! The crash suite's child process: a consumer in one role, over the run's records and
//! ledger.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure is the test failing

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_core::consumer::{Builder, Consumer, Report, Source, SourceConfig};
use idem_core::engine::{Context, HandlerError};
use idem_core::extract::Envelope;
use idem_core::inbox::{Inbox, Tx, TxInbox};
use idem_core::{DedupStore, OutcomeKind};
use idem_sqlx::SqliteStore;
use sqlx::AssertSqlSafe;

use super::*;

/// How one consumer of the scenario behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    Abort,
    Hang,
    Cut,
    Survivor,
    /// Aborts the process whenever the poison key's handler starts.
    Poison,
}

/// The settings every consumer of the scenario shares.
pub(super) fn configure<C: SourceConfig>(
    b: Builder<C>,
    batch: usize,
    hook: Hook<<C::Source as Source>::Delivery>,
) -> Builder<C> {
    b.scope("crash").batch(batch).idle_wait(Duration::from_millis(100)).on_settle(hook)
}

/// Counts handler runs and asks `started` whether this one hangs.
pub(super) struct Runs {
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

pub(super) async fn hang_if(hang: bool) {
    if hang {
        std::future::pending::<()>().await;
    }
}

/// Consumes the harness's destination in `files.mode` as `role` until `shutdown`; `hook` sees
/// every settlement; `started` is told each handler run's key and number, before its effect,
/// and answers whether that handler hangs there (never returns).
pub(super) async fn consume<H: CrashHarness>(
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
    // Every scenario with the poison scenario's limit (3): only deaths count, so the keys the
    // other scenarios take over (a kill, a cut, rebalances on Kafka, claims taken ahead and
    // given back) stay far below it.
    // The lease is the crash notes' too (inbox mode): a dead child's note runs out in 2 s.
    let b = configure(Consumer::builder(h.config()), batch, hook)
        .crash_loop_limit(POISON_LIMIT)
        .lease(LEASE);
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
pub(super) async fn inbox<C, I, DB>(
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
pub(super) async fn two_phase<C: SourceConfig, S: DedupStore>(
    b: Builder<C, S>,
    ledger: sqlx::SqlitePool,
    insert: &str,
    runs: &Runs,
    shutdown: impl Future<Output = ()> + Send,
) -> Report {
    let consumer = b.retain(DAY).build().await.expect("two-phase consumer");
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
pub(super) async fn run_child<H: CrashHarness>(
    entry: &str,
    h: &H,
    role: &str,
    files: &Files,
    until: Option<&str>,
) -> Vec<String> {
    let spec = files.child_spec(role, &h.spec());
    crate::process::run_child(entry, (CHILD_ENV, &spec), until, LIMIT).await
}
