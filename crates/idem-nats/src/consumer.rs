//! Two-phase mode: the idem [`Consumer`] engine over any [`DedupStore`].

use std::fmt::Display;
use std::future::Future;

use async_nats::jetstream::Context as JetStream;
use async_nats::jetstream::consumer::PullConsumer;
use idem_core::consumer::{Context, HandlerError};
use idem_core::{Consumer, DedupStore, RetentionWindow};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::source::{Source, Verdict};
use crate::{Delivery, Error, Report, Settings};

/// A JetStream pull consumer made idempotent by the idem engine (two-phase: claim with a lease,
/// run the handler, record completion, then ack).
///
/// Each fetched batch is claimed in one `claim_many` round trip; acquired handlers run
/// concurrently. Outcomes map to JetStream verbs: processed and duplicate → `Ack`; in progress
/// elsewhere → `Nak` delayed by the other lease's remaining time; transient failure → release
/// and `Nak` after [`Settings::retry_delay`]; conflict, permanent failure, or a retry at the
/// last allowed delivery → publish to the dead-letter subject (awaiting JetStream's publish ack)
/// with the reason in headers, then `Term`. While handlers run, `Progress` is sent on the dedup
/// consumer's heartbeat (or [`Settings::progress`]), which restarts `ack_wait` as the heartbeat
/// extends the lease.
///
/// ```no_run
/// use std::time::Duration;
/// use async_nats::jetstream::{self, consumer::{pull, AckPolicy}};
/// use idem_core::{Consumer, consumer::HandlerError};
/// use idem_nats::{JetStreamConsumer, Settings};
/// use idem_sqlx::SqliteStore;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let js = jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
/// let stream = js.get_stream("ORDERS").await?;
/// let pull = stream.get_or_create_consumer("billing", pull::Config {
///     durable_name: Some("billing".into()),
///     ack_policy: AckPolicy::Explicit,
///     ack_wait: Duration::from_secs(30),
///     max_deliver: 10,
///     ..Default::default()
/// }).await?;
/// let dedup = Consumer::builder(SqliteStore::open("idem.sqlite").await?)
///     .scope("billing")
///     .heartbeat(Duration::from_secs(10))
///     .build()?;
/// let nats = JetStreamConsumer::new(js, pull, dedup, Settings::new("orders.dlq")).await?;
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// # drop(stop);
/// let report = nats.run(|ctx, msg| {
///     let body = msg.payload_bytes();
///     async move {
///         // charge the customer, passing ctx.downstream_key() as the payment's idempotency key
///         Ok::<_, HandlerError<std::io::Error>>(body.len())
///     }
/// }, async { let _ = stopped.await; }).await?;
/// println!("{report}");
/// # Ok(()) }
/// ```
pub struct JetStreamConsumer<S> {
    source: Source,
    dedup: Consumer<S>,
}

impl<S> std::fmt::Debug for JetStreamConsumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamConsumer").field("dedup", &self.dedup).finish_non_exhaustive()
    }
}

/// The verbs decided for a processed batch, not yet sent: hand them to `settle` with the batch.
/// Every effect they acknowledge is already committed.
#[derive(Debug)]
#[must_use = "nothing is acked until the verdicts are settled"]
pub struct Verdicts {
    pub(crate) verdicts: Vec<Verdict>,
    pub(crate) report: Report,
}

impl Verdicts {
    /// The outcome counts of the batch (ack counts are filled in by `settle`).
    pub fn report(&self) -> Report {
        self.report
    }
}

impl<S: DedupStore> JetStreamConsumer<S> {
    /// Wraps a pull consumer. Checks, from the consumer's and stream's configuration, that acks
    /// are explicit, that `max_deliver` is set, that the dedup retention covers the redelivery
    /// window (`ack_wait × max_deliver`, see [`redelivery_window`](crate::redelivery_window)),
    /// that the heartbeat is shorter than `ack_wait`, and that a stream captures the
    /// dead-letter subject.
    ///
    /// # Errors
    /// [`Error`] naming the failed check, or the JetStream call that failed.
    pub async fn new(
        js: JetStream,
        consumer: PullConsumer,
        dedup: Consumer<S>,
        settings: Settings,
    ) -> Result<Self, Error> {
        let source =
            Source::open(js, consumer, settings, dedup.lease(), dedup.retain(), dedup.heartbeat())
                .await?;
        Ok(Self { source, dedup })
    }

