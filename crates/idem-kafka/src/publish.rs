//! Publishing outbox messages to Kafka with acknowledged produces: the outbox relay's broker.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idem_core::outbox::{OutboxMessage, PublishError, Publisher};
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};

use crate::Error;
use crate::delivery::MSG_ID_HEADER;

/// How long a produce may wait for room in librdkafka's local queue before it fails
/// (retryable); the broker's acknowledgement is then bounded by `message.timeout.ms`.
const QUEUE_TIMEOUT: Duration = Duration::from_secs(5);

/// Publishes outbox messages to Kafka, each acknowledged by the brokers: the [`Publisher`] an
/// outbox [`Relay`](idem_core::outbox::Relay) needs.
///
/// Each message is a record of its destination topic whose key is the message's ordering key
/// (so one key stays on one partition, in order; no key: librdkafka spreads them), whose value is
/// the payload, and whose headers are the message's headers plus [`message-id`](MSG_ID_HEADER) =
/// its outbox id — where [`KafkaConsumer`](crate::KafkaConsumer)'s default key extractor reads it.
/// A batch is produced at once and every delivery awaited; a message counts as published once
/// the brokers acknowledged it with `acks=all`.
///
/// The producer is idempotent (`enable.idempotence=true`): librdkafka's own retries of a
/// produce neither duplicate nor reorder records within a partition. A broker that cannot grant
/// a producer id (`InitProducerId`) fails every produce with an idempotent producer; such a
/// broker needs `enable.idempotence=false` in the configuration (the relay's retries are then
/// duplicates that consumers drop, as any republish is).
///
/// | delivery report | result |
/// | --- | --- |
/// | acknowledged | `Ok` |
/// | message or batch too large, invalid record, invalid topic name | not retryable |
/// | timed out (`message.timeout.ms`, 5 min by default; the relay's `publish_timeout` cuts the wait), unknown topic, not enough replicas, a lost connection, any other error | retryable |
///
/// After a fatal error (an idempotent producer fenced or out of sequence) the producer cannot
/// produce again: the next batch gets a new one.
///
/// ```no_run
/// use idem_core::outbox::{MemoryOutbox, OutboxStore, Outgoing, Relay};
/// use idem_kafka::KafkaPublisher;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let outbox = MemoryOutbox::new(); // or an idem-sqlx outbox, filled in your transactions
/// outbox.send(vec![Outgoing::new("orders", r#"{"order":"o-1"}"#).ordering_key("customer-7")]).await?;
/// let relay = Relay::builder(outbox, KafkaPublisher::new("127.0.0.1:9092")?).build()?;
/// assert_eq!(relay.run_until_empty().await?.published, 1);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct KafkaPublisher {
    /// Replaced after a fatal error; cloned (cheaply) for each batch.
    producer: Arc<Mutex<FutureProducer>>,
    config: ClientConfig,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("bootstrap.servers", &self.config.get("bootstrap.servers"))
            .field("enable.idempotence", &self.config.get("enable.idempotence"))
            .finish_non_exhaustive()
    }
}

impl KafkaPublisher {
    /// An idempotent producer with `acks=all` for `bootstrap_servers` (`host:port,…`).
    ///
    /// # Errors
    /// [`Error::Kafka`] when librdkafka refuses the configuration.
    pub fn new(bootstrap_servers: &str) -> Result<Self, Error> {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", bootstrap_servers);
        Self::with_config(&config)
    }

