//! PostgreSQL's outbox wakes waiting relays on commit (`LISTEN/NOTIFY`), not at the next poll.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use crate::common;

use std::time::{Duration, Instant};

use idem_core::outbox::{OutboxStore, Outgoing};
use idem_sqlx::PostgresStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_relay_wakes_when_an_enqueue_commits() {
    let Some(url) = common::pg_url() else { return };
    let schema = common::unique("idem_pgob");
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&url).await.unwrap();
    let _guard =
        common::DropSql { url, sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
    let store = PostgresStore::new(pool).with_schema(&schema).unwrap();
    let outbox = store.outbox();
    outbox.migrate().await.unwrap();
    assert!(outbox.channel().len() <= 63, "a channel name is an identifier");

    // The first wait starts listening; nothing is committed, so it waits its whole time.
    let t = Instant::now();
    outbox.wait_for_work(Duration::from_millis(300)).await;
    assert!(t.elapsed() >= Duration::from_millis(250), "woke with nothing committed");
    assert!(outbox.claim(10, Duration::from_secs(30)).await.unwrap().is_empty());

    // A commit while waiting 30 s wakes the waiter within moments.
    let waiter = {
        let outbox = outbox.clone();
        tokio::spawn(async move {
            let t = Instant::now();
            outbox.wait_for_work(Duration::from_secs(30)).await;
            t.elapsed()
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await; // let it wait first (not a sync point: either order passes)
    let mut tx = store.pool().begin().await.unwrap();
    outbox.enqueue(&mut tx, Outgoing::new("q", "x")).await.unwrap();
    tx.commit().await.unwrap();
    let waited = tokio::time::timeout(Duration::from_secs(10), waiter).await.unwrap().unwrap();
    assert!(waited < Duration::from_secs(5), "woke after {waited:?}, not on the commit");

    // A commit between a claim and the next wait is not slept through.
    assert_eq!(outbox.claim(10, Duration::from_secs(30)).await.unwrap().len(), 1);
    outbox.send(vec![Outgoing::new("q", "y")]).await.unwrap();
    idem_testkit::wait_for("the notification", Duration::from_secs(5), || async {
        let t = Instant::now();
        outbox.wait_for_work(Duration::from_millis(400)).await;
        t.elapsed() < Duration::from_millis(300)
    })
    .await;
    assert_eq!(outbox.claim(10, Duration::from_secs(30)).await.unwrap().len(), 1);
}