    /// The redelivery window the retention was checked against.
    pub fn redelivery_window(&self) -> RetentionWindow {
        self.source.window
    }

    /// The dedup engine.
    pub fn dedup(&self) -> &Consumer<S> {
        &self.dedup
    }

    /// Fetches up to [`Settings::batch`] messages, waiting up to [`Settings::idle_wait`] when
    /// none is pending (then the result may be empty).
    ///
    /// # Errors
    /// [`Error::JetStream`] when the pull fails.
    ///
    /// # Cancel safety
    /// Not cancel safe: messages already delivered to a dropped pull are redelivered after
    /// `ack_wait` (and then found done or claimed, never lost).
    pub async fn fetch(&self) -> Result<Vec<Delivery>, Error> {
        self.source.fetch().await
    }

    /// Claims the batch in one round trip, runs the acquired handlers and records their
    /// completions, sending `Progress` while they run. Nothing is acked yet: pass the result to
    /// [`settle`](Self::settle).
    pub async fn process<'m, T, E, F, Fut>(&self, batch: &'m [Delivery], handler: F) -> Verdicts
    where
        T: Serialize + DeserializeOwned,
        E: Display,
        F: Fn(Context, &'m Delivery) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let outcomes =
            self.source.with_progress(batch, self.dedup.process_batch(batch, handler)).await;
        let mut report = Report { fetched: batch.len() as u64, ..Report::default() };
        let verdicts = batch
            .iter()
            .zip(&outcomes)
            .map(|(d, o)| {
                report.count(o.label());
                self.source.verdict(d, o.disposition(), o.label())
            })
            .collect();
        Verdicts { verdicts, report }
    }

    /// Sends the verdicts: dead letters (confirmed publish, then `Term`), acks and naks.
    /// Messages beyond the verdicts (a mismatched batch) are nak'd.
    pub async fn settle(&self, batch: Vec<Delivery>, verdicts: Verdicts) -> Report {
        settle(&self.source, batch, verdicts).await
    }

    /// Fetch, process, settle, until `shutdown` completes; a batch in flight is finished first.
    /// The handler's future may not borrow the delivery: take what it needs (the payload is
    /// [`Delivery::payload_bytes`], a cheap clone) before its `async` block.
    ///
    /// # Errors
    /// [`Error::JetStream`] after 10 fetches in a row failed.
    pub async fn run<T, E, F, Fut>(
        &self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Report, Error>
    where
        T: Serialize + DeserializeOwned,
        E: Display,
        F: Fn(Context, &Delivery) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let mut total = Report::default();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut failures = 0u32;
        loop {
            let batch = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(total),
                b = self.fetch() => b,
            };
            let batch = match batch {
                Ok(b) => {
                    failures = 0;
                    b
                }
                Err(e) => {
                    failures += 1;
                    if failures >= 10 {
                        return Err(e);
                    }
                    tracing::warn!(target: "idem", error = %e, "fetch failed; retrying");
                    tokio::select! {
                        () = &mut shutdown => return Ok(total),
                        () = tokio::time::sleep(self.source.settings.retry_delay) => continue,
                    }
                }
            };
            if batch.is_empty() {
                continue;
            }
            let v = self.process(&batch, &handler).await;
            total += self.settle(batch, v).await;
        }
    }
}

pub(crate) async fn settle(source: &Source, batch: Vec<Delivery>, verdicts: Verdicts) -> Report {
    let mut report = verdicts.report;
    let mut vs = verdicts.verdicts.into_iter();
    let items = batch.into_iter().map(|d| (d, vs.next().unwrap_or(Verdict::Nak(None)))).collect();
    source.apply(items, &mut report).await;
    report
}
