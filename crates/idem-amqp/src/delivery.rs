//! A delivery as handlers and key extractors see it.

use std::sync::Arc;

use idem_core::extract::Envelope;
use lapin::BasicProperties;
use lapin::message::Delivery as LapinDelivery;
use lapin::types::AMQPValue;

/// One RabbitMQ delivery: body, properties and headers. Cheap to clone (shared).
///
/// Implements [`Envelope`], so every key extractor of `idem_core::extract` reads it: the AMQP
/// `message_id` property is [`Envelope::message_id`], string-like headers are
/// [`Envelope::header`], and the `correlation_id` property is the correlation id.
#[derive(Clone)]
pub struct Delivery {
    inner: Arc<LapinDelivery>,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("delivery_tag", &self.inner.delivery_tag)
            .field("message_id", &self.message_id())
            .field("redelivered", &self.inner.redelivered)
            .field("bytes", &self.inner.data.len())
            .finish_non_exhaustive()
    }
}

impl Delivery {
    pub(crate) fn new(delivery: LapinDelivery) -> Self {
        Self { inner: Arc::new(delivery) }
    }

    pub(crate) fn lapin(&self) -> &LapinDelivery {
        &self.inner
    }

    /// The body.
    pub fn payload(&self) -> &[u8] {
        &self.inner.data
    }

    /// The AMQP properties (message id, headers, content type…).
    pub fn properties(&self) -> &BasicProperties {
        &self.inner.properties
    }

    /// The routing key it was published with.
    pub fn routing_key(&self) -> &str {
        self.inner.routing_key.as_str()
    }

    /// Whether the broker flags this as a redelivery (an earlier delivery was not acked).
    /// Informational only: dedup never depends on it.
    pub fn redelivered(&self) -> bool {
        self.inner.redelivered
    }

    /// How many times this adapter has sent the message through its delay queue (header
    /// `idem-delays`).
    pub fn delays(&self) -> u32 {
        match header_value(&self.inner.properties, crate::topology::DELAYS_HEADER) {
            Some(AMQPValue::LongUInt(n)) => *n,
            Some(AMQPValue::LongLongInt(n)) => u32::try_from(*n).unwrap_or(u32::MAX),
            Some(AMQPValue::LongInt(n)) => u32::try_from(*n).unwrap_or(0),
            _ => 0,
        }
    }
}

fn header_value<'a>(props: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    props
        .headers()
        .as_ref()?
        .inner()
        .iter()
        .find(|(k, _)| k.as_str().eq_ignore_ascii_case(name))
        .map(|(_, v)| v)
}

impl Envelope for Delivery {
    fn payload(&self) -> &[u8] {
        &self.inner.data
    }

    /// The broker's `redelivered`, or a copy sent back through the delay queue (a retry is a
    /// new message to the broker).
    fn redelivery(&self) -> idem_core::extract::Redelivery {
        idem_core::extract::Redelivery::again_if(self.inner.redelivered || self.delays() > 0)
    }

    fn message_id(&self) -> Option<&str> {
        self.inner.properties.message_id().as_ref().map(|s| s.as_str())
    }

    /// String headers (`S` long strings that are UTF-8, and short strings). Numeric and
    /// binary headers are not keys.
    fn header(&self, name: &str) -> Option<&str> {
        match header_value(&self.inner.properties, name)? {
            AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok(),
            AMQPValue::ShortString(s) => Some(s.as_str()),
            _ => None,
        }
    }

    fn correlation_id(&self) -> Option<&str> {
        self.inner
            .properties
            .correlation_id()
            .as_ref()
            .map(|s| s.as_str())
            .or_else(|| self.header("correlation-id"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::extract::{Header, KeyExtractor, MessageId};
    use lapin::types::{FieldTable, LongString};

    fn msg(props: BasicProperties) -> Delivery {
        let mut d = LapinDelivery::mock(1, "".into(), "q".into(), false, b"{}".to_vec());
        d.properties = props;
        Delivery::new(d)
    }

    #[test]
    fn reads_message_id_and_string_headers() {
        let mut h = FieldTable::default();
        h.insert("Idempotency-Key".into(), AMQPValue::LongString(LongString::from("k-1")));
        h.insert("n".into(), AMQPValue::LongInt(5));
        h.insert("idem-delays".into(), AMQPValue::LongUInt(2));
        let m = msg(BasicProperties::default()
            .with_message_id("m-1".into())
            .with_correlation_id("c-1".into())
            .with_headers(h));
        assert_eq!(MessageId.extract(&m).unwrap(), "m-1");
        assert_eq!(Header::new("idempotency-key").extract(&m).unwrap(), "k-1");
        assert!(Header::new("n").extract(&m).unwrap_err().is_missing());
        assert_eq!(m.correlation_id(), Some("c-1"));
        assert_eq!(m.delays(), 2);
        assert!(MessageId.extract(&msg(BasicProperties::default())).unwrap_err().is_missing());
    }
}
