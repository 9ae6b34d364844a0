//! Key extraction: where a message's stable identity comes from.
//!
//! A key must be identical on every redelivery: a producer's message id, a business key in the
//! payload, CloudEvents `source` + `id`. Never a delivery tag, a delivery count, a receive
//! timestamp or a correlation id (which groups *related* messages).

use std::fmt;

use serde_json::Value;

/// What an extractor can read from a message. Broker adapters implement it for their deliveries.
pub trait Envelope {
    /// The body.
    fn payload(&self) -> &[u8];
    /// The producer-assigned message id (AMQP `message_id`, NATS `Nats-Msg-Id`, a Kafka header).
    fn message_id(&self) -> Option<&str>;
    /// A header by name, case-insensitively.
    fn header(&self, name: &str) -> Option<&str>;
    /// The correlation id, for logs only (never a dedup key).
    fn correlation_id(&self) -> Option<&str> {
        self.header("correlation-id")
    }
    /// What the broker says about earlier deliveries of this message
    /// ([`Redelivery`]). Inbox mode runs a message that is not a first delivery alone, after
    /// the rest of its batch, under a crash note, so one that kills the process is counted and
    /// dead-lettered as a crash loop; first deliveries pay nothing for it. Default:
    /// [`Redelivery::First`] (no crash-loop detection in inbox mode).
    fn redelivery(&self) -> Redelivery {
        Redelivery::First
    }
    /// Where the message sits in an ordered log (Kafka, Event Hubs): what the
    /// [offset inbox](crate::inbox::OffsetInbox) decides by. Default: `None` (not a log).
    fn log_position(&self) -> Option<LogPosition<'_>> {
        None
    }
}

/// What a broker says about a message's earlier deliveries ([`Envelope::redelivery`]).
///
/// ```
/// use idem_core::extract::{Envelope, Message, Redelivery};
///
/// let m = Message::new(b"{}".to_vec()).with_redelivery(Redelivery::Again);
/// assert_eq!(m.redelivery(), Redelivery::Again);
/// assert_eq!(Message::new(b"{}".to_vec()).redelivery(), Redelivery::First);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Redelivery {
    /// Its first delivery, as far as the broker can tell.
    #[default]
    First,
    /// Delivered before and never settled: RabbitMQ's `redelivered`, a JetStream or Redis
    /// Streams delivery count above 1, AMQP 1.0's `delivery-count` or `first-acquirer`, a copy
    /// idem rescheduled through a delay queue. A process may have died running it.
    Again,
    /// Perhaps delivered before: a Kafka record among the first read from its partition after
    /// an assignment (Kafka keeps no delivery count).
    Possible,
}

impl Redelivery {
    /// [`Again`](Self::Again) when the broker says so, else [`First`](Self::First): what a
    /// source with a redelivery flag or a delivery count answers.
    ///
    /// ```
    /// use idem_core::extract::Redelivery;
    ///
    /// assert_eq!(Redelivery::again_if(3 > 1), Redelivery::Again);
    /// assert_eq!(Redelivery::again_if(false), Redelivery::First);
    /// ```
    pub fn again_if(again: bool) -> Self {
        if again { Self::Again } else { Self::First }
    }
}

/// Where a delivery sits in an ordered log: its partition and offset, and where the consumer's
/// reading of that partition continued from ([`read_from`](Self::read_from)).
///
/// ```
/// use idem_core::extract::LogPosition;
///
/// let p = LogPosition::new("orders", 2, 41).read_from(Some(40));
/// assert_eq!((p.log, p.partition, p.offset, p.from), ("orders", 2, 41, Some(40)));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LogPosition<'a> {
    /// The log (a Kafka topic, an event hub).
    pub log: &'a str,
    /// The partition.
    pub partition: i32,
    /// The offset in the partition.
    pub offset: i64,
    /// Where this consumer's reading of the partition continued from when it read this
    /// message: the offset after the message it read before it from the same partition, or
    /// the offset it started reading at (a seek after an assignment). Every offset in
    /// `from..offset` was either never read by this consumer or is settled. `None` when
    /// unknown (the first message read after an assignment without a stored position).
    pub from: Option<i64>,
}

