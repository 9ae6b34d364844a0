//! Crash tests on a real Redis, in inbox mode (SQLite) and two-phase mode (`RedisStore`): a
//! consumer process that aborts between its commit and its `XACK` (from the `on_settle` hook),
//! then one killed while a handler hangs mid-effect; then two consumers drain the stream.
//!
//! Passes when every order's effect is in the ledger (no unique constraint) exactly once, the
//! aborted batch's entries come back and are found done (duplicates), the hung entry is taken
//! over (in two-phase mode once the dead consumer's lease ran out, as a takeover), the reused id
//! is dead-lettered (twice at most: a crash between the copy and the `XACK` repeats the copy,
//! never loses it), and nothing is left pending.

mod common;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::group_state;
use idem_core::OutcomeKind;
use idem_core::Tx;
use idem_core::consumer::{Builder, Report, Settlement, headers};
use idem_core::engine::{Context, HandlerError};
use idem_core::extract::Envelope;
use idem_redis::{Delivery, RedisStore, StreamConfig, StreamConsumer};
use idem_sqlx::{SqliteInbox, SqliteStore};
use idem_testkit::wait_for;
use redis::AsyncCommands;

const ORDERS: usize = 1_000;
const DUPLICATES: usize = 100;
const TOTAL: usize = ORDERS + DUPLICATES + 1;
const REUSED: &str = "o-7";
const GROUP: &str = "workers";
const RECLAIM: Duration = Duration::from_millis(300);
const LEASE: Duration = Duration::from_secs(2);
const CHILD_ENV: &str = "IDEM_REDIS_CRASH_CHILD";
/// The aborting child stops once this many of its entries are processed (committed, unacked).
const ABORT_AFTER: usize = 8;
/// The hanging child hangs on its this-many-th handler run, before the effect.
const HANG_AT: usize = 3;

/// What the processes share: where the stream, the records and the ledger are.
#[derive(Clone, Debug)]
struct Setup {
    inbox: bool,
    /// One server's URL, or (on a cluster) the node URLs separated by commas.
    url: String,
    stream: String,
    /// The SQLite file (inbox mode: records and ledger).
    db: String,
    /// The `RedisStore` namespace (two-phase mode).
    namespace: String,
}

impl Setup {
    fn cluster(&self) -> bool {
        self.url.contains(',')
    }

    fn nodes(&self) -> Vec<&str> {
        self.url.split(',').collect()
    }

    /// The stream's config, on the cluster or the one server.
    fn stream_config(&self, name: &str) -> StreamConfig {
        if self.cluster() {
            let client = redis::cluster::ClusterClient::new(self.nodes()).expect("cluster client");
            StreamConfig::cluster(client, &self.stream, GROUP, name)
        } else {
            let client = redis::Client::open(self.url.as_str()).expect("client");
            StreamConfig::new(client, &self.stream, GROUP, name)
        }
    }

    /// The store in the test's namespace (its connection also carries the ledger).
    async fn store(&self) -> RedisStore {
        let builder = if self.cluster() {
            RedisStore::cluster_builder(self.nodes()).expect("urls")
        } else {
            RedisStore::builder(&self.url).expect("url")
        };
        builder.namespace(&self.namespace).expect("namespace").connect().await.expect("store")
    }

    fn spec(&self) -> String {
        let mode = if self.inbox { "inbox" } else { "two-phase" };
        format!("{mode}|{}|{}|{}|{}", self.url, self.stream, self.db, self.namespace)
    }

    fn parse(spec: &str) -> Self {
        let [mode, url, stream, db, namespace] = spec.split('|').collect::<Vec<_>>()[..] else {
            panic!("bad child spec {spec}")
        };
        let s = |v: &str| v.to_owned();
        Setup {
            inbox: mode == "inbox",
            url: s(url),
            stream: s(stream),
            db: s(db),
            namespace: s(namespace),
        }
    }

    fn ledger_key(&self) -> String {
        format!("{}:ledger", self.stream)
    }

    fn took_over_key(&self) -> String {
        format!("{}:took-over", self.stream)
    }
}

/// How a consumer of the test behaves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Aborts the process from the settle hook (effects durable, nothing acknowledged).
    Abort,
    /// One entry per batch; hangs on its [`HANG_AT`]-th handler run, before the effect.
    Hang,
    /// Runs until told to stop.
    Survivor,
}

