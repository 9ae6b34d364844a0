//! The broker-source conformance suite on the real RabbitMQ: every mode through the same
//! builder calls (two-phase over a store; SQLite, PostgreSQL and MariaDB inboxes), each on a
//! queue of its own; and the crash suite (abort between commit and ack, SIGKILL and a dropped
//! connection mid-handler) in both modes, the store on SQLite and on PostgreSQL.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::Broker;
use idem_amqp::lapin::BasicProperties;
use idem_amqp::lapin::options::{BasicPublishOptions, QueueDeclareOptions};
use idem_amqp::lapin::types::{AMQPValue, FieldArray, FieldTable, LongString};
use idem_amqp::{AmqpConfig, AmqpDeadLetters, AmqpSource};
use idem_dlq::{DeadLetterQueue, DlqError, Letter, OnConflict, Workbench};
use idem_testkit::crash::CrashHarness;
use idem_testkit::source::{BoxFuture, DeadCopy, SourceHarness};

struct Harness(Broker);

impl SourceHarness for Harness {
    type Source = AmqpSource;
    type Config<'a> = AmqpConfig<'a>;

    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()> {
        Box::pin(self.0.publish(Some(id), body, &[]))
    }

    fn config(&self) -> AmqpConfig<'_> {
        AmqpConfig::new(&self.0.conn, self.0.queue())
            .retry_delay(Duration::from_millis(100), Duration::from_millis(500))
    }

    /// Nothing ready in the work queue or the delay queue (unacked deliveries count as ready
    /// again once the consumer is gone, which the suite checks after the run).
    fn settled(&self) -> BoxFuture<'_, bool> {
        Box::pin(async {
            self.0.count(self.0.queue()).await == 0
                && self.0.count(self.0.topology.delay_queue()).await == 0
        })
    }

    fn dead_letters(&self) -> BoxFuture<'_, Vec<DeadCopy>> {
        Box::pin(async {
            self.0
                .drain_dlq_headers()
                .await
                .into_iter()
                .map(|(message_id, headers, _)| DeadCopy { message_id, headers })
                .collect()
        })
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(self.0.cleanup())
    }
}

impl CrashHarness for Harness {
    fn spec(&self) -> String {
        self.0.queue().to_owned()
    }

    fn attach(queue: &str) -> BoxFuture<'static, Self> {
        let queue = queue.to_owned();
        Box::pin(async move { Harness(Broker::attach(&queue).await) })
    }
}

async fn harness(name: &str) -> Option<Harness> {
    Broker::new(&name.replace('_', "-")).await.map(Harness)
}

idem_testkit::source_conformance!(harness);
idem_testkit::crash_conformance!(Harness, harness, postgres);

/// The dead-letter workbench on RabbitMQ: the consumer's dead letters read back from
/// `<queue>.idem.dlq`, replayed, replayed again, purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workbench() {
    let Some(h) = harness("workbench").await else { return };
    // The consumer declares it too (the same arguments); the reader checks that it exists.
    declare_dlq(&h.0).await;
    let queue = AmqpDeadLetters::for_source(&h.0.conn, h.0.queue()).await.unwrap();
    assert_eq!(queue.describe(), format!("rabbitmq queue {}.idem.dlq", h.0.queue()));
    idem_testkit::dlq::workbench(h, queue).await;
}

