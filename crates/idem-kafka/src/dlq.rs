//! Dead letters read back from their Kafka topic, replayed and removed (by a marker record):
//! the [`DeadLetterQueue`] of `idem dlq` and the console.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use idem_dlq::{DeadLetterQueue, DlqError, Letter, Republish};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Header, Headers as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message as _, Offset, TopicPartitionList};

use crate::Error;
use crate::delivery::MSG_ID_HEADER;

/// How long a read may take, and a produce may wait for the brokers.
const TIMEOUT: Duration = Duration::from_secs(30);

/// How long a produce may wait for room in librdkafka's local queue.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(5);

/// The dead letters a [`KafkaConsumer`](crate::KafkaConsumer) produced to a topic: a
/// [`DeadLetterQueue`].
///
/// - **Id**: `<partition>:<offset>` of the dead-letter record.
/// - **Read**: a consumer that never joins a group (`assign`, under a group id of its own that
///   librdkafka requires: no member, no offset committed, so the brokers keep nothing of it)
///   reads every partition from its start to its end-of-file, oldest first by record
///   timestamp. A read goes
///   through the whole topic, removal markers included, however few letters it returns.
/// - **Remove**: Kafka cannot delete one record, so a removed letter is *marked*: a record with
///   an empty payload and the header [`REMOVED_HEADER`](Self::REMOVED_HEADER) =
///   `<partition>:<offset>` is appended to the same partition, and reads skip markers and the
///   records they mark. The record itself stays until the topic's retention deletes it, and a
///   plain consumer of the topic still sees it (and the marker).
/// - **Record key**: a read puts the record's key in the header
///   [`RECORD_KEY_HEADER`](Self::RECORD_KEY_HEADER) (or, for a key that is not UTF-8, its hex in
///   [`RECORD_KEY_HEX_HEADER`](Self::RECORD_KEY_HEX_HEADER)); a replay sends it as the record
///   key again, so the replay goes to the partition of its key, behind the same key's records.
/// - **Republish**: a record of the destination topic with that key, the payload, the headers
///   (as text: a header value that is not UTF-8 was read lossily) and
///   [`message-id`](MSG_ID_HEADER) = the message id, confirmed by its delivery report
///   (`acks=all`). Kafka has no duplicate window: a replay is always stored, and the consumer
///   finds a second one a duplicate.
///
/// ```no_run
/// use idem_dlq::{OnConflict, Workbench};
/// use idem_kafka::KafkaDeadLetters;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let bench = Workbench::new(KafkaDeadLetters::new("127.0.0.1:9092", "dlq.orders")?);
/// let letters = bench.list(100).await?;
/// let report = bench.replay(&letters, OnConflict::Refuse).await?;
/// println!("{report}");
/// # Ok(()) }
/// ```
pub struct KafkaDeadLetters {
    /// The reader's settings: the connection's, without a group.
    reader: ClientConfig,
    producer: FutureProducer,
    topic: String,
}

