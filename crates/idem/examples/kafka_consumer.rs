//! An order service consuming `OrderPlaced` from Kafka, idempotently.
//!
//! `cargo run -p idem-consumer --features kafka,postgres --example kafka_consumer`
//! (brokers from `IDEM_TEST_KAFKA_BROKERS`, default `127.0.0.1:9092`; `.ci/services.sh up`
//! starts tansu there; PostgreSQL from `IDEM_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/test`, in a schema of its own dropped at the end).
//!
//! It creates a topic of its own with 3 partitions and a dead-letter topic, produces five
//! orders, two producer retries of them (the same `message-id`, new offsets) and one reused
//! order id with a different body, then consumes with the transactional inbox on PostgreSQL:
//! each batch's order rows commit with their dedup markers in one transaction (the retries are
//! duplicates), the reused id goes to the dead-letter topic with its reason, and each
//! partition's offset is committed only up to the last settled message. It exits non-zero if
//! any of that does not hold.

use std::time::Duration;

use idem::engine::HandlerError;
use idem::engine::Verb;
use idem::kafka::rdkafka::ClientConfig;
use idem::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem::kafka::rdkafka::client::DefaultClientContext;
use idem::kafka::rdkafka::message::{Header, OwnedHeaders};
use idem::kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem::kafka::{KafkaConfig, KafkaConsumer};
use idem::{PostgresStore, sqlx};

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

    let pg = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("kafka_example_{sfx}");
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers).set("group.id", format!("order-writer-{sfx}"));
    let (settled_tx, mut settled_rx) = tokio::sync::mpsc::unbounded_channel();

    // The whole setup: a store, and a consumer of the topic with its inbox.
    let store = PostgresStore::connect(&pg).await?.with_schema(&schema)?;
    store.migrate().await?;
    let consumer = KafkaConsumer::builder(KafkaConfig::new(&config, &[topic.as_str()], &dlq))
        .inbox(store.inbox(Duration::from_secs(7 * 86_400)))
        .scope("order-writer")
        .on_settle(move |s| {
            let (m, id) = (s.message, idem::extract::Envelope::message_id(s.message));
            println!(
                "  {} p{} @{}: {} → {:?}",
                id.unwrap_or("?"),
                m.partition(),
                m.offset(),
                s.outcome,
                s.verb
            );
            let _ = settled_tx.send(s.verb.clone());
        })
        .build()
        .await?;

    let orders = format!("\"{schema}\".orders");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE TABLE {orders} (id TEXT, cents BIGINT)")))
        .execute(store.pool())
        .await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let total = sends.len();
    let waiter = tokio::spawn(async move {
        let mut done = 0;
        while done < total {
            match tokio::time::timeout(Duration::from_secs(60), settled_rx.recv()).await {
                Ok(Some(Verb::Retry { .. })) => {}
                Ok(Some(_)) => done += 1,
                _ => return Err("not every message settled within 60 s"),
            }
        }
        let _ = stop.send(());
        Ok(())
    });
    let insert = format!("INSERT INTO {orders} (id, cents) VALUES ($1, $2)");
    let report = consumer
        .run(
            |mut tx: idem::Tx<idem::PostgresInbox>, msg: idem::kafka::Delivery| {
                let insert = insert.clone();
                async move {
                    let order: serde_json::Value = serde_json::from_slice(msg.payload_bytes())
                        .map_err(|e| HandlerError::Permanent(e.to_string()))?;
                    sqlx::query(sqlx::AssertSqlSafe(insert))
                        .bind(order["order"].as_str())
                        .bind(order["cents"].as_i64())
                        .execute(&mut *tx) // the same transaction as the dedup marker
                        .await
                        .map_err(|e| HandlerError::Transient(e.to_string()))?;
                    Ok(())
                }
            },
            async {
                let _ = stopped.await;
            },
        )
        .await?;
    waiter.await??;
    println!("{report}");
    let _ = admin.delete_topics(&[&topic, &dlq], &AdminOptions::new()).await;

    let stored: Vec<(String, i64)> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT id, cents FROM {orders} ORDER BY id")))
            .fetch_all(store.pool())
            .await?;
    println!("stored {} orders: {stored:?}", stored.len());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(store.pool())
        .await?;
    if stored.len() != 5 || report.duplicates != 2 || report.dead_lettered != 1 {
        return Err("expected 5 orders stored once, 2 duplicates and 1 dead letter".into());
    }
    Ok(())
}
