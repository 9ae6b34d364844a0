//! The consume loop.

use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures_util::StreamExt;
use idem_core::consumer::{Context, HandlerError};
use idem_core::{Consumer, DedupStore};
use lapin::Channel;
use lapin::options::{BasicCancelOptions, BasicConsumeOptions, BasicNackOptions};
use lapin::types::FieldTable;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::settle::Hook;
use crate::{AmqpConsumerBuilder, AmqpMessage, Error, Stats, Topology};

/// A RabbitMQ consumer made idempotent by an [`idem_core::Consumer`] engine.
///
/// Manual acks only, and the ack is always the last step: after the effect is committed (or
/// was already), after a dead-letter copy is confirmed, after a delay copy is confirmed.
/// Deliveries received together (up to the batch size) are claimed together with one
/// `claim_many`. Each outcome maps to a verb:
///
/// | outcome | verb |
/// | --- | --- |
/// | processed, duplicate | `basic.ack` |
/// | in progress elsewhere | copy to the delay queue (per-message TTL, dead-letters back), then ack |
/// | transient failure | claim released by the engine, then `basic.nack(requeue)` |
/// | conflict, permanent failure, missing key | copy to the dead-letter exchange with `x-idem-reason`, then ack |
///
/// ```no_run
/// use idem_amqp::AmqpConsumer;
/// use idem_core::{Consumer, MemoryStore, consumer::HandlerError};
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let conn = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
/// let engine = Consumer::builder(MemoryStore::new()).scope("orders").build()?;
/// let consumer = AmqpConsumer::builder(engine, "orders").prefetch(32).connect(&conn).await?;
/// let stats = consumer
///     .run(
///         |ctx, msg| async move {
///             println!("order {:?}, attempt {}", msg.properties().message_id(), ctx.attempt());
///             Ok::<_, HandlerError<std::io::Error>>(())
///         },
///         async { tokio::signal::ctrl_c().await.ok(); },
///     )
///     .await?;
/// println!("{stats:?}");
/// # Ok(()) }
/// ```
pub struct AmqpConsumer<S> {
    pub(crate) engine: Consumer<S>,
    pub(crate) channel: Channel,
    pub(crate) publisher: Channel,
    pub(crate) topology: Topology,
    pub(crate) batch: usize,
    pub(crate) batch_wait: Duration,
    pub(crate) min_delay: Duration,
    pub(crate) max_delay: Duration,
    pub(crate) tag: String,
    pub(crate) hook: Option<Hook>,
    pub(crate) broker_timeout: Duration,
}

impl<S> std::fmt::Debug for AmqpConsumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpConsumer")
            .field("topology", &self.topology)
            .field("tag", &self.tag)
            .field("batch", &self.batch)
            .finish_non_exhaustive()
    }
}

impl<S: DedupStore> AmqpConsumer<S> {
    /// Starts a builder for a consumer of `queue` (which must exist) driven by `engine`.
    pub fn builder(engine: Consumer<S>, queue: impl Into<String>) -> AmqpConsumerBuilder<S> {
        AmqpConsumerBuilder::new(engine, queue)
    }

    /// The queue names in use.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The engine.
    pub fn engine(&self) -> &Consumer<S> {
        &self.engine
    }

