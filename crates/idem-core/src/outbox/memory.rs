//! In-memory outbox and publisher: the reference implementation, for tests and examples.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use super::{
    OutboxCounts, OutboxError, OutboxId, OutboxMessage, OutboxStore, Outgoing, Pending,
    PublishError, PublishFailure, Publisher, Ticket, UnsentRow,
};
use crate::time::{Clock, SystemClock};
use crate::{StoreError, Timestamp};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Pending,
    Sent(Timestamp),
    Parked,
}

#[derive(Debug)]
struct Row {
    message: OutboxMessage,
    state: State,
    failures: u32,
    due: Timestamp,
    lease_until: Timestamp,
    token: i64,
    reason: Option<String>,
}

/// An outbox in process memory, on a [`Clock`]: the reference implementation of
/// [`OutboxStore`]. Nothing survives the process, and nothing joins a database transaction:
/// use it to test relays and publishers.
#[derive(Debug, Clone)]
pub struct MemoryOutbox {
    rows: Arc<Mutex<BTreeMap<i64, Row>>>,
    clock: Arc<dyn Clock>,
}

impl Default for MemoryOutbox {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryOutbox {
    /// An empty outbox on the system clock.
    pub fn new() -> Self {
        Self::with_clock(SystemClock)
    }

    /// An empty outbox reading `clock`.
    pub fn with_clock(clock: impl Clock) -> Self {
        Self { rows: Arc::default(), clock: Arc::new(clock) }
    }

    fn rows(&self) -> MutexGuard<'_, BTreeMap<i64, Row>> {
        self.rows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The last failure recorded for `id`, if any.
    pub fn reason(&self, id: &OutboxId) -> Option<String> {
        self.rows().values().find(|r| r.message.id() == id).and_then(|r| r.reason.clone())
    }
}

fn row_of<'a>(rows: &'a mut BTreeMap<i64, Row>, t: &Ticket) -> Option<&'a mut Row> {
    rows.get_mut(&t.row).filter(|r| r.token == t.token && r.state == State::Pending)
}

impl OutboxStore for MemoryOutbox {
    async fn send(&self, messages: Vec<Outgoing>) -> Result<Vec<OutboxId>, OutboxError> {
        for m in &messages {
            m.validate()?;
        }
        let now = self.clock.now();
        let mut rows = self.rows();
        let mut ids = Vec::with_capacity(messages.len());
        for m in messages {
            let message = m.into_message(OutboxId::random);
            ids.push(message.id().clone());
            if rows.values().any(|r| r.message.id() == message.id()) {
                continue; // enqueued before: the same message
            }
            let seq = rows.last_key_value().map_or(1, |(k, _)| k + 1);
            rows.insert(
                seq,
                Row {
                    message,
                    state: State::Pending,
                    failures: 0,
                    due: now,
                    lease_until: now,
                    token: 0,
                    reason: None,
                },
            );
        }
        Ok(ids)
    }

    async fn claim(&self, limit: usize, lease: Duration) -> Result<Vec<Pending>, StoreError> {
        let now = self.clock.now();
        let mut rows = self.rows();
        let mut blocked = HashSet::new();
        let mut out = Vec::new();
        for (&row, r) in rows.iter_mut() {
            if out.len() >= limit {
                break;
            }
            if matches!(r.state, State::Sent(_)) {
                continue;
            }
            if let Some(k) = r.message.ordering_key() {
                // Only the oldest unsent row of an ordering key is ever leased.
                if !blocked.insert((r.message.destination().to_owned(), k.to_owned())) {
                    continue;
                }
            }
            if r.state == State::Pending && r.due <= now && r.lease_until <= now {
                r.token += 1;
                r.lease_until = now.plus(lease);
                out.push(Pending::new(
                    Ticket { row, token: r.token },
                    r.failures,
                    r.message.clone(),
                ));
            }
        }
        Ok(out)
    }

    async fn mark_sent(&self, tickets: &[Ticket]) -> Result<u64, StoreError> {
        let now = self.clock.now();
        let mut rows = self.rows();
        let mut n = 0;
        for t in tickets {
            if let Some(r) = row_of(&mut rows, t) {
                r.state = State::Sent(now);
                n += 1;
            }
        }
        Ok(n)
    }