    /// A producer with `config` (SASL, TLS, `linger.ms`, `message.timeout.ms`…): `acks=all`,
    /// and `enable.idempotence=true` unless `config` sets it to `false` (for a broker that
    /// grants no producer ids). `SSL` / `SASL_SSL` and SCRAM need the crate feature `tls`
    /// (librdkafka with OpenSSL); a build without it refuses them, naming the feature.
    ///
    /// ```no_run
    /// use idem_kafka::{KafkaPublisher, rdkafka::ClientConfig};
    ///
    /// # fn main() -> Result<(), idem_kafka::Error> {
    /// let mut config = ClientConfig::new();
    /// config
    ///     .set("bootstrap.servers", "broker.example:9093")
    ///     .set("security.protocol", "SASL_SSL")
    ///     .set("sasl.mechanism", "PLAIN");
    /// let publisher = KafkaPublisher::with_config(&config)?; // needs the feature `tls`
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::MissingSetting`] without `bootstrap.servers`; [`Error::Setting`] when `acks`
    /// is anything but `all` (or `-1`): a message must be on every in-sync replica before the
    /// relay forgets it, or when TLS or SCRAM is asked of a build without the feature `tls`;
    /// [`Error::Kafka`] when librdkafka refuses the configuration.
    pub fn with_config(config: &ClientConfig) -> Result<Self, Error> {
        if config.get("bootstrap.servers").is_none_or(str::is_empty) {
            return Err(Error::MissingSetting {
                key: "bootstrap.servers",
                why: "where the brokers are",
            });
        }
        if let Some(acks) = config.get("acks").or_else(|| config.get("request.required.acks"))
            && acks != "all"
            && acks != "-1"
        {
            return Err(Error::Setting {
                key: "acks",
                value: acks.to_owned(),
                why: "an outbox message counts as published only once every in-sync replica has it",
            });
        }
        let mut config = config.clone();
        config.set("acks", "all");
        if config.get("enable.idempotence").is_none() {
            config.set("enable.idempotence", "true");
        }
        let producer = create(&config)?;
        Ok(Self { producer: Arc::new(Mutex::new(producer)), config })
    }

    /// The producer for the next batch: the current one, or a new one if it failed fatally.
    fn producer(&self) -> Result<FutureProducer, Error> {
        let mut current = self.producer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((code, why)) = current.client().fatal_error() {
            tracing::error!(target: "idem", ?code, reason = %why,
                "the Kafka producer failed fatally; publishing with a new one");
            let old = std::mem::replace(&mut *current, create(&self.config)?);
            // Dropping a producer purges and flushes it, which blocks.
            std::thread::spawn(move || drop(old));
        }
        Ok(current.clone())
    }
}

fn create(config: &ClientConfig) -> Result<FutureProducer, Error> {
    crate::security::check(config)?;
    config.create().map_err(|e| Error::kafka("create producer", e))
}

/// Retryable unless the record can never be stored as it is.
fn classify(topic: &str, e: KafkaError) -> PublishError {
    let permanent = matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::MessageSizeTooLarge
                | RDKafkaErrorCode::MessageBatchTooLarge
                | RDKafkaErrorCode::InvalidMessageSize
                | RDKafkaErrorCode::InvalidRecord
                | RDKafkaErrorCode::InvalidTopic
        )
    );
    PublishError::new(topic, !permanent, e)
}

impl Publisher for KafkaPublisher {
    /// Produces the whole batch (librdkafka batches the records per partition), then awaits
    /// every delivery report.
    async fn publish(&self, batch: &[OutboxMessage]) -> Vec<Result<(), PublishError>> {
        let producer = match self.producer() {
            Ok(p) => p,
            Err(e) => {
                let e = Arc::new(e);
                return batch
                    .iter()
                    .map(|m| Err(PublishError::new(m.destination(), true, Arc::clone(&e))))
                    .collect();
            }
        };
        let sends = batch.iter().map(|m| {
            let mut headers = OwnedHeaders::new_with_capacity(m.headers().len() + 1);
            for (name, value) in m.headers() {
                // The id below is the outbox's; a header of that name would contradict it.
                if !name.eq_ignore_ascii_case(MSG_ID_HEADER) {
                    headers = headers.insert(Header { key: name, value: Some(value.as_bytes()) });
                }
            }
            headers = headers
                .insert(Header { key: MSG_ID_HEADER, value: Some(m.id().as_str().as_bytes()) });
            let mut record: FutureRecord<'_, str, [u8]> =
                FutureRecord::to(m.destination()).payload(m.payload()).headers(headers);
            if let Some(k) = m.ordering_key() {
                record = record.key(k);
            }
            let producer = &producer;
            async move {
                match producer.send(record, QUEUE_TIMEOUT).await {
                    Ok(_) => Ok(()),
                    Err((e, _)) => Err(classify(m.destination(), e)),
                }
            }
        });
        futures_util::future::join_all(sends).await
    }
}
