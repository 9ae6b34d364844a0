//! From an outcome to the broker's verbs.

use std::fmt::Display;
use std::sync::Arc;
use std::time::Duration;

use idem_core::consumer::Disposition;
use idem_core::{DedupStore, Outcome};
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicPublishOptions};
use lapin::types::{AMQPValue, LongString};
use lapin::{BasicProperties, Confirmation};

use crate::topology::{DELAYS_HEADER, OUTCOME_HEADER, QUEUE_HEADER, REASON_HEADER, SCOPE_HEADER};
use crate::{AmqpConsumer, AmqpMessage, Error};

pub(crate) type Hook = Arc<dyn Fn(&Report<'_>) + Send + Sync>;

/// What the adapter does with a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// `basic.ack`: processed, or a duplicate.
    Ack,
    /// `basic.nack(requeue = true)`: a transient failure whose claim was released.
    Requeue,
    /// A copy goes to the delay queue with this TTL (confirmed), then the original is acked:
    /// another consumer holds the key's lease.
    Delay(Duration),
    /// A copy goes to the dead-letter exchange with the reason in headers (confirmed), then
    /// the original is acked: a conflict or a permanent failure.
    DeadLetter {
        /// The `x-idem-reason` header.
        reason: String,
    },
}

/// One delivery's fate, shown to the [`on_settle`](crate::AmqpConsumerBuilder::on_settle) hook.
#[derive(Debug)]
#[non_exhaustive]
pub struct Report<'a> {
    /// The delivery.
    pub message: &'a AmqpMessage,
    /// Its dedup key id, when it has one.
    pub key: Option<&'a str>,
    /// The outcome's label (`processed`, `duplicate`, `conflict`, `in_progress_elsewhere`,
    /// `failed_transient`, `failed_permanent`).
    pub outcome: &'static str,
    /// What is about to be done.
    pub action: &'a Action,
}

/// Counts of what a run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Deliveries received.
    pub received: u64,
    /// Handler runs that committed.
    pub processed: u64,
    /// Deliveries recognised as already done.
    pub duplicates: u64,
    /// Deliveries acked (processed, duplicates, and originals of delayed or dead-lettered copies).
    pub acked: u64,
    /// Deliveries nacked with requeue.
    pub requeued: u64,
    /// Deliveries sent through the delay queue.
    pub delayed: u64,
    /// Deliveries sent to the dead-letter exchange.
    pub dead_lettered: u64,
    /// Deliveries the broker had pushed but the handler had not started when shutdown came:
    /// requeued untouched (also counted in `requeued`).
    pub returned_at_shutdown: u64,
}

pub(crate) fn action_of<T, E: Display>(o: &Outcome<T, E>, min: Duration, max: Duration) -> Action {
    match o.disposition() {
        Disposition::Ack => Action::Ack,
        Disposition::Retry { after: Some(d) } => Action::Delay(d.clamp(min, max)),
        Disposition::DeadLetter { reason } => Action::DeadLetter { reason },
        // A plain retry, and any disposition added later: redeliver, never lose.
        _ => Action::Requeue,
    }
}

