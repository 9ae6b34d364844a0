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
mod error;
pub mod headers;
mod memory;
mod report;
mod source;

use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

pub use builder::{Builder, FetchFailures};
pub use error::{BuildError, Error};
pub use memory::{MemoryDelivery, MemoryQueue};
pub use report::Report;
pub use source::{DeadLetter, Opening, Settlement, Source, SourceConfig};

use crate::engine::{Ahead, Backend, Cause, Engine, Handler, Outcome, Verb};
use crate::telemetry::{BATCH_SIZE, DEAD_LETTERS_TOTAL, FETCH_FAILURES_TOTAL, SOURCE_LAG_MESSAGES};
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
    /// Fetches, decides and settles batches until `shutdown` completes, then closes the source.
    /// In two-phase mode the handler gets a [`Context`](crate::engine::Context); in inbox
    /// mode, the batch's transaction. It gets its own copy of the message, so its future may
    /// own what it reads.
    ///
    /// # Errors
    /// [`Error::Fetch`] when the fetch-failure policy gives up, [`Error::Settle`] when the
    /// broker can no longer be told, [`Error::BrokerTimeout`] when a broker call hangs. The
    /// source is closed in every case; unacknowledged messages are redelivered.
    ///
    /// # Cancel safety
    /// Not cancel safe; stop it with `shutdown` instead. Dropped midway, nothing is lost (no
    /// message is acknowledged before its outcome is durable, so the broker redelivers the
    /// rest), but the source is not closed and in-progress claims wait for their leases.
    pub async fn run<H>(
        &self,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Report, Error<S::Error>>
    where
        H: Handler<B::Ctx, S::Delivery>,
    {
        // Every lane watches the same shutdown; a lane that fails stops the others.
        let shutdown: BoxFuture<'_, ()> = Box::pin(shutdown);
        let shutdown = futures_util::FutureExt::shared(shutdown);
        let failed = AtomicBool::new(false);
        let lanes = (0..self.settings.concurrency).map(|_| {
            let (shutdown, failed) = (shutdown.clone(), &failed);
            let handler = &handler;
            async move {
                let mut report = Report::default();
                let ended = self.drive(handler, shutdown, failed, &mut report).await;
                if ended.is_err() {
                    failed.store(true, Ordering::SeqCst);
                }
                (ended, report)
            }
        });
        let mut report = Report::default();
        let mut ended = Ok(());
        for (e, r) in futures_util::future::join_all(lanes).await {
            report += r;
            if ended.is_ok() {
                ended = e;
            }
        }
        match self.close().await {
            Ok(n) => report.released += n,
            Err(e) => tracing::warn!(target: "idem", error = %e, "closing the source failed"),
        }
        ended.map(|()| report)
    }

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
        let decided = self.decide_ref(batch, &handler, None).await?;
        self.settle(decided).await
    }

    /// One lane: fetch, decide, settle, until shutdown (or another lane failed).
    ///
    /// Pipelined (the default), three batches overlap: while batch k is decided, batch k + 1
    /// is fetched (and, two-phase, its keys claimed ahead) and waits for its turn, kept alive
    /// at the broker, and batch k − 1 is settled. Only a decided batch is ever settled, and
    /// batches are settled in the order they were decided. A fetch is never dropped (sources
    /// need not be cancel safe): on shutdown it is awaited, and what it brought — and the batch
    /// waiting for its turn — is released, with the claims taken ahead for it.
    async fn drive<H>(
        &self,
        handler: &H,
        mut shutdown: futures_util::future::Shared<BoxFuture<'_, ()>>,
        failed: &AtomicBool,
        report: &mut Report,
    ) -> Result<(), Error<S::Error>>
    where
        H: Handler<B::Ctx, S::Delivery>,
    {
        let pipelined = self.settings.pipelined;
        let mut lane = Lane::<'_, S>::default();
        let mut failures = 0u32;
        let mut stopping = false;
        let mut ended = Ok(());
        loop {
            if !stopping
                && (failed.load(Ordering::SeqCst) || is_ready(Pin::new(&mut shutdown)).await)
            {
                stopping = true;
            }
            if stopping {
                lane.backoff = None;
                if let Some(go) = lane.go.take() {
                    // Its future releases the batch; a closed receiver means it ended already.
                    let _ = go.send(false);
                }
            }
            if lane.settling.is_none()
                && let Some(d) = lane.decided.take()
            {
                lane.settling = Some(Box::pin(self.settle(d)));
            }
            // The next batch's turn (not when told to release: its `go` is spent).
            if lane.current.is_none()
                && lane.decided.is_none()
                && let Some(go) = lane.go.take()
            {
                let _ = go.send(true);
                lane.current = lane.next.take();
            }
            let room = if pipelined { lane.next.is_none() } else { lane.is_idle() };
            if !stopping && room && lane.fetching.is_none() && lane.backoff.is_none() {
                lane.fetching = Some(Box::pin(self.fetch_bounded()));
            }
            if stopping && lane.is_idle() && lane.fetching.is_none() {
                return ended;
            }
            let mut fail = |e: Error<S::Error>, stopping: &mut bool| {
                if ended.is_ok() {
                    ended = Err(e);
                }
                *stopping = true;
            };
            tokio::select! {
                biased;
                r = slot(&mut lane.settling), if lane.settling.is_some() => {
                    lane.settling = None;
                    match r {
                        Ok(r) => *report += r,
                        Err(e) => fail(e, &mut stopping),
                    }
                }
                r = slot(&mut lane.current), if lane.current.is_some() => {
                    lane.current = None;
                    match r {
                        Ok(Turned::Decided(d)) => lane.decided = Some(d),
                        Ok(Turned::Released(r)) => *report += r,
                        Err(e) => fail(e, &mut stopping),
                    }
                }
                // Only ends before its turn when told to release its batch.
                r = slot(&mut lane.next), if lane.next.is_some() => {
                    lane.next = None;
                    match r {
                        Ok(Turned::Released(r)) => *report += r,
                        Ok(Turned::Decided(d)) => lane.decided = Some(d),
                        Err(e) => fail(e, &mut stopping),
                    }
                }
                r = slot(&mut lane.fetching), if lane.fetching.is_some() => {
                    lane.fetching = None;
                    match r {
                        Ok(batch) => {
                            failures = 0;
                            if !batch.is_empty() {
                                let (go, turn) = tokio::sync::oneshot::channel();
                                lane.next = Some(Box::pin(self.turn(batch, handler, turn)));
                                lane.go = Some(go);
                            }
                        }
                        Err(Err(e)) => fail(e, &mut stopping),
                        Err(Ok(_)) if stopping => {}
                        Err(Ok(e)) => {
                            failures += 1;
                            let policy = self.settings.fetch_failures;
                            if self.source.is_fatal(&e) || failures >= policy.max_in_a_row {
                                fail(Error::Fetch { attempts: failures, source: e }, &mut stopping);
                            } else {
                                report.fetch_failures += 1;
                                metrics::counter!(FETCH_FAILURES_TOTAL, "scope" => self.engine.scope().to_owned())
                                    .increment(1);
                                tracing::warn!(target: "idem", error = %e, failures, "fetch failed; retrying");
                                lane.backoff = Some(Box::pin(tokio::time::sleep(policy.backoff)));
                            }
                        }
                    }
                }
                () = slot(&mut lane.backoff), if lane.backoff.is_some() => lane.backoff = None,
                () = &mut shutdown, if !stopping => stopping = true,
            }
        }
    }

    /// A fetched batch's way through a lane: claimed ahead (two-phase, pipelined) and kept
    /// alive while it waits for `turn`, then decided — or, told `false`, released.
    async fn turn<H>(
        &self,
        batch: Vec<S::Delivery>,
        handler: &H,
        turn: tokio::sync::oneshot::Receiver<bool>,
    ) -> Result<Turned<S::Delivery>, Error<S::Error>>
    where
        H: Handler<B::Ctx, S::Delivery>,
    {
        let (ahead, go) = {
            let wait = std::pin::pin!(async {
                let ahead = match self.settings.pipelined {
                    true => B::claim_ahead(&self.engine, &batch).await,
                    false => None,
                };
                (ahead, turn.await.unwrap_or(false))
            });
            let beat = std::pin::pin!(self.source.keep_alive(&batch));
            match futures_util::future::select(wait, beat).await {
                futures_util::future::Either::Left((waited, _)) => waited,
                futures_util::future::Either::Right(((), wait)) => wait.await,
            }
        };
        if !go {
            if let Some(ahead) = ahead {
                B::drop_ahead(&self.engine, ahead).await;
            }
            return self.release(batch).await.map(Turned::Released);
        }
        self.decide_ref(batch, handler, ahead).await.map(Turned::Decided)
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
        self.decide_ref(batch, &handler, None).await
    }

    async fn decide_ref<H>(
        &self,
        batch: Vec<S::Delivery>,
        handler: &H,
        ahead: Option<Ahead>,
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
            let decide = std::pin::pin!(self.engine.decide_batch_ahead(&batch, handler, ahead));
            let beat = std::pin::pin!(self.source.keep_alive(&batch));
            match futures_util::future::select(decide, beat).await {
                futures_util::future::Either::Left((outcomes, _)) => outcomes,
                // A keep-alive that ends has nothing more to say; the handlers go on.
                futures_util::future::Either::Right(((), decide)) => decide.await,
            }
        };
        self.note_store_failures(&outcomes, &mut report);
        let mut actions = Vec::with_capacity(batch.len());
        let mut dead = Vec::new();
        for (i, (m, o)) in batch.iter().zip(&outcomes).enumerate() {
            report.count_outcome(o.kind());
            let action = match o.verb() {
                Verb::Ack | Verb::Release => Verb::Ack,
                Verb::DeadLetter { reason } => {
                    dead.push((i, self.dead_letter_of(m, o, reason)));
                    Verb::Release
                }
                Verb::Retry { after } => match self.source.give_up(m) {
                    Some(why) => {
                        let reason = format!("{why}; last outcome {}: {}", o.kind(), describe(o));
                        dead.push((i, self.dead_letter_of(m, o, reason)));
                        Verb::Release
                    }
                    None => Verb::Retry { after },
                },
            };
            actions.push(action);
        }
        if !dead.is_empty() {
            let items: Vec<(&S::Delivery, _)> =
                dead.iter().map(|(i, dl)| (&batch[*i], dl.clone())).collect();
            let copied =
                self.bounded("the dead-letter copies", self.source.dead_letter(&items)).await?;
            let mut copied = copied.into_iter();
            for (i, dl) in dead {
                actions[i] = match copied.next() {
                    Some(Ok(())) => {
                        metrics::counter!(DEAD_LETTERS_TOTAL, "scope" => dl.scope.clone(),
                            "outcome" => dl.outcome.as_str())
                        .increment(1);
                        Verb::DeadLetter { reason: dl.reason }
                    }
                    failed => {
                        report.dead_letter_failures += 1;
                        let error = failed.and_then(Result::err).map(|e| e.to_string());
                        // Never remove what is not safely elsewhere: let it come back instead.
                        tracing::error!(target: "idem", error = error.as_deref().unwrap_or("no answer"),
                            reason = %dl.reason, "dead-letter copy failed; retrying the message instead");
                        Verb::Retry { after: None }
                    }
                };
            }
        }
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

    fn dead_letter_of<T, E>(
        &self,
        m: &S::Delivery,
        o: &Outcome<T, E>,
        reason: String,
    ) -> DeadLetter {
        let dl = DeadLetter::new(o.kind(), reason, self.engine.scope());
        match self.engine.key_of(m) {
            Ok(key) => dl.with_key(key.id()),
            Err(_) => dl,
        }
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

/// Whether `fut` is ready now (it is polled once; a ready future must not be polled again).
async fn is_ready(fut: Pin<&mut impl Future<Output = ()>>) -> bool {
    let mut fut = Some(fut);
    std::future::poll_fn(|cx| {
        let ready = fut.take().is_some_and(|f| f.poll(cx).is_ready());
        std::task::Poll::Ready(ready)
    })
    .await
}

/// What a fetched batch became when its turn came (or shutdown came first).
enum Turned<M> {
    Decided(Decided<M>),
    Released(Report),
}

type Step<'a, S> =
    BoxFuture<'a, Result<Turned<<S as Source>::Delivery>, Error<<S as Source>::Error>>>;
type Fetched<S> =
    Result<Vec<<S as Source>::Delivery>, Result<<S as Source>::Error, Error<<S as Source>::Error>>>;

/// A lane's batches in flight: at most one being fetched, one waiting for its turn (`next`,
/// told by `go`), one being decided, one decided and waiting for the broker, one being settled.
struct Lane<'a, S: Source> {
    fetching: Option<BoxFuture<'a, Fetched<S>>>,
    backoff: Option<Pin<Box<tokio::time::Sleep>>>,
    next: Option<Step<'a, S>>,
    go: Option<tokio::sync::oneshot::Sender<bool>>,
    current: Option<Step<'a, S>>,
    decided: Option<Decided<S::Delivery>>,
    settling: Option<BoxFuture<'a, Result<Report, Error<S::Error>>>>,
}

