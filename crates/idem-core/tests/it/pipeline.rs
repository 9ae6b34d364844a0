//! Pipelined lanes on the in-process queue: the next batch is fetched and claimed while the
//! current one runs, handlers still run one batch at a time and are acknowledged in order, and
//! a stop releases the batch waiting for its turn together with the claims taken for it.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::consumer::{MemoryDelivery, MemoryQueue};
use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_core::time::ManualClock;
use idem_core::{
    Claim, ClaimRequest, Consumer, DedupKey, DedupStore, InspectStore, MemoryStore, RecordState,
};
use tokio::sync::Notify;

const LONG_LEASE: Duration = Duration::from_secs(60);

async fn consumer(
    q: &MemoryQueue,
    store: &MemoryStore,
    batch: usize,
    pipeline: bool,
) -> Consumer<MemoryQueue, MemoryStore> {
    Consumer::builder(q.clone())
        .store(store.clone())
        .scope("orders")
        .lease(LONG_LEASE)
        .batch(batch)
        .pipeline(pipeline)
        .idle_wait(Duration::from_millis(20))
        .build()
        .await
        .unwrap()
}

async fn state(store: &MemoryStore, id: &str) -> Option<RecordState> {
    let key = DedupKey::new("orders", id).unwrap();
    store.get(&key).await.unwrap().map(|r| r.state)
}

