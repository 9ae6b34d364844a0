//! Building a [`Consumer`]: the broker side, then the store or the inbox, and every engine
//! setting, on one builder.

use std::sync::Arc;
use std::time::Duration;

use super::{BuildError, Consumer, Hook, Opening, Settlement, Source, SourceConfig};
use crate::DedupStore;
use crate::engine::{Backend, Settings as EngineSettings, engine_setters};
use crate::inbox::{Inbox, OffsetInbox, TxInbox, TxPositions};

/// What to do when fetching fails.
///
/// Default: retry, waiting `backoff` (1 s) between tries, and stop the run after 10 failures
/// in a row. A source can also declare an error fatal (its channel is gone), which stops the
/// run at once.
///
/// ```
/// use std::time::Duration;
/// use idem_core::consumer::FetchFailures;
///
/// let patient = FetchFailures::new(100, Duration::from_millis(500));
/// assert_eq!(patient.max_in_a_row, 100);
/// assert_eq!(FetchFailures::new(0, Duration::ZERO).max_in_a_row, 1); // at least one
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct FetchFailures {
    /// Failed fetches in a row that end the run (at least 1).
    pub max_in_a_row: u32,
    /// The wait before the next fetch after a failure.
    pub backoff: Duration,
}

impl Default for FetchFailures {
    fn default() -> Self {
        Self { max_in_a_row: 10, backoff: Duration::from_secs(1) }
    }
}

impl FetchFailures {
    /// Stop after `max_in_a_row` failures in a row (at least 1), waiting `backoff` between.
    pub fn new(max_in_a_row: u32, backoff: Duration) -> Self {
        Self { max_in_a_row: max_in_a_row.max(1), backoff }
    }
}

/// How the consumer fetches and bounds broker calls.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) batch: usize,
    pub(crate) idle_wait: Duration,
    pub(crate) fetch_failures: FetchFailures,
    pub(crate) broker_timeout: Duration,
    pub(crate) concurrency: usize,
    pub(crate) pipelined: bool,
}

/// Builds a [`Consumer`]: the broker side first ([`Consumer::builder`]), then the backend — a
/// store (two-phase) or an inbox (transactional) — and the engine's settings, the scope among
/// them, all on this one builder.
///
/// Defaults: batches of up to 64 messages, one lane, pipelined, wait up to 1 s for a first
/// message, broker calls bounded at 30 s, [`FetchFailures::default`]; the engine's defaults
/// are [`EngineBuilder`](crate::engine::EngineBuilder)'s.
///
/// ```
/// use std::time::Duration;
/// use idem_core::{Consumer, MemoryStore, consumer::MemoryQueue};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let consumer = Consumer::builder(MemoryQueue::new())
///     .store(MemoryStore::new())          // or .inbox(store.inbox(retain))
///     .scope("billing")
///     .lease(Duration::from_secs(60))     // every engine setting is here too
///     .batch(32)
///     .build()
///     .await?;
/// assert_eq!(consumer.engine().scope(), "billing");
/// # Ok(()) }
/// ```
#[must_use]
pub struct Builder<C: SourceConfig, B = ()> {
    config: C,
    backend: B,
    engine: EngineSettings,
    settings: Settings,
    hook: Option<Hook<<C::Source as Source>::Delivery>>,
}

impl<C: SourceConfig> Builder<C, ()> {
    pub(crate) fn new(config: C) -> Self {
        Self {
            config,
            backend: (),
            engine: EngineSettings::default(),
            settings: Settings {
                batch: 64,
                idle_wait: Duration::from_secs(1),
                fetch_failures: FetchFailures::default(),
                broker_timeout: Duration::from_secs(30),
                concurrency: 1,
                pipelined: true,
            },
            hook: None,
        }
    }

    fn with<B>(self, backend: B) -> Builder<C, B> {
        Builder {
            config: self.config,
            backend,
            engine: self.engine,
            settings: self.settings,
            hook: self.hook,
        }
    }

    /// **Two-phase mode** over `store`: each batch is claimed with one `claim_many`, the
    /// acquired handlers run under leases (they get a [`Context`](crate::engine::Context)
    /// with the downstream idempotency key), and their completions are recorded with one
    /// `complete_many`. For effects outside the database: a payment API, an e-mail.
    pub fn store<S: DedupStore>(self, store: S) -> Builder<C, S> {
        self.with(store)
    }

    /// **Transactional-inbox mode** over `inbox` (`store.inbox(retain)` of a SQL store): each
    /// batch's markers and the handlers' writes commit in one database transaction, which the
    /// handler receives ([`Tx`](crate::inbox::Tx)). For effects in that database.
    pub fn inbox<I: TxInbox>(self, inbox: I) -> Builder<C, Inbox<I>> {
        self.with(Inbox::new(inbox))
    }

