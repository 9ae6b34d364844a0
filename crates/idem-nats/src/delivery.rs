//! One JetStream delivery, as the idem engine reads it.

use async_nats::HeaderMap;
use async_nats::jetstream::AckKind;
use async_nats::jetstream::message::Acker;
use bytes::Bytes;
use idem_core::extract::Envelope;

/// The `Nats-Msg-Id` header: the producer's message id, and JetStream's own publish dedup id.
pub const MSG_ID_HEADER: &str = "Nats-Msg-Id";

/// Whether `name` is one of the server's `Nats-*` headers: an instruction for the publish that
/// carried it (`Nats-Expected-Stream`, `Nats-Expected-Last-Sequence`, `Nats-Rollup`,
/// `Nats-TTL`, `Nats-Msg-Id`), which the stream stores with the message. Sent again on another
/// publish it would be obeyed there: a copy refused (wrong stream or sequence), a subject
/// purged, an expiry set. Copies made by idem leave them out.
pub(crate) fn is_server_header(name: &str) -> bool {
    name.get(..5).is_some_and(|p| p.eq_ignore_ascii_case("Nats-"))
}

/// A message fetched from a pull consumer. Cheap to clone (shared): each handler gets its own
/// copy; only the adapter can ack it.
///
/// [`Envelope::message_id`] is the `Nats-Msg-Id` header, so the default key extractor
/// ([`idem_core::extract::MessageId`]) keys on it; [`Envelope::header`] looks headers up
/// case-insensitively, so any other extractor works too.
#[derive(Clone)]
pub struct Delivery {
    inner: std::sync::Arc<Inner>,
}

struct Inner {
    subject: String,
    payload: Bytes,
    headers: Option<HeaderMap>,
    stream: String,
    consumer: String,
    stream_sequence: u64,
    delivered: i64,
    pending: u64,
    acker: Acker,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("subject", &self.inner.subject)
            .field("stream_sequence", &self.inner.stream_sequence)
            .field("delivered", &self.inner.delivered)
            .field("message_id", &self.message_id())
            .finish_non_exhaustive()
    }
}

impl Delivery {
    pub(crate) fn new(msg: async_nats::jetstream::Message) -> Result<Self, async_nats::Error> {
        let (stream, consumer, stream_sequence, delivered, pending) = {
            let info = msg.info()?;
            let (stream, consumer) = (info.stream.to_owned(), info.consumer.to_owned());
            (stream, consumer, info.stream_sequence, info.delivered, info.pending)
        };
        let (m, acker) = msg.split();
        Ok(Self {
            inner: std::sync::Arc::new(Inner {
                subject: m.subject.to_string(),
                payload: m.payload,
                headers: m.headers,
                stream,
                consumer,
                stream_sequence,
                delivered,
                pending,
                acker,
            }),
        })
    }

    /// The subject it was published to.
    pub fn subject(&self) -> &str {
        &self.inner.subject
    }

    /// The payload as `Bytes` (a reference-counted clone, no copy), for handlers whose future
    /// must own what it reads.
    pub fn payload_bytes(&self) -> Bytes {
        self.inner.payload.clone()
    }

    /// Its headers, if any.
    pub fn headers(&self) -> Option<&HeaderMap> {
        self.inner.headers.as_ref()
    }

    /// The stream it is stored in.
    pub fn stream(&self) -> &str {
        &self.inner.stream
    }

    /// The consumer that delivered it.
    pub fn consumer(&self) -> &str {
        &self.inner.consumer
    }

    /// Its sequence number in the stream (the same on every redelivery; never a dedup key, since
    /// a producer's duplicate publish gets a new one).
    pub fn stream_sequence(&self) -> u64 {
        self.inner.stream_sequence
    }

    /// How many times JetStream has delivered it, this time included.
    pub fn delivered(&self) -> i64 {
        self.inner.delivered
    }

    /// How many messages the consumer still had for delivery when this one was sent
    /// (JetStream's `num_pending`, read from the delivery's metadata: no extra round trip).
    pub fn pending(&self) -> u64 {
        self.inner.pending
    }

    pub(crate) async fn reply(&self, kind: AckKind) -> Result<(), async_nats::Error> {
        self.inner.acker.ack_with(kind).await
    }
}

impl Envelope for Delivery {
    fn payload(&self) -> &[u8] {
        &self.inner.payload
    }

    fn redelivery(&self) -> idem_core::extract::Redelivery {
        idem_core::extract::Redelivery::again_if(self.inner.delivered > 1)
    }

    fn message_id(&self) -> Option<&str> {
        self.header(MSG_ID_HEADER)
    }

    fn header(&self, name: &str) -> Option<&str> {
        let headers = self.inner.headers.as_ref()?;
        headers
            .iter()
            .find(|(k, _)| AsRef::<str>::as_ref(*k).eq_ignore_ascii_case(name))
            .and_then(|(_, vs)| vs.first())
            .map(async_nats::HeaderValue::as_str)
    }
}
