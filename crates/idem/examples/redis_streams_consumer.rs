//! Two competing consumers of a Redis stream writing orders to PostgreSQL, idempotently: each
//! batch's order rows commit with their dedup markers in one transaction (the transactional
//! inbox), and only then are the entries acknowledged.
//!
//! The producer writes 100 orders, 20 of them twice (a retried send) and one reusing an order
//! id with other content. Each order is stored exactly once, the reused id goes to the
//! dead-letter stream with its reason, and every entry ends acknowledged.
//!
//! ```text
//! cargo run -p idem-consumer --features redis,postgres --example redis_streams_consumer
//! ```
//! Reads `IDEM_REDIS_URL` (default `redis://127.0.0.1:6379/`) and `IDEM_POSTGRES_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); deletes what it wrote (a schema of its own).

use std::time::{Duration, Instant};

use idem::engine::HandlerError;
use idem::extract::Envelope;
use idem::redis::redis::{self as client, AsyncCommands};
use idem::redis::{Delivery, StreamConfig, StreamConsumer};
use idem::{PostgresStore, sqlx};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    tracing_subscriber::fmt().with_target(false).init();
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let pg = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let run = format!("example_{}", std::process::id());
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

    // The store, and a table for the orders beside its markers.
    let store = PostgresStore::connect(&pg).await?.with_schema(&run)?;
    store.migrate().await?;
    let orders = format!("\"{run}\".orders");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE TABLE {orders} (id TEXT, body TEXT)")))
        .execute(store.pool())
        .await?;
    let insert = format!("INSERT INTO {orders} (id, body) VALUES ($1, $2)");
    let write = move |mut tx: idem::Tx<idem::PostgresInbox>, entry: Delivery| {
        let insert = insert.clone();
        async move {
            let id = entry.message_id().unwrap_or_default().to_owned();
            let body = String::from_utf8_lossy(entry.payload()).into_owned();
            sqlx::query(sqlx::AssertSqlSafe(insert))
                .bind(id)
                .bind(body)
                .execute(&mut *tx) // the same transaction as the dedup marker
                .await
                .map_err(|e| HandlerError::Transient(e.to_string()))?;
            Ok(())
        }
    };

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut workers = Vec::new();
    for n in 0..2 {
        // The whole consumer setup: the stream and group, the inbox, the scope.
        let config = StreamConfig::new(client.clone(), &stream, "order-writer", format!("w-{n}"));
        let consumer = StreamConsumer::builder(config.reclaim_idle(Duration::from_millis(500)))
            .inbox(store.inbox(Duration::from_secs(7 * 86_400)))
            .scope("order-writer")
            .idle_wait(Duration::from_millis(200))
            .build()
            .await?;
        let (write, mut stop) = (write.clone(), stop_rx.clone());
        workers.push(tokio::spawn(async move {
            consumer
                .run(write, async move {
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
    let mut report = idem::consumer::Report::default();
    for w in workers {
        report += w.await??;
    }

    let (stored, distinct): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT count(*), count(DISTINCT id) FROM {orders}"
    )))
    .fetch_one(store.pool())
    .await?;
    println!("entries sent: {sent}; orders stored: {stored} ({distinct} distinct)");
    println!("{report}");
    let dead: client::streams::StreamRangeReply =
        conn.xrange_all(format!("{stream}:dead-letter")).await?;
    for e in &dead.ids {
        let reason: String = e.get("idem-reason").unwrap_or_default();
        println!("dead letter {}: {reason}", e.get::<String>("message_id").unwrap_or_default());
    }

    let _: i64 = conn.del(&[stream.clone(), format!("{stream}:dead-letter")]).await?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{run}\" CASCADE")))
        .execute(store.pool())
        .await?;
    if stored != 100 || distinct != 100 || dead.ids.len() != 1 {
        return Err("exactly-once violated, or the conflict was not dead-lettered".into());
    }
    Ok(())
}
