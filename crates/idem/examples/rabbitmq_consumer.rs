//! An order service consuming `OrderPlaced` from RabbitMQ, idempotently, printing what it does.
//!
//! `cargo run -p idem-consumer --features amqp,postgres --example rabbitmq_consumer`
//! (broker from `IDEM_AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`; PostgreSQL
//! from `IDEM_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`, in a schema of
//! its own dropped at the end).
//!
//! It declares a queue of its own, publishes six orders — four orders, a producer retry of one
//! of them, and an order id reused with other content — and consumes them with the
//! transactional inbox on PostgreSQL: each batch's order rows commit with their dedup markers
//! in one transaction, and only then are the messages acked. The retry is acked as a duplicate
//! without a second row; the reused id goes to the dead-letter queue with its reason. Exits
//! non-zero if an order was stored twice or the conflict was not dead-lettered.
//!
//! With the `prometheus` feature it also serves its metrics on `IDEM_METRICS_ADDR` (default
//! `127.0.0.1:0`, a free port) and prints its `idem_` counters at the end.

use std::time::Duration;

use idem::PostgresStore;
use idem::amqp::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use idem::amqp::lapin::types::{AMQPValue, FieldTable};
use idem::amqp::lapin::{BasicProperties, Connection, ConnectionProperties};
use idem::amqp::{AmqpConfig, AmqpConsumer, Delivery, RabbitWindow};
use idem::consumer::{Settlement, headers};
use idem::engine::HandlerError;
use idem::engine::Verb;
use idem::sqlx::{self, AssertSqlSafe};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    // One call: a /metrics endpoint with every idem counter and histogram (docs/OPERATIONS.md).
    #[cfg(feature = "prometheus")]
    let metrics = {
        let addr = std::env::var("IDEM_METRICS_ADDR").unwrap_or_else(|_| "127.0.0.1:0".into());
        idem::prometheus::install(addr.parse()?)?
    };
    let url = std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    let sfx = std::process::id();
    let queue = format!("idem-example-orders-{sfx}");
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await?;
    // Never print a URL as it is: it may carry a password.
    println!("queue {queue} on {}", idem::redact::Redacted(&url));

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
        let publish = BasicPublishOptions::default();
        ch.basic_publish("".into(), queue.as_str().into(), publish, body.as_bytes(), props)
            .await?
            .await?;
        println!("published {id}: {body}");
    }

    let pg = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("amqp_example_{sfx}");

    // The whole setup: a store, and a consumer over the queue with its inbox.
    let store = PostgresStore::connect(&pg).await?.with_schema(&schema)?;
    store.migrate().await?;
    let config =
        AmqpConfig::new(&conn, &queue).redelivery_window(RabbitWindow::new().delivery_limit(20));
    let consumer = AmqpConsumer::builder(config)
        .inbox(store.inbox(Duration::from_secs(7 * 86_400)))
        .scope("order-writer")
        .idle_wait(Duration::from_millis(500))
        .on_settle(print_settlement)
        .build()
        .await?;

    let orders_table = format!("\"{schema}\".orders");
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {orders_table} (id TEXT NOT NULL, body TEXT NOT NULL)"
    )))
    .execute(store.pool())
    .await?;
    let insert = format!("INSERT INTO {orders_table} (id, body) VALUES ($1, $2)");
    let handler = |mut tx: idem::Tx<idem::PostgresInbox>, msg: Delivery| {
        let insert = insert.clone();
        async move {
            let id = idem::extract::Envelope::message_id(&msg).unwrap_or_default().to_owned();
            sqlx::query(AssertSqlSafe(insert))
                .bind(&id)
                .bind(String::from_utf8_lossy(msg.payload()).into_owned())
                .execute(&mut *tx) // the same transaction as the dedup marker
                .await
                .map_err(|e| HandlerError::Transient(e.to_string()))?;
            Ok(())
        }
    };
    let mut total = idem::consumer::Report::default();
    loop {
        let report = consumer.poll(&handler).await?;
        if report.fetched == 0 {
            break; // nothing arrived within the idle wait: all consumed
        }
        total += report;
    }
    let topology = consumer.source().topology().clone();
    consumer.close().await?;
    println!("total: {total}");
    #[cfg(feature = "prometheus")]
    for line in metrics.render().lines() {
        if line.starts_with("idem_outcomes_total") || line.starts_with("idem_dead_letters_total") {
            println!("metric: {line}");
        }
    }

    let rows: Vec<(String, String)> =
        sqlx::query_as(AssertSqlSafe(format!("SELECT id, body FROM {orders_table} ORDER BY id")))
            .fetch_all(store.pool())
            .await?;
    println!("orders table ({} rows, one per order):", rows.len());
    for (id, body) in &rows {
        println!("  {id}: {body}");
    }
    let dlq = topology.dead_letter_queue().unwrap_or_default();
    while let Some(m) = ch.basic_get(dlq.into(), BasicGetOptions { no_ack: true }).await? {
        let d = m.delivery;
        let reason =
            d.properties.headers().as_ref().and_then(|h| match h.inner().get(headers::REASON) {
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
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(store.pool())
        .await?;
    conn.close(200, "bye".into()).await?;
    if rows.len() != 4 || total.processed != 4 || total.dead_lettered != 1 {
        return Err(format!("expected 4 orders once and 1 dead letter: {total}").into());
    }
    Ok(())
}

/// Each delivery's fate, once its outcome is committed and before the broker is told.
fn print_settlement(s: &Settlement<'_, Delivery>) {
    let verb = match s.verb {
        Verb::Ack => "ack".to_owned(),
        Verb::Retry { after: Some(d) } => format!("delay queue ({d:?}), then ack"),
        Verb::DeadLetter { reason } => format!("dead-lettered ({reason}), then ack"),
        _ => "nack, requeue".to_owned(),
    };
    let key = s.key.map_or("-", |k| k.id());
    println!("consumed {key:<8} → {:<16} → {verb}", s.outcome.as_str());
}
