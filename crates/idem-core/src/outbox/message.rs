//! Outgoing messages, their ids and their limits.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::{DedupKey, StoreError};

/// Longest destination (queue, subject, topic or stream name) the outbox accepts, in bytes.
pub(crate) const MAX_DESTINATION_BYTES: usize = 255;
/// Longest message id or ordering key, in bytes.
pub(crate) const MAX_ID_BYTES: usize = 255;
/// Largest payload, in bytes. Brokers have their own limits, which may be lower once headers
/// are counted (NATS' default `max_payload` is 1 MiB with headers, Kafka's default
/// `message.max.bytes` 1,000,000): a message over the broker's limit is parked by the relay
/// with the broker's reason.
pub const MAX_PAYLOAD_BYTES: usize = 1 << 20;
/// Most headers on one message.
pub(crate) const MAX_HEADERS: usize = 64;
/// Longest header name, in bytes (AMQP's short-string limit).
pub(crate) const MAX_HEADER_NAME_BYTES: usize = 255;
/// Largest header name plus value, in bytes.
pub(crate) const MAX_HEADER_BYTES: usize = 4096;

/// Errors from enqueueing into an outbox.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxError {
    /// A field is empty.
    #[error("outbox message {field} is empty")]
    Empty {
        /// The field (`"destination"`, `"id"`, `"ordering key"`, `"header name"`).
        field: &'static str,
    },
    /// A field is longer than the outbox accepts.
    #[error("outbox message {field} is {len} bytes, longer than the limit of {limit} bytes")]
    TooLarge {
        /// The field.
        field: &'static str,
        /// Its size in bytes.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// More headers than the outbox accepts.
    #[error("outbox message has {count} headers, more than the limit of {limit}")]
    TooManyHeaders {
        /// How many were given.
        count: usize,
        /// The limit.
        limit: usize,
    },
    /// A field holds a control character (brokers reject them in names, and they hide in logs).
    #[error("outbox message {field} holds a control character at byte {offset}")]
    ControlCharacter {
        /// The field.
        field: &'static str,
        /// Where.
        offset: usize,
    },
    /// A header name or value holds a character some broker cannot carry in a header: names
    /// are visible ASCII without `:`, values printable ASCII (NATS headers are ASCII lines).
    #[error(
        "outbox message {field} {name:?} holds {found:?} at byte {offset}, which not every broker carries in a header"
    )]
    HeaderCharacter {
        /// `"header name"` or `"header value"`.
        field: &'static str,
        /// The header's name.
        name: String,
        /// The character.
        found: char,
        /// Where.
        offset: usize,
    },
    /// The payload did not serialize.
    #[error("outbox message payload did not serialize to JSON")]
    Encode(#[source] serde_json::Error),
    /// The database failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn check(field: &'static str, value: &str, limit: usize) -> Result<(), OutboxError> {
    if value.is_empty() {
        return Err(OutboxError::Empty { field });
    }
    if value.len() > limit {
        return Err(OutboxError::TooLarge { field, len: value.len(), limit });
    }
    if let Some(offset) = value.bytes().position(|b| b.is_ascii_control()) {
        return Err(OutboxError::ControlCharacter { field, offset });
    }
    Ok(())
}

/// The id an outgoing message carries to the broker (AMQP `message_id`, `Nats-Msg-Id`, a Kafka
/// `message-id` header, a Redis Streams field): what the next idem consumer deduplicates on.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OutboxId(String);

impl OutboxId {
    /// The id of the `seq`-th message (from 0) a handler produces while handling the message
    /// with key `inbound`: the same on every run of that handler, so a handler that runs again
    /// after a rollback produces the same ids, and a consumer downstream sees duplicates, not
    /// new messages.
    ///
    /// ```
    /// use idem_core::{DedupKey, outbox::OutboxId};
    /// let key = DedupKey::new("billing", "o-1").unwrap();
    /// assert_eq!(OutboxId::derived(&key, 0), OutboxId::derived(&key, 0));
    /// assert_ne!(OutboxId::derived(&key, 0), OutboxId::derived(&key, 1));
    /// ```
    pub fn derived(inbound: &DedupKey, seq: u32) -> Self {
        let mut h = Sha256::new();
        h.update(b"idem-outbox-v1");
        h.update(inbound.hash().0);
        h.update(seq.to_be_bytes());
        Self(format!("idem-{}", hex::encode(&h.finalize()[..16])))
    }

