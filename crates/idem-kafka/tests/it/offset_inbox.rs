//! The offset inbox on a real Kafka-protocol broker (tansu) and PostgreSQL: exactly once into a
//! ledger, one position row per partition, a group that starts over from offset 0 skipping
//! everything by offset, and one that seeks to the stored positions reading nothing again.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{PgSchema, Topics};
use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_core::inbox::OffsetInbox;
use idem_kafka::{Delivery, KafkaConfig, KafkaConsumer};
use idem_sqlx::PostgresInbox;

const LIMIT: Duration = Duration::from_secs(60);
const PARTITIONS: i32 = 3;

/// Runs a consumer of `group` over `inbox` until `settled` messages settled; the report.
async fn consume(
    brokers: &str,
    topic: &str,
    group: &str,
    inbox: OffsetInbox<PostgresInbox>,
    seek: bool,
    ledger: &str,
    settled: usize,
) -> idem_core::consumer::Report {
    let mut config =
        KafkaConfig::new(&common::config(brokers, group), &[topic], format!("{topic}-dlq"))
            .batch_wait(Duration::from_millis(50))
            .retry_delay(Duration::from_millis(200));
    if seek {
        config = config.stored_positions(inbox.clone());
    }
    let count = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&count);
    let c = KafkaConsumer::builder(config)
        .offset_inbox(inbox)
        .scope("offsets")
        .batch(16)
        .idle_wait(Duration::from_millis(200))
        .on_settle(move |s| {
            if s.verb == &idem_core::engine::Verb::Ack {
                seen.fetch_add(1, Ordering::SeqCst);
            }
        })
        .build()
        .await
        .unwrap();
    let insert = format!("INSERT INTO {ledger} (key, body, who) VALUES ($1, $2, 'c')");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        c.run(
            move |mut tx, d: Delivery| {
                let sql = insert.clone();
                async move {
                    sqlx::query(sqlx::AssertSqlSafe(sql))
                        .bind(d.message_id().unwrap_or_default().to_owned())
                        .bind(d.payload_bytes().to_vec())
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| HandlerError::Transient(e.to_string()))?;
                    Ok::<_, HandlerError<String>>(())
                }
            },
            async move {
                let _ = stopped.await;
            },
        )
        .await
        .unwrap()
    });
    common::eventually(LIMIT, "every message settled", || async {
        (count.load(Ordering::SeqCst) >= settled).then_some(())
    })
    .await;
    let _ = stop.send(());
    tokio::time::timeout(LIMIT, task).await.unwrap().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_and_positions_replace_the_group_offsets() {
    let (Some(brokers), Some(pg)) = (common::brokers(), common::pg_url()) else { return };
    let sfx = common::suffix();
    let topic = format!("idem-offsets-{sfx}");
    let _topics =
        Topics::create(&brokers, &[(&topic, PARTITIONS), (&format!("{topic}-dlq"), 1)]).await;
    // 60 messages, 12 of them a producer's second copy of an earlier id (another offset).
    let recs: Vec<(String, Vec<u8>)> = (0..60)
        .map(|i| {
            let id = format!("m-{}", if i < 48 { i } else { i - 48 });
            (id.clone(), format!(r#"{{"id":"{id}"}}"#).into_bytes())
        })
        .collect();
    common::produce(&common::producer(&brokers), &topic, &recs, None).await;
    let (schema, store) = PgSchema::create(&pg, format!("idem_kafka_offsets_{sfx}")).await;
    let ledger = format!("{}.ledger", schema.name);
    let inbox = OffsetInbox::new(store.inbox(Duration::from_secs(3600)));

    let first =
        consume(&brokers, &topic, &format!("g1-{sfx}"), inbox.clone(), true, &ledger, 60).await;
    assert_eq!((first.processed, first.duplicates), (48, 12), "{first:?}");
    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT key, count(*) FROM {ledger} GROUP BY key"
    )))
    .fetch_all(&schema.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 48);
    assert!(rows.iter().all(|(_, n)| *n == 1), "each id once");
    let positions: Vec<(i32, Option<i64>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT part, next_offset FROM {}.idem_records_positions WHERE scope = 'offsets' ORDER BY part",
        schema.name
    )))
    .fetch_all(&schema.pool)
    .await
    .unwrap();
    assert_eq!(positions.len(), 3, "one row per partition: {positions:?}");
    let ends = common::committed(&brokers, &format!("g1-{sfx}"), &topic, PARTITIONS).await;
    for (p, next) in &positions {
        assert_eq!(ends.get(p).copied(), *next, "the group's offset follows the stored one");
    }

    // A new group of the same scope, not seeking: it reads from offset 0 (as after a lost
    // offset commit) and every message is a duplicate by its offset.
    let replay =
        consume(&brokers, &topic, &format!("g2-{sfx}"), inbox.clone(), false, &ledger, 60).await;
    assert_eq!((replay.processed, replay.duplicates), (0, 60), "{replay:?}");

    // One message more; a third group that seeks to the stored positions reads only it.
    common::produce(
        &common::producer(&brokers),
        &topic,
        &[("m-60".to_owned(), b"{}".to_vec())],
        None,
    )
    .await;
    let sought =
        consume(&brokers, &topic, &format!("g3-{sfx}"), inbox.clone(), true, &ledger, 1).await;
    assert_eq!((sought.processed, sought.duplicates), (1, 0), "{sought:?}");
    let total: i64 =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {ledger}")))
            .fetch_one(&schema.pool)
            .await
            .unwrap();
    assert_eq!(total, 49);
    schema.drop_now().await;
}
