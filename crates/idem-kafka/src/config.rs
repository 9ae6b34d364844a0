//! What is specific to Kafka in a consumer's settings, and opening the source.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::RedeliveryWindow;
use idem_core::consumer::{Opening, SourceConfig};
use idem_core::inbox::PositionReader;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::producer::FutureProducer;

use crate::Error;
use crate::rebalance::Ctx;
use crate::source::{KafkaSource, State};

/// A Kafka consumer group's settings for the consumer: what is specific to Kafka. Batch size,
/// idle wait and broker timeouts are the consumer's ([`Builder`](idem_core::consumer::Builder)).
///
/// Defaults: gather a batch for at most 5 ms once a first message arrived; retry transient
/// failures after 1 s (a key in progress elsewhere after the other lease, at most that long);
/// wait up to 30 s for the broker to acknowledge a dead-letter produce; close within 10 s.
///
/// ```
/// use std::time::Duration;
/// use idem_kafka::{KafkaConfig, rdkafka::ClientConfig};
///
/// let mut config = ClientConfig::new();
/// config.set("bootstrap.servers", "127.0.0.1:9092").set("group.id", "billing");
/// let kafka = KafkaConfig::new(&config, &["orders"], "dlq.orders").retry_delay(Duration::from_secs(5));
/// ```
///
/// `Debug` shows the brokers, the group and the names of the other settings, never a value that
/// could be a credential (`sasl.password`, `ssl.key.pem`, `sasl.oauthbearer.config`…).
#[must_use]
pub struct KafkaConfig {
    config: ClientConfig,
    topics: Vec<String>,
    dead_letter: String,
    batch_wait: Duration,
    retry_delay: Duration,
    produce_timeout: Duration,
    close_timeout: Duration,
    redelivery_window: Option<Duration>,
    positions: Option<Arc<dyn PositionReader>>,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // rdkafka's own Debug leaves out five password keys but shows `ssl.key.pem` (a private
        // key) and `sasl.oauthbearer.config` (which may hold a client secret): names only.
        let settings: Vec<&str> = self.config.config_map().into_keys().collect();
        f.debug_struct("KafkaConfig")
            .field("bootstrap.servers", &self.config.get("bootstrap.servers"))
            .field("group.id", &self.config.get("group.id"))
            .field("settings", &settings)
            .field("topics", &self.topics)
            .field("dead_letter", &self.dead_letter)
            .field("batch_wait", &self.batch_wait)
            .field("retry_delay", &self.retry_delay)
            .field("produce_timeout", &self.produce_timeout)
            .field("close_timeout", &self.close_timeout)
            .field("redelivery_window", &self.redelivery_window)
            .field("stored_positions", &self.positions.is_some())
            .finish()
    }
}

