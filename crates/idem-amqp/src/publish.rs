//! Publishing outbox messages to RabbitMQ under publisher confirms: the outbox relay's broker.

use std::sync::Arc;

use futures_util::future::join_all;
use idem_core::outbox::{OutboxMessage, PublishError, Publisher};
use lapin::message::BasicReturnMessage;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation};

use crate::Error;

/// AMQP short strings (exchange names, header names, properties) hold at most 255 bytes; a
/// longer one would corrupt the frame and close the connection.
const SHORT_STRING: usize = 255;

/// Why RabbitMQ, or the publisher before it, did not take a message: the source of a
/// [`PublishError`]. A failing connection or channel is a [`lapin::Error`] instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// Published `mandatory` and routed to no queue: the broker returned it (retryable: the
    /// queue or binding may be created).
    #[error("unroutable: the broker returned it ({code} {text})")]
    Returned {
        /// The reply code (312 `NO_ROUTE`).
        code: u16,
        /// The broker's text.
        text: String,
    },
    /// The broker nacked it: it could not store it (retryable).
    #[error("the broker nacked it")]
    Nacked,
    /// The channel did not confirm it: publisher confirms are off (retryable, but it will not
    /// change: build the publisher with [`AmqpPublisher::new`], which turns them on).
    #[error("publisher confirms are off on this channel")]
    Unconfirmed,
    /// A name longer than AMQP allows (not retryable).
    #[error("the {what} is {len} bytes; AMQP allows 255")]
    TooLong {
        /// `"exchange name"` or `"header name"`.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
    },
}

/// Publishes outbox messages to RabbitMQ, each confirmed by the broker: the
/// [`Publisher`] an outbox [`Relay`](idem_core::outbox::Relay) needs.
///
/// Each message goes to the [`exchange`](Self::exchange) (default: the default exchange, so
/// the destination is the queue name) with the destination as routing key, `mandatory`,
/// persistent (delivery mode 2) unless told otherwise, its id as the `message_id` property —
/// where [`AmqpConsumer`](crate::AmqpConsumer)'s default key extractor reads it — and its
/// headers as long strings (a `content-type` header also sets the `content_type` property).
///
/// A batch is published at once and its confirms awaited together. A message counts as
/// published only when the broker acked it *and* did not return it: an unroutable message
/// ([`Refused::Returned`]), a nack, or a channel failure is a retryable failure. Header names
/// and an exchange name longer than 255 bytes are refused without publishing (not retryable).
///
/// Give it a channel of its own and publish on that channel through it only: lapin attaches a
/// returned message to whichever confirm of the channel completes next, so the publisher matches
/// returns to messages by id and routing key, and runs one batch at a time per channel (clones
/// share the channel and take turns). For batches in parallel, build several publishers on
/// several channels. A batch dropped before its confirms came (the relay's publish timeout)
/// makes the next one wait for them first, so that they cannot take its returns.
///
/// The exchange must exist: RabbitMQ closes a channel that publishes to a missing exchange,
/// after which every publish fails (retryable) until the publisher is rebuilt on a new channel;
/// [`is_open`](Self::is_open) tells.
///
/// ```no_run
/// use idem_amqp::AmqpPublisher;
/// use idem_core::outbox::{MemoryOutbox, OutboxStore, Outgoing, Relay};
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let conn = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
/// let publisher = AmqpPublisher::new(conn.create_channel().await?).await?; // routing key = queue
/// let outbox = MemoryOutbox::new(); // or an idem-sqlx outbox, filled in your transactions
/// outbox.send(vec![Outgoing::new("orders", r#"{"order":"o-1"}"#)]).await?;
/// let report = Relay::builder(outbox, publisher).build()?.run_until_empty().await?;
/// assert_eq!(report.published, 1);
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[must_use]
pub struct AmqpPublisher {
    channel: Channel,
    exchange: String,
    persistent: bool,
    /// One batch at a time on the channel, so that every message the broker returns is
    /// attached to a confirm of its own batch (lapin hands it to the next confirm completed).
    /// Holds whether the last batch ran to its end: one dropped mid-way (the relay's publish
    /// timeout) leaves confirms pending, which must complete before the next batch's returns.
    turn: Arc<tokio::sync::Mutex<bool>>,
}

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("channel", &self.channel.id())
            .field("exchange", &self.exchange)
            .field("persistent", &self.persistent)
            .finish_non_exhaustive()
    }
}

