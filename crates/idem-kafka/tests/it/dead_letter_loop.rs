//! A consumer never subscribes to its own dead-letter topic, by name or by pattern.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use idem_core::MemoryStore;
use idem_core::consumer::BuildError;
use idem_kafka::rdkafka::Message as _;
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idem_kafka::{Error, KafkaConfig, KafkaConsumer};

/// Opens a two-phase consumer over `kafka`; the source's error when it refuses.
async fn open(kafka: KafkaConfig) -> Result<(), Error> {
    let built = KafkaConsumer::builder(kafka).store(MemoryStore::new()).scope("s").build().await;
    match built {
        Ok(consumer) => {
            consumer.close().await.unwrap();
            Ok(())
        }
        Err(BuildError::Open(e)) => Err(e),
        Err(other) => panic!("expected the source to open or refuse: {other}"),
    }
}

/// A subscription by pattern takes every topic the pattern matches, the dead-letter topic too:
/// a record written there reaches the pattern's subscriber (what the check prevents), so a
/// consumer with that subscription and dead-letter topic is refused, naming both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pattern_that_takes_the_dead_letter_topic_is_refused() {
    let Some(brokers) = common::brokers() else { return };
    let sfx = common::suffix();
    let (orders, dlq) = (format!("orders_{sfx}"), format!("orders_{sfx}.dlq"));
    let outside = format!("dlq.orders_{sfx}");
    let _topics = common::Topics::create(&brokers, &[(&orders, 1), (&dlq, 1), (&outside, 1)]).await;
    let pattern = format!("^orders_{sfx}.*");

    // What the refusal prevents: a dead letter written to `orders_….dlq` is read by the
    // pattern's subscriber as one more message.
    let p = common::producer(&brokers);
    common::produce(&p, &dlq, &[("idem-dlq-1".to_owned(), b"{}".to_vec())], None).await;
    let (b, pat, want) = (brokers.clone(), pattern.clone(), dlq.clone());
    let seen = tokio::task::spawn_blocking(move || {
        let mut config = common::config(&b, &format!("peek-{}", common::suffix()));
        config.set("auto.offset.reset", "earliest").set("enable.auto.commit", "false");
        let c: BaseConsumer = config.create().unwrap();
        c.subscribe(&[&pat]).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if let Some(Ok(m)) = c.poll(Duration::from_millis(200))
                && m.topic() == want
            {
                return true;
            }
        }
        false
    })
    .await
    .unwrap();
    assert!(seen, "the pattern's subscriber reads the dead-letter topic");

    let cfg = common::config(&brokers, &format!("g-{sfx}"));
    let e = open(KafkaConfig::new(&cfg, &[pattern.as_str()], &dlq)).await.expect_err("a loop");
    assert!(matches!(e, Error::DeadLetterLoop { .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains(&format!("`{dlq}`")) && text.contains(&format!("`{pattern}`")), "{text}");

    // A dead-letter topic the pattern does not take opens.
    open(KafkaConfig::new(&cfg, &[pattern.as_str()], &outside)).await.expect("outside the pattern");
}

/// Refused before any broker is reached: the topic subscribed by name beside others, a pattern
/// that takes it, a pattern that cannot be read.
#[tokio::test]
async fn a_subscribed_dead_letter_topic_is_refused_before_connecting() {
    let cfg = common::config("127.0.0.1:1", "g");
    let e =
        open(KafkaConfig::new(&cfg, &["payments", "orders.dlq"], "orders.dlq")).await.unwrap_err();
    assert!(
        e.to_string().contains("the dead-letter topic `orders.dlq` is consumed too")
            && e.to_string().contains("subscription's `orders.dlq`"),
        "{e}"
    );
    let e = open(KafkaConfig::new(&cfg, &["payments", "^orders"], "orders-dlq")).await.unwrap_err();
    assert!(e.to_string().contains("`^orders` takes it"), "{e}");
    let e = open(KafkaConfig::new(&cfg, &["^orders[", "x"], "dlq")).await.unwrap_err();
    assert!(matches!(e, Error::Pattern { .. }) && e.to_string().contains("`^orders[`"), "{e}");
}
