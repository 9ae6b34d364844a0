//! What a relay reads from: leased rows of an outbox table, or a position in a log.

use std::future::Future;
use std::time::Duration;

use crate::StoreError;
use crate::outbox::{OutboxMessage, OutboxStore, PublishFailure, Ticket};

/// How a [`Feed`] acknowledges what the broker confirmed, which decides what the relay does
/// with a failed publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FeedKind {
    /// Leased rows, each marked on its own: a failed row is retried after a backoff or
    /// parked after [`Builder::max_attempts`](super::Builder::max_attempts), and later rows go
    /// on. Several relay loops may read one feed.
    Rows,
    /// A position in a log, moved past what was confirmed in order: a failed message holds
    /// the position before it, is retried with a backoff, and stops the relay with
    /// [`RelayError::Stuck`](super::RelayError::Stuck) after `max_attempts`. One relay reads
    /// the feed at a time.
    Position,
}

/// What one [`Feed::read`] returned.
#[derive(Debug)]
#[non_exhaustive]
pub struct Read<B> {
    /// The messages to publish, in the order the feed wants them confirmed.
    pub messages: Vec<OutboxMessage>,
    /// For [`FeedKind::Rows`]: how many publishes of each message failed before (one per
    /// message). Empty for [`FeedKind::Position`], where the relay counts the oldest's failures.
    pub failed_before: Vec<u32>,
    /// What [`Feed::acknowledge`] needs to acknowledge these messages.
    pub batch: B,
    /// More may be waiting: read again without waiting for work. `false` after a read that
    /// took everything there was (a draining relay then stops; a running one still reads
    /// again at once after a read that returned messages).
    pub more: bool,
}

impl<B> Read<B> {
    /// A read of `messages`, acknowledged later with `batch`.
    pub fn new(messages: Vec<OutboxMessage>, batch: B, more: bool) -> Self {
        Self { messages, failed_before: Vec::new(), batch, more }
    }

    /// With each message's count of failed publishes before this read.
    #[must_use]
    pub(crate) fn with_failed_before(mut self, failed_before: Vec<u32>) -> Self {
        self.failed_before = failed_before;
        self
    }
}

/// What became of one published message, as the relay tells its [`Feed`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Settled {
    /// The broker confirmed it.
    Sent,
    /// It failed; try again after `after`.
    Retry {
        /// Why it failed (the error chain).
        reason: String,
        /// The backoff.
        after: Duration,
    },
    /// It failed for good (a permanent error, or too many attempts): park it.
    Park {
        /// Why it failed (the error chain).
        reason: String,
    },
}

impl Settled {
    /// Whether the broker confirmed the message.
    pub fn is_sent(&self) -> bool {
        matches!(self, Self::Sent)
    }
}

