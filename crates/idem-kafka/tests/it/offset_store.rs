//! The offset inbox on each SQL database, decided through the engine with Kafka deliveries
//! built by hand (no broker): exactly once into a ledger, a redelivery skipped by its offset, a
//! crash before the commit leaving nothing, a failed message holding its partition back,
//! producer duplicates caught by markers — and, with markers off, run twice (what the docs say
//! an idempotent producer must prevent).
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_core::inbox::OffsetInbox;
use idem_core::{Engine, Outcome, OutcomeKind};
use idem_kafka::Delivery;

/// `n` messages of `topic`/`partition` from `start`, each read right after the one before it
/// (the first from `first_from`), with message ids `<prefix>-<offset>` and `body`.
fn run_of(
    topic: &str,
    partition: i32,
    start: i64,
    n: i64,
    first_from: Option<i64>,
    body: &[u8],
) -> Vec<Delivery> {
    (start..start + n)
        .map(|o| {
            let from = if o == start { first_from } else { Some(o) };
            Delivery::new(topic, partition, o, body.to_vec())
                .with_header("message-id", format!("{topic}-{partition}-{o}").as_bytes())
                .read_from(from)
        })
        .collect()
}

fn kinds<T, E>(outcomes: &[Outcome<T, E>]) -> Vec<OutcomeKind> {
    outcomes.iter().map(Outcome::kind).collect()
}

use OutcomeKind::{Duplicate as D, FailedTransient as W, Processed as P};

