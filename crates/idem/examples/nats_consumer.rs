//! An order service consuming `OrderPlaced` from NATS JetStream, idempotently.
//!
//! `cargo run -p idem-consumer --features nats,postgres --example nats_consumer`
//! (NATS from `IDEM_TEST_NATS_URL`, default `127.0.0.1:4222`; PostgreSQL from
//! `IDEM_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`, in a schema of its
//! own dropped at the end).
//!
//! It creates its own stream and dead-letter stream, publishes five orders, two producer retries
//! of them (sent after JetStream's 100 ms duplicate window, so the broker stores them again) and
//! one reused order id with a different body, then consumes with the transactional inbox on
//! PostgreSQL: each batch's order rows commit with their dedup markers in one transaction, and
//! only then are the messages acked. It prints the orders stored and the dead letter, and exits
//! non-zero if an order was stored twice or the conflict was not dead-lettered.

use std::time::Duration;

use idem::PostgresStore;
use idem::consumer::headers;
use idem::engine::HandlerError;
use idem::nats::async_nats::{self, HeaderMap, jetstream};
use idem::nats::{JetStreamConfig, JetStreamConsumer};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Result<()> {
    let url = std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = async_nats::connect(&url).await?;
    let js = jetstream::new(client.clone());
    let (version, at) = (client.server_info().version, idem::redact::Redacted(&url));
    println!("connected to NATS {version} at {at}");

    let sfx = std::process::id();
    let (stream, dlq_stream) = (format!("ORDERS_{sfx}"), format!("ORDERS_{sfx}_DLQ"));
    // The usual layout: the stream takes every subject under `orders.<sfx>.`. The dead letters
    // go outside it, to `dlq.orders.<sfx>` on a stream of their own: under `orders.<sfx>.` the
    // consumer would fetch each dead letter back as a new order (opening refuses that).
    let (subject, dlq) = (format!("orders.{sfx}.placed"), format!("dlq.orders.{sfx}"));
    let window = Duration::from_millis(100);
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("orders.{sfx}.>")],
        duplicate_window: window,
        max_age: Duration::from_secs(3600),
        ..Default::default()
    })
    .await?;
    js.create_stream(jetstream::stream::Config {
        name: dlq_stream.clone(),
        subjects: vec![dlq.clone()],
        ..Default::default()
    })
    .await?;
    let pull = js
        .get_stream(&stream)
        .await?
        .create_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("order-writer".into()),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_deliver: 5,
            ..Default::default()
        })
        .await?;

    let publish = |id: String, body: String| {
        let (js, subject) = (js.clone(), subject.clone());
        async move {
            let mut h = HeaderMap::new();
            h.insert("Nats-Msg-Id", id.as_str());
            let ack = js.publish_with_headers(subject, h, body.into()).await?.await?;
            println!(
                "published {id} (stream seq {}{})",
                ack.sequence,
                if ack.duplicate { ", merged by JetStream" } else { "" }
            );
            Ok::<_, async_nats::Error>(())
        }
    };
    for i in 1..=5 {
        publish(format!("order-{i}"), format!(r#"{{"order":"order-{i}","cents":{}}}"#, i * 1000))
            .await?;
    }
    // The producer's retries come after the broker's dedup window (the server forgets ids on a
    // timer, so up to twice the window later).
    tokio::time::sleep(window * 3).await;
    for i in [2, 4] {
        publish(format!("order-{i}"), format!(r#"{{"order":"order-{i}","cents":{}}}"#, i * 1000))
            .await?;
    }
    publish("order-3".into(), r#"{"order":"order-3","cents":999999}"#.into()).await?;

    let pg = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let schema = format!("nats_example_{sfx}");

    // The whole setup: a store, and a consumer over the pull consumer with its inbox.
    let store = PostgresStore::connect(&pg).await?.with_schema(&schema)?;
    store.migrate().await?;
    let consumer = JetStreamConsumer::builder(JetStreamConfig::new(js.clone(), pull, &dlq))
        .inbox(store.inbox(Duration::from_secs(7 * 86_400)))
        .scope("order-writer")
        .idle_wait(Duration::from_millis(500))
        .build()
        .await?;
    println!(
        "redelivery window to cover: {} (retention 7 days)",
        idem::retention::human(consumer.source().redelivery_window().minimum())
    );

    let orders_table = format!("\"{schema}\".orders");
    idem::sqlx::raw_sql(idem::sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {orders_table} (id TEXT NOT NULL, body TEXT NOT NULL)"
    )))
    .execute(store.pool())
    .await?;
    let insert = format!("INSERT INTO {orders_table} (id, body) VALUES ($1, $2)");
    let handler = |mut tx: idem::Tx<idem::PostgresInbox>, msg: idem::nats::Delivery| {
        let insert = insert.clone();
        async move {
            let id = idem::extract::Envelope::message_id(&msg).unwrap_or_default().to_owned();
            let body = String::from_utf8_lossy(&msg.payload_bytes()).into_owned();
            idem::sqlx::query(idem::sqlx::AssertSqlSafe(insert))
                .bind(&id)
                .bind(body)
                .execute(&mut *tx) // the same transaction as the dedup marker
                .await
                .map_err(|e| HandlerError::Transient(e.to_string()))?;
            Ok(format!("stored {id}"))
        }
    };
    let mut total = idem::consumer::Report::default();
    loop {
        let report = consumer.poll(&handler).await?;
        if report.fetched == 0 {
            break; // nothing arrived within the idle wait: all consumed
        }
        println!("batch: {report}");
        total += report;
    }
    consumer.close().await?;
    println!("total: {total}");

    let orders: Vec<(String, String)> = idem::sqlx::query_as(idem::sqlx::AssertSqlSafe(format!(
        "SELECT id, body FROM {orders_table} ORDER BY id"
    )))
    .fetch_all(store.pool())
    .await?;
    println!("orders stored ({}), each once:", orders.len());
    for (id, body) in &orders {
        println!("  {id}: {body}");
    }
    let dead = js.get_stream(&dlq_stream).await?.get_raw_message(1).await?;
    let h = |n: &str| dead.headers.get(n).map_or("", |v| v.as_str()).to_owned();
    println!(
        "dead letter on {dlq}: {} ({}) — {}",
        h(headers::ORIGINAL_MESSAGE_ID),
        h(headers::OUTCOME),
        h(headers::REASON)
    );

    js.delete_stream(&stream).await?;
    js.delete_stream(&dlq_stream).await?;
    idem::sqlx::raw_sql(idem::sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(store.pool())
        .await?;
    if orders.len() != 5 || total.processed != 5 || total.dead_lettered != 1 {
        return Err(format!("expected 5 orders once and 1 dead letter: {total}").into());
    }
    Ok(())
}