async fn declare_dlq(b: &Broker) -> String {
    let dlq = b.topology.dead_letter_queue().unwrap().to_owned();
    b.ch.queue_declare(dlq.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await
        .unwrap();
    dlq
}

/// Publishes straight into `queue`, confirmed.
async fn put(b: &Broker, queue: &str, id: &str, body: &[u8], headers: &[(&str, AMQPValue)]) {
    let mut h = FieldTable::default();
    for (k, v) in headers {
        h.insert((*k).into(), v.clone());
    }
    let props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(id.into())
        .with_content_type("application/json".into())
        .with_headers(h);
    let confirm =
        b.ch.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), body, props)
            .await
            .unwrap()
            .await
            .unwrap();
    assert!(confirm.is_ack());
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// A read takes the messages and puts them back: two reads give the same ids in the same
/// order and leave the depth as it was; remove takes exactly the ids it is given; a replay to
/// a queue that does not exist fails naming it, and removes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_read_twice_are_the_same() {
    let Some(h) = harness("dlq-reads").await else { return };
    let b = &h.0;
    let dlq = declare_dlq(b).await;
    for i in 0..5 {
        let body = format!("{{\"n\":{i}}}");
        let headers = [
            ("idem-outcome", text("failed_permanent")),
            ("idem-source", text(b.queue())),
            ("n", AMQPValue::LongInt(i)),
        ];
        put(b, &dlq, &format!("m-{i}"), body.as_bytes(), &headers).await;
    }
    // The same dead letter twice (an at-least-once copy): two letters, two ids.
    put(
        b,
        &dlq,
        "m-1",
        br#"{"n":1}"#,
        &[
            ("idem-outcome", text("failed_permanent")),
            ("idem-source", text(b.queue())),
            ("n", AMQPValue::LongInt(1)),
        ],
    )
    .await;
    let q = AmqpDeadLetters::new(&b.conn, dlq.clone()).await.unwrap();
    let first = q.read(100).await.unwrap();
    assert_eq!(b.count(&dlq).await, 6, "a read left the depth changed");
    let second = q.read(100).await.unwrap();
    assert_eq!(b.count(&dlq).await, 6);
    let ids = |ls: &[Letter]| ls.iter().map(|l| l.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&first), ids(&second), "two reads differ");
    let mids: Vec<_> = first.iter().map(|l| l.message_id.clone().unwrap()).collect();
    assert_eq!(mids, ["m-0", "m-1", "m-2", "m-3", "m-4", "m-1"], "oldest first");
    assert_eq!(first[5].id, format!("{}.2", first[1].id), "{first:?}");
    assert_eq!(first[2].header("n"), Some("2"));
    assert_eq!(first[2].content_type.as_deref(), Some("application/json"));
    assert_eq!(ids(&q.read(2).await.unwrap()), ids(&first[..2]));

    // Remove the second and the copy; the rest stay, in order.
    let gone = [first[1].id.clone(), first[5].id.clone(), "not-there".to_owned()];
    assert_eq!(q.remove(&gone).await.unwrap(), 2);
    assert_eq!(b.count(&dlq).await, 4);
    let left = q.read(100).await.unwrap();
    assert_eq!(ids(&left), [&first[0], &first[2], &first[3], &first[4]].map(|l| l.id.clone()));

    // A replay to a queue that does not exist fails, naming it; nothing is removed.
    let mut letter = left[0].clone();
    letter.headers.retain(|(k, _)| k != "idem-source");
    let missing = format!("{}-missing", b.queue());
    let letter = letter.with_header("idem-source", missing.clone());
    let err = Workbench::new(&q).replay(&[letter], OnConflict::Refuse).await.unwrap_err();
    assert!(
        matches!(&err, DlqError::NotPublished { letter, .. } if *letter == left[0].id),
        "{err}"
    );
    assert!(err.to_string().contains(&format!("`{missing}`")), "{err}");
    assert_eq!(b.count(&dlq).await, 4);
    // The channels are still usable after a returned message.
    assert_eq!(q.read(100).await.unwrap().len(), 4);
    h.0.cleanup().await;
}

