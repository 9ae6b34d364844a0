//! An in-process at-least-once queue with a visibility timeout, like SQS or a broker with
//! manual acks: a received message is invisible until acked; if the ack does not come within
//! the timeout it is delivered again, to whichever consumer asks next.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use idem::extract::Message;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Ready,
    InFlight { receipt: u64, until: Instant },
    Delayed { until: Instant },
    Done,
}

/// One delivery of a queued copy.
pub(crate) struct Delivery {
    pub receipt: u64,
    pub copy: usize,
    pub message: Message,
}

#[derive(Default)]
struct State {
    copies: Vec<(Message, Slot)>,
    ready: VecDeque<usize>,
    next_receipt: u64,
    deliveries: u64,
    dead: Vec<(usize, String)>,
    done: usize,
}

pub(crate) struct Queue {
    state: Mutex<State>,
    visibility: Duration,
}

impl Queue {
    pub(crate) fn new(messages: Vec<Message>, visibility: Duration) -> Self {
        let ready = (0..messages.len()).collect();
        let copies = messages.into_iter().map(|m| (m, Slot::Ready)).collect();
        Self { state: Mutex::new(State { copies, ready, ..State::default() }), visibility }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next visible message, waiting while others are in flight; `None` once every copy is
    /// acked or dead-lettered.
    pub(crate) async fn receive(&self) -> Option<Delivery> {
        loop {
            {
                let mut s = self.lock();
                if s.done == s.copies.len() {
                    return None;
                }
                let now = Instant::now();
                // Redeliver what timed out, release what was delayed.
                let mut back = Vec::new();
                for (i, (_, slot)) in s.copies.iter_mut().enumerate() {
                    match *slot {
                        Slot::InFlight { until, .. } | Slot::Delayed { until } if until <= now => {
                            *slot = Slot::Ready;
                            back.push(i);
                        }
                        _ => {}
                    }
                }
                s.ready.extend(back);
                while let Some(i) = s.ready.pop_front() {
                    if s.copies[i].1 != Slot::Ready {
                        continue;
                    }
                    s.next_receipt += 1;
                    s.deliveries += 1;
                    let receipt = s.next_receipt;
                    s.copies[i].1 = Slot::InFlight { receipt, until: now + self.visibility };
                    return Some(Delivery { receipt, copy: i, message: s.copies[i].0.clone() });
                }
            }
            // Nothing visible: wait a tick for a timeout or an ack elsewhere.
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Deletes the copy (a stale receipt still deletes it, as SQS does).
    pub(crate) fn ack(&self, d: &Delivery) {
        let mut s = self.lock();
        if s.copies[d.copy].1 != Slot::Done {
            s.copies[d.copy].1 = Slot::Done;
            s.done += 1;
        }
    }

    /// Makes the copy visible again after `delay`.
    pub(crate) fn nack(&self, d: &Delivery, delay: Duration) {
        let mut s = self.lock();
        if let Slot::InFlight { receipt, .. } = s.copies[d.copy].1
            && receipt == d.receipt
        {
            s.copies[d.copy].1 = Slot::Delayed { until: Instant::now() + delay };
        }
    }

    /// Moves the copy to the dead-letter queue with a reason.
    pub(crate) fn dead_letter(&self, d: &Delivery, reason: String) {
        let mut s = self.lock();
        if s.copies[d.copy].1 != Slot::Done {
            s.copies[d.copy].1 = Slot::Done;
            s.done += 1;
            s.dead.push((d.copy, reason));
        }
    }

    pub(crate) fn progress(&self) -> (usize, usize) {
        let s = self.lock();
        (s.done, s.copies.len())
    }

    pub(crate) fn deliveries(&self) -> u64 {
        self.lock().deliveries
    }

    pub(crate) fn dead_letters(&self) -> Vec<(Message, String)> {
        let s = self.lock();
        s.dead.iter().map(|(i, r)| (s.copies[*i].0.clone(), r.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn unacked_messages_come_back_after_the_visibility_timeout() {
        let q = Queue::new(vec![Message::new("a")], Duration::from_secs(1));
        let first = q.receive().await.unwrap();
        let second = q.receive().await.unwrap(); // waits (virtual time) for the timeout
        assert_eq!(first.copy, second.copy);
        assert_ne!(first.receipt, second.receipt);
        q.ack(&second);
        assert!(q.receive().await.is_none());
        assert_eq!(q.deliveries(), 2);
    }
}
