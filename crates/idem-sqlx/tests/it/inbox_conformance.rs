//! The transactional-inbox and offset-inbox conformance suites
//! (`idem_testkit::tx_inbox_conformance!`, `idem_testkit::tx_positions_conformance!`) on each
//! SQL database: SQLite on a file, PostgreSQL in a schema of its own, MariaDB in tables of their
//! own — all dropped afterwards.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::common;

use std::future::Future;
use std::time::Duration;

use idem_testkit::inbox::{BoxFuture, Conn, InboxHarness};

const WEEK: Duration = Duration::from_secs(7 * 86_400);

/// Polls `probe` until it answers true, or panics after 10 s.
async fn until<F: Future<Output = bool>>(what: &str, mut probe: impl FnMut() -> F) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !probe().await {
        assert!(tokio::time::Instant::now() < deadline, "{what} never happened");
        tokio::task::yield_now().await;
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use idem_sqlx::{SqliteInbox, SqliteStore};
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

    pub(crate) struct Sqlite {
        store: SqliteStore,
        _dir: tempfile::TempDir,
    }

    pub(crate) async fn harness() -> Option<Sqlite> {
        let dir = tempfile::tempdir().unwrap();
        let opts = SqliteConnectOptions::new()
            .filename(dir.path().join("inbox.sqlite"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new().max_connections(4).connect_with(opts).await.unwrap();
        let store = SqliteStore::new(pool);
        store.migrate().await.unwrap();
        sqlx::query("CREATE TABLE ledger (order_id TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .unwrap();
        Some(Sqlite { store, _dir: dir })
    }

    impl InboxHarness for Sqlite {
        type Store = SqliteStore;
        type Inbox = SqliteInbox;

        fn store(&self) -> &SqliteStore {
            &self.store
        }

        fn inbox(&self) -> SqliteInbox {
            self.store.inbox(WEEK)
        }

        fn write<'c>(
            &'c self,
            conn: &'c mut Conn<Self>,
            id: &'c str,
        ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::query("INSERT INTO ledger VALUES (?)").bind(id).execute(conn).await?;
                Ok(())
            })
        }

        fn ledger_rows(&self) -> BoxFuture<'_, i64> {
            Box::pin(async move {
                sqlx::query_scalar("SELECT count(*) FROM ledger")
                    .fetch_one(self.store.pool())
                    .await
                    .unwrap()
            })
        }

        /// SQLite shows no lock waits: a second connection checked out while the first holds
        /// the write lock can only be waiting in `BEGIN IMMEDIATE`.
        fn wait_until_blocked(&self) -> BoxFuture<'_, ()> {
            let pool = self.store.pool();
            Box::pin(until("a second connection in use", move || async move {
                pool.size() - u32::try_from(pool.num_idle()).unwrap_or(0) >= 2
            }))
        }
    }

    idem_testkit::tx_inbox_conformance!(harness);
    idem_testkit::tx_positions_conformance!(harness);
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use idem_sqlx::{PostgresInbox, PostgresStore};
    use sqlx::postgres::PgPoolOptions;

    pub(crate) struct Pg {
        store: PostgresStore,
        schema: String,
        _drop: common::DropSql,
    }

    pub(crate) async fn harness() -> Option<Pg> {
        let url = common::pg_url()?;
        let schema = common::unique("idem_inbox");
        let pool = PgPoolOptions::new().max_connections(16).connect(&url).await.unwrap();
        let store = PostgresStore::new(pool).with_schema(&schema).unwrap();
        store.migrate().await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE \"{schema}\".ledger (order_id TEXT NOT NULL)"
        )))
        .execute(store.pool())
        .await
        .unwrap();
        let drop =
            common::DropSql { url, sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
        Some(Pg { store, schema, _drop: drop })
    }

    impl InboxHarness for Pg {
        type Store = PostgresStore;
        type Inbox = PostgresInbox;

        fn store(&self) -> &PostgresStore {
            &self.store
        }

        fn inbox(&self) -> PostgresInbox {
            self.store.inbox(WEEK)
        }

        fn write<'c>(
            &'c self,
            conn: &'c mut Conn<Self>,
            id: &'c str,
        ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
            let sql = format!("INSERT INTO \"{}\".ledger VALUES ($1)", self.schema);
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id).execute(conn).await?;
                Ok(())
            })
        }

        fn ledger_rows(&self) -> BoxFuture<'_, i64> {
            let sql = format!("SELECT count(*) FROM \"{}\".ledger", self.schema);
            Box::pin(async move {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .fetch_one(self.store.pool())
                    .await
                    .unwrap()
            })
        }

        fn wait_until_blocked(&self) -> BoxFuture<'_, ()> {
            let probe = format!(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                 AND query LIKE '%\"{}\"%'",
                self.schema
            );
            let pool = self.store.pool();
            Box::pin(until("a mark waiting on a row lock", move || {
                let probe = probe.clone();
                async move {
                    let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(probe))
                        .fetch_one(pool)
                        .await
                        .unwrap();
                    n > 0
                }
            }))
        }
    }

    idem_testkit::tx_inbox_conformance!(harness);
    idem_testkit::tx_positions_conformance!(harness);
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use idem_sqlx::{MySqlInbox, MySqlStore};
    use sqlx::mysql::MySqlPoolOptions;

    pub(crate) struct My {
        store: MySqlStore,
        table: String,
        _drop: common::DropSql,
    }

    pub(crate) async fn harness() -> Option<My> {
        let url = common::mysql_url()?;
        let table = common::unique("inbox");
        let pool = MySqlPoolOptions::new().max_connections(16).connect(&url).await.unwrap();
        let store = MySqlStore::new(pool).with_table_name(&table).unwrap();
        store.migrate().await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE `{table}_ledger` (order_id VARCHAR(64) NOT NULL)"
        )))
        .execute(store.pool())
        .await
        .unwrap();
        let drop = common::DropSql {
            url,
            sql: format!("DROP TABLE IF EXISTS `{table}`, `{table}_ledger`, `{table}_positions`"),
        };
        Some(My { store, table, _drop: drop })
    }

    impl InboxHarness for My {
        type Store = MySqlStore;
        type Inbox = MySqlInbox;

        fn store(&self) -> &MySqlStore {
            &self.store
        }

        fn inbox(&self) -> MySqlInbox {
            self.store.inbox(WEEK)
        }

        fn write<'c>(
            &'c self,
            conn: &'c mut Conn<Self>,
            id: &'c str,
        ) -> BoxFuture<'c, Result<(), sqlx::Error>> {
            let sql = format!("INSERT INTO `{}_ledger` VALUES (?)", self.table);
            Box::pin(async move {
                sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id).execute(conn).await?;
                Ok(())
            })
        }

        fn ledger_rows(&self) -> BoxFuture<'_, i64> {
            let sql = format!("SELECT count(*) FROM `{}_ledger`", self.table);
            Box::pin(async move {
                sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .fetch_one(self.store.pool())
                    .await
                    .unwrap()
            })
        }

        fn wait_until_blocked(&self) -> BoxFuture<'_, ()> {
            let probe = "SELECT CAST(trx_query AS CHAR) FROM information_schema.innodb_trx \
                         WHERE CAST(trx_state AS CHAR) = 'LOCK WAIT'";
            Box::pin(async move {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
                loop {
                    let waiting: Vec<Option<String>> =
                        sqlx::query_scalar(probe).fetch_all(self.store.pool()).await.unwrap();
                    if waiting.iter().flatten().any(|q| q.contains(&self.table)) {
                        return;
                    }
                    assert!(tokio::time::Instant::now() < deadline, "no mark waited on a lock");
                    // InnoDB refreshes its information_schema lock cache only when it was not
                    // read in the last 100 ms: polling faster reads the same stale snapshot.
                    tokio::time::sleep(Duration::from_millis(150)).await;
                }
            })
        }
    }

    idem_testkit::tx_inbox_conformance!(harness);
    idem_testkit::tx_positions_conformance!(harness);
}
