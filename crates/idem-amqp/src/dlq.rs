//! Dead letters read back from a RabbitMQ queue, for `idem dlq` and the console: the
//! [`DeadLetterQueue`] of [`idem_core::dlq`].

use std::collections::{HashMap, HashSet};

use futures_util::future::{BoxFuture, join_all};
use idem_core::dlq::{DeadLetterQueue, DlqError, Letter, MAX_LETTERS, Republish};
use lapin::message::{BasicReturnMessage, Delivery};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, DecimalValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};
use sha2::{Digest as _, Sha256};
use tokio::sync::Mutex;

use crate::Topology;
use crate::topology::is_routing_header;

/// AMQP short strings (queue names, routing keys, header names, properties) hold at most 255
/// bytes.
const SHORT_STRING: usize = 255;

/// Headers RabbitMQ sets itself: shown in a [`Letter`], never sent again by a replay (the
/// broker keeps `x-death` as a table, which a replay would turn into text).
const BROKER_HEADERS: [&str; 4] =
    ["x-death", "x-first-death-", "x-last-death-", "x-delivery-count"];

/// The dead letters of a RabbitMQ queue — by default `<queue>.idem.dlq`, where
/// [`AmqpConsumer`](crate::AmqpConsumer) puts them ([`Topology`]) — read, replayed and removed
/// by the rules of [`Workbench`](idem_core::dlq::Workbench).
///
/// A queue has no read that leaves its messages in place, so:
/// - **read** takes up to `limit` messages with `basic.get` on a channel of its own, without
///   acking them, and puts them all back (`basic.nack` with requeue) before it returns. A
///   classic queue puts a requeued message back at its original place, so two reads see the
///   same letters in the same order. A consumer of the dead-letter queue, or a second reader,
///   does not see them meanwhile, and they come back flagged `redelivered`.
/// - a letter's **id** is a digest of its message id, content type, headers and payload (16 hex
///   digits of SHA-256), so it stays the same from one read to the next; identical copies (a
///   dead letter copied twice) are numbered `<digest>.2`, `<digest>.3` in queue order.
/// - **remove** takes the messages again from the head of the queue, acks those whose id it is
///   given and puts the others back.
/// - **republish** publishes to the default exchange with the destination as routing key (the
///   queue the letter was consumed from), `mandatory`, persistent, with publisher confirms: a
///   message the broker nacks, or returns because no queue has that name, fails the call with
///   [`DlqError::NotPublished`] naming the queue.
///
/// Headers are read as text: strings as they are, numbers and booleans in decimal, byte arrays
/// in hex, tables and arrays as `{k: v}` and `[a, b]`; RabbitMQ's `x-death` is summarised
/// (`2× expired in queue orders.idem.delay`). A replay sends the message id, the content type
/// and encoding, the correlation id, the original timestamp, the headers as strings and the
/// payload; RabbitMQ's own headers (`x-death`, `x-first-death-*`, `x-last-death-*`,
/// `x-delivery-count`) and the producer's routing headers (`CC`, `BCC`: the replay goes to its
/// destination only) are not sent again, nor are the rarer AMQP properties (type, user id, app
/// id, priority, expiration, reply-to).
///
/// On a quorum queue every read counts a delivery of each message it takes (its
/// `x-delivery-count` grows, and with a `delivery-limit` the broker drops or dead-letters a
/// message read that many times); the queue idem declares is a classic queue.
///
/// ```no_run
/// use idem_amqp::AmqpDeadLetters;
/// use idem_core::dlq::{OnConflict, Workbench};
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let conn = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
/// let bench = Workbench::new(AmqpDeadLetters::for_source(&conn, "orders").await?);
/// let letters = bench.list(100).await?;
/// let report = bench.replay(&letters, OnConflict::Refuse).await?;
/// println!("{report}");
/// # Ok(()) }
/// ```
pub struct AmqpDeadLetters {
    queue: String,
    /// One read or remove at a time: `basic.nack` of everything unacked puts back what this
    /// channel holds, which must be one operation's messages only.
    reader: Mutex<Reader>,
    /// One republish at a time, so that a message the broker returns is matched within its
    /// own batch (lapin attaches it to whichever confirm completes next).
    publisher: Mutex<Publisher>,
}

struct Reader {
    channel: Channel,
    /// Messages may still be taken: an operation was dropped before it put them back.
    holding: bool,
}

struct Publisher {
    channel: Channel,
    /// Confirms may still be pending: a republish was dropped before they all came.
    pending: bool,
}