    /// A fresh random id, for a message produced outside a handler.
    pub fn random() -> Self {
        Self(format!("idem-{:032x}", rand::random::<u128>()))
    }

    /// An id of the caller's choosing.
    ///
    /// # Errors
    /// Empty, longer than 255 bytes, or holding a control character.
    pub fn new(id: impl Into<String>) -> Result<Self, OutboxError> {
        let id = id.into();
        check("id", &id, MAX_ID_BYTES)?;
        Ok(Self(id))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// An id read back from a store, trusted as written.
    #[doc(hidden)]
    pub fn from_stored(id: String) -> Self {
        Self(id)
    }
}

impl fmt::Debug for OutboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OutboxId({:?})", self.0)
    }
}

impl fmt::Display for OutboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A message to publish through the outbox: its destination, payload, headers, and optionally
/// an ordering key and an id of the caller's choosing.
///
/// The destination is what the relay's broker calls it: a routing key (RabbitMQ), a subject
/// (NATS), a topic (Kafka) or a stream key (Redis).
///
/// ```
/// use idem_core::outbox::Outgoing;
/// let msg = Outgoing::new("orders.accepted", r#"{"order":"o-1"}"#)
///     .header("content-type", "application/json")
///     .ordering_key("customer-7");
/// assert!(msg.validate().is_ok());
/// assert!(Outgoing::new("", "x").validate().is_err());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub struct Outgoing {
    pub(crate) destination: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) ordering_key: Option<String>,
    pub(crate) id: Option<OutboxId>,
}

impl Outgoing {
    /// A message for `destination`.
    pub fn new(destination: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        Self {
            destination: destination.into(),
            payload: payload.into(),
            headers: Vec::new(),
            ordering_key: None,
            id: None,
        }
    }

    /// A message whose payload is `value` as JSON, with `content-type: application/json`.
    ///
    /// # Errors
    /// [`OutboxError::Encode`] when `value` does not serialize.
    pub fn json<T: serde::Serialize>(
        destination: impl Into<String>,
        value: &T,
    ) -> Result<Self, OutboxError> {
        let payload = serde_json::to_vec(value).map_err(OutboxError::Encode)?;
        Ok(Self::new(destination, payload).header("content-type", "application/json"))
    }

    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Messages with the same destination and ordering key are published in the order they
    /// were enqueued, one after the other (each waits until the one before it is confirmed).
    /// Messages without one are published in parallel, in no promised order.
    pub fn ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Publishes under this id instead of a derived or random one.
    pub fn id(mut self, id: OutboxId) -> Self {
        self.id = Some(id);
        self
    }

    /// Checks every field against the outbox's limits (enqueueing does this first).
    ///
    /// # Errors
    /// The first field that is empty, too long, or holds a control character; too many headers;
    /// a payload above [`MAX_PAYLOAD_BYTES`].
    pub fn validate(&self) -> Result<(), OutboxError> {
        check("destination", &self.destination, MAX_DESTINATION_BYTES)?;
        if self.payload.len() > MAX_PAYLOAD_BYTES {
            return Err(OutboxError::TooLarge {
                field: "payload",
                len: self.payload.len(),
                limit: MAX_PAYLOAD_BYTES,
            });
        }
        if let Some(k) = &self.ordering_key {
            check("ordering key", k, MAX_ID_BYTES)?;
        }
        if self.headers.len() > MAX_HEADERS {
            return Err(OutboxError::TooManyHeaders {
                count: self.headers.len(),
                limit: MAX_HEADERS,
            });
        }
        for (name, value) in &self.headers {
            check("header name", name, MAX_HEADER_NAME_BYTES)?;
            let bad_name = name.char_indices().find(|&(_, c)| !c.is_ascii_graphic() || c == ':');
            let bad_value =
                value.char_indices().find(|&(_, c)| !(c.is_ascii_graphic() || c == ' '));
            for (field, bad) in [("header name", bad_name), ("header value", bad_value)] {
                if let Some((offset, found)) = bad {
                    let name = name.clone();
                    return Err(OutboxError::HeaderCharacter { field, name, found, offset });
                }
            }
            let len = name.len() + value.len();
            if len > MAX_HEADER_BYTES {
                return Err(OutboxError::TooLarge {
                    field: "header",
                    len,
                    limit: MAX_HEADER_BYTES,
                });
            }
        }
        Ok(())
    }

