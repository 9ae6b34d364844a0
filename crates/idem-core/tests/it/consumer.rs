//! The consumer loop on the in-process queue: verbs per outcome, dead letters before removal,
//! a failed copy never acked, the delivery limit, hooks before verbs, shutdown, fetch failures.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::consumer::{
    BuildError, DeadLetter, Error, FetchFailures, MemoryDelivery, MemoryQueue, Opening, Source,
    SourceConfig, headers,
};
use idem_core::engine::{HandlerError, Verb};
use idem_core::extract::Envelope;
use idem_core::{Consumer, DedupStore, MemoryStore, OutcomeKind};

async fn consumer(q: &MemoryQueue) -> Consumer<MemoryQueue, MemoryStore> {
    Consumer::builder(q.clone())
        .store(MemoryStore::new())
        .scope("orders")
        .idle_wait(Duration::from_millis(20))
        .build()
        .await
        .unwrap()
}

/// A handler that fails transiently on ids starting `t-`, permanently on `p-`.
async fn handle(msg: MemoryDelivery) -> Result<String, HandlerError<String>> {
    let id = msg.message_id().unwrap_or_default().to_owned();
    if id.starts_with("t-") {
        return Err(HandlerError::Transient(format!("{id} is busy")));
    }
    if id.starts_with("p-") {
        return Err(HandlerError::Permanent(format!("{id} is invalid")));
    }
    Ok(id)
}

