//! Two-phase mode on a real Kafka-protocol broker (tansu), over SQLite and PostgreSQL stores:
//! the commit never passes a message still in flight, retries pause nothing but their own
//! partition's commit, conflicts are dead-lettered with their reason, and two consumers in a
//! group give exactly-once effects, also under the cooperative-sticky protocol.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::Topics;
use idem_core::consumer::Report;
use idem_core::engine::HandlerError;
use idem_core::engine::Verb;
use idem_core::extract::Envelope;
use idem_core::{Backend, ClaimRequest, DedupKey, DedupStore, FingerprintSpec};
use idem_kafka::{Delivery, KafkaConfig, KafkaConsumer};
use idem_sqlx::SqliteStore;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

const LIMIT: Duration = Duration::from_secs(60);

type Ledger = Arc<Mutex<Vec<String>>>;

fn run<S: DedupStore + Backend<Ctx = idem_core::engine::Context> + 'static>(
    c: KafkaConsumer<S>,
    ledger: Ledger,
) -> (oneshot::Sender<()>, JoinHandle<Report>) {
    run_paced(c, ledger, Duration::ZERO)
}

/// [`run`] with a handler that takes `pace` per message (work that takes time, so a consumer
/// is still busy when another joins its group).
fn run_paced<S: DedupStore + Backend<Ctx = idem_core::engine::Context> + 'static>(
    c: KafkaConsumer<S>,
    ledger: Ledger,
    pace: Duration,
) -> (oneshot::Sender<()>, JoinHandle<Report>) {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        c.run(
            |_ctx, d: Delivery| {
                let (ledger, key) = (ledger.clone(), d.message_id().unwrap_or_default().to_owned());
                async move {
                    if !pace.is_zero() {
                        tokio::time::sleep(pace).await;
                    }
                    ledger.lock().unwrap().push(key);
                    Ok::<_, HandlerError<String>>(())
                }
            },
            async move {
                let _ = stopped.await;
            },
        )
        .await
        .unwrap()
    });
    (stop, task)
}

