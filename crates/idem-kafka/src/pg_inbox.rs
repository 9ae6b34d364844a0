//! Transactional-inbox mode on PostgreSQL: the marker and the handler's writes commit in one
//! transaction, then the offset is committed.

use std::fmt::Display;
use std::future::Future;
use std::marker::PhantomData;
use std::time::Duration;

use idem_core::consumer::HandlerError;
use idem_core::extract::{KeyExtractor, MessageId};
use idem_core::{DedupKey, FingerprintSpec};
use idem_sqlx::batch::{Prepared, prepare, transact};
use idem_sqlx::postgres::PgWrites;
use idem_sqlx::{PostgresInbox, PostgresStore};
use rdkafka::config::ClientConfig;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::postgres::{PgConnection, PgPool};

use crate::source::{Decide, Decider, Decision, Hook, Settled, Source};
use crate::{Delivery, Error, Report, RetentionGap, Settings};

/// A Kafka consumer whose handler's writes and dedup markers commit in one PostgreSQL
/// transaction per polled batch ([`PostgresInbox`]); the offsets are committed afterwards, only
/// up to the durable prefix of each partition. A crash between the database commit and the
/// offset commit redelivers the messages, and their markers make them duplicates.
///
/// Offsets, retries, dead letters and rebalances behave as in
/// [`KafkaConsumer`](crate::KafkaConsumer). The messages of a batch run one after the other in
/// offset order, each inside its own savepoint: a message whose writes fail rolls back alone
/// (a permanent failure is dead-lettered and leaves no marker, a transient one is retried), and
/// a second copy of a key in the same batch is a duplicate. Competing consumers that mark the
/// same key wait for each other on its row lock; a deadlock between two batches (PostgreSQL
/// aborts one statement) is a transient failure of that one message. Use the default
/// `READ COMMITTED` isolation.
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::consumer::HandlerError;
/// use idem_kafka::{PgInboxConsumer, Settings, rdkafka::ClientConfig};
/// use idem_sqlx::PostgresStore;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
/// store.migrate().await?;
/// let mut config = ClientConfig::new();
/// config.set("bootstrap.servers", "127.0.0.1:9092").set("group.id", "order-writer");
/// let kafka = PgInboxConsumer::new(&config, &["orders"], &store, "order-writer",
///     Duration::from_secs(7 * 86_400), Settings::new("orders.dlq"))?;
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// # drop(stop);
/// kafka.run(|tx, msg| Box::pin(async move {
///     sqlx::query("INSERT INTO orders (body) VALUES ($1)").bind(msg.payload_bytes())
///         .execute(&mut *tx).await.map_err(|e| HandlerError::Transient(e.to_string()))?;
///     Ok(())
/// }), async { let _ = stopped.await; }).await?;
/// # Ok(()) }
/// ```
pub struct PgInboxConsumer {
    source: Source,
    inbox: PostgresInbox,
    pool: PgPool,
    scope: String,
    extractor: Box<dyn KeyExtractor>,
    fingerprint: FingerprintSpec,
    retain: Duration,
}

impl std::fmt::Debug for PgInboxConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgInboxConsumer").field("scope", &self.scope).finish_non_exhaustive()
    }
}

impl PgInboxConsumer {
    /// Creates the consumer (see [`KafkaConsumer::new`](crate::KafkaConsumer::new) for the
    /// client settings) over `store`'s inbox, keeping markers for `retain` — which must outlast
    /// the topic's retention plus the longest consumer lag you allow, or a replayed message is
    /// no longer recognised. Keys come from the `message-id` header and fingerprints from the
    /// canonical JSON payload until [`with_key`](Self::with_key) /
    /// [`with_fingerprint`](Self::with_fingerprint) say otherwise.
    ///
    /// # Errors
    /// As `KafkaConsumer::new`; [`Error::InvalidScope`] for a bad scope.
    pub fn new(
        config: &ClientConfig,
        topics: &[&str],
        store: &PostgresStore,
        scope: impl Into<String>,
        retain: Duration,
        settings: Settings,
    ) -> Result<Self, Error> {
        let scope = scope.into();
        DedupKey::new(scope.clone(), "x").map_err(Error::InvalidScope)?;
        Ok(Self {
            source: Source::open(config, topics, settings)?,
            inbox: store.inbox(retain),
            retain,
            pool: store.pool().clone(),
            scope,
            extractor: Box::new(MessageId),
            fingerprint: FingerprintSpec::default(),
        })
    }

    /// Takes keys from `extractor` instead of the `message-id` header.
    #[must_use]
    pub fn with_key(mut self, extractor: impl KeyExtractor) -> Self {
        self.extractor = Box::new(extractor);
        self
    }

