//! Kafka over TLS (`security.protocol=SSL`, feature `tls`) against the TLS listener of
//! `.ci/services.sh` (9093: tansu cannot serve TLS itself, so socat terminates TLS in front of a
//! second tansu; no SASL and no client-certificate check behind it). A verified session
//! publishes; a wrong CA, a wrong host name and TLS against the plaintext broker are refused.
#![cfg(feature = "tls")]

use crate::common;

use std::time::Duration;

use idem_core::outbox::{OutboxId, OutboxMessage, Publisher as _};
use idem_kafka::KafkaPublisher;
use idem_kafka::rdkafka::ClientConfig;
use idem_testkit::tls::{Pki, WRONG_HOST};

fn tls_brokers() -> Option<(String, Pki)> {
    let brokers = idem_testkit::service::require(
        "Kafka (TLS)",
        "IDEM_TEST_KAFKA_TLS_BROKERS",
        "localhost:9093",
    )?;
    Some((brokers, Pki::require()?))
}

fn ssl_config(brokers: &str, ca: &std::path::Path) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("security.protocol", "SSL")
        .set("ssl.ca.location", ca.to_str().unwrap_or_default())
        .set("ssl.endpoint.identification.algorithm", "https")
        // A refused handshake shows as a delivery that times out: keep that short.
        .set("message.timeout.ms", "8000");
    c
}

fn message(topic: &str) -> OutboxMessage {
    let id = OutboxId::new(format!("tls-{}", common::suffix())).expect("id");
    OutboxMessage::from_parts(id, topic.to_owned(), b"hello".to_vec(), vec![], None)
}

/// Publishes one message; `Ok` once the broker acknowledged it.
async fn publish(config: &ClientConfig, topic: &str) -> Result<(), String> {
    let publisher = KafkaPublisher::with_config(config).map_err(|e| e.to_string())?;
    let results = publisher.publish(&[message(topic)]).await;
    match results.into_iter().next() {
        Some(Ok(())) => Ok(()),
        Some(Err(e)) => Err(e.to_string()),
        None => Err("no result".into()),
    }
}

/// Creates `topic` over the TLS listener (its broker is in memory: nothing to clean up after).
async fn create_topic(config: &ClientConfig, topic: &str) {
    use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use idem_kafka::rdkafka::client::DefaultClientContext;
    let admin: AdminClient<DefaultClientContext> = config.create().expect("admin over TLS");
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(1));
    for r in admin.create_topics(&[new], &opts).await.expect("create topic over TLS") {
        r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ssl_with_our_ca_publishes() {
    let Some((brokers, pki)) = tls_brokers() else { return };
    let topic = format!("idem-tls-{}", common::suffix());
    create_topic(&ssl_config(&brokers, &pki.ca()), &topic).await;
    tokio::time::timeout(
        Duration::from_secs(30),
        publish(&ssl_config(&brokers, &pki.ca()), &topic),
    )
    .await
    .expect("bounded")
    .expect("a verified TLS session publishes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_a_wrong_host_and_the_plaintext_broker_are_refused() {
    let Some((brokers, pki)) = tls_brokers() else { return };
    let Some(plain) = common::brokers() else { return };
    let topic = format!("idem-tls-{}", common::suffix());
    let cases = [
        ("wrong CA", ssl_config(&brokers, &pki.wrong_ca())),
        ("wrong host", ssl_config(&brokers.replacen("localhost", WRONG_HOST, 1), &pki.ca())),
        ("TLS to the plaintext broker", ssl_config(&plain, &pki.ca())),
    ];
    for (case, config) in cases {
        let r = tokio::time::timeout(Duration::from_secs(30), publish(&config, &topic))
            .await
            .expect("bounded");
        assert!(r.is_err(), "{case}: published");
    }
}
