//! The broker-source conformance suite on a real Kafka-protocol broker (tansu): every mode
//! through the same builder calls (two-phase over a store; SQLite, PostgreSQL and MariaDB
//! inboxes), each on a topic of 2 partitions and a consumer group of its own. Also the crash
//! suite (abort between commit and offset commit, SIGKILL and a dropped connection
//! mid-handler, each followed by a rebalance) in both modes, the store on SQLite and on
//! PostgreSQL.

use crate::common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use common::Topics;
use idem_dlq::{DeadLetterQueue, OnConflict, Workbench};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::FutureProducer;
use idem_kafka::rdkafka::producer::FutureRecord;
use idem_kafka::{KafkaConfig, KafkaDeadLetters, KafkaSource};
use idem_testkit::crash::CrashHarness;
use idem_testkit::source::{BoxFuture, DeadCopy, SourceHarness};

const PARTITIONS: i32 = 2;

struct Harness {
    brokers: String,
    topic: String,
    dlq: String,
    group: String,
    producer: FutureProducer,
    /// Each partition's end offset as the broker acknowledged the records published so far.
    ends: Mutex<HashMap<i32, i64>>,
    /// Deletes the topics when dropped (the parent's only).
    _topics: Option<Topics>,
}

impl SourceHarness for Harness {
    type Source = KafkaSource;
    type Config<'a> = KafkaConfig;

    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let rec = [(id.to_owned(), body.to_vec())];
            let ends = common::produce(&self.producer, &self.topic, &rec, None).await;
            let mut all = self.ends.lock().expect("ends");
            for (p, o) in ends {
                let e = all.entry(p).or_insert(0);
                *e = (*e).max(o);
            }
        })
    }

    fn config(&self) -> KafkaConfig {
        KafkaConfig::new(
            &common::config(&self.brokers, &self.group),
            &[self.topic.as_str()],
            &self.dlq,
        )
        .retry_delay(Duration::from_millis(100))
    }

    /// The group's commits reached every partition's end: the end the broker acknowledged for
    /// the records published here, and the high watermark (records a dead-letter replay
    /// produced). At least, not equal: tansu 0.6 answers a high watermark one short of the end
    /// after a batch of two records.
    fn settled(&self) -> BoxFuture<'_, bool> {
        Box::pin(async {
            let mut ends = self.ends.lock().expect("ends").clone();
            for (p, high) in high_watermarks(&self.brokers, &self.topic, PARTITIONS).await {
                if high > 0 {
                    let e = ends.entry(p).or_insert(0);
                    *e = (*e).max(high);
                }
            }
            let got = common::committed(&self.brokers, &self.group, &self.topic, PARTITIONS).await;
            ends.iter().all(|(p, o)| got.get(p).is_some_and(|c| c >= o))
        })
    }

    /// Per partition: the group's committed offset, the end this harness published to, and
    /// the broker's high watermark.
    fn describe(&self) -> BoxFuture<'_, String> {
        Box::pin(async {
            let ends = self.ends.lock().expect("ends").clone();
            let high = high_watermarks(&self.brokers, &self.topic, PARTITIONS).await;
            let got = common::committed(&self.brokers, &self.group, &self.topic, PARTITIONS).await;
            (0..PARTITIONS)
                .map(|p| {
                    format!(
                        "partition {p}: committed {:?}, published to {:?}, high watermark {:?}",
                        got.get(&p),
                        ends.get(&p),
                        high.get(&p)
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        })
    }

    fn dead_letters(&self) -> BoxFuture<'_, Vec<DeadCopy>> {
        Box::pin(async {
            common::read_all(&self.brokers, &self.dlq, 1)
                .await
                .into_iter()
                .map(|(_, headers)| DeadCopy {
                    message_id: headers.get("message-id").cloned(),
                    headers,
                })
                .collect()
        })
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(async move { drop(self) })
    }
}

impl CrashHarness for Harness {
    fn spec(&self) -> String {
        format!("{} {} {}", self.topic, self.dlq, self.group)
    }

    fn attach(spec: &str) -> BoxFuture<'static, Self> {
        let names: Vec<String> = spec.split(' ').map(str::to_owned).collect();
        Box::pin(async move {
            let [topic, dlq, group] = <[String; 3]>::try_from(names).expect("topic dlq group");
            let brokers = common::brokers().expect("the Kafka broker");
            let producer = common::producer(&brokers);
            Harness { brokers, topic, dlq, group, producer, ends: Mutex::default(), _topics: None }
        })
    }
}

