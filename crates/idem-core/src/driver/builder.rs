//! Building a [`Driver`]: the broker side, then the store or the inbox.

use std::sync::Arc;
use std::time::Duration;

use super::{Driver, Error, Hook, Opening, Settlement, Source, SourceConfig};
use crate::consumer::Backend;
use crate::{Consumer, DedupStore};

/// What to do when fetching fails.
///
/// Default: retry, waiting `backoff` (1 s) between tries, and stop the run after 10 failures
/// in a row. A source can also declare an error fatal (its channel is gone), which stops the
/// run at once.
///
/// ```
/// use std::time::Duration;
/// use idem_core::driver::FetchFailures;
///
/// let patient = FetchFailures::new(100, Duration::from_millis(500));
/// assert_eq!(patient.max_in_a_row, 100);
/// assert_eq!(FetchFailures::stop_at_first().max_in_a_row, 1);
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

    /// Stop at the first failure.
    pub fn stop_at_first() -> Self {
        Self::new(1, Duration::ZERO)
    }
}

/// How the driver fetches and bounds broker calls.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) batch: usize,
    pub(crate) idle_wait: Duration,
    pub(crate) fetch_failures: FetchFailures,
    pub(crate) broker_timeout: Duration,
    pub(crate) concurrency: usize,
}

enum Mode<B> {
    Unset,
    Store(B),
    Engine(Consumer<B>),
}

/// Builds a [`Driver`]: the broker side first ([`Driver::builder`]), then either a store
/// (two-phase) or an inbox (transactional), then the scope.
///
/// Defaults: batches of up to 64 messages, one batch in flight, wait up to 1 s for a first
/// message, broker calls bounded at 30 s, [`FetchFailures::default`].
///
/// ```
/// use idem_core::{Driver, MemoryStore, driver::MemoryQueue};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let consumer = Driver::builder(MemoryQueue::new())
///     .store(MemoryStore::new())          // or .inbox(store.inbox(retain)), or .engine(consumer)
///     .scope("billing")
///     .batch(32)
///     .build()
///     .await?;
/// assert_eq!(consumer.consumer().scope(), "billing");
/// # Ok(()) }
/// ```
#[must_use]
pub struct Builder<C: SourceConfig, B = ()> {
    config: C,
    mode: Mode<B>,
    scope: Option<String>,
    settings: Settings,
    hook: Option<Hook<<C::Source as Source>::Message>>,
}

impl<C: SourceConfig> Builder<C, ()> {
    pub(crate) fn new(config: C) -> Self {
        Self {
            config,
            mode: Mode::Unset,
            scope: None,
            settings: Settings {
                batch: 64,
                idle_wait: Duration::from_secs(1),
                fetch_failures: FetchFailures::default(),
                broker_timeout: Duration::from_secs(30),
                concurrency: 1,
            },
            hook: None,
        }
    }

    fn with<B>(self, mode: Mode<B>) -> Builder<C, B> {
        Builder {
            config: self.config,
            mode,
            scope: self.scope,
            settings: self.settings,
            hook: self.hook,
        }
    }

    /// **Two-phase mode** over `store`: each batch is claimed with one `claim_many`, the
    /// acquired handlers run under leases (they get a [`Context`](crate::consumer::Context)
    /// with the downstream idempotency key), and their completions are recorded with one
    /// `complete_many`. For effects outside the database: a payment API, an e-mail.
    pub fn store<S: DedupStore>(self, store: S) -> Builder<C, S> {
        self.with(Mode::Store(store))
    }

    /// **Transactional-inbox mode** over `inbox` (`store.inbox(retain)` of a SQL store): each
    /// batch's markers and the handlers' writes commit in one database transaction, which the
    /// handler receives. For effects in that database.
    pub fn inbox<I: Backend>(self, inbox: I) -> Builder<C, I> {
        self.with(Mode::Store(inbox))
    }

    /// Either mode with an engine built by [`Consumer::builder`], for settings beyond the
    /// scope: key extractor, fingerprint, lease, heartbeat, retention check.
    pub fn engine<B: Backend>(self, engine: Consumer<B>) -> Builder<C, B> {
        self.with(Mode::Engine(engine))
    }
}

impl<C: SourceConfig, B> Builder<C, B> {
    /// The consumer's identity (a consumer group, a handler name): required with
    /// [`store`](Builder::store) and [`inbox`](Builder::inbox); an engine brings its own.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// The most messages fetched, claimed and committed together (at least 1).
    pub fn batch(mut self, n: usize) -> Self {
        self.settings.batch = n.max(1);
        self
    }

    /// How many batches are in flight at once (default 1, at least 1): each is its own
    /// fetch → decide → settle loop over the same source and engine, so one batch's broker round
    /// trips and database commit overlap another's. Above 1 the order of messages between
    /// batches is lost (on Kafka: the order within a partition) — keys still run exactly once;
    /// in inbox mode each batch holds its own connection (SQLite's single writer serializes
    /// them).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.settings.concurrency = n.max(1);
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
    /// lost and the run stops with [`Error::BrokerTimeout`] (default 30 s; at least 1 ms).
    pub fn broker_timeout(mut self, d: Duration) -> Self {
        self.settings.broker_timeout = d.max(Duration::from_millis(1));
        self
    }

    /// Called for every message once its outcome (and any dead-letter copy) is durable, just
    /// before the broker is told: for logs, metrics, tests.
    pub fn on_settle(
        mut self,
        hook: impl Fn(&Settlement<'_, <C::Source as Source>::Message>) + Send + Sync + 'static,
    ) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }
}

impl<C: SourceConfig, B: Backend> Builder<C, B> {
    /// Builds the engine, runs the store's checks ([`DedupStore::check`]: its table exists
    /// with the columns it needs), then opens the source, which checks the broker's redelivery
    /// window against the engine's retention (and the rest of the broker's configuration).
    ///
    /// # Errors
    /// [`Error::Builder`] without a store, inbox or engine, or with a scope given twice;
    /// [`Error::Config`] for a missing or invalid scope; [`Error::Store`] when the store is
    /// not ready (a table not created: the message names the `migrate()` to run);
    /// [`Error::Open`] when the source cannot open or refuses the configuration.
    pub async fn build(self) -> Result<Driver<C::Source, B>, Error<<C::Source as Source>::Error>> {
        let consumer = match self.mode {
            Mode::Unset => {
                return Err(Error::Builder(
                    "no store: call .store(store) (two-phase), .inbox(store.inbox(retain)) or .engine(consumer)",
                ));
            }
            Mode::Engine(_) if self.scope.is_some() => {
                return Err(Error::Builder(
                    "the scope is set on the engine; do not set it on the builder too",
                ));
            }
            Mode::Engine(c) => c,
            Mode::Store(s) => {
                let mut b = Consumer::builder(s);
                if let Some(scope) = self.scope {
                    b = b.scope(scope);
                }
                b.build()?
            }
        };
        B::check(&consumer).await.map_err(Error::Store)?;
        let opening = Opening {
            scope: consumer.scope(),
            retention: B::retention(&consumer),
            lease: B::lease(&consumer),
            heartbeat: consumer.heartbeat(),
            batch: self.settings.batch,
            concurrency: self.settings.concurrency,
        };
        let source = self.config.open(opening).await.map_err(Error::Open)?;
        Ok(Driver { source, consumer, settings: self.settings, hook: self.hook })
    }
}