impl<'a> LogPosition<'a> {
    /// Offset `offset` of `partition` of `log`, read from an unknown position.
    pub fn new(log: &'a str, partition: i32, offset: i64) -> Self {
        Self { log, partition, offset, from: None }
    }

    /// Where the reading of the partition continued from (see [`from`](Self::from)).
    #[must_use]
    pub fn read_from(mut self, from: Option<i64>) -> Self {
        self.from = from;
        self
    }
}

/// A plain message, for tests, the demo and adapters that have no richer type.
///
/// ```
/// use idem_core::extract::{Envelope, Message};
///
/// let m = Message::new(br#"{"order_id":"o-1"}"#.to_vec()).with_message_id("m-1").with_header("ce-id", "e-1");
/// assert_eq!(m.message_id(), Some("m-1"));
/// assert_eq!(m.header("CE-ID"), Some("e-1"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Message {
    /// The body.
    pub payload: Vec<u8>,
    /// The producer's message id.
    pub message_id: Option<String>,
    /// Headers in arrival order.
    pub headers: Vec<(String, String)>,
    /// Correlation id.
    pub correlation_id: Option<String>,
    /// What the broker says about earlier deliveries (see [`Envelope::redelivery`]).
    pub redelivery: Redelivery,
}

impl Message {
    /// A message with a body and nothing else.
    pub fn new(payload: impl Into<Vec<u8>>) -> Self {
        Self { payload: payload.into(), ..Self::default() }
    }

    /// Sets the message id.
    #[must_use]
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Adds a header.
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the correlation id.
    #[must_use]
    pub fn with_correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }

    /// Says what the broker said about earlier deliveries (see [`Envelope::redelivery`]).
    #[must_use]
    pub fn with_redelivery(mut self, redelivery: Redelivery) -> Self {
        self.redelivery = redelivery;
        self
    }
}

impl Envelope for Message {
    fn payload(&self) -> &[u8] {
        &self.payload
    }

    fn redelivery(&self) -> Redelivery {
        self.redelivery
    }
    fn message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
    fn correlation_id(&self) -> Option<&str> {
        self.correlation_id.as_deref().or_else(|| self.header("correlation-id"))
    }
}

/// Why no key could be taken from a message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExtractError {
    /// The message does not carry the key where the extractor looks.
    #[error("message has no dedup key: {what} is missing")]
    Missing {
        /// Where the extractor looked (`"message id"`, `"header `ce-id`"`).
        what: String,
    },
    /// The key is there but cannot be used.
    #[error("dedup key at {what} is unusable: {reason}")]
    Invalid {
        /// Where the key was found.
        what: String,
        /// Why it is unusable.
        reason: String,
    },
    /// The extractor needs a JSON body and this one is not JSON.
    #[error("payload is not JSON, so {what} cannot be read")]
    NotJson {
        /// What was to be read.
        what: String,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
}

impl ExtractError {
    /// Whether the message simply carries no key (as opposed to a malformed one).
    pub fn is_missing(&self) -> bool {
        matches!(self, Self::Missing { .. })
    }
}

/// Turns a message into the id part of its dedup key.
pub trait KeyExtractor: Send + Sync + fmt::Debug + 'static {
    /// The key id for `msg`.
    ///
    /// # Errors
    /// [`ExtractError::Missing`] when the message has no key where this extractor looks.
    fn extract(&self, msg: &dyn Envelope) -> Result<String, ExtractError>;

    /// The key id for `msg`, whose payload the engine parsed as JSON already (`json`, to read
    /// its fingerprint): an extractor that reads the payload as JSON reads `json` instead of
    /// parsing it again. It must answer what [`extract`](Self::extract) answers. Default:
    /// `extract`.
    ///
    /// # Errors
    /// As [`extract`](Self::extract).
    fn extract_parsed(&self, msg: &dyn Envelope, json: &Value) -> Result<String, ExtractError> {
        let _ = json;
        self.extract(msg)
    }
}

