//! Claims that ride on a completion. On a store whose [`DedupStore::complete_and_claim`] sends
//! completions and claims in one write ([`DedupStore::combines_writes`]), a consumer's claims
//! taken ahead do not go out alone while a decision in flight is about to record a completion:
//! they wait for it and travel in the same write. A pipelined consumer at one message in flight
//! then pays one write per message (complete k, claim k + 1) instead of two, and its critical
//! path is unchanged: message k + 1 could not start before message k's completion returned
//! anyway.
//!
//! Each fetched batch gets a [`Ticket`], and is *coming* until its claims ahead are posted (or
//! sent alone). When its turn comes, the lane seats it as a *driver* (before the next batch is
//! fetched), and it drives until it sends its first completion or ends. Before it takes the
//! riders, a driver waits for the batches coming to post their claims — work of the same lane
//! task, already fetched, that never waits for the network — so a handler that never yields
//! still carries the next batch's claims. A batch's claims ride only while some *other* batch
//! drives (never on their own batch's seat: that batch cannot complete before they are
//! answered); when the last such driver leaves without carrying them, they go out alone at
//! once. So a claim never waits for a decision that will not complete.
//!
//! [`DedupStore::complete_and_claim`]: crate::DedupStore::complete_and_claim
//! [`DedupStore::combines_writes`]: crate::DedupStore::combines_writes

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use crate::{Claim, ClaimRequest, StoreError};

/// The longest a driver waits for the batches coming to post their claims.
const COMING_WAIT: std::time::Duration = std::time::Duration::from_millis(10);

/// The answers a rider gets: one per request, in order.
type Answers = Vec<Result<Claim, StoreError>>;

/// A fetched batch's identity: its claims never ride on its own seat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TicketId(u64);

/// A fetched batch's ticket: its identity, and (on an engine whose claims ride) its place among
/// the batches coming, given up when its claims are posted or sent alone, or when dropped.
#[derive(Debug)]
pub struct Ticket {
    id: TicketId,
    coming: Option<Arc<Rides>>,
}

impl Ticket {
    /// A ticket no other batch of this process has, not counted as coming.
    pub(crate) fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        Self { id: TicketId(NEXT.fetch_add(1, Ordering::Relaxed)), coming: None }
    }

    pub(crate) fn id(&self) -> TicketId {
        self.id
    }
}

impl Drop for Ticket {
    /// No longer coming (its claims posted or sent alone, or the batch gone): drivers waiting
    /// may go.
    fn drop(&mut self) {
        if let Some(rides) = self.coming.take() {
            rides.lock().coming -= 1;
            rides.arrived.notify_waiters();
        }
    }
}

/// An engine's riders and drivers (shared by its clones).
#[derive(Debug, Default)]
pub(crate) struct Rides {
    state: Mutex<State>,
    /// Told when a batch coming posts its claims (or sends them alone).
    arrived: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct State {
    /// The tickets of the batches driving.
    drivers: Vec<TicketId>,
    riders: Vec<Rider>,
    /// Batches fetched whose claims ahead are not posted yet.
    coming: usize,
}

impl State {
    /// Whether a batch other than `own` drives.
    fn carried_for(&self, own: TicketId) -> bool {
        self.drivers.iter().any(|&d| d != own)
    }
}

/// Claims waiting for a completion to carry them.
#[derive(Debug)]
struct Rider {
    own: TicketId,
    reqs: Vec<ClaimRequest>,
    answer: oneshot::Sender<Answers>,
}

impl Rides {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A ticket for a batch just fetched, coming until its claims are posted.
    pub(crate) fn ticket(self: &Arc<Self>) -> Ticket {
        self.lock().coming += 1;
        Ticket { coming: Some(Arc::clone(self)), ..Ticket::new() }
    }

    /// The batch of `ticket` is due: it may carry claims until [`Driver::take`] or its end.
    pub(crate) fn drive(self: &Arc<Self>, ticket: TicketId) -> Driver {
        self.lock().drivers.push(ticket);
        Driver { rides: Arc::clone(self), ticket, left: AtomicBool::new(false) }
    }

