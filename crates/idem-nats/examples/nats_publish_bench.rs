//! Messages/s published to JetStream with acks: a bare async-nats loop beside
//! `JetStreamPublisher`, in one run — the ceiling an outbox relay's publishing can reach on this
//! server.
//!
//! `cargo run --release -p idem-nats --example nats_publish_bench -- [messages] [batch]`
//!
//! Both modes publish N messages (a `Nats-Msg-Id` and one header each) to a fresh file-backed
//! stream, a batch at a time: the whole batch sent, then every publish ack awaited. The bare loop
//! runs first and last, so warm-up and machine noise show. Server: `IDEM_TEST_NATS_URL` (default
//! `127.0.0.1:4222`).

use std::time::Instant;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, Context, stream};
use futures_util::future::join_all;
use idem_core::outbox::{OutboxId, OutboxMessage, Publisher};
use idem_nats::{JetStreamPublisher, MSG_ID_HEADER};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(20_000);
    let batch: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(256);
    let url = std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".to_owned());
    let js = jetstream::new(async_nats::connect(&url).await?);
    println!("JetStream publish with acks; {n} messages, batches of {batch}");
    for mode in ["bare async-nats", "JetStreamPublisher", "bare async-nats (again)"] {
        let sfx = format!("{:016x}", rand::random::<u64>());
        let name = format!("BENCH_{sfx}");
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("bench.{sfx}")],
            ..Default::default()
        })
        .await?;
        let subject = format!("bench.{sfx}");
        let messages: Vec<OutboxMessage> = (0..n).map(|i| message(&subject, i)).collect();
        let t = Instant::now();
        if mode == "JetStreamPublisher" {
            let publisher = JetStreamPublisher::new(js.clone());
            for chunk in messages.chunks(batch) {
                for r in publisher.publish(chunk).await {
                    r?;
                }
            }
        } else {
            for chunk in messages.chunks(batch) {
                bare(&js, chunk).await?;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let rate = n as f64 / secs;
        println!("{mode:<24} {n} msgs in {secs:>6.2} s = {rate:>8.0} msgs/s");
        js.delete_stream(&name).await?;
    }
    Ok(())
}

fn message(subject: &str, i: usize) -> OutboxMessage {
    OutboxMessage::from_parts(
        OutboxId::random(),
        subject.to_owned(),
        format!(r#"{{"order":{i},"cents":1200}}"#).into_bytes(),
        vec![("content-type".to_owned(), "application/json".to_owned())],
        None,
    )
}

/// One batch with what `JetStreamPublisher` sends, without it: every publish, then every ack.
async fn bare(js: &Context, batch: &[OutboxMessage]) -> Result<()> {
    let mut acks = Vec::with_capacity(batch.len());
    for m in batch {
        let mut h = HeaderMap::new();
        for (k, v) in m.headers() {
            h.insert(k.as_str(), v.as_str());
        }
        h.insert(MSG_ID_HEADER, m.id().as_str());
        let payload = bytes::Bytes::copy_from_slice(m.payload());
        acks.push(js.publish_with_headers(m.destination().to_owned(), h, payload).await?);
    }
    for ack in join_all(acks.into_iter().map(std::future::IntoFuture::into_future)).await {
        ack?;
    }
    Ok(())
}