impl<S: Source> Default for Lane<'_, S> {
    fn default() -> Self {
        Self {
            fetching: None,
            backoff: None,
            next: None,
            go: None,
            current: None,
            decided: None,
            settling: None,
        }
    }
}

impl<S: Source> Lane<'_, S> {
    /// Whether no batch is in the lane (a fetch may still be).
    fn is_idle(&self) -> bool {
        self.next.is_none()
            && self.current.is_none()
            && self.decided.is_none()
            && self.settling.is_none()
    }
}

/// The future in `slot`, which must be there (`select!` guards each branch with `is_some`).
async fn slot<F: Future + Unpin>(slot: &mut Option<F>) -> F::Output {
    match slot {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

/// An outcome's cause in words, for a dead letter made of a retry.
fn describe<T, E: Display>(o: &Outcome<T, E>) -> String {
    match o {
        Outcome::Failed(f) => f.cause.to_string(),
        Outcome::InProgressElsewhere { retry_after } => {
            format!("another consumer holds the key for {retry_after:?} more")
        }
        other => other.kind().to_string(),
    }
}

/// The delay to use for a retry: the suggestion clamped to `[min, max]`, or `default`.
///
/// ```
/// use std::time::Duration;
/// use idem_core::consumer::retry_delay;
///
/// let s = Duration::from_secs;
/// assert_eq!(retry_delay(Some(s(900)), s(1), s(1), s(300)), s(300));
/// assert_eq!(retry_delay(None, s(5), s(1), s(300)), s(5));
/// ```
pub fn retry_delay(
    after: Option<Duration>,
    default: Duration,
    min: Duration,
    max: Duration,
) -> Duration {
    after.map_or(default, |d| d.clamp(min, max.max(min)))
}
