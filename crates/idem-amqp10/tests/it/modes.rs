//! The broker-source conformance suite on RabbitMQ's AMQP 1.0 plugin: every mode through the
//! same builder calls (two-phase over a store; SQLite, PostgreSQL and MariaDB inboxes), each
//! on a queue of its own, dead letters copied to an address; and the crash suite (abort between
//! commit and `accepted`, SIGKILL and a dropped connection mid-handler) in both modes.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::Broker;
use idem_amqp10::{Amqp10Config, Amqp10DeadLetters, Amqp10Source, DeadLetters};
use idem_dlq::{DeadLetterQueue, Letter, OnConflict, Workbench};
use idem_testkit::crash::CrashHarness;
use idem_testkit::source::{BoxFuture, DeadCopy, SourceHarness};

struct Harness(Broker);

impl SourceHarness for Harness {
    type Source = Amqp10Source;
    type Config<'a> = Amqp10Config;

    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()> {
        Box::pin(self.0.publish(Some(id), body, &[]))
    }

    fn config(&self) -> Amqp10Config {
        Amqp10Config::new(self.0.url.clone(), self.0.address())
            .dead_letters(DeadLetters::Address(self.0.dlq_address()))
            .retry_delay(Duration::from_millis(100), Duration::from_millis(500))
    }

    fn settled(&self) -> BoxFuture<'_, bool> {
        Box::pin(async { self.0.count(&self.0.name).await == 0 })
    }

    fn dead_letters(&self) -> BoxFuture<'_, Vec<DeadCopy>> {
        Box::pin(async {
            self.0
                .drain_dlq()
                .await
                .into_iter()
                .map(|(message_id, headers)| DeadCopy { message_id, headers })
                .collect()
        })
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(self.0.cleanup())
    }
}

impl CrashHarness for Harness {
    fn spec(&self) -> String {
        self.0.name.clone()
    }

    fn attach(name: &str) -> BoxFuture<'static, Self> {
        let name = name.to_owned();
        Box::pin(async move { Harness(Broker::attach(&name).await) })
    }
}

async fn harness(name: &str) -> Option<Harness> {
    Broker::new(&name.replace('_', "-")).await.map(Harness)
}

idem_testkit::source_conformance!(harness);
idem_testkit::crash_conformance!(Harness, harness);

/// The dead-letter workbench on RabbitMQ's AMQP 1.0 plugin: the consumer's dead letters read
/// back from its dead-letter address, replayed to the source address, replayed again, purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workbench() {
    let Some(h) = harness("workbench").await else { return };
    let queue = Amqp10DeadLetters::for_source(&h.config()).unwrap();
    assert_eq!(queue.describe(), format!("amqp 1.0 address {}", h.0.dlq_address()));
    idem_testkit::dlq::workbench(h, queue).await;
}