type Hook = Box<dyn Fn(&Settlement<'_, Delivery>) + Send + Sync>;

/// Builds a consumer named `name` in `setup`'s mode and runs it until `shutdown`.
async fn consume(
    setup: &Setup,
    name: &str,
    role: Role,
    hook: Hook,
    shutdown: impl Future<Output = ()> + Send,
) -> Report {
    // The hanging consumer never takes over entries: what the aborted one left is the
    // survivors' to find.
    let reclaim = if role == Role::Hang { Duration::from_secs(3600) } else { RECLAIM };
    let config = setup.stream_config(name).reclaim_idle(reclaim);
    let builder = |b: Builder<StreamConfig>| {
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
    if setup.inbox {
        let store = SqliteStore::open(&setup.db).await.expect("sqlite");
        let c = builder(StreamConsumer::builder(config))
            .inbox(store.inbox(Duration::from_secs(86_400)))
            .scope("crash")
            .build()
            .await
            .expect("inbox consumer");
        let handler = |mut tx: Tx<SqliteInbox>, e: Delivery| {
            let key = e.message_id().unwrap_or_default().to_owned();
            let hung = hang(&key);
            async move {
                hung.await;
                sqlx::query("INSERT INTO ledger (k, took_over) VALUES (?, 0)")
                    .bind(key)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| HandlerError::Transient(e.to_string()))?;
                Ok::<_, HandlerError<String>>(())
            }
        };
        c.run(handler, shutdown).await.expect("run")
    } else {
        let store = setup.store().await;
        let ledger = store.connection().clone();
        let c = builder(StreamConsumer::builder(config))
            .store(store)
            .scope("crash")
            .lease(LEASE)
            .retain(Duration::from_secs(86_400))
            .build()
            .await
            .expect("consumer");
        let (ledger_key, took_over_key) = (setup.ledger_key(), setup.took_over_key());
        let handler = |ctx: Context, e: Delivery| {
            let key = e.message_id().unwrap_or_default().to_owned();
            let hung = hang(&key);
            let (mut ledger, ledger_key, took_over_key) =
                (ledger.clone(), ledger_key.clone(), took_over_key.clone());
            async move {
                hung.await;
                // The external effect: counted, never deduplicated.
                let _: i64 = ledger
                    .hincr(&ledger_key, &key, 1)
                    .await
                    .map_err(|e| HandlerError::Transient(e.to_string()))?;
                if ctx.took_over_expired() {
                    let _: i64 = ledger
                        .sadd(&took_over_key, &key)
                        .await
                        .map_err(|e| HandlerError::Transient(e.to_string()))?;
                }
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
        println!("COMMITTED {}", s.message.id());
        if processed.fetch_add(1, Ordering::SeqCst) + 1 == ABORT_AFTER {
            // Every effect of the batch is durable; no XACK has been sent.
            std::process::abort();
        }
    });
    let name = if role == Role::Abort { "child-abort" } else { "child-hang" };
    consume(&setup, name, role, hook, std::future::pending()).await;
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

async fn crash(inbox: bool, cluster: bool) {
    let (url, (store, _offset, mut cleanup)) = if cluster {
        let Some(urls) = common::cluster_urls() else { return };
        (urls.join(","), common::cluster_store(&urls, "crash", true).await)
    } else {
        let Some(url) = common::url() else { return };
        let store = common::store(&url, "crash").await;
        (url, store)
    };
    let stream = common::fresh_name(if inbox { "crash-inbox" } else { "crash-2p" });
    cleanup.patterns.push(format!("{stream}*"));
    let dir = tempfile::tempdir().expect("tempdir");
    let setup = Setup {
        inbox,
        url: url.clone(),
        stream: stream.clone(),
        db: dir.path().join("crash.sqlite").to_string_lossy().into_owned(),
        namespace: store.namespace().as_str().to_owned(),
    };
    let sqlite = SqliteStore::open(&setup.db).await.expect("sqlite"); // creates the records table
    // No unique constraint: a second effect for one key would be a second row.
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL, took_over INTEGER NOT NULL)")
        .execute(sqlite.pool())
        .await
        .expect("ledger");

    // 1,000 orders, 100 of them sent twice, and one id reused with other content last.
    let mut conn = store.connection().clone();
    let mut pipe = redis::pipe();
    let body = |i: usize| format!(r#"{{"order":{i}}}"#);
    for i in (0..ORDERS).chain((0..ORDERS).step_by(ORDERS / DUPLICATES)) {
        pipe.xadd(&stream, "*", &[("message_id", format!("o-{i}")), ("payload", body(i))]);
    }
    pipe.xadd(&stream, "*", &[("message_id", REUSED), ("payload", r#"{"order":"other"}"#)]);
    let _: Vec<String> = pipe.query_async(&mut conn).await.expect("xadd");

    let aborted = child(&setup, "abort", None).await;
    let committed: HashSet<String> =
        aborted.iter().filter_map(|l| l.strip_prefix("COMMITTED ")).map(str::to_owned).collect();
    assert_eq!(committed.len(), ABORT_AFTER, "{aborted:?}");
    let hung = child(&setup, "hang", Some("HUNG ")).await;
    let hung_key = hung.last().and_then(|l| l.strip_prefix("HUNG ")).expect("hung key").to_owned();

    // Two survivors drain the stream; their settle hooks record every outcome.
    let outcomes: Arc<Mutex<Vec<(String, String, OutcomeKind)>>> = Arc::default();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let survivors = (0..2).map(|n| {
        let (outcomes, mut stopped, setup) =
            (Arc::clone(&outcomes), stopped.clone(), setup.clone());
        tokio::spawn(async move {
            let hook: Hook = Box::new(move |s| {
                let key = s.message.message_id().unwrap_or_default().to_owned();
                outcomes.lock().expect("outcomes").push((
                    s.message.id().to_owned(),
                    key,
                    s.outcome,
                ));
            });
            let shutdown = async move {
                let _ = stopped.wait_for(|s| *s).await;
            };
            consume(&setup, &format!("survivor-{n}"), Role::Survivor, hook, shutdown).await
        })
    });
    let survivors: Vec<_> = survivors.collect();
    wait_for("the stream drained", Duration::from_secs(60), || {
        let mut conn = conn.clone();
        let stream = &stream;
        async move { group_state(&mut conn, stream, GROUP).await == Some((0, TOTAL)) }
    })
    .await;
    stop.send(true).expect("stop");
    let mut report = Report::default();
    for s in survivors {
        report += s.await.expect("survivor");
    }

    // Exactly once: one effect per order, the hung order's included.
    let effects: HashMap<String, i64> = if inbox {
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT k, COUNT(*) FROM ledger GROUP BY k")
            .fetch_all(sqlite.pool())
            .await
            .expect("ledger");
        rows.into_iter().collect()
    } else {
        conn.hgetall(setup.ledger_key()).await.expect("ledger")
    };
    assert_eq!(effects.len(), ORDERS, "{report}");
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "effects not exactly once: {twice:?}");

    // The aborted batch came back and was found done; the hung entry was processed here.
    let outcomes = std::mem::take(&mut *outcomes.lock().expect("outcomes"));
    for id in &committed {
        let kinds: Vec<_> = outcomes.iter().filter(|(e, _, _)| e == id).map(|o| o.2).collect();
        assert!(kinds.contains(&OutcomeKind::Duplicate), "{id}: {kinds:?}");
        assert!(!kinds.contains(&OutcomeKind::Processed), "{id} processed twice: {kinds:?}");
    }
    let hung_outcomes: Vec<_> =
        outcomes.iter().filter(|(_, k, _)| *k == hung_key).map(|o| o.2).collect();
    assert!(hung_outcomes.contains(&OutcomeKind::Processed), "{hung_key}: {hung_outcomes:?}");
    if !inbox {
        // Its lease had to run out: a takeover, with the same downstream key.
        let took_over: HashSet<String> = conn.smembers(setup.took_over_key()).await.expect("set");
        assert!(took_over.contains(&hung_key), "{hung_key} not taken over: {took_over:?}");
    }

    // The reused id is dead-lettered, possibly twice (the aborted child may have copied it).
    let dead: redis::streams::StreamRangeReply =
        conn.xrange_all(format!("{stream}:dead-letter")).await.expect("xrange");
    assert!((1..=2).contains(&dead.ids.len()), "{} dead letters", dead.ids.len());
    let positions: HashSet<String> =
        dead.ids.iter().filter_map(|e| e.get::<String>(headers::POSITION)).collect();
    assert_eq!(positions.len(), 1, "more than one entry dead-lettered");
    for e in &dead.ids {
        assert_eq!(e.get::<String>("message_id").as_deref(), Some(REUSED));
        assert_eq!(e.get::<String>(headers::OUTCOME).as_deref(), Some("conflict"));
    }
    assert_eq!(group_state(&mut conn, &stream, GROUP).await, Some((0, TOTAL)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_inbox_mode() {
    crash(true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_two_phase_mode() {
    crash(false, false).await;
}

/// The stream, the ledger and the records on the local 3-master Redis Cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_inbox_mode_on_cluster() {
    crash(true, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_two_phase_mode_on_cluster() {
    crash(false, true).await;
}
