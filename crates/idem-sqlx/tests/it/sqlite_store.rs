//! The SQLite version guard and identifier checks on real database files.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::time::Duration;

use idem_core::inbox::TxInbox;
use idem_core::{Advance, Claim, DedupKey, VersionGuard};
use idem_sqlx::SqliteStore;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

const WEEK: Duration = Duration::from_secs(7 * 86_400);

/// A store whose pool has `conns` connections (two lets transactions really contend).
async fn store(conns: u32) -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let opts = SqliteConnectOptions::new()
        .filename(dir.path().join("inbox.sqlite"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePoolOptions::new().max_connections(conns).connect_with(opts).await.unwrap();
    let store = SqliteStore::new(pool);
    store.migrate().await.unwrap();
    (store, dir)
}

fn key(id: &str) -> DedupKey {
    DedupKey::new("ledger-writer", id).unwrap()
}

#[tokio::test]
async fn version_guard_rejects_stale_and_equal_versions() {
    let (store, _dir) = store(1).await;
    let entity = DedupKey::new("customer-state", "c-1").unwrap();
    assert_eq!(store.advance(&entity, 3).await.unwrap(), Advance::Applied);
    assert_eq!(store.advance(&entity, 2).await.unwrap(), Advance::Stale { current: 3 });
    assert_eq!(store.advance(&entity, 3).await.unwrap(), Advance::Stale { current: 3 });
    assert_eq!(store.advance(&entity, 7).await.unwrap(), Advance::Applied);
    // Inside a transaction: the state write and the version commit together.
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(store.advance_in(&mut tx, &entity, 9).await.unwrap(), Advance::Applied);
    tx.rollback().await.unwrap();
    assert_eq!(
        store.advance(&entity, 8).await.unwrap(),
        Advance::Applied,
        "rolled-back 9 must not count"
    );
}

#[tokio::test]
async fn table_names_are_validated() {
    let (store, _dir) = store(1).await;
    for bad in ["records; DROP TABLE ledger", "1x", "a-b", "\"quoted\"", ""] {
        let err = store.clone().with_table_name(bad).unwrap_err();
        assert!(err.to_string().contains("table name"), "{err}");
    }
    let err = store.clone().with_table_name(&"t".repeat(64)).unwrap_err();
    assert!(err.to_string().contains("longer than the limit of 63 bytes"), "{err}");
    let custom = store.clone().with_table_name("shop_dedup").unwrap();
    custom.migrate().await.unwrap();
    custom.migrate().await.unwrap(); // idempotent
    assert!(custom.schema().contains("CREATE TABLE IF NOT EXISTS shop_dedup"));
}

/// Keys differing only in case or a trailing space are distinct records.
#[tokio::test]
async fn keys_are_compared_by_hash_not_collation() {
    let (store, _dir) = store(1).await;
    let inbox = store.inbox(WEEK);
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    for id in ["Order-1", "order-1", "order-1 "] {
        let claim = inbox.mark(&mut tx, &key(id), None).await.unwrap();
        assert!(matches!(claim, Claim::Acquired(_)), "{id:?}: {claim:?}");
    }
    tx.commit().await.unwrap();
}

/// Processes that open one new database file at the same moment (an application and its relay
/// starting together, two relays) all get a store: while one turns the file into a WAL database
/// and creates the tables, SQLite answers the others "database is locked" at once, without
/// waiting in its busy handler, and the open tries again. Eight opens at once, in ten new files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_opens_of_one_new_file_at_once_all_succeed() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..10 {
        let file = dir.path().join(format!("shared-{round}.sqlite"));
        // As `idem relay` finds it: the file exists and is empty.
        std::fs::File::create(&file).unwrap();
        let opens = (0..8).map(|_| {
            let file = file.clone();
            tokio::spawn(async move {
                let store = SqliteStore::open(&file).await?;
                store.outbox().migrate().await?;
                Ok::<_, idem_core::StoreError>(())
            })
        });
        for (n, open) in futures_util::future::join_all(opens).await.into_iter().enumerate() {
            open.unwrap().unwrap_or_else(|e| panic!("round {round}, open {n}: {e}"));
        }
    }
}
