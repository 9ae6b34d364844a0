//! The relay's own tests, over `MemoryOutbox`.

use super::*;
use crate::outbox::{MemoryOutbox, OutboxStore, Outgoing, RecordingPublisher};

#[test]
fn backoff_doubles_up_to_the_cap() {
    let (a, m) = (Duration::from_millis(100), Duration::from_secs(1));
    assert_eq!(backoff(a, m, 1), a);
    assert_eq!(backoff(a, m, 3), Duration::from_millis(400));
    assert_eq!(backoff(a, m, 30), m);
}

#[test]
fn settings_are_checked() {
    let b = || Relay::builder(MemoryOutbox::new(), RecordingPublisher::new());
    let e = b().publish_timeout(Duration::from_secs(30)).build().unwrap_err();
    assert!(e.to_string().contains("publish_timeout"), "{e}");
    assert!(b().batch(0).build().is_err());
    assert!(b().concurrency(0).build().is_err());
}

#[tokio::test]
async fn failures_back_off_then_park() {
    let outbox = MemoryOutbox::new();
    outbox.send(vec![Outgoing::new("q", "x")]).await.unwrap();
    let broker = RecordingPublisher::new();
    broker.fail_next(3, true);
    let relay = Relay::builder(outbox.clone(), broker.clone())
        .max_attempts(3)
        .backoff(Duration::ZERO, Duration::ZERO)
        .build()
        .unwrap();
    let r = relay.run_until_empty().await.unwrap();
    assert_eq!((r.retried, r.parked, r.published), (2, 1, 0), "{r}");
    let c = outbox.counts().await.unwrap();
    assert_eq!((c.pending, c.parked), (0, 1));
    assert_eq!(outbox.retry_parked(10).await.unwrap(), 1);
    let r = relay.run_until_empty().await.unwrap();
    assert_eq!(r.published, 1);
    assert_eq!(broker.published().len(), 1);
}

#[tokio::test]
async fn zero_retention_deletes_confirmed_rows() {
    let outbox = MemoryOutbox::new();
    outbox.send((0..3).map(|i| Outgoing::new("q", format!("{i}"))).collect()).await.unwrap();
    let relay = Relay::builder(outbox.clone(), RecordingPublisher::new())
        .retain_sent(Duration::ZERO)
        .concurrency(2)
        .build()
        .unwrap();
    assert_eq!(relay.run_until_empty().await.unwrap().published, 3);
    let c = outbox.counts().await.unwrap();
    assert_eq!((c.pending, c.sent, c.parked), (0, 0, 0), "confirmed rows are gone");
}

#[tokio::test]
async fn a_permanent_failure_parks_at_once() {
    let outbox = MemoryOutbox::new();
    outbox.send(vec![Outgoing::new("q", "x")]).await.unwrap();
    let broker = RecordingPublisher::new();
    broker.fail_next(1, false);
    let relay = Relay::builder(outbox.clone(), broker).build().unwrap();
    let r = relay.run_until_empty().await.unwrap();
    assert_eq!(r.parked, 1);
}

#[tokio::test]
async fn ordered_messages_go_one_after_the_other() {
    let outbox = MemoryOutbox::new();
    let msgs = (0..5).map(|i| Outgoing::new("q", format!("{i}")).ordering_key("k")).collect();
    outbox.send(msgs).await.unwrap();
    outbox.send(vec![Outgoing::new("q", "free")]).await.unwrap();
    let broker = RecordingPublisher::new();
    let relay = Relay::builder(outbox, broker.clone()).build().unwrap();
    let r = relay.run_until_empty().await.unwrap();
    assert_eq!((r.published, r.batches), (6, 5));
    let order: Vec<_> = broker
        .published()
        .iter()
        .filter(|m| m.ordering_key().is_some())
        .map(|m| m.payload().to_vec())
        .collect();
    assert_eq!(order, (0..5).map(|i| format!("{i}").into_bytes()).collect::<Vec<_>>());
}

#[tokio::test]
async fn run_stops_at_shutdown_and_wakes_for_work() {
    let outbox = MemoryOutbox::new();
    let broker = RecordingPublisher::new();
    let relay = Relay::builder(outbox.clone(), broker.clone())
        .poll_interval(Duration::from_millis(10))
        .concurrency(2)
        .build()
        .unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = relay.run(async move {
        let _ = rx.await;
    });
    let feed = async {
        outbox.send(vec![Outgoing::new("q", "late")]).await.unwrap();
        let published = async {
            while broker.published().is_empty() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), published)
            .await
            .expect("the late message was not published within 10 s");
        let _ = tx.send(());
    };
    let (report, ()) = tokio::join!(run, feed);
    assert_eq!(report.unwrap().published, 1);
}

