//! Concurrent histories against the SQL stores, checked for linearizability against the store
//! model (`idem_testkit::linearize`): SQLite on a fresh file, PostgreSQL in a fresh schema,
//! MySQL/MariaDB in a fresh table, each dropped afterwards. Every history runs in a scope of
//! its own, so one store serves them all.
//!
//! Every store passes the strict model: one `claim_many` is one atomic step (PostgreSQL and
//! MySQL decide it in one transaction holding the batch's row locks), a conflict carries the
//! key's current record, and the operator's `force_release` / `force_fail` run beside the rest.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::common;

use std::sync::Arc;

#[allow(unused_imports)]
use idem_core::{BatchConfig, Batched};
use idem_core::{DedupStore, InspectStore};
use idem_testkit::linearize::{Config, check_store};

async fn assert_linearizable<S: DedupStore + InspectStore>(name: &str, store: S, cfg: Config) {
    match check_store(Arc::new(store), &cfg).await {
        Ok(sum) => eprintln!("{name}: seed {} {sum:?}", cfg.seed),
        Err(v) => panic!("{name}: {v}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store_is_linearizable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = idem_sqlx::SqliteStore::open(dir.path().join("lin.sqlite"))
        .await
        .expect("open sqlite store");
    assert_linearizable("sqlite", store, Config::default()).await;
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    async fn run(cfg: Config, group_commit: bool) {
        let Some(url) = common::pg_url() else { return };
        let schema = common::unique("idem_lin");
        let _guard = common::DropSql {
            url: url.clone(),
            sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"),
        };
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .expect("connect to postgres");
        let store = idem_sqlx::PostgresStore::new(pool).with_schema(&schema).expect("valid schema");
        store.migrate().await.expect("migrate");
        if group_commit {
            let store = Batched::new(store, BatchConfig::default());
            assert_linearizable("postgres (group commit)", store, cfg).await;
        } else {
            assert_linearizable("postgres", store, cfg).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_store_is_linearizable() {
        run(Config::default(), false).await;
    }

    /// Completions through `Batched`: `complete_many`'s one statement must fence each lease.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_group_commit_is_linearizable() {
        run(Config::default(), true).await;
    }
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;

    async fn run(cfg: Config, group_commit: bool) {
        let Some(url) = common::mysql_url() else { return };
        let table = common::unique("lin");
        let _guard = common::DropSql {
            url: url.clone(),
            sql: format!("DROP TABLE IF EXISTS `{table}`, `{table}_positions`"),
        };
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .expect("connect to mysql");
        let store = idem_sqlx::MySqlStore::new(pool).with_table_name(&table).expect("valid table");
        store.migrate().await.expect("migrate");
        if group_commit {
            let store = Batched::new(store, BatchConfig::default());
            assert_linearizable("mysql (group commit)", store, cfg).await;
        } else {
            assert_linearizable("mysql", store, cfg).await;
        }
    }

    /// Operator operations included: a claim's upsert and its read-back are one transaction,
    /// so a `force_release` cannot land between them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_store_is_linearizable() {
        run(Config::default(), false).await;
    }

    /// Completions through `Batched` (`complete_many`). It used to answer `Ok` to a spent lease
    /// completing again (any row completed with the lease's token counted as applied); it now
    /// tells the rows this batch's statement changed by their `updated_at`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mysql_group_commit_is_linearizable() {
        run(Config::default(), true).await;
    }
}
