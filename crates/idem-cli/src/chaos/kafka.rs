//! Kafka as the broker of a run (the `kafka` feature): a topic of 3 partitions and its
//! dead-letter topic, the input published one record per batch, the backlog as the consumer
//! group's lag. librdkafka calls block, and a client's close can hang against some brokers, so
//! each runs on a thread of its own that is abandoned after its timeout.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context as _, anyhow};
use idem::dlq::DeadLetterQueue as _;
use idem::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem::kafka::rdkafka::client::DefaultClientContext;
use idem::kafka::rdkafka::config::ClientConfig;
use idem::kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idem::kafka::rdkafka::{Offset, TopicPartitionList};
use idem::kafka::{KafkaDeadLetters, KafkaPublisher};
use idem::outbox::{OutboxMessage, Publisher};

use super::broker::BrokerUrl;

/// Partitions of the run's topic (its dead-letter topic has one).
const PARTITIONS: i32 = 3;
const TIMEOUT: Duration = Duration::from_secs(10);

/// The workers' consumer settings: quick rebalances when a worker is killed. Each run's topic
/// has a group of its own: runs side by side would otherwise rebalance each other at every kill.
pub(crate) fn consumer_config(brokers: &str, topic: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", BrokerUrl::kafka_group(topic))
        .set("session.timeout.ms", "6000")
        .set("heartbeat.interval.ms", "500")
        .set("max.poll.interval.ms", "30000")
        .set("topic.metadata.refresh.interval.ms", "1000");
    c
}

/// Runs `f` on a thread of its own, waiting at most `TIMEOUT` for it.
async fn off_thread<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("chaos: {what}"))
        .spawn(move || drop(tx.send(f())))
        .with_context(|| format!("starting a thread to {what}"))?;
    tokio::time::timeout(TIMEOUT * 3, rx)
        .await
        .map_err(|_| anyhow!("{what}: no answer from the brokers within {:?}", TIMEOUT * 3))?
        .map_err(|_| anyhow!("{what}: the thread panicked"))?
}

pub(crate) struct KafkaAdmin {
    brokers: String,
    topic: String,
    dead_letter_queue: KafkaDeadLetters,
    publisher: KafkaPublisher,
}

impl KafkaAdmin {
    pub(crate) async fn create(
        brokers: &str,
        topic: String,
        dead_letter: String,
    ) -> anyhow::Result<Self> {
        let (b, t, d) = (brokers.to_owned(), topic.clone(), dead_letter.clone());
        off_thread("create the topics", move || {
            let admin: AdminClient<DefaultClientContext> =
                ClientConfig::new().set("bootstrap.servers", &b).create()?;
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let opts =
                AdminOptions::new().operation_timeout(Some(TIMEOUT)).request_timeout(Some(TIMEOUT));
            let topics = [
                NewTopic::new(&t, PARTITIONS, TopicReplication::Fixed(1)),
                NewTopic::new(&d, 1, TopicReplication::Fixed(1)),
            ];
            for r in rt.block_on(admin.create_topics(&topics, &opts))? {
                r.map_err(|(name, e)| anyhow!("creating topic {name}: {e}"))?;
            }
            Ok(())
        })
        .await
        .with_context(|| format!("Kafka at {brokers}"))?;
        // One record per batch: tansu 0.6 skips records when a fetch starts inside a batch.
        let mut pc = ClientConfig::new();
        pc.set("bootstrap.servers", brokers).set("batch.num.messages", "1").set("linger.ms", "5");
        // Keyless records spread over every partition: with librdkafka's sticky partitioner a
        // burst lands on one or two, which leaves the third untested.
        pc.set("sticky.partitioning.linger.ms", "0");
        let publisher = KafkaPublisher::with_config(&pc)?;
        let dead_letter_queue = KafkaDeadLetters::new(brokers, dead_letter)?;
        Ok(Self { brokers: brokers.to_owned(), topic, dead_letter_queue, publisher })
    }

    pub(crate) async fn publish(
        &self,
        chunk: &[OutboxMessage],
    ) -> Vec<Result<(), idem::outbox::PublishError>> {
        self.publisher.publish(chunk).await
    }

    /// Records of the topic past the group's committed offsets.
    pub(crate) async fn backlog(&self) -> anyhow::Result<u64> {
        let (brokers, topic) = (self.brokers.clone(), self.topic.clone());
        off_thread("read the group's lag", move || {
            let mut cfg = consumer_config(&brokers, &topic);
            cfg.set("enable.auto.commit", "false");
            let c: BaseConsumer = cfg.create()?;
            let mut tpl = TopicPartitionList::new();
            for p in 0..PARTITIONS {
                tpl.add_partition(&topic, p);
            }
            let committed = c.committed_offsets(tpl, TIMEOUT)?;
            let mut left = 0u64;
            for e in committed.elements() {
                let (low, high) = c.fetch_watermarks(&topic, e.partition(), TIMEOUT)?;
                let done = match e.offset() {
                    Offset::Offset(o) => o,
                    _ => low,
                };
                left += u64::try_from(high - done).unwrap_or(0);
            }
            Ok(left)
        })
        .await
    }

    /// Partitions of the topic holding at least one record (a keyless burst can leave one
    /// empty: librdkafka's sticky partitioner).
    pub(crate) async fn partitions_used(&self) -> anyhow::Result<i64> {
        let (brokers, topic) = (self.brokers.clone(), self.topic.clone());
        off_thread("read the topic's watermarks", move || {
            let mut cfg = consumer_config(&brokers, &topic);
            cfg.set("enable.auto.commit", "false");
            let c: BaseConsumer = cfg.create()?;
            let mut used = 0;
            for p in 0..PARTITIONS {
                let (low, high) = c.fetch_watermarks(&topic, p, TIMEOUT)?;
                used += i64::from(high > low);
            }
            Ok(used)
        })
        .await
    }

    /// The ids in the dead-letter topic, read from its start to its end as `idem dlq` reads
    /// it (past a broker's short high watermark too).
    pub(crate) async fn dead_letters(&self) -> anyhow::Result<HashSet<String>> {
        let letters = self.dead_letter_queue.read(usize::MAX).await?;
        letters.iter().map(|l| super::broker::payload_id(&l.payload)).collect()
    }

    pub(crate) async fn delete(&self) -> anyhow::Result<()> {
        let (b, t) = (self.brokers.clone(), self.topic.clone());
        let d = self.dead_letter_queue.topic().to_owned();
        off_thread("delete the topics", move || {
            let admin: AdminClient<DefaultClientContext> =
                ClientConfig::new().set("bootstrap.servers", &b).create()?;
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let opts = AdminOptions::new().operation_timeout(Some(TIMEOUT));
            rt.block_on(admin.delete_topics(&[t.as_str(), d.as_str()], &opts))?;
            Ok(())
        })
        .await
    }
}