    /// The message with its id settled: its own, else `fallback`.
    pub fn into_message(self, fallback: impl FnOnce() -> OutboxId) -> OutboxMessage {
        OutboxMessage {
            id: self.id.unwrap_or_else(fallback),
            destination: self.destination,
            payload: self.payload,
            headers: self.headers,
            ordering_key: self.ordering_key,
        }
    }
}

/// A message with its id, as stored in an outbox and handed to a [`Publisher`](super::Publisher).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxMessage {
    id: OutboxId,
    destination: String,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
    ordering_key: Option<String>,
}

impl OutboxMessage {
    /// A message read back from a store.
    pub fn from_parts(
        id: OutboxId,
        destination: String,
        payload: Vec<u8>,
        headers: Vec<(String, String)>,
        ordering_key: Option<String>,
    ) -> Self {
        Self { id, destination, payload, headers, ordering_key }
    }

    /// The id to publish under.
    pub fn id(&self) -> &OutboxId {
        &self.id
    }

    /// Where to publish.
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// The payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The headers, in the order they were added.
    pub fn headers(&self) -> &[(String, String)] {
        &self.headers
    }

    /// The ordering key, if any (Kafka publishers use it as the record key).
    pub fn ordering_key(&self) -> Option<&str> {
        self.ordering_key.as_deref()
    }

    /// Headers as stored: a JSON array of `[name, value]` pairs.
    pub fn headers_json(&self) -> String {
        encode_headers(&self.headers)
    }
}

/// Headers as stored: a JSON array of `[name, value]` pairs.
pub fn encode_headers(headers: &[(String, String)]) -> String {
    serde_json::to_string(headers).unwrap_or_else(|_| String::from("[]"))
}

/// Headers read back from a store.
///
/// # Errors
/// [`StoreError::Corrupt`] when the text is not a JSON array of pairs of strings.
pub fn decode_headers(text: &str) -> Result<Vec<(String, String)>, StoreError> {
    serde_json::from_str(text)
        .map_err(|e| StoreError::Corrupt { what: format!("outbox headers: {e}") })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_name_the_field() {
        let e = Outgoing::new("q", vec![0; MAX_PAYLOAD_BYTES + 1]).validate().unwrap_err();
        assert!(e.to_string().contains("payload") && e.to_string().contains("1048576"), "{e}");
        let e = Outgoing::new("a\nb", "x").validate().unwrap_err();
        assert!(e.to_string().contains("destination") && e.to_string().contains("byte 1"), "{e}");
        let e = Outgoing::new("x".repeat(256), "x").validate().unwrap_err();
        assert!(e.to_string().contains("255"), "{e}");
        let mut m = Outgoing::new("q", "x");
        for i in 0..65 {
            m = m.header(format!("h{i}"), "v");
        }
        assert!(matches!(m.validate(), Err(OutboxError::TooManyHeaders { count: 65, .. })));
        assert!(Outgoing::new("q", "x").ordering_key("").validate().is_err());
        let e = Outgoing::new("q", "x").header("trace", "é").validate().unwrap_err();
        assert!(e.to_string().contains("header value") && e.to_string().contains("'é'"), "{e}");
        let e = Outgoing::new("q", "x").header("a:b", "1").validate().unwrap_err();
        assert!(e.to_string().contains("header name"), "{e}");
        assert!(Outgoing::new("q", "x").header("h", "v\r\nX: 1").validate().is_err());
        assert!(Outgoing::new("q", "x").header("x-trace", "a b=c;d").validate().is_ok());
        assert!(OutboxId::new("").is_err());
    }

    #[test]
    fn derived_ids_depend_on_key_and_sequence_only() {
        let a = DedupKey::new("s", "1").unwrap();
        let b = DedupKey::new("s", "2").unwrap();
        assert_eq!(OutboxId::derived(&a, 3), OutboxId::derived(&a.clone(), 3));
        assert_ne!(OutboxId::derived(&a, 0), OutboxId::derived(&b, 0));
        assert_ne!(OutboxId::random(), OutboxId::random());
        assert_eq!(OutboxId::derived(&a, 0).as_str().len(), 37);
    }

    #[test]
    fn headers_round_trip() {
        let h = vec![("a".to_owned(), "1".to_owned()), ("b\"".to_owned(), "é".to_owned())];
        assert_eq!(decode_headers(&encode_headers(&h)).unwrap(), h);
        assert!(matches!(decode_headers("{"), Err(StoreError::Corrupt { .. })));
    }
}
