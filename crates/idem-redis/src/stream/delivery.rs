//! A stream entry as a delivery: an idem [`Envelope`].

use std::sync::Arc;

use idem_core::extract::Envelope;
use redis::Value;

/// Which entry fields play which part.
#[derive(Debug)]
pub(crate) struct Fields {
    pub(crate) payload: String,
    pub(crate) id: String,
}

/// One entry read from a stream: its id and fields. Cheap to clone (shared), so each handler
/// gets its own copy.
///
/// As an [`Envelope`]: the payload is the field named by
/// [`payload_field`](crate::StreamConfig::payload_field) (default `payload`), the message id the
/// field named by [`id_field`](crate::StreamConfig::id_field) (default `message_id`), and every
/// field is a header. So the consumer's key extractor chooses the key: the default reads the id
/// field; `Header::new("order_id")` another field; `JsonPointer::new("/order/id")` a value
/// inside the payload.
///
/// ```
/// use idem_core::extract::Envelope;
/// use idem_redis::Delivery;
///
/// let e = Delivery::new("1-0", vec![("message_id".into(), b"o-1".to_vec()),
///                                      ("payload".into(), b"{}".to_vec())]);
/// assert_eq!(e.message_id(), Some("o-1"));
/// assert_eq!(e.payload(), b"{}");
/// assert_eq!(e.header("MESSAGE_ID"), Some("o-1"));
/// assert_eq!(e.delivered(), 1);
/// ```
#[derive(Debug, Clone)]
pub struct Delivery {
    inner: Arc<Inner>,
    delivered: u64,
}

#[derive(Debug)]
struct Inner {
    id: String,
    fields: Vec<(String, Vec<u8>)>,
    roles: Arc<Fields>,
}

impl Delivery {
    /// An entry with the default field roles (`payload`, `message_id`).
    pub fn new(id: impl Into<String>, fields: Vec<(String, Vec<u8>)>) -> Self {
        let roles = Arc::new(Fields { payload: "payload".into(), id: "message_id".into() });
        Self { inner: Arc::new(Inner { id: id.into(), fields, roles }), delivered: 1 }
    }

    pub(crate) fn from_reply(
        id: String,
        map: std::collections::HashMap<String, Value>,
        roles: &Arc<Fields>,
        delivered: u64,
    ) -> Self {
        let mut fields: Vec<(String, Vec<u8>)> = map
            .into_iter()
            .map(|(k, v)| {
                let bytes = match v {
                    Value::BulkString(b) => b,
                    Value::SimpleString(s) => s.into_bytes(),
                    Value::Int(n) => n.to_string().into_bytes(),
                    _ => Vec::new(),
                };
                (k, bytes)
            })
            .collect();
        fields.sort_by(|a, b| a.0.cmp(&b.0));
        Self { inner: Arc::new(Inner { id, fields, roles: Arc::clone(roles) }), delivered }
    }

    /// The entry id (`<ms>-<seq>`): a delivery position, never a dedup key.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// All fields, sorted by name (a reply does not keep the order they were added in).
    pub fn fields(&self) -> &[(String, Vec<u8>)] {
        &self.inner.fields
    }

    /// A field's raw value.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.inner
            .fields
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// How many times the group has delivered it, this time included: 1 for a new entry, the
    /// pending list's count for one taken over with `XAUTOCLAIM` (a retry, or an entry whose
    /// consumer died). Never part of the dedup key.
    pub fn delivered(&self) -> u64 {
        self.delivered
    }
}

impl Envelope for Delivery {
    fn payload(&self) -> &[u8] {
        self.field(&self.inner.roles.payload).unwrap_or_default()
    }

    fn redelivery(&self) -> idem_core::extract::Redelivery {
        idem_core::extract::Redelivery::again_if(self.delivered > 1)
    }

    fn message_id(&self) -> Option<&str> {
        self.header(&self.inner.roles.id)
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.field(name).and_then(|v| std::str::from_utf8(v).ok())
    }
}
