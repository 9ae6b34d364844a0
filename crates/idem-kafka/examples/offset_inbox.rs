//! The offset inbox on Kafka and PostgreSQL: each order row and its partition's position commit
//! together, and a producer's second copy of a message id is a duplicate (markers kept for an
//! hour). Prints `processed 3, duplicates 1` and the stored positions, then cleans up.
//!
//! `cargo run -p idem-kafka --example offset_inbox` (brokers from `IDEM_TEST_KAFKA_BROKERS`,
//! PostgreSQL from `IDEM_TEST_POSTGRES_URL`; both default to loopback).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_core::inbox::OffsetInbox;
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::{KafkaConfig, KafkaConsumer};
use idem_sqlx::PostgresStore;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let brokers =
        std::env::var("IDEM_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let pg = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let topic = format!("idem-offset-example-{:06x}", rand::random::<u32>() & 0xff_ffff);
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", &brokers).create()?;
    let new = [
        NewTopic::new(&topic, 2, TopicReplication::Fixed(1)),
        NewTopic::new("idem-offset-example.dlq", 1, TopicReplication::Fixed(1)),
    ];
    admin.create_topics(&new, &AdminOptions::new()).await?;

    // o-1 twice: the producer retried without idempotence.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("batch.num.messages", "1")
        .create()?;
    for id in ["o-1", "o-2", "o-1", "o-3"] {
        let hs = OwnedHeaders::new().insert(Header { key: "message-id", value: Some(id) });
        let rec = FutureRecord::to(&topic).key(id).payload(id).headers(hs);
        producer.send(rec, Duration::from_secs(10)).await.map_err(|(e, _)| e)?;
    }

    let store = PostgresStore::connect(&pg).await?.with_schema("idem_offset_example")?;
    store.migrate().await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS idem_offset_example.orders (id text NOT NULL, at timestamptz DEFAULT now())",
    )
    .execute(store.pool())
    .await?;
    let inbox = OffsetInbox::new(store.inbox(Duration::from_secs(3600)));
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers).set("group.id", "idem-offset-example");
    let kafka = KafkaConfig::new(&config, &[topic.as_str()], "idem-offset-example.dlq")
        .stored_positions(inbox.clone());
    let consumer = KafkaConsumer::builder(kafka)
        .offset_inbox(inbox)
        .scope("order-writer")
        .idle_wait(Duration::from_millis(500))
        .build()
        .await?;
    // Stop after three quiet seconds.
    let report = consumer
        .run(
            |mut tx, msg| async move {
                sqlx::query("INSERT INTO idem_offset_example.orders (id) VALUES ($1)")
                    .bind(msg.message_id().unwrap_or_default().to_owned())
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| HandlerError::Transient(e.to_string()))?;
                Ok::<_, HandlerError<String>>(())
            },
            tokio::time::sleep(Duration::from_secs(3)),
        )
        .await?;
    println!("processed {}, duplicates {}", report.processed, report.duplicates);
    let positions: Vec<(String, i32, Option<i64>)> = sqlx::query_as(
        "SELECT log, part, next_offset FROM idem_offset_example.idem_records_positions ORDER BY 1, 2",
    )
    .fetch_all(store.pool())
    .await?;
    for (log, part, next) in positions {
        println!("{log}[{part}] next offset {next:?}");
    }
    sqlx::raw_sql("DROP SCHEMA idem_offset_example CASCADE").execute(store.pool()).await?;
    admin.delete_topics(&[&topic, "idem-offset-example.dlq"], &AdminOptions::new()).await?;
    Ok(())
}
