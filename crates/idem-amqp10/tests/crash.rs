//! Crash tests on RabbitMQ's AMQP 1.0 plugin, in inbox mode and two-phase mode (both on a
//! SQLite file): a consumer process that aborts between its commit and its `accepted` (from the
//! `on_settle` hook), then one killed with SIGKILL while a handler hangs mid-effect; then two
//! consumers drain the queue.
//!
//! Passes when every order's effect is in the ledger (no unique constraint) exactly once, the
//! aborted batch's messages come back and are found done (duplicates), the hung message is
//! processed by a survivor, the reused id is dead-lettered (twice at most: a crash between the
//! copy and the `accepted` repeats the copy, never loses it), and the queue is empty.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Broker;
use idem_amqp10::{Amqp10Config, Amqp10Consumer, DeadLetters, Delivery};
use idem_core::OutcomeKind;
use idem_core::Tx;
use idem_core::consumer::{Builder, Report, Settlement};
use idem_core::engine::{Context, HandlerError};
use idem_core::extract::Envelope;
use idem_sqlx::{SqliteInbox, SqliteStore};

const ORDERS: usize = 500;
const DUPLICATES: usize = 50;
const REUSED: &str = "o-7";
const CHILD_ENV: &str = "IDEM_AMQP10_CRASH_CHILD";
/// The aborting child stops once this many of its messages are processed (committed, unsettled).
const ABORT_AFTER: usize = 8;
/// The hanging child hangs on its this-many-th handler run, before the effect.
const HANG_AT: usize = 3;
/// How long the survivors must settle nothing before the queue counts as drained: longer than
/// the longest hold of a retry (`retry_delay` max, 500 ms).
const QUIET: Duration = Duration::from_millis(1500);

#[derive(Clone, Debug)]
struct Setup {
    inbox: bool,
    url: String,
    address: String,
    dlq: String,
    db: String,
}

impl Setup {
    fn spec(&self) -> String {
        let mode = if self.inbox { "inbox" } else { "two-phase" };
        format!("{mode}|{}|{}|{}|{}", self.url, self.address, self.dlq, self.db)
    }