/// The producer's message id (the default extractor).
#[derive(Debug, Clone, Copy, Default)]
pub struct MessageId;

impl KeyExtractor for MessageId {
    fn extract(&self, msg: &dyn Envelope) -> Result<String, ExtractError> {
        non_empty("message id", msg.message_id())
    }
}

/// A header's value (e.g. `Idempotency-Key`, a Kafka `message-id` header).
#[derive(Debug, Clone)]
pub struct Header(String);

impl Header {
    /// Reads the header `name` (case-insensitive).
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into())
    }
}

impl KeyExtractor for Header {
    fn extract(&self, msg: &dyn Envelope) -> Result<String, ExtractError> {
        non_empty(&format!("header `{}`", self.0), msg.header(&self.0))
    }
}

/// A business idempotency key inside a JSON payload, by RFC 6901 pointer. Strings are taken as
/// they are, integers in decimal; other JSON types are refused.
///
/// ```
/// use idem_core::extract::{JsonPointer, KeyExtractor, Message};
///
/// let m = Message::new(br#"{"order":{"id":42}}"#.to_vec());
/// assert_eq!(JsonPointer::new("/order/id").extract(&m).unwrap(), "42");
/// assert!(JsonPointer::new("/nope").extract(&m).unwrap_err().is_missing());
/// ```
#[derive(Debug, Clone)]
pub struct JsonPointer(String);

impl JsonPointer {
    /// Reads the value at `pointer` (e.g. `/order/id`).
    pub fn new(pointer: impl Into<String>) -> Self {
        Self(pointer.into())
    }
}

impl KeyExtractor for JsonPointer {
    fn extract(&self, msg: &dyn Envelope) -> Result<String, ExtractError> {
        let what = || format!("JSON pointer `{}`", self.0);
        let v: Value = serde_json::from_slice(msg.payload())
            .map_err(|source| ExtractError::NotJson { what: what(), source })?;
        scalar_with(what, v.pointer(&self.0))
    }

    fn extract_parsed(&self, _: &dyn Envelope, json: &Value) -> Result<String, ExtractError> {
        scalar_with(|| format!("JSON pointer `{}`", self.0), json.pointer(&self.0))
    }
}

/// How a CloudEvent is carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CloudEventsMode {
    /// Binary mode (`ce-source`/`ce-id` headers) when present, else structured mode.
    #[default]
    Auto,
    /// The event is the JSON body (`{"specversion":"1.0","source":…,"id":…}`).
    Structured,
    /// Attributes are headers `ce-source` and `ce-id` (HTTP, Kafka; AMQP uses `cloudEvents:`).
    Binary,
}

/// CloudEvents `source` + `id`: the spec makes that pair unique per distinct event.
///
/// The pair is joined length-prefixed (`<len(source)>:<source><id>`), so distinct pairs can
/// never produce the same key.
///
/// ```
/// use idem_core::extract::{CloudEvents, KeyExtractor, Message};
///
/// let structured = Message::new(br#"{"specversion":"1.0","source":"/shop","id":"e1","type":"t"}"#.to_vec());
/// let binary = Message::new(b"{}".to_vec()).with_header("ce-source", "/shop").with_header("ce-id", "e1");
/// let ce = CloudEvents::default();
/// assert_eq!(ce.extract(&structured).unwrap(), "5:/shope1");
/// assert_eq!(ce.extract(&binary).unwrap(), ce.extract(&structured).unwrap());
/// ```
#[derive(Debug, Clone, Copy, Default)]
pub struct CloudEvents(pub CloudEventsMode);

