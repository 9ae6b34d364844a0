//! MariaDB entity-as-marker pattern, names, startup checks, deadlocks and purge on the
//! real server.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing
#![cfg(feature = "mysql")]

use crate::common;

use std::time::Duration;

use idem_core::inbox::TxInbox;
use idem_core::time::ClockSkew;
use idem_core::{
    Claim, ClaimRequest, DedupKey, DedupStore, Fingerprint, InspectStore, RecordState,
};
use idem_sqlx::MySqlStore;
use idem_sqlx::mysql::is_duplicate_key;
use sqlx::mysql::MySqlPoolOptions;

const WEEK: Duration = Duration::from_secs(7 * 86_400);

struct Db {
    store: MySqlStore,
    table: String,
    skew: ClockSkew,
    _drop: common::DropSql,
}

async fn db(conns: u32) -> Option<Db> {
    let url = common::mysql_url()?;
    let table = common::unique("my");
    let pool = MySqlPoolOptions::new().max_connections(conns).connect(&url).await.unwrap();
    let skew = ClockSkew::new();
    let store =
        MySqlStore::new(pool).with_table_name(&table).unwrap().with_clock_skew(skew.clone());
    store.migrate().await.unwrap();
    let drop = common::DropSql {
        url,
        sql: format!("DROP TABLE IF EXISTS `{table}`, `{table}_orders`, `{table}_positions`"),
    };
    Some(Db { store, table, skew, _drop: drop })
}

fn key(id: &str) -> DedupKey {
    DedupKey::new("ledger-writer", id).unwrap()
}

async fn wait_until_blocked(db: &Db) {
    let probe = "SELECT CAST(trx_query AS CHAR) FROM information_schema.innodb_trx \
                 WHERE CAST(trx_state AS CHAR) = 'LOCK WAIT'";
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: Vec<Option<String>> =
            sqlx::query_scalar(probe).fetch_all(db.store.pool()).await.unwrap();
        if waiting.iter().flatten().any(|q| q.contains(&db.table)) {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "second mark never blocked on the first");
        // InnoDB refreshes its information_schema lock cache only when it was not read in
        // the last 100 ms: polling faster reads the same stale snapshot forever.
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

/// Two transactions marking two keys in opposite order deadlock; MariaDB rolls one back, and
/// the error is classified retryable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlock_is_retryable() {
    let Some(db) = db(4).await else { return };
    let inbox = db.store.inbox(WEEK);
    let (a, b) = (key("dl-a"), key("dl-b"));
    let mut tx1 = db.store.pool().begin().await.unwrap();
    let mut tx2 = db.store.pool().begin().await.unwrap();
    assert!(matches!(inbox.mark(&mut tx1, &a, None).await.unwrap(), Claim::Acquired(_)));
    assert!(matches!(inbox.mark(&mut tx2, &b, None).await.unwrap(), Claim::Acquired(_)));
    let (i1, b1) = (inbox.clone(), b.clone());
    let t1 = tokio::spawn(async move {
        let r = i1.mark(&mut tx1, &b1, None).await;
        (r, tx1)
    });
    wait_until_blocked(&db).await;
    let r2 = inbox.mark(&mut tx2, &a, None).await;
    let (r1, tx1) = tokio::time::timeout(Duration::from_secs(20), t1).await.unwrap().unwrap();
    let errs: Vec<_> = [&r1, &r2].into_iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(errs.len(), 1, "exactly one side is the deadlock victim: {r1:?} / {r2:?}");
    assert!(errs[0].is_retryable(), "a deadlock must be retryable: {}", errs[0]);
    drop(tx1.rollback().await);
    drop(tx2.rollback().await);
}

