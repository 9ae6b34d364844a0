//! The Redis Streams source on the real server: 4 competing consumers over 10,000 entries with
//! 20% duplicates, one consumer dropped mid-run without acking; every verb; the delivery limit;
//! a dead-letter outage; the settings' checks.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::group_state;
use idem_core::MemoryStore;
use idem_core::consumer::{Report, headers};
use idem_core::engine::{HandlerError, Verb};
use idem_core::extract::Envelope;
use idem_redis::{Delivery, Error, GROUP_FIELD, StreamConfig, StreamConsumer};
use rand::SeedableRng;
use rand::seq::SliceRandom;
use redis::AsyncCommands;
use redis::streams::StreamRangeReply;

const UNIQUE: usize = 8_000;
const EXACT_DUPS: usize = 1_950;
const CONFLICTS: usize = 50;
const POISON: usize = 20;

/// Every handler run that had an effect, per key. Deliberately does not deduplicate.
type Ledger = Arc<Mutex<HashMap<String, u32>>>;
/// Every settlement of a run, one line each.
type Story = Arc<Mutex<Vec<String>>>;

fn payload(id: usize, cents: u64, poison: bool) -> String {
    format!(r#"{{"order":"o-{id}","cents":{cents},"poison":{poison}}}"#)
}

/// Swaps the first entry that is `wanted` into position `at`.
fn place(entries: &mut [(usize, String)], at: usize, wanted: impl Fn(&(usize, String)) -> bool) {
    let from = entries.iter().position(wanted).expect("the entry to place");
    entries.swap(from, at);
}

async fn handler(ledger: Ledger, entry: Delivery) -> Result<u64, HandlerError<String>> {
    let v: serde_json::Value = serde_json::from_slice(entry.payload())
        .map_err(|e| HandlerError::Permanent(e.to_string()))?;
    if v["poison"].as_bool() == Some(true) {
        return Err(HandlerError::Permanent("poison order".into()));
    }
    let id = entry.message_id().unwrap_or_default().to_owned();
    *ledger.lock().expect("ledger").entry(id).or_default() += 1;
    Ok(v["cents"].as_u64().unwrap_or(0))
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
    // In a fixed order: the workload is the same in every run (a HashSet's order is not).
    let conflicted = &others[EXACT_DUPS..EXACT_DUPS + CONFLICTS];
    for &i in conflicted {
        entries.push((i, payload(i, 999_999, false)));
    }
    entries.shuffle(&mut rng);
    assert_eq!(entries.len(), 10_000);
    // The batch the doomed consumer decides and never acks (entries 100-149) holds a poison
    // order and a reused id whose first use it ran before (at 10): both are dead-lettered
    // there, in the window between the copy and the ack that a crash leaves open.
    let reused = conflicted[0];
    place(&mut entries, 10, |(i, p)| *i == reused && !p.contains("999999"));
    place(&mut entries, 130, |(i, p)| *i == reused && p.contains("999999"));
    place(&mut entries, 120, |(i, _)| *i == 0);
    for chunk in entries.chunks(500) {
        let mut pipe = redis::pipe();
        for (i, p) in chunk {
            pipe.xadd(&stream, "*", &[("message_id", format!("o-{i}")), ("payload", p.clone())]);
        }
        let _: Vec<String> = pipe.query_async(&mut conn).await.expect("xadd");
    }

    // Every settlement, in order: (ms since the start, consumer, entry id, delivery count,
    // outcome, verb), so a failure below shows each entry's story.
    let started = Instant::now();
    let story: Story = Arc::default();
    let consumer = |name: &str| {
        let (story, name_) = (story.clone(), name.to_owned());
        // Longer than a batch takes even on a loaded machine (the keep-alive resets a held
        // entry's idle time every quarter of it): a batch taken over while in flight would
        // dead-letter its conflicts a second time, which the check below refuses. (The two
        // failures seen at 5 s were the doomed consumer's copies made before its crash, not
        // a takeover; docs/TESTING.md, flake 8.)
        let config = StreamConfig::new(client.clone(), &stream, "billing", name)
            .reclaim_idle(Duration::from_secs(5));
        StreamConsumer::builder(config)
            .store(store.clone())
            .scope("billing")
            .lease(Duration::from_secs(5))
            .retain(Duration::from_secs(3600))
            .batch(50)
            .idle_wait(Duration::from_millis(200))
            .on_settle(move |st| {
                story.lock().expect("story").push(format!(
                    "{:>6} ms {name_}: entry {} delivery {}: {} -> {:?}",
                    started.elapsed().as_millis(),
                    st.message.id(),
                    st.message.delivered(),
                    st.outcome,
                    st.verb
                ));
            })
            .build()
    };
    let ledger: Ledger = Arc::default();

    // The one that dies: two full rounds, then a batch processed but never acked, then a batch
    // read and never processed. Dropped with both pending.
    let mut doomed_dead = HashSet::new();
    {
        let doomed = consumer("doomed").await.expect("consumer");
        let l = ledger.clone();
        let h = move |_ctx, e: Delivery| handler(l.clone(), e);
        for _ in 0..2 {
            doomed.poll(&h).await.expect("poll");
        }
        let batch = doomed.fetch().await.expect("fetch");
        assert!(!batch.is_empty());
        let n = batch.len();
        let decided = doomed.decide(batch, &h).await.expect("decide");
        assert_eq!(decided.items().len(), n);
        doomed_dead.extend(
            decided
                .items()
                .iter()
                .filter(|(_, v)| matches!(v, Verb::DeadLetter { .. }))
                .map(|(e, _)| e.id().to_owned()),
        );
        assert_eq!(doomed_dead.len(), 2, "the poison order and the reused id: {doomed_dead:?}");
        drop(decided); // processed, dead letters copied, never acked
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
            let h = move |_ctx, e: Delivery| handler(l.clone(), e);
            c.run(h, async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
        }));
    }

    // Wait (bounded) until every entry was delivered and nothing is pending.
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let state = group_state(&mut conn, &stream, "billing").await;
        if state == Some((0, 10_000)) {
            break;
        }
        assert!(Instant::now() < deadline, "not drained: (pending, entries-read) {state:?}");
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

    // Every conflict and poison entry was dead-lettered, with its reason: once, or - the
    // entries the doomed consumer copied and never acked - once more when redelivered (dead
    // letters are at least once; the copy comes before the ack).
    let dead: redis::streams::StreamRangeReply =
        conn.xrange_all(format!("{stream}:dead-letter")).await.expect("xrange");
    let mut reasons: HashMap<&str, usize> = HashMap::new();
    let mut copies: HashMap<String, Vec<(u64, String)>> = HashMap::new();
    for e in &dead.ids {
        let reason: String = e.get("idem-reason").expect("reason");
        let source: String = e.get("idem-source-position").expect("source entry id");
        let outcome: String = e.get("idem-outcome").expect("outcome");
        assert!(outcome == "conflict" || outcome == "failed_permanent", "{outcome}");
        assert_eq!(e.get::<String>(headers::SOURCE).as_deref(), Some(stream.as_str()));
        assert_eq!(e.get::<String>(headers::SCOPE).as_deref(), Some("billing"));
        assert_eq!(e.get::<String>(GROUP_FIELD).as_deref(), Some("billing"));
        let delivered: u64 = e.get(headers::DELIVERED).expect("delivered");
        assert!(e.get::<String>("payload").is_some(), "the entry's own fields are kept");
        let seen = copies.entry(source.clone()).or_default();
        seen.push((delivered, e.id.clone()));
        // A second copy only of what the doomed consumer copied, from a later delivery.
        let allowed = match seen.as_slice() {
            [_] => true,
            [(1, _), (later, _)] => doomed_dead.contains(&source) && *later > 1,
            _ => false,
        };
        if !allowed {
            let story = story.lock().expect("story");
            let lines: Vec<&String> = story.iter().filter(|l| l.contains(&source)).collect();
            panic!(
                "entry {source} was dead-lettered again: copies (delivery, id) {seen:?}; \
                 its settlements: {lines:#?}; the survivors' report: {total:?}"
            );
        }
        if seen.len() > 1 {
            continue;
        }
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
    for source in &doomed_dead {
        assert!(copies.contains_key(source), "the doomed consumer's copy of {source} is missing");
    }
    assert!(total.acked > 0 && total.dead_lettered > 0, "{total:?}");
    assert_eq!(group_state(&mut conn, &stream, "billing").await, Some((0, 10_000)));
}

