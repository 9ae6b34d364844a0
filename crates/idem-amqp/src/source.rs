//! The RabbitMQ side of the consumer: fetching from the delivery stream, the copies, the verbs.

use std::time::Duration;

use futures_util::future::join_all;
use futures_util::{FutureExt, StreamExt};
use idem_core::consumer::{DeadLetter, Source, headers};
use idem_core::engine::Verb;
use lapin::options::{BasicAckOptions, BasicCancelOptions, BasicNackOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation};

use crate::topology::{DELAYS_HEADER, is_routing_header};
use crate::{Delivery, Error, Topology};

/// A RabbitMQ queue opened for the consumer (see [`AmqpConfig`](crate::AmqpConfig)): a consuming
/// channel with manual acks and a prefetch, and a publishing channel with publisher confirms for
/// the dead-letter and delay copies.
///
/// | verb | RabbitMQ |
/// | --- | --- |
/// | ack (processed, duplicate) | `basic.ack` |
/// | dead-letter (the copy is confirmed) | `basic.ack` |
/// | retry with a delay (in progress elsewhere) | a copy to the delay queue with a per-message TTL (confirmed), then `basic.ack`; if the copy fails, `basic.nack(requeue)` |
/// | retry without one (transient failure), release | `basic.nack(requeue)` |
pub struct AmqpSource {
    pub(crate) channel: Channel,
    pub(crate) publisher: Channel,
    pub(crate) stream: tokio::sync::Mutex<lapin::Consumer>,
    pub(crate) topology: Topology,
    pub(crate) batch_wait: Duration,
    pub(crate) min_delay: Duration,
    pub(crate) max_delay: Duration,
    pub(crate) tag: String,
}

impl std::fmt::Debug for AmqpSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpSource")
            .field("topology", &self.topology)
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

impl AmqpSource {
    /// The queue names in use.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The consumer tag.
    pub fn consumer_tag(&self) -> &str {
        &self.tag
    }

    /// The delay a retry gets: the suggestion (the other lease's remaining time) clamped to the
    /// configured range, or `None` (a plain requeue) when there is no suggestion.
    ///
    /// ```no_run
    /// # fn f(source: &idem_amqp::AmqpSource) {
    /// use std::time::Duration;
    /// // With .retry_delay(1 s, 5 min): a 30-minute lease waits 5 minutes at most.
    /// assert_eq!(source.delay_for(Some(Duration::from_secs(1800))), Some(Duration::from_secs(300)));
    /// # }
    /// ```
    pub fn delay_for(&self, after: Option<Duration>) -> Option<Duration> {
        after.map(|d| d.clamp(self.min_delay, self.max_delay))
    }

