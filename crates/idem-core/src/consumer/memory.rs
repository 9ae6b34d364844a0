//! An in-process at-least-once queue: a [`Source`] for examples, the demo and unit tests of
//! the driver's logic (never a substitute for a broker's own tests).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::{DeadLetter, Opening, Source, SourceConfig};
use crate::engine::Verb;
use crate::extract::Envelope;

/// A queue held in memory, with a broker's manners: a fetched message is redelivered unless it
/// is acknowledged, retries wait their delay, dead letters are kept aside. Clones share the
/// queue, so a test keeps one to push messages and look at the results while a [`Consumer`]
/// consumes another.
///
/// [`Consumer`]: super::Consumer
///
/// ```
/// use idem_core::consumer::{MemoryQueue, Source};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let q = MemoryQueue::new();
/// q.push("m-1", "{}");
/// let batch = q.fetch(10, std::time::Duration::ZERO).await.unwrap();
/// assert_eq!(batch.len(), 1);
/// assert_eq!(q.pending(), 1); // fetched, not yet settled
/// # }
/// ```
#[derive(Clone, Default)]
pub struct MemoryQueue {
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
}

#[derive(Default)]
struct State {
    next_seq: u64,
    ready: VecDeque<MemoryDelivery>,
    delayed: Vec<(Instant, MemoryDelivery)>,
    in_flight: usize,
    acked: Vec<MemoryDelivery>,
    dead: Vec<(MemoryDelivery, DeadLetter)>,
    max_deliveries: Option<u32>,
    fail_dead_letters: bool,
}

impl std::fmt::Debug for MemoryQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryQueue").field("pending", &self.pending()).finish_non_exhaustive()
    }
}

/// One message of a [`MemoryQueue`]: cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryDelivery {
    inner: Arc<Inner>,
    deliveries: u32,
}

#[derive(Debug, PartialEq, Eq)]
struct Inner {
    seq: u64,
    id: Option<String>,
    payload: Vec<u8>,
    headers: Vec<(String, String)>,
}

impl MemoryDelivery {
    /// Its position in the queue (never a dedup key: a producer's retry gets a new one).
    pub fn seq(&self) -> u64 {
        self.inner.seq
    }

    /// How many times it has been fetched, this time included.
    pub fn deliveries(&self) -> u32 {
        self.deliveries
    }

    /// The body.
    pub fn payload(&self) -> &[u8] {
        &self.inner.payload
    }
}

impl Envelope for MemoryDelivery {
    fn payload(&self) -> &[u8] {
        &self.inner.payload
    }

    fn redelivery(&self) -> crate::extract::Redelivery {
        crate::extract::Redelivery::again_if(self.deliveries > 1)
    }

