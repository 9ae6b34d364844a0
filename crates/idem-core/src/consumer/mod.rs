//! The consumer loop, written once for every broker.
//!
//! A broker adapter supplies a [`Source`]: how to fetch a batch, how to copy a message to the
//! dead-letter destination, how to send the final verbs. The [`Consumer`] owns everything else:
//!
//! 1. **fetch** a batch (up to [`Builder::batch`] messages, waiting up to
//!    [`Builder::idle_wait`] for a first one; failures follow [`FetchFailures`]);
//! 2. **decide** it with its [`Engine`] over its [`Backend`] — one `claim_many`, the
//!    handlers, one `complete_many` in two-phase mode; one transaction in inbox mode — while
//!    the source keeps the batch alive at the broker ([`Source::keep_alive`]);
//! 3. **dead-letter** the conflicts and permanent failures (and retries past the broker's
//!    delivery limit), waiting for the broker to confirm each copy; a copy that fails turns
//!    into a retry, never into an ack;
//! 4. **settle**: one verb per message, always last, after the effect is durable.
//!
//! | outcome | verb ([`Verb`]) |
//! | --- | --- |
//! | processed, duplicate | `Ack` |
//! | in progress elsewhere | `Retry` after the other lease's remaining time |
//! | transient failure | `Retry` (the claim was released) |
//! | conflict, permanent failure, missing key | dead-letter copy with [`headers`], then `DeadLetter` (the original is removed) |
//! | fetched while shutting down | `Release` |
//!
//! With [`Builder::concurrency`] above 1, that many of these loops run at once on one source
//! and one engine, so one batch's broker round trips and commit overlap another's.
//!
//! Every broker call is bounded by [`Builder::broker_timeout`]. Shutdown is checked between
//! batches: the batch in flight is finished and settled, a fetch in progress is awaited (never
//! dropped) and its messages released, then the source is closed.

mod builder;
mod dead_letter;
mod error;
pub mod headers;
mod lane;
mod memory;
mod report;
mod source;

use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

pub use builder::{Builder, FetchFailures};
pub use error::{BuildError, Error};
pub use memory::{MemoryDelivery, MemoryQueue};
pub use report::Report;
pub use source::{DeadLetter, Opening, Settlement, Source, SourceConfig, retry_delay};

use crate::engine::{Ahead, Backend, Cause, Driver, Engine, Handler, Outcome, Verb};
use crate::telemetry::{BATCH_SIZE, SOURCE_LAG_MESSAGES};
use builder::Settings;

type Hook<M> = Arc<dyn Fn(&Settlement<'_, M>) + Send + Sync>;
type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A broker consumer made idempotent: a [`Source`] driven through an [`Engine`].
///
/// Broker adapters name it for their source (`AmqpConsumer<B>`, `JetStreamConsumer<B>`,
/// `KafkaConsumer<B>`, `StreamConsumer<B>`); `B` is the store (two-phase) or the
/// [`Inbox`](crate::inbox::Inbox).
///
/// ```
/// use idem_core::{Consumer, MemoryStore, engine::HandlerError, consumer::MemoryQueue};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let queue = MemoryQueue::new();
/// queue.push("o-1", r#"{"cents":1200}"#);
/// queue.push("o-1", r#"{"cents":1200}"#); // the producer retried
/// let consumer = Consumer::builder(queue.clone()).store(MemoryStore::new()).scope("billing").build().await?;
///
/// let report = consumer
///     .run(|ctx, msg| async move {
///         // charge the customer, passing ctx.downstream_key() as the payment's idempotency key
///         Ok::<_, HandlerError<String>>(msg.payload().len())
///     }, queue.drained())
///     .await?;
/// assert_eq!((report.processed, report.duplicates, report.acked), (1, 1, 2));
/// # Ok(()) }
/// ```
pub struct Consumer<S: Source, B> {
    source: S,
    engine: Engine<B>,
    settings: Settings,
    hook: Option<Hook<S::Delivery>>,
}

impl<S: Source, B> std::fmt::Debug for Consumer<S, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("engine", &self.engine)
            .field("batch", &self.settings.batch)
            .finish_non_exhaustive()
    }
}

impl<S: Source> Consumer<S, ()> {
    /// Starts a builder over a broker source's settings.
    pub fn builder<C: SourceConfig<Source = S>>(config: C) -> Builder<C> {
        Builder::new(config)
    }
}

impl<S: Source, B> Consumer<S, B> {
    /// The broker source (for its broker-specific accessors).
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The dedup engine.
    pub fn engine(&self) -> &Engine<B> {
        &self.engine
    }
}

