//! A relay's settings, its report and why it stops.

use std::fmt;
use std::ops::AddAssign;
use std::time::Duration;

use super::{Feed, FeedKind, Relay};
use crate::StoreError;
use crate::outbox::{OutboxStore, PublishError, Publisher};

/// Why a relay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The outbox failed in a way retrying will not fix (for the WAL outbox: no such slot,
    /// `wal_level` not logical, a message that does not decode), or failed
    /// [`Builder::store_failures`] times in a row.
    #[error("outbox store failed; the relay stopped")]
    Store(#[source] StoreError),
    /// Another relay reads the feed ([`Relay::run_until_empty`] does not wait for it; only a
    /// [`FeedKind::Position`] feed is read by one relay at a time).
    #[error("another relay is reading {feed}")]
    Busy {
        /// The feed, as it describes itself (`slot idem_outbox`).
        feed: String,
    },
    /// The oldest unconfirmed message of a [`FeedKind::Position`] feed failed
    /// [`Builder::max_attempts`] times in a row. The position stays before it: nothing after it
    /// is lost, nothing is skipped.
    #[error("message {id} failed {attempts} publishes in a row; the relay stays before it")]
    Stuck {
        /// The message's id.
        id: String,
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        #[source]
        source: PublishError,
    },
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
    /// Reads that returned at least one message.
    pub batches: u64,
    /// Messages confirmed by the broker and acknowledged (marked sent, or passed by the
    /// position).
    pub published: u64,
    /// Failed publishes to be tried again (for a position: the messages it stays before).
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
pub(super) struct Settings {
    pub(super) batch: usize,
    pub(super) concurrency: usize,
    pub(super) lease: Duration,
    pub(super) publish_timeout: Duration,
    pub(super) max_attempts: u32,
    pub(super) backoff: (Duration, Duration),
    pub(super) poll: Duration,
    pub(super) retain_sent: Duration,
    pub(super) purge_every: Duration,
    pub(super) store_failures: u32,
}

impl Settings {
    fn of<F: Feed>() -> Self {
        Self {
            batch: F::BATCH,
            concurrency: 1,
            lease: Duration::from_secs(30),
            publish_timeout: Duration::from_secs(10),
            max_attempts: 10,
            backoff: F::BACKOFF,
            poll: F::POLL,
            retain_sent: Duration::from_secs(24 * 3600),
            purge_every: Duration::from_secs(60),
            store_failures: 10,
        }
    }
}

/// Configures a [`Relay`]; see [`Relay::builder`].
#[derive(Debug)]
#[must_use]
pub struct Builder<F, P> {
    feed: F,
    publisher: P,
    settings: Settings,
}

impl<F: Feed, P: Publisher> Builder<F, P> {
    pub(super) fn new(feed: F, publisher: P) -> Self {
        Self { feed, publisher, settings: Settings::of::<F>() }
    }

    /// Messages read per round (default 256 rows from a table; 4,096 decoded records from a
    /// WAL slot, where each message is one and each transaction two more, and a read ends on
    /// a transaction boundary).
    pub fn batch(mut self, n: usize) -> Self {
        self.settings.batch = n;
        self
    }

    /// How many read–publish–acknowledge loops run at once on a table (default 1): with
    /// several, one batch's confirmations overlap the next batch's claim. A position feed is
    /// read by one loop.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.settings.concurrency = n;
        self
    }

    /// How long to wait for the broker to confirm a batch (default 10 s); on a table, shorter
    /// than the lease. Unconfirmed messages count as failed publishes.
    pub fn publish_timeout(mut self, d: Duration) -> Self {
        self.settings.publish_timeout = d;
        self
    }

    /// Publish attempts (default 10) before a row is parked, or before a relay on a position
    /// feed stops with [`RelayError::Stuck`] (a position cannot move past a message without
    /// losing it). Permanent failures park a row at once.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.settings.max_attempts = n;
        self
    }

    /// Backoff between attempts: `first`, doubling up to `max` (default 500 ms up to 5 min on
    /// a table, 100 ms up to 10 s on a WAL slot). Store failures back off the same way, up to
    /// 5 s.
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.backoff = (first, max);
        self
    }

    /// The longest wait for new messages when there were none (default 1 s on a table, which
    /// PostgreSQL's `LISTEN/NOTIFY` cuts short; 20 ms on a WAL slot), and how often a standby
    /// relay tries to take a position feed over.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.settings.poll = d;
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
    /// [`RelayError::Config`] naming the setting: a batch under the feed's least (1; 3 on a
    /// WAL slot, where a transaction is three records), a zero concurrency, lease, attempts or
    /// poll interval, more than one loop on a position feed, or a publish timeout not shorter
    /// than a table's lease.
    pub fn build(self) -> Result<Relay<F, P>, RelayError> {
        let s = &self.settings;
        let bad = |field, why| Err(RelayError::Config { field, why });
        if s.batch < F::MIN_BATCH.0.max(1) {
            return bad("batch", F::MIN_BATCH.1);
        }
        if s.concurrency == 0 {
            return bad("concurrency", "must be at least 1");
        }
        if F::KIND == FeedKind::Position && s.concurrency > 1 {
            return bad("concurrency", "must be 1: a position is read by one relay at a time");
        }
        if s.publish_timeout.is_zero() {
            return bad("publish_timeout", "must be longer than zero");
        }
        if F::KIND == FeedKind::Rows {
            if s.lease.is_zero() {
                return bad("lease", "must be longer than zero");
            }
            if s.publish_timeout >= s.lease {
                return bad("publish_timeout", "must be shorter than the lease");
            }
        }
        if s.max_attempts == 0 {
            return bad("max_attempts", "must be at least 1");
        }
        if s.poll.is_zero() {
            return bad("poll_interval", "must be longer than zero");
        }
        Ok(Relay { feed: self.feed, publisher: self.publisher, settings: self.settings })
    }
}

impl<S: OutboxStore, P: Publisher> Builder<S, P> {
    /// How long a claim holds its rows (default 30 s). A relay that dies holding rows leaves
    /// them to another relay after this long; they are then published again (consumers
    /// deduplicate them by id).
    pub fn lease(mut self, d: Duration) -> Self {
        self.settings.lease = d;
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
}
