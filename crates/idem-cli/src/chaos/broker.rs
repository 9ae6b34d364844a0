//! The broker side of a run: its queue or stream, publishing the input, the backlog and the
//! dead letters.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context as _, bail};
use idem::amqp::Topology;
use idem::amqp::lapin::options::{
    BasicGetOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idem::amqp::lapin::types::FieldTable;
use idem::amqp::lapin::{Connection, ConnectionProperties};
use idem::nats::async_nats::{self, jetstream};
use idem::outbox::{OutboxMessage, Publisher};

use super::store::redact;

const ACCEPTED: &str = "amqp:// (RabbitMQ) or nats:// (JetStream)";
/// The shortest duplicate window JetStream accepts.
pub(crate) const NATS_DUPLICATE_WINDOW: Duration = Duration::from_millis(100);
/// The durable JetStream consumer every worker pulls from.
pub(crate) const NATS_CONSUMER: &str = "chaos";

/// The broker, as given by `--broker`.
#[derive(Debug, Clone)]
pub(crate) enum BrokerUrl {
    Amqp(String),
    Nats(String),
}

impl BrokerUrl {
    pub(crate) fn parse(s: &str) -> anyhow::Result<Self> {
        if s.starts_with("amqp://") || s.starts_with("amqps://") {
            Ok(Self::Amqp(s.to_owned()))
        } else if s.starts_with("nats://") {
            Ok(Self::Nats(s.to_owned()))
        } else if s.starts_with("redis://") || s.starts_with("kafka://") {
            bail!(
                "--broker {s}: Redis Streams and Kafka are not supported by `idem chaos` yet; use {ACCEPTED}"
            )
        } else {
            bail!("--broker {s}: unsupported scheme; expected {ACCEPTED}")
        }
    }

    /// The queue (RabbitMQ) or subject (NATS) of the run with `tag`.
    pub(crate) fn destination(&self, tag: &str) -> String {
        format!("idem.chaos.{tag}")
    }

    /// The JetStream stream holding the run's subject and its dead-letter subject.
    pub(crate) fn stream(tag: &str) -> String {
        format!("IDEM_CHAOS_{}", tag.to_uppercase())
    }

    pub(crate) fn dead_letter_subject(tag: &str) -> String {
        format!("idem.chaos.{tag}.dlq")
    }
}

pub(crate) async fn amqp_connect(url: &str) -> anyhow::Result<Connection> {
    Connection::connect(url, ConnectionProperties::default())
        .await
        .with_context(|| format!("connecting to RabbitMQ at {}", redact(url)))
}

pub(crate) async fn nats_connect(url: &str) -> anyhow::Result<jetstream::Context> {
    let client = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .with_context(|| format!("connecting to NATS at {}", redact(url)))?;
    Ok(jetstream::new(client))
}

/// The orchestrator's connection to the broker.
pub(crate) enum Admin {
    Amqp { conn: Connection, publisher: idem::amqp::AmqpPublisher, topology: Topology },
    Nats { js: jetstream::Context, publisher: idem::nats::JetStreamPublisher, tag: String },
}

impl Admin {
    /// Creates the run's queue or stream (the workers declare RabbitMQ's companions).
    pub(crate) async fn create(broker: &BrokerUrl, tag: &str) -> anyhow::Result<Self> {
        let destination = broker.destination(tag);
        match broker {
            BrokerUrl::Amqp(url) => {
                let conn = amqp_connect(url).await?;
                let ch = conn.create_channel().await?;
                ch.queue_declare(
                    destination.as_str().into(),
                    QueueDeclareOptions::durable(),
                    FieldTable::default(),
                )
                .await
                .with_context(|| format!("declaring queue {destination}"))?;
                let publisher = idem::amqp::AmqpPublisher::new(ch).await?.persistent(true);
                Ok(Self::Amqp { conn, publisher, topology: Topology::for_queue(destination) })
            }
            BrokerUrl::Nats(url) => {
                let js = nats_connect(url).await?;
                let dlq = BrokerUrl::dead_letter_subject(tag);
                let stream = js
                    .create_stream(jetstream::stream::Config {
                        name: BrokerUrl::stream(tag),
                        subjects: vec![destination.clone(), dlq],
                        // JetStream drops a re-publish of an id inside this window before any
                        // consumer sees it; the shortest it allows, so most duplicates reach
                        // idem (reused ids are published later than this).
                        duplicate_window: NATS_DUPLICATE_WINDOW,
                        ..Default::default()
                    })
                    .await
                    .with_context(|| format!("creating stream {}", BrokerUrl::stream(tag)))?;
                stream
                    .create_consumer(jetstream::consumer::pull::Config {
                        durable_name: Some(NATS_CONSUMER.into()),
                        filter_subject: destination,
                        ack_policy: jetstream::consumer::AckPolicy::Explicit,
                        // A killed worker's messages come back after this.
                        ack_wait: Duration::from_secs(2),
                        max_deliver: 1000,
                        ..Default::default()
                    })
                    .await
                    .context("creating the JetStream consumer")?;
                let publisher = idem::nats::JetStreamPublisher::new(js.clone());
                Ok(Self::Nats { js, publisher, tag: tag.to_owned() })
            }
        }
    }

    /// Publishes `messages`, each confirmed by the broker.
    pub(crate) async fn publish(&self, messages: &[OutboxMessage]) -> anyhow::Result<()> {
        for chunk in messages.chunks(500) {
            let results = match self {
                Self::Amqp { publisher, .. } => publisher.publish(chunk).await,
                Self::Nats { publisher, .. } => publisher.publish(chunk).await,
            };
            for r in results {
                r.context("publishing the input")?;
            }
        }
        Ok(())
    }

    /// Messages waiting (RabbitMQ: ready in the queue and its delay queue; NATS: pending and
    /// unacknowledged).
    pub(crate) async fn backlog(&self) -> anyhow::Result<u64> {
        match self {
            Self::Amqp { conn, topology, .. } => {
                let mut n = 0;
                for q in [topology.queue(), topology.delay_queue()] {
                    n += amqp_count(conn, q).await?.unwrap_or(0);
                }
                Ok(n)
            }
            Self::Nats { js, tag, .. } => {
                let mut c: jetstream::consumer::PullConsumer =
                    js.get_consumer_from_stream(NATS_CONSUMER, &BrokerUrl::stream(tag)).await?;
                let info = c.info().await?;
                Ok(info.num_pending + info.num_ack_pending as u64)
            }
        }
    }

    /// The distinct ids in the dead-letter queue (read without consuming them).
    pub(crate) async fn dead_letters(&self) -> anyhow::Result<HashSet<String>> {
        let mut ids = HashSet::new();
        match self {
            Self::Amqp { conn, topology, .. } => {
                let Some(dlq) = topology.dead_letter_queue() else { return Ok(ids) };
                if amqp_count(conn, dlq).await?.is_none() {
                    return Ok(ids); // not declared yet: no worker has opened
                }
                let ch = conn.create_channel().await?;
                // Unacknowledged gets go back to the queue when the channel closes.
                while let Some(m) =
                    ch.basic_get(dlq.into(), BasicGetOptions { no_ack: false }).await?
                {
                    ids.insert(payload_id(&m.delivery.data)?);
                }
                let _ = ch.close(200, "read".into()).await;
            }
            Self::Nats { js, tag, .. } => {
                let stream = js.get_stream(BrokerUrl::stream(tag)).await?;
                let reader = stream
                    .create_consumer(jetstream::consumer::pull::Config {
                        filter_subject: BrokerUrl::dead_letter_subject(tag),
                        ack_policy: jetstream::consumer::AckPolicy::None,
                        inactive_threshold: Duration::from_secs(5),
                        ..Default::default()
                    })
                    .await?;
                loop {
                    let mut batch = reader
                        .fetch()
                        .max_messages(500)
                        .expires(Duration::from_millis(200))
                        .messages()
                        .await?;
                    let mut got = 0;
                    while let Some(m) = futures_util::StreamExt::next(&mut batch).await {
                        let m = m.map_err(|e| anyhow::anyhow!("reading dead letters: {e}"))?;
                        ids.insert(payload_id(&m.payload)?);
                        got += 1;
                    }
                    if got == 0 {
                        break;
                    }
                }
            }
        }
        Ok(ids)
    }

    /// Deletes the run's queues and exchange, or its stream.
    pub(crate) async fn delete(&self) -> anyhow::Result<()> {
        match self {
            Self::Amqp { conn, topology, .. } => {
                let ch = conn.create_channel().await?;
                let mut queues = vec![topology.queue(), topology.delay_queue()];
                queues.extend(topology.dead_letter_queue());
                for q in queues {
                    ch.queue_delete(q.into(), QueueDeleteOptions::default()).await?;
                }
                ch.exchange_delete(
                    topology.dead_letter_exchange().into(),
                    ExchangeDeleteOptions::default(),
                )
                .await?;
            }
            Self::Nats { js, tag, .. } => {
                js.delete_stream(BrokerUrl::stream(tag)).await?;
            }
        }
        Ok(())
    }
}

/// Messages ready in `queue`; `None` when it does not exist. A passive declare of a missing
/// queue closes its channel, so each count has a channel of its own.
async fn amqp_count(conn: &Connection, queue: &str) -> anyhow::Result<Option<u64>> {
    let ch = conn.create_channel().await?;
    let opts = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::durable() };
    match ch.queue_declare(queue.into(), opts, FieldTable::default()).await {
        Ok(q) => {
            let _ = ch.close(200, "counted".into()).await;
            Ok(Some(u64::from(q.message_count())))
        }
        Err(_) => Ok(None),
    }
}

/// The `id` field of a chaos message's JSON payload.
pub(crate) fn payload_id(payload: &[u8]) -> anyhow::Result<String> {
    let v: serde_json::Value =
        serde_json::from_slice(payload).context("a payload not from idem chaos")?;
    match v.get("id").and_then(|id| id.as_str()) {
        Some(id) => Ok(id.to_owned()),
        None => bail!("a payload without an id: {v}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_accepted_schemes() {
        let e = BrokerUrl::parse("mqtt://h").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("amqp://") && e.contains("nats://"), "{e}");
        assert!(BrokerUrl::parse("nats://127.0.0.1:4222").is_ok());
    }
}