    fn parse(spec: &str) -> Self {
        let [mode, url, address, dlq, db] = spec.split('|').collect::<Vec<_>>()[..] else {
            panic!("bad child spec {spec}")
        };
        Setup {
            inbox: mode == "inbox",
            url: url.into(),
            address: address.into(),
            dlq: dlq.into(),
            db: db.into(),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Abort,
    Hang,
    Survivor,
}

type Hook = Box<dyn Fn(&Settlement<'_, Delivery>) + Send + Sync>;

async fn consume(
    setup: &Setup,
    role: Role,
    hook: Hook,
    shutdown: impl Future<Output = ()> + Send,
) -> Report {
    let config = Amqp10Config::new(setup.url.clone(), setup.address.clone())
        .dead_letters(DeadLetters::Address(setup.dlq.clone()))
        // Held retries (a key in progress elsewhere) stay well under the QUIET spell below.
        .retry_delay(Duration::from_millis(100), Duration::from_millis(500))
        .prefetch(if role == Role::Hang { 1 } else { 128 });
    let builder = |b: Builder<Amqp10Config>| {
        b.batch(if role == Role::Hang { 1 } else { 64 })
            .idle_wait(Duration::from_millis(100))
            .on_settle(hook)
    };
    let runs = AtomicUsize::new(0);
    let hang = |key: &str| {
        let hung = role == Role::Hang && runs.fetch_add(1, Ordering::SeqCst) + 1 == HANG_AT;
        if hung {
            println!("HUNG {key}");
        }
        async move {
            if hung {
                std::future::pending::<()>().await;
            }
        }
    };
    let store = SqliteStore::open(&setup.db).await.expect("sqlite");
    let ledger = store.pool().clone();
    if setup.inbox {
        let c = builder(Amqp10Consumer::builder(config))
            .inbox(store.inbox(Duration::from_secs(86_400)))
            .scope("crash")
            .build()
            .await
            .expect("inbox consumer");
        let handler = |mut tx: Tx<SqliteInbox>, m: Delivery| {
            let key = m.message_id().unwrap_or_default().to_owned();
            let hung = hang(&key);
            async move {
                hung.await;
                sqlx::query("INSERT INTO ledger (k) VALUES (?)")
                    .bind(key)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| HandlerError::Transient(e.to_string()))?;
                Ok::<_, HandlerError<String>>(())
            }
        };
        c.run(handler, shutdown).await.expect("run")
    } else {
        let c = builder(Amqp10Consumer::builder(config))
            .store(store)
            .scope("crash")
            .lease(Duration::from_secs(2))
            .retain(Duration::from_secs(86_400))
            .build()
            .await
            .expect("consumer");
        let handler = |_ctx: Context, m: Delivery| {
            let key = m.message_id().unwrap_or_default().to_owned();
            let hung = hang(&key);
            let ledger = ledger.clone();
            async move {
                hung.await;
                // The external effect: a row per run, never deduplicated.
                sqlx::query("INSERT INTO ledger (k) VALUES (?)")
                    .bind(key)
                    .execute(&ledger)
                    .await
                    .map_err(|e| HandlerError::Transient(e.to_string()))?;
                Ok::<_, HandlerError<String>>(())
            }
        };
        c.run(handler, shutdown).await.expect("run")
    }
}

/// Entry point of the child processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the crash test's child process; run by it, not alone"]
async fn crash_child_process_entry() {
    let spec = std::env::var(CHILD_ENV).expect("started by a crash test, with its spec");
    let (role, spec) = spec.split_once('|').expect("role");
    let setup = Setup::parse(spec);
    let role = if role == "abort" { Role::Abort } else { Role::Hang };
    let processed = AtomicUsize::new(0);
    let hook: Hook = Box::new(move |s| {
        if role != Role::Abort || s.outcome != OutcomeKind::Processed {
            return;
        }
        println!("COMMITTED {}", s.message.message_id().unwrap_or_default());
        if processed.fetch_add(1, Ordering::SeqCst) + 1 == ABORT_AFTER {
            // Every effect of the batch is durable; no `accepted` has been sent.
            std::process::abort();
        }
    });
    consume(&setup, role, hook, std::future::pending()).await;
}

/// Runs a child process in `role` until it prints a line starting with `until` (then kills
/// it with SIGKILL), or until it exits; returns the lines it printed.
async fn child(setup: &Setup, role: &str, until: Option<&str>) -> Vec<String> {
    let spec = format!("{role}|{}", setup.spec());
    idem_testkit::process::run_child(
        "crash_child_process_entry",
        (CHILD_ENV, &spec),
        until,
        Duration::from_secs(60),
    )
    .await
}

async fn ledger(pool: &sqlx::SqlitePool) -> HashMap<String, i64> {
    let rows: Vec<(String, i64)> = sqlx::query_as("SELECT k, COUNT(*) FROM ledger GROUP BY k")
        .fetch_all(pool)
        .await
        .expect("ledger");
    rows.into_iter().collect()
}

async fn crash(inbox: bool) {
    let Some(broker) = Broker::new(if inbox { "crash-inbox" } else { "crash-2p" }).await else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let setup = Setup {
        inbox,
        url: broker.url.clone(),
        address: broker.address(),
        dlq: broker.dlq_address(),
        db: dir.path().join("crash.sqlite").to_string_lossy().into_owned(),
    };
    let sqlite = SqliteStore::open(&setup.db).await.expect("sqlite");
    // No unique constraint: a second effect for one key would be a second row.
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL)")
        .execute(sqlite.pool())
        .await
        .expect("ledger");

    // 500 orders, 50 of them sent twice, and one id reused with other content last.
    let body = |i: usize| format!(r#"{{"order":{i}}}"#);
    for i in (0..ORDERS).chain((0..ORDERS).step_by(ORDERS / DUPLICATES)) {
        broker.publish(Some(&format!("o-{i}")), body(i).as_bytes(), &[]).await;
    }
    broker.publish(Some(REUSED), br#"{"order":"other"}"#, &[]).await;

    let aborted = child(&setup, "abort", None).await;
    let committed: HashSet<String> =
        aborted.iter().filter_map(|l| l.strip_prefix("COMMITTED ")).map(str::to_owned).collect();
    assert!(!committed.is_empty() && committed.len() <= ABORT_AFTER, "{aborted:?}");
    let hung = child(&setup, "hang", Some("HUNG ")).await;
    let hung_key = hung.last().and_then(|l| l.strip_prefix("HUNG ")).expect("hung key").to_owned();

    let outcomes: Arc<Mutex<Vec<(String, OutcomeKind)>>> = Arc::default();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let survivors: Vec<_> = (0..2)
        .map(|_| {
            let (outcomes, mut stopped, setup) =
                (Arc::clone(&outcomes), stopped.clone(), setup.clone());
            tokio::spawn(async move {
                let hook: Hook = Box::new(move |s| {
                    let key = s.message.message_id().unwrap_or_default().to_owned();
                    outcomes.lock().expect("outcomes").push((key, s.outcome));
                });
                let shutdown = async move {
                    let _ = stopped.wait_for(|s| *s).await;
                };
                consume(&setup, Role::Survivor, hook, shutdown).await
            })
        })
        .collect();
    // Drained: every effect in the ledger, the conflict seen, nothing ready, and the survivors
    // quiet for a while (so nothing is left on their links or held for a retry).
    let (mut settled, mut quiet_since) = (0, tokio::time::Instant::now());
    idem_testkit::wait_for("the queue drained", Duration::from_secs(60), || {
        let now_settled = outcomes.lock().expect("outcomes").len();
        if now_settled != settled {
            (settled, quiet_since) = (now_settled, tokio::time::Instant::now());
        }
        let quiet = quiet_since.elapsed() > QUIET;
        let conflict_seen = outcomes
            .lock()
            .expect("outcomes")
            .iter()
            .any(|(k, o)| k == REUSED && *o == OutcomeKind::Conflict);
        let (sqlite, broker) = (&sqlite, &broker);
        async move {
            quiet
                && conflict_seen
                && ledger(sqlite.pool()).await.len() == ORDERS
                && broker.count(&broker.name).await == 0
        }
    })
    .await;
    stop.send(true).expect("stop");
    let mut report = Report::default();
    for s in survivors {
        report += s.await.expect("survivor");
    }

    let effects = ledger(sqlite.pool()).await;
    assert_eq!(effects.len(), ORDERS, "{report}");
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "effects not exactly once: {twice:?}");

    let outcomes = std::mem::take(&mut *outcomes.lock().expect("outcomes"));
    // The aborted batch came back (to the hanging child or a survivor) and was found done.
    for key in &committed {
        let kinds: Vec<_> = outcomes.iter().filter(|(k, _)| k == key).map(|o| o.1).collect();
        assert!(!kinds.contains(&OutcomeKind::Processed), "{key} processed twice: {kinds:?}");
    }
    assert!(report.duplicates > 0, "no redelivered duplicates: {report}");
    let hung_outcomes: Vec<_> =
        outcomes.iter().filter(|(k, _)| *k == hung_key).map(|o| o.1).collect();
    assert!(hung_outcomes.contains(&OutcomeKind::Processed), "{hung_key}: {hung_outcomes:?}");

    let dead = broker.drain_dlq().await;
    assert!((1..=2).contains(&dead.len()), "{} dead letters", dead.len());
    for (id, headers) in &dead {
        assert_eq!(id.as_deref(), Some(REUSED));
        assert_eq!(headers.get("idem-outcome").map(String::as_str), Some("conflict"));
    }
    // Nothing left ready once the survivors have closed (unsettled would be back by now).
    assert_eq!(broker.count(&broker.name).await, 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_inbox_mode() {
    crash(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_two_phase_mode() {
    crash(false).await;
}
