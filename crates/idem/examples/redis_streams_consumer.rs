//! Two competing consumers of a Redis stream, made idempotent by `RedisStore`.
//!
//! The producer writes 100 orders, 20 of them twice (a retried send) and one reusing an order
//! id with other content. Each order is charged exactly once, the reused id goes to the
//! dead-letter stream with its reason, and every entry ends acknowledged.
//!
//! ```text
//! cargo run -p idem --features redis --example redis_streams_consumer
//! ```
//! Reads `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379/`); deletes what it wrote.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::Consumer;
use idem::consumer::HandlerError;
use idem::extract::Envelope;
use idem::redis::redis::{self as client, AsyncCommands};
use idem::redis::{RedisStore, StreamConsumer, StreamEntry};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt().with_target(false).init();
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let run = format!("example-{}", std::process::id());
    let stream = format!("idem-example:{run}:orders");
    let client = client::Client::open(url.as_str())?;
    let mut conn = client.get_multiplexed_async_connection().await?;

    // The producer: retried sends write some orders twice; one id is reused with new content.
    let mut sent = 0;
    for i in 0..100u32 {
        let copies = if i % 5 == 0 { 2 } else { 1 };
        for _ in 0..copies {
            let body = format!(r#"{{"order":"o-{i}","cents":{}}}"#, 1000 + i);
            let _: String = conn
                .xadd(&stream, "*", &[("message_id", format!("o-{i}")), ("payload", body)])
                .await?;
            sent += 1;
        }
    }
    let _: String = conn
        .xadd(&stream, "*", &[("message_id", "o-7"), ("payload", r#"{"order":"o-7","cents":1}"#)])
        .await?;
    sent += 1;

    // Startup refuses an evicting maxmemory-policy and warns when persistence is off.
    let store = RedisStore::builder(&url)?.namespace(&run)?.connect().await?;
    let engine = Consumer::builder(store.clone())
        .scope("billing")
        .lease(Duration::from_secs(10))
        .retain(Duration::from_secs(3600))
        .build()?;

    let charges: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut workers = Vec::new();
    for n in 0..2 {
        let mut consumer = StreamConsumer::builder(client.clone(), engine.clone())
            .stream(&stream)
            .group("billing")
            .consumer_name(format!("billing-{n}"))
            .reclaim_idle(Duration::from_millis(500))
            .block(Duration::from_millis(200))
            .build()
            .await?;
        let charges = charges.clone();
        let mut stop = stop_rx.clone();
        workers.push(tokio::spawn(async move {
            let charge = move |ctx: idem::consumer::Context, entry: StreamEntry| {
                let charges = charges.clone();
                async move {
                    // A real handler would call the payment API with ctx.downstream_key() as
                    // its idempotency key.
                    let id = entry.message_id().unwrap_or_default().to_owned();
                    *charges.lock().expect("charges").entry(id).or_default() += 1;
                    Ok::<_, HandlerError<String>>(format!("charged at attempt {}", ctx.attempt()))
                }
            };
            consumer
                .run(charge, async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
        }));
    }

    // Wait until the group has read everything and nothing is pending.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info: client::streams::StreamInfoGroupsReply = conn.xinfo_groups(&stream).await?;
        let (pending, read) =
            info.groups.first().map_or((1, 0), |g| (g.pending, g.entries_read.unwrap_or(0)));
        if pending == 0 && read >= sent {
            break;
        }
        if Instant::now() > deadline {
            return Err("the consumers did not drain the stream in 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop_tx.send(true)?;
    let mut settled = idem::redis::Settled::default();
    for w in workers {
        settled += w.await??;
    }

    let (charged, twice) = {
        let charges = charges.lock().expect("charges");
        (charges.len(), charges.values().filter(|&&n| n > 1).count())
    };
    println!("entries sent: {sent}; orders charged: {charged}; charged twice: {twice}");
    println!(
        "acked {} (processed or duplicate), dead-lettered {}",
        settled.acked, settled.dead_lettered
    );
    let dead: client::streams::StreamRangeReply =
        conn.xrange_all(format!("{stream}:dead-letter")).await?;
    for e in &dead.ids {
        let reason: String = e.get("idem-reason").unwrap_or_default();
        println!("dead letter {}: {reason}", e.get::<String>("message_id").unwrap_or_default());
    }

    let _: i64 = conn.del(&[stream.clone(), format!("{stream}:dead-letter")]).await?;
    let keys: Vec<String> = conn.keys(format!("{}*", store.namespace().key_prefix())).await?;
    if !keys.is_empty() {
        let _: i64 = conn.del(keys).await?;
    }
    if twice > 0 || charged != 100 {
        return Err("exactly-once violated".into());
    }
    Ok(())
}