impl std::fmt::Debug for KafkaDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaDeadLetters")
            .field("bootstrap.servers", &self.reader.get("bootstrap.servers"))
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl KafkaDeadLetters {
    /// The header of a removal marker: the `<partition>:<offset>` of the letter it removes.
    pub const REMOVED_HEADER: &'static str = "idem-dlq-removed";
    /// The header a read puts the record key in (a UTF-8 key).
    pub const RECORD_KEY_HEADER: &'static str = "idem-record-key";
    /// The header a read puts the record key in, as hex (a key that is not UTF-8).
    pub const RECORD_KEY_HEX_HEADER: &'static str = "idem-record-key-hex";

    /// The dead letters of `topic` on `bootstrap_servers` (`host:port,…`).
    ///
    /// # Errors
    /// [`Error::Kafka`] when librdkafka refuses the configuration.
    pub fn new(bootstrap_servers: &str, topic: impl Into<String>) -> Result<Self, Error> {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", bootstrap_servers);
        Self::with_config(&config, topic)
    }

    /// The dead letters of `topic`, reached with `config`'s connection settings (the brokers,
    /// security, SASL, SSL and socket settings; a consumer's settings such as `group.id` are
    /// left out), as [`KafkaConfig`](crate::KafkaConfig) reaches its dead-letter topic.
    ///
    /// # Errors
    /// [`Error::MissingSetting`] without `bootstrap.servers`; [`Error::Setting`] when TLS or
    /// SCRAM is asked of a build without the feature `tls`; [`Error::Kafka`] when librdkafka
    /// refuses the configuration.
    pub fn with_config(config: &ClientConfig, topic: impl Into<String>) -> Result<Self, Error> {
        if config.get("bootstrap.servers").is_none_or(str::is_empty) {
            return Err(Error::MissingSetting {
                key: "bootstrap.servers",
                why: "where the brokers are",
            });
        }
        crate::security::check(config)?;
        let conn = crate::config::connection_config(config);
        let mut pc = conn.clone();
        pc.set("acks", "all").set("message.timeout.ms", TIMEOUT.as_millis().to_string());
        let producer: FutureProducer =
            pc.create().map_err(|e| Error::kafka("create dead-letter producer", e))?;
        let mut reader = conn;
        reader
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("enable.partition.eof", "true");
        Ok(Self { reader, producer, topic: topic.into() })
    }

    /// The dead letters of consumers of `consumed` on `bootstrap_servers`, at the conventional
    /// dead-letter topic [`topic_for(consumed)`](Self::topic_for) (with other connection
    /// settings: `with_config(&config, KafkaDeadLetters::topic_for(consumed))`).
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn for_source(bootstrap_servers: &str, consumed: &str) -> Result<Self, Error> {
        Self::new(bootstrap_servers, Self::topic_for(consumed))
    }

    /// The conventional dead-letter topic of consumers of `consumed`: `dlq.<consumed>`, which
    /// a pattern subscription to `^<consumed>.*` does not take.
    /// [`KafkaConfig`](crate::KafkaConfig) has no default: this is the name its docs recommend.
    ///
    /// ```
    /// assert_eq!(idem_kafka::KafkaDeadLetters::topic_for("orders"), "dlq.orders");
    /// ```
    pub fn topic_for(consumed: &str) -> String {
        format!("dlq.{consumed}")
    }

    /// The dead-letter topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Every live letter of the topic, oldest first, read on a thread of its own (the client
    /// blocks).
    async fn scan(&self) -> Result<Vec<Record>, DlqError> {
        let (reader, topic) = (self.reader.clone(), self.topic.clone());
        crate::source::detached("read dead letters", move || scan(&reader, &topic))
            .await
            .map_err(|e| DlqError::broker(format!("reading {}", self.describe()), e))?
    }

    /// Appends a removal marker of `(partition, offset)`.
    async fn mark(&self, (partition, offset): (i32, i64)) -> Result<(), DlqError> {
        let id = format!("{partition}:{offset}");
        let hs = OwnedHeaders::new()
            .insert(Header { key: Self::REMOVED_HEADER, value: Some(id.as_bytes()) });
        let rec: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.topic).partition(partition).payload(&[][..]).headers(hs);
        match self.producer.send(rec, QUEUE_TIMEOUT).await {
            Ok(_) => Ok(()),
            Err((e, _)) => {
                Err(DlqError::broker(format!("marking {id} removed on {}", self.describe()), e))
            }
        }
    }

    async fn send(&self, r: &Republish) -> Result<(), DlqError> {
        let mut key = None;
        let mut hs = OwnedHeaders::new_with_capacity(r.headers.len() + 1);
        for (name, value) in &r.headers {
            if name.eq_ignore_ascii_case(Self::RECORD_KEY_HEADER) {
                key = Some(value.as_bytes().to_vec());
            } else if name.eq_ignore_ascii_case(Self::RECORD_KEY_HEX_HEADER) {
                key = Some(from_hex(value).ok_or_else(|| DlqError::NotPublished {
                    letter: r.letter.clone(),
                    why: format!("its {} header is not hex", Self::RECORD_KEY_HEX_HEADER),
                })?);
            } else if !name.eq_ignore_ascii_case(MSG_ID_HEADER)
                && !name.eq_ignore_ascii_case(Self::REMOVED_HEADER)
            {
                hs = hs.insert(Header { key: name, value: Some(value.as_bytes()) });
            }
        }
        if let Some(id) = &r.message_id {
            hs = hs.insert(Header { key: MSG_ID_HEADER, value: Some(id.as_bytes()) });
        }
        let mut rec: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&r.destination).payload(r.payload.as_slice()).headers(hs);
        if let Some(k) = &key {
            rec = rec.key(k.as_slice());
        }
        if let Some(ms) = r
            .timestamp
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .and_then(|d| i64::try_from(d.as_millis()).ok())
        {
            rec = rec.timestamp(ms);
        }
        match self.producer.send(rec, QUEUE_TIMEOUT).await {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(DlqError::broker(
                format!("replaying {} to topic {}", r.letter, r.destination),
                e,
            )),
        }
    }
}