async fn harness(name: &str) -> Option<Harness> {
    let brokers = common::brokers()?;
    let sfx = common::suffix();
    let name = name.replace('_', "-");
    let (topic, dlq, group) =
        (format!("idem-{name}-{sfx}"), format!("idem-{name}-{sfx}-dlq"), format!("g-{sfx}"));
    let topics = Topics::create(&brokers, &[(&topic, PARTITIONS), (&dlq, 1)]).await;
    let producer = common::producer(&brokers);
    Some(Harness {
        brokers,
        topic,
        dlq,
        group,
        producer,
        ends: Mutex::new(HashMap::new()),
        _topics: Some(topics),
    })
}

idem_testkit::source_conformance!(harness);
idem_testkit::crash_conformance!(Harness, harness, postgres);

/// Each partition's high watermark, asked of the broker without a group.
async fn high_watermarks(brokers: &str, topic: &str, n: i32) -> HashMap<i32, i64> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let c: BaseConsumer =
            ClientConfig::new().set("bootstrap.servers", &brokers).create().expect("consumer");
        (0..n)
            .map(|p| {
                let (_, high) =
                    c.fetch_watermarks(&topic, p, Duration::from_secs(10)).expect("watermarks");
                (p, high)
            })
            .collect()
    })
    .await
    .expect("watermarks thread")
}

/// The dead-letter workbench through the real consumer: read back, replay by the rules (a
/// conflict refused, then accepted as new), replayed twice, purged (by marker records).
#[tokio::test]
async fn workbench() {
    let Some(h) = harness("workbench").await else { return };
    let queue = KafkaDeadLetters::new(&h.brokers, &h.dlq).expect("dead letters");
    idem_testkit::dlq::workbench(h, queue).await;
}

/// Kafka cannot delete a record: a removal appends a marker, and every later reader — a new
/// one included — skips the marker and the record it marks. A replay keeps the record key.
#[tokio::test]
async fn a_removed_dead_letter_stays_hidden_from_a_fresh_reader() {
    let Some(brokers) = common::brokers() else { return };
    let sfx = common::suffix();
    let (dlq, dest) = (format!("idem-removal-{sfx}-dlq"), format!("idem-removal-{sfx}"));
    let _topics = Topics::create(&brokers, &[(&dlq, 2), (&dest, 1)]).await;
    let producer = common::producer(&brokers);
    for (p, id) in [(0, "r-1"), (1, "r-2")] {
        let hs = [
            ("message-id", id),
            ("idem-outcome", "failed_permanent"),
            ("idem-reason", "declined"),
            ("idem-scope", "s"),
            ("idem-key", id),
            ("idem-source", dest.as_str()),
        ]
        .iter()
        .fold(OwnedHeaders::new(), |h, (k, v)| {
            h.insert(Header { key: k, value: Some(v.as_bytes()) })
        });
        let key = format!("customer-{id}");
        let rec = FutureRecord::to(&dlq).partition(p).key(&key).payload("{}").headers(hs);
        producer.send(rec, Duration::from_secs(30)).await.map_err(|(e, _)| e).expect("produce");
    }

    let first = KafkaDeadLetters::new(&brokers, &dlq).expect("dead letters");
    let letters = first.read(10).await.expect("read");
    assert_eq!(letters.len(), 2, "{letters:?}");
    let (gone, kept) = (letters[0].id.clone(), letters[1].id.clone());
    assert_eq!(first.remove(std::slice::from_ref(&gone)).await.expect("remove"), 1);
    assert_eq!(first.remove(std::slice::from_ref(&gone)).await.expect("remove again"), 0);
    let ids = |ls: &[idem_dlq::Letter]| ls.iter().map(|l| l.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&first.read(10).await.expect("read")), [kept.as_str()]);
    drop(first);

    let fresh = KafkaDeadLetters::new(&brokers, &dlq).expect("dead letters");
    let left = fresh.read(10).await.expect("read");
    assert_eq!(ids(&left), [kept.as_str()], "a fresh reader sees a removed letter");
    let marks = high_watermarks(&brokers, &dlq, 2).await.values().sum::<i64>();
    assert_eq!(marks, 3, "two letters and one marker");

    let report = Workbench::new(&fresh).replay(&left, OnConflict::Refuse).await.expect("replay");
    assert_eq!(report.replayed, [kept.as_str()], "{report:?}");
    assert!(fresh.read(10).await.expect("read").is_empty());
    let replayed =
        KafkaDeadLetters::new(&brokers, &dest).expect("reader").read(10).await.expect("read");
    assert_eq!(replayed.len(), 1, "{replayed:?}");
    let r = &replayed[0];
    assert_eq!(r.message_id, left[0].message_id);
    let key = format!("customer-{}", left[0].message_id.as_deref().unwrap_or_default());
    assert_eq!(r.header(KafkaDeadLetters::RECORD_KEY_HEADER), Some(key.as_str()), "{r:?}");
    assert_eq!(r.header("idem-replayed-from"), Some(kept.as_str()), "{r:?}");
    assert!(r.header("idem-outcome").is_none(), "{r:?}");
}

