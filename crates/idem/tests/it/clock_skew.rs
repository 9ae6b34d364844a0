//! A consumer whose clock is wrong. On PostgreSQL and Redis leases are measured by the server's
//! clock, so a consumer process running 10 minutes ahead or behind (under libfaketime) neither
//! takes over a live lease early nor grants leases that others see as long expired or far in the
//! future. SQLite is embedded: its clock is the process's, and the test with an injected clock
//! shows what a skew between two processes sharing a file does.
//!
//! The skewed process is this test binary run again under `LD_PRELOAD=libfaketime` (Debian
//! package `faketime`); the monotonic clock is left alone (`FAKETIME_DONT_FAKE_MONOTONIC=1`) so
//! that timers and timeouts behave.
#![cfg(all(feature = "postgres", feature = "redis", feature = "sqlite"))]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed setup step is the test failing

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem::engine::HandlerError;
use idem::extract::Message;
use idem::{Claim, ClaimRequest, DedupKey, DedupStore, Engine, Outcome, PostgresStore};
use idem_testkit::process::{child_entry, spawn_child};
use rand::Rng;
use tokio::io::AsyncBufReadExt;

const SPEC: &str = "IDEM_SKEW_SPEC";
const LEASE: Duration = Duration::from_secs(30);
/// How far a lease's time left may exceed its length on a store that stamps leases from an
/// estimate of its clock (Redis's fast claim).
const ESTIMATE: Duration = Duration::from_secs(1);
const RETAIN: Duration = Duration::from_secs(3_600);
const LIBFAKETIME: [&str; 2] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
];

fn libfaketime() -> Option<&'static str> {
    let found = LIBFAKETIME.into_iter().find(|p| std::path::Path::new(p).exists());
    if found.is_none() {
        assert!(!idem_testkit::service::in_ci(), "libfaketime missing: apt-get install faketime");
        eprintln!("skipped: libfaketime not installed (apt-get install faketime)");
    }
    found
}

fn request(key: &DedupKey) -> ClaimRequest {
    ClaimRequest::new(key.clone(), None, LEASE, RETAIN)
}

fn unix_now() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs()).unwrap()
}

/// `<store> <url> <namespace> <held key> <fresh key>`
struct Spec {
    store: String,
    url: String,
    namespace: String,
    held: String,
    fresh: String,
}

impl Spec {
    fn line(&self) -> String {
        format!("{} {} {} {} {}", self.store, self.url, self.namespace, self.held, self.fresh)
    }

    fn parse(s: &str) -> Self {
        let p: Vec<&str> = s.split(' ').collect();
        Self {
            store: p[0].into(),
            url: p[1].into(),
            namespace: p[2].into(),
            held: p[3].into(),
            fresh: p[4].into(),
        }
    }
}

/// What a claim answered, in one word.
fn word(c: &Claim) -> String {
    match c {
        Claim::Acquired(_) => "acquired".into(),
        Claim::InProgress { retry_after, .. } => format!("in_progress:{}", retry_after.as_secs()),
        Claim::Completed(_) => "completed".into(),
        Claim::Conflict(_) => "conflict".into(),
    }
}

async fn skewed_side<S: DedupStore + Clone>(store: S, spec: &Spec) {
    println!("clock {}", unix_now());
    // The consumer path: a delivery of the key the other process holds must not run.
    let consumer = Engine::builder(store.clone()).scope("skew").lease(LEASE).build().unwrap();
    let msg = Message::new("{}").with_message_id(spec.held.as_str());
    let ran = std::sync::atomic::AtomicBool::new(false);
    let _: Outcome<(), String> = consumer
        .process(&msg, |_| async {
            ran.store(true, std::sync::atomic::Ordering::SeqCst);
            Ok::<(), HandlerError<String>>(())
        })
        .await;
    let ran = ran.load(std::sync::atomic::Ordering::SeqCst);
    println!("process held {}", if ran { "ran" } else { "not_run" });
    let held = DedupKey::new("skew", spec.held.as_str()).unwrap();
    println!("claim held {}", word(&store.claim(&request(&held)).await.unwrap()));
    // A lease granted to this process: the other one must see it as live for its whole length.
    let fresh = DedupKey::new("skew", spec.fresh.as_str()).unwrap();
    let c = store.claim(&request(&fresh)).await.unwrap();
    println!("claim fresh {}", word(&c));
    if let Claim::Acquired(lease) = c {
        std::mem::forget(lease); // held until it expires
    }
    println!("done");
}

