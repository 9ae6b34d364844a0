//! The relay: leases pending rows, publishes them, marks them sent.

use std::fmt;
use std::future::Future;
use std::ops::AddAssign;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures_util::FutureExt;

use super::{OutboxMessage, OutboxStore, PublishError, PublishFailure, Publisher, Ticket};
use crate::StoreError;
use crate::telemetry::{OUTBOX_FAILURES_TOTAL, OUTBOX_PUBLISH_SECONDS, OUTBOX_PUBLISHED_TOTAL};

/// Why a relay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The outbox table failed in a way retrying will not fix, or failed
    /// [`Builder::store_failures`] times in a row.
    #[error("outbox store failed; the relay stopped")]
    Store(#[source] StoreError),
    /// A setting is out of range.
    #[error("relay setting {field} is invalid: {why}")]
    Config {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// Counts of what a relay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayReport {
    /// Claims that leased at least one row.
    pub batches: u64,
    /// Messages confirmed by the broker and marked sent.
    pub published: u64,
    /// Failed publishes scheduled for another attempt.
    pub retried: u64,
    /// Rows parked after repeated or permanent failures.
    pub parked: u64,
    /// Confirmed messages whose lease had been taken over before they were marked (another
    /// relay publishes them again; consumers see a duplicate).
    pub lost_leases: u64,
    /// Sent rows deleted after their retention.
    pub purged: u64,
    /// Store calls that failed and were retried.
    pub store_failures: u64,
}

impl AddAssign for RelayReport {
    fn add_assign(&mut self, o: Self) {
        self.batches += o.batches;
        self.published += o.published;
        self.retried += o.retried;
        self.parked += o.parked;
        self.lost_leases += o.lost_leases;
        self.purged += o.purged;
        self.store_failures += o.store_failures;
    }
}

impl fmt::Display for RelayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "batches {}: published {}, retried {}, parked {}, lost leases {}, purged {}, store failures {}",
            self.batches,
            self.published,
            self.retried,
            self.parked,
            self.lost_leases,
            self.purged,
            self.store_failures
        )
    }
}

#[derive(Debug, Clone)]
struct Settings {
    batch: usize,
    concurrency: usize,
    lease: Duration,
    publish_timeout: Duration,
    max_attempts: u32,
    backoff: (Duration, Duration),
    poll: Duration,
    retain_sent: Duration,
    purge_every: Duration,
    store_failures: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            batch: 256,
            concurrency: 1,
            lease: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(10),
            max_attempts: 10,
            backoff: (Duration::from_millis(500), Duration::from_secs(300)),
            poll: Duration::from_secs(1),
            retain_sent: Duration::from_secs(24 * 3600),
            purge_every: Duration::from_secs(60),
            store_failures: 10,
        }
    }
}

/// Configures a [`Relay`]; see [`Relay::builder`].
#[derive(Debug)]
#[must_use]
pub struct Builder<S, P> {
    store: S,
    publisher: P,
    settings: Settings,
}

impl<S: OutboxStore, P: Publisher> Builder<S, P> {
    /// Rows leased per claim (default 256).
    pub fn batch(mut self, n: usize) -> Self {
        self.settings.batch = n;
        self
    }

