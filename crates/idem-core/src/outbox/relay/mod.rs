//! The relay: reads what a [`Feed`] holds, publishes it, acknowledges what the broker
//! confirmed. One loop for every outbox: the table outbox acknowledges leased rows, the WAL
//! outbox a slot position; the rest (publish timeout, metrics, backoff, the failure policy,
//! store-failure retries, shutdown, the report) is written here once.

mod builder;
mod feed;
#[cfg(test)]
mod tests;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use futures_util::future::Shared;

use builder::Settings;
pub use builder::{Builder, RelayError, RelayReport};
pub use feed::{Feed, FeedKind, Read, Settled, Tickets};

use super::{OutboxMessage, PublishError, Publisher};
use crate::StoreError;
use crate::telemetry::{OUTBOX_FAILURES_TOTAL, OUTBOX_PUBLISH_SECONDS, OUTBOX_PUBLISHED_TOTAL};

/// Publishes what handlers enqueued in an outbox, at least once, each message under its stable
/// id so that the idem consumer downstream deduplicates copies.
///
/// Each round: read due messages from the [`Feed`] (an [`OutboxStore`](super::OutboxStore)
/// leases rows; `idem-sqlx`'s WAL outbox peeks its slot), publish them and wait for the
/// broker's confirmations ([`Publisher::publish`], bounded by [`Builder::publish_timeout`]),
/// then acknowledge: confirmed rows are marked sent, failed ones retried after a backoff or
/// parked after [`Builder::max_attempts`] or a permanent failure; a WAL slot moves past what
/// was confirmed in order, and stays before a failure ([`RelayError::Stuck`] after
/// `max_attempts`). When nothing is due it waits for work. Sent rows are purged after
/// [`Builder::retain_sent`].
///
/// A relay that crashes between the broker's confirmation and the acknowledgement publishes
/// those messages again (after their lease, or from the slot's position) under the same ids.
///
/// ```
/// use idem_core::outbox::{MemoryOutbox, OutboxStore, Outgoing, Relay, RecordingPublisher};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = MemoryOutbox::new();
/// outbox.send(vec![Outgoing::new("orders.accepted", "o-1")]).await?;
/// let broker = RecordingPublisher::new();
/// let relay = Relay::builder(outbox.clone(), broker.clone()).build()?;
/// let report = relay.run_until_empty().await?;
/// assert_eq!(report.published, 1);
/// assert_eq!(broker.published()[0].destination(), "orders.accepted");
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Relay<F, P> {
    feed: F,
    publisher: P,
    settings: Settings,
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a round leaves the loop to do.
enum Next {
    /// Read again at once: the feed says more may be waiting.
    More,
    /// Messages were read, and the feed says nothing more was waiting then: a running relay
    /// reads again at once, one draining the feed stops.
    Drained,
    /// Wait for work.
    Idle,
    /// A position feed's oldest message failed: try again after this long.
    Backoff(Duration),
    /// It failed too often: stop.
    Stuck(RelayError),
}

impl<F: Feed, P: Publisher> Relay<F, P> {
    /// Starts configuring a relay from `feed` (an outbox) to `publisher`.
    pub fn builder(feed: F, publisher: P) -> Builder<F, P> {
        Builder::new(feed, publisher)
    }

    /// The outbox.
    pub fn store(&self) -> &F {
        &self.feed
    }

    /// Runs until `shutdown` completes: the batch in flight is published and acknowledged
    /// first. A relay on a position feed another relay holds waits as a standby and takes
    /// over when the first one lets go.
    ///
    /// # Errors
    /// [`RelayError::Store`] when the outbox fails for good; [`RelayError::Stuck`].
    ///
    /// # Cancel safety
    /// Not cancel safe; stop it with `shutdown`. Dropped midway, read messages are published
    /// again (after their lease, or from the slot's position): at least once.
    pub async fn run(
        &self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<RelayReport, RelayError> {
        let shutdown: BoxFuture<'_, ()> = Box::pin(shutdown);
        let shutdown = shutdown.shared();
        let failed = AtomicBool::new(false);
        let lanes = (0..self.settings.concurrency).map(|lane| {
            let (shutdown, failed) = (shutdown.clone(), &failed);
            async move {
                let mut report = RelayReport::default();
                let ended = self.lane(lane, shutdown, failed, &mut report).await;
                if ended.is_err() {
                    failed.store(true, Ordering::SeqCst);
                }
                (ended, report)
            }
        });
        let mut total = RelayReport::default();
        let mut first_err = None;
        for (ended, report) in futures_util::future::join_all(lanes).await {
            total += report;
            if let Err(e) = ended {
                first_err.get_or_insert(e);
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(total),
        }
    }

    /// Publishes until a read finds nothing due (rows waiting for a retry stay), then returns:
    /// for tests, scripts and `idem relay --once`. Runs [`Builder::concurrency`] loops, each
    /// until its own read comes back empty. Store failures are not retried.
    ///
    /// # Errors
    /// [`RelayError::Store`] when the outbox fails; [`RelayError::Busy`] when another relay
    /// holds a position feed; [`RelayError::Stuck`].
    ///
    /// # Cancel safety
    /// As [`run`](Self::run).
    pub async fn run_until_empty(&self) -> Result<RelayReport, RelayError> {
        let lanes = (0..self.settings.concurrency).map(|_| async {
            let mut report = RelayReport::default();
            let Some(mut hold) = self.feed.take().await.map_err(RelayError::Store)? else {
                return Err(RelayError::Busy { feed: self.feed.describe() });
            };
            let mut oldest = 0;
            let ended = loop {
                match self.round(&mut hold, &mut oldest, &mut report).await {
                    Err(e) => break Err(RelayError::Store(e)),
                    Ok(Next::More) => {}
                    Ok(Next::Drained | Next::Idle) => break Ok(report),
                    Ok(Next::Backoff(d)) => tokio::time::sleep(d).await,
                    Ok(Next::Stuck(e)) => break Err(e),
                }
            };
            self.feed.release(hold).await;
            ended
        });
        let mut total = RelayReport::default();
        for r in futures_util::future::join_all(lanes).await {
            total += r?;
        }
        Ok(total)
    }

    async fn lane(
        &self,
        lane: usize,
        shutdown: Shared<BoxFuture<'_, ()>>,
        failed: &AtomicBool,
        report: &mut RelayReport,
    ) -> Result<(), RelayError> {
        let s = &self.settings;
        let (mut in_a_row, mut oldest) = (0u32, 0u32);
        let mut last_purge: Option<Instant> = None;
        let mut hold: Option<F::Hold> = None;
        loop {
            if shutdown.peek().is_some() || failed.load(Ordering::SeqCst) {
                break;
            }
            let purge_due = last_purge.is_none_or(|t| t.elapsed() >= s.purge_every);
            if lane == 0 && !s.retain_sent.is_zero() && purge_due {
                last_purge = Some(Instant::now());
                match self.feed.purge(s.retain_sent, 1000).await {
                    Ok(n) => report.purged += n,
                    Err(e) => tracing::warn!(error = %e, "outbox purge failed"),
                }
            }
            let next = match hold.as_mut() {
                None => match self.feed.take().await {
                    Ok(Some(h)) => {
                        hold = Some(h);
                        Next::More
                    }
                    Ok(None) => Next::Backoff(s.poll), // a standby
                    Err(e) => Next::Backoff(self.store_failed(e, &mut in_a_row, report)?),
                },
                Some(h) => match self.round(h, &mut oldest, report).await {
                    Ok(next) => {
                        in_a_row = 0;
                        next
                    }
                    Err(e) => {
                        hold = None; // dropped: a new one next time
                        Next::Backoff(self.store_failed(e, &mut in_a_row, report)?)
                    }
                },
            };
            let stopped = match next {
                Next::More | Next::Drained => shutdown.peek().is_some(),
                Next::Idle => tokio::select! {
                    () = self.feed.wait(s.poll) => false,
                    () = shutdown.clone() => true,
                },
                Next::Backoff(d) => tokio::select! {
                    () = tokio::time::sleep(d) => false,
                    () = shutdown.clone() => true,
                },
                Next::Stuck(e) => return Err(e),
            };
            if stopped {
                break;
            }
        }
        if let Some(h) = hold {
            self.feed.release(h).await;
        }
        Ok(())
    }

    /// Counts a store failure; the wait before trying again, or the error that stops the relay.
    fn store_failed(
        &self,
        e: StoreError,
        in_a_row: &mut u32,
        report: &mut RelayReport,
    ) -> Result<Duration, RelayError> {
        let s = &self.settings;
        if !e.is_retryable() || *in_a_row + 1 >= s.store_failures {
            return Err(RelayError::Store(e));
        }
        *in_a_row += 1;
        report.store_failures += 1;
        let wait = backoff(s.backoff.0, s.backoff.1.min(Duration::from_secs(5)), *in_a_row);
        tracing::warn!(error = %e, retry_in = ?wait, "outbox store failed; retrying");
        Ok(wait)
    }

    /// One read, publish and acknowledgement. `oldest`: failed rounds in a row of a position
    /// feed.
    async fn round(
        &self,
        hold: &mut F::Hold,
        oldest: &mut u32,
        report: &mut RelayReport,
    ) -> Result<Next, StoreError> {
        let s = &self.settings;
        let read = self.feed.read(hold, s.batch, s.lease).await?;
        let n = read.messages.len();
        if n > 0 {
            report.batches += 1;
        }
        let results = self.publish(&read.messages).await;
        let (settled, first_failure) = self.settle(&read, results, *oldest);
        let keep_sent = !s.retain_sent.is_zero();
        let published = self.feed.acknowledge(hold, read.batch, &settled, keep_sent).await?;
        report.published += published;
        metrics::counter!(OUTBOX_PUBLISHED_TOTAL).increment(published);
        if F::KIND == FeedKind::Rows {
            let sent = settled.iter().filter(|x| x.is_sent()).count() as u64;
            report.lost_leases += sent.saturating_sub(published);
            let parked = settled.iter().filter(|x| matches!(x, Settled::Park { .. })).count();
            let retried = settled.iter().filter(|x| matches!(x, Settled::Retry { .. })).count();
            report.parked += parked as u64;
            report.retried += retried as u64;
            metrics::counter!(OUTBOX_FAILURES_TOTAL, "parked" => "true").increment(parked as u64);
            metrics::counter!(OUTBOX_FAILURES_TOTAL, "parked" => "false").increment(retried as u64);
        } else if let Some((id, e)) = first_failure {
            report.retried += (n as u64).saturating_sub(published);
            metrics::counter!(OUTBOX_FAILURES_TOTAL, "parked" => "false").increment(1);
            *oldest += 1;
            let reason = crate::ErrorChain(&e).to_string();
            if *oldest >= s.max_attempts {
                tracing::error!(%id, attempts = *oldest, error = %reason, "relay stuck");
                return Ok(Next::Stuck(RelayError::Stuck { id, attempts: *oldest, source: e }));
            }
            let wait = backoff(s.backoff.0, s.backoff.1, *oldest);
            tracing::warn!(%id, attempts = *oldest, retry_in = ?wait, error = %reason,
                "publish failed; the relay stays before it");
            return Ok(Next::Backoff(wait));
        } else {
            *oldest = 0;
        }
        Ok(match (read.more, n) {
            (true, _) => Next::More,
            (false, 0) => Next::Idle,
            (false, _) => Next::Drained,
        })
    }

    /// Publishes `messages` and waits for the confirmations, at most the publish timeout: one
    /// result per message.
    async fn publish(&self, messages: &[OutboxMessage]) -> Vec<Result<(), PublishError>> {
        if messages.is_empty() {
            return Vec::new();
        }
        let started = Instant::now();
        let published =
            tokio::time::timeout(self.settings.publish_timeout, self.publisher.publish(messages))
                .await;
        metrics::histogram!(OUTBOX_PUBLISH_SECONDS).record(started.elapsed().as_secs_f64());
        let why = match published {
            Ok(r) if r.len() == messages.len() => return r,
            Ok(r) => {
                format!("publisher answered {} results for {} messages", r.len(), messages.len())
            }
            Err(_) => "not confirmed within the publish timeout".to_owned(),
        };
        messages
            .iter()
            .map(|m| Err(PublishError::new(m.destination(), true, why.clone())))
            .collect()
    }

    /// What became of each message, by the feed's failure policy; and, for a position feed,
    /// the first failure (the oldest message the position stays before).
    fn settle(
        &self,
        read: &Read<F::Batch>,
        results: Vec<Result<(), PublishError>>,
        oldest: u32,
    ) -> (Vec<Settled>, Option<(String, PublishError)>) {
        let s = &self.settings;
        let mut first = None;
        let settled = results
            .into_iter()
            .zip(&read.messages)
            .enumerate()
            .map(|(i, (r, m))| {
                let Err(e) = r else { return Settled::Sent };
                let reason = crate::ErrorChain(&e).to_string();
                if F::KIND == FeedKind::Position {
                    let after = backoff(s.backoff.0, s.backoff.1, oldest + 1);
                    first.get_or_insert_with(|| (m.id().to_string(), e));
                    return Settled::Retry { reason, after };
                }
                let attempts = read.failed_before.get(i).copied().unwrap_or(0) + 1;
                if e.is_retryable() && attempts < s.max_attempts {
                    let after = backoff(s.backoff.0, s.backoff.1, attempts);
                    tracing::warn!(id = %m.id(), attempts, retry_in = ?after, error = %reason,
                        "publish failed; will retry");
                    Settled::Retry { reason, after }
                } else {
                    tracing::error!(id = %m.id(), attempts, error = %reason,
                        "publish failed; row parked");
                    Settled::Park { reason }
                }
            })
            .collect();
        (settled, first)
    }
}

/// `first × 2^(n−1)`, at most `max`.
fn backoff(first: Duration, max: Duration, n: u32) -> Duration {
    first.saturating_mul(1u32 << n.saturating_sub(1).min(20)).min(max)
}