    /// Consumes in **two-phase mode** until `shutdown` completes: each batch is claimed with
    /// one `claim_many`, the acquired handlers run concurrently under their leases, each
    /// completion is recorded, then every delivery is settled.
    ///
    /// Graceful shutdown: `shutdown` is checked between batches, so handlers in flight finish
    /// and are settled; then the consumer is cancelled, deliveries the broker had already
    /// pushed are requeued, and both channels are closed.
    ///
    /// # Errors
    /// [`Error`] when the connection or channel fails; unacked messages are then redelivered.
    pub async fn run<H, Fut, T, E>(
        self,
        handler: H,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Stats, Error>
    where
        H: Fn(Context, AmqpMessage) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
        T: Serialize + DeserializeOwned,
        E: Display,
    {
        let mut stream = self.consume().await?;
        let mut shutdown = std::pin::pin!(shutdown);
        let mut stats = Stats::default();
        while let Some(batch) = self.fetch(&mut stream, shutdown.as_mut(), &mut stats).await? {
            let outcomes = self
                .engine
                .process_batch(&batch, |ctx, m: &AmqpMessage| handler(ctx, m.clone()))
                .await;
            for (m, o) in batch.iter().zip(&outcomes) {
                self.settle(m, o, &mut stats).await?;
            }
        }
        self.close(stream, &mut stats).await;
        Ok(stats)
    }

    pub(crate) async fn consume(&self) -> Result<lapin::Consumer, Error> {
        self.channel
            .basic_consume(
                self.topology.queue.as_str().into(),
                self.tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|source| Error::Setup { what: "basic.consume", source })
    }

    /// The next batch: waits for one delivery (or shutdown), then gathers what arrives within
    /// the batch wait. `None` on shutdown.
    pub(crate) async fn fetch(
        &self,
        stream: &mut lapin::Consumer,
        mut shutdown: Pin<&mut (impl Future<Output = ()> + ?Sized)>,
        stats: &mut Stats,
    ) -> Result<Option<Vec<AmqpMessage>>, Error> {
        let first = tokio::select! {
            biased;
            () = shutdown.as_mut() => return Ok(None),
            d = stream.next() => d,
            () = self.lost() => {
                return Err(Error::BrokerTimeout { what: "the delivery stream", timeout: self.broker_timeout });
            }
        };
        let mut batch = vec![AmqpMessage::new(next_delivery(first)?)];
        let deadline = tokio::time::Instant::now() + self.batch_wait;
        while batch.len() < self.batch {
            match tokio::time::timeout_at(deadline, stream.next()).await {
                Ok(d) => batch.push(AmqpMessage::new(next_delivery(d)?)),
                Err(_) => break,
            }
        }
        stats.received += batch.len() as u64;
        Ok(Some(batch))
    }

    /// `fut`, or [`Error::BrokerTimeout`] once `broker_timeout` has passed.
    pub(crate) async fn bounded<T>(
        &self,
        what: &'static str,
        fut: impl Future<Output = T>,
    ) -> Result<T, Error> {
        tokio::time::timeout(self.broker_timeout, fut)
            .await
            .map_err(|_| Error::BrokerTimeout { what, timeout: self.broker_timeout })
    }

    /// Resolves once the consuming channel has not been connected for `broker_timeout`: a
    /// stream that lapin leaves silent after its connection failed must not hold the consumer.
    async fn lost(&self) {
        let every =
            (self.broker_timeout / 10).clamp(Duration::from_millis(1), Duration::from_secs(1));
        let mut since = None;
        loop {
            tokio::time::sleep(every).await;
            if self.channel.status().connected() {
                since = None;
            } else if since.get_or_insert_with(tokio::time::Instant::now).elapsed()
                >= self.broker_timeout
            {
                return;
            }
        }
    }

    /// Cancels the consumer, requeues what the broker pushed meanwhile, closes the channels.
    pub(crate) async fn close(&self, mut stream: lapin::Consumer, stats: &mut Stats) {
        let cancel =
            self.channel.basic_cancel(self.tag.as_str().into(), BasicCancelOptions::default());
        match self.bounded("basic.cancel", cancel).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(target: "idem", error = %e, "basic.cancel failed"),
            Err(e) => {
                tracing::warn!(target: "idem", error = %e, "basic.cancel unanswered; closing")
            }
        }
        // After cancel-ok the stream ends; the bound only guards against a silent broker.
        while let Ok(Some(Ok(d))) =
            tokio::time::timeout(Duration::from_secs(5), stream.next()).await
        {
            let nack = d.nack(BasicNackOptions { multiple: false, requeue: true });
            match self.bounded("a nack", nack).await {
                Ok(Ok(true)) => {
                    stats.requeued += 1;
                    stats.returned_at_shutdown += 1;
                }
                _ => break,
            }
        }
        for ch in [&self.channel, &self.publisher] {
            let close = ch.close(200, "idem consumer shutdown".into());
            match self.bounded("channel.close", close).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!(target: "idem", error = %e, "channel close"),
                Err(e) => tracing::debug!(target: "idem", error = %e, "channel close unanswered"),
            }
        }
    }
}

fn next_delivery(
    d: Option<Result<lapin::message::Delivery, lapin::Error>>,
) -> Result<lapin::message::Delivery, Error> {
    match d {
        Some(Ok(d)) => Ok(d),
        Some(Err(e)) => Err(Error::Stream(e)),
        None => Err(Error::Cancelled),
    }
}
