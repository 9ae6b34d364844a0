//! A billing service consuming `OrderPlaced` from Kafka, idempotently.
//!
//! `cargo run -p idem --features kafka --example kafka_consumer`
//! (brokers from `IDEM_TEST_KAFKA_BROKERS`, default `127.0.0.1:9092`; `.ci/services.sh up`
//! starts tansu there).
//!
//! It creates a topic of its own with 3 partitions and a dead-letter topic, produces five
//! orders, two producer retries of them (the same `message-id`, new offsets) and one reused
//! order id with a different body, then consumes in two-phase mode over the embedded SQLite
//! store: each order is charged once (the retries are duplicates), the reused id goes to the
//! dead-letter topic with its reason, and each partition's offset is committed only up to the
//! last settled message. It exits non-zero if any of that does not hold.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::consumer::HandlerError;
use idem::kafka::rdkafka::ClientConfig;
use idem::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem::kafka::rdkafka::client::DefaultClientContext;
use idem::kafka::rdkafka::message::{Header, OwnedHeaders};
use idem::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem::kafka::{Action, KafkaConsumer, Settings};
use idem::{Consumer, SqliteStore};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Result<()> {
    let brokers =
        std::env::var("IDEM_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let sfx = std::process::id();
    let (topic, dlq) = (format!("orders-{sfx}"), format!("orders-{sfx}-dlq"));
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", &brokers).create()?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    for r in admin
        .create_topics(
            &[
                NewTopic::new(&topic, 3, TopicReplication::Fixed(1)),
                NewTopic::new(&dlq, 1, TopicReplication::Fixed(1)),
            ],
            &opts,
        )
        .await?
    {
        r.map_err(|(t, e)| format!("create topic {t}: {e}"))?;
    }
    println!("created {topic} (3 partitions) and {dlq} on {brokers}");

    let producer: FutureProducer =
        ClientConfig::new().set("bootstrap.servers", &brokers).set("acks", "all").create()?;
    let order = |i: u32, cents: u32| {
        (format!("order-{i}"), format!(r#"{{"order":"order-{i}","cents":{cents}}}"#))
    };
    let mut sends: Vec<(String, String)> = (1..=5).map(|i| order(i, i * 1000)).collect();
    sends.push(order(2, 2000)); // producer retries: same id, same body
    sends.push(order(4, 4000));
    sends.push(order(3, 99_999)); // the same id reused for a different order
    for (id, body) in &sends {
        let hs =
            OwnedHeaders::new().insert(Header { key: "message-id", value: Some(id.as_bytes()) });
        let rec = FutureRecord::to(&topic).key(id.as_bytes()).payload(body.as_bytes()).headers(hs);
        let d = producer.send(rec, Duration::from_secs(10)).await.map_err(|(e, _)| e)?;
        println!("produced {id} at partition {} offset {}", d.partition, d.offset);
    }

    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await?;
    let dedup = Consumer::builder(store).scope("billing").build()?;
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers).set("group.id", format!("billing-{sfx}"));
    let (settled_tx, mut settled_rx) = tokio::sync::mpsc::unbounded_channel();
    let kafka = KafkaConsumer::new(&config, &[topic.as_str()], dedup, Settings::new(&dlq))?
        .with_hook(move |s| {
            println!(
                "  {} p{} @{}: {} → {:?}",
                idem::extract::Envelope::message_id(s.delivery).unwrap_or("?"),
                s.delivery.partition(),
                s.delivery.offset(),
                s.outcome,
                s.action
            );
            let _ = settled_tx.send(s.action);
        });

    let charged = Arc::new(Mutex::new(Vec::new()));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let total = sends.len();
    let waiter = tokio::spawn(async move {
        let mut done = 0;
        while done < total {
            match tokio::time::timeout(Duration::from_secs(60), settled_rx.recv()).await {
                Ok(Some(Action::Retry)) => {}
                Ok(Some(_)) => done += 1,
                _ => return Err("not every message settled within 60 s"),
            }
        }
        let _ = stop.send(());
        Ok(())
    });
    let ledger = Arc::clone(&charged);
    let report = kafka
        .run(
            |ctx, msg| {
                let (ledger, body) = (Arc::clone(&ledger), msg.payload_bytes().to_vec());
                async move {
                    // Charge here, passing ctx.downstream_key() as the payment's idempotency key.
                    let order: serde_json::Value = serde_json::from_slice(&body)
                        .map_err(|e| HandlerError::Permanent(e.to_string()))?;
                    ledger
                        .lock()
                        .map_err(|e| HandlerError::Transient(e.to_string()))?
                        .push(order["order"].as_str().unwrap_or("?").to_owned());
                    Ok::<_, HandlerError<String>>(ctx.attempt())
                }
            },
            async {
                let _ = stopped.await;
            },
        )
        .await?;
    waiter.await??;
    println!("{report}");
    if !kafka.close(Duration::from_secs(10)).await {
        eprintln!("closing the consumer timed out");
    }
    let _ = admin.delete_topics(&[&topic, &dlq], &AdminOptions::new()).await;

    let charged = charged.lock().map_err(|e| e.to_string())?.clone();
    println!("charged {} orders: {charged:?}", charged.len());
    if charged.len() != 5 || report.duplicates != 2 || report.dead_lettered != 1 {
        return Err("expected 5 charges, 2 duplicates and 1 dead letter".into());
    }
    Ok(())
}