    /// Republishes `m` (persistent, mandatory) with its headers less `CC`/`BCC` (the copy is
    /// for `routing_key` only) plus `extra`, and waits for the broker's confirm.
    async fn copy(
        &self,
        m: &Delivery,
        exchange: &str,
        routing_key: &str,
        extra: Vec<(&str, AMQPValue)>,
        expiration: Option<Duration>,
    ) -> Result<(), Error> {
        let p = m.properties();
        // A fresh set of properties: the original's `expiration` must not follow the copy, and
        // `user_id` is checked by the broker against this connection's user.
        let mut props = BasicProperties::default().with_delivery_mode(2);
        if let Some(v) = p.content_type() {
            props = props.with_content_type(v.clone());
        }
        if let Some(v) = p.content_encoding() {
            props = props.with_content_encoding(v.clone());
        }
        if let Some(v) = p.message_id() {
            props = props.with_message_id(v.clone());
        }
        if let Some(v) = p.correlation_id() {
            props = props.with_correlation_id(v.clone());
        }
        if let Some(v) = p.reply_to() {
            props = props.with_reply_to(v.clone());
        }
        if let Some(v) = p.timestamp() {
            props = props.with_timestamp(*v);
        }
        if let Some(v) = p.kind() {
            props = props.with_type(v.clone());
        }
        if let Some(v) = p.app_id() {
            props = props.with_app_id(v.clone());
        }
        if let Some(v) = p.priority() {
            props = props.with_priority(*v);
        }
        let mut h = FieldTable::default();
        for (k, v) in p.headers().iter().flat_map(FieldTable::inner) {
            if !is_routing_header(k.as_str()) {
                h.insert(k.clone(), v.clone());
            }
        }
        for (k, v) in extra {
            h.insert(k.into(), v);
        }
        props = props.with_headers(h);
        if let Some(d) = expiration {
            let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1);
            props = props.with_expiration(ms.to_string().into());
        }
        let failed = |why: &'static str| Error::CopyRefused { exchange: exchange.to_owned(), why };
        let confirm = self
            .publisher
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions { mandatory: true, immediate: false },
                m.payload(),
                props,
            )
            .await
            .map_err(|source| Error::Copy { exchange: exchange.to_owned(), source })?
            .await
            .map_err(|source| Error::Copy { exchange: exchange.to_owned(), source })?;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(failed("unroutable: the broker returned it")),
            Confirmation::Nack(_) => Err(failed("the broker nacked it")),
            Confirmation::NotRequested => Err(failed("publisher confirms are off")),
        }
    }

    /// A copy to the delay queue that dead-letters back to the work queue after `delay`.
    async fn delay(&self, m: &Delivery, delay: Duration) -> Result<(), Error> {
        let delays = AMQPValue::LongUInt(m.delays().saturating_add(1));
        let queue = self.topology.delay_queue.as_str();
        self.copy(m, "", queue, vec![(DELAYS_HEADER, delays)], Some(delay)).await
    }

    async fn ack(&self, m: &Delivery) -> Result<(), Error> {
        let d = m.lapin();
        match d.ack(BasicAckOptions::default()).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::Settle { verb: "ack", tag: d.delivery_tag, source: None }),
            Err(e) => Err(Error::Settle { verb: "ack", tag: d.delivery_tag, source: Some(e) }),
        }
    }

    async fn requeue(&self, m: &Delivery) -> Result<(), Error> {
        let d = m.lapin();
        match d.nack(BasicNackOptions { multiple: false, requeue: true }).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(Error::Settle { verb: "nack", tag: d.delivery_tag, source: None }),
            Err(e) => Err(Error::Settle { verb: "nack", tag: d.delivery_tag, source: Some(e) }),
        }
    }

    /// One message's verbs.
    async fn send(&self, m: &Delivery, verb: &Verb) -> Result<(), Error> {
        match verb {
            Verb::Ack | Verb::DeadLetter { .. } => self.ack(m).await,
            Verb::Retry { after } => match self.delay_for(*after) {
                Some(d) => match self.delay(m, d).await {
                    Ok(()) => self.ack(m).await,
                    Err(e) => {
                        // Never ack what is not safely elsewhere: let it come back instead.
                        tracing::warn!(target: "idem", error = %e, "delay copy failed; requeueing instead");
                        self.requeue(m).await
                    }
                },
                None => self.requeue(m).await,
            },
            // Release, and any verb added later: redeliver, never lose.
            _ => self.requeue(m).await,
        }
    }
}

fn next_delivery(
    d: Option<Result<lapin::message::Delivery, lapin::Error>>,
) -> Result<Delivery, Error> {
    match d {
        Some(Ok(d)) => Ok(Delivery::new(d)),
        Some(Err(e)) => Err(Error::Stream(e)),
        None => Err(Error::Cancelled),
    }
}

impl Source for AmqpSource {
    type Delivery = Delivery;
    type Error = Error;

