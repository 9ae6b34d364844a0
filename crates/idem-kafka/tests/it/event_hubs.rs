//! Azure Event Hubs through the Kafka adapter, at the configuration level: the consumer built
//! from a connection string opens (librdkafka creates the consumer and the dead-letter
//! producer, which needs no network), and the stated hub retention is checked against the
//! dedup retention before anything connects. One test reaches Azure, only when
//! `IDEM_TEST_EVENTHUBS_CONNECTION` is set.
#![cfg(feature = "event-hubs")]
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use idem_core::MemoryStore;
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idem_kafka::{Error, EventHubsConfig, KafkaConsumer};

const DAY: Duration = Duration::from_secs(86_400);

/// A namespace that never resolves (`.invalid`): nothing here reaches a network.
const OFFLINE: &str = "Endpoint=sb://idem-test.invalid/;SharedAccessKeyName=listen;\
                       SharedAccessKey=c2VjcmV0LWtleQ==;EntityPath=orders";

#[tokio::test]
async fn opening_fails_naming_both_durations_when_the_hub_outlives_the_records() {
    let hubs = EventHubsConfig::new(OFFLINE, "order-writer").unwrap().redelivery_window(DAY * 7);
    let kafka = hubs.kafka(&[hubs.topic().unwrap()], "orders-dlq");
    let err = KafkaConsumer::builder(kafka)
        .store(MemoryStore::new())
        .scope("eh")
        .retain(DAY)
        .build()
        .await
        .unwrap_err();
    let idem_core::consumer::BuildError::Open(source) = err else { panic!("{err:?}") };
    assert!(
        matches!(&source, Error::Retention(r)
            if r.window.minimum() == DAY * 7 && r.retention == DAY),
        "{source:?}"
    );
    let msg = source.to_string();
    assert!(msg.contains("retention 1d") && msg.contains("window 7d"), "{msg}");
}

#[tokio::test]
async fn the_consumer_and_its_dead_letter_producer_open_offline_when_the_records_outlive_the_hub() {
    let hubs = EventHubsConfig::new(OFFLINE, "order-writer").unwrap().redelivery_window(DAY * 7);
    let kafka = hubs.kafka(&["orders"], "orders-dlq").close_timeout(Duration::from_secs(2));
    // Equal retentions are enough: a replay can only bring back what the hub still holds.
    let c = KafkaConsumer::builder(kafka)
        .store(MemoryStore::new())
        .scope("eh")
        .retain(DAY * 7)
        .build()
        .await
        .unwrap();
    c.close().await.unwrap();
}

/// Reaches the namespace for real: TLS, SASL PLAIN with the connection string, the recommended
/// settings accepted, the topic's metadata returned. Needs a connection string with an
/// `EntityPath` (or `IDEM_TEST_EVENTHUBS_TOPIC`).
#[tokio::test]
async fn against_azure_the_consumer_authenticates_and_sees_the_hub() {
    let Ok(connection) = std::env::var("IDEM_TEST_EVENTHUBS_CONNECTION") else {
        println!("skipped: IDEM_TEST_EVENTHUBS_CONNECTION unset");
        return;
    };
    let hubs = EventHubsConfig::new(&connection, "idem-test").unwrap();
    let topic = std::env::var("IDEM_TEST_EVENTHUBS_TOPIC")
        .ok()
        .or_else(|| hubs.topic().map(str::to_owned))
        .expect("an EntityPath in the connection string, or IDEM_TEST_EVENTHUBS_TOPIC");
    let config = hubs.client_config();
    let metadata = tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = config.create().unwrap();
        consumer.fetch_metadata(Some(&topic), Duration::from_secs(30)).map(|m| {
            m.topics()
                .iter()
                .map(|t| (t.name().to_owned(), t.partitions().len()))
                .collect::<Vec<_>>()
        })
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(metadata.len(), 1, "{metadata:?}");
    assert!(metadata[0].1 > 0, "the hub has partitions: {metadata:?}");
}