/// A read takes the messages unsettled and releases them: two reads give the same ids in the
/// same order and leave the depth as it was; remove accepts exactly the ids it is given; a
/// replay goes back to the source address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_read_twice_are_the_same() {
    let Some(h) = harness("dlq-reads").await else { return };
    let b = &h.0;
    let dlq = format!("{}.dlq", b.name);
    let source = b.address();
    let dead = Broker::attach(&dlq).await; // a producer on the dead-letter queue
    for i in 0..5 {
        let body = format!("{{\"n\":{i}}}");
        let headers = [("idem-outcome", "failed_permanent"), ("idem-source", source.as_str())];
        dead.publish(Some(&format!("m-{i}")), body.as_bytes(), &headers).await;
    }
    dead.publish(
        Some("m-1"),
        br#"{"n":1}"#,
        &[("idem-outcome", "failed_permanent"), ("idem-source", source.as_str())],
    )
    .await;
    let q = Amqp10DeadLetters::new(b.url.clone(), b.dlq_address())
        .read_wait(Duration::from_millis(300));
    let first = q.read(100).await.unwrap();
    assert_eq!(b.count(&dlq).await, 6, "a read left the depth changed");
    let second = q.read(100).await.unwrap();
    assert_eq!(b.count(&dlq).await, 6);
    let ids = |ls: &[Letter]| ls.iter().map(|l| l.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&first), ids(&second), "two reads differ");
    let mids: Vec<_> = first.iter().map(|l| l.message_id.clone().unwrap()).collect();
    assert_eq!(mids, ["m-0", "m-1", "m-2", "m-3", "m-4", "m-1"], "oldest first");
    assert_eq!(first[5].id, format!("{}.2", first[1].id), "{first:?}");
    assert_eq!(first[2].payload, br#"{"n":2}"#);
    assert_eq!(ids(&q.read(2).await.unwrap()), ids(&first[..2]));
    assert_eq!(b.count(&dlq).await, 6);

    let gone = [first[1].id.clone(), first[5].id.clone(), "not-there".to_owned()];
    assert_eq!(q.remove(&gone).await.unwrap(), 2);
    assert_eq!(b.count(&dlq).await, 4);
    let left = q.read(100).await.unwrap();
    assert_eq!(ids(&left), [&first[0], &first[2], &first[3], &first[4]].map(|l| l.id.clone()));

    // Replayed to the source address, confirmed, then removed.
    let r = Workbench::new(&q).replay(&left[..1], OnConflict::Refuse).await.unwrap();
    assert_eq!(r.removed, 1, "{r:?}");
    assert_eq!(b.count(&dlq).await, 3);
    assert_eq!(b.count(&b.name).await, 1);
    dead.cleanup().await;
    h.0.cleanup().await;
}

/// A replay carries what the producer set besides the id and the content type: the correlation
/// id, the creation time and the content encoding, through the consumer's dead-letter copy,
/// the dead letter read back, and the message sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_keeps_correlation_id_timestamp_and_encoding() {
    use fe2o3_amqp::types::messaging::{MessageId, Properties};
    use fe2o3_amqp::types::primitives::{Symbol, Timestamp};
    use idem_core::engine::HandlerError;
    let Some(h) = harness("dlq-props").await else { return };
    let b = &h.0;
    let ms = 1_765_000_000_123_i64;
    let props = Properties {
        message_id: Some(MessageId::String("p-1".to_owned())),
        correlation_id: Some(MessageId::String("c-42".to_owned())),
        content_type: Some(Symbol::from("application/json")),
        content_encoding: Some(Symbol::from("identity")),
        creation_time: Some(Timestamp::from_milliseconds(ms)),
        ..Properties::default()
    };
    b.publish_with(props, br#"{"n":1}"#, &[]).await;
    let c = idem_amqp10::Amqp10Consumer::builder(h.config())
        .store(idem_core::MemoryStore::new())
        .scope("props")
        .build()
        .await
        .unwrap();
    let refuse = |_, _| async { Err::<(), _>(HandlerError::Permanent("refused".to_owned())) };
    let report = c.poll(refuse).await.unwrap();
    assert_eq!(report.dead_lettered, 1, "{report}");
    drop(c);

    let q = Amqp10DeadLetters::for_source(&h.config()).unwrap();
    let bench = Workbench::new(&q);
    let letters = bench.list(10).await.unwrap();
    let l = &letters[0];
    let sent = std::time::UNIX_EPOCH + Duration::from_millis(ms.unsigned_abs());
    assert_eq!(
        (l.correlation_id.as_deref(), l.content_encoding.as_deref(), l.timestamp),
        (Some("c-42"), Some("identity"), Some(sent))
    );
    let report = bench.replay(&letters, OnConflict::Refuse).await.unwrap();
    assert_eq!(report.replayed.len(), 1, "{report}");
    let m = b.take(&b.address()).await.expect("the replayed message");
    let p = m.properties.expect("properties");
    assert_eq!(p.message_id, Some(MessageId::String("p-1".to_owned())));
    assert_eq!(p.correlation_id, Some(MessageId::String("c-42".to_owned())));
    assert_eq!(p.content_encoding, Some(Symbol::from("identity")));
    assert_eq!(p.creation_time.map(|t| t.milliseconds()), Some(ms));
    h.0.cleanup().await;
}