    /// How many claim–publish–mark loops run at once (default 1): with several, one batch's
    /// confirmations overlap the next batch's claim.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.settings.concurrency = n;
        self
    }

    /// How long a claim holds its rows (default 30 s). A relay that dies holding rows leaves
    /// them to another relay after this long; they are then published again (consumers
    /// deduplicate them by id).
    pub fn lease(mut self, d: Duration) -> Self {
        self.settings.lease = d;
        self
    }

    /// How long to wait for the broker to confirm a batch (default 10 s); must be shorter than
    /// the lease. Unconfirmed messages count as failed publishes.
    pub fn publish_timeout(mut self, d: Duration) -> Self {
        self.settings.publish_timeout = d;
        self
    }

    /// Publish attempts before a row is parked (default 10). Permanent failures park at once.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.settings.max_attempts = n;
        self
    }

    /// Backoff between attempts: `first`, doubling up to `max` (default 500 ms up to 5 min).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.backoff = (first, max);
        self
    }

    /// The longest wait for new rows when the outbox is empty (default 1 s). A store that is
    /// told of commits (PostgreSQL's `LISTEN/NOTIFY`) wakes the relay sooner.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.settings.poll = d;
        self
    }

    /// How long sent rows are kept before they are purged (default 24 h), for operators to
    /// see what went out. Zero deletes each row as soon as the broker confirmed it: the
    /// cheapest mark (on PostgreSQL a delete costs about a third of the update to *sent*), at
    /// the price of forgetting sent ids — enqueueing one again publishes it again (consumers
    /// still deduplicate it).
    pub fn retain_sent(mut self, d: Duration) -> Self {
        self.settings.retain_sent = d;
        self
    }

    /// Store failures in a row (each retried after a backoff) before the relay stops
    /// (default 10).
    pub fn store_failures(mut self, n: u32) -> Self {
        self.settings.store_failures = n;
        self
    }

    /// The relay.
    ///
    /// # Errors
    /// [`RelayError::Config`] naming the setting: a zero batch, concurrency or lease, or a
    /// publish timeout not shorter than the lease.
    pub fn build(self) -> Result<Relay<S, P>, RelayError> {
        let s = &self.settings;
        let bad = |field, why| Err(RelayError::Config { field, why });
        if s.batch == 0 {
            return bad("batch", "must be at least 1");
        }
        if s.concurrency == 0 {
            return bad("concurrency", "must be at least 1");
        }
        if s.lease.is_zero() {
            return bad("lease", "must be longer than zero");
        }
        if s.publish_timeout >= s.lease {
            return bad("publish_timeout", "must be shorter than the lease");
        }
        if s.max_attempts == 0 {
            return bad("max_attempts", "must be at least 1");
        }
        if s.poll.is_zero() {
            return bad("poll_interval", "must be longer than zero");
        }
        Ok(Relay { store: self.store, publisher: self.publisher, settings: self.settings })
    }
}

/// Publishes what handlers enqueued in an outbox, at least once, each message under its stable
/// id so that the idem consumer downstream deduplicates copies.
///
/// Each loop: lease due rows ([`OutboxStore::claim`]), publish them and wait for the broker's
/// confirmations ([`Publisher::publish`]), then mark the confirmed rows sent and the others for
/// a retry after a backoff — or parked, after [`Builder::max_attempts`] or a permanent failure.
/// When nothing is due it waits for work ([`OutboxStore::wait_for_work`]). Sent rows are
/// purged after [`Builder::retain_sent`].
///
/// A relay that crashes between the broker's confirmation and the mark leaves the rows leased;
/// once the lease runs out they are published again under the same ids.
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
pub struct Relay<S, P> {
    store: S,
    publisher: P,
    settings: Settings,
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

impl<S: OutboxStore, P: Publisher> Relay<S, P> {
    /// Starts configuring a relay from `store` to `publisher`.
    pub fn builder(store: S, publisher: P) -> Builder<S, P> {
        Builder { store, publisher, settings: Settings::default() }
    }

    /// The outbox.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Runs until `shutdown` completes: the batch in flight is published and marked first.
    ///
    /// # Errors
    /// [`RelayError::Store`] when the outbox fails for good.
    ///
    /// # Cancel safety
    /// Not cancel safe; stop it with `shutdown`. Dropped midway, claimed rows stay claimed
    /// until their lease runs out and are then published again (at least once).
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

    /// Publishes until a claim finds nothing due (rows waiting for a retry stay), then returns:
    /// for tests, scripts and `idem relay --once`. Runs [`Builder::concurrency`] loops, each
    /// until its own claim comes back empty.
    ///
    /// # Errors
    /// [`RelayError::Store`] when the outbox fails.
    ///
    /// # Cancel safety
    /// As [`run`](Self::run).
    pub async fn run_until_empty(&self) -> Result<RelayReport, RelayError> {
        let lanes = (0..self.settings.concurrency).map(|_| async {
            let mut report = RelayReport::default();
            while self.round(&mut report).await? > 0 {}
            Ok::<_, StoreError>(report)
        });
        let mut total = RelayReport::default();
        for r in futures_util::future::join_all(lanes).await {
            total += r.map_err(RelayError::Store)?;
        }
        Ok(total)
    }

