//! One polled Kafka message, owned.

use std::sync::Arc;

use idem_core::extract::{Envelope, LogPosition};
use rdkafka::Message as _;
use rdkafka::message::{BorrowedMessage, Headers as _};

/// The header the default key extractor reads (`MessageId`).
pub const MSG_ID_HEADER: &str = "message-id";

/// A polled Kafka message: where it came from, its key, payload and headers; cheap to clone
/// (shared), so each handler gets its own copy. Implements
/// [`Envelope`], so any [`KeyExtractor`](idem_core::extract::KeyExtractor) works; the default
/// one reads the [`MSG_ID_HEADER`] header. The offset is never a key: a producer's retry
/// writes the same message again at a new offset.
///
/// ```
/// use idem_core::extract::Envelope;
/// use idem_kafka::Delivery;
///
/// let d = Delivery::new("orders", 0, 41, b"{}".to_vec()).with_header("message-id", b"o-1");
/// assert_eq!(d.message_id(), Some("o-1"));
/// assert_eq!((d.topic(), d.partition(), d.offset()), ("orders", 0, 41));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    inner: Arc<Record>,
    pub(crate) attempts: u32,
    /// The adapter's revocation count when this was polled.
    pub(crate) epoch: u64,
    /// Where this member's reading of the partition continued from (see
    /// [`LogPosition::from`]).
    pub(crate) from: Option<i64>,
    /// Read again after its partition was assigned: among the first records read there, which
    /// a member that died may have been processing (see [`Envelope::redelivery`]).
    pub(crate) reread: bool,
}

/// The record itself, shared by the clones handlers get.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    topic: String,
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    payload: Vec<u8>,
    headers: Vec<(String, Vec<u8>)>,
    /// The record's timestamp (ms since 1970), when it has one.
    timestamp: Option<i64>,
}

impl Delivery {
    /// A message with no key and no headers (for tests and examples).
    pub fn new(topic: impl Into<String>, partition: i32, offset: i64, payload: Vec<u8>) -> Self {
        let record = Record {
            topic: topic.into(),
            partition,
            offset,
            key: None,
            payload,
            headers: Vec::new(),
            timestamp: None,
        };
        Self { inner: Arc::new(record), attempts: 0, epoch: 0, from: None, reread: false }
    }

    /// Adds a header.
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: &[u8]) -> Self {
        Arc::make_mut(&mut self.inner).headers.push((name.into(), value.to_vec()));
        self
    }

    pub(crate) fn from_borrowed(m: &BorrowedMessage<'_>) -> Self {
        let headers = m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec).unwrap_or_default()))
                    .collect()
            })
            .unwrap_or_default();
        let record = Record {
            topic: m.topic().to_owned(),
            partition: m.partition(),
            offset: m.offset(),
            key: m.key().map(<[u8]>::to_vec),
            payload: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
            headers,
            timestamp: m.timestamp().to_millis(),
        };
        Self { inner: Arc::new(record), attempts: 0, epoch: 0, from: None, reread: false }
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.inner.topic
    }

    /// The partition.
    pub fn partition(&self) -> i32 {
        self.inner.partition
    }

    /// The offset in its partition.
    pub fn offset(&self) -> i64 {
        self.inner.offset
    }

    /// The record's timestamp in milliseconds since 1970 (its producer's create time, or the
    /// broker's append time, as the topic says), when it has one.
    pub fn timestamp_ms(&self) -> Option<i64> {
        self.inner.timestamp
    }

    /// The Kafka record key (the partitioning key, usually an entity id; not a message id).
    pub fn record_key(&self) -> Option<&[u8]> {
        self.inner.key.as_deref()
    }

    /// The payload.
    pub fn payload_bytes(&self) -> &[u8] {
        &self.inner.payload
    }

    /// All headers in record order (a name may repeat).
    pub fn headers(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.inner.headers.iter().map(|(k, v)| (k.as_str(), v.as_slice()))
    }

    /// Sets where the reading of its partition continued from, as the source does when it
    /// polls (for tests of the offset inbox).
    #[must_use]
    pub fn read_from(mut self, from: Option<i64>) -> Self {
        self.from = from;
        self
    }

    /// How many times this adapter has retried this message in this process.
    pub fn retries(&self) -> u32 {
        self.attempts
    }

    pub(crate) fn tp(&self) -> (String, i32) {
        (self.inner.topic.clone(), self.inner.partition)
    }
}

impl Envelope for Delivery {
    fn payload(&self) -> &[u8] {
        &self.inner.payload
    }

    fn message_id(&self) -> Option<&str> {
        self.header(MSG_ID_HEADER)
    }

    /// Topic, partition and offset, and where this member's reading of the partition
    /// continued from: what the offset inbox decides by.
    fn log_position(&self) -> Option<LogPosition<'_>> {
        Some(LogPosition::new(self.topic(), self.partition(), self.offset()).read_from(self.from))
    }

    /// [`Redelivery::Possible`](idem_core::extract::Redelivery::Possible) for the first records
    /// read from its partition since it was assigned (twice the largest batch): a member that
    /// died may have been processing them. Kafka keeps no delivery count, and the committed
    /// offset may lag the last batch settled by one batch.
    fn redelivery(&self) -> idem_core::extract::Redelivery {
        if self.reread {
            idem_core::extract::Redelivery::Possible
        } else {
            idem_core::extract::Redelivery::First
        }
    }

    /// The last header of that name whose value is UTF-8 (Kafka headers are bytes).
    fn header(&self, name: &str) -> Option<&str> {
        self.inner
            .headers
            .iter()
            .rev()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }
}
