//! The contract an outbox table offers its relay.

use std::future::Future;
use std::time::Duration;

use super::{OutboxId, OutboxMessage, Outgoing};
use crate::StoreError;

/// A row leased to one relay: publish it, then report it [`sent`](OutboxStore::mark_sent) or
/// [`failed`](OutboxStore::mark_failed) with its [`Ticket`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Pending {
    /// The row and the lease on it.
    pub ticket: Ticket,
    /// How many publish attempts failed before this one.
    pub failures: u32,
    /// The message.
    pub message: OutboxMessage,
}

impl Pending {
    /// A leased row as a store read it.
    pub fn new(ticket: Ticket, failures: u32, message: OutboxMessage) -> Self {
        Self { ticket, failures, message }
    }
}

/// Which row, under which lease: marks are fenced by the token, so a relay whose lease ran out
/// and was taken over changes nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Ticket {
    /// The row's sequence number (enqueue order).
    pub row: i64,
    /// The lease's fencing token.
    pub token: i64,
}

/// A failed publish, as the relay reports it.
#[derive(Clone, Debug)]
pub struct PublishFailure {
    /// The row and lease.
    pub ticket: Ticket,
    /// Why it failed (stored for operators; cut to 1,000 bytes).
    pub reason: String,
    /// Try again after this long, or `None` to park the row: it stays in the table, is never
    /// published again on its own, and blocks later messages with its ordering key.
    pub retry_in: Option<Duration>,
}

/// Rows of an outbox by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxCounts {
    /// Not yet confirmed by the broker (including rows leased right now and rows waiting
    /// for a retry).
    pub pending: u64,
    /// Confirmed, kept until the retention for sent rows passes.
    pub sent: u64,
    /// Given up on after repeated failures; need an operator.
    pub parked: u64,
}

/// A row not yet sent, as an operator sees it (the console's outbox page).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnsentRow {
    /// The row's sequence number (enqueue order).
    pub row: i64,
    /// The message id the relay publishes it with.
    pub message_id: String,
    /// Where it goes.
    pub destination: String,
    /// Given up on after repeated failures, until an operator retries it.
    pub parked: bool,
    /// Publishes that failed so far.
    pub failures: u32,
    /// Why the last one failed.
    pub last_error: Option<String>,
}

impl UnsentRow {
    /// A row as a store read it.
    pub fn new(
        row: i64,
        message_id: impl Into<String>,
        destination: impl Into<String>,
        parked: bool,
        failures: u32,
        last_error: Option<String>,
    ) -> Self {
        Self {
            row,
            message_id: message_id.into(),
            destination: destination.into(),
            parked,
            failures,
            last_error,
        }
    }
}

/// An outbox table as its relay sees it.
///
/// # Contract
/// - **Exclusive leases.** [`claim`](Self::claim) leases due rows atomically: rows leased by one
///   call are not returned by another, concurrent or later, until the lease runs out (on the
///   store's clock). Several relays may run on one outbox.
/// - **Fenced marks.** `mark_sent` and `mark_failed` change a row only while the ticket's token
///   is the row's current one; a stale ticket changes nothing.
/// - **Ordering.** Of the unsent rows sharing a destination and an ordering key, only the
///   oldest is ever leased; the next becomes due once it is marked sent.
/// - **Nothing sent is published again by the relay; nothing unsent is dropped.** Only
///   [`purge_sent`](Self::purge_sent) deletes, and only sent rows.
///
/// The conformance suite in `idem-testkit` checks each store against this contract.
pub trait OutboxStore: Send + Sync + 'static {
    /// Enqueues messages in a transaction of their own (use a store's `enqueue` inside a
    /// transaction to commit them with other writes). Messages without an id get a random one.
    ///
    /// # Errors
    /// A message that breaks a limit (nothing is enqueued); backend errors.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped mid-way, the messages may or may not be enqueued.
    fn send(
        &self,
        messages: Vec<Outgoing>,
    ) -> impl Future<Output = Result<Vec<OutboxId>, super::OutboxError>> + Send;

    /// Leases up to `limit` due rows for `lease`, oldest first.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Not cancel safe: rows leased by a dropped call become due again when the lease runs out.
    fn claim(
        &self,
        limit: usize,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<Pending>, StoreError>> + Send;

    /// Marks rows as confirmed by the broker; returns how many were still held by these tickets.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: a row left unmarked is published again after its lease.
    fn mark_sent(&self, tickets: &[Ticket])
    -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes rows confirmed by the broker instead of keeping them as sent (for relays that
    /// keep no sent rows: one cheap delete instead of an update and a later purge); returns how
    /// many were still held by these tickets. Fenced like `mark_sent`.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: a row left in place is published again after its lease.
    fn remove_sent(
        &self,
        tickets: &[Ticket],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Records failed publishes: each row is due again after its `retry_in`, or parked.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: a row left unmarked is due again after its lease.
    fn mark_failed(
        &self,
        failures: &[PublishFailure],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Deletes at most `limit` rows sent more than `older_than` ago; returns how many.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe.
    fn purge_sent(
        &self,
        older_than: Duration,
        limit: usize,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Makes parked rows due again (an operator decided to retry them); returns how many.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe.
    fn retry_parked(&self, limit: usize) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Counts rows by state.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe.
    fn counts(&self) -> impl Future<Output = Result<OutboxCounts, StoreError>> + Send;

    /// Up to `limit` rows not yet sent, parked ones first, each group in enqueue order: what an
    /// operator looks at when the outbox does not drain.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe.
    fn unsent(
        &self,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<UnsentRow>, StoreError>> + Send;

    /// Waits until new rows may have been committed, or `max` passed. The default polls:
    /// it sleeps `max`. PostgreSQL wakes on `LISTEN/NOTIFY`.
    ///
    /// # Cancel safety
    /// Cancel safe.
    fn wait_for_work(&self, max: Duration) -> impl Future<Output = ()> + Send {
        tokio::time::sleep(max)
    }
}