/// A dead letter whose producer sent it to a second queue too (RabbitMQ's `CC`, kept on the
/// message) is replayed to its own queue only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_goes_to_its_queue_only() {
    let Some(h) = harness("dlq-cc").await else { return };
    let b = &h.0;
    let dlq = declare_dlq(b).await;
    let audit = format!("{}-audit", b.queue());
    // Exclusive: gone with the test's connection, even when the test fails.
    let only_ours = QueueDeclareOptions { exclusive: true, ..QueueDeclareOptions::default() };
    b.ch.queue_declare(audit.as_str().into(), only_ours, FieldTable::default()).await.unwrap();
    let cc = FieldArray::from(vec![text(&audit)]);
    let headers = [
        ("idem-outcome", text("failed_permanent")),
        ("idem-source", text(b.queue())),
        ("CC", AMQPValue::FieldArray(cc)),
    ];
    put(b, &dlq, "cc-1", br#"{"n":1}"#, &headers).await;
    assert_eq!(b.count(&audit).await, 1, "the broker honours CC");

    let q = AmqpDeadLetters::new(&b.conn, dlq.clone()).await.unwrap();
    let bench = Workbench::new(&q);
    let letters = bench.list(100).await.unwrap();
    let report = bench.replay(&letters, OnConflict::Refuse).await.unwrap();
    assert_eq!(report.replayed, [letters[0].id.clone()], "{report}");
    assert_eq!(b.count(b.queue()).await, 1);
    assert_eq!(b.count(&audit).await, 1, "the replay went to the CC'd queue again");
    assert_eq!(b.count(&dlq).await, 0);
    h.0.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_dead_letter_queue_is_named() {
    let Some(h) = harness("dlq-missing").await else { return };
    let err = AmqpDeadLetters::for_source(&h.0.conn, h.0.queue()).await.unwrap_err();
    assert!(err.to_string().contains(&format!("`{}.idem.dlq`", h.0.queue())), "{err}");
    h.0.cleanup().await;
}

/// A replay carries what the producer set besides the id and the content type: the correlation
/// id, the original timestamp and the content encoding, through the consumer's dead-letter copy,
/// the dead letter read back, and the message sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_keeps_correlation_id_timestamp_and_encoding() {
    use idem_amqp::lapin::options::BasicGetOptions;
    use idem_core::engine::HandlerError;
    let Some(h) = harness("dlq-props").await else { return };
    let b = &h.0;
    let sent = std::time::UNIX_EPOCH + Duration::from_secs(1_765_000_000);
    let props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id("p-1".into())
        .with_content_type("application/json".into())
        .with_content_encoding("identity".into())
        .with_correlation_id("c-42".into())
        .with_timestamp(1_765_000_000);
    let publish = b.ch.basic_publish(
        "".into(),
        b.queue().into(),
        BasicPublishOptions::default(),
        br#"{"n":1}"#,
        props,
    );
    assert!(publish.await.unwrap().await.unwrap().is_ack());
    let c = idem_amqp::AmqpConsumer::builder(h.config())
        .store(idem_core::MemoryStore::new())
        .scope("props")
        .build()
        .await
        .unwrap();
    let refuse = |_, _| async { Err::<(), _>(HandlerError::Permanent("refused".to_owned())) };
    let report = c.poll(refuse).await.unwrap();
    assert_eq!(report.dead_lettered, 1, "{report}");
    drop(c);

    let q = AmqpDeadLetters::for_source(&b.conn, b.queue()).await.unwrap();
    let bench = Workbench::new(&q);
    let letters = bench.list(10).await.unwrap();
    let l = &letters[0];
    assert_eq!(
        (l.correlation_id.as_deref(), l.content_encoding.as_deref(), l.timestamp),
        (Some("c-42"), Some("identity"), Some(sent))
    );
    let report = bench.replay(&letters, OnConflict::Refuse).await.unwrap();
    assert_eq!(report.replayed.len(), 1, "{report}");
    let got = b.ch.basic_get(b.queue().into(), BasicGetOptions { no_ack: true }).await.unwrap();
    let p = got.expect("the replayed message").delivery.properties;
    let s = |v: &Option<idem_amqp::lapin::types::ShortString>| v.as_ref().map(|s| s.to_string());
    assert_eq!(s(p.message_id()).as_deref(), Some("p-1"));
    assert_eq!(s(p.correlation_id()).as_deref(), Some("c-42"));
    assert_eq!(s(p.content_encoding()).as_deref(), Some("identity"));
    assert_eq!(s(p.content_type()).as_deref(), Some("application/json"));
    assert_eq!(p.timestamp(), &Some(1_765_000_000));
    h.0.cleanup().await;
}