/// Builds a consumer over `config` (two-phase over a memory store, retention `retain`) and
/// returns what opening the source said.
async fn open(config: StreamConfig, retain: Duration) -> Result<(), Error> {
    let built = StreamConsumer::builder(config)
        .store(MemoryStore::new())
        .scope("s")
        .retain(retain)
        .build()
        .await;
    match built {
        Ok(_) => Ok(()),
        Err(idem_core::consumer::BuildError::Open(e)) => Err(e),
        Err(e) => panic!("not an error of the source: {e}"),
    }
}

#[tokio::test]
async fn settings_are_checked_and_errors_name_the_field() {
    // No server needed: every check runs before connecting.
    let client = redis::Client::open("redis://127.0.0.1:1/").expect("client");
    let cfg = |stream: &str, group: &str, consumer: &str| {
        StreamConfig::new(client.clone(), stream, group, consumer)
    };
    let day = Duration::from_secs(86_400);
    let cases = [
        (cfg("", "g", "c"), "`stream` is empty"),
        (cfg("s", "", "c"), "`group` is empty"),
        (cfg("s", "g", ""), "`consumer` is empty"),
        (cfg("s", "g", "c").dead_letter_stream(""), "`dead_letter_stream` is empty"),
        (cfg("s", "g", "c").reclaim_idle(Duration::ZERO), "`reclaim_idle` must be at least 1 ms"),
        (cfg("s", "g", "c").max_deliveries(0), "`max_deliveries` must be at least 1"),
        (cfg("s", "g", "c").payload_field(""), "`payload_field` is empty"),
        (cfg("s", "g", "c").id_field(""), "`id_field` is empty"),
    ];
    for (config, expected) in cases {
        let err = open(config, day).await.expect_err(expected);
        assert!(matches!(err, Error::Config { .. }), "{err:?}");
        assert!(err.to_string().contains(expected), "{err} (wanted {expected})");
    }
    let err = open(cfg("s", "g", "c").dead_letter_stream("s"), day).await.expect_err("a loop");
    assert!(matches!(err, Error::DeadLetterLoop { .. }), "{err:?}");
    // 10 deliveries, each up to 3 h + 45 min apart, cannot be covered by one day of records.
    let long = cfg("s", "g", "c").reclaim_idle(Duration::from_secs(3 * 3600)).max_deliveries(10);
    let err = open(long, day).await.expect_err("retention");
    assert!(matches!(err, Error::Retention(_)), "{err:?}");
    assert!(err.to_string().contains("10 deliveries × 3h 45m"), "{err}");
    // The same limit with a retention that covers it goes on to connect (and finds no server).
    let covered = cfg("s", "g", "c").reclaim_idle(Duration::from_secs(60)).max_deliveries(10);
    let err = open(covered, day).await.expect_err("no server on port 1");
    assert!(matches!(err, Error::Redis { op: "connect", .. }), "{err:?}");
}