/// The child: the same claims, from a process whose wall clock is skewed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the skewed child process of the clock-skew tests"]
async fn skew_child() {
    let spec = Spec::parse(&std::env::var(SPEC).expect("run by the skew tests"));
    match spec.store.as_str() {
        "postgres" => {
            let pool = idem::sqlx::PgPool::connect(&spec.url).await.unwrap();
            skewed_side(PostgresStore::new(pool).with_schema(&spec.namespace).unwrap(), &spec)
                .await;
        }
        "redis" => {
            let store = idem::redis::RedisStore::builder(&spec.url)
                .unwrap()
                .namespace(&spec.namespace)
                .unwrap()
                .connect()
                .await
                .unwrap();
            skewed_side(store, &spec).await;
        }
        other => panic!("unknown store {other}"),
    }
}

/// Runs the child under `FAKETIME=<skew>` and returns its lines.
async fn run_skewed(lib: &str, skew: &str, spec: &Spec) -> Vec<String> {
    let line = spec.line();
    let env = [
        (SPEC, line.as_str()),
        ("LD_PRELOAD", lib),
        ("FAKETIME", skew),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ];
    let mut child = spawn_child(&child_entry(module_path!(), "skew_child"), &env);
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(l) = lines.next_line().await.unwrap() {
            let l = l.rsplit("... ").next().unwrap_or(&l).to_owned();
            let done = l == "done";
            seen.push(l);
            if done {
                break;
            }
        }
    })
    .await
    .expect("the skewed child finishes");
    let status = child.wait().await.unwrap();
    assert!(status.success(), "the skewed child failed: {seen:?}");
    seen
}

