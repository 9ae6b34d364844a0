//! Messages/s produced with acknowledgements: a bare rdkafka loop beside `KafkaPublisher`, in
//! one run — the ceiling an outbox relay's publishing can reach on this broker.
//!
//! `cargo run --release -p idem-kafka --example kafka_publish_bench -- [messages] [batch]`
//!
//! Both modes produce N records (a `message-id` header and one other header each, no key) to a
//! fresh topic of one partition with the same producer settings (`acks=all`, idempotence as
//! `IDEM_BENCH_KAFKA_IDEMPOTENCE`, default `true`), a batch at a time: the whole batch
//! produced, then every delivery report awaited. The bare loop runs first and last, so warm-up
//! and machine noise show. Brokers: `IDEM_TEST_KAFKA_BROKERS` (default `127.0.0.1:9092`).

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use idem_core::outbox::{OutboxId, OutboxMessage, Publisher};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::{KafkaPublisher, MSG_ID_HEADER};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(20_000);
    let batch: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(256);
    let brokers =
        std::env::var("IDEM_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned());
    let idempotence =
        std::env::var("IDEM_BENCH_KAFKA_IDEMPOTENCE").unwrap_or_else(|_| "true".to_owned());
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &brokers)
        .set("acks", "all")
        .set("enable.idempotence", &idempotence);
    let admin: AdminClient<DefaultClientContext> = config.create()?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    println!(
        "Kafka produce with acks=all, idempotence {idempotence}; {n} messages, batches of {batch}"
    );
    for mode in ["bare rdkafka", "KafkaPublisher", "bare rdkafka (again)"] {
        let topic = format!("idem-publish-bench-{:016x}", rand::random::<u64>());
        for r in admin
            .create_topics(&[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))], &opts)
            .await?
        {
            r.map_err(|(t, e)| format!("create topic {t}: {e}"))?;
        }
        let messages: Vec<OutboxMessage> = (0..n).map(|i| message(&topic, i)).collect();
        // A producer of each mode's own, created before the clock starts; its first batch
        // still pays for the metadata and the producer id.
        let t;
        if mode == "KafkaPublisher" {
            let publisher = KafkaPublisher::with_config(&config)?;
            t = Instant::now();
            for chunk in messages.chunks(batch) {
                for r in publisher.publish(chunk).await {
                    r?;
                }
            }
        } else {
            let producer: FutureProducer = config.create()?;
            t = Instant::now();
            for chunk in messages.chunks(batch) {
                bare(&producer, chunk).await?;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let rate = n as f64 / secs;
        println!("{mode:<22} {n} msgs in {secs:>6.2} s = {rate:>8.0} msgs/s");
        admin.delete_topics(&[topic.as_str()], &opts).await?;
    }
    Ok(())
}

fn message(topic: &str, i: usize) -> OutboxMessage {
    OutboxMessage::from_parts(
        OutboxId::random(),
        topic.to_owned(),
        format!(r#"{{"order":{i},"cents":1200}}"#).into_bytes(),
        vec![("content-type".to_owned(), "application/json".to_owned())],
        None,
    )
}

/// One batch with what `KafkaPublisher` sends, without it: every record, then every report.
async fn bare(producer: &FutureProducer, batch: &[OutboxMessage]) -> Result<()> {
    let sends = batch.iter().map(|m| {
        let mut headers = OwnedHeaders::new_with_capacity(m.headers().len() + 1);
        for (k, v) in m.headers() {
            headers = headers.insert(Header { key: k, value: Some(v.as_bytes()) });
        }
        headers =
            headers.insert(Header { key: MSG_ID_HEADER, value: Some(m.id().as_str().as_bytes()) });
        let record: FutureRecord<'_, str, [u8]> =
            FutureRecord::to(m.destination()).payload(m.payload()).headers(headers);
        producer.send(record, Duration::from_secs(5))
    });
    for r in join_all(sends).await {
        r.map_err(|(e, _)| e)?;
    }
    Ok(())
}
