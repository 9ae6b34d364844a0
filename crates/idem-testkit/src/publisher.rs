//! The outbox-publisher contract, run against every broker's [`Publisher`] by
//! [`publisher_conformance!`](crate::publisher_conformance), on the real broker.
//!
//! Each case publishes to a destination of its own and reads what arrived through the same
//! crate's idem source (the [`Consumer`] in two-phase mode over a [`MemoryStore`]), so it checks
//! the whole way: the message id lands where the consumer's default key extractor reads it,
//! payload and headers survive, a message published twice is a duplicate downstream, an ordering
//! key keeps the enqueue order, and a destination nothing receives is a failure, not a success.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure is the test failing

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::consumer::{Report, Source, SourceConfig};
use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_core::outbox::{
    MemoryOutbox, OutboxId, OutboxMessage, OutboxStore, Outgoing, Publisher, Relay,
};
use idem_core::{Consumer, MemoryStore, OutcomeKind};

pub use crate::inbox::BoxFuture;

/// A broker under test: a publisher, a destination of its own (a queue, subject, topic or
/// stream, deleted when the harness is dropped or cleaned up), and the same crate's source
/// reading that destination.
pub trait PublisherHarness: Send + Sync + Sized {
    /// The publisher under test.
    type Publisher: Publisher + Clone;
    /// The crate's source, which reads what the publisher wrote.
    type Source: Source;
    /// The source's settings type (it may borrow the harness's connection).
    type Config<'a>: SourceConfig<Source = Self::Source>
    where
        Self: 'a;

    /// The publisher (a clone shares its connection).
    fn publisher(&self) -> Self::Publisher;

    /// The destination this harness created: messages published there reach
    /// [`config`](Self::config)'s consumer.
    fn destination(&self) -> &str;

    /// Settings for a consumer of the destination, reading from its start.
    fn config(&self) -> Self::Config<'_>;

    /// A destination that no queue or stream receives, where a publish must fail — retryably,
    /// since the queue or stream may be created later — rather than be confirmed and lost
    /// (RabbitMQ: a routing key bound to no queue; JetStream: a subject no stream captures).
    /// `None` for a broker that creates what it is sent to (Kafka topics, Redis streams).
    fn missing_destination(&self) -> Option<String> {
        None
    }

    /// Waits until the broker would store another copy of a message already published: a
    /// broker with a duplicate window of its own (JetStream's `Nats-Msg-Id` window) drops a
    /// quick copy, and the copy must reach the consumer for the case to check it there.
    fn before_republish(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// Deletes what the harness created.
    fn cleanup(self) -> BoxFuture<'static, ()>;
}

/// The user header every case sets.
const HEADER: &str = "x-idem-test";
const SCOPE: &str = "publisher-conformance";
const LIMIT: Duration = Duration::from_secs(60);

/// One message as the consumer's settle hook saw it.
#[derive(Debug, Clone)]
struct Seen {
    key: Option<String>,
    outcome: OutcomeKind,
    payload: Vec<u8>,
    header: Option<String>,
}

/// Consumes the harness's destination with the crate's source until `done` holds over what was
/// seen (or panics after [`LIMIT`]); returns what was seen, in order, and the run's report.
async fn consume<H: PublisherHarness>(
    h: &H,
    what: &str,
    done: impl Fn(&[Seen]) -> bool,
) -> (Vec<Seen>, Report) {
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let hook = {
        let seen = Arc::clone(&seen);
        move |s: &idem_core::consumer::Settlement<'_, <H::Source as Source>::Delivery>| {
            seen.lock().unwrap().push(Seen {
                key: s.key.map(|k| k.id().to_owned()),
                outcome: s.outcome,
                payload: s.message.payload().to_vec(),
                header: s.message.header(HEADER).map(str::to_owned),
            });
        }
    };
    let consumer = Consumer::builder(h.config())
        .store(MemoryStore::new())
        .scope(SCOPE)
        .batch(32)
        .idle_wait(Duration::from_millis(100))
        .on_settle(hook)
        .build()
        .await
        .expect("consumer");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = consumer.run(|_ctx, _m| async { Ok::<_, HandlerError<String>>(()) }, async {
        let _ = stopped.await;
    });
    let mut run = std::pin::pin!(run);
    let watch = crate::wait_for(what, LIMIT, || std::future::ready(done(&seen.lock().unwrap())));
    tokio::select! {
        ended = &mut run => panic!("the consumer stopped before {what}: {ended:?}"),
        () = watch => {}
    }
    stop.send(()).expect("stop");
    let report = run.await.expect("consumer run");
    let seen = seen.lock().unwrap().clone();
    (seen, report)
}

