//! Each verb on RabbitMQ's AMQP 1.0 plugin, through the public API: the key from `message-id`
//! or the CloudEvents AMQP binding, `accepted` removes, `released` redelivers, `rejected` goes
//! to the queue's dead-letter exchange, shutdown gives back what was never fetched and is
//! bounded, and settings are checked when the consumer is built.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::Broker;
use idem_amqp10::{Amqp10Config, Amqp10Consumer, DeadLetters, Delivery, Error};
use idem_core::MemoryStore;
use idem_core::engine::{Context, HandlerError};
use idem_core::extract::{CloudEvents, Envelope, Redelivery};
use idem_testkit::wait_for;

type C = Amqp10Consumer<MemoryStore>;

async fn consumer(config: Amqp10Config) -> C {
    Amqp10Consumer::builder(config)
        .idle_wait(Duration::from_millis(200))
        .store(MemoryStore::new())
        .scope("verbs")
        .build()
        .await
        .unwrap()
}

async fn ok(_: Context, _: Delivery) -> Result<(), HandlerError<String>> {
    Ok(())
}

/// Polls until `done` holds over the summed reports, for at most 20 s.
async fn poll_until<F, Fut>(
    c: &C,
    handler: F,
    done: impl Fn(&idem_core::consumer::Report) -> bool,
) -> idem_core::consumer::Report
where
    F: Fn(Context, Delivery) -> Fut + Sync + Clone,
    Fut: std::future::Future<Output = Result<(), HandlerError<String>>> + Send,
{
    let mut total = idem_core::consumer::Report::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !done(&total) {
        assert!(tokio::time::Instant::now() < deadline, "not reached: {total}");
        total += c.poll(handler.clone()).await.unwrap();
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_id_is_the_key_and_accepted_removes() {
    let Some(b) = Broker::new("accept").await else { return };
    for id in ["o-1", "o-2", "o-1"] {
        b.publish(Some(id), br#"{"n":1}"#, &[]).await;
    }
    let c = consumer(Amqp10Config::new(b.url.clone(), b.address())).await;
    let r = poll_until(&c, ok, |r| r.processed + r.duplicates == 3).await;
    assert_eq!((r.processed, r.duplicates, r.acked), (2, 1, 3), "{r}");
    c.close().await.unwrap();
    assert_eq!(b.count(&b.name).await, 0);
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloud_events_binding_gives_the_key() {
    let Some(b) = Broker::new("cloudevents").await else { return };
    let attrs = [
        ("cloudEvents:source", "/shop"),
        ("cloudEvents:id", "e-1"),
        ("cloudEvents:specversion", "1.0"),
    ];
    b.publish(None, b"{}", &attrs).await;
    b.publish(None, b"{}", &attrs).await;
    let c = Amqp10Consumer::builder(Amqp10Config::new(b.url.clone(), b.address()))
        .idle_wait(Duration::from_millis(200))
        .store(MemoryStore::new())
        .scope("ce")
        .key(CloudEvents::default())
        .build()
        .await
        .unwrap();
    let r = poll_until(&c, ok, |r| r.processed + r.duplicates == 2).await;
    assert_eq!((r.processed, r.duplicates), (1, 1), "{r}");
    c.close().await.unwrap();
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_redelivers_a_transient_failure() {
    let Some(b) = Broker::new("release").await else { return };
    b.publish(Some("o-1"), b"{}", &[]).await;
    let c = consumer(Amqp10Config::new(b.url.clone(), b.address())).await;
    let failed_once = std::sync::Arc::new(AtomicBool::new(false));
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen_by = std::sync::Arc::clone(&seen);
    let handler = move |_: Context, d: Delivery| {
        seen_by.lock().unwrap().push(d.redelivery());
        let first = !failed_once.swap(true, Ordering::SeqCst);
        async move { if first { Err(HandlerError::Transient("flaky".to_owned())) } else { Ok(()) } }
    };
    let r = poll_until(&c, handler, |r| r.processed == 1).await;
    assert_eq!((r.failed_transient, r.processed), (1, 1), "{r}");
    // The broker tells the released copy apart (what inbox mode's crash notes go by).
    assert_eq!(*seen.lock().unwrap(), [Redelivery::First, Redelivery::Again]);
    c.close().await.unwrap();
    assert_eq!(b.count(&b.name).await, 0);
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejected_goes_to_the_queues_dead_letter_exchange() {
    let Some(b) = Broker::new("reject").await else { return };
    b.publish(Some("o-1"), br#"{"n":1}"#, &[]).await;
    b.publish(Some("o-1"), br#"{"n":2}"#, &[]).await; // reused id, other content
    let config = Amqp10Config::new(b.url.clone(), b.address()).dead_letters(DeadLetters::Reject);
    let c = consumer(config).await;
    let r = poll_until(&c, ok, |r| r.processed + r.conflicts == 2).await;
    assert_eq!((r.processed, r.conflicts, r.dead_lettered), (1, 1, 1), "{r}");
    c.close().await.unwrap();
    let dead = b.drain_dlq().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].0.as_deref(), Some("o-1"));
    assert_eq!(b.count(&b.name).await, 0);
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_gives_back_the_unfetched_and_is_bounded() {
    let Some(b) = Broker::new("shutdown").await else { return };
    for i in 0..20 {
        b.publish(Some(&format!("o-{i}")), b"{}", &[]).await;
    }
    let config = Amqp10Config::new(b.url.clone(), b.address())
        .prefetch(64)
        .verb_timeout(Duration::from_secs(2));
    let c = Amqp10Consumer::builder(config)
        .store(MemoryStore::new())
        .scope("s")
        .batch(1)
        .build()
        .await
        .unwrap();
    let r = poll_until(&c, ok, |r| r.processed == 1).await;
    assert_eq!(r.processed, 1);
    // The other 19 arrived on the link (credit 64) but were never fetched.
    wait_for("deliveries to reach the link", Duration::from_secs(10), || async {
        b.count(&b.name).await == 0
    })
    .await;
    let started = std::time::Instant::now();
    let given_back = c.close().await.unwrap();
    assert!(started.elapsed() < Duration::from_secs(8), "close took {:?}", started.elapsed());
    // Counted are those released explicitly (from the channel and the client's buffers); the
    // broker returns any still on the wire when the link detaches. The broker's queue count only
    // says they left the broker, not that they reached the client (under load they may not
    // have), so the count is bounded, not fixed. All 19 must come back.
    assert!(given_back <= 19, "{given_back} given back");
    wait_for("released messages back", Duration::from_secs(10), || async {
        b.count(&b.name).await == 19
    })
    .await;
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_are_checked_when_built() {
    let Some(b) = Broker::new("settings").await else { return };
    let build = |config: Amqp10Config| async {
        Amqp10Consumer::builder(config)
            .store(MemoryStore::new())
            .scope("s")
            .build()
            .await
            .map(|_| ())
    };
    let err = build(
        Amqp10Config::new(b.url.clone(), b.address())
            .dead_letters(DeadLetters::Address(b.address())),
    )
    .await
    .unwrap_err();
    assert!(
        err.to_string().contains("dead_letters") || format!("{err:?}").contains("dead_letters"),
        "{err:?}"
    );
    let err = build(
        Amqp10Config::new(b.url.clone(), b.address())
            .redelivery_window(Duration::from_secs(400 * 86_400)),
    )
    .await
    .unwrap_err();
    assert!(format!("{err:?}").contains("RetentionTooShort"), "{err:?}");
    let err = build(Amqp10Config::new("http://127.0.0.1:5672", b.address())).await.unwrap_err();
    assert!(format!("{err:?}").contains("scheme"), "{err:?}");
    let err = build(Amqp10Config::new(b.url.clone(), "/amq/queue/does-not-exist-idem"))
        .await
        .unwrap_err();
    assert!(
        matches!(source_of(&err), Some(Error::AttachReceiver { .. }) | Some(Error::Timeout { .. })),
        "{err:?}"
    );
    b.cleanup().await;
}

fn source_of<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a Error> {
    let mut e: Option<&'a (dyn std::error::Error + 'static)> = Some(err);
    while let Some(cur) = e {
        if let Some(found) = cur.downcast_ref::<Error>() {
            return Some(found);
        }
        e = cur.source();
    }
    None
}