/// Entity as marker on MySQL: the business row's primary key is the marker; a duplicate key
/// means a duplicate delivery, and the stored fingerprint tells a conflict.
#[tokio::test]
async fn entity_row_is_its_own_marker() {
    let Some(db) = db(2).await else { return };
    let orders = format!("{}_orders", db.table);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE `{orders}` (order_id VARCHAR(64) PRIMARY KEY, fingerprint BINARY(32), cents BIGINT)"
    )))
    .execute(db.store.pool())
    .await
    .unwrap();
    let run = async |id: &str, cents: i64| -> &'static str {
        let fp = Fingerprint::of_bytes(format!("{id}:{cents}").as_bytes());
        let mut tx = db.store.pool().begin().await.unwrap();
        let ins =
            sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO `{orders}` VALUES (?, ?, ?)")))
                .bind(id)
                .bind(&fp.0[..])
                .bind(cents)
                .execute(&mut *tx)
                .await;
        let verdict = match ins {
            Ok(_) => "inserted",
            Err(e) if is_duplicate_key(&e) => {
                let stored: Vec<u8> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                    "SELECT fingerprint FROM `{orders}` WHERE order_id = ? LOCK IN SHARE MODE"
                )))
                .bind(id)
                .fetch_one(&mut *tx)
                .await
                .unwrap();
                if stored == fp.0 { "duplicate" } else { "conflict" }
            }
            Err(e) => panic!("{e}"),
        };
        tx.commit().await.unwrap();
        verdict
    };
    assert_eq!(run("o-1", 1200).await, "inserted");
    assert_eq!(run("o-1", 1200).await, "duplicate");
    assert_eq!(run("o-1", 9900).await, "conflict");
}

#[tokio::test]
async fn names_are_validated() {
    let Some(url) = common::mysql_url() else { return };
    let pool = MySqlPoolOptions::new().max_connections(1).connect_lazy(&url).unwrap();
    let store = MySqlStore::new(pool);
    for bad in ["idem; DROP TABLE users", "a`b", "", "1abc", "tab le", "x'--"] {
        let err = store.clone().with_table_name(bad).unwrap_err().to_string();
        assert!(err.contains("table name"), "{bad:?}: {err}");
    }
    let err = store.clone().with_table_name(&"t".repeat(53)).unwrap_err().to_string();
    assert!(err.contains("52"), "{err}");
    assert!(store.with_table_name(&"t".repeat(52)).is_ok());
}

#[tokio::test]
async fn startup_check_warns_on_a_text_key_column() {
    let Some(db) = db(1).await else { return };
    let w = db.store.check().await.unwrap();
    assert!(!w.iter().any(|w| w.contains("key_hash")), "{w:?}");
    let texty = format!("{}_orders", db.table);
    // Every column the store needs, but the key as text.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE `{texty}` LIKE `{table}`; \
         ALTER TABLE `{texty}` MODIFY key_hash VARCHAR(64) NOT NULL",
        table = db.table
    )))
    .execute(db.store.pool())
    .await
    .unwrap();
    let w = db.store.clone().with_table_name(&texty).unwrap().check().await.unwrap();
    assert!(w.iter().any(|w| w.contains("`varchar(64)`, not `binary(32)`")), "{w:?}");
}