/// The suite, once per database: `$fixture` opens a store of the test's own with a ledger
/// table, and has `insert` (the handler's SQL, binding the message id), `ledger()` and
/// `positions()`.
macro_rules! offset_suite {
    ($db:ident, $fixture:path) => {
        mod $db {
            use super::*;

            fn handler(
                insert: String,
            ) -> impl Fn(
                idem_core::Tx<<$fixture as Fixture>::Inbox>,
                Delivery,
            ) -> std::pin::Pin<
                Box<dyn std::future::Future<Output = Result<(), HandlerError<String>>> + Send>,
            > + Sync {
                move |mut tx, d| {
                    let sql = insert.clone();
                    Box::pin(async move {
                        let id = d.message_id().unwrap_or_default().to_owned();
                        // Written first: a failure after it must roll it back.
                        sqlx::query(sqlx::AssertSqlSafe(sql))
                            .bind(id)
                            .execute(&mut *tx)
                            .await
                            .map_err(|e| HandlerError::Transient(e.to_string()))?;
                        match d.payload_bytes() {
                            b"fail" => Err(HandlerError::Transient("refused".to_owned())),
                            b"hang" => std::future::pending().await,
                            _ => Ok(()),
                        }
                    })
                }
            }

            async fn engine(
                f: &$fixture,
                markers: bool,
            ) -> Engine<OffsetInbox<<$fixture as Fixture>::Inbox>> {
                let inbox = OffsetInbox::new(f.inbox());
                let inbox = if markers { inbox } else { inbox.without_markers() };
                Engine::builder(inbox).scope("offsets").build().unwrap()
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn exactly_once_and_a_redelivery_is_known_by_its_offset() {
                let Some(f) = <$fixture>::open().await else { return };
                let e = engine(&f, true).await;
                let h = handler(f.insert());
                let mut batch = run_of("t", 0, 0, 5, None, b"ok");
                batch.extend(run_of("t", 1, 0, 3, None, b"ok"));
                assert_eq!(kinds(&e.decide_batch(&batch, &h).await), [P; 8]);
                // The group resumes from an older offset (a new assignment: `from` unknown).
                let again = run_of("t", 0, 2, 3, None, b"ok");
                assert_eq!(kinds(&e.decide_batch(&again, &h).await), [D; 3]);
                // And the next message after the stored position runs.
                let next = run_of("t", 0, 5, 1, Some(5), b"ok");
                assert_eq!(kinds(&e.decide_batch(&next, &h).await), [P]);
                assert!(f.ledger().await.iter().all(|(_, n)| *n == 1));
                assert_eq!(f.ledger().await.len(), 9);
                assert_eq!(
                    f.positions().await,
                    [("t".to_owned(), 0, Some(6)), ("t".to_owned(), 1, Some(3))]
                );
                f.close().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_crash_before_the_commit_leaves_nothing_and_the_redelivery_runs_once() {
                let Some(f) = <$fixture>::open().await else { return };
                let e = engine(&f, false).await;
                let h = handler(f.insert());
                let mut batch = run_of("t", 0, 0, 3, None, b"ok");
                batch.push(
                    Delivery::new("t", 0, 3, b"hang".to_vec())
                        .with_header("message-id", b"t-0-3")
                        .read_from(Some(3)),
                );
                // The process dies while the last handler runs: the transaction is dropped.
                let crashed =
                    tokio::time::timeout(Duration::from_secs(2), e.decide_batch(&batch, &h));
                assert!(crashed.await.is_err());
                assert!(f.ledger().await.is_empty(), "nothing committed");
                let redelivered = run_of("t", 0, 0, 4, None, b"ok");
                assert_eq!(kinds(&e.decide_batch(&redelivered, &h).await), [P; 4]);
                // The broker's offset was never committed: it delivers all four again.
                assert_eq!(kinds(&e.decide_batch(&redelivered, &h).await), [D; 4]);
                assert_eq!(f.ledger().await.len(), 4);
                assert!(f.ledger().await.iter().all(|(_, n)| *n == 1));
                f.close().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_failed_message_holds_its_partition_back_not_the_others() {
                let Some(f) = <$fixture>::open().await else { return };
                let e = engine(&f, true).await;
                let h = handler(f.insert());
                let mut batch = run_of("t", 0, 0, 4, None, b"ok");
                batch[1] = Delivery::new("t", 0, 1, b"fail".to_vec())
                    .with_header("message-id", b"t-0-1")
                    .read_from(Some(1));
                batch.extend(run_of("t", 1, 0, 2, None, b"ok"));
                let got = kinds(&e.decide_batch(&batch, &h).await);
                assert_eq!(got, [P, W, W, W, P, P], "1 failed; 2 and 3 wait for it");
                assert_eq!(f.positions().await[0], ("t".to_owned(), 0, Some(1)));
                // 3 comes back alone (retried sooner): it still waits for 1.
                let alone = &batch[3..4];
                assert_eq!(kinds(&e.decide_batch(alone, &h).await), [W]);
                // 1 succeeds on its retry; then 2 and 3 run, in offset order.
                let retry = run_of("t", 0, 1, 3, Some(1), b"ok");
                let rev: Vec<Delivery> = retry.into_iter().rev().collect();
                assert_eq!(kinds(&e.decide_batch(&rev, &h).await), [P; 3]);
                assert_eq!(f.ledger().await.len(), 6);
                assert!(
                    f.ledger().await.iter().all(|(_, n)| *n == 1),
                    "the failed run rolled back"
                );
                assert_eq!(f.positions().await[0], ("t".to_owned(), 0, Some(4)));
                f.close().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_producer_duplicate_is_caught_by_markers_in_their_window() {
                let Some(f) = <$fixture>::open().await else { return };
                let e = engine(&f, true).await;
                let h = handler(f.insert());
                let first = run_of("t", 0, 0, 1, None, b"ok");
                assert_eq!(kinds(&e.decide_batch(&first, &h).await), [P]);
                // The producer retried: the same id again, at offset 1, and at 2 in another
                // partition, plus a copy of it within one batch.
                let copy = |p: i32, o: i64| {
                    Delivery::new("t", p, o, b"ok".to_vec())
                        .with_header("message-id", b"t-0-0")
                        .read_from(Some(o))
                };
                let batch = vec![copy(0, 1), copy(1, 0).read_from(None), copy(0, 2)];
                assert_eq!(kinds(&e.decide_batch(&batch, &h).await), [D, D, D]);
                assert_eq!(f.ledger().await, [("t-0-0".to_owned(), 1)]);
                // Duplicates move the positions too.
                assert_eq!(
                    f.positions().await,
                    [("t".to_owned(), 0, Some(3)), ("t".to_owned(), 1, Some(1))]
                );
                f.close().await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn without_markers_a_republished_message_runs_twice() {
                let Some(f) = <$fixture>::open().await else { return };
                let e = engine(&f, false).await;
                let h = handler(f.insert());
                let first = run_of("t", 0, 0, 1, None, b"ok");
                assert_eq!(kinds(&e.decide_batch(&first, &h).await), [P]);
                let republished = Delivery::new("t", 0, 1, b"ok".to_vec())
                    .with_header("message-id", b"t-0-0")
                    .read_from(Some(1));
                assert_eq!(kinds(&e.decide_batch(&[republished], &h).await), [P]);
                assert_eq!(
                    f.ledger().await,
                    [("t-0-0".to_owned(), 2)],
                    "the producer must be idempotent"
                );
                f.close().await;
            }
        }
    };
}

/// A store of the test's own, with a ledger table without a unique key (a second effect of one
/// key shows as a second row).
trait Fixture: Sized {
    type Inbox: idem_core::inbox::TxPositions + Clone;
    async fn open() -> Option<Self>;
    fn inbox(&self) -> Self::Inbox;
    fn insert(&self) -> String;
    /// (key, rows) by key.
    async fn ledger(&self) -> Vec<(String, i64)>;
    /// (log, partition, next offset) of scope `offsets`, sorted.
    async fn positions(&self) -> Vec<(String, i32, Option<i64>)>;
    async fn close(self);
}

struct Pg {
    schema: common::PgSchema,
    store: idem_sqlx::PostgresStore,
}

impl Fixture for Pg {
    type Inbox = idem_sqlx::PostgresInbox;
    async fn open() -> Option<Self> {
        let url = common::pg_url()?;
        let (schema, store) =
            common::PgSchema::create(&url, format!("idem_offsets_{}", common::suffix())).await;
        Some(Self { schema, store })
    }
    fn inbox(&self) -> Self::Inbox {
        self.store.inbox(Duration::from_secs(3600))
    }
    fn insert(&self) -> String {
        format!("INSERT INTO {}.ledger (key) VALUES ($1)", self.schema.name)
    }
    async fn ledger(&self) -> Vec<(String, i64)> {
        let sql = format!(
            "SELECT key, count(*) FROM {}.ledger GROUP BY key ORDER BY key",
            self.schema.name
        );
        sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(&self.schema.pool).await.unwrap()
    }
    async fn positions(&self) -> Vec<(String, i32, Option<i64>)> {
        let sql = format!(
            "SELECT log, part, next_offset FROM {}.idem_records_positions WHERE scope = 'offsets' ORDER BY log, part",
            self.schema.name
        );
        sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(&self.schema.pool).await.unwrap()
    }
    async fn close(self) {
        self.schema.drop_now().await;
    }
}

struct My {
    store: idem_sqlx::MySqlStore,
    table: String,
}

impl Fixture for My {
    type Inbox = idem_sqlx::MySqlInbox;
    async fn open() -> Option<Self> {
        let url = idem_testkit::service::require(
            "MariaDB",
            "IDEM_TEST_MYSQL_URL",
            "mysql://root@127.0.0.1:3306/test",
        )?;
        let table = format!("idem_offsets_{}", common::suffix());
        let store =
            idem_sqlx::MySqlStore::connect(&url).await.unwrap().with_table_name(&table).unwrap();
        store.migrate().await.unwrap();
        let this = Self { store, table };
        this.exec(&format!("CREATE TABLE {}_ledger (`key` VARCHAR(200) NOT NULL)", this.table))
            .await;
        Some(this)
    }
    fn inbox(&self) -> Self::Inbox {
        self.store.inbox(Duration::from_secs(3600))
    }
    fn insert(&self) -> String {
        format!("INSERT INTO {}_ledger (`key`) VALUES (?)", self.table)
    }
    async fn ledger(&self) -> Vec<(String, i64)> {
        let sql = format!(
            "SELECT `key`, count(*) FROM {}_ledger GROUP BY `key` ORDER BY `key`",
            self.table
        );
        sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(self.store.pool()).await.unwrap()
    }
    async fn positions(&self) -> Vec<(String, i32, Option<i64>)> {
        let sql = format!(
            "SELECT log, part, next_offset FROM {}_positions WHERE scope = 'offsets' ORDER BY log, part",
            self.table
        );
        let rows: Vec<(Vec<u8>, i32, Option<i64>)> =
            sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(self.store.pool()).await.unwrap();
        rows.into_iter().map(|(l, p, o)| (String::from_utf8(l).unwrap(), p, o)).collect()
    }
    async fn close(self) {
        let t = &self.table;
        self.exec(&format!("DROP TABLE {t}, {t}_positions, {t}_ledger")).await;
    }
}

impl My {
    async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(self.store.pool())
            .await
            .unwrap();
    }
}

struct Lite {
    store: idem_sqlx::SqliteStore,
    _dir: tempfile::TempDir,
}

impl Fixture for Lite {
    type Inbox = idem_sqlx::SqliteInbox;
    async fn open() -> Option<Self> {
        let dir = tempfile::tempdir().unwrap();
        let store = idem_sqlx::SqliteStore::open(dir.path().join("o.sqlite")).await.unwrap();
        sqlx::raw_sql("CREATE TABLE ledger (key TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .unwrap();
        Some(Self { store, _dir: dir })
    }
    fn inbox(&self) -> Self::Inbox {
        self.store.inbox(Duration::from_secs(3600))
    }
    fn insert(&self) -> String {
        "INSERT INTO ledger (key) VALUES (?)".to_owned()
    }
    async fn ledger(&self) -> Vec<(String, i64)> {
        sqlx::query_as("SELECT key, count(*) FROM ledger GROUP BY key ORDER BY key")
            .fetch_all(self.store.pool())
            .await
            .unwrap()
    }
    async fn positions(&self) -> Vec<(String, i32, Option<i64>)> {
        let sql = format!(
            "SELECT log, part, next_offset FROM {}_positions WHERE scope = 'offsets' ORDER BY log, part",
            self.store.table()
        );
        sqlx::query_as(sqlx::AssertSqlSafe(sql)).fetch_all(self.store.pool()).await.unwrap()
    }
    async fn close(self) {}
}

offset_suite!(postgres, Pg);
offset_suite!(mariadb, My);
offset_suite!(sqlite, Lite);

/// A store migrated before the offset inbox existed has no positions table: the consumer's
/// build says which `migrate()` to run instead of failing at the first batch.
#[tokio::test]
async fn a_store_without_the_positions_table_is_refused_at_build() {
    let f = Lite::open().await.unwrap();
    let drop_it = format!("DROP TABLE {}_positions", f.store.table());
    sqlx::raw_sql(sqlx::AssertSqlSafe(drop_it)).execute(f.store.pool()).await.unwrap();
    let built = idem_core::Consumer::builder(idem_core::consumer::MemoryQueue::new())
        .offset_inbox(OffsetInbox::new(f.inbox()))
        .scope("offsets")
        .build()
        .await;
    match built {
        Err(idem_core::consumer::BuildError::Store(
            e @ idem_core::StoreError::NotMigrated { .. },
        )) => {
            assert!(e.to_string().contains("migrate()"), "{e}");
        }
        other => panic!("{:?}", other.map(|_| ())),
    }
}
