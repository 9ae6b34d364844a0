//! The transactional outbox with the inbox: an order consumer that stores each order *and*
//! publishes `OrderAccepted` exactly once in effect, and a mailer downstream that e-mails once
//! per order.
//!
//! 1. Orders arrive on RabbitMQ queue `orders` (one is sent twice by a retrying producer).
//! 2. The order writer (PostgreSQL inbox) stores the order and enqueues its `OrderAccepted` in
//!    the outbox — marker, order row and outgoing message in one transaction.
//! 3. The relay publishes the outbox to queue `orders-accepted` with publisher confirms, each
//!    message under an id derived from the order's key (so a re-publish is a duplicate).
//! 4. The mailer (two-phase over the same store, its own scope) "sends" one e-mail per order.
//!
//! `cargo run -p idem-consumer --features amqp,postgres --example outbox_orders` (local RabbitMQ and
//! PostgreSQL; `IDEM_AMQP_URL`, `IDEM_POSTGRES_URL` override). Exits non-zero unless 3 orders
//! are stored, 3 messages published and 3 e-mails sent.

use std::time::Duration;

use idem::amqp::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use idem::amqp::lapin::types::FieldTable;
use idem::amqp::lapin::{Connection, ConnectionProperties};
use idem::amqp::{AmqpConfig, AmqpConsumer, AmqpPublisher, Delivery};
use idem::engine::HandlerError;
use idem::extract::Envelope;
use idem::outbox::{OutboxId, OutboxStore, Outgoing, Publisher, Relay};
use idem::sqlx::{self, AssertSqlSafe};
use idem::{PostgresStore, Tx};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let amqp = std::env::var("IDEM_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let pg = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let sfx = std::process::id();
    let (orders_q, accepted_q) = (format!("orders-{sfx}"), format!("orders-accepted-{sfx}"));
    let conn = Connection::connect(&amqp, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    for q in [&orders_q, &accepted_q] {
        ch.queue_declare(q.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
            .await?;
    }

    // Orders in, with a producer retry of order-2 (same message id).
    let producer = AmqpPublisher::new(conn.create_channel().await?).await?;
    let orders = ["order-1", "order-2", "order-2", "order-3"].map(|id| {
        Outgoing::new(orders_q.clone(), format!(r#"{{"order":"{id}"}}"#))
            .id(OutboxId::new(id).expect("a valid id"))
            .into_message(OutboxId::random)
    });
    for r in producer.publish(&orders).await {
        r?;
    }
    println!("published 4 orders to {orders_q} (order-2 twice)");

    let schema = format!("outbox_example_{sfx}");
    let store = PostgresStore::connect(&pg).await?.with_schema(&schema)?;
    store.migrate().await?;
    let outbox = store.outbox();
    outbox.migrate().await?; // the outbox table, its indexes and its NOTIFY trigger
    let orders_table = format!("\"{schema}\".orders");
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE {orders_table} (id TEXT PRIMARY KEY)")))
        .execute(store.pool())
        .await?;

    // 2. The order writer: marker, order row and outgoing message in one transaction.
    let writer = AmqpConsumer::builder(AmqpConfig::new(&conn, &orders_q))
        .inbox(store.inbox(Duration::from_secs(7 * 86_400)))
        .scope("order-writer")
        .idle_wait(Duration::from_millis(300))
        .build()
        .await?;
    let insert = format!("INSERT INTO {orders_table} (id) VALUES ($1)");
    let write_order = |mut tx: Tx<idem::PostgresInbox>, msg: Delivery| {
        let (insert, outbox, accepted_q) = (insert.clone(), outbox.clone(), accepted_q.clone());
        async move {
            let id = msg.message_id().unwrap_or_default().to_owned();
            let transient = |e: &dyn std::fmt::Display| HandlerError::Transient(e.to_string());
            sqlx::query(AssertSqlSafe(insert))
                .bind(&id)
                .execute(&mut *tx)
                .await
                .map_err(|e| transient(&e))?;
            let accepted =
                Outgoing::new(accepted_q, format!(r#"{{"order":"{id}","status":"accepted"}}"#))
                    .header("content-type", "application/json");
            // In the handler's transaction, with an id derived from this message's key.
            let out = outbox.enqueue(&mut tx, accepted).await.map_err(|e| transient(&e))?;
            println!("order writer: stored {id}, enqueued OrderAccepted {out}");
            Ok(())
        }
    };
    let mut written = idem::consumer::Report::default();
    loop {
        let r = writer.poll(&write_order).await?;
        if r.fetched == 0 {
            break;
        }
        written += r;
    }
    println!("order writer: {written}");

    // 3. The relay (a long-running task or `idem relay` in production; here until empty).
    let relay =
        Relay::builder(outbox.clone(), AmqpPublisher::new(conn.create_channel().await?).await?)
            .build()?;
    let relayed = relay.run_until_empty().await?;
    println!("relay: {relayed}");

    // 4. The mailer downstream: its own scope, two-phase (the e-mail is an external effect).
    let mailer = AmqpConsumer::builder(AmqpConfig::new(&conn, &accepted_q))
        .store(store.clone())
        .scope("mailer")
        .idle_wait(Duration::from_millis(300))
        .build()
        .await?;
    let sent = std::sync::atomic::AtomicU64::new(0);
    let send_mail = |ctx: idem::engine::Context, msg: Delivery| {
        let sent = &sent;
        async move {
            let body = String::from_utf8_lossy(msg.payload()).into_owned();
            // A real mailer passes ctx.downstream_key() to the e-mail API as its idempotency key.
            println!("mailer: e-mail for {body} (key {})", ctx.downstream_key().unwrap_or("-"));
            sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, HandlerError<String>>(())
        }
    };
    loop {
        if mailer.poll(&send_mail).await?.fetched == 0 {
            break;
        }
    }

    let stored: i64 =
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {orders_table}")))
            .fetch_one(store.pool())
            .await?;
    let counts = outbox.counts().await?;
    let mails = sent.load(std::sync::atomic::Ordering::SeqCst);
    println!("orders stored {stored}, outbox sent {}, e-mails {mails}", counts.sent);
    for q in [&orders_q, &accepted_q] {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await?;
    }
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(store.pool())
        .await?;
    if stored != 3 || counts.sent != 3 || counts.pending != 0 || mails != 3 {
        return Err("expected 3 orders, 3 OrderAccepted messages and 3 e-mails".into());
    }
    Ok(())
}