impl KafkaConfig {
    /// Consumes `topics` (names, or patterns starting with `^`) with `config` (needs
    /// `bootstrap.servers` and `group.id`; idem sets `enable.auto.commit` and
    /// `enable.auto.offset.store` to `false`, and `auto.offset.reset` to `earliest` unless
    /// given) and dead-letters to `dead_letter_topic` (produced with `acks=all` on the same
    /// brokers, with every security setting of `config`). The dead-letter topic must be one the
    /// subscription does not take, by name or by pattern (`^orders.*` takes `orders.dlq`; use
    /// `dlq.orders`): opening fails with [`Error::DeadLetterLoop`] otherwise, since each dead
    /// letter would come back as a new message and be processed.
    pub fn new(
        config: &ClientConfig,
        topics: &[&str],
        dead_letter_topic: impl Into<String>,
    ) -> Self {
        Self {
            config: config.clone(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            dead_letter: dead_letter_topic.into(),
            batch_wait: Duration::from_millis(5),
            retry_delay: Duration::from_secs(1),
            produce_timeout: Duration::from_secs(30),
            close_timeout: Duration::from_secs(10),
            redelivery_window: None,
            positions: None,
        }
    }

    /// Seeks each partition, when it is assigned, to the position an
    /// [`OffsetInbox`](idem_core::inbox::OffsetInbox) stored for it (pass the same inbox as
    /// the consumer's): the group then resumes where the database says, not where the group's
    /// Kafka offset says. Duplicates below the stored position are skipped either way; the seek
    /// spares reading them.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_core::inbox::{OffsetInbox, TxPositions};
    /// use idem_kafka::{KafkaConfig, rdkafka::ClientConfig};
    ///
    /// fn kafka<I: TxPositions + Clone>(inbox: &OffsetInbox<I>) -> KafkaConfig {
    ///     let mut config = ClientConfig::new();
    ///     config.set("bootstrap.servers", "127.0.0.1:9092").set("group.id", "billing");
    ///     KafkaConfig::new(&config, &["orders"], "dlq.orders").stored_positions(inbox.clone())
    /// }
    /// ```
    pub fn stored_positions(mut self, reader: impl PositionReader) -> Self {
        self.positions = Some(Arc::new(reader));
        self
    }

    /// How long to keep gathering a batch after its first message arrived.
    pub fn batch_wait(mut self, d: Duration) -> Self {
        self.batch_wait = d;
        self
    }

    /// The delay before a transiently failed message is tried again, and the longest wait for a
    /// key in progress elsewhere (its partition is paused meanwhile, and no offset is committed
    /// past it).
    pub fn retry_delay(mut self, d: Duration) -> Self {
        self.retry_delay = d;
        self
    }

    /// How long to wait for the broker to acknowledge a dead-letter produce before the message
    /// is retried instead.
    pub fn produce_timeout(mut self, d: Duration) -> Self {
        self.produce_timeout = d;
        self
    }

    /// States the consumed topics' redelivery window — how long they keep messages
    /// (`retention.ms`), since a replay from an old offset redelivers anything the log still
    /// holds — instead of asking the brokers: for brokers that do not answer `DescribeConfigs`
    /// (Azure Event Hubs' Kafka endpoint did not for years) or whose answer does not hold.
    /// Opening then fails with [`Error::Retention`] when the dedup records are kept for less,
    /// and the brokers are not asked. Without it the brokers are asked and a shorter dedup
    /// retention is only logged (see [`KafkaSource::retention_gaps`](crate::KafkaSource::retention_gaps)).
    pub fn redelivery_window(mut self, topic_retention: Duration) -> Self {
        self.redelivery_window = Some(topic_retention);
        self
    }

    /// How long leaving the group may take when the run ends (librdkafka's close was seen to
    /// hang; it is left to finish in the background after this).
    pub fn close_timeout(mut self, d: Duration) -> Self {
        self.close_timeout = d;
        self
    }
}

fn check_config(config: &ClientConfig) -> Result<(), Error> {
    crate::security::check(config)?;
    if config.get("group.id").is_none_or(str::is_empty) {
        return Err(Error::MissingSetting {
            key: "group.id",
            why: "offsets are committed for a consumer group",
        });
    }
    if config.get("bootstrap.servers").is_none_or(str::is_empty) {
        return Err(Error::MissingSetting {
            key: "bootstrap.servers",
            why: "where the brokers are",
        });
    }
    for (key, why) in [
        (
            "enable.auto.commit",
            "idem commits each partition's offset itself, only up to the last message whose outcome is durable",
        ),
        ("enable.auto.offset.store", "idem stores offsets itself, only for settled messages"),
    ] {
        if let Some(v) = config.get(key)
            && v != "false"
        {
            return Err(Error::Setting { key, value: v.to_owned(), why });
        }
    }
    Ok(())
}

/// The settings a producer or admin client needs to reach the same brokers as `config`: the
/// addresses, the client id, every security, SASL and SSL setting (credentials included), and
/// the socket and connection-lifetime settings (a load balancer that drops idle connections,
/// as Azure's does after 240 s, drops the producer's too).
pub(crate) fn connection_config(config: &ClientConfig) -> ClientConfig {
    const EXACT: [&str; 5] = [
        "bootstrap.servers",
        "client.id",
        "broker.address.family",
        "metadata.max.age.ms",
        "connections.max.idle.ms",
    ];
    const PREFIXES: [&str; 4] = ["security.", "sasl.", "ssl.", "socket."];
    let mut out = ClientConfig::new();
    // `config_map` masks secrets in its values, so only its keys are used.
    for key in config.config_map().into_keys() {
        if (EXACT.contains(&key) || PREFIXES.iter().any(|p| key.starts_with(p)))
            && let Some(v) = config.get(key)
        {
            out.set(key, v);
        }
    }
    out
}

impl SourceConfig for KafkaConfig {
    type Source = KafkaSource;