/// Dead letters produced in one batch (a consumer dead-letters a burst of conflicts at once)
/// are all read back, the last batch included. After a batch of several records tansu 0.6
/// answers `ListOffsets` with a high watermark of the batch's base offset plus one (2 here,
/// for 4 records), so a reader that stops at that watermark misses the rest: `idem chaos`
/// read its Kafka dead letters that way, saw 12 of 13 and waited for the 13th until its
/// timeout. The reader goes to each partition's end-of-file instead.
#[tokio::test]
async fn a_last_batch_of_several_dead_letters_is_read_to_its_end() {
    let Some(brokers) = common::brokers() else { return };
    let dlq = format!("idem-batched-{}-dlq", common::suffix());
    let _topics = Topics::create(&brokers, &[(&dlq, 1)]).await;
    // Records sent together under a linger go out as one batch.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("linger.ms", "100")
        .create()
        .expect("producer");
    for batch in [1, 3] {
        let sends = (0..batch).map(|i| {
            let payload = format!("{{\"n\":{i}}}");
            let producer = producer.clone();
            let dlq = dlq.clone();
            async move {
                let rec: FutureRecord<'_, [u8], [u8]> =
                    FutureRecord::to(&dlq).partition(0).payload(payload.as_bytes());
                producer.send(rec, Duration::from_secs(30)).await.map_err(|(e, _)| e)
            }
        });
        for r in futures_util::future::join_all(sends).await {
            r.expect("produce");
        }
    }
    let high = high_watermarks(&brokers, &dlq, 1).await.get(&0).copied();
    println!("4 records; the broker's high watermark: {high:?}");
    let letters = KafkaDeadLetters::new(&brokers, &dlq).expect("dead letters");
    let read = letters.read(100).await.expect("read");
    let mut offsets: Vec<&str> = read.iter().map(|l| l.id.as_str()).collect();
    offsets.sort_unstable();
    assert_eq!(offsets, ["0:0", "0:1", "0:2", "0:3"], "high watermark {high:?}");
}

/// A replay keeps the record's original time: the consumer's dead-letter copy carries the
/// timestamp of the record it copies, the dead letter reads it back, and the replay produces
/// the record with it (correlation ids and content encodings travel as headers on Kafka).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_keeps_the_record_timestamp() {
    use idem_core::engine::HandlerError;
    let Some(h) = harness("dlq-time").await else { return };
    let ms = 1_765_000_000_123_i64;
    let hs = OwnedHeaders::new()
        .insert(Header { key: "message-id", value: Some(b"t-1".as_slice()) })
        .insert(Header { key: "correlation-id", value: Some(b"c-42".as_slice()) });
    let rec = FutureRecord::to(&h.topic).key("t-1").payload(r#"{"n":1}"#).headers(hs).timestamp(ms);
    h.producer.send(rec, Duration::from_secs(30)).await.map_err(|(e, _)| e).expect("produce");
    let c = idem_kafka::KafkaConsumer::builder(h.config())
        .store(idem_core::MemoryStore::new())
        .scope("time")
        .build()
        .await
        .unwrap();
    let refuse = |_, _| async { Err::<(), _>(HandlerError::Permanent("refused".to_owned())) };
    // The first polls may come back empty while the group forms; each waits for messages.
    let mut dead = 0;
    for _ in 0..30 {
        dead += c.poll(refuse).await.unwrap().dead_lettered;
        if dead > 0 {
            break;
        }
    }
    assert_eq!(dead, 1);
    drop(c);

    let q = KafkaDeadLetters::new(&h.brokers, &h.dlq).expect("dead letters");
    let letters = q.read(10).await.expect("read");
    let sent = std::time::UNIX_EPOCH + Duration::from_millis(ms.unsigned_abs());
    assert_eq!(letters[0].timestamp, Some(sent), "{letters:?}");
    assert_eq!(letters[0].header("correlation-id"), Some("c-42"));
    let report = Workbench::new(&q).replay(&letters, OnConflict::Refuse).await.expect("replay");
    assert_eq!(report.replayed.len(), 1, "{report:?}");
    // The topic read as a dead-letter queue: its records' times and headers.
    let replayed = KafkaDeadLetters::new(&h.brokers, &h.topic).expect("reader");
    let records = replayed.read(10).await.expect("read");
    let again = records.iter().find(|r| r.header("idem-replayed-from").is_some()).expect("replay");
    assert_eq!(again.timestamp, Some(sent), "{again:?}");
    assert_eq!(again.header("correlation-id"), Some("c-42"));
    h.cleanup().await;
}