/// A dead-letter record, owned.
#[derive(Debug)]
struct Record {
    partition: i32,
    offset: i64,
    timestamp: i64,
    key: Option<Vec<u8>>,
    headers: Vec<(String, Vec<u8>)>,
    payload: Vec<u8>,
}

impl Record {
    fn of(m: &BorrowedMessage<'_>) -> Self {
        let headers = m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec).unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            partition: m.partition(),
            offset: m.offset(),
            timestamp: m.timestamp().to_millis().unwrap_or_default(),
            key: m.key().map(<[u8]>::to_vec),
            headers,
            payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
        }
    }

    /// What a removal marker says it removes.
    fn marks(&self) -> Option<Option<(i32, i64)>> {
        let (_, v) = self
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(KafkaDeadLetters::REMOVED_HEADER))?;
        Some(std::str::from_utf8(v).ok().and_then(position))
    }

    fn into_letter(self) -> Letter {
        let text = |v: &[u8]| String::from_utf8_lossy(v).into_owned();
        let mut l = Letter::new(format!("{}:{}", self.partition, self.offset), self.payload);
        l.message_id = self
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(MSG_ID_HEADER))
            .map(|(_, v)| text(v));
        l.headers = self.headers.iter().map(|(k, v)| (k.clone(), text(v))).collect();
        // The dead-letter copy keeps the original record's time.
        if let Ok(ms) = u64::try_from(self.timestamp)
            && ms > 0
        {
            l.timestamp = Some(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms));
        }
        if let Some(k) = self.key {
            l.headers.push(match String::from_utf8(k) {
                Ok(k) => (KafkaDeadLetters::RECORD_KEY_HEADER.to_owned(), k),
                Err(e) => {
                    (KafkaDeadLetters::RECORD_KEY_HEX_HEADER.to_owned(), to_hex(e.as_bytes()))
                }
            });
        }
        l
    }
}

/// `<partition>:<offset>`.
fn position(id: &str) -> Option<(i32, i64)> {
    let (p, o) = id.split_once(':')?;
    Some((p.parse().ok()?, o.parse().ok()?))
}

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn from_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// Reads `topic` from every partition's start to its end; the records no marker removes,
/// oldest first. Blocks.
fn scan(reader: &ClientConfig, topic: &str) -> Result<Vec<Record>, DlqError> {
    let what = || format!("reading kafka topic {topic}");
    // librdkafka refuses `assign` without a group id, though an assigned consumer never joins
    // its group: a name of its own, no member, no offset committed, nothing kept by the brokers.
    static READS: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let n = READS.fetch_add(1, Ordering::Relaxed);
    let group = format!("idem-dlq-reader-{}-{nanos:08x}-{n}", std::process::id());
    let c: BaseConsumer =
        reader.clone().set("group.id", group).create().map_err(|e| {
            DlqError::broker(format!("creating a reader of kafka topic {topic}"), e)
        })?;
    let md = c.fetch_metadata(Some(topic), TIMEOUT).map_err(|e| DlqError::broker(what(), e))?;
    let Some(t) = md.topics().iter().find(|t| t.name() == topic) else {
        return Err(DlqError::broker(what(), "the brokers did not describe the topic"));
    };
    if let Some(e) = t.error() {
        return Err(DlqError::broker(what(), KafkaError::MetadataFetch(e.into())));
    }
    // Each partition is read to its end-of-file, not to the high watermark `ListOffsets` gives:
    // tansu 0.6 gave one short of the end after a batch of two records.
    let mut open: HashSet<i32> = t.partitions().iter().map(|p| p.id()).collect();
    if open.is_empty() {
        return Ok(Vec::new());
    }
    let mut tpl = TopicPartitionList::new();
    for p in &open {
        tpl.add_partition_offset(topic, *p, Offset::Beginning)
            .map_err(|e| DlqError::broker(what(), e))?;
    }
    c.assign(&tpl).map_err(|e| DlqError::broker(what(), e))?;
    let deadline = Instant::now() + TIMEOUT;
    let mut records = Vec::new();
    while !open.is_empty() {
        match c.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => records.push(Record::of(&m)),
            // Read through (what arrives later is for the next read).
            Some(Err(KafkaError::PartitionEOF(p))) => {
                open.remove(&p);
            }
            Some(Err(e)) => return Err(DlqError::broker(what(), e)),
            None if Instant::now() >= deadline => {
                let left: Vec<i32> = open.iter().copied().collect();
                return Err(DlqError::broker(
                    what(),
                    format!("partitions {left:?} not read to their end within {TIMEOUT:?}"),
                ));
            }
            None => {}
        }
    }
    drop(c);
    Ok(live(records))
}