impl AmqpPublisher {
    /// A publisher on `channel` (a channel of its own), with publisher confirms turned on,
    /// to the default exchange, persistent.
    ///
    /// # Errors
    /// [`Error::Setup`] when `confirm.select` fails (the channel is closed, or in transaction
    /// mode).
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is published. The channel is moved in, so a cancelled call drops
    /// this handle to it; whether `confirm.select` reached the broker is unknown, so give the
    /// next attempt a new channel.
    pub async fn new(channel: Channel) -> Result<Self, Error> {
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|source| Error::Setup { what: "confirm.select", source })?;
        Ok(Self {
            channel,
            exchange: String::new(),
            persistent: true,
            turn: Arc::new(tokio::sync::Mutex::new(true)),
        })
    }

    /// Publishes to `exchange` (which must exist), the destination being the routing key.
    ///
    /// ```no_run
    /// # async fn f(channel: lapin::Channel) -> Result<(), idem_amqp::Error> {
    /// let publisher = idem_amqp::AmqpPublisher::new(channel).await?.exchange("events");
    /// # Ok(()) }
    /// ```
    pub fn exchange(mut self, exchange: impl Into<String>) -> Self {
        self.exchange = exchange.into();
        self
    }

    /// Whether messages are published persistent (delivery mode 2; the default) — stored on
    /// disk by a durable queue before the broker confirms them — or transient (faster, lost
    /// when the broker restarts).
    pub fn persistent(mut self, persistent: bool) -> Self {
        self.persistent = persistent;
        self
    }

    /// Whether the channel is still open; once closed (connection lost, a missing exchange),
    /// every publish fails until the publisher is rebuilt on a new channel.
    pub fn is_open(&self) -> bool {
        self.channel.status().connected()
    }

    fn properties(&self, m: &OutboxMessage) -> Result<BasicProperties, Refused> {
        let mut props = BasicProperties::default().with_message_id(m.id().as_str().into());
        if self.persistent {
            props = props.with_delivery_mode(2);
        }
        if !m.headers().is_empty() {
            let mut table = FieldTable::default();
            for (name, value) in m.headers() {
                if name.len() > SHORT_STRING {
                    return Err(Refused::TooLong { what: "header name", len: name.len() });
                }
                if name.eq_ignore_ascii_case("content-type") && value.len() <= SHORT_STRING {
                    props = props.with_content_type(value.as_str().into());
                }
                table.insert(
                    name.as_str().into(),
                    AMQPValue::LongString(LongString::from(value.as_str())),
                );
            }
            props = props.with_headers(table);
        }
        Ok(props)
    }

    /// Publishes one message and waits for its confirm.
    async fn one(&self, m: &OutboxMessage) -> Sent {
        let props = match self.properties(m) {
            Ok(p) => p,
            Err(r) => return Sent::Refused(r),
        };
        let options = BasicPublishOptions { mandatory: true, immediate: false };
        let sent = self
            .channel
            .basic_publish(
                self.exchange.as_str().into(),
                m.destination().into(),
                options,
                m.payload(),
                props,
            )
            .await;
        let confirmed = match sent {
            Ok(confirm) => confirm.await,
            Err(e) => return Sent::Failed(e),
        };
        match confirmed {
            Ok(Confirmation::Ack(r)) => Sent::Acked(r),
            Ok(Confirmation::Nack(r)) => Sent::Nacked(r),
            Ok(Confirmation::NotRequested) => Sent::Refused(Refused::Unconfirmed),
            Err(e) => Sent::Failed(e),
        }
    }
}

/// What became of one message on the channel.
enum Sent {
    /// Acked; lapin may have attached a returned message (this one's or another's).
    Acked(Option<BasicReturnMessage>),
    /// Nacked, likewise.
    Nacked(Option<BasicReturnMessage>),
    /// The channel or connection failed.
    Failed(lapin::Error),
    /// Not published, or not confirmed.
    Refused(Refused),
}

/// Whether `r` is the broker's return of `m`.
fn returned_is(r: &BasicReturnMessage, m: &OutboxMessage) -> bool {
    let d = &r.delivery;
    d.routing_key.as_str() == m.destination()
        && d.properties.message_id().as_ref().is_some_and(|id| id.as_str() == m.id().as_str())
}

impl Publisher for AmqpPublisher {
    /// Publishes the whole batch (lapin pipelines the frames on the channel), then awaits every
    /// confirm; a returned message is matched to the message it returns by id and routing key,
    /// whichever confirm lapin attached it to.
    async fn publish(&self, batch: &[OutboxMessage]) -> Vec<Result<(), PublishError>> {
        if batch.is_empty() {
            return Vec::new();
        }
        if self.exchange.len() > SHORT_STRING {
            let e = Refused::TooLong { what: "exchange name", len: self.exchange.len() };
            return batch
                .iter()
                .map(|m| Err(PublishError::new(m.destination(), false, e.clone())))
                .collect();
        }
        let mut finished = self.turn.lock().await;
        if !*finished {
            // What it gives back belongs to the abandoned batch, which the relay counts as
            // failed and publishes again.
            let _ = self.channel.wait_for_confirms().await;
        }
        *finished = false;
        let mut sent = join_all(batch.iter().map(|m| self.one(m))).await;
        *finished = true;
        // Every returned message, whichever confirm lapin attached it to (the next one
        // completed, in no particular order when the broker acks several at once).
        let returns: Vec<BasicReturnMessage> = sent
            .iter_mut()
            .filter_map(|s| match s {
                Sent::Acked(r) | Sent::Nacked(r) => r.take(),
                _ => None,
            })
            .collect();
        let mut returned: Vec<Option<Refused>> = vec![None; batch.len()];
        for r in returns {
            let mine =
                (0..batch.len()).find(|&i| returned[i].is_none() && returned_is(&r, &batch[i]));
            match mine {
                Some(i) => {
                    returned[i] = Some(Refused::Returned {
                        code: r.reply_code,
                        text: r.reply_text.to_string(),
                    });
                }
                None => tracing::warn!(target: "idem", routing_key = %r.delivery.routing_key,
                    "the broker returned a message this batch did not publish: is the channel shared?"),
            }
        }
        batch
            .iter()
            .zip(sent)
            .zip(returned)
            .map(|((m, sent), returned)| {
                let fail = |retryable, source: Box<dyn std::error::Error + Send + Sync>| {
                    Err(PublishError::new(m.destination(), retryable, source))
                };
                match (sent, returned) {
                    (Sent::Acked(_), None) => Ok(()),
                    (Sent::Acked(_) | Sent::Nacked(_), Some(r)) => fail(true, Box::new(r)),
                    (Sent::Nacked(_), None) => fail(true, Box::new(Refused::Nacked)),
                    (Sent::Failed(e), _) => fail(true, Box::new(e)),
                    (Sent::Refused(r @ Refused::TooLong { .. }), _) => fail(false, Box::new(r)),
                    (Sent::Refused(r), _) => fail(true, Box::new(r)),
                }
            })
            .collect()
    }
}
