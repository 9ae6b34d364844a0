//! Messages/s appended to a Redis stream: a bare pipelined `XADD` loop beside `StreamPublisher`,
//! in one run — the ceiling an outbox relay's publishing can reach on this server.
//!
//! `cargo run --release -p idem-redis --example redis_publish_bench -- [messages] [batch]`
//!
//! Both modes append N entries (`message_id`, `payload` and one header field each) to a fresh
//! stream, a batch per pipelined round trip, each `XADD` answered. The bare loop runs first and
//! last, so warm-up and machine noise show. Server: `IDEM_TEST_REDIS_URL` (default
//! `redis://127.0.0.1:6379/`).

use std::time::Instant;

use idem_core::outbox::{OutboxId, OutboxMessage, Publisher};
use idem_redis::StreamPublisher;
use redis::aio::ConnectionManager;
use redis::{AsyncCommands, RedisResult, Value};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(20_000);
    let batch: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(256);
    let url = std::env::var("IDEM_TEST_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379/".to_owned());
    let mut conn = redis::Client::open(url)?.get_connection_manager().await?;
    println!("Redis stream appends; {n} messages, batches of {batch}");
    for mode in ["bare XADD pipeline", "StreamPublisher", "bare XADD pipeline (again)"] {
        let stream = format!("idem-publish-bench-{:016x}", rand::random::<u64>());
        let messages: Vec<OutboxMessage> = (0..n).map(|i| message(&stream, i)).collect();
        let t = Instant::now();
        if mode == "StreamPublisher" {
            let publisher = StreamPublisher::new(conn.clone());
            for chunk in messages.chunks(batch) {
                for r in publisher.publish(chunk).await {
                    r?;
                }
            }
        } else {
            for chunk in messages.chunks(batch) {
                bare(&mut conn, chunk).await?;
            }
        }
        let secs = t.elapsed().as_secs_f64();
        #[allow(clippy::cast_precision_loss)]
        let rate = n as f64 / secs;
        println!("{mode:<28} {n} msgs in {secs:>6.2} s = {rate:>8.0} msgs/s");
        let _: i64 = conn.del(&stream).await?;
    }
    Ok(())
}

fn message(stream: &str, i: usize) -> OutboxMessage {
    OutboxMessage::from_parts(
        OutboxId::random(),
        stream.to_owned(),
        format!(r#"{{"order":{i},"cents":1200}}"#).into_bytes(),
        vec![("content-type".to_owned(), "application/json".to_owned())],
        None,
    )
}

/// One batch with what `StreamPublisher` sends, without it: one pipeline, each reply checked.
async fn bare(conn: &mut ConnectionManager, batch: &[OutboxMessage]) -> Result<()> {
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    for m in batch {
        let c = pipe.cmd("XADD").arg(m.destination()).arg("*");
        c.arg("message_id").arg(m.id().as_str()).arg("payload").arg(m.payload());
        for (k, v) in m.headers() {
            c.arg(k).arg(v);
        }
    }
    let replies: Vec<RedisResult<Value>> = pipe.query_async(conn).await?;
    for r in replies {
        r?;
    }
    Ok(())
}
