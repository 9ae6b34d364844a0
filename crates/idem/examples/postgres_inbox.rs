//! The transactional inbox on PostgreSQL: each message's dedup marker commits in the same
//! transaction as the order it writes, so a redelivery can never write it twice — and a reused
//! order id with different content is reported, not dropped.
//!
//! ```text
//! cargo run -p idem-consumer --features postgres --example postgres_inbox
//! ```
//! Uses `IDEM_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`) and its own
//! schema `idem_example`, dropped at the end.

use std::time::Duration;

use idem::engine::HandlerError;
use idem::{DedupKey, Fingerprint, Outcome, PostgresStore, TxInbox as _};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("IDEM_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned());
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&url).await?;
    sqlx::raw_sql("DROP SCHEMA IF EXISTS idem_example CASCADE").execute(&pool).await?;
    let store = PostgresStore::new(pool.clone()).with_schema("idem_example")?;
    store.migrate().await?;
    for warning in store.check().await? {
        println!("warning: {warning}");
    }
    sqlx::raw_sql(
        "CREATE TABLE idem_example.orders (order_id TEXT NOT NULL, cents BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let inbox = store.inbox(Duration::from_secs(7 * 86_400));

    // At-least-once delivery: o-2 arrives twice, o-3's id is reused with another amount.
    let deliveries = [("o-1", 1200), ("o-2", 500), ("o-2", 500), ("o-3", 990), ("o-3", 12_000)];
    let mut conflicts = 0;
    for (id, cents) in deliveries {
        let key = DedupKey::new("order-writer", id)?;
        let fp = Fingerprint::of_json(&serde_json::json!({ "id": id, "cents": cents }));
        let outcome = inbox
            .process(&key, Some(fp), |mut tx| async move {
                sqlx::query("INSERT INTO idem_example.orders VALUES ($1, $2)")
                    .bind(id)
                    .bind(cents)
                    .execute(&mut *tx) // the transaction the marker is in
                    .await
                    .map_err(HandlerError::Transient)?;
                Ok::<_, HandlerError<sqlx::Error>>(format!("stored {id} for {cents} cents"))
            })
            .await;
        match outcome {
            Outcome::Processed(r) => println!("{id:>4} {cents:>6}: processed ({r}); ack"),
            Outcome::Duplicate(r) => {
                println!("{id:>4} {cents:>6}: duplicate, first result {r:?}; ack without writing");
            }
            Outcome::Conflict(c) => {
                conflicts += 1;
                println!("{id:>4} {cents:>6}: CONFLICT: {c}; dead-letter");
            }
            other => return Err(format!("{id}: {:?}", other.verb()).into()),
        }
    }
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_example.orders").fetch_one(&pool).await?;
    println!("orders stored: {rows} (3 unique orders), conflicts reported: {conflicts}");
    sqlx::raw_sql("DROP SCHEMA idem_example CASCADE").execute(&pool).await?;
    if rows != 3 || conflicts != 1 {
        return Err("the inbox let a duplicate through or dropped the conflict".into());
    }
    Ok(())
}