impl std::fmt::Debug for AmqpDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpDeadLetters").field("queue", &self.queue).finish_non_exhaustive()
    }
}

impl AmqpDeadLetters {
    /// The dead letters in `queue`, read and removed on a channel of `conn` and republished
    /// on another (with publisher confirms). The channels keep the connection open.
    ///
    /// # Errors
    /// [`DlqError::Broker`] when the queue does not exist (naming it) or a channel cannot be
    /// opened.
    ///
    /// # Cancel safety
    /// Cancel safe: it only opens channels, which close when dropped.
    pub async fn new(conn: &Connection, queue: impl Into<String>) -> Result<Self, DlqError> {
        let queue = queue.into();
        if queue.is_empty() || queue.len() > SHORT_STRING {
            return Err(DlqError::broker(
                format!("the dead-letter queue `{queue}`"),
                "a queue name is 1 to 255 bytes",
            ));
        }
        let reader = conn
            .create_channel()
            .await
            .map_err(|e| DlqError::broker("opening a channel to read dead letters", e))?;
        declare_passive(&reader, &queue).await?;
        let publisher = conn
            .create_channel()
            .await
            .map_err(|e| DlqError::broker("opening a channel to republish dead letters", e))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| DlqError::broker("turning publisher confirms on", e))?;
        Ok(Self {
            queue,
            reader: Mutex::new(Reader { channel: reader, holding: false }),
            publisher: Mutex::new(Publisher { channel: publisher, pending: false }),
        })
    }

    /// The dead letters of consumers of `queue` with idem's default [`Topology`]:
    /// `<queue>.idem.dlq`.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub async fn for_source(conn: &Connection, queue: &str) -> Result<Self, DlqError> {
        let topology = Topology::for_queue(queue);
        let dlq = match topology.dead_letter_queue() {
            Some(q) => q.to_owned(),
            None => format!("{queue}.idem.dlq"),
        };
        Self::new(conn, dlq).await
    }

    /// The dead-letter queue's name.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// Takes up to `limit` messages from the head of the queue, unacked.
    async fn take(&self, reader: &mut Reader, limit: usize) -> Result<Vec<Delivery>, DlqError> {
        if reader.holding {
            put_back(reader, &self.queue).await?;
        }
        reader.holding = true;
        let mut out = Vec::new();
        while out.len() < limit {
            let got = reader
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: false })
                .await
                .map_err(|e| DlqError::broker(format!("reading queue `{}`", self.queue), e))?;
            let Some(m) = got else { break };
            out.push(m.delivery);
            if m.message_count == 0 {
                break;
            }
        }
        Ok(out)
    }
}

async fn declare_passive(ch: &Channel, queue: &str) -> Result<u32, DlqError> {
    let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    ch.queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .map(|q| q.message_count())
        .map_err(|e| {
            DlqError::broker(format!("the dead-letter queue `{queue}` (does it exist?)"), e)
        })
}

/// Requeues everything the reader holds, and waits until the queue has it back: the passive
/// declare that follows on the same channel is answered after the queue took the requeue.
async fn put_back(reader: &mut Reader, queue: &str) -> Result<(), DlqError> {
    reader
        .channel
        .basic_nack(0, BasicNackOptions { multiple: true, requeue: true })
        .await
        .map_err(|e| DlqError::broker(format!("putting messages back into queue `{queue}`"), e))?;
    declare_passive(&reader.channel, queue).await?;
    reader.holding = false;
    Ok(())
}

impl DeadLetterQueue for AmqpDeadLetters {
    fn describe(&self) -> String {
        format!("rabbitmq queue {}", self.queue)
    }

