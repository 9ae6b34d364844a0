//! Coalesced completions, when the store is built with `coalesce_completions(true)` (group
//! commit without a timer): a `complete` goes out at once while
//! fewer than [`MAX_IN_FLIGHT`] completion scripts are in flight; otherwise it queues, and the
//! next script to leave carries everything queued. At one task nothing waits; at many, one
//! script carries several completions, so Redis runs fewer scripts (each call has a fixed cost
//! well above a `SET`'s) and the client sends fewer requests.
//!
//! The caller that sends a script (the leader) keeps sending until the queue is empty. If its
//! future is dropped mid-flight (cancelled), a task takes over the queue, so completions queued
//! behind it are never stranded; the completions of the script it was sending get a retryable
//! error (they may or may not have applied: fencing makes a retry of an applied one fail, never
//! apply twice).

use std::sync::{Mutex, MutexGuard, PoisonError};

use idem_core::{Completion, StoreError};
use tokio::sync::oneshot;

use super::RedisStore;

/// Most completions in one script.
const MAX_BATCH: usize = 256;

/// Completion scripts in flight at once. One would make every completion wait for the round
/// trip ahead of it; several keep the multiplexed connection's pipelining.
pub(crate) const MAX_IN_FLIGHT: usize = 4;

type Job = (Completion, oneshot::Sender<Result<(), StoreError>>);

#[derive(Default)]
pub(crate) struct Queue {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    pending: Vec<Job>,
    in_flight: usize,
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Sends `item` (with whatever queued meanwhile) or queues it behind the scripts in flight.
pub(crate) async fn complete(store: &RedisStore, item: Completion) -> Result<(), StoreError> {
    let (tx, rx) = oneshot::channel();
    let lead = {
        let mut st = store.completes.lock();
        st.pending.push((item, tx));
        if st.in_flight < MAX_IN_FLIGHT {
            st.in_flight += 1;
            true
        } else {
            false
        }
    };
    if lead {
        let mut guard = Leading { store: Some(store.clone()) };
        drain(store).await;
        guard.store = None;
    }
    rx.await.unwrap_or_else(|_| {
        Err(StoreError::backend(
            "complete",
            true,
            "the completion was abandoned in flight (its sender was cancelled): it may or may not \
             have applied",
        ))
    })
}

/// Sends what is queued, script after script, until the queue is empty; then leaves the slot.
async fn drain(store: &RedisStore) {
    loop {
        let jobs: Vec<Job> = {
            let mut st = store.completes.lock();
            if st.pending.is_empty() {
                st.in_flight -= 1;
                return;
            }
            let n = st.pending.len().min(MAX_BATCH);
            st.pending.drain(..n).collect()
        };
        let (items, senders): (Vec<Completion>, Vec<_>) = jobs.into_iter().unzip();
        match store.complete_now(&items).await {
            Ok(answers) => {
                for (tx, a) in senders.into_iter().zip(answers) {
                    let _ = tx.send(a);
                }
            }
            Err(e) => {
                for tx in senders {
                    let _ = tx.send(Err(e.copy_for("complete")));
                }
            }
        }
    }
}

/// Held by a leader while it drains: dropped before the end (the leader's future cancelled),
/// it hands the queue to a task.
struct Leading {
    store: Option<RedisStore>,
}

impl Drop for Leading {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else { return };
        // Still counted in flight: the task inherits the slot and drains.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { drain(&store).await });
        } else {
            store.completes.lock().in_flight -= 1;
        }
    }
}

/// Callers waiting for a `WAIT`, and whether one is in flight.
#[derive(Default)]
pub(crate) struct Waits {
    state: Mutex<WaitState>,
}

#[derive(Default)]
struct WaitState {
    waiting: Vec<oneshot::Sender<Result<(), StoreError>>>,
    in_flight: bool,
}

impl Waits {
    fn lock(&self) -> MutexGuard<'_, WaitState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Waits for a `WAIT` sent after the caller's write, which has been answered. `WAIT` blocks the
/// connection it runs on until the replicas answer, so one per write would serialise the
/// multiplexed connection; instead callers that arrive while one is in flight share the next.
/// The loop runs on a task of its own, so a cancelled caller strands no one.
pub(crate) async fn replicated(store: &RedisStore, op: &'static str) -> Result<(), StoreError> {
    let (tx, rx) = oneshot::channel();
    let start = {
        let mut st = store.waits.lock();
        st.waiting.push(tx);
        !std::mem::replace(&mut st.in_flight, true)
    };
    if start {
        let store = store.clone();
        tokio::spawn(async move {
            loop {
                let batch = {
                    let mut st = store.waits.lock();
                    if st.waiting.is_empty() {
                        st.in_flight = false;
                        return;
                    }
                    std::mem::take(&mut st.waiting)
                };
                // Every write in `batch` was answered before this WAIT is sent.
                let r = store
                    .wait_once(op)
                    .await
                    .map_err(|e| (e.is_retryable(), idem_core::ErrorChain(&e).to_string()));
                for tx in batch {
                    let _ = tx.send(
                        r.clone()
                            .map_err(|(retryable, msg)| StoreError::backend(op, retryable, msg)),
                    );
                }
            }
        });
    }
    rx.await.unwrap_or_else(|_| Err(StoreError::backend(op, true, "the WAIT task ended")))
}