/// An outbox message with a fresh id for `h`'s destination.
fn message<H: PublisherHarness>(h: &H, payload: &str, header: &str) -> OutboxMessage {
    OutboxMessage::from_parts(
        OutboxId::random(),
        h.destination().to_owned(),
        payload.as_bytes().to_vec(),
        vec![(HEADER.to_owned(), header.to_owned())],
        None,
    )
}

/// A relay from a [`MemoryOutbox`] publishes 200 messages with headers in batches of 64; the
/// consumer processes each once, keyed by its outbox id, with its payload and header.
///
/// # Cancel safety
/// Dropped midway, what the case published stays on the harness's destination, which the
/// harness deletes when it is dropped.
pub async fn relay_delivers_every_message<H: PublisherHarness>(h: H) {
    const N: usize = 200;
    let outbox = MemoryOutbox::new();
    let msgs = (0..N)
        .map(|i| {
            Outgoing::new(h.destination(), format!(r#"{{"n":{i}}}"#))
                .header(HEADER, format!("h-{i}"))
        })
        .collect();
    let ids = outbox.send(msgs).await.expect("enqueue");
    let relay = Relay::builder(outbox.clone(), h.publisher()).batch(64).build().expect("relay");
    let report = relay.run_until_empty().await.expect("relay run");
    assert_eq!(report.published, N as u64, "{report}");
    assert_eq!(outbox.counts().await.unwrap().sent, N as u64);
    let (seen, report) = consume(&h, "every relayed message", |s| s.len() >= N).await;
    assert_eq!((report.processed, report.duplicates), (N as u64, 0), "{report}");
    let by_key: HashMap<&str, &Seen> =
        seen.iter().filter_map(|s| Some((s.key.as_deref()?, s))).collect();
    assert_eq!(by_key.len(), N, "a message without its outbox id as key, or twice: {seen:?}");
    for (i, id) in ids.iter().enumerate() {
        let s = by_key.get(id.as_str()).unwrap_or_else(|| panic!("{id} never arrived"));
        assert_eq!(s.outcome, OutcomeKind::Processed);
        assert_eq!(s.payload, format!(r#"{{"n":{i}}}"#).into_bytes(), "payload of {id}");
        assert_eq!(s.header.as_deref(), Some(format!("h-{i}").as_str()), "header of {id}");
    }
    h.cleanup().await;
}

/// A message published twice under one id (a relay that died before marking it sent) is
/// confirmed both times, processed once and found a duplicate once.
///
/// # Cancel safety
/// Dropped midway, what the case published stays on the harness's destination, which the
/// harness deletes when it is dropped.
pub async fn republished_message_is_a_duplicate<H: PublisherHarness>(h: H) {
    let p = h.publisher();
    assert!(p.publish(&[]).await.is_empty(), "an empty batch has no results");
    let m = message(&h, r#"{"order":"o-1"}"#, "first");
    let first = p.publish(std::slice::from_ref(&m)).await;
    assert!(matches!(first.as_slice(), [Ok(())]), "{first:?}");
    h.before_republish().await;
    let again = p.publish(std::slice::from_ref(&m)).await;
    assert!(matches!(again.as_slice(), [Ok(())]), "{again:?}");
    let (seen, report) = consume(&h, "both copies", |s| s.len() >= 2).await;
    assert_eq!((report.processed, report.duplicates), (1, 1), "{report}: {seen:?}");
    assert!(seen.iter().all(|s| s.key.as_deref() == Some(m.id().as_str())), "{seen:?}");
    h.cleanup().await;
}

/// Messages with one ordering key, enqueued among others, arrive in enqueue order.
///
/// # Cancel safety
/// Dropped midway, what the case published stays on the harness's destination, which the
/// harness deletes when it is dropped.
pub async fn ordering_key_keeps_enqueue_order<H: PublisherHarness>(h: H) {
    const KEYED: usize = 20;
    let outbox = MemoryOutbox::new();
    let mut msgs = Vec::new();
    for i in 0..KEYED {
        msgs.push(Outgoing::new(h.destination(), format!("k-{i}")).ordering_key("customer-7"));
        if i % 4 == 0 {
            msgs.push(Outgoing::new(h.destination(), format!("free-{i}")));
        }
    }
    let total = msgs.len();
    outbox.send(msgs).await.expect("enqueue");
    let relay = Relay::builder(outbox, h.publisher()).build().expect("relay");
    let report = relay.run_until_empty().await.expect("relay run");
    assert_eq!(report.published, total as u64, "{report}");
    let (seen, _) = consume(&h, "every message", |s| s.len() >= total).await;
    let keyed: Vec<String> = seen
        .iter()
        .map(|s| String::from_utf8_lossy(&s.payload).into_owned())
        .filter(|p| p.starts_with("k-"))
        .collect();
    let want: Vec<String> = (0..KEYED).map(|i| format!("k-{i}")).collect();
    assert_eq!(keyed, want, "the ordering key's messages arrived out of order");
    h.cleanup().await;
}

/// Publishing where nothing receives is a retryable failure naming that destination, in its
/// place among the batch's results; the publisher goes on publishing afterwards.
///
/// # Cancel safety
/// Dropped midway, what the case published stays on the harness's destination, which the
/// harness deletes when it is dropped.
pub async fn unroutable_destination_fails<H: PublisherHarness>(h: H) {
    let Some(missing) = h.missing_destination() else {
        eprintln!("not applicable: the broker creates whatever destination it is sent to");
        h.cleanup().await;
        return;
    };
    let p = h.publisher();
    let batch: Vec<OutboxMessage> = (0..10)
        .map(|i| {
            let mut m = message(&h, &format!("m-{i}"), "x");
            if i % 3 == 1 {
                m = OutboxMessage::from_parts(
                    m.id().clone(),
                    missing.clone(),
                    m.payload().to_vec(),
                    m.headers().to_vec(),
                    None,
                );
            }
            m
        })
        .collect();
    let results = p.publish(&batch).await;
    assert_eq!(results.len(), batch.len());
    for (i, r) in results.iter().enumerate() {
        if i % 3 == 1 {
            let e = r.as_ref().expect_err("a publish nothing receives was confirmed");
            assert_eq!(e.destination(), missing);
            assert!(e.is_retryable(), "{e:?}");
        } else {
            assert!(r.is_ok(), "message {i}: {r:?}");
        }
    }
    let after = p.publish(&[message(&h, "after", "x")]).await;
    assert!(matches!(after.as_slice(), [Ok(())]), "{after:?}");
    let good = (0..batch.len()).filter(|i| i % 3 != 1).count() + 1;
    let (seen, report) = consume(&h, "the routable messages", |s| s.len() >= good).await;
    assert_eq!(report.processed, good as u64, "{report}: {seen:?}");
    h.cleanup().await;
}

/// Defines the outbox-publisher conformance tests in the calling test file: one test per case,
/// each on a fresh harness from `$make`, an async closure taking the case's name and returning
/// `Option<harness>` (`None`: the broker is unreachable and the test is skipped — under
/// `CI=true` the harness should panic instead, as [`service::require`](crate::service::require)
/// does).
///
/// ```ignore
/// idem_testkit::publisher_conformance!(|name: &'static str| async move { MyBroker::new(name).await });
/// ```
#[macro_export]
macro_rules! publisher_conformance {
    ($make:expr) => {
        $crate::__publisher_cases!($make;
            relay_delivers_every_message,
            republished_message_is_a_duplicate,
            ordering_key_keeps_enqueue_order,
            unroutable_destination_fails,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __publisher_cases {
    ($make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some(harness) = ($make)(stringify!($name)).await else { return };
                $crate::publisher::$name(harness).await;
            }
        )+
    };
}