impl<S: Source, B: Backend> Consumer<S, B> {
    /// Closes the source: gives back what the broker delivered but was never fetched, makes
    /// final commits, closes channels; returns how many messages it gave back. [`run`](Self::run)
    /// does it when it ends; call it after driving [`poll`](Self::poll) or the steps yourself.
    /// The source cannot be used afterwards.
    ///
    /// # Errors
    /// The source's error ([`Error::Settle`]), or [`Error::BrokerTimeout`].
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped midway, some messages may not be given back (the broker
    /// redelivers them once the connection closes).
    pub async fn close(&self) -> Result<u64, Error<S::Error>> {
        self.bounded("closing the source", self.source.close()).await?.map_err(Error::Settle)
    }

    /// One round without closing anything: fetch a batch (waiting up to the idle wait), decide
    /// it, settle it. For tests, and for callers that drive their own loop.
    ///
    /// # Errors
    /// As [`run`](Self::run), except that a failed fetch is returned at once.
    ///
    /// # Cancel safety
    /// Not cancel safe, as [`run`](Self::run): nothing is lost, but a fetched batch dropped
    /// before it is settled waits for the broker's redelivery.
    pub async fn poll<H>(&self, handler: H) -> Result<Report, Error<S::Error>>
    where
        H: Handler<B::Ctx, S::Delivery>,
    {
        let batch = self.fetch().await?;
        let decided = self.decide_ref(batch, &handler, None, None).await?;
        self.settle(decided).await
    }

    /// A fetch bounded by the idle wait plus the broker timeout. `Err(Ok(e))` is the source's
    /// error (retryable by policy); `Err(Err(e))` ends the run.
    async fn fetch_bounded(&self) -> Result<Vec<S::Delivery>, Result<S::Error, Error<S::Error>>> {
        let s = &self.settings;
        let limit = s.idle_wait + s.broker_timeout;
        match tokio::time::timeout(limit, self.source.fetch(s.batch, s.idle_wait)).await {
            Ok(Ok(batch)) => {
                if let Some(lag) = self.source.lag(&batch) {
                    // Precision is lost only past 2^53 messages.
                    #[allow(clippy::cast_precision_loss)]
                    metrics::gauge!(SOURCE_LAG_MESSAGES, "scope" => self.engine.scope().to_owned())
                        .set(lag as f64);
                }
                Ok(batch)
            }
            Ok(Err(e)) => Err(Ok(e)),
            Err(_) => Err(Err(Error::BrokerTimeout { what: "a fetch", timeout: limit })),
        }
    }

    /// Fetches one batch (waiting up to the idle wait). With [`decide`](Self::decide) and
    /// [`settle`](Self::settle), the steps of [`poll`](Self::poll), for callers that interpose
    /// between them (tests that crash between commit and ack).
    ///
    /// # Errors
    /// [`Error::Fetch`] with the source's error, [`Error::BrokerTimeout`].
    ///
    /// # Cancel safety
    /// Only as cancel safe as the source's fetch; the broker redelivers what a dropped fetch
    /// had taken.
    pub async fn fetch(&self) -> Result<Vec<S::Delivery>, Error<S::Error>> {
        self.fetch_bounded().await.map_err(|e| match e {
            Ok(source) => Error::Fetch { attempts: 1, source },
            Err(e) => e,
        })
    }

    /// Decides a batch and makes every outcome durable — effects committed, dead-letter copies
    /// confirmed — then calls the [`on_settle`](Builder::on_settle) hook; nothing is
    /// acknowledged yet: pass the result to [`settle`](Self::settle).
    ///
    /// # Errors
    /// [`Error::BrokerTimeout`] when the dead-letter copies hang.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped midway, claims stay in progress until their leases run out
    /// (two-phase) or the transaction is rolled back (inbox). Nothing is acknowledged, so the
    /// broker redelivers the batch.
    pub async fn decide<H>(
        &self,
        batch: Vec<S::Delivery>,
        handler: H,
    ) -> Result<Decided<S::Delivery>, Error<S::Error>>
    where
        H: Handler<B::Ctx, S::Delivery>,
    {
        self.decide_ref(batch, &handler, None, None).await
    }

    async fn decide_ref<H>(
        &self,
        batch: Vec<S::Delivery>,
        handler: &H,
        ahead: Option<Ahead>,
        seat: Option<Driver>,
    ) -> Result<Decided<S::Delivery>, Error<S::Error>>
    where
        H: Handler<B::Ctx, S::Delivery>,
    {
        let mut report = Report { batches: 1, fetched: batch.len() as u64, ..Report::default() };
        // Empty fetches (an idle `poll`) say nothing about batch sizes.
        if !batch.is_empty() {
            #[allow(clippy::cast_precision_loss)] // a batch is far below 2^53 messages
            metrics::histogram!(BATCH_SIZE, "scope" => self.engine.scope().to_owned())
                .record(batch.len() as f64);
        }
        let outcomes = {
            let decide =
                std::pin::pin!(self.engine.decide_batch_ahead(&batch, handler, ahead, seat));
            let beat = std::pin::pin!(self.source.keep_alive(&batch));
            match futures_util::future::select(decide, beat).await {
                futures_util::future::Either::Left((outcomes, _)) => outcomes,
                // A keep-alive that ends has nothing more to say; the handlers go on.
                futures_util::future::Either::Right(((), decide)) => decide.await,
            }
        };
        self.note_store_failures(&outcomes, &mut report);
        let (verbs, dead) = self.verbs(&batch, &outcomes, &mut report);
        let actions = self.copy_dead_letters(&batch, verbs, dead, &mut report).await?;
        if let Some(hook) = &self.hook {
            for ((m, o), action) in batch.iter().zip(&outcomes).zip(&actions) {
                let key = self.engine.key_of(m).ok();
                hook(&Settlement {
                    message: m,
                    key: key.as_ref(),
                    outcome: o.kind(),
                    verb: action,
                });
            }
        }
        for a in &actions {
            report.count_verb(a);
        }
        Ok(Decided { items: batch.into_iter().zip(actions).collect(), report })
    }

    /// Sends a decided batch's verbs to the broker (the ack is always this last step).
    ///
    /// # Errors
    /// [`Error::Settle`] when the source can no longer settle, [`Error::BrokerTimeout`].
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped midway, some verbs may not be sent; those messages come back
    /// and are found done.
    pub async fn settle(&self, decided: Decided<S::Delivery>) -> Result<Report, Error<S::Error>> {
        let Decided { items, mut report } = decided;
        report.settle_failures += self.send_verbs(items).await?;
        Ok(report)
    }

    /// Gives a batch back untouched (fetched while shutting down).
    async fn release(&self, batch: Vec<S::Delivery>) -> Result<Report, Error<S::Error>> {
        let mut report = Report { fetched: batch.len() as u64, ..Report::default() };
        report.released = batch.len() as u64;
        let items = batch.into_iter().map(|m| (m, Verb::Release)).collect();
        report.settle_failures += self.send_verbs(items).await?;
        Ok(report)
    }

    async fn send_verbs(&self, items: Vec<(S::Delivery, Verb)>) -> Result<u64, Error<S::Error>> {
        if items.is_empty() {
            return Ok(0);
        }
        self.bounded("the batch's verbs", self.source.settle(items)).await?.map_err(Error::Settle)
    }

    /// Keeps the batch's first store failure in its report, and logs a warning when every
    /// message of the batch failed on the store: a store that cannot work (a table dropped, a
    /// schema never migrated) fails everything, and the retries alone would say nothing.
    fn note_store_failures<T, E: Display>(&self, outcomes: &[Outcome<T, E>], report: &mut Report) {
        let mut failed = outcomes.iter().filter_map(|o| match o {
            Outcome::Failed(f) if matches!(f.cause, Cause::Store(_)) => Some(&f.cause),
            _ => None,
        });
        let Some(first) = failed.next() else { return };
        let first = first.to_string();
        let n = 1 + failed.count();
        if n == outcomes.len() {
            tracing::warn!(target: "idem", scope = self.engine.scope(), failed = n,
                error = %first, "every message of the batch failed on the store; retrying them");
        }
        report.first_store_error = Some(first);
    }

    /// `fut`, or [`Error::BrokerTimeout`] once the broker timeout has passed.
    async fn bounded<T>(
        &self,
        what: &'static str,
        fut: impl Future<Output = T>,
    ) -> Result<T, Error<S::Error>> {
        let timeout = self.settings.broker_timeout;
        tokio::time::timeout(timeout, fut).await.map_err(|_| Error::BrokerTimeout { what, timeout })
    }
}

/// A batch whose outcomes are durable and whose verbs are not sent yet
/// ([`Consumer::decide`]); pass it to [`Consumer::settle`]. Dropped unsettled, its messages are
/// redelivered by the broker and found done.
#[derive(Debug)]
#[must_use = "nothing is acknowledged until the batch is settled"]
pub struct Decided<M> {
    items: Vec<(M, Verb)>,
    report: Report,
}

impl<M> Decided<M> {
    /// The counts so far (outcomes, and the verbs about to be sent).
    pub fn report(&self) -> Report {
        self.report.clone()
    }

    /// Each message with the verb it will get.
    pub fn items(&self) -> &[(M, Verb)] {
        &self.items
    }
}
