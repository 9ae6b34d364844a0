//! Dead letters as AMQP 0-9-1 messages: a republished letter's properties, the confirms,
//! a delivery's stable id and its letter.

use crate::topology::is_routing_header;
use idem_dlq::{DlqError, Letter, Republish};
use lapin::message::{BasicReturnMessage, Delivery};
use lapin::types::{AMQPValue, DecimalValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Confirmation};
use sha2::{Digest as _, Sha256};
use std::collections::HashMap;

use super::*;

/// The AMQP properties of a replay, or why it cannot be sent.
pub(super) fn properties(m: &Republish) -> Result<BasicProperties, DlqError> {
    let too_long = |what: &str, len: usize| DlqError::NotPublished {
        letter: m.letter.clone(),
        why: format!("its {what} is {len} bytes; AMQP allows 255"),
    };
    if m.destination.len() > SHORT_STRING {
        return Err(too_long("destination queue name", m.destination.len()));
    }
    // A short-string property, refused when it is longer than AMQP allows.
    let short = |what: &str, v: &Option<String>| match v {
        Some(v) if v.len() > SHORT_STRING => Err(too_long(what, v.len())),
        v => Ok(v.as_deref().map(ShortString::from)),
    };
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if let Some(id) = short("message id", &m.message_id)? {
        props = props.with_message_id(id);
    }
    if let Some(ct) = short("content type", &m.content_type)? {
        props = props.with_content_type(ct);
    }
    if let Some(ce) = short("content encoding", &m.content_encoding)? {
        props = props.with_content_encoding(ce);
    }
    if let Some(c) = short("correlation id", &m.correlation_id)? {
        props = props.with_correlation_id(c);
    }
    // AMQP's timestamp is whole seconds since 1970.
    if let Some(secs) = m.timestamp.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()) {
        props = props.with_timestamp(secs.as_secs());
    }
    let mut table = FieldTable::default();
    for (name, value) in m.headers.iter().filter(|(k, _)| !is_broker_header(k)) {
        if name.len() > SHORT_STRING {
            return Err(too_long("header name", name.len()));
        }
        table.insert(name.as_str().into(), AMQPValue::LongString(LongString::from(value.as_str())));
    }
    Ok(props.with_headers(table))
}

pub(super) fn is_broker_header(name: &str) -> bool {
    BROKER_HEADERS.iter().any(|h| name.starts_with(h)) || is_routing_header(name)
}

pub(super) fn failed(m: &Republish, e: lapin::Error) -> DlqError {
    DlqError::broker(format!("republishing {} to queue `{}`", m.letter, m.destination), e)
}

/// `Ok` when every message was acked and none returned; else the first failure, by letter.
pub(super) fn check_confirms(
    messages: &[Republish],
    confirmed: Vec<lapin::Result<Confirmation>>,
) -> Result<(), DlqError> {
    let mut returns: Vec<BasicReturnMessage> = Vec::new();
    let mut nacked = None;
    for (m, c) in messages.iter().zip(confirmed) {
        match c.map_err(|e| failed(m, e))? {
            Confirmation::Ack(r) => returns.extend(r),
            Confirmation::Nack(r) => {
                returns.extend(r);
                nacked.get_or_insert(m);
            }
            Confirmation::NotRequested => {
                return Err(DlqError::NotPublished {
                    letter: m.letter.clone(),
                    why: "publisher confirms are off on the channel".into(),
                });
            }
        }
    }
    // The broker returns an unroutable message before it acks it; lapin attaches the return
    // to a confirm of the batch, not necessarily its own: match it by routing key and id.
    if let Some(r) = returns.first() {
        let d = &r.delivery;
        let id = d.properties.message_id().as_ref().map(|s| s.as_str());
        let m = messages
            .iter()
            .find(|m| m.destination == d.routing_key.as_str() && m.message_id.as_deref() == id)
            .or_else(|| messages.iter().find(|m| m.destination == d.routing_key.as_str()));
        return Err(DlqError::NotPublished {
            letter: m.map_or_else(String::new, |m| m.letter.clone()),
            why: format!(
                "no queue `{}` took it: the broker returned it as unroutable ({} {})",
                d.routing_key, r.reply_code, r.reply_text
            ),
        });
    }
    if let Some(m) = nacked {
        return Err(DlqError::NotPublished {
            letter: m.letter.clone(),
            why: format!("the broker nacked it (queue `{}` did not store it)", m.destination),
        });
    }
    Ok(())
}

/// Numbers identical copies, in queue order, so every letter of a read has its own id.
#[derive(Default)]
pub(super) struct Ids(HashMap<String, u32>);

impl Ids {
    pub(super) fn next(&mut self, digest: String) -> String {
        let n = self.0.entry(digest.clone()).or_insert(0);
        *n += 1;
        if *n == 1 { digest } else { format!("{digest}.{n}") }
    }
}