    async fn remove_sent(&self, tickets: &[Ticket]) -> Result<u64, StoreError> {
        let mut rows = self.rows();
        let mut n = 0;
        for t in tickets {
            if row_of(&mut rows, t).is_some() {
                rows.remove(&t.row);
                n += 1;
            }
        }
        Ok(n)
    }

    async fn mark_failed(&self, failures: &[PublishFailure]) -> Result<u64, StoreError> {
        let now = self.clock.now();
        let mut rows = self.rows();
        let mut n = 0;
        for f in failures {
            if let Some(r) = row_of(&mut rows, &f.ticket) {
                r.failures += 1;
                r.reason = Some(f.reason.clone());
                r.lease_until = now;
                r.token += 1; // the lease is spent
                match f.retry_in {
                    Some(d) => r.due = now.plus(d),
                    None => r.state = State::Parked,
                }
                n += 1;
            }
        }
        Ok(n)
    }

    async fn purge_sent(&self, older_than: Duration, limit: usize) -> Result<u64, StoreError> {
        let now = self.clock.now();
        let mut rows = self.rows();
        let old: Vec<i64> = rows
            .iter()
            .filter(|(_, r)| matches!(r.state, State::Sent(at) if at.plus(older_than) <= now))
            .map(|(k, _)| *k)
            .take(limit)
            .collect();
        for k in &old {
            rows.remove(k);
        }
        Ok(old.len() as u64)
    }

    async fn retry_parked(&self, limit: usize) -> Result<u64, StoreError> {
        let now = self.clock.now();
        let mut n = 0;
        for r in self.rows().values_mut().filter(|r| r.state == State::Parked).take(limit) {
            r.state = State::Pending;
            r.failures = 0;
            r.due = now;
            n += 1;
        }
        Ok(n)
    }

    async fn counts(&self) -> Result<OutboxCounts, StoreError> {
        let mut c = OutboxCounts::default();
        for r in self.rows().values() {
            match r.state {
                State::Pending => c.pending += 1,
                State::Sent(_) => c.sent += 1,
                State::Parked => c.parked += 1,
            }
        }
        Ok(c)
    }

    async fn unsent(&self, limit: usize) -> Result<Vec<UnsentRow>, StoreError> {
        let rows = self.rows();
        let unsent = |parked: bool| {
            rows.iter().filter(move |(_, r)| match r.state {
                State::Parked => parked,
                State::Pending => !parked,
                State::Sent(_) => false,
            })
        };
        Ok(unsent(true)
            .chain(unsent(false))
            .take(limit)
            .map(|(seq, r)| {
                UnsentRow::new(
                    *seq,
                    r.message.id().as_str(),
                    r.message.destination(),
                    r.state == State::Parked,
                    r.failures,
                    r.reason.clone(),
                )
            })
            .collect())
    }
}

/// A [`Publisher`] that keeps what it is given, and can be told to fail: for tests.
#[derive(Debug, Clone, Default)]
pub struct RecordingPublisher {
    inner: Arc<Mutex<Recorded>>,
}

#[derive(Debug, Default)]
struct Recorded {
    published: Vec<OutboxMessage>,
    fail_next: u32,
    retryable: bool,
}

impl RecordingPublisher {
    /// A publisher that confirms everything.
    pub fn new() -> Self {
        Self::default()
    }

    /// Everything confirmed so far, in order.
    pub fn published(&self) -> Vec<OutboxMessage> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner).published.clone()
    }

    /// Fails the next `n` messages, as retryable failures or permanent ones.
    pub fn fail_next(&self, n: u32, retryable: bool) {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        g.fail_next = n;
        g.retryable = retryable;
    }
}

impl Publisher for RecordingPublisher {
    async fn publish(&self, batch: &[OutboxMessage]) -> Vec<Result<(), PublishError>> {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        batch
            .iter()
            .map(|m| {
                if g.fail_next > 0 {
                    g.fail_next -= 1;
                    return Err(PublishError::new(
                        m.destination(),
                        g.retryable,
                        "injected failure",
                    ));
                }
                g.published.push(m.clone());
                Ok(())
            })
            .collect()
    }
}