    async fn lane(
        &self,
        lane: usize,
        shutdown: futures_util::future::Shared<BoxFuture<'_, ()>>,
        failed: &AtomicBool,
        report: &mut RelayReport,
    ) -> Result<(), RelayError> {
        let s = &self.settings;
        let mut in_a_row = 0u32;
        let mut last_purge: Option<Instant> = None;
        loop {
            if shutdown.peek().is_some() || failed.load(Ordering::SeqCst) {
                return Ok(());
            }
            let purge_due = last_purge.is_none_or(|t| t.elapsed() >= s.purge_every);
            if lane == 0 && !s.retain_sent.is_zero() && purge_due {
                last_purge = Some(Instant::now());
                match self.store.purge_sent(s.retain_sent, 1000).await {
                    Ok(n) => report.purged += n,
                    Err(e) => tracing::warn!(error = %e, "outbox purge failed"),
                }
            }
            match self.round(report).await {
                Ok(0) => {
                    in_a_row = 0;
                    tokio::select! {
                        () = self.store.wait_for_work(s.poll) => {}
                        () = shutdown.clone() => return Ok(()),
                    }
                }
                Ok(_) => in_a_row = 0,
                Err(e) if e.is_retryable() && in_a_row + 1 < s.store_failures => {
                    in_a_row += 1;
                    report.store_failures += 1;
                    let wait =
                        backoff(s.backoff.0, s.backoff.1.min(Duration::from_secs(5)), in_a_row);
                    tracing::warn!(error = %e, retry_in = ?wait, "outbox store failed; retrying");
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = shutdown.clone() => return Ok(()),
                    }
                }
                Err(e) => return Err(RelayError::Store(e)),
            }
        }
    }

    /// One claim, publish and mark; returns how many rows were leased.
    async fn round(&self, report: &mut RelayReport) -> Result<usize, StoreError> {
        let s = &self.settings;
        let batch = self.store.claim(s.batch, s.lease).await?;
        if batch.is_empty() {
            return Ok(0);
        }
        report.batches += 1;
        let mut leased = Vec::with_capacity(batch.len());
        let mut messages = Vec::with_capacity(batch.len());
        for p in batch {
            leased.push((p.ticket, p.failures));
            messages.push(p.message);
        }
        let started = Instant::now();
        let results = match tokio::time::timeout(
            s.publish_timeout,
            self.publisher.publish(&messages),
        )
        .await
        {
            Ok(r) if r.len() == messages.len() => r,
            Ok(r) => {
                let why = format!(
                    "publisher answered {} results for {} messages",
                    r.len(),
                    messages.len()
                );
                messages
                    .iter()
                    .map(|m| Err(PublishError::new(m.destination(), true, why.clone())))
                    .collect()
            }
            Err(_) => messages
                .iter()
                .map(|m| {
                    Err(PublishError::new(
                        m.destination(),
                        true,
                        "not confirmed within the publish timeout",
                    ))
                })
                .collect(),
        };
        metrics::histogram!(OUTBOX_PUBLISH_SECONDS).record(started.elapsed().as_secs_f64());
        let mut sent: Vec<Ticket> = Vec::with_capacity(messages.len());
        let mut failures = Vec::new();
        for ((&(ticket, failed_before), m), r) in leased.iter().zip(&messages).zip(results) {
            match r {
                Ok(()) => sent.push(ticket),
                Err(e) => failures.push(self.failure(ticket, failed_before, m, &e)),
            }
        }
        let marked = if s.retain_sent.is_zero() {
            self.store.remove_sent(&sent).await?
        } else {
            self.store.mark_sent(&sent).await?
        };
        let sent_n = sent.len() as u64;
        report.published += marked;
        report.lost_leases += sent_n.saturating_sub(marked);
        metrics::counter!(OUTBOX_PUBLISHED_TOTAL).increment(marked);
        if !failures.is_empty() {
            let parked = failures.iter().filter(|f| f.retry_in.is_none()).count() as u64;
            self.store.mark_failed(&failures).await?;
            report.parked += parked;
            report.retried += failures.len() as u64 - parked;
            metrics::counter!(OUTBOX_FAILURES_TOTAL, "parked" => "true").increment(parked);
            metrics::counter!(OUTBOX_FAILURES_TOTAL, "parked" => "false")
                .increment(failures.len() as u64 - parked);
        }
        Ok(messages.len())
    }

    fn failure(
        &self,
        ticket: Ticket,
        failed_before: u32,
        m: &OutboxMessage,
        e: &PublishError,
    ) -> PublishFailure {
        let s = &self.settings;
        let attempts = failed_before + 1;
        let reason = crate::ErrorChain(e).to_string();
        let retry_in = (e.is_retryable() && attempts < s.max_attempts)
            .then(|| backoff(s.backoff.0, s.backoff.1, attempts));
        match retry_in {
            Some(d) => {
                tracing::warn!(id = %m.id(), attempts, retry_in = ?d, error = %reason, "publish failed; will retry")
            }
            None => {
                tracing::error!(id = %m.id(), attempts, error = %reason, "publish failed; row parked")
            }
        }
        PublishFailure { ticket, reason, retry_in }
    }
}

