//! Two-phase mode: the idem [`Consumer`] engine over any [`DedupStore`].

use std::fmt::Display;
use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;

use idem_core::consumer::{Context, HandlerError};
use idem_core::{Consumer, DedupStore};
use rdkafka::config::ClientConfig;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::source::{Decide, Decider, Decision, Hook, Settled, Source};
use crate::{Delivery, Error, Report, RetentionGap, Settings};

/// A Kafka consumer-group consumer made idempotent by the idem engine (two-phase: claim with a
/// lease, run the handler, record completion, then commit the offset).
///
/// Auto-commit is off. Messages polled together are claimed in one `claim_many` round trip and
/// their handlers run concurrently; each partition's offset is committed only up to the last
/// message whose outcome is durable — processed, duplicate, or produced to the dead-letter
/// topic and acknowledged — never past one still in flight or waiting for a retry. A key in
/// progress elsewhere, or a transient failure, pauses the partition and retries that message
/// after the other lease's remaining time (or [`Settings::retry_delay`]).
///
/// Rebalances: revocations are reported inside a poll, and the adapter polls only between
/// batches, so handlers in flight always finish (and their offsets are committed) before a
/// partition is given up. Messages of a revoked partition already polled (or waiting for a
/// retry) are still processed, but their offsets are no longer committed; the new owner resumes
/// at the committed offset, and the store makes whichever copy comes second a duplicate.
///
/// ```no_run
/// use idem_core::{Consumer, consumer::HandlerError};
/// use idem_kafka::{KafkaConsumer, Settings, rdkafka::ClientConfig};
/// use idem_sqlx::SqliteStore;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut config = ClientConfig::new();
/// config.set("bootstrap.servers", "127.0.0.1:9092").set("group.id", "billing");
/// let dedup = Consumer::builder(SqliteStore::open("idem.sqlite").await?).scope("billing").build()?;
/// let kafka = KafkaConsumer::new(&config, &["orders"], dedup, Settings::new("orders.dlq"))?;
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// # drop(stop);
/// let report = kafka.run(|ctx, msg| {
///     let cents = msg.payload_bytes().len();
///     async move {
///         // charge the customer, passing ctx.downstream_key() as the payment's idempotency key
///         Ok::<_, HandlerError<std::io::Error>>(cents)
///     }
/// }, async { let _ = stopped.await; }).await?;
/// println!("{report}");
/// kafka.close(std::time::Duration::from_secs(10)).await;
/// # Ok(()) }
/// ```
pub struct KafkaConsumer<S> {
    source: Source,
    dedup: Consumer<S>,
}

impl<S> std::fmt::Debug for KafkaConsumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConsumer").field("dedup", &self.dedup).finish_non_exhaustive()
    }
}

impl<S: DedupStore> KafkaConsumer<S> {
    /// Creates the consumer from `config` (needs `bootstrap.servers` and `group.id`; idem sets
    /// `enable.auto.commit` and `enable.auto.offset.store` to `false`, and
    /// `auto.offset.reset` to `earliest` unless given) and subscribes to `topics`. A producer
    /// on the same brokers writes the dead letters with `acks=all`.
    ///
    /// # Errors
    /// [`Error::Setting`] when `config` turns auto-commit on, [`Error::MissingSetting`],
    /// [`Error::Topics`], or [`Error::Kafka`] when the client cannot be created.
    pub fn new(
        config: &ClientConfig,
        topics: &[&str],
        dedup: Consumer<S>,
        settings: Settings,
    ) -> Result<Self, Error> {
        Ok(Self { source: Source::open(config, topics, settings)?, dedup })
    }