/// 16 hex digits of SHA-256 over the message id, content type, headers and payload: what the
/// message is, not how it was delivered (the redelivered flag, a quorum queue's
/// `x-delivery-count`).
pub(super) fn digest(d: &Delivery) -> String {
    let p = &d.properties;
    let mut h = Sha256::new();
    h.update(b"idem-amqp dead letter\0");
    field(&mut h, p.message_id().as_ref().map(|s| s.as_str().as_bytes()));
    field(&mut h, p.content_type().as_ref().map(|s| s.as_str().as_bytes()));
    for (k, v) in p.headers().iter().flat_map(FieldTable::inner) {
        if k.as_str() == "x-delivery-count" {
            continue;
        }
        let mut value = Vec::new();
        canonical(v, &mut value);
        field(&mut h, Some(k.as_str().as_bytes()));
        field(&mut h, Some(&value));
    }
    field(&mut h, Some(&d.data));
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

/// An unambiguous byte encoding of a header value: its type, then its value.
pub(super) fn canonical(v: &AMQPValue, out: &mut Vec<u8>) {
    let len = |n: usize| u64::try_from(n).unwrap_or(u64::MAX).to_be_bytes();
    out.push(u8::try_from(u32::from(v.get_type().get_id())).unwrap_or(b'?'));
    match v {
        AMQPValue::Boolean(b) => out.push(u8::from(*b)),
        AMQPValue::ShortShortInt(n) => out.extend(n.to_be_bytes()),
        AMQPValue::ShortShortUInt(n) => out.extend(n.to_be_bytes()),
        AMQPValue::ShortInt(n) => out.extend(n.to_be_bytes()),
        AMQPValue::ShortUInt(n) => out.extend(n.to_be_bytes()),
        AMQPValue::LongInt(n) => out.extend(n.to_be_bytes()),
        AMQPValue::LongUInt(n) => out.extend(n.to_be_bytes()),
        AMQPValue::LongLongInt(n) => out.extend(n.to_be_bytes()),
        AMQPValue::Float(f) => out.extend(f.to_bits().to_be_bytes()),
        AMQPValue::Double(f) => out.extend(f.to_bits().to_be_bytes()),
        AMQPValue::DecimalValue(d) => {
            out.push(d.scale);
            out.extend(d.value.to_be_bytes());
        }
        AMQPValue::ShortString(s) => {
            out.extend(len(s.as_str().len()));
            out.extend(s.as_str().as_bytes());
        }
        AMQPValue::LongString(s) => {
            out.extend(len(s.len()));
            out.extend(s.as_bytes());
        }
        AMQPValue::ByteArray(b) => {
            out.extend(len(b.len()));
            out.extend(b.as_slice());
        }
        AMQPValue::Timestamp(t) => out.extend(t.to_be_bytes()),
        AMQPValue::FieldArray(a) => {
            out.extend(len(a.as_slice().len()));
            for v in a.as_slice() {
                canonical(v, out);
            }
        }
        AMQPValue::FieldTable(t) => {
            out.extend(len(t.inner().len()));
            for (k, v) in t.inner() {
                out.extend(len(k.as_str().len()));
                out.extend(k.as_str().as_bytes());
                canonical(v, out);
            }
        }
        AMQPValue::Void => {}
    }
}

pub(super) fn letter(id: String, d: &Delivery) -> Letter {
    let p = &d.properties;
    let mut l = Letter::new(id, d.data.clone());
    if let Some(mid) = p.message_id() {
        l = l.with_message_id(mid.as_str());
    }
    if let Some(ct) = p.content_type() {
        l = l.with_content_type(ct.as_str());
    }
    if let Some(ce) = p.content_encoding() {
        l = l.with_content_encoding(ce.as_str());
    }
    if let Some(c) = p.correlation_id() {
        l = l.with_correlation_id(c.as_str());
    }
    if let Some(secs) = p.timestamp() {
        l = l.with_timestamp(std::time::UNIX_EPOCH + std::time::Duration::from_secs(*secs));
    }
    for (k, v) in p.headers().iter().flat_map(FieldTable::inner) {
        let value = match (k.as_str(), v) {
            ("x-death", AMQPValue::FieldArray(deaths)) => x_death(deaths.as_slice()),
            _ => text(v),
        };
        l = l.with_header(k.as_str(), value);
    }
    l
}

/// A header value as text.
pub(super) fn text(v: &AMQPValue) -> String {
    match v {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::ShortShortInt(n) => n.to_string(),
        AMQPValue::ShortShortUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::Float(f) => f.to_string(),
        AMQPValue::Double(f) => f.to_string(),
        AMQPValue::DecimalValue(d) => decimal(d),
        AMQPValue::Timestamp(t) => t.to_string(),
        AMQPValue::ByteArray(b) => hex::encode(b.as_slice()),
        AMQPValue::Void => String::new(),
        AMQPValue::FieldArray(a) => {
            format!("[{}]", a.as_slice().iter().map(text).collect::<Vec<_>>().join(", "))
        }
        AMQPValue::FieldTable(t) => format!(
            "{{{}}}",
            t.inner()
                .iter()
                .map(|(k, v)| format!("{k}: {}", text(v)))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// `value × 10^-scale` in decimal notation.
pub(super) fn decimal(d: &DecimalValue) -> String {
    let digits = d.value.to_string();
    let scale = usize::from(d.scale);
    if scale == 0 {
        return digits;
    }
    let padded = format!("{digits:0>width$}", width = scale + 1);
    let (int, frac) = padded.split_at(padded.len() - scale);
    format!("{int}.{frac}")
}

/// RabbitMQ's `x-death` (one table per queue and reason) as `2× expired in queue q; …`.
pub(super) fn x_death(deaths: &[AMQPValue]) -> String {
    deaths
        .iter()
        .map(|d| match d {
            AMQPValue::FieldTable(t) => {
                let get = |k: &str| t.inner().get(k).map(text).unwrap_or_default();
                format!("{}× {} in queue {}", get("count"), get("reason"), get("queue"))
            }
            other => text(other),
        })
        .collect::<Vec<_>>()
        .join("; ")
}