/// `first × 2^(n−1)`, at most `max`.
fn backoff(first: Duration, max: Duration, n: u32) -> Duration {
    first.saturating_mul(1u32 << n.saturating_sub(1).min(20)).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::{MemoryOutbox, Outgoing, RecordingPublisher};

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let (a, m) = (Duration::from_millis(100), Duration::from_secs(1));
        assert_eq!(backoff(a, m, 1), a);
        assert_eq!(backoff(a, m, 3), Duration::from_millis(400));
        assert_eq!(backoff(a, m, 30), m);
    }

    #[test]
    fn settings_are_checked() {
        let b = || Relay::builder(MemoryOutbox::new(), RecordingPublisher::new());
        let e = b().publish_timeout(Duration::from_secs(30)).build().unwrap_err();
        assert!(e.to_string().contains("publish_timeout"), "{e}");
        assert!(b().batch(0).build().is_err());
        assert!(b().concurrency(0).build().is_err());
    }

    #[tokio::test]
    async fn failures_back_off_then_park() {
        let outbox = MemoryOutbox::new();
        outbox.send(vec![Outgoing::new("q", "x")]).await.unwrap();
        let broker = RecordingPublisher::new();
        broker.fail_next(3, true);
        let relay = Relay::builder(outbox.clone(), broker.clone())
            .max_attempts(3)
            .backoff(Duration::ZERO, Duration::ZERO)
            .build()
            .unwrap();
        let r = relay.run_until_empty().await.unwrap();
        assert_eq!((r.retried, r.parked, r.published), (2, 1, 0), "{r}");
        let c = outbox.counts().await.unwrap();
        assert_eq!((c.pending, c.parked), (0, 1));
        assert_eq!(outbox.retry_parked(10).await.unwrap(), 1);
        let r = relay.run_until_empty().await.unwrap();
        assert_eq!(r.published, 1);
        assert_eq!(broker.published().len(), 1);
    }

    #[tokio::test]
    async fn zero_retention_deletes_confirmed_rows() {
        let outbox = MemoryOutbox::new();
        outbox.send((0..3).map(|i| Outgoing::new("q", format!("{i}"))).collect()).await.unwrap();
        let relay = Relay::builder(outbox.clone(), RecordingPublisher::new())
            .retain_sent(Duration::ZERO)
            .concurrency(2)
            .build()
            .unwrap();
        assert_eq!(relay.run_until_empty().await.unwrap().published, 3);
        let c = outbox.counts().await.unwrap();
        assert_eq!((c.pending, c.sent, c.parked), (0, 0, 0), "confirmed rows are gone");
    }

    #[tokio::test]
    async fn a_permanent_failure_parks_at_once() {
        let outbox = MemoryOutbox::new();
        outbox.send(vec![Outgoing::new("q", "x")]).await.unwrap();
        let broker = RecordingPublisher::new();
        broker.fail_next(1, false);
        let relay = Relay::builder(outbox.clone(), broker).build().unwrap();
        let r = relay.run_until_empty().await.unwrap();
        assert_eq!(r.parked, 1);
    }

    #[tokio::test]
    async fn ordered_messages_go_one_after_the_other() {
        let outbox = MemoryOutbox::new();
        let msgs = (0..5).map(|i| Outgoing::new("q", format!("{i}")).ordering_key("k")).collect();
        outbox.send(msgs).await.unwrap();
        outbox.send(vec![Outgoing::new("q", "free")]).await.unwrap();
        let broker = RecordingPublisher::new();
        let relay = Relay::builder(outbox, broker.clone()).build().unwrap();
        let r = relay.run_until_empty().await.unwrap();
        assert_eq!((r.published, r.batches), (6, 5));
        let order: Vec<_> = broker
            .published()
            .iter()
            .filter(|m| m.ordering_key().is_some())
            .map(|m| m.payload().to_vec())
            .collect();
        assert_eq!(order, (0..5).map(|i| format!("{i}").into_bytes()).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn run_stops_at_shutdown_and_wakes_for_work() {
        let outbox = MemoryOutbox::new();
        let broker = RecordingPublisher::new();
        let relay = Relay::builder(outbox.clone(), broker.clone())
            .poll_interval(Duration::from_millis(10))
            .concurrency(2)
            .build()
            .unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let run = relay.run(async move {
            let _ = rx.await;
        });
        let feed = async {
            outbox.send(vec![Outgoing::new("q", "late")]).await.unwrap();
            while broker.published().is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let _ = tx.send(());
        };
        let (report, ()) = tokio::join!(run, feed);
        assert_eq!(report.unwrap().published, 1);
    }
}