    /// Checks the settings, creates the consumer (subscribed) and the dead-letter producer, and
    /// logs a warning for every consumed topic whose log outlives the dedup records (or, with a
    /// [stated redelivery window](KafkaConfig::redelivery_window), fails when it is longer than theirs).
    async fn open(self, opening: Opening<'_>) -> Result<KafkaSource, Error> {
        check_config(&self.config)?;
        if let Some(topic_retention) = self.redelivery_window {
            // Kafka redelivers nothing on a timer: the window is how long a message may wait in
            // the log to be read again.
            RedeliveryWindow::new(0, Duration::ZERO)
                .message_ttl(topic_retention)
                .check(opening.retention)?;
        }
        if self.topics.is_empty() {
            return Err(Error::Topics("at least one topic is needed"));
        }
        if self.topics.iter().any(String::is_empty) || self.dead_letter.is_empty() {
            return Err(Error::Topics("a topic name is empty"));
        }
        crate::subscription::check(&self.topics, &self.dead_letter)?;
        let mut cc = self.config.clone();
        cc.set("enable.auto.commit", "false").set("enable.auto.offset.store", "false");
        if cc.get("auto.offset.reset").is_none() {
            cc.set("auto.offset.reset", "earliest");
        }
        let state = Arc::new(Mutex::new(State::default()));
        let consumer: StreamConsumer<Ctx> = cc
            .create_with_context(Ctx::new(Arc::clone(&state)))
            .map_err(|e| Error::kafka("create consumer", e))?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics).map_err(|e| Error::kafka("subscribe", e))?;
        let conn = connection_config(&self.config);
        let mut pc = conn.clone();
        pc.set("acks", "all")
            .set("message.timeout.ms", self.produce_timeout.as_millis().to_string());
        let producer: FutureProducer =
            pc.create().map_err(|e| Error::kafka("create dead-letter producer", e))?;
        let source = KafkaSource {
            consumer: Mutex::new(Some(Arc::new(consumer))),
            producer,
            conn,
            topics: self.topics,
            dead_letter: self.dead_letter,
            batch_wait: self.batch_wait,
            retry_delay: self.retry_delay,
            produce_timeout: self.produce_timeout,
            close_timeout: self.close_timeout,
            retention: opening.retention,
            state,
            positions: self.positions,
            scope: opening.scope.to_owned(),
        };
        // An offset inbox knows redeliveries by their offsets: no log retention is too long.
        if self.redelivery_window.is_none() && opening.retention != Duration::MAX {
            source.warn_retention().await;
        }
        Ok(source)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_shows_no_credential() {
        const SECRET: &str = "PlantedSecret42";
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", "b1:9093").set("group.id", "g");
        c.set("sasl.username", "app").set("sasl.password", SECRET);
        c.set("ssl.key.pem", format!("-----BEGIN PRIVATE KEY-----{SECRET}"));
        c.set("sasl.oauthbearer.config", format!("clientSecret={SECRET}"));
        let d = format!("{:?}", KafkaConfig::new(&c, &["orders"], "dlq"));
        assert!(!d.contains(SECRET), "{d}");
        assert!(d.contains("b1:9093") && d.contains("ssl.key.pem") && d.contains("orders"), "{d}");
        let p = crate::KafkaPublisher::with_config(&c).unwrap();
        assert!(!format!("{p:?}").contains(SECRET), "{p:?}");
    }
}