/// The records that are not markers nor marked, oldest first.
fn live(records: Vec<Record>) -> Vec<Record> {
    let mut removed = HashSet::new();
    let mut letters = Vec::new();
    for r in records {
        match r.marks() {
            Some(Some(pos)) => {
                removed.insert(pos);
            }
            Some(None) => {}
            None => letters.push(r),
        }
    }
    letters.retain(|r| !removed.contains(&(r.partition, r.offset)));
    letters.sort_by_key(|r| (r.timestamp, r.partition, r.offset));
    letters
}

impl DeadLetterQueue for KafkaDeadLetters {
    fn describe(&self) -> String {
        format!("kafka topic {}", self.topic)
    }

    fn read(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Letter>, DlqError>> {
        Box::pin(async move {
            let records = self.scan().await?;
            Ok(records.into_iter().take(limit).map(Record::into_letter).collect())
        })
    }

    /// Produces every message, then awaits every delivery report; the first failure is
    /// returned (the others may have been stored: a replay is at worst twice on the topic).
    fn republish<'a>(&'a self, messages: &'a [Republish]) -> BoxFuture<'a, Result<(), DlqError>> {
        Box::pin(async move {
            let sends = messages.iter().map(|r| self.send(r));
            futures_util::future::join_all(sends).await.into_iter().collect()
        })
    }

    /// Reads the topic, then appends a marker for each id that is a live letter; returns how
    /// many were marked. Two removals of one letter at the same time may both mark it (and
    /// both count it).
    fn remove<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<u64, DlqError>> {
        Box::pin(async move {
            let live: HashSet<(i32, i64)> =
                self.scan().await?.iter().map(|r| (r.partition, r.offset)).collect();
            let wanted: HashSet<(i32, i64)> =
                ids.iter().filter_map(|id| position(id)).filter(|pos| live.contains(pos)).collect();
            let marks = wanted.iter().map(|pos| self.mark(*pos));
            let done: Result<Vec<()>, DlqError> =
                futures_util::future::join_all(marks).await.into_iter().collect();
            Ok(done?.len() as u64)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(partition: i32, offset: i64, headers: &[(&str, &str)]) -> Record {
        Record {
            partition,
            offset,
            timestamp: offset,
            key: None,
            headers: headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
                .collect(),
            payload: Vec::new(),
        }
    }

    #[test]
    fn markers_hide_themselves_and_what_they_mark() {
        let rs = vec![
            record(0, 0, &[("message-id", "a")]),
            record(0, 1, &[("message-id", "b")]),
            record(1, 0, &[("message-id", "c")]),
            record(0, 2, &[(KafkaDeadLetters::REMOVED_HEADER, "0:0")]),
            record(1, 1, &[(KafkaDeadLetters::REMOVED_HEADER, "not a position")]),
        ];
        let ids: Vec<String> = live(rs).into_iter().map(|r| r.into_letter().id).collect();
        assert_eq!(ids, ["1:0", "0:1"]);
    }

    #[test]
    fn record_keys_round_trip() {
        let mut r = record(0, 4, &[("message-id", "a")]);
        r.key = Some(vec![0xff, 0x00, 0x41]);
        let l = r.into_letter();
        assert_eq!(l.header(KafkaDeadLetters::RECORD_KEY_HEX_HEADER), Some("ff0041"));
        assert_eq!(from_hex("ff0041"), Some(vec![0xff, 0x00, 0x41]));
        assert_eq!(from_hex("f"), None);
        assert_eq!(from_hex("zz"), None);
        let mut r = record(0, 5, &[]);
        r.key = Some(b"customer-7".to_vec());
        assert_eq!(r.into_letter().header(KafkaDeadLetters::RECORD_KEY_HEADER), Some("customer-7"));
        assert_eq!(position("3:17"), Some((3, 17)));
        assert_eq!(position("3-17"), None);
    }
}
