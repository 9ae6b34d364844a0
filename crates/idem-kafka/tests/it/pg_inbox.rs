//! Inbox mode on a real Kafka-protocol broker (tansu) and PostgreSQL: one transaction per polled
//! batch. A message whose writes fail rolls back alone (its business row and its marker), a
//! second copy in the same batch is a duplicate, and the offsets reach the end once the retried
//! message commits.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{PgSchema, Topics};
use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_kafka::{KafkaConfig, KafkaConsumer};

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_message_rolls_back_alone_inside_the_batch_transaction() {
    let (Some(brokers), Some(pg)) = (common::brokers(), common::pg_url()) else { return };
    let sfx = common::suffix();
    let (topic, dlq, group) =
        (format!("idem-inbox-{sfx}"), format!("idem-inbox-{sfx}-dlq"), format!("g-{sfx}"));
    let _topics = Topics::create(&brokers, &[(&topic, 1), (&dlq, 1)]).await;
    // m-1 fails for good, m-2 fails once then succeeds, m-0 comes twice in the batch.
    let recs: Vec<(String, Vec<u8>)> = ["m-0", "m-1", "m-2", "m-0", "m-3"]
        .iter()
        .map(|id| ((*id).to_owned(), format!(r#"{{"id":"{id}"}}"#).into_bytes()))
        .collect();
    // Produced before the consumer starts, so the first poll takes them all in one batch.
    let ends = common::produce(&common::producer(&brokers), &topic, &recs, Some(0)).await;
    assert_eq!(ends[&0], 5);
    let (schema, store) = PgSchema::create(&pg, format!("idem_kafka_inbox_{sfx}")).await;

    let config = KafkaConfig::new(&common::config(&brokers, &group), &[topic.as_str()], &dlq)
        .batch_wait(Duration::from_millis(300))
        .retry_delay(Duration::from_millis(200));
    let c = KafkaConsumer::builder(config)
        .inbox(store.inbox(Duration::from_secs(86_400)))
        .scope("inbox")
        .idle_wait(Duration::from_millis(500))
        .build()
        .await
        .unwrap();
    let m2_attempts = Arc::new(AtomicUsize::new(0));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = {
        let (name, attempts) = (schema.name.clone(), Arc::clone(&m2_attempts));
        tokio::spawn(async move {
            c.run(
                move |mut tx, d| {
                    let (name, attempts) = (name.clone(), Arc::clone(&attempts));
                    async move {
                        let key = d.message_id().unwrap_or_default().to_owned();
                        // The row is written first, so a failure after it must roll it back.
                        sqlx::query(sqlx::AssertSqlSafe(format!(
                            "INSERT INTO {name}.ledger (key, body, who) VALUES ($1, $2, 'c')"
                        )))
                        .bind(&key)
                        .bind(d.payload_bytes())
                        .execute(&mut *tx)
                        .await
                        .map_err(|e| HandlerError::Transient(e.to_string()))?;
                        match key.as_str() {
                            "m-1" => Err(HandlerError::Permanent("m-1 is refused".to_owned())),
                            "m-2" if attempts.fetch_add(1, Ordering::SeqCst) == 0 => {
                                Err(HandlerError::Transient("m-2 not yet".to_owned()))
                            }
                            _ => Ok(key),
                        }
                    }
                },
                async move {
                    let _ = stopped.await;
                },
            )
            .await
            .unwrap()
        })
    };

    common::eventually(LIMIT, "all 5 offsets committed", || async {
        (common::committed(&brokers, &group, &topic, 1).await.get(&0) == Some(&5)).then_some(())
    })
    .await;
    let _ = stop.send(());
    let report = tokio::time::timeout(LIMIT, task).await.unwrap().unwrap();

    let rows: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT key, count(*) FROM {}.ledger GROUP BY key ORDER BY key",
        schema.name
    )))
    .fetch_all(&schema.pool)
    .await
    .unwrap();
    let rows: Vec<(&str, i64)> = rows.iter().map(|(k, n)| (k.as_str(), *n)).collect();
    assert_eq!(rows, [("m-0", 1), ("m-2", 1), ("m-3", 1)], "m-1's row rolled back, the rest once");
    assert_eq!(m2_attempts.load(Ordering::SeqCst), 2, "m-2 ran again after its transient failure");
    let refused = idem_core::DedupKey::new("inbox", "m-1").unwrap();
    assert!(
        idem_core::InspectStore::get(&store, &refused).await.unwrap().is_none(),
        "a permanently failed message leaves no marker"
    );
    assert_eq!((report.processed, report.duplicates), (3, 1), "{report:?}");
    assert!(report.dead_lettered >= 1 && report.retried >= 1, "{report:?}");
    let dead = common::read_all(&brokers, &dlq, 1).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].1["message-id"], "m-1");
    assert!(
        dead[0].1["idem-reason"].starts_with("handler failed: m-1 is refused"),
        "{:?}",
        dead[0].1
    );
    schema.drop_now().await;
}