    /// Claims `reqs` (of the batch of `ticket`) with the next completion of another batch in
    /// flight: `Some` answers, or `None` when no other batch drives (or the one carrying them
    /// failed): claim them now, alone.
    pub(crate) async fn ride(&self, reqs: &[ClaimRequest], ticket: Ticket) -> Option<Answers> {
        let own = ticket.id;
        let rx = {
            let mut st = self.lock();
            st.carried_for(own).then(|| {
                let (answer, rx) = oneshot::channel();
                st.riders.push(Rider { own, reqs: reqs.to_vec(), answer });
                rx
            })
        };
        // Posted (or going alone): a driver that wakes now finds the rider in place.
        drop(ticket);
        rx?.await.ok().filter(|a| a.len() == reqs.len())
    }
}

/// A batch due to complete, which may carry the claims waiting to ride.
#[derive(Debug)]
pub struct Driver {
    rides: Arc<Rides>,
    ticket: TicketId,
    left: AtomicBool,
}

impl Driver {
    /// The claims to send with this decision's completion (its first; later ones carry
    /// nothing): once no batch is coming, every rider of another batch waiting. The driver
    /// leaves.
    pub(crate) async fn take(&self) -> Riders {
        if self.left.load(Ordering::SeqCst) {
            return Riders(Vec::new());
        }
        // The batches coming post their claims when their lane polls them next, within this
        // task's next turn; the bound only guards against a lane that is never polled again
        // (a `run` future kept but abandoned): then this completion goes without them.
        let all_arrived = async {
            loop {
                let arrived = self.rides.arrived.notified();
                let mut arrived = std::pin::pin!(arrived);
                arrived.as_mut().enable();
                if self.rides.lock().coming == 0 {
                    break;
                }
                arrived.await;
            }
        };
        let _ = tokio::time::timeout(COMING_WAIT, all_arrived).await;
        if self.left.swap(true, Ordering::SeqCst) {
            return Riders(Vec::new());
        }
        Riders(self.leave(true))
    }

    /// Leaves, taking the riders of other batches when `carrying`. The riders no other batch
    /// can carry now are dropped: their senders gone, they claim alone.
    fn leave(&self, carrying: bool) -> Vec<Rider> {
        let mut alone = Vec::new();
        let mut carried = Vec::new();
        {
            let mut st = self.rides.lock();
            if let Some(i) = st.drivers.iter().position(|&d| d == self.ticket) {
                st.drivers.swap_remove(i);
            }
            for r in std::mem::take(&mut st.riders) {
                if carrying && r.own != self.ticket {
                    carried.push(r);
                } else if st.carried_for(r.own) {
                    st.riders.push(r);
                } else {
                    alone.push(r);
                }
            }
        }
        drop(alone);
        carried
    }
}

impl Drop for Driver {
    /// A decision that ends without carrying leaves; the riders no other batch can carry are
    /// sent off alone.
    fn drop(&mut self) {
        if !self.left.swap(true, Ordering::SeqCst) {
            self.leave(false);
        }
    }
}

/// Riders taken by a driver: their requests go out with its completion; [`Riders::answer`]
/// hands each its answers. Dropped unanswered, they claim alone.
#[derive(Debug, Default)]
pub(crate) struct Riders(Vec<Rider>);

impl Riders {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Every rider's requests, in order.
    pub(crate) fn requests(&self) -> Vec<ClaimRequest> {
        self.0.iter().flat_map(|r| r.reqs.iter().cloned()).collect()
    }

    /// Hands out `answers` (one per request of [`requests`](Self::requests), in order).
    pub(crate) fn answer(self, answers: Vec<Claim>) {
        let mut answers = answers.into_iter();
        for r in self.0 {
            let mine: Answers = answers.by_ref().take(r.reqs.len()).map(Ok).collect();
            // A rider whose turn was dropped meanwhile took nothing: its leases run out.
            let _ = r.answer.send(mine);
        }
    }
}