/// MariaDB's default collations ignore case and trailing spaces; the binary hash key does not.
#[tokio::test]
async fn keys_differing_by_case_or_trailing_space_stay_distinct() {
    let Some(db) = db(2).await else { return };
    let r = |id: &str| ClaimRequest::new(key(id), None, Duration::from_secs(30), WEEK);
    for id in ["Order-1", "order-1", "order-1 ", "ORDER-1", "order-1  "] {
        assert!(matches!(db.store.claim(&r(id)).await.unwrap(), Claim::Acquired(_)), "{id:?}");
    }
    let same: i64 = sqlx::query_scalar("SELECT 'order-1' = 'ORDER-1 '")
        .fetch_one(db.store.pool())
        .await
        .unwrap();
    assert_eq!(same, 1, "the server's own collation does merge these strings");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_runs_beside_claims() {
    let Some(db) = db(8).await else { return };
    let short = |id: String| {
        ClaimRequest::new(key(&id), None, Duration::from_secs(1), Duration::from_secs(10))
    };
    let reqs: Vec<_> = (0..500).map(|i| short(format!("old-{i}"))).collect();
    for chunk in reqs.chunks(100) {
        for c in db.store.claim_many(chunk).await.unwrap() {
            let Claim::Acquired(l) = c else { panic!("fresh keys") };
            db.store.complete(l, None, Duration::from_secs(10)).await.unwrap();
        }
    }
    let live = ClaimRequest::new(key("live"), None, Duration::from_secs(3600), Duration::ZERO);
    let Claim::Acquired(live_lease) = db.store.claim(&live).await.unwrap() else { panic!() };
    db.skew.advance(Duration::from_secs(60));
    let store = db.store.clone();
    let claims = tokio::spawn(async move {
        let mut won = 0;
        for i in 0..200 {
            let r =
                ClaimRequest::new(key(&format!("new-{i}")), None, Duration::from_secs(30), WEEK);
            if let Claim::Acquired(l) = store.claim(&r).await.unwrap() {
                store.complete(l, None, WEEK).await.unwrap();
                won += 1;
            }
        }
        won
    });
    let mut purged = 0;
    loop {
        let n = db.store.purge(50).await.unwrap();
        assert!(n <= 50);
        purged += n;
        if n < 50 {
            break;
        }
    }
    assert_eq!(claims.await.unwrap(), 200);
    assert_eq!(purged, 500);
    let rec = db.store.get(&key("live")).await.unwrap().expect("live lease survives");
    assert_eq!(rec.state, RecordState::InProgress);
    db.store.complete(live_lease, None, WEEK).await.unwrap();
    assert_eq!(db.store.count(Some("ledger-writer")).await.unwrap().total(), 201);
}

/// Four batches in flight on one MariaDB inbox, all of fresh keys: InnoDB makes concurrent
/// marker inserts deadlock on the index gaps they share whatever the key order, and the inbox
/// marks such a batch again instead of failing it, so no message comes back as a transient
/// failure and every order is written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_mark_again_after_a_deadlock_instead_of_failing() {
    use idem_core::consumer::{Consumer, MemoryDelivery, MemoryQueue};
    use idem_core::extract::Envelope;

    let Some(db) = db(8).await else { return };
    let orders = format!("`{}_orders`", db.table);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE TABLE {orders} (id VARCHAR(32) NOT NULL)")))
        .execute(db.store.pool())
        .await
        .unwrap();
    let q = MemoryQueue::new();
    const N: usize = 4_000;
    for i in 0..N {
        q.push(format!("o-{i:05}"), format!(r#"{{"order":{i}}}"#));
    }
    let consumer = Consumer::builder(q.clone())
        .inbox(db.store.inbox(WEEK))
        .scope("deadlocks")
        .batch(64)
        .concurrency(4)
        .idle_wait(Duration::from_millis(20))
        .build()
        .await
        .unwrap();
    let insert = format!("INSERT INTO {orders} VALUES (?)");
    let handler = |mut tx: idem_core::Tx<idem_sqlx::MySqlInbox>, m: MemoryDelivery| {
        let insert = insert.clone();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(insert))
                .bind(m.message_id().unwrap_or_default().to_owned())
                .execute(&mut *tx)
                .await
                .map_err(|e| idem_core::engine::HandlerError::Transient(e.to_string()))?;
            Ok::<_, idem_core::engine::HandlerError<String>>(())
        }
    };
    let drained = q.drained();
    let report = tokio::time::timeout(Duration::from_secs(120), consumer.run(handler, drained))
        .await
        .expect("the queue drains")
        .unwrap();
    assert_eq!(report.processed, N as u64, "{report}");
    assert_eq!((report.failed_transient, report.retried), (0, 0), "{report}");
    let (rows, distinct): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*), COUNT(DISTINCT id) FROM {orders}"
    )))
    .fetch_one(db.store.pool())
    .await
    .unwrap();
    assert_eq!((rows, distinct), (N as i64, N as i64));
}