#[tokio::test]
async fn a_missing_group_is_refused_unless_created() {
    let Some(url) = common::url() else { return };
    let stream = common::fresh_name("stream-group");
    let _cleanup = common::Cleanup { url: url.clone(), patterns: vec![format!("{stream}*")] };
    let client = redis::Client::open(url.as_str()).expect("client");
    let day = Duration::from_secs(86_400);
    let no_create = || StreamConfig::new(client.clone(), &stream, "g", "c").create_group(false);
    let err = open(no_create(), day).await.expect_err("no stream, no group");
    assert!(err.to_string().contains("`group` does not exist"), "{err}");
    open(StreamConfig::new(client.clone(), &stream, "g", "c"), day).await.expect("created");
    open(no_create(), day).await.expect("now it exists");
    let mut conn = client.get_multiplexed_async_connection().await.expect("conn");
    assert_eq!(group_state(&mut conn, &stream, "g").await, Some((0, 0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_gets_its_verb() {
    let Some(url) = common::url() else { return };
    let stream = common::fresh_name("stream-verbs");
    let (store, _offset, mut cleanup) = common::store(&url, "streams-verbs").await;
    cleanup.patterns.push(format!("{stream}*"));
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("conn");
    let mut ids = HashMap::new();
    for (id, payload) in [
        ("o-1", r#"{"n":1}"#),
        ("o-1", r#"{"n":1}"#),       // the producer retried: a duplicate
        ("o-1", r#"{"n":"other"}"#), // the id reused with other content: a conflict
        ("o-2", r#"{"poison":true}"#),
        ("o-3", r#"{"flaky":true}"#),
    ] {
        let entry: String = conn
            .xadd(&stream, "*", &[("message_id", id), ("payload", payload)])
            .await
            .expect("xadd");
        ids.entry(id).or_insert(entry);
    }
    let config = StreamConfig::new(client.clone(), &stream, "g", "c")
        .reclaim_idle(Duration::from_millis(200));
    let c = StreamConsumer::builder(config)
        .store(store)
        .scope("verbs")
        .idle_wait(Duration::from_millis(50))
        .build()
        .await
        .expect("consumer");
    // o-3 fails transiently at its first delivery; the handler records what it saw.
    let seen: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let handler = |_ctx, e: Delivery| {
        let seen = Arc::clone(&seen);
        async move {
            seen.lock().expect("seen").push((e.id().to_owned(), e.delivered()));
            if e.payload().starts_with(br#"{"poison""#) {
                return Err(HandlerError::Permanent("poison order".to_owned()));
            }
            if e.payload().starts_with(br#"{"flaky""#) && e.delivered() == 1 {
                return Err(HandlerError::Transient("downstream is down".to_owned()));
            }
            Ok(())
        }
    };
    let first = c.poll(&handler).await.expect("poll");
    assert_eq!(first.fetched, 5, "{first}");
    assert_eq!((first.processed, first.duplicates, first.conflicts), (1, 1, 1), "{first}");
    assert_eq!((first.failed_permanent, first.failed_transient), (1, 1), "{first}");
    assert_eq!((first.acked, first.dead_lettered, first.retried), (2, 2, 1), "{first}");
    // Only the retry is left pending; the dead letters are confirmed copies.
    let pending: redis::streams::StreamPendingCountReply =
        conn.xpending_count(&stream, "g", "-", "+", 10).await.expect("xpending");
    let pending: Vec<&str> = pending.ids.iter().map(|p| p.id.as_str()).collect();
    assert_eq!(pending, [ids["o-3"].as_str()]);
    let dead: StreamRangeReply =
        conn.xrange_all(format!("{stream}:dead-letter")).await.expect("xrange");
    assert_eq!(dead.ids.len(), 2);
    for (e, outcome) in dead.ids.iter().zip(["conflict", "failed_permanent"]) {
        let field = |k: &str| e.get::<String>(k).unwrap_or_else(|| panic!("no {k}"));
        assert_eq!(field(headers::OUTCOME), outcome);
        assert_eq!(field(headers::SCOPE), "verbs");
        assert_eq!(field(headers::SOURCE), stream);
        assert_eq!(field(headers::DELIVERED), "1");
        assert_eq!(field(GROUP_FIELD), "g");
        assert!(!field(headers::REASON).is_empty());
    }
    assert_eq!(dead.ids[0].get::<String>("message_id").as_deref(), Some("o-1"));
    assert_eq!(dead.ids[1].get::<String>(headers::POSITION).as_ref(), Some(&ids["o-2"]));

    // The retry comes back through XAUTOCLAIM once idle, as its second delivery.
    let deadline = Instant::now() + Duration::from_secs(10);
    let second = loop {
        let r = c.poll(&handler).await.expect("poll");
        if r.fetched > 0 {
            break r;
        }
        assert!(Instant::now() < deadline, "the retry never came back");
    };
    assert_eq!((second.fetched, second.processed, second.acked), (1, 1, 1), "{second}");
    assert_eq!(seen.lock().expect("seen").last(), Some(&(ids["o-3"].clone(), 2)));
    assert_eq!(group_state(&mut conn, &stream, "g").await, Some((0, 5)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_outage_leaves_the_entry_pending_until_it_can_be_copied() {
    let Some(url) = common::url() else { return };
    let stream = common::fresh_name("stream-outage");
    let (store, _offset, mut cleanup) = common::store(&url, "streams-outage").await;
    cleanup.patterns.push(format!("{stream}*"));
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("conn");
    let dlq = format!("{stream}:dlq");
    // The dead-letter key holds a string: every XADD to it fails with WRONGTYPE.
    let () = conn.set(&dlq, "not a stream").await.expect("set");
    let _: String = conn
        .xadd(&stream, "*", &[("message_id", "o-1"), ("payload", "poison")])
        .await
        .expect("xadd");
    let config = StreamConfig::new(client.clone(), &stream, "g", "c")
        .dead_letter_stream(&dlq)
        .reclaim_idle(Duration::from_millis(200));
    let c = StreamConsumer::builder(config)
        .store(store)
        .scope("outage")
        .idle_wait(Duration::from_millis(50))
        .build()
        .await
        .expect("consumer");
    let handler =
        |_ctx, _e: Delivery| async { Err::<(), _>(HandlerError::Permanent("poison".to_owned())) };
    let r = c.poll(handler).await.expect("poll");
    assert_eq!((r.failed_permanent, r.dead_letter_failures), (1, 1), "{r}");
    // Never removed without its copy: retried instead of acknowledged.
    assert_eq!((r.acked, r.dead_lettered, r.retried), (0, 0, 1), "{r}");
    assert_eq!(group_state(&mut conn, &stream, "g").await, Some((1, 1)));

    // The dead-letter stream can be written again: the entry comes back and is copied.
    let _: i64 = conn.del(&dlq).await.expect("del");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = c.poll(handler).await.expect("poll");
        if r.dead_lettered == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "never dead-lettered: {r}");
    }
    assert_eq!(group_state(&mut conn, &stream, "g").await, Some((0, 1)));
    let dead: StreamRangeReply = conn.xrange_all(&dlq).await.expect("xrange");
    assert_eq!(dead.ids.len(), 1);
    assert_eq!(dead.ids[0].get::<String>(headers::DELIVERED).as_deref(), Some("2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_put_back_is_dead_lettered_with_one_set_of_headers() {
    let Some(url) = common::url() else { return };
    let stream = common::fresh_name("stream-putback");
    let (store, _offset, mut cleanup) = common::store(&url, "streams-putback").await;
    cleanup.patterns.push(format!("{stream}*"));
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("conn");
    // An operator put a dead letter back on the stream, its idem-* fields included.
    let _: String = conn
        .xadd(
            &stream,
            "*",
            &[
                ("message_id", "o-1"),
                ("payload", "poison"),
                (headers::REASON, "an earlier reason"),
                (headers::OUTCOME, "conflict"),
                (headers::POSITION, "1-1"),
                (GROUP_FIELD, "an earlier group"),
            ],
        )
        .await
        .expect("xadd");
    let c = StreamConsumer::builder(StreamConfig::new(client.clone(), &stream, "g", "c"))
        .store(store)
        .scope("putback")
        .idle_wait(Duration::from_millis(50))
        .build()
        .await
        .expect("consumer");
    let r = c
        .poll(|_ctx, _e| async { Err::<(), _>(HandlerError::Permanent("still poison".to_owned())) })
        .await
        .expect("poll");
    assert_eq!(r.dead_lettered, 1, "{r}");
    // Read the copy raw: a field written twice would show twice.
    let raw: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(format!("{stream}:dead-letter"))
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .expect("xrange");
    let fields = &raw[0].1;
    for name in [headers::REASON, headers::OUTCOME, headers::POSITION, GROUP_FIELD] {
        assert_eq!(fields.iter().filter(|(k, _)| k == name).count(), 1, "{name}: {fields:?}");
    }
    let get = |name: &str| fields.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str());
    assert!(get(headers::REASON).is_some_and(|r| r.contains("still poison")), "{fields:?}");
    assert_eq!(get(GROUP_FIELD), Some("g"));
    assert_eq!(get("message_id"), Some("o-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_group_ends_the_run_at_once() {
    let Some(url) = common::url() else { return };
    let stream = common::fresh_name("stream-nogroup");
    let _cleanup = common::Cleanup { url: url.clone(), patterns: vec![format!("{stream}*")] };
    let client = redis::Client::open(url.as_str()).expect("client");
    let c = StreamConsumer::builder(StreamConfig::new(client.clone(), &stream, "g", "c"))
        .store(MemoryStore::new())
        .scope("nogroup")
        .idle_wait(Duration::from_millis(50))
        .build()
        .await
        .expect("consumer");
    let mut conn = client.get_multiplexed_async_connection().await.expect("conn");
    let _: i64 = redis::cmd("XGROUP")
        .arg("DESTROY")
        .arg(&stream)
        .arg("g")
        .query_async(&mut conn)
        .await
        .expect("destroy");
    let run =
        c.run(|_ctx, _e| async { Ok::<(), HandlerError<String>>(()) }, std::future::pending());
    // The default policy would retry 10 times, 1 s apart: NOGROUP is fatal instead.
    let ended = tokio::time::timeout(Duration::from_secs(5), run).await.expect("run ended");
    match ended {
        Err(idem_core::consumer::Error::Fetch {
            attempts: 1,
            source: Error::Redis { source, .. },
        }) => {
            assert_eq!(source.code(), Some("NOGROUP"), "{source}");
        }
        other => panic!("expected a fatal fetch error, got {other:?}"),
    }
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
    let mut total = Report::default();
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
        total += settled;
        if group_state(&mut conn, &stream, "g").await == Some((0, 1)) {
            break;
        }
        assert!(Instant::now() < deadline, "never dead-lettered");
    }
    // The first delivery and the redelivery ran the handler; the retry the second one asked
    // for would have been the third delivery, so it was dead-lettered instead.
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!((total.retried, total.dead_lettered), (1, 1), "{total}");
    let dead: StreamRangeReply =
        conn.xrange_all(format!("{stream}:dead-letter")).await.expect("xrange");
    assert_eq!(dead.ids.len(), 1);
    let reason: String = dead.ids[0].get(headers::REASON).expect("reason");
    assert!(reason.starts_with("gave up after 2 deliveries (max_deliveries)"), "{reason}");
    assert!(reason.contains("downstream is down"), "{reason}");
    assert_eq!(dead.ids[0].get::<String>(headers::OUTCOME).as_deref(), Some("failed_transient"));
    assert_eq!(dead.ids[0].get::<String>(headers::DELIVERED).as_deref(), Some("2"));
    let id: String = dead.ids[0].get("message_id").expect("original fields kept");
    assert_eq!(id, "m-1");
}

/// A batch whose handler outlives the idle time is kept alive (`XCLAIM … JUSTID` every quarter
/// of it): another consumer of the group, polling all along, never takes it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_batch_is_kept_alive_and_not_taken_over() {
    let Some(url) = common::url() else { return };
    let stream = common::fresh_name("stream-alive");
    let (store, _offset, mut cleanup) = common::store(&url, "streams-alive").await;
    cleanup.patterns.push(format!("{stream}*"));
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("conn");
    let _: String =
        conn.xadd(&stream, "*", &[("message_id", "m-1"), ("payload", "{}")]).await.expect("xadd");
    let idle = Duration::from_millis(400);
    let member = |name: &str| {
        let config = StreamConfig::new(client.clone(), &stream, "g", name).reclaim_idle(idle);
        StreamConsumer::builder(config)
            .store(store.clone())
            .scope("s")
            .idle_wait(Duration::from_millis(50))
            .build()
    };
    let (slow, other) =
        (member("slow").await.expect("slow"), member("other").await.expect("other"));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let finished = done.clone();
    // The slow member reads the entry first; the other polls while its handler runs.
    let batch = slow.fetch().await.expect("slow fetch");
    assert_eq!(batch.len(), 1);
    let holder = async move {
        // The slow handler is the scenario: four idle times inside one handler.
        let decided = slow
            .decide(batch, |_ctx, _e| async move {
                tokio::time::sleep(4 * idle).await;
                Ok::<_, HandlerError<String>>(())
            })
            .await
            .expect("slow decide");
        let r = slow.settle(decided).await.expect("slow settle");
        finished.store(true, std::sync::atomic::Ordering::SeqCst);
        r
    };
    let watcher = async {
        let mut seen = Report::default();
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            seen += other
                .poll(|_ctx, _e| async { Ok::<_, HandlerError<String>>(()) })
                .await
                .expect("other poll");
        }
        seen
    };
    let (held, seen) = tokio::join!(holder, watcher);
    assert_eq!((held.processed, held.acked), (1, 1), "{held}");
    assert_eq!(seen.fetched, 0, "the other consumer took the entry over: {seen}");
    assert_eq!(group_state(&mut conn, &stream, "g").await, Some((0, 1)));
}
