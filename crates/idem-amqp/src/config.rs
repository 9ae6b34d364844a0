//! What is specific to RabbitMQ in a consumer's settings, and opening the source.

use std::time::Duration;

use idem_core::consumer::{Opening, SourceConfig};
use lapin::Connection;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions};
use lapin::types::FieldTable;

use crate::source::AmqpSource;
use crate::{Error, RabbitWindow, Topology};

/// A RabbitMQ queue's settings for the consumer. Only the connection and the queue are required;
/// batch size, idle wait and broker timeouts are the consumer's
/// ([`Builder`](idem_core::consumer::Builder)).
///
/// Defaults: prefetch 128 (at least the consumer's batch), no extra gathering after the first
/// delivery, "in progress elsewhere" delays clamped to 1 s – 5 min, the
/// [`Topology::for_queue`] companions, consumer tag `idem-<scope>-<random>`, no retention check
/// (set one with [`redelivery_window`](Self::redelivery_window)).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_amqp::{AmqpConfig, AmqpConsumer, RabbitWindow};
/// use idem_core::MemoryStore;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let conn = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
/// let config = AmqpConfig::new(&conn, "payments")
///     .prefetch(256)
///     .batch_wait(Duration::from_millis(2))
///     .retry_delay(Duration::from_millis(500), Duration::from_secs(60))
///     .redelivery_window(RabbitWindow::new().delivery_limit(10));
/// let consumer = AmqpConsumer::builder(config)
///     .store(MemoryStore::new())
///     .scope("payments")
///     .batch(64)
///     .build()
///     .await?;
/// # drop(consumer); Ok(()) }
/// ```
#[derive(Debug)]
#[must_use]
pub struct AmqpConfig<'c> {
    conn: &'c Connection,
    topology: Topology,
    prefetch: u16,
    batch_wait: Duration,
    min_delay: Duration,
    max_delay: Duration,
    window: Option<RabbitWindow>,
    tag: Option<String>,
}

impl<'c> AmqpConfig<'c> {
    /// Consumes `queue` (which must exist) over `conn`, on two channels of its own.
    pub fn new(conn: &'c Connection, queue: impl Into<String>) -> Self {
        Self {
            conn,
            topology: Topology::for_queue(queue),
            prefetch: 128,
            batch_wait: Duration::ZERO,
            min_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            window: None,
            tag: None,
        }
    }

    /// How many unacked deliveries the broker may push to this consumer (`basic.qos`). At least
    /// the consumer's batch, or batches could never fill; `batch × concurrency` lets every batch in
    /// flight fill, and twice that keeps the next batches arriving while those are decided.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n;
        self
    }

    /// After the first delivery of a batch, wait up to `d` for more until the batch is full:
    /// bigger batches (fewer commits) when messages trickle in, at the cost of that latency.
    pub fn batch_wait(mut self, d: Duration) -> Self {
        self.batch_wait = d;
        self
    }

    /// Bounds for the delay of an "in progress elsewhere" retry (the other lease's remaining
    /// time, clamped). RabbitMQ expires per-message TTLs only at the head of the delay queue, so
    /// a narrow range keeps a short delay from waiting behind a long one.
    pub fn retry_delay(mut self, min: Duration, max: Duration) -> Self {
        self.min_delay = min;
        self.max_delay = max;
        self
    }

    /// Other names for the delay queue and dead-letter exchange.
    pub fn topology(mut self, topology: Topology) -> Self {
        self.topology = topology;
        self
    }

    /// Checks when the consumer is built that its retention covers this queue's redelivery
    /// window.
    pub fn redelivery_window(mut self, window: RabbitWindow) -> Self {
        self.window = Some(window);
        self
    }

    /// The consumer tag (at most 255 bytes).
    pub fn consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.tag = Some(tag.into());
        self
    }
}

impl SourceConfig for AmqpConfig<'_> {
    type Source = AmqpSource;

    /// Checks the settings, the [topology](Topology#dead-letters-that-would-come-back) and the
    /// redelivery window, opens a consuming channel (with the prefetch) and a publishing channel
    /// (with publisher confirms), checks the work queue exists, declares the delay queue and
    /// dead-letter exchange, and starts consuming.
    async fn open(self, opening: Opening<'_>) -> Result<AmqpSource, Error> {
        self.topology.check()?;
        if let Some(w) = self.window {
            w.to_redelivery_window().check(opening.retention)?;
        }
        if self.prefetch == 0 {
            return Err(Error::Config("prefetch must be at least 1".to_owned()));
        }
        if opening.batch > usize::from(self.prefetch) {
            return Err(Error::Config(format!(
                "the consumer's batch ({}) exceeds the prefetch ({}): batches could never fill",
                opening.batch, self.prefetch
            )));
        }
        if opening.batch * opening.concurrency > usize::from(self.prefetch) {
            tracing::warn!(target: "idem", prefetch = self.prefetch, batch = opening.batch,
                concurrency = opening.concurrency,
                "the prefetch is below batch × concurrency: the batches in flight share fewer messages than they could take");
        }
        if self.min_delay.is_zero() || self.min_delay > self.max_delay {
            return Err(Error::Config(format!(
                "retry_delay needs 0 < min <= max (got {:?}, {:?})",
                self.min_delay, self.max_delay
            )));
        }
        // AMQP short strings hold 255 bytes; scopes may be longer.
        let tag = match self.tag {
            Some(t) if t.is_empty() || t.len() > 255 => {
                return Err(Error::Config(format!(
                    "consumer_tag must be 1 to 255 bytes (got {})",
                    t.len()
                )));
            }
            Some(t) => t,
            None => {
                let scope: String = opening.scope.chars().take(64).collect();
                format!("idem-{scope}-{:016x}", rand_suffix())
            }
        };
        // Without a heartbeat a connection whose peer vanished without a reset (a network
        // partition, a host that lost power) is never noticed: the consumer waits in its read
        // until the kernel gives up, which for an idle connection is never.
        if self.conn.configuration().heartbeat() == 0 {
            tracing::warn!(target: "idem",
                "the RabbitMQ connection has no heartbeat: a half-open connection would go unnoticed; add `?heartbeat=10` to the URL");
        }
        let setup = |what: &'static str| move |source| Error::Setup { what, source };
        let channel = self.conn.create_channel().await.map_err(setup("open consuming channel"))?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(setup("basic.qos"))?;
        let publisher =
            self.conn.create_channel().await.map_err(setup("open publishing channel"))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(setup("confirm.select"))?;
        self.topology.declare(&publisher).await?;
        let stream = channel
            .basic_consume(
                self.topology.queue.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(setup("basic.consume"))?;
        Ok(AmqpSource {
            channel,
            publisher,
            stream: tokio::sync::Mutex::new(stream),
            topology: self.topology,
            batch_wait: self.batch_wait,
            min_delay: self.min_delay,
            max_delay: self.max_delay,
            tag,
        })
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
