//! An inbox handler writes and enqueues in one closure: its outgoing messages commit with its
//! marker, vanish with a rollback, and keep their ids when the handler runs again.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_core::consumer::{MemoryDelivery, MemoryQueue};
use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_core::outbox::{OutboxId, OutboxStore, Outgoing};
use idem_core::{Consumer, DedupKey};

const WEEK: Duration = Duration::from_secs(7 * 86_400);

/// Ten orders (o-1 delivered twice), a batch of 8; o-3 fails once after enqueueing, so its
/// batch rolls back and runs again message by message; o-9 fails for good.
fn queue() -> MemoryQueue {
    let q = MemoryQueue::new();
    for i in 0..10 {
        q.push(format!("o-{i}"), format!("order {i}"));
        if i == 1 {
            q.push("o-1", "order 1");
        }
    }
    q
}

/// The ids the handler must have enqueued: two per processed order, derived from its key.
fn expected(scope: &str) -> HashSet<OutboxId> {
    (0..9)
        .flat_map(|i| {
            let key = DedupKey::new(scope, format!("o-{i}")).unwrap();
            [OutboxId::derived(&key, 0), OutboxId::derived(&key, 1)]
        })
        .collect()
}

macro_rules! handler_case {
    ($name:ident, $db:ty, $make:expr, $outbox:expr) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            let Some((store, _guard)) = $make.await else { return };
            let outbox = ($outbox)(&store);
            outbox.migrate().await.unwrap();
            let q = queue();
            let consumer = Consumer::builder(q.clone())
                .inbox(store.inbox(WEEK))
                .scope("order-writer")
                .batch(8)
                .idle_wait(Duration::from_millis(20))
                .build()
                .await
                .unwrap();
            let failed_once = Arc::new(AtomicBool::new(false));
            let handler = |mut tx: idem_core::Tx<$db>, m: MemoryDelivery| {
                let (outbox, failed_once) = (outbox.clone(), Arc::clone(&failed_once));
                async move {
                    let id = m.message_id().unwrap_or_default().to_owned();
                    let fail =
                        |e: idem_core::outbox::OutboxError| HandlerError::Transient(e.to_string());
                    outbox
                        .enqueue(&mut tx, Outgoing::new("orders.accepted", id.clone()))
                        .await
                        .map_err(fail)?;
                    outbox
                        .enqueue(
                            &mut tx,
                            Outgoing::new("billing.charge", id.clone()).ordering_key("billing"),
                        )
                        .await
                        .map_err(fail)?;
                    if id == "o-3" && !failed_once.swap(true, Ordering::SeqCst) {
                        return Err(HandlerError::Transient("first attempt fails".to_owned()));
                    }
                    if id == "o-9" {
                        return Err(HandlerError::Permanent("never works".to_owned()));
                    }
                    Ok::<_, HandlerError<String>>(())
                }
            };
            let report =
                tokio::time::timeout(Duration::from_secs(60), consumer.run(handler, q.drained()))
                    .await
                    .expect("the queue drains")
                    .unwrap();
            assert_eq!((report.processed, report.duplicates), (9, 1), "{report}");
            assert_eq!(report.failed_permanent, 1, "{report}");
            // Every processed order's two messages, under ids derived from its key; nothing
            // from the rolled-back first run of o-3 or from o-9.
            let relay_view = outbox.claim(100, Duration::from_secs(30)).await.unwrap();
            let mut ids: HashSet<OutboxId> = HashSet::new();
            let mut all = 0;
            let mut more = relay_view;
            while !more.is_empty() {
                all += more.len();
                ids.extend(more.iter().map(|p| p.message.id().clone()));
                let t: Vec<_> = more.iter().map(|p| p.ticket).collect();
                outbox.mark_sent(&t).await.unwrap();
                more = outbox.claim(100, Duration::from_secs(30)).await.unwrap();
            }
            assert_eq!(all, 18, "two messages per processed order, once each");
            assert_eq!(ids, expected("order-writer"));
        }
    };
}

#[cfg(feature = "sqlite")]
handler_case!(
    sqlite_handler_enqueues_with_its_writes,
    idem_sqlx::SqliteInbox,
    async {
        let dir = tempfile::tempdir().unwrap();
        let store = idem_sqlx::SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
        Some((store, dir))
    },
    |s: &idem_sqlx::SqliteStore| s.outbox()
);

#[cfg(feature = "postgres")]
handler_case!(
    postgres_handler_enqueues_with_its_writes,
    idem_sqlx::PostgresInbox,
    async {
        let url = common::pg_url()?;
        let schema = common::unique("idem_obh");
        let pool =
            sqlx::postgres::PgPoolOptions::new().max_connections(8).connect(&url).await.unwrap();
        let store = idem_sqlx::PostgresStore::new(pool).with_schema(&schema).unwrap();
        store.migrate().await.unwrap();
        let guard =
            common::DropSql { url, sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
        Some((store, guard))
    },
    |s: &idem_sqlx::PostgresStore| s.outbox()
);

#[cfg(feature = "mysql")]
handler_case!(
    mysql_handler_enqueues_with_its_writes,
    idem_sqlx::MySqlInbox,
    async {
        let url = common::mysql_url()?;
        let table = common::unique("obh");
        let pool =
            sqlx::mysql::MySqlPoolOptions::new().max_connections(8).connect(&url).await.unwrap();
        let store = idem_sqlx::MySqlStore::new(pool).with_table_name(&table).unwrap();
        store.migrate().await.unwrap();
        let guard = common::DropSql {
            url,
            sql: format!("DROP TABLE IF EXISTS `{table}`, `{table}_outbox`, `{table}_positions`"),
        };
        Some((store, guard))
    },
    |s: &idem_sqlx::MySqlStore| s
        .outbox()
        .with_table_name(&format!("{}_outbox", s.table()))
        .unwrap()
);