/// Holds a key, lets a skewed process try it and claim another, then checks both from here.
async fn leases_follow_the_store_clock<S: DedupStore>(
    store: S,
    url: &str,
    kind: &str,
    namespace: &str,
) {
    let Some(lib) = libfaketime() else { return };
    for (skew, secs) in [("+10m", 600_i64), ("-10m", -600)] {
        let tag = rand::rng().random::<u32>();
        let spec = Spec {
            store: kind.into(),
            url: url.into(),
            namespace: namespace.into(),
            held: format!("held-{tag}"),
            fresh: format!("fresh-{tag}"),
        };
        let held = DedupKey::new("skew", spec.held.as_str()).unwrap();
        let Claim::Acquired(_lease) = store.claim(&request(&held)).await.unwrap() else {
            panic!("a fresh key is acquired")
        };
        let lines = run_skewed(lib, skew, &spec).await;
        let get = |prefix: &str| {
            lines
                .iter()
                .find_map(|l| l.strip_prefix(prefix))
                .unwrap_or_else(|| panic!("no `{prefix}` in {lines:?}"))
                .to_owned()
        };
        let their_clock: i64 = get("clock ").parse().unwrap();
        let off = their_clock - unix_now();
        assert!(
            (off - secs).abs() < 30,
            "{skew}: the child's clock is off by {off} s, not {secs} s"
        );
        assert_eq!(get("process held "), "not_run", "{kind} {skew}: a live lease was taken over");
        let held_answer = get("claim held ");
        assert!(held_answer.starts_with("in_progress:"), "{kind} {skew}: {held_answer}");
        let left: u64 = held_answer["in_progress:".len()..].parse().unwrap();
        assert!((25..=30).contains(&left), "{kind} {skew}: {left} s left of a 30 s lease");
        assert_eq!(get("claim fresh "), "acquired", "{kind} {skew}");
        // The lease the skewed process took is live for its length, here as well. Redis's
        // fast claim stamps a lease's end from its estimate of the server's clock (an anchor
        // read from `TIME`, ± half that round trip), and answers from one: the time left may
        // exceed the lease by those few milliseconds (30.0017 s seen with one core busy), never
        // by anything near the 600 s skew this test is about.
        let fresh = DedupKey::new("skew", spec.fresh.as_str()).unwrap();
        match store.claim(&request(&fresh)).await.unwrap() {
            Claim::InProgress { retry_after, .. } => assert!(
                (Duration::from_secs(20)..=LEASE + ESTIMATE).contains(&retry_after),
                "{kind} {skew}: the skewed process's lease has {retry_after:?} left"
            ),
            other => {
                panic!("{kind} {skew}: the skewed process's lease was not live: {}", word(&other))
            }
        }
        println!(
            "{kind}, consumer clock {skew}: no takeover either way; leases by the server's clock"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_leases_ignore_a_skewed_consumer_clock() {
    let Some(url) = idem_testkit::service::require(
        "postgres",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ) else {
        return;
    };
    let pool = idem::sqlx::PgPool::connect(&url).await.unwrap();
    let schema = format!("idem_skew_{}", rand::rng().random::<u32>());
    let store = PostgresStore::new(pool.clone()).with_schema(&schema).unwrap();
    store.migrate().await.unwrap();
    leases_follow_the_store_clock(store, &url, "postgres", &schema).await;
    idem::sqlx::raw_sql(idem::sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(&pool)
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_leases_ignore_a_skewed_consumer_clock() {
    let Some(url) =
        idem_testkit::service::require("redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/")
    else {
        return;
    };
    let namespace = format!("skew-{}", rand::rng().random::<u32>());
    let store = idem::redis::RedisStore::builder(&url)
        .unwrap()
        .namespace(&namespace)
        .unwrap()
        .connect()
        .await
        .unwrap();
    leases_follow_the_store_clock(store, &url, "redis", &namespace).await;
}

/// SQLite is embedded: the store's clock is the process's. Two processes sharing one file with
/// clocks 10 minutes apart disagree about leases: the one ahead takes over a live lease at once,
/// and the one behind sees a lease it granted as live for 10 minutes longer than asked. (Processes
/// sharing a SQLite file share a host, so in practice they share one clock.)
#[tokio::test]
async fn sqlite_leases_follow_each_process_clock() {
    use idem::time::ManualClock;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("skew.db");
    let (here, ahead) = (ManualClock::new(), ManualClock::new());
    ahead.advance(Duration::from_secs(600));
    let a = idem::SqliteStore::open(&path).await.unwrap().with_clock(here.clone());
    a.migrate().await.unwrap();
    let b = idem::SqliteStore::open(&path).await.unwrap().with_clock(ahead.clone());
    let key = DedupKey::new("skew", "k").unwrap();
    let Claim::Acquired(_held) = a.claim(&request(&key)).await.unwrap() else { panic!("acquired") };
    let Claim::Acquired(taken) = b.claim(&request(&key)).await.unwrap() else {
        panic!("the process 10 minutes ahead takes the live lease over")
    };
    assert!(taken.took_over_expired(), "a takeover of an 'expired' lease");
    // And the other way: seen from the correct clock, the lease granted 10 minutes ahead has
    // 10 minutes 30 s left.
    match a.claim(&request(&key)).await.unwrap() {
        Claim::InProgress { retry_after, .. } => {
            assert!(retry_after > Duration::from_secs(600), "{retry_after:?}");
        }
        other => panic!("{}", word(&other)),
    }
}
