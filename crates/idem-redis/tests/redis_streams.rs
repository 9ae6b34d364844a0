//! The Redis Streams adapter on the real server: 4 competing consumers over 10,000 entries with
//! 20% duplicates, one consumer dropped mid-run without acking.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::Consumer;
use idem_core::consumer::HandlerError;
use idem_core::driver::Report;
use idem_core::extract::Envelope;
use idem_redis::{RedisStore, StreamConfig, StreamConsumer, StreamEntry};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use redis::AsyncCommands;

const UNIQUE: usize = 8_000;
const EXACT_DUPS: usize = 1_950;
const CONFLICTS: usize = 50;
const POISON: usize = 20;

/// Every handler run that had an effect, per key. Deliberately does not deduplicate.
type Ledger = Arc<Mutex<HashMap<String, u32>>>;

fn payload(id: usize, cents: u64, poison: bool) -> String {
    format!(r#"{{"order":"o-{id}","cents":{cents},"poison":{poison}}}"#)
}

async fn handler(ledger: Ledger, entry: StreamEntry) -> Result<u64, HandlerError<String>> {
    let v: serde_json::Value = serde_json::from_slice(entry.payload())
        .map_err(|e| HandlerError::Permanent(e.to_string()))?;
    if v["poison"].as_bool() == Some(true) {
        return Err(HandlerError::Permanent("poison order".into()));
    }
    let id = entry.message_id().unwrap_or_default().to_owned();
    *ledger.lock().expect("ledger").entry(id).or_default() += 1;
    Ok(v["cents"].as_u64().unwrap_or(0))
}

async fn group_state(conn: &mut redis::aio::MultiplexedConnection, stream: &str) -> (i64, i64) {
    // XINFO GROUPS: [name, .., pending, n, .., entries-read, n, ..]
    let groups: Vec<HashMap<String, redis::Value>> =
        redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(conn).await.expect("xinfo");
    let g = &groups[0];
    let num = |k: &str| match g.get(k) {
        Some(redis::Value::Int(n)) => *n,
        _ => -1,
    };
    (num("pending"), num("entries-read"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_competing_consumers_one_dropped_exactly_once() {
    let Some(url) = common::url() else { return };
    let stream = common::fresh_name("stream");
    let (store, _offset, mut cleanup) = common::store(&url, "streams").await;
    cleanup.patterns.push(format!("{stream}*"));
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("conn");

    // The workload: 8,000 orders (20 of them poison), 1,950 exact duplicates and 50 reuses of
    // an id with other content, shuffled (seeded).
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let mut entries: Vec<(usize, String)> =
        (0..UNIQUE).map(|i| (i, payload(i, 100 + i as u64, i < POISON))).collect();
    let mut others: Vec<usize> = (POISON..UNIQUE).collect();
    others.shuffle(&mut rng);
    for &i in &others[..EXACT_DUPS] {
        entries.push((i, payload(i, 100 + i as u64, false)));
    }
    let conflicted: HashSet<usize> =
        others[EXACT_DUPS..EXACT_DUPS + CONFLICTS].iter().copied().collect();
    for &i in &conflicted {
        entries.push((i, payload(i, 999_999, false)));
    }
    entries.shuffle(&mut rng);
    assert_eq!(entries.len(), 10_000);
    for chunk in entries.chunks(500) {
        let mut pipe = redis::pipe();
        for (i, p) in chunk {
            pipe.xadd(&stream, "*", &[("message_id", format!("o-{i}")), ("payload", p.clone())]);
        }
        let _: Vec<String> = pipe.query_async(&mut conn).await.expect("xadd");
    }

    let engine = Consumer::builder(store.clone())
        .scope("billing")
        .lease(Duration::from_secs(5))
        .retain(Duration::from_secs(3600))
        .build()
        .expect("engine");
    let consumer = |name: &str| {
        let config = StreamConfig::new(client.clone(), &stream, "billing", name)
            .reclaim_idle(Duration::from_millis(500));
        StreamConsumer::builder(config)
            .engine(engine.clone())
            .batch(50)
            .idle_wait(Duration::from_millis(200))
            .build()
    };
    let ledger: Ledger = Arc::default();

    // The one that dies: two full rounds, then a batch processed but never acked, then a batch
    // read and never processed. Dropped with both pending.
    {
        let doomed = consumer("doomed").await.expect("consumer");
        let l = ledger.clone();
        let h = move |_ctx, e: StreamEntry| handler(l.clone(), e);
        for _ in 0..2 {
            doomed.poll(&h).await.expect("poll");
        }
        let batch = doomed.fetch().await.expect("fetch");
        assert!(!batch.is_empty());
        let n = batch.len();
        let decided = doomed.decide(batch, &h).await.expect("decide");
        assert_eq!(decided.items().len(), n);
        drop(decided); // processed, never acked
        let unprocessed = doomed.fetch().await.expect("fetch");
        assert!(!unprocessed.is_empty());
    }

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    for n in 0..3 {
        let c = consumer(&format!("survivor-{n}")).await.expect("consumer");
        let l = ledger.clone();
        let mut rx = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            let h = move |_ctx, e: StreamEntry| handler(l.clone(), e);
            c.run(h, async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
        }));
    }

    // Wait (bounded) until every entry was delivered and nothing is pending.
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let (pending, read) = group_state(&mut conn, &stream).await;
        if pending == 0 && read == 10_000 {
            break;
        }
        assert!(Instant::now() < deadline, "not drained: pending {pending}, entries-read {read}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop_tx.send(true).expect("stop");
    let mut total = Report::default();
    for t in tasks {
        total += t.await.expect("task").expect("run");
    }

    // Exactly once: every non-poison key's effect ran once, whatever was duplicated, reclaimed
    // or left unacked by the dropped consumer.
    {
        let ledger = ledger.lock().expect("ledger");
        for i in POISON..UNIQUE {
            assert_eq!(ledger.get(&format!("o-{i}")).copied(), Some(1), "o-{i}");
        }
        for i in 0..POISON {
            assert_eq!(ledger.get(&format!("o-{i}")), None, "poison o-{i} had an effect");
        }
        assert_eq!(ledger.len(), UNIQUE - POISON);
    }

    // Every conflict and poison entry was dead-lettered once, with its reason.
    let dead: redis::streams::StreamRangeReply =
        conn.xrange_all(format!("{stream}:dead-letter")).await.expect("xrange");
    let mut reasons: HashMap<&str, usize> = HashMap::new();
    let mut sources = HashSet::new();
    for e in &dead.ids {
        let reason: String = e.get("idem-reason").expect("reason");
        let source: String = e.get("idem-source-position").expect("source entry id");
        let outcome: String = e.get("idem-outcome").expect("outcome");
        assert!(outcome == "conflict" || outcome == "failed_permanent", "{outcome}");
        assert!(sources.insert(source), "an entry was dead-lettered twice");
        let kind = if reason.starts_with("conflict:") {
            "conflict"
        } else if reason.contains("poison order") {
            "poison"
        } else {
            panic!("unexpected dead-letter reason {reason}")
        };
        *reasons.entry(kind).or_default() += 1;
    }
    assert_eq!(reasons.get("conflict"), Some(&CONFLICTS));
    assert_eq!(reasons.get("poison"), Some(&POISON));
    assert!(total.acked > 0 && total.dead_lettered > 0, "{total:?}");
    let (pending, read) = group_state(&mut conn, &stream).await;
    assert_eq!((pending, read), (0, 10_000));
    let _ = rng.random::<u8>();
}

#[tokio::test]
async fn missing_settings_are_refused() {
    let Some(url) = common::url() else { return };
    let store = RedisStore::connect(&url).await.expect("connect");
    let client = redis::Client::open(url.as_str()).expect("client");
    let err = StreamConsumer::builder(StreamConfig::new(client, "", "g", "c"))
        .store(store)
        .scope("s")
        .build()
        .await
        .unwrap_err();
    let idem_core::driver::Error::Open(err) = err else { panic!("{err}") };
    assert!(err.to_string().contains("`stream` is empty"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_that_never_settles_is_dead_lettered_after_max_deliveries() {
    let Some(url) = common::url() else { return };
    let stream = common::fresh_name("stream-max");
    let (store, _offset, mut cleanup) = common::store(&url, "streams-max").await;
    cleanup.patterns.push(format!("{stream}*"));
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("conn");
    let _: String =
        conn.xadd(&stream, "*", &[("message_id", "m-1"), ("payload", "{}")]).await.expect("xadd");
    let config = StreamConfig::new(client.clone(), &stream, "g", "c")
        .reclaim_idle(Duration::from_millis(100))
        .max_deliveries(2);
    let c = StreamConsumer::builder(config)
        .store(store)
        .scope("s")
        .idle_wait(Duration::from_millis(50))
        .build()
        .await
        .expect("consumer");
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = runs.clone();
        let settled = c
            .poll(move |_ctx, _e| {
                let r = r.clone();
                async move {
                    r.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Err::<(), _>(HandlerError::Transient("downstream is down".to_owned()))
                }
            })
            .await
            .expect("poll");
        assert_eq!(settled.acked, 0, "a transient failure must never be acked");
        let (pending, read) = group_state(&mut conn, &stream).await;
        if pending == 0 && read == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "never dead-lettered");
    }
    // The first delivery and the redelivery ran the handler; the retry the second one asked
    // for would have been the third delivery, so it was dead-lettered instead.
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    let dead: redis::streams::StreamRangeReply =
        conn.xrange_all(format!("{stream}:dead-letter")).await.expect("xrange");
    assert_eq!(dead.ids.len(), 1);
    let reason: String = dead.ids[0].get("idem-reason").expect("reason");
    assert!(reason.starts_with("gave up after 2 deliveries (max_deliveries)"), "{reason}");
    let id: String = dead.ids[0].get("message_id").expect("original fields kept");
    assert_eq!(id, "m-1");
}