/// Where a [`Relay`](super::Relay) reads messages and what it acknowledges: the one narrow
/// piece that differs between the table outbox (every [`OutboxStore`] is a feed of
/// [`FeedKind::Rows`]) and the WAL outbox (`idem-sqlx`'s `PostgresWalOutbox`, a feed of
/// [`FeedKind::Position`]). Publishing, its timeout, metrics, backoff, the failure policy,
/// store-failure retries, shutdown and the report are the relay's, written once.
pub trait Feed: Send + Sync + 'static {
    /// How this feed acknowledges.
    const KIND: FeedKind;
    /// Default [`Builder::batch`](super::Builder::batch).
    const BATCH: usize;
    /// The smallest batch the feed can read, and what the error says below it.
    const MIN_BATCH: (usize, &'static str) = (1, "must be at least 1");
    /// Default [`Builder::poll_interval`](super::Builder::poll_interval).
    const POLL: Duration;
    /// Default [`Builder::backoff`](super::Builder::backoff): first, max.
    const BACKOFF: (Duration, Duration);

    /// What a reader holds while it reads (a connection holding a lock, or nothing). Dropping
    /// it must free what it holds (the relay drops it after a store failure).
    type Hold: Send;
    /// What acknowledging a read needs (tickets, log positions).
    type Batch: Send;

    /// Takes the feed for one reader; `None` while another reader holds it.
    ///
    /// # Errors
    /// Backend errors.
    fn take(&self) -> impl Future<Output = Result<Option<Self::Hold>, StoreError>> + Send;

    /// Reads up to `max` messages; `lease` is how long they stay this reader's
    /// ([`FeedKind::Rows`]).
    ///
    /// # Errors
    /// Backend errors, a message that does not decode.
    fn read(
        &self,
        hold: &mut Self::Hold,
        max: usize,
        lease: Duration,
    ) -> impl Future<Output = Result<Read<Self::Batch>, StoreError>> + Send;

    /// Acknowledges what became of a read's messages (`settled` is in the read's order);
    /// returns how many were acknowledged as sent (for leased rows, fewer than were confirmed
    /// when leases were lost; for a position, the confirmed ones it moved past). `keep_sent`: keep confirmed
    /// messages for [`Builder::retain_sent`](super::Builder::retain_sent) rather than delete
    /// them at once.
    ///
    /// # Errors
    /// Backend errors.
    fn acknowledge(
        &self,
        hold: &mut Self::Hold,
        batch: Self::Batch,
        settled: &[Settled],
        keep_sent: bool,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Gives the feed back at shutdown, so that another reader can take it at once.
    fn release(&self, hold: Self::Hold) -> impl Future<Output = ()> + Send {
        async { drop(hold) }
    }

    /// Waits until new messages may have been committed, or `max` passed.
    fn wait(&self, max: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(max)
    }

    /// Deletes at most `limit` confirmed messages kept longer than `older_than`; how many.
    ///
    /// # Errors
    /// Backend errors.
    fn purge(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        let _ = (older_than, limit);
        async { Ok(0) }
    }

    /// What [`RelayError::Busy`](super::RelayError::Busy) names (a slot).
    fn describe(&self) -> String;
}

/// The table outbox: leased rows, marked sent or failed by their tickets.
impl<S: OutboxStore> Feed for S {
    const KIND: FeedKind = FeedKind::Rows;
    const BATCH: usize = 256;
    const POLL: Duration = Duration::from_secs(1);
    const BACKOFF: (Duration, Duration) = (Duration::from_millis(500), Duration::from_secs(300));

    type Hold = ();
    type Batch = Tickets;

    async fn take(&self) -> Result<Option<()>, StoreError> {
        Ok(Some(()))
    }

    async fn read(
        &self,
        (): &mut (),
        max: usize,
        lease: Duration,
    ) -> Result<Read<Tickets>, StoreError> {
        let leased = OutboxStore::claim(self, max, lease).await?;
        let more = !leased.is_empty();
        let (mut tickets, mut failed_before, mut messages) = (
            Vec::with_capacity(leased.len()),
            Vec::with_capacity(leased.len()),
            Vec::with_capacity(leased.len()),
        );
        for p in leased {
            tickets.push(p.ticket);
            failed_before.push(p.failures);
            messages.push(p.message);
        }
        Ok(Read::new(messages, Tickets(tickets), more).with_failed_before(failed_before))
    }

    async fn acknowledge(
        &self,
        (): &mut (),
        tickets: Tickets,
        settled: &[Settled],
        keep_sent: bool,
    ) -> Result<u64, StoreError> {
        if tickets.0.is_empty() {
            return Ok(0);
        }
        let mut sent = Vec::with_capacity(tickets.0.len());
        let mut failures = Vec::new();
        for (&ticket, s) in tickets.0.iter().zip(settled) {
            match s {
                Settled::Sent => sent.push(ticket),
                Settled::Retry { reason, after } => failures.push(PublishFailure {
                    ticket,
                    reason: reason.clone(),
                    retry_in: Some(*after),
                }),
                Settled::Park { reason } => {
                    failures.push(PublishFailure {
                        ticket,
                        reason: reason.clone(),
                        retry_in: None,
                    });
                }
            }
        }
        let marked = if keep_sent {
            OutboxStore::mark_sent(self, &sent).await?
        } else {
            OutboxStore::remove_sent(self, &sent).await?
        };
        if !failures.is_empty() {
            OutboxStore::mark_failed(self, &failures).await?;
        }
        Ok(marked)
    }

    fn wait(&self, max: Duration) -> impl Future<Output = ()> + Send {
        OutboxStore::wait_for_work(self, max)
    }

    fn purge(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        OutboxStore::purge_sent(self, older_than, limit)
    }

    fn describe(&self) -> String {
        "the outbox table".to_owned()
    }
}

/// The tickets of a read of leased rows.
#[derive(Debug)]
pub struct Tickets(Vec<Ticket>);