fn msgs(ids: &[&str]) -> Vec<(String, Vec<u8>)> {
    ids.iter().map(|id| ((*id).to_owned(), format!(r#"{{"id":"{id}"}}"#).into_bytes())).collect()
}

type Seen = mpsc::UnboundedReceiver<(i64, &'static str, &'static str)>;

/// What the consumer does with a settled message, in words the tests compare.
fn verb(a: &Verb) -> &'static str {
    match a {
        Verb::Ack => "commit",
        Verb::DeadLetter { .. } => "dead-lettered",
        Verb::Retry { .. } => "retry",
        _ => "release",
    }
}

/// One consumer of `topic` (1 partition) whose hook reports every settled message.
async fn run_hooked<S: DedupStore + Backend<Ctx = idem_core::engine::Context>>(
    brokers: &str,
    group: &str,
    topic: &str,
    dlq: &str,
    (store, scope): (S, &str),
    kafka: impl FnOnce(KafkaConfig) -> KafkaConfig,
) -> (Ledger, Seen, oneshot::Sender<()>, JoinHandle<Report>) {
    let (seen_tx, seen_rx) = mpsc::unbounded_channel();
    let config = kafka(KafkaConfig::new(&common::config(brokers, group), &[topic], dlq));
    let c = KafkaConsumer::builder(config)
        .store(store)
        .scope(scope)
        .idle_wait(Duration::from_millis(500))
        .on_settle(move |s| {
            let _ = seen_tx.send((s.message.offset(), s.outcome.as_str(), verb(s.verb)));
        })
        .build()
        .await
        .unwrap();
    let ledger: Ledger = Arc::default();
    let (stop, task) = run(c, ledger.clone());
    (ledger, seen_rx, stop, task)
}

/// Waits until the message at `offset` has settled `n` more times, each (when given) with
/// `expect` as its outcome and verb.
async fn settles(seen: &mut Seen, offset: i64, n: usize, expect: Option<(&str, &str)>) {
    let mut got = 0;
    while got < n {
        let (off, outcome, verb) = tokio::time::timeout(LIMIT, seen.recv()).await.unwrap().unwrap();
        if off == offset {
            if let Some(e) = expect {
                assert_eq!((outcome, verb), e, "offset {offset}");
            }
            got += 1;
        }
    }
}

/// Waits until the group's committed offset of partition 0 is `offset`.
async fn committed_at(brokers: &str, group: &str, topic: &str, offset: i64) {
    common::eventually(LIMIT, &format!("offset {offset} committed"), || async {
        (common::committed(brokers, group, topic, 1).await.get(&0) == Some(&offset)).then_some(())
    })
    .await;
}

/// A key held by another consumer's live lease: its partition's commit stops right before it
/// while the messages after it are processed; once the lease is released the retry runs it and
/// the commit reaches the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_progress_elsewhere_holds_the_commit_back_until_its_retry_settles() {
    let Some(brokers) = common::brokers() else { return };
    let sfx = common::suffix();
    let (topic, dlq, group) =
        (format!("idem-hold-{sfx}"), format!("idem-hold-{sfx}-dlq"), format!("g-{sfx}"));
    let _topics = Topics::create(&brokers, &[(&topic, 1), (&dlq, 1)]).await;
    let ids = ["m-0", "m-1", "m-2", "m-3", "m-4", "m-5"];
    let ends = common::produce(&common::producer(&brokers), &topic, &msgs(&ids), Some(0)).await;
    assert_eq!(ends[&0], 6);

    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
    // Another consumer holds m-3 (same fingerprint: the same message, in progress elsewhere).
    let req = ClaimRequest::new(
        DedupKey::new("hold", "m-3").unwrap(),
        FingerprintSpec::default().fingerprint(&msgs(&["m-3"])[0].1).unwrap(),
        Duration::from_secs(600),
        Duration::from_secs(86_400),
    );
    let lease = match store.claim(&req).await.unwrap() {
        idem_core::Claim::Acquired(l) => l,
        other => panic!("{other:?}"),
    };

    let kafka = |k: KafkaConfig| {
        k.retry_delay(Duration::from_millis(200)).batch_wait(Duration::from_millis(200))
    };
    let (ledger, mut seen, stop, task) =
        run_hooked(&brokers, &group, &topic, &dlq, (store.clone(), "hold"), kafka).await;

    // m-3 is retried at least twice while m-0..m-2 are processed; the commit stops at offset 3.
    settles(&mut seen, 3, 2, Some(("in_progress_elsewhere", "retry"))).await;
    committed_at(&brokers, &group, &topic, 3).await;
    assert!(!ledger.lock().unwrap().contains(&"m-3".to_owned()));
    // Still held back after further retries of m-3.
    settles(&mut seen, 3, 2, None).await;
    assert_eq!(common::committed(&brokers, &group, &topic, 1).await.get(&0), Some(&3));

    store.release(lease).await.unwrap();
    committed_at(&brokers, &group, &topic, 6).await;
    let _ = stop.send(());
    let report = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    let mut got = ledger.lock().unwrap().clone();
    got.sort();
    assert_eq!(got, ids, "each effect exactly once");
    assert!(report.in_progress >= 4 && report.processed == 6, "{report:?}");
}

/// A topic of 3 partitions (and its dead-letter topic) holding 600 ids `o-0` … `o-599`, then
/// 150 producer duplicates (every fourth id again), then `extra`; and a group to consume it.
struct OrdersTopic {
    topic: String,
    dlq: String,
    group: String,
    /// Each partition's end offset after the produce.
    ends: HashMap<i32, i64>,
    _topics: Topics,
}

impl OrdersTopic {
    async fn create(brokers: &str, prefix: &str, extra: &[(String, Vec<u8>)]) -> Self {
        let sfx = common::suffix();
        let (topic, dlq, group) =
            (format!("{prefix}-{sfx}"), format!("{prefix}-{sfx}-dlq"), format!("g-{sfx}"));
        let topics = Topics::create(brokers, &[(&topic, 3), (&dlq, 1)]).await;
        let mut recs: Vec<(String, Vec<u8>)> =
            (0..600).map(|i| (format!("o-{i}"), format!(r#"{{"i":{i}}}"#).into_bytes())).collect();
        for i in 0..150 {
            recs.push(recs[i * 4].clone());
        }
        recs.extend_from_slice(extra);
        let ends = common::produce(&common::producer(brokers), &topic, &recs, None).await;
        Self { topic, dlq, group, ends, _topics: topics }
    }

    /// A consumer of the group over `store` (scope `orders`) in batches of `batch`, with
    /// `extra` client settings.
    async fn consumer(
        &self,
        brokers: &str,
        store: &SqliteStore,
        batch: usize,
        extra: &[(&str, &str)],
    ) -> KafkaConsumer<SqliteStore> {
        let mut cfg = common::config(brokers, &self.group);
        for (k, v) in extra {
            cfg.set(*k, *v);
        }
        KafkaConsumer::builder(KafkaConfig::new(&cfg, &[self.topic.as_str()], &self.dlq))
            .store(store.clone())
            .scope("orders")
            .batch(batch)
            .idle_wait(Duration::from_millis(500))
            .build()
            .await
            .unwrap()
    }

    /// Waits until the group's commits reach the end of every partition.
    async fn all_committed(&self, brokers: &str) {
        common::eventually(LIMIT, "all committed", || async {
            let got = common::committed(brokers, &self.group, &self.topic, 3).await;
            (got.len() == self.ends.len() && got.iter().all(|(p, o)| self.ends.get(p) == Some(o)))
                .then_some(())
        })
        .await;
    }
}

/// Stops every run and collects its report.
async fn stop_all(runs: Vec<(oneshot::Sender<()>, JoinHandle<Report>)>) -> Vec<Report> {
    let mut reports = Vec::new();
    for (stop, task) in runs {
        let _ = stop.send(());
        reports.push(tokio::time::timeout(LIMIT, task).await.unwrap().unwrap());
    }
    reports
}

/// Every one of `n` keys ran its effect exactly once.
fn each_once(ledger: &Ledger, n: usize) {
    let mut counts: HashMap<String, usize> = HashMap::new();
    for k in ledger.lock().unwrap().iter() {
        *counts.entry(k.clone()).or_default() += 1;
    }
    assert_eq!(counts.len(), n);
    assert!(counts.values().all(|&c| c == 1), "a key's effect ran twice");
}

/// Two consumers in a group over 3 partitions: 600 unique ids, 150 duplicates and one reused
/// id. Every effect once, the reused id dead-lettered with its reason, offsets at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_give_exactly_once_effects_and_dead_letter_the_reused_id() {
    let Some(brokers) = common::brokers() else { return };
    let reused = [("o-5".to_owned(), br#"{"i":"different"}"#.to_vec())];
    let t = OrdersTopic::create(&brokers, "idem-2p", &reused).await;
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
    let ledger: Ledger = Arc::default();
    let mut runs = Vec::new();
    for _ in 0..2 {
        runs.push(run(t.consumer(&brokers, &store, 100, &[]).await, ledger.clone()));
    }
    t.all_committed(&brokers).await;
    let reports = stop_all(runs).await;
    each_once(&ledger, 600);
    // Redelivery after the group's first rebalance (messages polled but not yet committed)
    // makes extra duplicates and extra dead letters possible; first effects stay exactly 600.
    let sum = |f: fn(&Report) -> u64| reports.iter().map(f).sum::<u64>();
    assert_eq!(sum(|r| r.processed), 600, "{reports:?}");
    assert!(sum(|r| r.duplicates) >= 150 && sum(|r| r.dead_lettered) >= 1, "{reports:?}");
    let n = usize::try_from(sum(|r| r.dead_lettered)).unwrap();
    let dead = common::read_all(&brokers, &t.dlq, n).await;
    assert_eq!(dead.len(), n, "{dead:?}");
    for (_, hs) in &dead {
        assert_eq!(hs["message-id"], "o-5");
        assert!(hs["idem-reason"].starts_with("conflict: key orders/o-5 reused"), "{hs:?}");
        assert_eq!(hs["idem-outcome"], "conflict");
    }
}

/// The dead-letter topic is unreachable (it does not exist yet, so every produce times out):
/// the reused id is retried, never committed past, and the messages before it still commit.
/// Once the topic exists the retry's produce is acknowledged and the commit reaches the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_dead_letter_produce_holds_the_commit_back_until_a_retry_is_acknowledged() {
    let Some(brokers) = common::brokers() else { return };
    let sfx = common::suffix();
    let (topic, dlq, group) =
        (format!("idem-dlqf-{sfx}"), format!("idem-dlqf-{sfx}-dlq"), format!("g-{sfx}"));
    let topics = Topics::create(&brokers, &[(&topic, 1)]).await;
    let mut recs = msgs(&["m-0", "m-1"]);
    recs.push(("m-1".to_owned(), br#"{"id":"m-1","changed":true}"#.to_vec()));
    recs.extend(msgs(&["m-3"]));
    let ends = common::produce(&common::producer(&brokers), &topic, &recs, Some(0)).await;
    assert_eq!(ends[&0], 4);

    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
    let kafka = |k: KafkaConfig| {
        k.produce_timeout(Duration::from_millis(500))
            .retry_delay(Duration::from_millis(200))
            .batch_wait(Duration::from_millis(200))
    };
    let (ledger, mut seen, stop, task) =
        run_hooked(&brokers, &group, &topic, &dlq, (store, "dlqf"), kafka).await;

    // The conflict at offset 2 fails to dead-letter, twice at least, and is kept for a retry.
    settles(&mut seen, 2, 2, Some(("conflict", "retry"))).await;
    committed_at(&brokers, &group, &topic, 2).await;
    settles(&mut seen, 2, 2, None).await;
    assert_eq!(
        common::committed(&brokers, &group, &topic, 1).await.get(&0),
        Some(&2),
        "the commit went past a conflict whose dead letter was never acknowledged"
    );

    let _dlq_topic = Topics::create(&brokers, &[(&dlq, 1)]).await;
    committed_at(&brokers, &group, &topic, 4).await;
    let _ = stop.send(());
    let report = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();
    assert!(report.dead_letter_failures >= 4 && report.dead_lettered >= 1, "{report:?}");
    let n = usize::try_from(report.dead_lettered).unwrap();
    let dead = common::read_all(&brokers, &dlq, n).await;
    assert_eq!(dead.len(), n, "{dead:?}");
    for (body, hs) in &dead {
        assert_eq!(body.as_slice(), br#"{"id":"m-1","changed":true}"#);
        assert_eq!(
            (hs["message-id"].as_str(), hs["idem-source-position"].as_str()),
            ("m-1", "0:2")
        );
        assert_eq!(hs["idem-source"], topic);
    }
    let mut got = ledger.lock().unwrap().clone();
    got.sort();
    assert_eq!(got, ["m-0", "m-1", "m-3"], "each effect exactly once");
    drop(topics);
}

/// Settings that contradict the adapter's offset handling are refused with the key named.
#[tokio::test]
async fn auto_commit_and_a_missing_group_are_refused_with_the_setting_named() {
    let refused = |kafka: KafkaConfig| async move {
        let e = KafkaConsumer::builder(kafka)
            .store(idem_core::MemoryStore::new())
            .scope("s")
            .build()
            .await
            .unwrap_err();
        match e {
            idem_core::consumer::BuildError::Open(e) => e.to_string(),
            other => panic!("expected the source to refuse: {other}"),
        }
    };
    let mut cfg = common::config("127.0.0.1:1", "g");
    cfg.set("enable.auto.commit", "true");
    let e = refused(KafkaConfig::new(&cfg, &["t"], "dlq")).await;
    assert!(e.contains("`enable.auto.commit` = `true` is not allowed"), "{e}");
    let mut cfg = idem_kafka::rdkafka::ClientConfig::new();
    cfg.set("bootstrap.servers", "127.0.0.1:1");
    let e = refused(KafkaConfig::new(&cfg, &["t"], "dlq")).await;
    assert!(e.contains("`group.id` is required"), "{e}");
    let cfg = common::config("127.0.0.1:1", "g");
    let e = refused(KafkaConfig::new(&cfg, &["t"], "t")).await;
    assert!(e.contains("the dead-letter topic `t` is consumed too"), "{e}");
}

/// The incremental (cooperative-sticky) protocol: a second consumer joins mid-run, so the first
/// loses only some of its partitions and goes on with the others. Every key's effect runs once,
/// both consumers take part, and the commits reach the end of every partition. (librdkafka
/// refuses an eager `assign` under this protocol; the adapter leaves the assignment to it. On
/// tansu 0.6 the first consumer's log shows `partitions revoked partitions=1` at the join.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cooperative_rebalance_mid_run_keeps_effects_exactly_once() {
    let Some(brokers) = common::brokers() else { return };
    let t = OrdersTopic::create(&brokers, "idem-coop", &[]).await;
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
    let ledger: Ledger = Arc::default();
    // Small batches and 10 ms of work per message (6 s for all 600 alone), so the first
    // consumer is still at work when the second joins: without the pacing, a fast run had
    // finished everything before the rebalance gave the second any partition.
    let coop = [("partition.assignment.strategy", "cooperative-sticky")];
    let pace = Duration::from_millis(10);
    let first = run_paced(t.consumer(&brokers, &store, 4, &coop).await, ledger.clone(), pace);
    common::eventually(LIMIT, "the first consumer under way", || async {
        (ledger.lock().unwrap().len() >= 20).then_some(())
    })
    .await;
    let second = run_paced(t.consumer(&brokers, &store, 4, &coop).await, ledger.clone(), pace);
    t.all_committed(&brokers).await;
    let reports = stop_all(vec![first, second]).await;
    each_once(&ledger, 600);
    assert_eq!(reports.iter().map(|r| r.processed).sum::<u64>(), 600, "{reports:?}");
    assert!(reports.iter().map(|r| r.duplicates).sum::<u64>() >= 150, "{reports:?}");
    assert!(reports.iter().all(|r| r.fetched > 0), "both consumers took part: {reports:?}");
}

/// `fetch` dropped at its await loses nothing: a due retry it took from the retry list comes
/// back from the next fetch, as would messages it had received. (Before the fix they were in
/// the dropped future's locals: gone, with their offsets left open.) The drop is made at the
/// first point where the fetch waits: one poll, with the retry due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_dropped_at_its_await_loses_nothing() {
    use futures_util::FutureExt;
    use idem_core::consumer::Source;
    let Some(brokers) = common::brokers() else { return };
    let topic = format!("idem-cancel-{}", common::suffix());
    let dlq = format!("{topic}-dlq");
    let _topics = Topics::create(&brokers, &[(&topic, 1), (&dlq, 1)]).await;
    let ids: Vec<String> = (0..40).map(|i| format!("c-{i}")).collect();
    let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    common::produce(&common::producer(&brokers), &topic, &msgs(&id_refs), Some(0)).await;
    let config = KafkaConfig::new(
        &common::config(&brokers, &format!("g-{}", common::suffix())),
        &[topic.as_str()],
        dlq,
    )
    .retry_delay(Duration::from_millis(20))
    .batch_wait(Duration::from_millis(200));
    let c = KafkaConsumer::builder(config)
        .store(idem_core::MemoryStore::new())
        .scope("cancel")
        .build()
        .await
        .unwrap();
    let src = c.source();

    let first = tokio::time::timeout(LIMIT, src.fetch(1, LIMIT)).await.unwrap().unwrap();
    let retried = first[0].offset();
    src.settle(first.into_iter().map(|d| (d, Verb::Retry { after: None })).collect())
        .await
        .unwrap();
    // Once the retry is due, poll a fetch once: it takes the retry into its batch and waits
    // (its partition is paused while the retry waits, so nothing else arrives), where it is
    // dropped.
    let mut dropped_pending = false;
    let deadline = tokio::time::Instant::now() + LIMIT;
    let mut got: Vec<i64> = Vec::new();
    while tokio::time::Instant::now() < deadline && got.len() < ids.len() {
        tokio::time::sleep(Duration::from_millis(50)).await;
        match src.fetch(100, Duration::from_millis(100)).now_or_never() {
            None => dropped_pending = true,
            Some(batch) => {
                let batch = batch.unwrap();
                got.extend(batch.iter().map(|d| d.offset()));
                src.settle(batch.into_iter().map(|d| (d, Verb::Ack)).collect()).await.unwrap();
            }
        }
        if dropped_pending {
            break;
        }
    }
    assert!(dropped_pending, "no fetch was caught waiting; the test proved nothing");
    while tokio::time::Instant::now() < deadline && got.len() < ids.len() {
        let batch = src.fetch(100, Duration::from_millis(500)).await.unwrap();
        got.extend(batch.iter().map(|d| d.offset()));
        // Settled, the retry lets its partition resume.
        src.settle(batch.into_iter().map(|d| (d, Verb::Ack)).collect()).await.unwrap();
    }
    got.sort_unstable();
    got.dedup();
    assert!(got.contains(&retried), "the retry taken by the dropped fetch came back");
    assert_eq!(got.len(), ids.len(), "every message came back once: {got:?}");
    c.close().await.unwrap();
}

/// A member whose partition another member consumed meanwhile (two owners at once: a broker
/// that does not fence stale members, as tansu after a restart) never moves the group's
/// offset back: its first commit after the assignment reads the group's offset and leaves the
/// partition out while the group is ahead; once it has caught up, it commits again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_behind_the_group_offset_never_commits_it_backwards() {
    use idem_core::consumer::Source;
    let Some(brokers) = common::brokers() else { return };
    let sfx = common::suffix();
    let (topic, dlq, group) =
        (format!("idem-behind-{sfx}"), format!("idem-behind-{sfx}-dlq"), format!("g-{sfx}"));
    let _topics = Topics::create(&brokers, &[(&topic, 1), (&dlq, 1)]).await;
    let ids: Vec<String> = (0..12).map(|i| format!("b-{i}")).collect();
    let id_refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    let ends = common::produce(&common::producer(&brokers), &topic, &msgs(&id_refs), Some(0)).await;
    assert_eq!(ends[&0], 12);
    let config = KafkaConfig::new(&common::config(&brokers, &group), &[topic.as_str()], dlq);
    let c = KafkaConsumer::builder(config)
        .store(idem_core::MemoryStore::new())
        .scope("behind")
        .build()
        .await
        .unwrap();
    let src = c.source();

    let first = tokio::time::timeout(LIMIT, src.fetch(4, LIMIT)).await.unwrap().unwrap();
    assert_eq!(first.first().map(Delivery::offset), Some(0));
    assert!(first.len() < 12, "one fetch took the whole partition; the test proves nothing");
    // Meanwhile another member consumed the whole partition and committed its end.
    common::commit_from_outside(&brokers, &group, &topic, 12).await;
    let n = first.len();
    src.settle(first.into_iter().map(|d| (d, Verb::Ack)).collect()).await.unwrap();
    assert_eq!(
        common::committed(&brokers, &group, &topic, 1).await.get(&0),
        Some(&12),
        "the commit of offset {n} would have handed {} messages back",
        12 - n
    );
    // Catching up to the group's offset, the member commits again (the same offset).
    let mut got = n;
    while got < 12 {
        let batch = tokio::time::timeout(LIMIT, src.fetch(4, LIMIT)).await.unwrap().unwrap();
        got += batch.len();
        src.settle(batch.into_iter().map(|d| (d, Verb::Ack)).collect()).await.unwrap();
        let committed = common::committed(&brokers, &group, &topic, 1).await;
        assert_eq!(committed.get(&0), Some(&12), "after {got} of 12 settled");
    }
    c.close().await.unwrap();
    assert_eq!(common::committed(&brokers, &group, &topic, 1).await.get(&0), Some(&12));
}
