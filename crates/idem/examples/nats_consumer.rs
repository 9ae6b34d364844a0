//! An order service consuming `OrderPlaced` from NATS JetStream, idempotently.
//!
//! `cargo run -p idem --features nats --example nats_consumer`
//! (server from `IDEM_TEST_NATS_URL`, default `127.0.0.1:4222`).
//!
//! It creates its own stream and dead-letter stream, publishes five orders, two producer retries
//! of them (sent after JetStream's 100 ms duplicate window, so the broker stores them again) and
//! one reused order id with a different body, then consumes with the transactional inbox: each
//! order row commits with its dedup marker in one SQLite transaction, and only then is the
//! message acked. It prints what each batch did, the orders stored and the dead letter.

use std::time::Duration;

use idem::SqliteStore;
use idem::consumer::HandlerError;
use idem::nats::async_nats::{self, HeaderMap, jetstream};
use idem::nats::{InboxConsumer, Settings, headers};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Result<()> {
    let url = std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = async_nats::connect(&url).await?;
    let js = jetstream::new(client.clone());
    println!("connected to NATS {} at {url}", client.server_info().version);

    let sfx = std::process::id();
    let (stream, dlq_stream) = (format!("ORDERS_{sfx}"), format!("ORDERS_{sfx}_DLQ"));
    let (subject, dlq) = (format!("orders.{sfx}.placed"), format!("orders.{sfx}.dlq"));
    let window = Duration::from_millis(100);
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
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

    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("shop.sqlite")).await?;
    sqlx::query("CREATE TABLE orders (id TEXT NOT NULL, body TEXT NOT NULL)")
        .execute(store.pool())
        .await?;
    let inbox = InboxConsumer::new(
        js.clone(),
        pull,
        &store,
        "order-writer",
        Duration::from_secs(7 * 86_400),
        Settings::new(&dlq),
    )
    .await?;
    println!(
        "redelivery window to cover: {} (retention 7 days)",
        idem::retention::human(inbox.redelivery_window().minimum())
    );

    let mut total = idem::nats::Report::default();
    loop {
        let batch = inbox.fetch().await?;
        if batch.is_empty() {
            break; // nothing arrived within the idle wait: all consumed
        }
        let verdicts = inbox
            .process(&batch, |conn, msg| {
                Box::pin(async move {
                    let id =
                        idem::extract::Envelope::message_id(msg).unwrap_or_default().to_owned();
                    let body =
                        String::from_utf8_lossy(idem::extract::Envelope::payload(msg)).into_owned();
                    sqlx::query("INSERT INTO orders (id, body) VALUES (?, ?)")
                        .bind(&id)
                        .bind(body)
                        .execute(&mut *conn)
                        .await
                        .map_err(|e| HandlerError::Transient(e.to_string()))?;
                    Ok(format!("stored {id}"))
                })
            })
            .await;
        let report = inbox.settle(batch, verdicts).await;
        println!("batch: {report}");
        total += report;
    }
    println!("total: {total}");

    let orders: Vec<(String, String)> =
        sqlx::query_as("SELECT id, body FROM orders ORDER BY id").fetch_all(store.pool()).await?;
    println!("orders stored ({}), each once:", orders.len());
    for (id, body) in &orders {
        println!("  {id}: {body}");
    }
    let dead = js.get_stream(&dlq_stream).await?.get_raw_message(1).await?;
    let h = |n: &str| dead.headers.get(n).map_or("", |v| v.as_str()).to_owned();
    println!("dead letter on {dlq}: {} — {}", h(headers::ORIGINAL_MSG_ID), h(headers::REASON));

    js.delete_stream(&stream).await?;
    js.delete_stream(&dlq_stream).await?;
    Ok(())
}