    /// **Offset-inbox mode**, for ordered logs (Kafka, Event Hubs): each batch commits its
    /// partitions' positions with the handlers' writes in one transaction, which the handler
    /// receives; a redelivery is recognised by its offset, with no per-message marker (see
    /// [`OffsetInbox`] for producer duplicates).
    pub fn offset_inbox<I: TxPositions>(self, inbox: OffsetInbox<I>) -> Builder<C, OffsetInbox<I>> {
        self.with(inbox)
    }
}

impl<C: SourceConfig, B> Builder<C, B> {
    engine_setters!(engine);

    /// The most messages fetched, claimed and committed together (at least 1).
    pub fn batch(mut self, n: usize) -> Self {
        self.settings.batch = n.max(1);
        self
    }

    /// How many batches are in flight at once (default 1, at least 1): each is its own
    /// fetch → decide → settle loop over the same source and engine, so one batch's broker
    /// round trips and database commit overlap another's. Above 1 the order of messages between
    /// batches is lost (on Kafka: the order within a partition) — keys still run exactly once;
    /// in inbox mode each batch holds its own connection (SQLite's single writer serializes
    /// them).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.settings.concurrency = n.max(1);
        self
    }

    /// Whether each lane overlaps its steps (default `true`): it fetches batch k + 1 — and, in
    /// two-phase mode, claims its keys — while the handlers of batch k run, and sends batch
    /// k − 1's acks meanwhile. The handlers of one lane still run one batch at a time, in order;
    /// nothing is acknowledged before its batch is durable. A lane then holds up to three
    /// batches unacknowledged (the broker's prefetch or credit should allow `3 × batch ×
    /// concurrency`), and a key redelivered while its first copy runs is claimed again when its
    /// turn comes, not answered "in progress". On a store that sends a completion and claims in
    /// one write ([`DedupStore::combines_writes`](crate::DedupStore::combines_writes): Redis),
    /// batch k + 1's claims go out with batch k's completion, one write for both.
    /// `false`: fetch, decide, settle, one after the other.
    pub fn pipeline(mut self, on: bool) -> Self {
        self.settings.pipelined = on;
        self
    }

    /// How long one fetch waits for a first message. Shutdown waits for the fetch in progress,
    /// so this bounds how long a stop takes when the broker is idle.
    pub fn idle_wait(mut self, d: Duration) -> Self {
        self.settings.idle_wait = d;
        self
    }

    /// What to do when fetching fails.
    pub fn fetch_failures(mut self, policy: FetchFailures) -> Self {
        self.settings.fetch_failures = policy;
        self
    }

    /// How long any broker call (a fetch beyond its idle wait, the dead-letter copies of a
    /// batch, the verbs of a batch, the close) may take before the connection is taken for
    /// lost and the run stops with [`Error::BrokerTimeout`](super::Error::BrokerTimeout)
    /// (default 30 s; at least 1 ms).
    pub fn broker_timeout(mut self, d: Duration) -> Self {
        self.settings.broker_timeout = d.max(Duration::from_millis(1));
        self
    }

    /// Called for every message once its outcome (and any dead-letter copy) is durable, just
    /// before the broker is told: for logs, metrics, tests.
    pub fn on_settle(
        mut self,
        hook: impl Fn(&Settlement<'_, <C::Source as Source>::Delivery>) + Send + Sync + 'static,
    ) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }
}

impl<C: SourceConfig, B: Backend> Builder<C, B> {
    /// Builds the engine, runs the store's checks (its table exists with the columns it needs),
    /// then opens the source, which checks the broker's redelivery window against the engine's
    /// retention (and the rest of the broker's configuration).
    ///
    /// # Errors
    /// [`BuildError::Config`] for a missing or invalid setting (the scope above all);
    /// [`BuildError::Store`] when the store is not ready (a table not created: the message
    /// names the `migrate()` to run); [`BuildError::Open`] when the source cannot open or
    /// refuses the configuration.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is consumed before it returns (a source opened halfway is dropped).
    pub async fn build(
        self,
    ) -> Result<Consumer<C::Source, B>, BuildError<<C::Source as Source>::Error>> {
        let engine = self.engine.build(self.backend)?;
        crate::engine::Mode::check(engine.store()).await.map_err(BuildError::Store)?;
        let opening = Opening {
            scope: engine.scope(),
            retention: B::retention(&engine),
            lease: B::lease(&engine),
            heartbeat: engine.heartbeat(),
            batch: self.settings.batch,
            concurrency: self.settings.concurrency,
        };
        let source = self.config.open(opening).await.map_err(BuildError::Open)?;
        Ok(Consumer { source, engine, settings: self.settings, hook: self.hook })
    }
}