/// A position feed over a list: reads from its position, moves past the confirmed prefix,
/// and lets one reader hold it at a time.
#[derive(Debug, Default)]
struct Log {
    messages: std::sync::Mutex<Vec<OutboxMessage>>,
    position: std::sync::Mutex<usize>,
    held: AtomicBool,
}

impl Log {
    fn of(n: usize) -> Self {
        let messages = (0..n)
            .map(|i| {
                Outgoing::new("q", format!("{i}")).into_message(crate::outbox::OutboxId::random)
            })
            .collect();
        Self { messages: std::sync::Mutex::new(messages), ..Self::default() }
    }

    fn position(&self) -> usize {
        *self.position.lock().unwrap()
    }
}

impl Feed for Log {
    const KIND: FeedKind = FeedKind::Position;
    const BATCH: usize = 2;
    const POLL: Duration = Duration::from_millis(1);
    const BACKOFF: (Duration, Duration) = (Duration::ZERO, Duration::ZERO);
    type Hold = ();
    type Batch = usize;

    async fn take(&self) -> Result<Option<()>, StoreError> {
        Ok((!self.held.swap(true, Ordering::SeqCst)).then_some(()))
    }

    async fn read(&self, (): &mut (), max: usize, _: Duration) -> Result<Read<usize>, StoreError> {
        let from = self.position();
        let all = self.messages.lock().unwrap();
        let read: Vec<_> = all.iter().skip(from).take(max).cloned().collect();
        let more = !read.is_empty();
        Ok(Read::new(read, from, more))
    }

    async fn acknowledge(
        &self,
        (): &mut (),
        from: usize,
        settled: &[Settled],
        _: bool,
    ) -> Result<u64, StoreError> {
        let ok = settled.iter().take_while(|s| s.is_sent()).count();
        *self.position.lock().unwrap() = from + ok;
        Ok(ok as u64)
    }

    async fn release(&self, (): ()) {
        self.held.store(false, Ordering::SeqCst);
    }

    fn describe(&self) -> String {
        "the test log".to_owned()
    }
}

#[tokio::test]
async fn a_position_stays_before_a_failure_and_goes_on_after_it() {
    let log = Log::of(5);
    let broker = RecordingPublisher::new();
    broker.fail_next(1, true);
    let relay = Relay::builder(log, broker.clone()).build().unwrap();
    let r = relay.run_until_empty().await.unwrap();
    // The first read's first message failed: the position stayed before it (its confirmed
    // neighbour is published again), then everything went out in order.
    assert_eq!((r.published, r.retried, r.parked), (5, 2, 0), "{r}");
    assert_eq!(relay.store().position(), 5);
    let order: Vec<_> = broker.published().iter().map(|m| m.payload().to_vec()).collect();
    assert_eq!(order[0], b"1", "the failed message's neighbour was confirmed first");
    assert_eq!(order[1..], (0..5).map(|i| format!("{i}").into_bytes()).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_position_feed_is_stuck_after_max_attempts_and_held_by_one_relay() {
    let broker = RecordingPublisher::new();
    broker.fail_next(6, true); // three reads of two messages
    let relay = Relay::builder(Log::of(3), broker.clone()).max_attempts(3).build().unwrap();
    let stuck = relay.run_until_empty().await;
    assert!(
        matches!(&stuck, Err(RelayError::Stuck { attempts: 3, id, .. }) if !id.is_empty()),
        "{stuck:?}"
    );
    assert_eq!(relay.store().position(), 0, "the position moved past a failed message");
    // Released at the end: the next run takes the feed and goes on from the same place.
    assert_eq!(relay.run_until_empty().await.unwrap().published, 3);
    relay.store().held.store(true, Ordering::SeqCst);
    let busy = relay.run_until_empty().await;
    assert!(matches!(&busy, Err(RelayError::Busy { feed }) if feed == "the test log"), "{busy:?}");
    let two = Relay::builder(Log::of(1), broker).concurrency(2).build().unwrap_err();
    assert!(two.to_string().contains("concurrency"), "{two}");
}