    fn message_id(&self) -> Option<&str> {
        self.inner.id.as_deref()
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.inner
            .headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

impl MemoryQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Publishes a message with a producer message id; returns its sequence number.
    pub fn push(&self, message_id: impl Into<String>, payload: impl Into<Vec<u8>>) -> u64 {
        self.push_with(Some(message_id.into()), payload, Vec::new())
    }

    /// Publishes a message with an optional message id and headers.
    pub fn push_with(
        &self,
        message_id: Option<String>,
        payload: impl Into<Vec<u8>>,
        headers: Vec<(String, String)>,
    ) -> u64 {
        let seq = {
            let mut st = self.state();
            st.next_seq += 1;
            let seq = st.next_seq;
            let inner = Arc::new(Inner { seq, id: message_id, payload: payload.into(), headers });
            st.ready.push_back(MemoryDelivery { inner, deliveries: 0 });
            seq
        };
        self.changed.notify_waiters();
        seq
    }

    /// Dead-letter a message instead of retrying it once it has been delivered `n` times.
    #[must_use]
    pub fn with_max_deliveries(self, n: u32) -> Self {
        self.state().max_deliveries = Some(n);
        self
    }

    /// Makes every dead-letter copy fail from now on (`true`) or succeed again: a dead-letter
    /// destination that is down.
    pub fn fail_dead_letters(&self, fail: bool) {
        self.state().fail_dead_letters = fail;
    }

    /// Messages not yet acknowledged or dead-lettered (ready, delayed or being handled).
    pub fn pending(&self) -> usize {
        let st = self.state();
        st.ready.len() + st.delayed.len() + st.in_flight
    }

    /// Messages fetched and not yet settled.
    pub fn in_flight(&self) -> usize {
        self.state().in_flight
    }

    /// The messages acknowledged so far, in order.
    pub fn acked(&self) -> Vec<MemoryDelivery> {
        self.state().acked.clone()
    }

    /// The dead-lettered messages with what their copies carry.
    pub fn dead_letters(&self) -> Vec<(MemoryDelivery, DeadLetter)> {
        self.state().dead.clone()
    }

    /// Resolves once nothing is pending: a shutdown signal for a run that should drain the queue.
    pub fn drained(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let q = self.clone();
        async move {
            loop {
                let changed = q.changed.notified();
                if q.pending() == 0 {
                    return;
                }
                let _ = tokio::time::timeout(Duration::from_millis(50), changed).await;
            }
        }
    }

    fn take_ready(&self, max: usize) -> Vec<MemoryDelivery> {
        let mut st = self.state();
        let now = Instant::now();
        let mut i = 0;
        while i < st.delayed.len() {
            if st.delayed[i].0 <= now {
                let (_, m) = st.delayed.swap_remove(i);
                st.ready.push_back(m);
            } else {
                i += 1;
            }
        }
        let n = max.min(st.ready.len());
        let batch: Vec<MemoryDelivery> = st
            .ready
            .drain(..n)
            .map(|mut m| {
                m.deliveries += 1;
                m
            })
            .collect();
        st.in_flight += batch.len();
        batch
    }
}

impl Source for MemoryQueue {
    type Delivery = MemoryDelivery;
    type Error = std::convert::Infallible;

    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<MemoryDelivery>, Self::Error> {
        let until = Instant::now() + wait;
        loop {
            let changed = self.changed.notified();
            let batch = self.take_ready(max);
            if !batch.is_empty() || Instant::now() >= until {
                return Ok(batch);
            }
            let next_due = self.state().delayed.iter().map(|(at, _)| *at).min();
            let wake = next_due.map_or(until, |d| d.min(until));
            let _ = tokio::time::timeout_at(wake, changed).await;
        }
    }

    fn give_up(&self, msg: &MemoryDelivery) -> Option<String> {
        let max = self.state().max_deliveries?;
        (msg.deliveries >= max).then(|| format!("gave up after {} deliveries", msg.deliveries))
    }

    async fn dead_letter(
        &self,
        items: &[(&MemoryDelivery, DeadLetter)],
    ) -> Vec<Result<(), Self::Error>> {
        let mut st = self.state();
        if st.fail_dead_letters {
            // Infallible has no value: a failing destination answers with fewer results.
            return Vec::new();
        }
        for (m, dl) in items {
            st.dead.push(((*m).clone(), dl.clone()));
        }
        items.iter().map(|_| Ok(())).collect()
    }

    async fn settle(&self, items: Vec<(MemoryDelivery, Verb)>) -> Result<u64, Self::Error> {
        {
            let mut st = self.state();
            for (m, action) in items {
                st.in_flight = st.in_flight.saturating_sub(1);
                match action {
                    Verb::Ack => st.acked.push(m),
                    Verb::DeadLetter { .. } => {}
                    Verb::Retry { after: Some(d) } => st.delayed.push((Instant::now() + d, m)),
                    _ => st.ready.push_back(m),
                }
            }
        }
        self.changed.notify_waiters();
        Ok(0)
    }
}

impl SourceConfig for MemoryQueue {
    type Source = MemoryQueue;

    async fn open(self, _: Opening<'_>) -> Result<Self, std::convert::Infallible> {
        Ok(self)
    }
}
