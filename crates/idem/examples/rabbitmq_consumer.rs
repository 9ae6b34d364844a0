//! An idempotent RabbitMQ consumer against the local broker, printing what it does.
//!
//! ```text
//! cargo run -p idem --features amqp --example rabbitmq_consumer
//! ```
//!
//! It declares a queue of its own, publishes six `OrderPlaced` messages — four orders, a
//! producer retry of one of them, and an order id reused with other content — and consumes
//! them in transactional-inbox mode: each order row commits with its dedup marker in SQLite,
//! then the message is acked. The retry is acked as a duplicate without a second row; the
//! reused id goes to the dead-letter queue with its reason. Broker address: `IDEM_AMQP_URL`
//! (default `amqp://guest:guest@127.0.0.1:5672/%2f`).

use std::time::Duration;

use idem::Consumer;
use idem::SqliteStore;
use idem::amqp::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use idem::amqp::lapin::types::{AMQPValue, FieldTable};
use idem::amqp::lapin::{BasicProperties, Connection, ConnectionProperties};
use idem::amqp::{Action, AmqpConsumer, RabbitWindow, Report};
use idem::consumer::HandlerError;
use idem::sqlite::Writes;
use sqlx::sqlite::SqliteConnection;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let url = std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    let queue = format!("idem-example-orders-{}", std::process::id());
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await?;
    println!("queue {queue} on {url}");

    // The producer, with a retry and a reused id.
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let orders = [
        ("order-1", r#"{"order":"order-1","cents":1200}"#),
        ("order-2", r#"{"order":"order-2","cents":550}"#),
        ("order-1", r#"{"order":"order-1","cents":1200}"#), // the producer's retry
        ("order-3", r#"{"order":"order-3","cents":9900}"#),
        ("order-2", r#"{"order":"order-2","cents":99999}"#), // same id, other content
        ("order-4", r#"{"order":"order-4","cents":100}"#),
    ];
    for (id, body) in orders {
        let props = BasicProperties::default().with_delivery_mode(2).with_message_id(id.into());
        ch.basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            props,
        )
        .await?
        .await?;
        println!("published {id}: {body}");
    }

    // The consumer: SQLite holds the orders and the dedup markers, in one transaction each.
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("orders.sqlite")).await?;
    sqlx::query("CREATE TABLE orders (id TEXT NOT NULL, body TEXT NOT NULL)")
        .execute(store.pool())
        .await?;
    let inbox = store.inbox(Duration::from_secs(7 * 86_400));
    let engine = Consumer::builder(store.clone()).scope("order-writer").build()?;
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let consumer = AmqpConsumer::builder(engine, queue.as_str())
        .retention_window(RabbitWindow::new().delivery_limit(20))
        .on_settle(move |r: &Report<'_>| {
            let verb = match r.action {
                Action::Ack => "ack".to_owned(),
                Action::Requeue => "nack, requeue".to_owned(),
                Action::Delay(d) => format!("delay {d:?}, then ack"),
                Action::DeadLetter { reason } => format!("dead-letter ({reason}), then ack"),
                _ => "other".to_owned(),
            };
            println!("consumed {:<8} → {:<16} → {verb}", r.key.unwrap_or("-"), r.outcome);
            let _ = done_tx.send(());
        })
        .connect(&conn)
        .await?;
    let topology = consumer.topology().clone();
    let shutdown = async move {
        for _ in 0..orders.len() {
            let _ = done_rx.recv().await;
        }
    };
    let stats = consumer.run_inbox(&inbox, store.pool(), store_order, shutdown).await?;
    println!("{stats:?}");

    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT id, body FROM orders ORDER BY id").fetch_all(store.pool()).await?;
    println!("orders table ({} rows, one per order):", rows.len());
    for (id, body) in &rows {
        println!("  {id}: {body}");
    }
    let dlq = topology.dead_letter_queue().unwrap_or_default();
    while let Some(m) = ch.basic_get(dlq.into(), BasicGetOptions { no_ack: true }).await? {
        let d = m.delivery;
        let reason =
            d.properties.headers().as_ref().and_then(|h| match h.inner().get("x-idem-reason") {
                Some(AMQPValue::LongString(s)) => Some(s.to_string()),
                _ => None,
            });
        println!(
            "dead-letter queue: {:?} {} — reason: {}",
            d.properties.message_id(),
            String::from_utf8_lossy(&d.data),
            reason.unwrap_or_default()
        );
    }

    for q in [topology.queue(), topology.delay_queue(), dlq] {
        ch.queue_delete(q.into(), QueueDeleteOptions::default()).await?;
    }
    ch.exchange_delete(topology.dead_letter_exchange().into(), ExchangeDeleteOptions::default())
        .await?;
    conn.close(200, "bye".into()).await?;
    Ok(())
}

/// The business write, on the inbox's transaction.
fn store_order(
    conn: &mut SqliteConnection,
    msg: idem::amqp::AmqpMessage,
) -> Writes<'_, (), HandlerError<sqlx::Error>> {
    Box::pin(async move {
        let id = msg.properties().message_id().as_ref().map(|s| s.to_string()).unwrap_or_default();
        sqlx::query("INSERT INTO orders VALUES (?, ?)")
            .bind(id)
            .bind(String::from_utf8_lossy(msg.payload()).into_owned())
            .execute(&mut *conn)
            .await
            .map_err(HandlerError::Transient)?;
        Ok(())
    })
}