    /// # Cancel safety
    /// Dropped midway, the messages taken stay unacked on the reader channel until the next
    /// operation puts them back (or the channel closes with the value).
    fn read(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Letter>, DlqError>> {
        Box::pin(async move {
            let mut reader = self.reader.lock().await;
            let taken = self.take(&mut reader, limit.min(MAX_LETTERS)).await;
            // Put back even after a failed take: what it did take is held.
            let back = put_back(&mut reader, &self.queue).await;
            let taken = taken?;
            back?;
            let mut ids = Ids::default();
            Ok(taken.iter().map(|d| letter(ids.next(digest(d)), d)).collect())
        })
    }

    fn republish<'a>(&'a self, messages: &'a [Republish]) -> BoxFuture<'a, Result<(), DlqError>> {
        Box::pin(async move {
            let mut props = Vec::with_capacity(messages.len());
            for m in messages {
                props.push(properties(m)?);
            }
            let mut publisher = self.publisher.lock().await;
            if publisher.pending {
                // What they give back belongs to the abandoned call, which did not succeed.
                let _ = publisher.channel.wait_for_confirms().await;
            }
            publisher.pending = true;
            // Published one after another (in the letters' order), confirmed together.
            let mut confirms: Vec<PublisherConfirm> = Vec::with_capacity(messages.len());
            for (m, props) in messages.iter().zip(props) {
                let confirm = publisher
                    .channel
                    .basic_publish(
                        "".into(),
                        m.destination.as_str().into(),
                        BasicPublishOptions { mandatory: true, immediate: false },
                        &m.payload,
                        props,
                    )
                    .await
                    .map_err(|e| failed(m, e))?;
                confirms.push(confirm);
            }
            let confirmed = join_all(confirms).await;
            publisher.pending = false;
            check_confirms(messages, confirmed)
        })
    }

    /// # Cancel safety
    /// As [`read`](Self::read): dropped midway, what was taken is put back by the next
    /// operation; an ack already sent stays sent.
    fn remove<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<u64, DlqError>> {
        Box::pin(async move {
            if ids.is_empty() {
                return Ok(0);
            }
            let wanted: HashSet<&str> = ids.iter().map(String::as_str).collect();
            let mut reader = self.reader.lock().await;
            let acked = self.ack_matching(&mut reader, &wanted).await;
            let back = put_back(&mut reader, &self.queue).await;
            let acked = acked?;
            back?;
            Ok(acked)
        })
    }
}

impl AmqpDeadLetters {
    /// Takes messages from the head (up to [`MAX_LETTERS`], as far as a read reaches) until
    /// every id in `wanted` is found, acking those; the rest stay taken for `put_back`.
    async fn ack_matching(
        &self,
        reader: &mut Reader,
        wanted: &HashSet<&str>,
    ) -> Result<u64, DlqError> {
        if reader.holding {
            put_back(reader, &self.queue).await?;
        }
        reader.holding = true;
        let mut ids = Ids::default();
        let mut acked = 0u64;
        let mut found = HashSet::new();
        for _ in 0..MAX_LETTERS {
            let got = reader
                .channel
                .basic_get(self.queue.as_str().into(), BasicGetOptions { no_ack: false })
                .await
                .map_err(|e| DlqError::broker(format!("reading queue `{}`", self.queue), e))?;
            let Some(m) = got else { break };
            let id = ids.next(digest(&m.delivery));
            if wanted.contains(id.as_str()) && found.insert(id) {
                reader
                    .channel
                    .basic_ack(m.delivery.delivery_tag, BasicAckOptions { multiple: false })
                    .await
                    .map_err(|e| {
                        DlqError::broker(format!("removing a dead letter from `{}`", self.queue), e)
                    })?;
                acked += 1;
            }
            if m.message_count == 0 || found.len() == wanted.len() {
                break;
            }
        }
        Ok(acked)
    }
}

/// The AMQP properties of a replay, or why it cannot be sent.
fn properties(m: &Republish) -> Result<BasicProperties, DlqError> {
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

fn is_broker_header(name: &str) -> bool {
    BROKER_HEADERS.iter().any(|h| name.starts_with(h)) || is_routing_header(name)
}

fn failed(m: &Republish, e: lapin::Error) -> DlqError {
    DlqError::broker(format!("republishing {} to queue `{}`", m.letter, m.destination), e)
}

/// `Ok` when every message was acked and none returned; else the first failure, by letter.
fn check_confirms(
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
struct Ids(HashMap<String, u32>);

impl Ids {
    fn next(&mut self, digest: String) -> String {
        let n = self.0.entry(digest.clone()).or_insert(0);
        *n += 1;
        if *n == 1 { digest } else { format!("{digest}.{n}") }
    }
}

/// 16 hex digits of SHA-256 over the message id, content type, headers and payload: what the
/// message is, not how it was delivered (the redelivered flag, a quorum queue's
/// `x-delivery-count`).
fn digest(d: &Delivery) -> String {
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

fn field(h: &mut Sha256, bytes: Option<&[u8]>) {
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
fn canonical(v: &AMQPValue, out: &mut Vec<u8>) {
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

fn letter(id: String, d: &Delivery) -> Letter {
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
fn text(v: &AMQPValue) -> String {
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
fn decimal(d: &DecimalValue) -> String {
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
fn x_death(deaths: &[AMQPValue]) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::FieldArray;

    fn delivery(redelivered: bool, headers: FieldTable) -> Delivery {
        let mut d = Delivery::mock(7, "".into(), "q".into(), redelivered, b"{}".to_vec());
        d.properties = BasicProperties::default()
            .with_message_id("m-1".into())
            .with_content_type("application/json".into())
            .with_headers(headers);
        d
    }

    fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
        let mut t = FieldTable::default();
        for (k, v) in pairs {
            t.insert(ShortString::from(*k), v.clone());
        }
        t
    }

    #[test]
    fn the_id_is_the_content_not_the_delivery() {
        let s = |v: &str| AMQPValue::LongString(LongString::from(v));
        let first = delivery(false, table(&[("idem-reason", s("no"))]));
        let again = delivery(
            true,
            table(&[("idem-reason", s("no")), ("x-delivery-count", AMQPValue::LongLongInt(3))]),
        );
        assert_eq!(digest(&first), digest(&again));
        assert_eq!(digest(&first).len(), 16);
        let other = delivery(false, table(&[("idem-reason", s("yes"))]));
        assert_ne!(digest(&first), digest(&other));
        // A number is not the same header as the string of its digits.
        let n = delivery(false, table(&[("n", AMQPValue::LongInt(5))]));
        let t = delivery(false, table(&[("n", s("5"))]));
        assert_ne!(digest(&n), digest(&t));
    }

    #[test]
    fn identical_copies_get_ids_of_their_own() {
        let mut ids = Ids::default();
        assert_eq!(ids.next("ab".into()), "ab");
        assert_eq!(ids.next("cd".into()), "cd");
        assert_eq!(ids.next("ab".into()), "ab.2");
    }

    #[test]
    fn headers_read_as_text() {
        let death = table(&[
            ("count", AMQPValue::LongLongInt(2)),
            ("reason", AMQPValue::LongString("expired".into())),
            ("queue", AMQPValue::LongString("q.idem.delay".into())),
        ]);
        let d = delivery(
            false,
            table(&[
                (
                    "x-death",
                    AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
                ),
                ("n", AMQPValue::LongInt(-5)),
                ("ok", AMQPValue::Boolean(true)),
                ("price", AMQPValue::DecimalValue(DecimalValue { scale: 3, value: 25 })),
                ("raw", AMQPValue::ByteArray(vec![0xca, 0xfe].into())),
                ("t", AMQPValue::FieldTable(table(&[("a", AMQPValue::Void)]))),
            ]),
        );
        let l = letter("x".into(), &d);
        assert_eq!(l.header("x-death"), Some("2× expired in queue q.idem.delay"));
        assert_eq!(l.header("n"), Some("-5"));
        assert_eq!(l.header("ok"), Some("true"));
        assert_eq!(l.header("price"), Some("0.025"));
        assert_eq!(l.header("raw"), Some("cafe"));
        assert_eq!(l.header("t"), Some("{a: }"));
        assert_eq!(l.message_id.as_deref(), Some("m-1"));
        assert_eq!(l.content_type.as_deref(), Some("application/json"));
    }

    #[test]
    fn a_replay_leaves_the_brokers_headers_to_the_broker() {
        let mut r = sample();
        r.headers = vec![
            ("traceparent".into(), "00-1".into()),
            ("x-death".into(), "1× expired in queue q".into()),
            ("x-first-death-queue".into(), "q".into()),
            ("CC".into(), "[audit]".into()),
            ("BCC".into(), "[secret]".into()),
        ];
        let props = properties(&r).expect("properties");
        let h = props.headers().clone().unwrap_or_default();
        let names: Vec<&str> = h.inner().keys().map(ShortString::as_str).collect();
        assert_eq!(names, ["traceparent"]);
        assert_eq!(props.delivery_mode(), &Some(2));
        r.destination = "q".repeat(256);
        assert!(
            matches!(properties(&r), Err(DlqError::NotPublished { why, .. }) if why.contains("256 bytes"))
        );
    }

    fn sample() -> Republish {
        use idem_core::dlq::{MemoryDeadLetters, OnConflict, Workbench};
        // The workbench builds a Republish; take one from the in-memory queue.
        let q = MemoryDeadLetters::new();
        q.push(
            Letter::new("1", b"{}".to_vec())
                .with_message_id("m-1")
                .with_header("idem-outcome", "failed_permanent")
                .with_header("idem-source", "orders"),
        );
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        rt.block_on(async {
            let bench = Workbench::new(q.clone());
            let ls = bench.list(10).await.expect("list");
            bench.replay(&ls, OnConflict::Refuse).await.expect("replay");
        });
        q.published().remove(0)
    }
}