/// Waits (up to 5 s) until `cond` holds.
async fn wait_until<F: Future<Output = bool>>(what: &str, mut cond: impl FnMut() -> F) {
    let waited = tokio::time::timeout(Duration::from_secs(5), async {
        while !cond().await {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out waiting until {what}");
}

fn id_of(m: &MemoryDelivery) -> String {
    m.message_id().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn a_stop_releases_the_prefetched_batch_and_its_claims() {
    let q = MemoryQueue::new();
    for i in 0..6 {
        q.push(format!("o-{i}"), "{}");
    }
    let store = MemoryStore::new();
    let c = consumer(&q, &store, 2, true).await;
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handler = {
        let (started, gate) = (started.clone(), gate.clone());
        move |_, m: MemoryDelivery| {
            let (started, gate) = (started.clone(), gate.clone());
            async move {
                if id_of(&m) == "o-0" {
                    started.notify_one();
                    gate.notified().await;
                }
                Ok::<_, HandlerError<String>>(id_of(&m))
            }
        }
    };
    let control = async {
        started.notified().await;
        // While batch 1 runs, batch 2 is fetched and its keys claimed ahead.
        wait_until("batch 2 is prefetched", || async { q.in_flight() == 4 }).await;
        wait_until("batch 2 is claimed ahead", || async {
            state(&store, "o-3").await == Some(RecordState::InProgress)
        })
        .await;
        assert_eq!(state(&store, "o-4").await, None, "batch 3 is not fetched yet");
        stop.send(()).unwrap();
        gate.notify_one();
    };
    let (report, ()) = tokio::join!(
        c.run(handler, async {
            let _ = stopped.await;
        }),
        control
    );
    let report = report.unwrap();
    assert_eq!((report.processed, report.acked, report.released), (2, 2, 2));
    assert_eq!(q.pending(), 4, "the released batch and the one never fetched stay queued");
    let acked: Vec<String> = q.acked().iter().map(id_of).collect();
    assert_eq!(acked, ["o-0", "o-1"]);
    for id in ["o-2", "o-3"] {
        assert_eq!(state(&store, id).await, Some(RecordState::Released), "{id}'s lease given back");
    }

    // A new consumer takes them at once: no claim waits for the 60 s lease.
    let calls = Arc::new(Mutex::new(HashMap::<String, u32>::new()));
    let c = consumer(&q, &store, 2, true).await;
    let count = calls.clone();
    let drained = q.drained();
    let report = tokio::time::timeout(
        Duration::from_secs(5),
        c.run(
            move |_, m: MemoryDelivery| {
                *count.lock().unwrap().entry(id_of(&m)).or_default() += 1;
                async move { Ok::<_, HandlerError<String>>(id_of(&m)) }
            },
            drained,
        ),
    )
    .await
    .expect("the released claims are free at once")
    .unwrap();
    assert_eq!(report.processed, 4);
    assert!(calls.lock().unwrap().values().all(|&n| n == 1), "{:?}", calls.lock().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lane_runs_one_batch_at_a_time_and_acks_in_order() {
    let q = MemoryQueue::new();
    for i in 0..60 {
        q.push(format!("o-{i:02}"), "{}");
    }
    let store = MemoryStore::new();
    let c = consumer(&q, &store, 3, true).await;
    let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let handler = {
        let (running, most) = (running.clone(), most.clone());
        move |_, m: MemoryDelivery| {
            let (running, most) = (running.clone(), most.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                for _ in 0..20 {
                    tokio::task::yield_now().await;
                }
                running.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, HandlerError<String>>(id_of(&m))
            }
        }
    };
    let report = c.run(handler, q.drained()).await.unwrap();
    assert_eq!((report.processed, report.acked), (60, 60));
    assert!(most.load(Ordering::SeqCst) <= 3, "at most one batch of 3 runs at once");
    let acked: Vec<String> = q.acked().iter().map(id_of).collect();
    let mut sorted = acked.clone();
    sorted.sort();
    assert_eq!(acked, sorted, "batches are acknowledged in the order they were fetched");
}

#[tokio::test]
async fn a_copy_right_behind_its_original_is_a_duplicate_not_in_progress() {
    let q = MemoryQueue::new();
    q.push("o-1", "{}");
    q.push("o-1", "{}"); // the producer retried
    q.push("o-2", "{}");
    let store = MemoryStore::new();
    let c = consumer(&q, &store, 1, true).await;
    let queue = q.clone();
    let handler = move |_, m: MemoryDelivery| {
        let queue = queue.clone();
        async move {
            if id_of(&m) == "o-1" {
                // Let the copy be fetched and claimed ahead (it then finds o-1 in progress).
                wait_until("the copy is prefetched", || async { queue.in_flight() >= 2 }).await;
                for _ in 0..20 {
                    tokio::task::yield_now().await;
                }
            }
            Ok::<_, HandlerError<String>>(id_of(&m))
        }
    };
    // With a 60 s lease, an "in progress" answer for the copy would hold it for a minute.
    let report = tokio::time::timeout(Duration::from_secs(5), c.run(handler, q.drained()))
        .await
        .expect("the copy is decided when its turn comes")
        .unwrap();
    assert_eq!((report.processed, report.duplicates, report.acked), (2, 1, 3));
}

#[tokio::test]
async fn unpipelined_lanes_fetch_only_after_settling() {
    let q = MemoryQueue::new();
    for i in 0..4 {
        q.push(format!("o-{i}"), "{}");
    }
    let store = MemoryStore::new();
    let c = consumer(&q, &store, 2, false).await;
    let queue = q.clone();
    let most = Arc::new(AtomicUsize::new(0));
    let seen = most.clone();
    let handler = move |_, m: MemoryDelivery| {
        let (queue, seen) = (queue.clone(), seen.clone());
        async move {
            for _ in 0..20 {
                seen.fetch_max(queue.in_flight(), Ordering::SeqCst);
                tokio::task::yield_now().await;
            }
            Ok::<_, HandlerError<String>>(id_of(&m))
        }
    };
    let report = c.run(handler, q.drained()).await.unwrap();
    assert_eq!(report.processed, 4);
    assert_eq!(most.load(Ordering::SeqCst), 2, "one batch of 2 in flight at a time");
}

/// Claims taken ahead never take over a lease that ran out: a key a crashed consumer held is
/// taken over alone, when its batch runs (so a crash then holds no other key), and a stop
/// gives back only what was claimed ahead, leaving that key as the crash left it (released,
/// the next claim would find it free and never learn that the effect may have been made).
#[tokio::test]
async fn a_lease_that_ran_out_is_not_taken_over_ahead() {
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(clock.clone());
    // o-1's earlier holder crashed mid-effect: its lease runs out unreleased.
    let key = DedupKey::new("orders", "o-1").unwrap();
    let req = ClaimRequest::new(key, None, LONG_LEASE, Duration::from_secs(3600));
    let Ok(Claim::Acquired(lease)) = store.claim(&req).await else { panic!("first claim") };
    drop(lease);
    clock.advance(LONG_LEASE + Duration::from_secs(1));

    let q = MemoryQueue::new();
    for id in ["o-0", "o-x", "o-1", "o-2"] {
        q.push(id, "{}");
    }
    let c = consumer(&q, &store, 2, true).await;
    let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let handler = {
        let (started, gate) = (started.clone(), gate.clone());
        move |_, m: MemoryDelivery| {
            let (started, gate) = (started.clone(), gate.clone());
            async move {
                if id_of(&m) == "o-0" {
                    started.notify_one();
                    gate.notified().await;
                }
                Ok::<_, HandlerError<String>>(id_of(&m))
            }
        }
    };
    let control = async {
        started.notified().await;
        // The next batch, [o-1, o-2], is claimed ahead: o-2 is acquired, o-1 left alone.
        wait_until("o-2 is claimed ahead", || async {
            state(&store, "o-2").await == Some(RecordState::InProgress)
        })
        .await;
        let o1 = store.get(&DedupKey::new("orders", "o-1").unwrap()).await.unwrap().unwrap();
        assert_eq!((o1.attempt, o1.state), (1, RecordState::InProgress), "o-1 taken over ahead");
        stop.send(()).unwrap();
        gate.notify_one();
    };
    let (report, ()) = tokio::join!(
        c.run(handler, async {
            let _ = stopped.await;
        }),
        control
    );
    assert_eq!(report.unwrap().released, 2);
    // The claim taken ahead is given back; o-1 stays as the crash left it.
    assert_eq!(state(&store, "o-2").await, Some(RecordState::Released));
    let o1 = store.get(&DedupKey::new("orders", "o-1").unwrap()).await.unwrap().unwrap();
    assert_eq!((o1.attempt, o1.state), (1, RecordState::InProgress));
}
