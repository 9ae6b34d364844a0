//! Dead letters as AMQP 1.0 messages: a republished letter's message, and a delivery's
//! stable id.

use crate::delivery::{Delivery, id_text};
use fe2o3_amqp::types::messaging::{
    ApplicationProperties, Body, Data, Header, Message, MessageId, Properties,
};
use fe2o3_amqp::types::primitives::{Binary, SimpleValue, Symbol, Value};
use idem_dlq::{DlqError, Republish};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;

use super::*;

pub(super) fn sent_failed(m: &Republish, e: &dyn std::fmt::Display) -> DlqError {
    DlqError::broker(format!("republishing {} to `{}`", m.letter, m.destination), e.to_string())
}

/// The AMQP message a replay sends: durable, its id, content type and encoding, correlation id
/// and creation time, its headers as string application properties (not the broker's own), its
/// payload as one `data` section.
pub(super) fn message(m: &Republish, service_bus: bool) -> Message<Body<Value>> {
    let mut app = ApplicationProperties::default();
    for (k, v) in &m.headers {
        if service_bus && SERVICE_BUS_PROPERTIES.iter().any(|p| p.eq_ignore_ascii_case(k)) {
            continue;
        }
        app.0.insert(k.clone(), SimpleValue::String(v.clone()));
    }
    Message {
        header: Some(Header { durable: true, ..Header::default() }),
        delivery_annotations: None,
        message_annotations: None,
        properties: Some(Properties {
            message_id: m.message_id.clone().map(MessageId::String),
            content_type: m.content_type.clone().map(Symbol::from),
            content_encoding: m.content_encoding.clone().map(Symbol::from),
            correlation_id: m.correlation_id.clone().map(MessageId::String),
            creation_time: m
                .timestamp
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .and_then(|d| i64::try_from(d.as_millis()).ok())
                .map(fe2o3_amqp::types::primitives::Timestamp::from_milliseconds),
            ..Properties::default()
        }),
        application_properties: Some(app),
        body: Body::Data(vec![Data(Binary::from(m.payload.clone()))].into()),
        footer: None,
    }
}

/// Numbers identical copies, in arrival order, so every letter of a read has its own id.
#[derive(Default)]
pub(super) struct Ids(HashMap<String, u32>);

impl Ids {
    pub(super) fn next(&mut self, digest: String) -> String {
        let n = self.0.entry(digest.clone()).or_insert(0);
        *n += 1;
        if *n == 1 { digest } else { format!("{digest}.{n}") }
    }
}

/// 16 hex digits of SHA-256 over the message id, content type, application properties (by
/// name) and body: what the message is, not how it was delivered (header, annotations, lock
/// token).
pub(super) fn digest(d: &Delivery) -> String {
    let m = d.message();
    let props = m.properties.as_ref();
    let mut h = Sha256::new();
    h.update(b"idem-amqp10 dead letter\0");
    let id = props.and_then(|p| p.message_id.as_ref()).map(|id| {
        let kind = match id {
            MessageId::String(_) => 's',
            MessageId::Ulong(_) => 'u',
            MessageId::Uuid(_) => 'g',
            MessageId::Binary(_) => 'b',
        };
        format!("{kind}:{}", id_text(id))
    });
    field(&mut h, id.as_deref().map(str::as_bytes));
    field(&mut h, props.and_then(|p| p.content_type.as_ref()).map(|c| c.0.as_bytes()));
    let mut app: Vec<(&String, &SimpleValue)> =
        m.application_properties.iter().flat_map(|a| a.0.iter()).collect();
    app.sort_by(|a, b| a.0.cmp(b.0));
    for (k, v) in app {
        field(&mut h, Some(k.as_bytes()));
        let encoded = serde_amqp::to_vec(v).unwrap_or_else(|_| format!("{v:?}").into_bytes());
        field(&mut h, Some(&encoded));
    }
    match &m.body {
        Body::Data(_) => field(&mut h, Some(d.payload())),
        // Bodies the payload does not show in full (sequences, maps) by their structure.
        other => field(&mut h, Some(format!("{other:?}").as_bytes())),
    }
    hex::encode(&h.finalize()[..8])
}

pub(super) fn field(h: &mut Sha256, bytes: Option<&[u8]>) {
    match bytes {
        None => h.update([0]),
        Some(b) => {
            h.update([1]);
            h.update(u64::try_from(b.len()).unwrap_or(u64::MAX).to_be_bytes());
            h.update(b);
        }
    }
}

/// An application property as text.
pub(super) fn text(v: &SimpleValue) -> String {
    match v {
        SimpleValue::Null => String::new(),
        SimpleValue::Bool(b) => b.to_string(),
        SimpleValue::Ubyte(n) => n.to_string(),
        SimpleValue::Ushort(n) => n.to_string(),
        SimpleValue::Uint(n) => n.to_string(),
        SimpleValue::Ulong(n) => n.to_string(),
        SimpleValue::Byte(n) => n.to_string(),
        SimpleValue::Short(n) => n.to_string(),
        SimpleValue::Int(n) => n.to_string(),
        SimpleValue::Long(n) => n.to_string(),
        SimpleValue::Float(f) => f.to_string(),
        SimpleValue::Double(f) => f.to_string(),
        SimpleValue::Char(c) => c.to_string(),
        SimpleValue::Timestamp(t) => t.milliseconds().to_string(),
        SimpleValue::Uuid(u) => uuid::Uuid::from_bytes(*u.as_inner()).hyphenated().to_string(),
        SimpleValue::Binary(b) => hex::encode(b.as_ref()),
        SimpleValue::String(s) => s.clone(),
        SimpleValue::Symbol(s) => s.0.clone(),
        other => format!("{other:?}"),
    }
}