#[derive(Debug, thiserror::Error)]
enum PublishError {
    #[error(transparent)]
    Broker(#[from] lapin::Error),
    #[error("the broker refused the copy (nack)")]
    Nacked,
    #[error("the copy was unroutable (returned)")]
    Unroutable,
    #[error("no publisher confirm for the copy within {0:?}")]
    NoConfirm(std::time::Duration),
}

impl<S: DedupStore> AmqpConsumer<S> {
    pub(crate) async fn settle<T, E: Display>(
        &self,
        m: &AmqpMessage,
        outcome: &Outcome<T, E>,
        stats: &mut Stats,
    ) -> Result<(), Error> {
        match outcome {
            Outcome::Processed(_) => stats.processed += 1,
            Outcome::Duplicate(_) => stats.duplicates += 1,
            _ => {}
        }
        let action = action_of(outcome, self.min_delay, self.max_delay);
        if let Some(hook) = &self.hook {
            let key = self.engine.key_of(m).ok();
            hook(&Report {
                message: m,
                key: key.as_ref().map(|k| k.id()),
                outcome: outcome.label(),
                action: &action,
            });
        }
        match action {
            Action::Ack => self.ack(m, stats).await,
            Action::Requeue => self.requeue(m, stats).await,
            Action::Delay(d) => {
                let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1);
                let delays = AMQPValue::LongUInt(m.delays().saturating_add(1));
                let copy = self
                    .publish_copy(
                        m,
                        "",
                        &self.topology.delay_queue,
                        &[(DELAYS_HEADER, delays)],
                        Some(ms),
                    )
                    .await;
                match copy {
                    Ok(()) => {
                        stats.delayed += 1;
                        self.ack(m, stats).await
                    }
                    Err(e) => {
                        tracing::warn!(target: "idem", error = %e, "delay copy failed; requeueing instead");
                        self.requeue(m, stats).await
                    }
                }
            }
            Action::DeadLetter { reason } => {
                let text = |s: &str| AMQPValue::LongString(LongString::from(s));
                let headers = [
                    (REASON_HEADER, text(&reason)),
                    (OUTCOME_HEADER, text(outcome.label())),
                    (SCOPE_HEADER, text(self.engine.scope())),
                    (QUEUE_HEADER, text(&self.topology.queue)),
                ];
                let exchange = self.topology.dead_letter_exchange.as_str();
                match self.publish_copy(m, exchange, &self.topology.queue, &headers, None).await {
                    Ok(()) => {
                        stats.dead_lettered += 1;
                        self.ack(m, stats).await
                    }
                    Err(e) => {
                        // Never ack what is not safely elsewhere: let it come back instead.
                        tracing::error!(target: "idem", error = %e, %reason,
                            "dead-letter copy failed; requeueing the message");
                        self.requeue(m, stats).await
                    }
                }
            }
        }
    }

    async fn ack(&self, m: &AmqpMessage, stats: &mut Stats) -> Result<(), Error> {
        let d = m.delivery();
        match self.bounded("an ack", d.ack(BasicAckOptions::default())).await? {
            Ok(true) => {
                stats.acked += 1;
                Ok(())
            }
            Ok(false) => Err(Error::Settle { verb: "ack", tag: d.delivery_tag, source: None }),
            Err(e) => Err(Error::Settle { verb: "ack", tag: d.delivery_tag, source: Some(e) }),
        }
    }

    pub(crate) async fn requeue(&self, m: &AmqpMessage, stats: &mut Stats) -> Result<(), Error> {
        let d = m.delivery();
        let opts = BasicNackOptions { multiple: false, requeue: true };
        match self.bounded("a nack", d.nack(opts)).await? {
            Ok(true) => {
                stats.requeued += 1;
                Ok(())
            }
            Ok(false) => Err(Error::Settle { verb: "nack", tag: d.delivery_tag, source: None }),
            Err(e) => Err(Error::Settle { verb: "nack", tag: d.delivery_tag, source: Some(e) }),
        }
    }

    /// Republishes `m` (persistent, mandatory) and waits for the broker's confirm.
    async fn publish_copy(
        &self,
        m: &AmqpMessage,
        exchange: &str,
        routing_key: &str,
        extra: &[(&str, AMQPValue)],
        expiration_ms: Option<u64>,
    ) -> Result<(), PublishError> {
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
        let mut headers = p.headers().clone().unwrap_or_default();
        for (k, v) in extra {
            headers.insert((*k).into(), v.clone());
        }
        props = props.with_headers(headers);
        if let Some(ms) = expiration_ms {
            props = props.with_expiration(ms.to_string().into());
        }
        let publish = async {
            self.publisher
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions { mandatory: true, immediate: false },
                    m.payload(),
                    props,
                )
                .await?
                .await
        };
        let confirm = tokio::time::timeout(self.broker_timeout, publish)
            .await
            .map_err(|_| PublishError::NoConfirm(self.broker_timeout))??;
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) => Err(PublishError::Unroutable),
            Confirmation::Nack(_) | Confirmation::NotRequested => Err(PublishError::Nacked),
        }
    }
}
