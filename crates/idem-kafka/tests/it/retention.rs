//! The startup retention check. Against a real Kafka-protocol broker (tansu): a topic that
//! keeps messages longer than idem keeps their dedup records is reported, one that does not
//! is not. Without one: a stated redelivery window (the topics' retention) is enforced before
//! anything connects.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::Topics;
use idem_kafka::{KafkaConfig, KafkaConsumer};

const DAY: Duration = Duration::from_secs(86_400);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_that_outlives_the_dedup_records_is_reported_with_both_durations() {
    let Some(brokers) = common::brokers() else { return };
    let sfx = common::suffix();
    let (week, hour) = (format!("idem-ret-week-{sfx}"), format!("idem-ret-hour-{sfx}"));
    let _topics = Topics::create_with(
        &brokers,
        &[(&week, 1, &[("retention.ms", "604800000")]), (&hour, 1, &[("retention.ms", "3600000")])],
    )
    .await;
    let check = |retain: Duration| {
        let (brokers, week, hour) = (brokers.clone(), week.clone(), hour.clone());
        async move {
            let config = KafkaConfig::new(
                &common::config(&brokers, &format!("g-{}", common::suffix())),
                &[week.as_str(), hour.as_str()],
                format!("{week}-dlq"),
            );
            let c = KafkaConsumer::builder(config)
                .store(idem_core::MemoryStore::new())
                .scope("ret")
                .retain(retain)
                .build()
                .await
                .unwrap();
            let gaps = c.source().retention_gaps().await.unwrap();
            c.close().await.unwrap();
            gaps
        }
    };

    let gaps = check(DAY).await;
    assert_eq!(gaps.len(), 1, "{gaps:?}");
    assert_eq!(gaps[0].topic, week);
    assert_eq!(gaps[0].log_retention, Some(DAY * 7));
    assert_eq!(gaps[0].dedup_retention, DAY);
    let msg = gaps[0].to_string();
    assert!(msg.contains("for 7d (retention.ms)") && msg.contains("kept for 1d"), "{msg}");

    assert!(check(DAY * 8).await.is_empty(), "records kept 8 days outlive both topics");
}

/// A stated redelivery window replaces the brokers' answer and is enforced: opening fails before
/// anything connects (the brokers' address here is never dialled).
#[tokio::test]
async fn a_stated_topic_retention_longer_than_the_records_fails_the_opening() {
    let open = |retain: Duration| async move {
        let config =
            KafkaConfig::new(&common::config("127.0.0.1:1", "g"), &["orders"], "orders-dlq")
                .redelivery_window(DAY * 7)
                .close_timeout(Duration::from_secs(2));
        KafkaConsumer::builder(config)
            .store(idem_core::MemoryStore::new())
            .scope("ret")
            .retain(retain)
            .build()
            .await
    };
    let Err(idem_core::consumer::BuildError::Open(e)) = open(DAY).await else { panic!("opened") };
    assert!(
        matches!(&e, idem_kafka::Error::Retention(r)
            if r.window.minimum() == DAY * 7 && r.retention == DAY),
        "{e:?}"
    );
    open(DAY * 7).await.unwrap().close().await.unwrap();
}