#[tokio::test]
async fn each_outcome_gets_its_verb_and_dead_letters_carry_the_headers() {
    let q = MemoryQueue::new();
    q.push("o-1", r#"{"cents":1}"#);
    q.push("o-1", r#"{"cents":1}"#); // producer retry: duplicate
    q.push("o-1", r#"{"cents":2}"#); // reused id, other content: conflict
    q.push("p-1", "{}");
    q.push_with(None, "{}", Vec::new()); // no key: rejected
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let c = Consumer::builder(q.clone())
        .store(MemoryStore::new())
        .scope("orders")
        .idle_wait(Duration::from_millis(20))
        .on_settle(move |s| log.lock().unwrap().push((s.outcome, s.verb.clone())))
        .build()
        .await
        .unwrap();
    let report = c.poll(|_, m| handle(m)).await.unwrap();
    assert_eq!(report.fetched, 5);
    assert_eq!((report.processed, report.duplicates, report.conflicts), (1, 1, 1));
    assert_eq!(report.failed_permanent, 2);
    assert_eq!((report.acked, report.dead_lettered, report.retried), (2, 3, 0));
    let kinds: Vec<OutcomeKind> = seen.lock().unwrap().iter().map(|(k, _)| *k).collect();
    assert_eq!(
        kinds,
        [
            OutcomeKind::Processed,
            OutcomeKind::Duplicate,
            OutcomeKind::Conflict,
            OutcomeKind::FailedPermanent,
            OutcomeKind::FailedPermanent
        ]
    );
    let dead = q.dead_letters();
    assert_eq!(dead.len(), 3);
    let h = dead[0].1.headers();
    assert_eq!(h[1], (headers::OUTCOME, "conflict".to_owned()));
    assert!(h[0].1.starts_with("conflict: key orders/o-1 reused"), "{}", h[0].1);
    assert_eq!(h[2], (headers::SCOPE, "orders".to_owned()));
    assert_eq!(q.pending(), 0, "everything was settled");
}

#[tokio::test]
async fn transient_failures_come_back_and_give_up_at_the_delivery_limit() {
    let q = MemoryQueue::new().with_max_deliveries(3);
    q.push("t-1", "{}");
    let c = consumer(&q).await;
    let report = c.run(|_, m| handle(m), q.drained()).await.unwrap();
    assert_eq!(report.failed_transient, 3, "three deliveries, each a transient failure");
    assert_eq!((report.retried, report.dead_lettered), (2, 1));
    let dead = q.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.outcome, OutcomeKind::FailedTransient);
    assert!(dead[0].1.reason.starts_with("gave up after 3 deliveries"), "{}", dead[0].1.reason);
}

#[tokio::test]
async fn a_failed_dead_letter_copy_is_retried_never_removed() {
    let q = MemoryQueue::new();
    q.push("p-1", "{}");
    q.fail_dead_letters(true);
    let c = consumer(&q).await;
    let report = c.poll(|_, m| handle(m)).await.unwrap();
    assert_eq!((report.dead_letter_failures, report.retried, report.dead_lettered), (1, 1, 0));
    assert_eq!(q.pending(), 1, "the message is back in the queue");
    q.fail_dead_letters(false);
    let report = c.run(|_, m| handle(m), q.drained()).await.unwrap();
    assert_eq!(report.dead_lettered, 1);
    assert_eq!(q.dead_letters().len(), 1);
}

#[tokio::test]
async fn a_key_in_progress_elsewhere_is_retried_after_the_lease() {
    let store = MemoryStore::new();
    let q = MemoryQueue::new();
    q.push("o-1", "{}");
    // Another consumer holds the key.
    let req = idem_core::ClaimRequest::new(
        idem_core::DedupKey::new("orders", "o-1").unwrap(),
        None,
        Duration::from_millis(50),
        Duration::from_secs(60),
    );
    let idem_core::Claim::Acquired(_held) = store.claim(&req).await.unwrap() else {
        panic!("fresh key")
    };
    let c = Consumer::builder(q.clone())
        .store(store)
        .scope("orders")
        .lease(Duration::from_millis(50))
        .idle_wait(Duration::from_millis(20))
        .build()
        .await
        .unwrap();
    let report = c.poll(|_, m| handle(m)).await.unwrap();
    assert_eq!((report.in_progress, report.retried), (1, 1));
    // The lease runs out (nobody completes it): the retry takes the key over.
    let report = c.run(|_, m| handle(m), q.drained()).await.unwrap();
    assert_eq!(report.processed, 1);
    assert_eq!(q.acked().len(), 1);
}

#[tokio::test]
async fn the_hook_runs_after_the_effect_and_before_the_verb() {
    let q = MemoryQueue::new();
    q.push("o-1", "{}");
    let effects = Arc::new(AtomicU32::new(0));
    let at_hook = Arc::new(Mutex::new(None));
    let (e2, h2, q2) = (Arc::clone(&effects), Arc::clone(&at_hook), q.clone());
    let c = Consumer::builder(q.clone())
        .store(MemoryStore::new())
        .scope("orders")
        .on_settle(move |_| {
            *h2.lock().unwrap() = Some((e2.load(Ordering::SeqCst), q2.acked().len()));
        })
        .build()
        .await
        .unwrap();
    let e = Arc::clone(&effects);
    c.poll(move |_, _| {
        let e = Arc::clone(&e);
        async move {
            e.fetch_add(1, Ordering::SeqCst);
            Ok::<_, HandlerError<String>>(())
        }
    })
    .await
    .unwrap();
    assert_eq!(*at_hook.lock().unwrap(), Some((1, 0)), "effect done, not yet acked");
    assert_eq!(q.acked().len(), 1);
}

#[tokio::test]
async fn the_builder_names_what_is_missing() {
    // Without .store / .inbox there is no `build` at all (a compile error); a scope set on an
    // engine and again on the consumer cannot happen either: there is one builder.
    let no_scope =
        Consumer::builder(MemoryQueue::new()).store(MemoryStore::new()).build().await.unwrap_err();
    assert!(matches!(no_scope, BuildError::Config(_)), "{no_scope}");
    assert!(no_scope.to_string().contains(".scope("), "{no_scope}");
    let long = Consumer::builder(MemoryQueue::new())
        .store(MemoryStore::new())
        .scope("s".repeat(513))
        .build()
        .await
        .unwrap_err()
        .to_string();
    assert!(long.contains("scope") && long.contains("512"), "{long}");
}

/// A source whose fetch fails `fails` times, then serves a memory queue.
#[derive(Clone)]
struct Flaky {
    queue: MemoryQueue,
    fails: Arc<AtomicU32>,
    fatal: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("the broker is down")]
struct Down;

impl Source for Flaky {
    type Delivery = MemoryDelivery;
    type Error = Down;

    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<MemoryDelivery>, Down> {
        if self.fails.load(Ordering::SeqCst) > 0 {
            self.fails.fetch_sub(1, Ordering::SeqCst);
            return Err(Down);
        }
        Ok(self.queue.fetch(max, wait).await.unwrap_or_else(|e: Infallible| match e {}))
    }

    fn is_fatal(&self, _: &Down) -> bool {
        self.fatal
    }

    async fn dead_letter(&self, items: &[(&MemoryDelivery, DeadLetter)]) -> Vec<Result<(), Down>> {
        items.iter().map(|_| Ok(())).collect()
    }

    async fn settle(&self, items: Vec<(MemoryDelivery, Verb)>) -> Result<u64, Down> {
        Ok(self.queue.settle(items).await.unwrap_or_else(|e: Infallible| match e {}))
    }
}

impl SourceConfig for Flaky {
    type Source = Flaky;
    async fn open(self, _: Opening<'_>) -> Result<Flaky, Down> {
        Ok(self)
    }
}

#[tokio::test(start_paused = true)]
async fn fetch_failures_follow_the_policy() {
    let q = MemoryQueue::new();
    q.push("o-1", "{}");
    let flaky =
        |fails, fatal| Flaky { queue: q.clone(), fails: Arc::new(AtomicU32::new(fails)), fatal };
    // Two failures are retried, then the message is handled.
    let c = Consumer::builder(flaky(2, false))
        .store(MemoryStore::new())
        .scope("orders")
        .fetch_failures(FetchFailures::new(3, Duration::from_millis(10)))
        .build()
        .await
        .unwrap();
    let report = c.run(|_, m| handle(m), q.drained()).await.unwrap();
    assert_eq!((report.fetch_failures, report.processed), (2, 1));
    // Three in a row end the run.
    let c = Consumer::builder(flaky(3, false))
        .store(MemoryStore::new())
        .scope("orders")
        .fetch_failures(FetchFailures::new(3, Duration::from_millis(10)))
        .build()
        .await
        .unwrap();
    let err = c.run(|_, m| handle(m), std::future::pending()).await.unwrap_err();
    assert!(matches!(err, Error::Fetch { attempts: 3, .. }), "{err}");
    // A fatal error ends it at once.
    let c = Consumer::builder(flaky(1, true))
        .store(MemoryStore::new())
        .scope("o")
        .build()
        .await
        .unwrap();
    let err = c.run(|_, m| handle(m), std::future::pending()).await.unwrap_err();
    assert!(matches!(err, Error::Fetch { attempts: 1, .. }), "{err}");
}

#[tokio::test]
async fn shutdown_finishes_the_batch_in_flight_and_releases_what_came_later() {
    let q = MemoryQueue::new();
    for i in 0..3 {
        q.push(format!("o-{i}"), "{}");
    }
    let c = Consumer::builder(q.clone())
        .store(MemoryStore::new())
        .scope("orders")
        .batch(1)
        .idle_wait(Duration::from_millis(20))
        .build()
        .await
        .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let stop = Mutex::new(Some(stop));
    let report = c
        .run(
            |_, m| {
                // Ask to stop during the first handler: its batch still completes and acks.
                if let Some(s) = stop.lock().unwrap().take() {
                    let _ = s.send(());
                }
                handle(m)
            },
            async {
                let _ = stopped.await;
            },
        )
        .await
        .unwrap();
    assert_eq!((report.processed, report.acked), (1, 1));
    assert_eq!(q.pending(), 2, "the rest stays queued");
}

#[tokio::test]
async fn a_run_can_be_spawned() {
    let q = MemoryQueue::new();
    q.push("o-1", "{}");
    let c = consumer(&q).await;
    let drained = q.drained();
    let report =
        tokio::spawn(async move { c.run(|_, m| handle(m), drained).await }).await.unwrap().unwrap();
    assert_eq!(report.processed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_batches_in_flight_handle_each_message_once() {
    let q = MemoryQueue::new();
    for i in 0..200 {
        q.push(format!("o-{}", i % 150), "{}"); // 50 duplicates
    }
    let c = Consumer::builder(q.clone())
        .store(MemoryStore::new())
        .scope("orders")
        .batch(7)
        .concurrency(3)
        .idle_wait(Duration::from_millis(20))
        .build()
        .await
        .unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&runs);
    let report = c
        .run(
            move |_, m| {
                r.fetch_add(1, Ordering::SeqCst);
                handle(m)
            },
            q.drained(),
        )
        .await
        .unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 150, "each key's handler ran once");
    assert_eq!((report.processed, report.acked), (150, 200), "{report}");
    assert!(report.batches >= 29, "batches of at most 7: {report:?}");
}
