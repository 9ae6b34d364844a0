//! Each outcome ends in the right broker verb, on the real RabbitMQ.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::{Broker, Seen, reporter, wait_for};
use idem_amqp::lapin::BasicProperties;
use idem_amqp::lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
use idem_amqp::lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};
use idem_amqp::{AmqpConfig, AmqpConsumer, Error, RabbitWindow};
use idem_core::MemoryStore;
use idem_core::consumer::{self, headers};
use idem_core::engine::HandlerError;
use idem_core::engine::Verb;
use idem_core::extract::Header;
use tokio::sync::{Notify, oneshot};

const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processed_duplicate_conflict_and_missing_key() {
    let Some(b) = Broker::new("verbs").await else { return };
    let (hook, mut rx) = reporter();
    let store = MemoryStore::new();
    let c = AmqpConsumer::builder(AmqpConfig::new(&b.conn, b.queue()))
        .store(store)
        .scope("verbs")
        .on_settle(hook)
        .build()
        .await
        .unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let (stop, stopped) = oneshot::channel::<()>();
    let r = Arc::clone(&runs);
    let task = tokio::spawn(async move {
        c.run(
            move |_ctx, _m| {
                let r = Arc::clone(&r);
                async move {
                    r.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, HandlerError<String>>("done".to_owned())
                }
            },
            async move {
                let _ = stopped.await;
            },
        )
        .await
    });
    b.publish(Some("a"), br#"{"n":1}"#, &[]).await;
    b.publish(Some("a"), br#"{ "n" : 1 }"#, &[]).await; // same canonical JSON: a duplicate
    b.publish(Some("a"), br#"{"n":2}"#, &[]).await; // reused id, other body: a conflict
    b.publish(None, b"no id", &[]).await;
    let mut seen = Vec::new();
    wait_for(&mut rx, &mut seen, LIMIT, |s| s.len() == 4).await;
    let outcomes: Vec<_> = seen.iter().map(|s| s.outcome).collect();
    assert_eq!(outcomes, ["processed", "duplicate", "conflict", "failed_permanent"]);
    assert_eq!(seen[0].verb, Verb::Ack);
    assert_eq!(seen[1].verb, Verb::Ack);
    assert!(matches!(seen[2].verb, Verb::DeadLetter { .. }));
    stop.send(()).unwrap();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!((stats.fetched, stats.acked, stats.dead_lettered), (4, 2, 2), "{stats}");
    assert_eq!(b.count(b.queue()).await, 0, "nothing left unacked");
    let dlq = b.drain_dlq_headers().await;
    assert_eq!(dlq.len(), 2, "{dlq:?}");
    assert_eq!(dlq[0].0.as_deref(), Some("a"), "the copy keeps the AMQP message id");
    assert_eq!(dlq[0].2, br#"{"n":2}"#);
    let header = |i: usize, name: &str| dlq[i].1.get(name).map(String::as_str);
    assert!(header(0, headers::REASON).unwrap().starts_with("conflict: key verbs/a reused"));
    assert!(header(1, headers::REASON).unwrap().contains("message id is missing"), "{dlq:?}");
    assert_eq!(
        [header(0, headers::OUTCOME), header(1, headers::OUTCOME)],
        [Some("conflict"), Some("failed_permanent")]
    );
    for i in 0..2 {
        assert_eq!(header(i, headers::SCOPE), Some("verbs"), "{dlq:?}");
        assert_eq!(header(i, headers::SOURCE), Some(b.queue()), "{dlq:?}");
    }
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_failure_releases_and_requeues_then_permanent_dead_letters() {
    let Some(b) = Broker::new("fail").await else { return };
    let (hook, mut rx) = reporter();
    let store = MemoryStore::new();
    let c = AmqpConsumer::builder(AmqpConfig::new(&b.conn, b.queue()))
        .store(store)
        .scope("fail")
        .on_settle(hook)
        .build()
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        c.run(
            |ctx, m| async move {
                match (m.payload(), ctx.attempt()) {
                    (b"flaky", 1) => Err(HandlerError::Transient("503 from upstream".to_owned())),
                    (b"flaky", _) => Ok(ctx.attempt()),
                    _ => Err(HandlerError::Permanent("invalid order".to_owned())),
                }
            },
            async move {
                let _ = stopped.await;
            },
        )
        .await
    });
    b.publish(Some("t"), b"flaky", &[]).await;
    b.publish(Some("p"), b"bad", &[]).await;
    let mut seen = Vec::new();
    wait_for(&mut rx, &mut seen, LIMIT, |s| s.len() == 3).await;
    let t: Vec<_> = seen.iter().filter(|s| s.key.as_deref() == Some("t")).collect();
    assert_eq!(t[0].outcome, "failed_transient");
    assert_eq!(t[0].verb, Verb::Retry { after: None }, "a plain requeue");
    assert_eq!(t[1].outcome, "processed");
    assert!(t[1].redelivered, "the requeued copy is flagged redelivered");
    let p = seen.iter().find(|s| s.key.as_deref() == Some("p")).unwrap();
    assert_eq!(p.outcome, "failed_permanent");
    stop.send(()).unwrap();
    let stats = task.await.unwrap().unwrap();
    assert_eq!((stats.retried, stats.processed, stats.dead_lettered), (1, 1, 1), "{stats}");
    assert_eq!(b.count(b.queue()).await, 0);
    let dlq = b.drain_dlq().await;
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].1.as_deref(), Some("handler failed: invalid order"));
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_elsewhere_goes_round_the_delay_queue_and_ends_duplicate() {
    let Some(b) = Broker::new("delay").await else { return };
    let store = MemoryStore::new();
    let (hook_a, mut rx_a) = reporter();
    let (hook_b, mut rx_b) = reporter();
    let conn_b = b.connect().await;
    let build = |conn, hook| {
        AmqpConsumer::builder(
            AmqpConfig::new(conn, b.queue())
                .prefetch(1)
                .retry_delay(Duration::from_millis(200), Duration::from_millis(500)),
        )
        .store(store.clone())
        .scope("delay")
        .batch(1)
        .on_settle(hook)
        .build()
    };
    let a = build(&b.conn, hook_a).await.unwrap();
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let (stop_a, stopped_a) = oneshot::channel::<()>();
    let (s, r) = (Arc::clone(&started), Arc::clone(&release));
    let task_a = tokio::spawn(async move {
        a.run(
            move |_ctx, _m| {
                let (s, r) = (Arc::clone(&s), Arc::clone(&r));
                async move {
                    s.notify_one();
                    r.notified().await;
                    Ok::<_, HandlerError<String>>(())
                }
            },
            async move {
                let _ = stopped_a.await;
            },
        )
        .await
    });
    b.publish(Some("x"), b"slow", &[]).await;
    tokio::time::timeout(LIMIT, started.notified()).await.expect("A starts the handler");
    // A holds the lease; B gets the producer's duplicate copy.
    let b_consumer = Arc::new(build(&conn_b, hook_b).await.unwrap());
    let (stop_b, stopped_b) = oneshot::channel::<()>();
    let task_b = tokio::spawn({
        let b_consumer = Arc::clone(&b_consumer);
        async move {
            b_consumer
                .run(|_ctx, _m| async { Ok::<_, HandlerError<String>>(()) }, async move {
                    let _ = stopped_b.await;
                })
                .await
        }
    });
    // The producer's copy also goes to an audit queue (RabbitMQ's `CC` header, which the
    // broker keeps on the delivered message): the delay copy must not send it there again.
    let audit = format!("{}-audit", b.queue());
    // Exclusive: gone with the test's connection, even when the test fails.
    let only_ours = QueueDeclareOptions { exclusive: true, ..QueueDeclareOptions::default() };
    b.ch.queue_declare(audit.as_str().into(), only_ours, FieldTable::default()).await.unwrap();
    publish_cc(&b, "x", b"slow", &audit).await;
    let mut seen_b = Vec::new();
    wait_for(&mut rx_b, &mut seen_b, LIMIT, |s| !s.is_empty()).await;
    assert_eq!(seen_b[0].outcome, "in_progress_elsewhere");
    let Verb::Retry { after: Some(after) } = seen_b[0].verb else {
        panic!("a delayed retry: {:?}", seen_b[0].verb)
    };
    assert_eq!(
        b_consumer.source().delay_for(Some(after)),
        Some(Duration::from_millis(500)),
        "the 30 s lease ({after:?} left) is clamped to the max delay"
    );
    release.notify_one();
    // The copy returns from the delay queue; whoever gets it sees the completed record.
    let mut seen_a = Vec::new();
    let done = |s: &[Seen]| s.iter().any(|x| x.outcome == "duplicate");
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        tokio::select! {
            Some(x) = rx_a.recv() => seen_a.push(x),
            Some(x) = rx_b.recv() => seen_b.push(x),
            () = tokio::time::sleep_until(deadline) => panic!("no duplicate: {seen_a:?} {seen_b:?}"),
        }
        if done(&seen_a) || done(&seen_b) {
            break;
        }
    }
    let dup = seen_a.iter().chain(&seen_b).find(|x| x.outcome == "duplicate").unwrap();
    assert!(dup.delays >= 1, "the duplicate came back through the delay queue: {dup:?}");
    assert_eq!(seen_a[0].outcome, "processed");
    stop_a.send(()).unwrap();
    stop_b.send(()).unwrap();
    task_a.await.unwrap().unwrap();
    task_b.await.unwrap().unwrap();
    assert_eq!(b.count(b.queue()).await, 0);
    assert_eq!(b.count(b.topology.delay_queue()).await, 0);
    assert_eq!(b.count(&audit).await, 1, "the delay copy was sent to the CC'd queue again");
    b.ch.queue_delete(audit.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    let _ = conn_b.close(200, "".into()).await;
    b.cleanup().await;
}

/// Publishes `body` to the work queue with `CC: [cc]`, confirmed.
async fn publish_cc(b: &Broker, id: &str, body: &[u8], cc: &str) {
    let mut h = FieldTable::default();
    let to = FieldArray::from(vec![AMQPValue::LongString(LongString::from(cc))]);
    h.insert("CC".into(), AMQPValue::FieldArray(to));
    let props = BasicProperties::default().with_message_id(id.into()).with_headers(h);
    let confirm = b
        .ch
        .basic_publish("".into(), b.queue().into(), BasicPublishOptions::default(), body, props)
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_the_handler_in_flight_and_requeues_the_rest() {
    let Some(b) = Broker::new("drain").await else { return };
    let store = MemoryStore::new();
    let c = AmqpConsumer::builder(AmqpConfig::new(&b.conn, b.queue()).prefetch(3))
        .store(store)
        .scope("drain")
        .batch(1)
        .build()
        .await
        .unwrap();
    for id in ["1", "2", "3"] {
        b.publish(Some(id), id.as_bytes(), &[]).await;
    }
    let started = Arc::new(Notify::new());
    let release = Arc::new(Notify::new());
    let (stop, stopped) = oneshot::channel::<()>();
    let (s, r) = (Arc::clone(&started), Arc::clone(&release));
    let task = tokio::spawn(async move {
        c.run(
            move |_ctx, _m| {
                let (s, r) = (Arc::clone(&s), Arc::clone(&r));
                async move {
                    s.notify_one();
                    r.notified().await;
                    Ok::<_, HandlerError<String>>(())
                }
            },
            async move {
                let _ = stopped.await;
            },
        )
        .await
    });
    tokio::time::timeout(LIMIT, started.notified()).await.expect("handler starts");
    stop.send(()).unwrap();
    assert!(!task.is_finished(), "shutdown waits for the handler in flight");
    release.notify_one();
    let stats = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap().unwrap();
    assert_eq!((stats.processed, stats.acked), (1, 1), "{stats:?}");
    // The lane had fetched message 2 ahead; released, RabbitMQ may push it to this consumer
    // again before the cancel, and closing releases it a second time.
    assert!((2..=3).contains(&stats.released), "{stats:?}");
    // The two prefetched deliveries went back to the queue, unprocessed.
    b.wait_count(b.queue(), 2, LIMIT).await;
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_extractor_replaces_the_message_id() {
    let Some(b) = Broker::new("header").await else { return };
    let (hook, mut rx) = reporter();
    let c = AmqpConsumer::builder(AmqpConfig::new(&b.conn, b.queue()))
        .store(MemoryStore::new())
        .scope("header")
        .key(Header::new("idempotency-key"))
        .on_settle(hook)
        .build()
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        c.run(|_ctx, _m| async { Ok::<_, HandlerError<String>>(()) }, async move {
            let _ = stopped.await;
        })
        .await
    });
    b.publish(Some("m-1"), b"pay", &[("Idempotency-Key", "k-1")]).await;
    b.publish(Some("m-2"), b"pay", &[("Idempotency-Key", "k-1")]).await;
    let mut seen = Vec::new();
    wait_for(&mut rx, &mut seen, LIMIT, |s| s.len() == 2).await;
    assert_eq!(seen[0].key.as_deref(), Some("k-1"));
    assert_eq!([seen[0].outcome, seen[1].outcome], ["processed", "duplicate"]);
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    b.cleanup().await;
}

#[tokio::test]
async fn retention_shorter_than_the_redelivery_window_is_refused_at_startup() {
    let Some(b) = Broker::new("window").await else { return };
    let window = RabbitWindow::new().delivery_limit(20);
    let err = AmqpConsumer::builder(AmqpConfig::new(&b.conn, b.queue()).redelivery_window(window))
        .store(MemoryStore::new())
        .scope("window")
        .retain(Duration::from_secs(3600))
        .build()
        .await
        .unwrap_err();
    let consumer::BuildError::Open(inner @ Error::Retention(_)) = &err else { panic!("{err:?}") };
    assert!(inner.to_string().contains("20 deliveries × 30m"), "{inner}");
    let c = AmqpConsumer::builder(AmqpConfig::new(&b.conn, b.queue()).redelivery_window(window))
        .store(MemoryStore::new())
        .scope("window")
        .build()
        .await;
    assert!(c.is_ok(), "7 days cover 10 h");
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_fetched_together_are_claimed_together() {
    let Some(b) = Broker::new("batch").await else { return };
    for i in 0..10 {
        b.publish(Some(&format!("k-{i}")), b"{}", &[]).await;
    }
    let store = idem_testkit::faults::FaultyStore::new(MemoryStore::new());
    let (hook, mut rx) = reporter();
    let c = AmqpConsumer::builder(
        AmqpConfig::new(&b.conn, b.queue()).prefetch(16).batch_wait(Duration::from_secs(2)),
    )
    .store(store.clone())
    .scope("batch")
    .batch(10)
    .on_settle(hook)
    .build()
    .await
    .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        c.run(|_ctx, _m| async { Ok::<_, HandlerError<String>>(()) }, async move {
            let _ = stopped.await;
        })
        .await
    });
    let mut seen = Vec::new();
    wait_for(&mut rx, &mut seen, LIMIT, |s| s.len() == 10).await;
    assert!(seen.iter().all(|s| s.outcome == "processed"));
    assert_eq!(store.claim_many_calls(), 1, "ten deliveries, one claim_many round trip");
    assert_eq!(store.claims(), 10);
    stop.send(()).unwrap();
    let stats = task.await.unwrap().unwrap();
    assert_eq!(stats.acked, 10);
    b.cleanup().await;
}

#[tokio::test]
async fn unusable_settings_are_refused_with_the_setting_named() {
    let Some(b) = Broker::new("settings").await else { return };
    let err = build(AmqpConfig::new(&b.conn, b.queue()).prefetch(16), 32).await.unwrap_err();
    assert!(err.source_message().contains("batch (32) exceeds the prefetch (16)"), "{err:?}");
    let err = build(AmqpConfig::new(&b.conn, b.queue()).prefetch(0), 1).await.unwrap_err();
    assert!(err.source_message().contains("prefetch must be at least 1"), "{err:?}");
    let backwards = AmqpConfig::new(&b.conn, b.queue())
        .retry_delay(Duration::from_secs(10), Duration::from_secs(1));
    let err = build(backwards, 8).await.unwrap_err();
    assert!(err.source_message().contains("retry_delay needs 0 < min <= max"), "{err:?}");
    let long_tag = AmqpConfig::new(&b.conn, b.queue()).consumer_tag("t".repeat(256));
    let err = build(long_tag, 8).await.unwrap_err();
    assert!(err.source_message().contains("consumer_tag must be 1 to 255 bytes"), "{err:?}");
    let missing = AmqpConfig::new(&b.conn, format!("{}-missing", b.queue()));
    let err = build(missing, 8).await.unwrap_err();
    assert!(err.source_message().contains("work queue"), "{err:?}");
    b.cleanup().await;
}

async fn build(
    config: AmqpConfig<'_>,
    batch: usize,
) -> Result<AmqpConsumer<MemoryStore>, consumer::BuildError<Error>> {
    AmqpConsumer::builder(config)
        .store(MemoryStore::new())
        .scope("settings")
        .batch(batch)
        .build()
        .await
}

/// The error's own message and its source's, for assertions.
trait SourceMessage {
    fn source_message(&self) -> String;
}

impl SourceMessage for consumer::BuildError<Error> {
    fn source_message(&self) -> String {
        match self {
            consumer::BuildError::Open(e) => e.to_string(),
            other => other.to_string(),
        }
    }
}