    /// Calls `hook` for every message once its outcome is settled — after its effect and any
    /// dead letter are durable, before its offset is committed.
    #[must_use]
    pub fn with_hook(mut self, hook: impl Fn(&Settled<'_>) + Send + Sync + 'static) -> Self {
        self.source.hook = Some(std::sync::Arc::new(hook) as Hook);
        self
    }

    /// The dedup engine.
    pub fn dedup(&self) -> &Consumer<S> {
        &self.dedup
    }

    /// Messages polled and not yet settled (in flight or waiting for a retry).
    pub fn open_messages(&self) -> usize {
        self.source.open_count()
    }

    /// Polls up to [`Settings::batch`] messages (due retries first), waiting up to
    /// [`Settings::idle_wait`] for a first one.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the poll fails and nothing was polled.
    pub async fn fetch(&self) -> Result<Vec<Delivery>, Error> {
        self.source.fetch().await
    }

    /// Claims the batch in one round trip, runs the acquired handlers and records their
    /// completions, then dead-letters, schedules retries and commits the durable prefix of
    /// each partition.
    pub async fn process<T, E, F, Fut>(&self, batch: Vec<Delivery>, handler: F) -> Report
    where
        T: Serialize + DeserializeOwned,
        E: Display,
        F: Fn(Context, &Delivery) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let decided = decide(&self.dedup, &batch, &handler).await;
        self.source.settle(batch, decided).await
    }

    /// Poll and process until `shutdown` completes; a batch in flight is finished and its
    /// offsets committed first. The handler's future may not borrow the delivery: take what it
    /// needs (the payload is [`Delivery::payload_bytes`]) before its `async` block.
    ///
    /// # Errors
    /// [`Error::Kafka`] after 10 polls in a row failed.
    pub async fn run<T, E, F, Fut>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Report, Error>
    where
        T: Serialize + DeserializeOwned + Send,
        E: Display + Send,
        F: Fn(Context, &Delivery) -> Fut + Sync,
        Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
        S: Sync,
    {
        self.source.warn_retention(self.dedup.retain()).await;
        let decider = TwoPhase { dedup: &self.dedup, handler: &handler, types: PhantomData };
        self.source.run(&decider, shutdown).await
    }

    /// Asks the brokers for each consumed topic's `retention.ms` and returns the topics that
    /// keep messages longer than the dedup records are retained ([`Consumer::retain`]): a replay
    /// of their older messages would run effects again. [`run`](Self::run) logs these as
    /// warnings when it starts.
    ///
    /// ```no_run
    /// # async fn f(kafka: idem_kafka::KafkaConsumer<idem_sqlx::SqliteStore>) -> Result<(), idem_kafka::Error> {
    /// for gap in kafka.retention_gaps().await? {
    ///     eprintln!("{gap}"); // topic `orders` keeps messages for 7d (retention.ms) but …
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Kafka`] when the brokers cannot be asked (10 s limit), [`Error::Broker`] when a
    /// topic's configs carry no usable `retention.ms`.
    pub async fn retention_gaps(&self) -> Result<Vec<RetentionGap>, Error> {
        self.source.retention_gaps(self.dedup.retain()).await
    }

    /// Leaves the group and closes the client on a blocking thread, giving up after `timeout`.
    /// `true` when it closed in time.
    pub async fn close(self, timeout: Duration) -> bool {
        self.source.close(timeout).await
    }
}

struct TwoPhase<'h, S, F, T, E, Fut> {
    dedup: &'h Consumer<S>,
    handler: &'h F,
    #[allow(clippy::type_complexity)]
    types: PhantomData<fn() -> (T, E, Fut)>,
}

impl<S, F, T, E, Fut> Decider for TwoPhase<'_, S, F, T, E, Fut>
where
    S: DedupStore + Sync,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
    F: Fn(Context, &Delivery) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
{
    fn decide<'a>(&'a self, batch: &'a [Delivery]) -> Decide<'a> {
        Box::pin(decide(self.dedup, batch, self.handler))
    }
}

async fn decide<S, T, E, F, Fut>(
    dedup: &Consumer<S>,
    batch: &[Delivery],
    handler: &F,
) -> Vec<Decision>
where
    S: DedupStore,
    T: Serialize + DeserializeOwned,
    E: Display,
    F: Fn(Context, &Delivery) -> Fut,
    Fut: Future<Output = Result<T, HandlerError<E>>>,
{
    dedup
        .process_batch(batch, handler)
        .await
        .into_iter()
        .map(|o| (o.label(), o.disposition()))
        .collect()
}
