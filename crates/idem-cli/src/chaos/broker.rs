//! The broker side of a run: its queue or stream, publishing the input, the backlog and the
//! dead letters.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context as _, bail};
use idem::amqp::Topology;
use idem::amqp::lapin::Connection;
use idem::amqp::lapin::options::{
    BasicGetOptions, ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idem::amqp::lapin::types::FieldTable;
use idem::nats::async_nats::jetstream;
use idem::outbox::{OutboxMessage, Publisher};
use idem::redact::Redacted;

use crate::connect;

const ACCEPTED: &str =
    "amqp:// (RabbitMQ), nats:// (JetStream), redis:// (Redis Streams) or kafka:// (Kafka)";
/// The shortest duplicate window JetStream accepts.
pub(crate) const NATS_DUPLICATE_WINDOW: Duration = Duration::from_millis(100);
/// The durable JetStream consumer every worker pulls from.
pub(crate) const NATS_CONSUMER: &str = "chaos";
/// The Redis Streams consumer group every worker reads in.
pub(crate) const STREAM_GROUP: &str = "chaos";
/// Prefix of the runs' Kafka consumer groups.
pub(crate) const KAFKA_GROUP: &str = "idem-chaos";

/// The broker, as given by `--broker`.
#[derive(Debug, Clone)]
pub(crate) enum BrokerUrl {
    Amqp(String),
    Nats(String),
    Redis(String),
    /// `host:port[,host:port]` after `kafka://` (read only with the `kafka` feature).
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    Kafka(String),
}

impl BrokerUrl {
    pub(crate) fn parse(s: &str) -> anyhow::Result<Self> {
        if s.starts_with("amqp://") || s.starts_with("amqps://") {
            Ok(Self::Amqp(s.to_owned()))
        } else if s.starts_with("nats://") || s.starts_with("tls://") {
            Ok(Self::Nats(s.to_owned()))
        } else if s.starts_with("redis://") || s.starts_with("rediss://") {
            Ok(Self::Redis(s.to_owned()))
        } else if s.starts_with("kafka://") || s.starts_with("kafka+") {
            let target = connect::kafka_target(s).context("--broker")?;
            if !target.is_plain() {
                bail!(
                    "--broker {}: idem chaos reaches Kafka over plaintext kafka:// only (its \
                     admin, producer and worker clients take no TLS or SASL settings yet)",
                    Redacted(s)
                );
            }
            let brokers = target.brokers;
            if cfg!(feature = "kafka") {
                Ok(Self::Kafka(brokers.to_owned()))
            } else {
                bail!("--broker {s}: this idem was built without the `kafka` feature")
            }
        } else {
            bail!("--broker {}: unsupported scheme; expected {ACCEPTED}", Redacted(s))
        }
    }

    /// The queue (RabbitMQ), subject (NATS) or stream key (Redis) of the run with `tag`.
    pub(crate) fn destination(&self, tag: &str) -> String {
        match self {
            Self::Redis(_) => format!("idem:chaos:{tag}"),
            _ => format!("idem.chaos.{tag}"),
        }
    }

    /// Where the run's consumers dead-letter: RabbitMQ's default dead-letter queue of the
    /// destination, the NATS subject, the Redis stream, the Kafka topic.
    pub(crate) fn dead_letter(&self, tag: &str) -> String {
        match self {
            Self::Amqp(_) => idem::amqp::Topology::for_queue(self.destination(tag))
                .dead_letter_queue()
                .map(str::to_owned)
                .unwrap_or_default(),
            Self::Nats(_) => Self::dead_letter_subject(tag),
            Self::Redis(_) => self.dead_letter_stream(tag),
            Self::Kafka(_) => format!("{}.dlq", self.destination(tag)),
        }
    }

    /// The Kafka consumer group of the run's topic: a group per run, so runs side by side do
    /// not rebalance each other.
    pub(crate) fn kafka_group(topic: &str) -> String {
        format!("{KAFKA_GROUP}-{topic}")
    }

    /// Where the Redis Streams source dead-letters (its default).
    pub(crate) fn dead_letter_stream(&self, tag: &str) -> String {
        format!("{}:dead-letter", self.destination(tag))
    }

    /// The JetStream stream holding the run's subject and its dead-letter subject.
    pub(crate) fn stream(tag: &str) -> String {
        format!("IDEM_CHAOS_{}", tag.to_uppercase())
    }

    pub(crate) fn dead_letter_subject(tag: &str) -> String {
        format!("idem.chaos.{tag}.dlq")
    }
}

pub(crate) async fn nats_connect(url: &str) -> anyhow::Result<jetstream::Context> {
    Ok(jetstream::new(connect::nats_client(url).await?))
}

/// The orchestrator's connection to the broker.
pub(crate) enum Admin {
    Amqp {
        conn: Connection,
        publisher: idem::amqp::AmqpPublisher,
        topology: Topology,
    },
    Nats {
        js: jetstream::Context,
        publisher: idem::nats::JetStreamPublisher,
        tag: String,
    },
    #[cfg(feature = "kafka")]
    Kafka(super::kafka::KafkaAdmin),
    Redis {
        conn: idem::redis::redis::aio::ConnectionManager,
        publisher: idem::redis::StreamPublisher,
        stream: String,
        dead_letter: String,
    },
}

impl Admin {
    /// Creates the run's queue or stream (the workers declare RabbitMQ's companions).
    pub(crate) async fn create(broker: &BrokerUrl, tag: &str) -> anyhow::Result<Self> {
        let destination = broker.destination(tag);
        match broker {
            BrokerUrl::Amqp(url) => {
                let conn = connect::amqp_connection(url).await?;
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
                        // A bounded age: the consumer refuses a stream that keeps messages
                        // for ever (the retention must cover it).
                        max_age: Duration::from_secs(3600),
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
            BrokerUrl::Redis(url) => {
                let mut conn = connect::redis_manager(url).await?;
                // The group first, from the stream's start, so the backlog counts every entry.
                let _: () = idem::redis::redis::cmd("XGROUP")
                    .arg("CREATE")
                    .arg(&destination)
                    .arg(STREAM_GROUP)
                    .arg("0")
                    .arg("MKSTREAM")
                    .query_async(&mut conn)
                    .await
                    .with_context(|| format!("creating group {STREAM_GROUP} on {destination}"))?;
                let publisher = idem::redis::StreamPublisher::new(conn.clone());
                let dead_letter = broker.dead_letter_stream(tag);
                Ok(Self::Redis { conn, publisher, stream: destination, dead_letter })
            }
            #[cfg(feature = "kafka")]
            BrokerUrl::Kafka(brokers) => {
                connect::kafka_reachable(&connect::kafka_target(&format!("kafka://{brokers}"))?)
                    .await?;
                let dead_letter = broker.dead_letter(tag);
                Ok(Self::Kafka(
                    super::kafka::KafkaAdmin::create(brokers, destination, dead_letter).await?,
                ))
            }
            #[cfg(not(feature = "kafka"))]
            BrokerUrl::Kafka(_) => bail!("this idem was built without the `kafka` feature"),
        }
    }

    /// Publishes `messages`, each confirmed by the broker.
    pub(crate) async fn publish(&self, messages: &[OutboxMessage]) -> anyhow::Result<()> {
        for chunk in messages.chunks(500) {
            let results = match self {
                Self::Amqp { publisher, .. } => publisher.publish(chunk).await,
                Self::Nats { publisher, .. } => publisher.publish(chunk).await,
                Self::Redis { publisher, .. } => publisher.publish(chunk).await,
                #[cfg(feature = "kafka")]
                Self::Kafka(k) => k.publish(chunk).await,
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
            Self::Redis { conn, stream, .. } => {
                // XINFO GROUPS: `pending` (delivered, not acked) and `lag` (not yet delivered;
                // Redis 7).
                let mut conn = conn.clone();
                let groups: Vec<std::collections::HashMap<String, idem::redis::redis::Value>> =
                    idem::redis::redis::cmd("XINFO")
                        .arg("GROUPS")
                        .arg(stream)
                        .query_async(&mut conn)
                        .await?;
                let number = |v: Option<&idem::redis::redis::Value>| -> anyhow::Result<u64> {
                    match v {
                        Some(idem::redis::redis::Value::Int(n)) => {
                            Ok(u64::try_from(*n).unwrap_or(0))
                        }
                        other => {
                            bail!("XINFO GROUPS answered {other:?}; Redis 7 or later is needed")
                        }
                    }
                };
                let mut n = 0;
                for g in groups.iter().filter(|g| {
                    matches!(g.get("name"), Some(idem::redis::redis::Value::BulkString(b)) if b == STREAM_GROUP.as_bytes())
                }) {
                    n += number(g.get("pending"))? + number(g.get("lag"))?;
                }
                Ok(n)
            }
            #[cfg(feature = "kafka")]
            Self::Kafka(k) => k.backlog().await,
        }
    }

    /// Kafka: the partitions of the run's topic that hold messages (the offset inbox keeps one
    /// position row for each). Other brokers: none.
    pub(crate) async fn partitions_used(&self) -> anyhow::Result<i64> {
        match self {
            #[cfg(feature = "kafka")]
            Self::Kafka(k) => k.partitions_used().await,
            _ => Ok(0),
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
            #[cfg(feature = "kafka")]
            Self::Kafka(k) => ids = k.dead_letters().await?,
            Self::Redis { conn, dead_letter, .. } => {
                let mut conn = conn.clone();
                let reply: idem::redis::redis::streams::StreamRangeReply =
                    idem::redis::redis::cmd("XRANGE")
                        .arg(dead_letter)
                        .arg("-")
                        .arg("+")
                        .query_async(&mut conn)
                        .await?;
                for entry in reply.ids {
                    if let Some(idem::redis::redis::Value::BulkString(b)) = entry.map.get("payload")
                    {
                        ids.insert(payload_id(b)?);
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
            #[cfg(feature = "kafka")]
            Self::Kafka(k) => k.delete().await?,
            Self::Redis { conn, stream, dead_letter, .. } => {
                let mut conn = conn.clone();
                let _: () = idem::redis::redis::cmd("DEL")
                    .arg(stream)
                    .arg(dead_letter)
                    .query_async(&mut conn)
                    .await?;
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