impl KeyExtractor for CloudEvents {
    fn extract(&self, msg: &dyn Envelope) -> Result<String, ExtractError> {
        let binary = || -> Option<(String, String)> {
            let get = |n: &str| {
                msg.header(&format!("ce-{n}"))
                    .or_else(|| msg.header(&format!("ce_{n}")))
                    .or_else(|| msg.header(&format!("cloudEvents:{n}")))
                    .map(str::to_owned)
            };
            Some((get("source")?, get("id")?))
        };
        let (source, id) = match self.0 {
            CloudEventsMode::Binary => binary().ok_or_else(|| ExtractError::Missing {
                what: "CloudEvents headers `ce-source` and `ce-id`".into(),
            })?,
            CloudEventsMode::Auto if binary().is_some() => binary().unwrap_or_default(),
            CloudEventsMode::Auto | CloudEventsMode::Structured => {
                let what = "CloudEvents `source` and `id` in a structured event".to_string();
                let v: Value = serde_json::from_slice(msg.payload())
                    .map_err(|source| ExtractError::NotJson { what: what.clone(), source })?;
                (
                    scalar("CloudEvents `source`", v.get("source"))?,
                    scalar("CloudEvents `id`", v.get("id"))?,
                )
            }
        };
        if source.is_empty() || id.is_empty() {
            return Err(ExtractError::Invalid {
                what: "CloudEvents `source`/`id`".into(),
                reason: "empty".into(),
            });
        }
        Ok(format!("{}:{source}{id}", source.len()))
    }
}

/// Tries extractors in order; the first that finds a key wins. A malformed key (not merely
/// missing) stops the search.
#[derive(Debug)]
pub struct FirstOf(pub Vec<Box<dyn KeyExtractor>>);

impl KeyExtractor for FirstOf {
    fn extract(&self, msg: &dyn Envelope) -> Result<String, ExtractError> {
        self.first(|x| x.extract(msg))
    }

    fn extract_parsed(&self, msg: &dyn Envelope, json: &Value) -> Result<String, ExtractError> {
        self.first(|x| x.extract_parsed(msg, json))
    }
}

impl FirstOf {
    fn first(
        &self,
        extract: impl Fn(&dyn KeyExtractor) -> Result<String, ExtractError>,
    ) -> Result<String, ExtractError> {
        let mut missing = Vec::new();
        for x in &self.0 {
            match extract(x.as_ref()) {
                Ok(k) => return Ok(k),
                Err(ExtractError::Missing { what }) => missing.push(what),
                Err(e) => return Err(e),
            }
        }
        Err(ExtractError::Missing { what: missing.join(", ") })
    }
}

/// All extractors' keys joined, length-prefixed, into one (a tenant id plus an order id).
///
/// ```
/// use idem_core::extract::{Header, JsonPointer, Join, KeyExtractor, Message};
///
/// let m = Message::new(br#"{"id":"o-1"}"#.to_vec()).with_header("tenant", "acme");
/// let key = Join(vec![Box::new(Header::new("tenant")), Box::new(JsonPointer::new("/id"))]);
/// assert_eq!(key.extract(&m).unwrap(), "4:acme3:o-1");
/// ```
#[derive(Debug)]
pub struct Join(pub Vec<Box<dyn KeyExtractor>>);

impl KeyExtractor for Join {
    fn extract(&self, msg: &dyn Envelope) -> Result<String, ExtractError> {
        self.join(|x| x.extract(msg))
    }

    fn extract_parsed(&self, msg: &dyn Envelope, json: &Value) -> Result<String, ExtractError> {
        self.join(|x| x.extract_parsed(msg, json))
    }
}

impl Join {
    fn join(
        &self,
        extract: impl Fn(&dyn KeyExtractor) -> Result<String, ExtractError>,
    ) -> Result<String, ExtractError> {
        let mut out = String::new();
        for x in &self.0 {
            let part = extract(x.as_ref())?;
            out.push_str(&format!("{}:{part}", part.len()));
        }
        Ok(out)
    }
}

