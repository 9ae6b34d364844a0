//! The outbox publisher on a real Kafka-protocol broker (tansu): the shared publisher suite
//! (read back through `KafkaConsumer`), then what is Kafka's own — the record's key and headers,
//! a record too large, `acks` other than `all`.

use crate::common;

use std::error::Error as _;
use std::time::Duration;

use common::Topics;
use idem_core::outbox::{OutboxId, OutboxMessage, Publisher};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idem_kafka::rdkafka::error::{KafkaError, RDKafkaErrorCode};
use idem_kafka::rdkafka::{Message as _, Offset, TopicPartitionList};
use idem_kafka::{Error, KafkaConfig, KafkaPublisher, KafkaSource};
use idem_testkit::publisher::{BoxFuture, PublisherHarness};

/// The publisher's settings for the test broker.
fn publisher_config(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    c
}

struct Harness {
    brokers: String,
    topic: String,
    dlq: String,
    group: String,
    publisher: KafkaPublisher,
    _topics: Topics,
}

impl Harness {
    /// A topic of 2 partitions (and a dead-letter topic) of the case's own.
    async fn new(name: &str) -> Option<Self> {
        let brokers = common::brokers()?;
        let sfx = common::suffix();
        let name = name.replace('_', "-");
        let (topic, dlq, group) =
            (format!("idem-{name}-{sfx}"), format!("idem-{name}-{sfx}-dlq"), format!("g-{sfx}"));
        let topics = Topics::create(&brokers, &[(&topic, 2), (&dlq, 1)]).await;
        let publisher = KafkaPublisher::with_config(&publisher_config(&brokers)).expect("producer");
        Some(Self { brokers, topic, dlq, group, publisher, _topics: topics })
    }
}

impl PublisherHarness for Harness {
    type Publisher = KafkaPublisher;
    type Source = KafkaSource;
    type Config<'a> = KafkaConfig;

    fn publisher(&self) -> KafkaPublisher {
        self.publisher.clone()
    }

    fn destination(&self) -> &str {
        &self.topic
    }

    fn config(&self) -> KafkaConfig {
        KafkaConfig::new(
            &common::config(&self.brokers, &self.group),
            &[self.topic.as_str()],
            &self.dlq,
        )
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(async move { drop(self) })
    }
}

idem_testkit::publisher_conformance!(|name: &'static str| Harness::new(name));

fn message(topic: &str, key: Option<&str>, headers: &[(&str, &str)]) -> OutboxMessage {
    OutboxMessage::from_parts(
        OutboxId::random(),
        topic.to_owned(),
        br#"{"order":"o-1"}"#.to_vec(),
        headers.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        key.map(str::to_owned),
    )
}

/// Every record of partition `p` of `topic`: key and headers, read from the start until `n`.
async fn records(
    brokers: &str,
    topic: &str,
    p: i32,
    n: usize,
) -> Vec<(Option<Vec<u8>>, Vec<(String, Vec<u8>)>)> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        use idem_kafka::rdkafka::message::Headers as _;
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", format!("reader-{}", common::suffix()))
            .set("enable.auto.commit", "false")
            .create()
            .expect("reader");
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, p, Offset::Beginning).expect("partition");
        c.assign(&tpl).expect("assign");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut out = Vec::new();
        while out.len() < n && std::time::Instant::now() < deadline {
            if let Some(Ok(m)) = c.poll(Duration::from_millis(200)) {
                let headers = m
                    .headers()
                    .map(|hs| {
                        hs.iter()
                            .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                            .collect()
                    })
                    .unwrap_or_default();
                out.push((m.key().map(<[u8]>::to_vec), headers));
            }
        }
        out
    })
    .await
    .expect("reader thread")
}

/// The ordering key is the record key; the outbox id is the `message-id` header, after the
/// message's own headers (a header of that name from the message does not replace it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_and_headers() {
    let Some(brokers) = common::brokers() else { return };
    let topic = format!("idem-pub-record-{}", common::suffix());
    let _topics = Topics::create(&brokers, &[(&topic, 1)]).await;
    let p = KafkaPublisher::with_config(&publisher_config(&brokers)).expect("producer");
    let m = message(&topic, Some("customer-7"), &[("tenant", "t-1"), ("message-id", "forged")]);
    let r = p.publish(std::slice::from_ref(&m)).await;
    assert!(r[0].is_ok(), "{r:?}");
    let got = records(&brokers, &topic, 0, 1).await;
    let (key, headers) = &got[0];
    assert_eq!(key.as_deref(), Some(&b"customer-7"[..]));
    let h = |name: &str| -> Vec<Vec<u8>> {
        headers.iter().filter(|(k, _)| k == name).map(|(_, v)| v.clone()).collect()
    };
    assert_eq!(h("tenant"), [b"t-1".to_vec()]);
    assert_eq!(h("message-id"), [m.id().as_str().as_bytes().to_vec()]);
}

/// A record above the producer's `message.max.bytes` (1,000,000 by default) is refused by
/// librdkafka and never retried; the rest of the batch is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_too_large_is_not_retried() {
    let Some(brokers) = common::brokers() else { return };
    let topic = format!("idem-pub-large-{}", common::suffix());
    let _topics = Topics::create(&brokers, &[(&topic, 1)]).await;
    let p = KafkaPublisher::with_config(&publisher_config(&brokers)).expect("producer");
    let big = OutboxMessage::from_parts(
        OutboxId::random(),
        topic.clone(),
        vec![b'x'; 1 << 20],
        Vec::new(),
        None,
    );
    let results = p.publish(&[big, message(&topic, None, &[])]).await;
    let e = results[0].as_ref().expect_err("too large");
    assert!(!e.is_retryable(), "{e:?}");
    let cause = e.source().and_then(|s| s.downcast_ref::<KafkaError>());
    assert_eq!(
        cause.and_then(KafkaError::rdkafka_error_code),
        Some(RDKafkaErrorCode::MessageSizeTooLarge)
    );
    assert!(results[1].is_ok(), "{results:?}");
}

#[test]
fn acks_other_than_all_are_refused() {
    let mut c = publisher_config("127.0.0.1:9092");
    c.set("acks", "1");
    assert!(matches!(KafkaPublisher::with_config(&c), Err(Error::Setting { key: "acks", .. })));
    c.set("acks", "-1");
    assert!(KafkaPublisher::with_config(&c).is_ok());
    let empty = ClientConfig::new();
    assert!(matches!(
        KafkaPublisher::with_config(&empty),
        Err(Error::MissingSetting { key: "bootstrap.servers", .. })
    ));
}
