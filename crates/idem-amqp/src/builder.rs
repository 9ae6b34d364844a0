//! Adapter configuration.

use std::sync::Arc;
use std::time::Duration;

use idem_core::{Consumer, DedupStore};
use lapin::Connection;
use lapin::options::{BasicQosOptions, ConfirmSelectOptions};

use crate::settle::Hook;
use crate::{AmqpConsumer, Error, RabbitWindow, Report, Topology};

/// Builds an [`AmqpConsumer`]: the engine and the queue are required, the rest has defaults.
///
/// Defaults: prefetch 64, batches of up to 32 deliveries gathered for at most 5 ms, delays for
/// "in progress elsewhere" clamped to 1 s – 5 min, the [`Topology::for_queue`] companions,
/// consumer tag `idem-<scope>-<random>`, no retention check (set one with
/// [`retention_window`](Self::retention_window)).
///
/// ```no_run
/// use std::time::Duration;
/// use idem_amqp::{AmqpConsumer, RabbitWindow};
/// use idem_core::{Consumer, MemoryStore, extract::Header};
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let conn = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
/// let engine = Consumer::builder(MemoryStore::new())
///     .scope("payments")
///     .key(Header::new("Idempotency-Key")) // instead of the AMQP message_id
///     .build()?;
/// let consumer = AmqpConsumer::builder(engine, "payments")
///     .prefetch(128)
///     .batch(64, Duration::from_millis(2))
///     .retention_window(RabbitWindow::new().delivery_limit(10))
///     .on_settle(|r| println!("{:?} → {} → {:?}", r.key, r.outcome, r.action))
///     .connect(&conn)
///     .await?;
/// # drop(consumer); Ok(()) }
/// ```
#[must_use]
pub struct AmqpConsumerBuilder<S> {
    pub(crate) engine: Consumer<S>,
    pub(crate) topology: Topology,
    pub(crate) prefetch: u16,
    pub(crate) batch: usize,
    pub(crate) batch_wait: Duration,
    pub(crate) min_delay: Duration,
    pub(crate) max_delay: Duration,
    pub(crate) window: Option<RabbitWindow>,
    pub(crate) tag: Option<String>,
    pub(crate) hook: Option<Hook>,
    pub(crate) broker_timeout: Duration,
}

impl<S: DedupStore> AmqpConsumerBuilder<S> {
    pub(crate) fn new(engine: Consumer<S>, queue: impl Into<String>) -> Self {
        Self {
            engine,
            topology: Topology::for_queue(queue),
            prefetch: 64,
            batch: 32,
            batch_wait: Duration::from_millis(5),
            min_delay: Duration::from_secs(1),
            max_delay: Duration::from_secs(300),
            window: None,
            tag: None,
            hook: None,
            broker_timeout: Duration::from_secs(30),
        }
    }

    /// How many unacked deliveries the broker may push to this consumer (`basic.qos`).
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n;
        self
    }

    /// Deliveries gathered into one batch (one `claim_many`), and how long to wait for more
    /// after the first. At most the prefetch.
    pub fn batch(mut self, max: usize, wait: Duration) -> Self {
        self.batch = max;
        self.batch_wait = wait;
        self
    }

    /// Bounds for the delay of an "in progress elsewhere" retry (the other lease's remaining
    /// time, clamped).
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

    /// Checks at startup that the engine's retention covers this queue's redelivery window.
    pub fn retention_window(mut self, window: RabbitWindow) -> Self {
        self.window = Some(window);
        self
    }

    /// The consumer tag.
    pub fn consumer_tag(mut self, tag: impl Into<String>) -> Self {
        self.tag = Some(tag.into());
        self
    }

    /// How long an ack or nack, or a dead-letter or delay copy with its publisher confirm, may
    /// take before the consumer takes its connection for lost and stops with
    /// [`Error::BrokerTimeout`] (default 30 s; at least 1 ms). lapin was seen to leave an ack
    /// pending forever once its connection had failed. Unacked messages are redelivered, and the
    /// store makes the copies duplicates.
    pub fn broker_timeout(mut self, d: Duration) -> Self {
        self.broker_timeout = d.max(Duration::from_millis(1));
        self
    }

    /// Called for every delivery once its outcome is decided (and, in inbox mode, committed),
    /// just before the broker verb is sent: for logs, metrics, tests.
    pub fn on_settle(mut self, hook: impl Fn(&Report<'_>) + Send + Sync + 'static) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// Checks the configuration and the retention window, opens a consuming channel (with the
    /// prefetch) and a publishing channel (with publisher confirms), checks the work queue
    /// exists and declares the delay queue and dead-letter exchange.
    ///
    /// # Errors
    /// [`Error::Retention`] when the retention is shorter than the window, [`Error::Config`],
    /// [`Error::Setup`] and [`Error::Topology`] for broker failures.
    pub async fn connect(self, conn: &Connection) -> Result<AmqpConsumer<S>, Error> {
        if let Some(w) = self.window {
            w.to_retention_window().check(self.engine.retain())?;
        }
        if self.prefetch == 0 {
            return Err(Error::Config("prefetch must be at least 1"));
        }
        if self.batch == 0 || self.batch > usize::from(self.prefetch) {
            return Err(Error::Config("batch must be between 1 and the prefetch"));
        }
        if self.min_delay.is_zero() || self.min_delay > self.max_delay {
            return Err(Error::Config("retry delays need 0 < min <= max"));
        }
        let setup = |what: &'static str| move |source| Error::Setup { what, source };
        let channel = conn.create_channel().await.map_err(setup("open consuming channel"))?;
        channel
            .basic_qos(self.prefetch, BasicQosOptions::default())
            .await
            .map_err(setup("basic.qos"))?;
        let publisher = conn.create_channel().await.map_err(setup("open publishing channel"))?;
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(setup("confirm.select"))?;
        self.topology.declare(&publisher).await?;
        // AMQP short strings hold 255 bytes; scopes may be longer.
        let tag = self.tag.unwrap_or_else(|| {
            let scope: String = self.engine.scope().chars().take(64).collect();
            format!("idem-{scope}-{:016x}", rand_suffix())
        });
        Ok(AmqpConsumer {
            engine: self.engine,
            channel,
            publisher,
            topology: self.topology,
            batch: self.batch,
            batch_wait: self.batch_wait,
            min_delay: self.min_delay,
            max_delay: self.max_delay,
            tag,
            hook: self.hook,
            broker_timeout: self.broker_timeout,
        })
    }
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}