    /// Fingerprints payloads by `spec`.
    #[must_use]
    pub fn with_fingerprint(mut self, spec: FingerprintSpec) -> Self {
        self.fingerprint = spec;
        self
    }

    /// As [`KafkaConsumer::with_hook`](crate::KafkaConsumer::with_hook): called after the
    /// database commit (or dead letter), before the offset commit.
    #[must_use]
    pub fn with_hook(mut self, hook: impl Fn(&Settled<'_>) + Send + Sync + 'static) -> Self {
        self.source.hook = Some(std::sync::Arc::new(hook) as Hook);
        self
    }

    /// Messages polled and not yet settled.
    pub fn open_messages(&self) -> usize {
        self.source.open_count()
    }

    /// As [`KafkaConsumer::fetch`](crate::KafkaConsumer::fetch).
    ///
    /// # Errors
    /// [`Error::Kafka`] when the poll fails and nothing was polled.
    pub async fn fetch(&self) -> Result<Vec<Delivery>, Error> {
        self.source.fetch().await
    }

    /// Marks, writes and commits each message of the batch, then dead-letters, schedules
    /// retries and commits the offsets.
    pub async fn process<T, E, F>(&self, batch: Vec<Delivery>, writes: F) -> Report
    where
        T: Serialize + DeserializeOwned + Send,
        E: Display + Send,
        F: for<'c> Fn(&'c mut PgConnection, &'c Delivery) -> PgWrites<'c, T, HandlerError<E>>,
    {
        let decided = self.decide(&batch, &writes).await;
        self.source.settle(batch, decided).await
    }

    /// As [`KafkaConsumer::retention_gaps`](crate::KafkaConsumer::retention_gaps), against the
    /// markers' retention.
    ///
    /// # Errors
    /// As `KafkaConsumer::retention_gaps`.
    pub async fn retention_gaps(&self) -> Result<Vec<RetentionGap>, Error> {
        self.source.retention_gaps(self.retain).await
    }

    /// Poll and process until `shutdown` completes; a batch in flight is finished first. First
    /// it logs a warning for every topic whose log outlives the markers
    /// ([`retention_gaps`](Self::retention_gaps)).
    ///
    /// # Errors
    /// [`Error::Kafka`] after 10 polls in a row failed.
    pub async fn run<T, E, F>(
        &self,
        writes: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Report, Error>
    where
        T: Serialize + DeserializeOwned + Send,
        E: Display + Send,
        F: for<'c> Fn(&'c mut PgConnection, &'c Delivery) -> PgWrites<'c, T, HandlerError<E>>
            + Sync,
    {
        self.source.warn_retention(self.retain).await;
        let decider = Inbox { consumer: self, writes: &writes, types: PhantomData };
        self.source.run(&decider, shutdown).await
    }

    /// Leaves the group and closes the client on a blocking thread, giving up after `timeout`.
    pub async fn close(self, timeout: Duration) -> bool {
        self.source.close(timeout).await
    }

    /// The key and fingerprint of `d`, or why it can only be dead-lettered.
    fn prepare(&self, d: &Delivery) -> Prepared {
        prepare(self.extractor.as_ref(), &self.scope, &self.fingerprint, d)
    }

    /// One transaction for the batch, in offset order: each message is marked (and, the first
    /// time, written) inside its own savepoint, so a failing message rolls back alone; then one
    /// commit. If the transaction cannot begin or commit, nothing of the batch was written and
    /// every message is retried, except those that dead-letter whatever the database says.
    async fn decide<T, E, F>(&self, batch: &[Delivery], writes: &F) -> Vec<Decision>
    where
        T: Serialize + DeserializeOwned + Send,
        E: Display + Send,
        F: for<'c> Fn(&'c mut PgConnection, &'c Delivery) -> PgWrites<'c, T, HandlerError<E>>,
    {
        let items: Vec<_> = batch.iter().map(|d| (d, self.prepare(d))).collect();
        transact(&self.inbox, self.pool.begin(), items, writes).await
    }
}

struct Inbox<'h, F, T, E> {
    consumer: &'h PgInboxConsumer,
    writes: &'h F,
    types: PhantomData<fn() -> (T, E)>,
}

impl<F, T, E> Decider for Inbox<'_, F, T, E>
where
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
    F: for<'c> Fn(&'c mut PgConnection, &'c Delivery) -> PgWrites<'c, T, HandlerError<E>> + Sync,
{
    fn decide<'a>(&'a self, batch: &'a [Delivery]) -> Decide<'a> {
        Box::pin(self.consumer.decide(batch, self.writes))
    }
}
