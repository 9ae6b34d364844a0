//! Dead letters read back from a RabbitMQ queue, for `idem dlq` and the console: the
//! [`DeadLetterQueue`] of [`idem_dlq`].

use std::collections::HashSet;

use futures_util::future::{BoxFuture, join_all};
use idem_dlq::{DeadLetterQueue, DlqError, Letter, MAX_LETTERS, Republish};
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, PublisherConfirm};
use tokio::sync::Mutex;

use crate::Topology;

/// AMQP short strings (queue names, routing keys, header names, properties) hold at most 255
/// bytes.
const SHORT_STRING: usize = 255;

/// Headers RabbitMQ sets itself: shown in a [`Letter`], never sent again by a replay (the
/// broker keeps `x-death` as a table, which a replay would turn into text).
const BROKER_HEADERS: [&str; 4] =
    ["x-death", "x-first-death-", "x-last-death-", "x-delivery-count"];

/// The dead letters of a RabbitMQ queue — by default `<queue>.idem.dlq`, where
/// [`AmqpConsumer`](crate::AmqpConsumer) puts them ([`Topology`]) — read, replayed and removed
/// by the rules of [`Workbench`](idem_dlq::Workbench).
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
/// use idem_dlq::{OnConflict, Workbench};
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

mod convert;
use convert::*;

#[cfg(test)]
mod tests;