fn non_empty(what: &str, v: Option<&str>) -> Result<String, ExtractError> {
    match v {
        None => Err(ExtractError::Missing { what: what.to_owned() }),
        Some("") => Err(ExtractError::Invalid { what: what.to_owned(), reason: "empty".into() }),
        Some(s) => Ok(s.to_owned()),
    }
}

fn scalar(what: &str, v: Option<&Value>) -> Result<String, ExtractError> {
    scalar_with(|| what.to_owned(), v)
}

/// [`scalar`] with the field's description built only for an error (the hot path of a key
/// extractor allocates nothing for it).
fn scalar_with(what: impl FnOnce() -> String, v: Option<&Value>) -> Result<String, ExtractError> {
    match v {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::String(_)) => {
            Err(ExtractError::Invalid { what: what(), reason: "empty".into() })
        }
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(n.to_string()),
        None | Some(Value::Null) => Err(ExtractError::Missing { what: what() }),
        Some(other) => Err(ExtractError::Invalid {
            what: what(),
            reason: format!("expected a string or an integer, found {}", json_type(other)),
        }),
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a non-integer number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_id_missing_and_empty() {
        assert!(MessageId.extract(&Message::new(b"".to_vec())).unwrap_err().is_missing());
        let e = MessageId.extract(&Message::new(b"".to_vec()).with_message_id("")).unwrap_err();
        assert!(matches!(e, ExtractError::Invalid { .. }), "{e}");
    }

    #[test]
    fn json_pointer_types() {
        let m = Message::new(br#"{"a":"x","b":7,"c":1.5,"d":[1],"e":null}"#.to_vec());
        assert_eq!(JsonPointer::new("/a").extract(&m).unwrap(), "x");
        assert_eq!(JsonPointer::new("/b").extract(&m).unwrap(), "7");
        for p in ["/c", "/d"] {
            assert!(matches!(JsonPointer::new(p).extract(&m), Err(ExtractError::Invalid { .. })));
        }
        assert!(JsonPointer::new("/e").extract(&m).unwrap_err().is_missing());
        let not_json = Message::new(b"nope".to_vec());
        assert!(matches!(
            JsonPointer::new("/a").extract(&not_json),
            Err(ExtractError::NotJson { .. })
        ));
    }

    #[test]
    fn cloudevents_modes() {
        let s = Message::new(br#"{"source":"a:b","id":"1"}"#.to_vec());
        let b =
            Message::new(b"x".to_vec()).with_header("ce-source", "a:b").with_header("ce-id", "1");
        assert_eq!(CloudEvents(CloudEventsMode::Structured).extract(&s).unwrap(), "3:a:b1");
        assert_eq!(CloudEvents(CloudEventsMode::Binary).extract(&b).unwrap(), "3:a:b1");
        assert!(CloudEvents(CloudEventsMode::Binary).extract(&s).unwrap_err().is_missing());
        assert!(matches!(
            CloudEvents(CloudEventsMode::Structured).extract(&b),
            Err(ExtractError::NotJson { .. })
        ));
        // Distinct pairs never collide.
        let x = Message::new(br#"{"source":"ab","id":"c"}"#.to_vec());
        let y = Message::new(br#"{"source":"a","id":"bc"}"#.to_vec());
        let ce = CloudEvents::default();
        assert_ne!(ce.extract(&x).unwrap(), ce.extract(&y).unwrap());
    }

    #[test]
    fn first_of_falls_back_only_when_missing() {
        let x = FirstOf(vec![Box::new(MessageId), Box::new(Header::new("k"))]);
        assert_eq!(x.extract(&Message::new(vec![]).with_header("k", "v")).unwrap(), "v");
        assert_eq!(
            x.extract(&Message::new(vec![]).with_message_id("m").with_header("k", "v")).unwrap(),
            "m"
        );
        let e = x.extract(&Message::new(vec![])).unwrap_err();
        assert_eq!(e.to_string(), "message has no dedup key: message id, header `k` is missing");
    }
}