    /// What the broker has pushed already, or else the first delivery within `wait` and what
    /// came with it; then more for up to the batch wait, up to `max`.
    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>, Error> {
        // The wait counts from the call, not from getting the stream: with batches in flight,
        // fetches queue for it, and each waiting its full time would hold shutdown up to
        // `concurrency × wait`.
        let deadline = tokio::time::Instant::now() + wait;
        let mut stream = self.stream.lock().await;
        let mut out = Vec::with_capacity(max);
        let ready = |out: &mut Vec<Delivery>, stream: &mut lapin::Consumer| {
            while out.len() < max {
                match stream.next().now_or_never() {
                    Some(d) => out.push(next_delivery(d)?),
                    None => break,
                }
            }
            Ok::<_, Error>(())
        };
        if let Err(e) = ready(&mut out, &mut stream) {
            return keep_or_fail(out, e);
        }
        if out.is_empty() {
            match tokio::time::timeout_at(deadline, stream.next()).await {
                Ok(d) => out.push(next_delivery(d)?),
                // lapin may leave the stream silent after its connection failed.
                Err(_) if !self.channel.status().connected() => return Err(Error::ChannelClosed),
                Err(_) => return Ok(out),
            }
            if let Err(e) = ready(&mut out, &mut stream) {
                return keep_or_fail(out, e);
            }
        }
        let until = tokio::time::Instant::now() + self.batch_wait;
        while out.len() < max {
            match tokio::time::timeout_at(until, stream.next()).await {
                Ok(d) => match next_delivery(d) {
                    Ok(m) => out.push(m),
                    Err(e) => return keep_or_fail(out, e),
                },
                Err(_) => break,
            }
        }
        Ok(out)
    }

    /// The stream failing, the broker cancelling the consumer, the channel closing: nothing
    /// more will arrive on this channel.
    fn is_fatal(&self, error: &Error) -> bool {
        matches!(error, Error::Stream(_) | Error::Cancelled | Error::ChannelClosed)
    }

    /// Copies to the dead-letter exchange (routing key: the work queue), with the reason,
    /// outcome, scope and `idem-source` (the queue) headers, all confirmed together.
    async fn dead_letter(&self, items: &[(&Delivery, DeadLetter)]) -> Vec<Result<(), Error>> {
        let exchange = self.topology.dead_letter_exchange.as_str();
        let queue = self.topology.queue.as_str();
        let text = |s: &str| AMQPValue::LongString(LongString::from(s));
        join_all(items.iter().map(|(m, dl)| {
            let mut extra: Vec<(&str, AMQPValue)> =
                dl.headers().iter().map(|(k, v)| (*k, text(v))).collect();
            extra.push((headers::SOURCE, text(queue)));
            self.copy(m, exchange, queue, extra, None)
        }))
        .await
    }

    /// Every verb of the batch at once (lapin pipelines them on the channel). A verb that
    /// cannot be sent means the channel is gone: the run ends, and the broker redelivers every
    /// unacked message.
    async fn settle(&self, items: Vec<(Delivery, Verb)>) -> Result<u64, Error> {
        let results = join_all(items.iter().map(|(m, v)| self.send(m, v))).await;
        results.into_iter().collect::<Result<Vec<()>, Error>>()?;
        Ok(0)
    }

    /// Cancels the consumer, requeues what the broker pushed meanwhile, closes both channels.
    async fn close(&self) -> Result<u64, Error> {
        let cancel =
            self.channel.basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default());
        if let Err(e) = cancel.await {
            tracing::warn!(target: "idem", error = %e, "basic.cancel failed");
        }
        let mut stream = self.stream.lock().await;
        let mut released = 0;
        // After cancel-ok the stream ends; the bound only guards against a silent broker.
        while let Ok(Some(Ok(d))) =
            tokio::time::timeout(Duration::from_secs(5), stream.next()).await
        {
            match d.nack(BasicNackOptions { multiple: false, requeue: true }).await {
                Ok(true) => released += 1,
                _ => break,
            }
        }
        for ch in [&self.channel, &self.publisher] {
            if let Err(e) = ch.close(200, "idem consumer shutdown".into()).await {
                tracing::debug!(target: "idem", error = %e, "channel close");
            }
        }
        Ok(released)
    }
}

/// Deliveries already received are ours until the channel closes: hand them to the consumer and
/// let the next fetch report the error.
fn keep_or_fail(out: Vec<Delivery>, e: Error) -> Result<Vec<Delivery>, Error> {
    if out.is_empty() {
        return Err(e);
    }
    tracing::warn!(target: "idem", error = %e, received = out.len(),
        "delivery stream ended early; handling what arrived");
    Ok(out)
}
