//! A delivery as handlers and key extractors see it.

use std::sync::Arc;

use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::types::messaging::{Body, Message, MessageId};
use fe2o3_amqp::types::primitives::{SimpleValue, Value};
use idem_core::extract::Envelope;

/// The application property counting reschedules.
pub(crate) const DELAYS: &str = "idem-delays";

/// One AMQP 1.0 delivery, received unsettled: the broker keeps it locked (Service Bus
/// PeekLock) or unacknowledged (RabbitMQ) until the consumer settles it. Cheap to clone.
///
/// Implements [`Envelope`], so every key extractor of `idem_core::extract` reads it:
/// - [`Envelope::message_id`] is the AMQP `message-id` property (a string as is, a `ulong` in
///   decimal, a `uuid` hyphenated, `binary` in hex) — Service Bus' `MessageId`;
/// - [`Envelope::header`] reads string application properties, case-insensitively; a name
///   `ce-x` or `ce_x` also finds the CloudEvents AMQP binding's `cloudEvents:x` /
///   `cloudEvents_x`, so [`CloudEvents`](idem_core::extract::CloudEvents) works unchanged;
/// - [`Envelope::correlation_id`] is the `correlation-id` property (logs only, never a key).
#[derive(Clone)]
pub struct Delivery {
    inner: Arc<Inner>,
}

struct Inner {
    info: DeliveryInfo,
    message: Message<Body<Value>>,
    payload: Vec<u8>,
    message_id: Option<String>,
    correlation_id: Option<String>,
    headers: Vec<(String, String)>,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("delivery_id", &self.inner.info.delivery_id())
            .field("message_id", &self.inner.message_id)
            .field("delivery_count", &self.delivery_count())
            .field("bytes", &self.inner.payload.len())
            .finish_non_exhaustive()
    }
}

impl Delivery {
    pub(crate) fn new(info: DeliveryInfo, message: Message<Body<Value>>) -> Self {
        let payload = body_bytes(&message.body);
        let props = message.properties.as_ref();
        let message_id = props.and_then(|p| p.message_id.as_ref()).map(id_text);
        let correlation_id = props.and_then(|p| p.correlation_id.as_ref()).map(id_text);
        let headers = message
            .application_properties
            .as_ref()
            .map(|ap| {
                ap.0.iter().filter_map(|(k, v)| simple_text(v).map(|v| (k.clone(), v))).collect()
            })
            .unwrap_or_default();
        Self {
            inner: Arc::new(Inner { info, message, payload, message_id, correlation_id, headers }),
        }
    }

    pub(crate) fn info(&self) -> &DeliveryInfo {
        &self.inner.info
    }

    /// The body: the concatenated `data` sections, or an `amqp-value` that is a string or
    /// binary. Other bodies (sequences, maps) read as empty: use [`message`](Self::message).
    pub fn payload(&self) -> &[u8] {
        &self.inner.payload
    }

    /// The whole AMQP message (header, annotations, properties, application properties).
    pub fn message(&self) -> &Message<Body<Value>> {
        &self.inner.message
    }

    /// How many earlier deliveries of this message failed (the `header.delivery-count`;
    /// Service Bus counts abandons and lock expiries). Informational: dedup never uses it.
    pub fn delivery_count(&self) -> u32 {
        self.inner.message.header.as_ref().map_or(0, |h| h.delivery_count)
    }

    /// The delivery tag: on Service Bus the message's lock token.
    pub fn delivery_tag(&self) -> &[u8] {
        self.inner.info.delivery_tag().as_ref()
    }

    /// A copy of the bare message (header, properties, application properties, body) with
    /// `extra` string application properties set; the broker's annotations are not copied.
    pub(crate) fn copy_with<'a>(
        &self,
        extra: impl IntoIterator<Item = (&'a str, String)>,
    ) -> Message<Body<Value>> {
        let original = &self.inner.message;
        let mut props = original.application_properties.clone().unwrap_or_default();
        for (k, v) in extra {
            props.0.insert(k.to_owned(), SimpleValue::String(v));
        }
        Message {
            header: original.header.clone(),
            delivery_annotations: None,
            message_annotations: None,
            properties: original.properties.clone(),
            application_properties: Some(props),
            body: original.body.clone(),
            footer: None,
        }
    }

    /// How many times idem has rescheduled this message (application property
    /// `idem-delays`; Service Bus with `schedule_retries` only).
    pub fn delays(&self) -> u32 {
        self.inner
            .headers
            .iter()
            .find(|(k, _)| k == DELAYS)
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0)
    }

    /// The application properties that are strings, in arrival order.
    pub fn headers(&self) -> &[(String, String)] {
        &self.inner.headers
    }
}

fn body_bytes(body: &Body<Value>) -> Vec<u8> {
    match body {
        Body::Data(sections) => sections.iter().flat_map(|d| d.0.iter().copied()).collect(),
        Body::Value(v) => match &v.0 {
            Value::String(s) => s.as_bytes().to_vec(),
            Value::Binary(b) => b.to_vec(),
            _ => Vec::new(),
        },
        _ => Vec::new(),
    }
}

/// A message or correlation id as text.
pub(crate) fn id_text(id: &MessageId) -> String {
    match id {
        MessageId::String(s) => s.clone(),
        MessageId::Ulong(n) => n.to_string(),
        MessageId::Uuid(u) => uuid::Uuid::from_bytes(*u.as_inner()).hyphenated().to_string(),
        MessageId::Binary(b) => b.iter().map(|x| format!("{x:02x}")).collect(),
    }
}

fn simple_text(v: &SimpleValue) -> Option<String> {
    match v {
        SimpleValue::String(s) => Some(s.clone()),
        SimpleValue::Symbol(s) => Some(s.0.clone()),
        _ => None,
    }
}

impl Envelope for Delivery {
    fn payload(&self) -> &[u8] {
        &self.inner.payload
    }

    /// A `delivery-count` above 0, `first-acquirer` false, or a copy idem rescheduled
    /// ([`delays`](Delivery::delays): a retry is a new message to the broker).
    fn redelivery(&self) -> idem_core::extract::Redelivery {
        let header = self.inner.message.header.as_ref();
        idem_core::extract::Redelivery::again_if(
            self.delays() > 0 || header.is_some_and(|h| h.delivery_count > 0 || !h.first_acquirer),
        )
    }

    fn message_id(&self) -> Option<&str> {
        self.inner.message_id.as_deref()
    }

    fn header(&self, name: &str) -> Option<&str> {
        let find = |n: &str| {
            self.inner
                .headers
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(n))
                .map(|(_, v)| v.as_str())
        };
        find(name).or_else(|| {
            // The CloudEvents AMQP binding prefixes attributes with `cloudEvents:` (or `_`).
            let attr = name.strip_prefix("ce-").or_else(|| name.strip_prefix("ce_"))?;
            find(&format!("cloudEvents:{attr}")).or_else(|| find(&format!("cloudEvents_{attr}")))
        })
    }

    fn correlation_id(&self) -> Option<&str> {
        self.inner.correlation_id.as_deref()
    }
}
