//! Messages/s published with confirms: a bare lapin loop beside `AmqpPublisher`, in one run —
//! the ceiling an outbox relay's publishing can reach on this broker.
//!
//! `cargo run --release -p idem-amqp --example amqp_publish_bench -- [messages] [batch]`
//!
//! Both modes publish N persistent, `mandatory` messages (a message id and one header each) to
//! a fresh durable queue through the default exchange, a batch at a time: the whole batch sent,
//! then every confirm awaited. The bare loop runs first and last, so warm-up and machine noise
//! show. Broker: `IDEM_TEST_AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`).

use std::time::Instant;

use futures_util::future::join_all;
use idem_amqp::AmqpPublisher;
use idem_amqp::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idem_amqp::lapin::types::{AMQPValue, FieldTable, LongString};
use idem_amqp::lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use idem_core::outbox::{OutboxId, OutboxMessage, Publisher};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(20_000);
    let batch: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(256);
    let url = std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
    let admin = conn.create_channel().await?;
    println!("RabbitMQ publish with confirms; {n} messages, batches of {batch}");
    for mode in ["bare lapin", "AmqpPublisher", "bare lapin (again)"] {
        let queue = format!("idem-publish-bench-{:016x}", rand::random::<u64>());
        admin
            .queue_declare(
                queue.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await?;
        let messages: Vec<OutboxMessage> = (0..n).map(|i| message(&queue, i)).collect();
        let ch = conn.create_channel().await?;
        let t = Instant::now();
        if mode == "AmqpPublisher" {
            let publisher = AmqpPublisher::new(ch).await?;
            for chunk in messages.chunks(batch) {
                for r in publisher.publish(chunk).await {
                    r?;
                }
            }
        } else {
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
            for chunk in messages.chunks(batch) {
                bare(&ch, chunk).await?;
            }
            ch.close(200, "".into()).await?;
        }
        let secs = t.elapsed().as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let rate = n as f64 / secs;
        println!("{mode:<20} {n} msgs in {secs:>6.2} s = {rate:>8.0} msgs/s");
        admin.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await?;
    }
    conn.close(200, "".into()).await?;
    Ok(())
}

fn message(queue: &str, i: usize) -> OutboxMessage {
    OutboxMessage::from_parts(
        OutboxId::random(),
        queue.to_owned(),
        format!(r#"{{"order":{i},"cents":1200}}"#).into_bytes(),
        vec![("content-type".to_owned(), "application/json".to_owned())],
        None,
    )
}

/// One batch with what `AmqpPublisher` sends, without it: every publish, then every confirm.
async fn bare(ch: &Channel, batch: &[OutboxMessage]) -> Result<()> {
    let sends = batch.iter().map(|m| async move {
        let mut headers = FieldTable::default();
        for (k, v) in m.headers() {
            headers.insert(k.as_str().into(), AMQPValue::LongString(LongString::from(v.as_str())));
        }
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(m.id().as_str().into())
            .with_headers(headers);
        let options = BasicPublishOptions { mandatory: true, immediate: false };
        ch.basic_publish("".into(), m.destination().into(), options, m.payload(), props)
            .await?
            .await
    });
    for c in join_all(sends).await {
        match c? {
            Confirmation::Ack(None) => {}
            other => return Err(format!("not stored: {other:?}").into()),
        }
    }
    Ok(())
}
