//! The SQLite transactional inbox, version guard and identifier checks on real database files.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_core::{Advance, DedupKey, Fingerprint, InspectStore, RecordState, VersionGuard};
use idem_sqlx::{InboxError, InboxOutcome, Mark, SqliteStore};
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
    sqlx::query("CREATE TABLE ledger (order_id TEXT NOT NULL, cents INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    (store, dir)
}

async fn ledger_rows(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger").fetch_one(store.pool()).await.unwrap()
}

fn key(id: &str) -> DedupKey {
    DedupKey::new("ledger-writer", id).unwrap()
}

#[tokio::test]
async fn rollback_leaves_no_marker() {
    let (store, _dir) = store(1).await;
    let inbox = store.inbox(WEEK);
    let k = key("o-1");
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(inbox.mark(&mut tx, &k, None).await.unwrap(), Mark::First);
    sqlx::query("INSERT INTO ledger VALUES ('o-1', 5)").execute(&mut *tx).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(store.get(&k).await.unwrap().is_none(), "rolled back marker must not exist");
    assert_eq!(ledger_rows(&store).await, 0);
    // The redelivery is first again.
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(inbox.mark(&mut tx, &k, None).await.unwrap(), Mark::First);
    tx.commit().await.unwrap();
    assert_eq!(store.get(&k).await.unwrap().unwrap().state, RecordState::Completed);
}

/// Two transactions mark the same key: the second waits on the write lock, then sees the first's
/// committed marker — or is first itself when the first rolled back.
#[tokio::test]
async fn concurrent_mark_waits_then_sees_the_outcome() {
    for commit_first in [true, false] {
        let (store, _dir) = store(2).await;
        let inbox = store.inbox(WEEK);
        let k = key("o-1");
        let mut tx1 = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
        assert_eq!(inbox.mark(&mut tx1, &k, None).await.unwrap(), Mark::First);
        let first_done = Arc::new(AtomicBool::new(false));
        let second = {
            let (store, inbox, k, first_done) =
                (store.clone(), inbox.clone(), k.clone(), first_done.clone());
            tokio::spawn(async move {
                let mut tx2 = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
                let mark = inbox.mark(&mut tx2, &k, None).await.unwrap();
                let waited = first_done.load(Ordering::SeqCst);
                tx2.commit().await.unwrap();
                (mark, waited)
            })
        };
        first_done.store(true, Ordering::SeqCst);
        if commit_first {
            tx1.commit().await.unwrap()
        } else {
            tx1.rollback().await.unwrap()
        }
        let (mark, waited) =
            tokio::time::timeout(Duration::from_secs(10), second).await.unwrap().unwrap();
        assert!(waited, "the second transaction must not decide before the first ends");
        if commit_first {
            assert!(matches!(mark, Mark::Duplicate(_)), "{mark:?}");
        } else {
            assert_eq!(mark, Mark::First);
        }
    }
}

#[tokio::test]
async fn reused_key_with_other_content_is_a_conflict() {
    let (store, _dir) = store(1).await;
    let inbox = store.inbox(WEEK);
    let k = key("o-1");
    let (a, b) = (Fingerprint::of_bytes(b"a"), Fingerprint::of_bytes(b"b"));
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    assert_eq!(inbox.mark(&mut tx, &k, Some(a)).await.unwrap(), Mark::First);
    tx.commit().await.unwrap();
    let mut tx = store.pool().begin_with("BEGIN IMMEDIATE").await.unwrap();
    match inbox.mark(&mut tx, &k, Some(b)).await.unwrap() {
        Mark::Conflict(rec) => assert_eq!(rec.fingerprint, Some(a)),
        other => panic!("{other:?}"),
    }
}

/// `process` runs the writes once, stores their result with the marker and replays it.
#[tokio::test]
async fn process_runs_once_and_replays_the_result() {
    let (store, _dir) = store(1).await;
    let inbox = store.inbox(WEEK);
    let k = key("o-1");
    for round in 0..3 {
        let out = inbox
            .process(store.pool(), &k, None, |conn| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO ledger VALUES ('o-1', 5)").execute(&mut *conn).await?;
                    Ok::<_, sqlx::Error>(format!("receipt-{round}"))
                })
            })
            .await
            .unwrap();
        match (round, out) {
            (0, InboxOutcome::Processed(r)) => assert_eq!(r, "receipt-0"),
            (_, InboxOutcome::Duplicate(Some(r))) => assert_eq!(r, "receipt-0"),
            (r, other) => panic!("round {r}: {other:?}"),
        }
    }
    assert_eq!(ledger_rows(&store).await, 1);
    // Failing writes roll the marker back with them.
    let k2 = key("o-2");
    let err = inbox
        .process(store.pool(), &k2, None, |conn| {
            Box::pin(async move {
                sqlx::query("INSERT INTO ledger VALUES ('o-2', 5)").execute(&mut *conn).await?;
                sqlx::query("INSERT INTO no_such_table VALUES (1)").execute(&mut *conn).await?;
                Ok::<_, sqlx::Error>(())
            })
        })
        .await
        .unwrap_err();
    assert!(matches!(err, InboxError::Writes(_)), "{err:?}");
    assert!(store.get(&k2).await.unwrap().is_none());
    assert_eq!(ledger_rows(&store).await, 1);
}

/// Many tasks deliver 200 orders, 30% of them twice: the ledger (no unique constraint) gets
/// exactly one row per order.
#[tokio::test]
async fn concurrent_processors_write_each_order_once() {
    let (store, _dir) = store(4).await;
    let inbox = store.inbox(WEEK);
    let mut deliveries: Vec<u32> = (0..200).collect();
    deliveries.extend((0..200).filter(|i| i % 10 < 3));
    let mut tasks = Vec::new();
    for chunk in deliveries.chunks(25) {
        let (store, inbox, chunk) = (store.clone(), inbox.clone(), chunk.to_vec());
        tasks.push(tokio::spawn(async move {
            for id in chunk {
                let k = key(&format!("o-{id}"));
                let out = inbox
                    .process(store.pool(), &k, None, |conn| {
                        Box::pin(async move {
                            sqlx::query("INSERT INTO ledger VALUES (?1, 1)")
                                .bind(format!("o-{id}"))
                                .execute(&mut *conn)
                                .await?;
                            Ok::<_, sqlx::Error>(())
                        })
                    })
                    .await
                    .unwrap();
                assert!(matches!(out, InboxOutcome::Processed(()) | InboxOutcome::Duplicate(_)));
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(ledger_rows(&store).await, 200);
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT order_id) FROM ledger")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(distinct, 200);
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
        assert_eq!(inbox.mark(&mut tx, &key(id), None).await.unwrap(), Mark::First, "{id:?}");
    }
    tx.commit().await.unwrap();
}
