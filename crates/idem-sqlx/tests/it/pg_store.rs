//! PostgreSQL entity-as-marker, schema, startup checks and purge on the real server.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing
#![cfg(feature = "postgres")]

use crate::common;

use std::time::Duration;

use idem_core::time::ClockSkew;
use idem_core::{
    Claim, ClaimRequest, DedupKey, DedupStore, Fingerprint, InspectStore, RecordState,
};
use idem_sqlx::PostgresStore;
use idem_sqlx::postgres::EntityTable;
use sqlx::postgres::PgPoolOptions;

const WEEK: Duration = Duration::from_secs(7 * 86_400);

struct Db {
    store: PostgresStore,
    schema: String,
    skew: ClockSkew,
    _drop: common::DropSql,
}

async fn db(conns: u32) -> Option<Db> {
    let url = common::pg_url()?;
    let schema = common::unique("idem_pg");
    let pool = PgPoolOptions::new().max_connections(conns).connect(&url).await.unwrap();
    let skew = ClockSkew::new();
    let store =
        PostgresStore::new(pool).with_schema(&schema).unwrap().with_clock_skew(skew.clone());
    store.migrate().await.unwrap();
    let drop = common::DropSql { url, sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
    Some(Db { store, schema, skew, _drop: drop })
}

fn key(id: &str) -> DedupKey {
    DedupKey::new("ledger-writer", id).unwrap()
}

#[tokio::test]
async fn entity_row_is_its_own_marker() {
    let Some(db) = db(2).await else { return };
    let s = &db.schema;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE \"{s}\".orders (order_id TEXT PRIMARY KEY, fingerprint BYTEA, cents BIGINT)"
    )))
    .execute(db.store.pool())
    .await
    .unwrap();
    let orders = EntityTable::new(s, "orders", "order_id", "fingerprint").unwrap();
    let insert =
        format!("INSERT INTO \"{s}\".orders VALUES ($1, $2, $3) ON CONFLICT (order_id) DO NOTHING");
    let run = async |id: &str, cents: i64| {
        let fp = Fingerprint::of_bytes(format!("{id}:{cents}").as_bytes());
        let mut tx = db.store.pool().begin().await.unwrap();
        let done = sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
            .bind(id)
            .bind(&fp.0[..])
            .bind(cents)
            .execute(&mut *tx)
            .await
            .unwrap();
        let mark = orders.classify(&mut tx, done.rows_affected(), &key(id), fp).await.unwrap();
        tx.commit().await.unwrap();
        mark
    };
    assert!(matches!(run("o-1", 1200).await, Claim::Acquired(_)));
    let fp = Fingerprint::of_bytes(b"o-1:1200");
    assert!(matches!(run("o-1", 1200).await, Claim::Completed(r) if r.fingerprint == Some(fp)));
    assert!(matches!(run("o-1", 9900).await, Claim::Conflict(r) if r.fingerprint == Some(fp)));
    assert!(EntityTable::new(s, "orders; DROP TABLE x", "order_id", "fp").is_err());
}

#[tokio::test]
async fn names_are_validated() {
    let Some(url) = common::pg_url() else { return };
    let pool = PgPoolOptions::new().max_connections(1).connect_lazy(&url).unwrap();
    let store = PostgresStore::new(pool);
    for bad in ["idem; DROP TABLE users", "a\"b", "", "1abc", "tab le"] {
        let err = store.clone().with_schema(bad).unwrap_err().to_string();
        assert!(err.contains("schema name"), "{bad:?}: {err}");
        assert!(store.clone().with_table_name(bad).is_err(), "{bad:?}");
    }
    let long = "t".repeat(53);
    let err = store.clone().with_table_name(&long).unwrap_err().to_string();
    assert!(err.contains("table name") && err.contains("52"), "{err}");
    let err = store.clone().with_schema(&"s".repeat(64)).unwrap_err().to_string();
    assert!(err.contains("63"), "{err}");
    assert!(store.with_table_name(&"t".repeat(52)).is_ok());
}

#[tokio::test]
async fn startup_check_warns_on_async_commit_and_text_keys() {
    let Some(url) = common::pg_url() else { return };
    let Some(db) = db(1).await else { return };
    assert!(db.store.check().await.unwrap().is_empty(), "a default server needs no warning");
    let opts: sqlx::postgres::PgConnectOptions = url.parse().unwrap();
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(opts.options([("synchronous_commit", "off")]))
        .await
        .unwrap();
    let lax = PostgresStore::new(pool).with_schema(&db.schema).unwrap();
    let w = lax.check().await.unwrap();
    assert!(w.iter().any(|w| w.contains("synchronous_commit is off")), "{w:?}");
    // Every column the store needs, but the key as text.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE \"{s}\".textkeys (LIKE \"{s}\".idem_records); \
         ALTER TABLE \"{s}\".textkeys ALTER COLUMN key_hash TYPE TEXT",
        s = db.schema
    )))
    .execute(db.store.pool())
    .await
    .unwrap();
    let texty = db.store.clone().with_table_name("textkeys").unwrap();
    let w = texty.check().await.unwrap();
    assert!(w.iter().any(|w| w.contains("`text`, not `bytea`")), "{w:?}");
}

#[tokio::test]
async fn keys_differing_by_case_or_trailing_space_stay_distinct() {
    let Some(db) = db(2).await else { return };
    let r = |id: &str| ClaimRequest::new(key(id), None, Duration::from_secs(30), WEEK);
    for id in ["Order-1", "order-1", "order-1 ", "ORDER-1"] {
        assert!(matches!(db.store.claim(&r(id)).await.unwrap(), Claim::Acquired(_)), "{id:?}");
    }
}

/// Purge deletes expired records in bounded batches while claims keep running, and never
/// touches a live lease or a record within its retention.
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
    // A live lease that outlasts the move of the clock, with a short retention.
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
        assert!(n <= 50, "a purge batch is bounded by its limit");
        purged += n;
        if n < 50 {
            break;
        }
    }
    assert_eq!(claims.await.unwrap(), 200, "claims keep succeeding during the purge");
    assert_eq!(purged, 500);
    let live_rec = db.store.get(&key("live")).await.unwrap().expect("live lease survives");
    assert_eq!(live_rec.state, RecordState::InProgress);
    db.store.complete(live_lease, None, WEEK).await.unwrap();
    assert_eq!(db.store.count(Some("ledger-writer")).await.unwrap().total(), 201);
}

/// `complete_many`, `purge` and `claim_many`'s read of the losers (and the per-message claim,
/// complete and get, which never scanned) must stay index lookups as the table grows. As a prepared
/// statement its plan was cached once generic (after five runs) while the table was tiny: a
/// sequential scan joined by hash, which then read the whole table on every batch (seen in
/// `idem bench-sql`: 5,152 sequential scans reading 98 million rows for 40,000 completions).
/// It is now planned with its arrays on every run. Seen through the table's statistics, which
/// the server publishes once the pool's one connection has closed.
#[tokio::test]
async fn batch_statements_stay_index_lookups_as_the_table_grows() {
    let Some(db) = db(1).await else { return };
    let req = |id: String| ClaimRequest::new(key(&id), None, Duration::from_secs(30), WEEK);
    let complete_all = async |reqs: Vec<ClaimRequest>| {
        let claims = db.store.claim_many(&reqs).await.unwrap();
        let items = claims
            .into_iter()
            .map(|c| {
                let Claim::Acquired(lease) = c else { panic!("fresh keys") };
                idem_core::Completion { lease, result: None, retain_for: WEEK }
            })
            .collect();
        for r in db.store.complete_many(items).await.unwrap() {
            r.unwrap();
        }
    };
    // While the table is tiny: enough runs for the server to settle on a generic plan.
    let one = async |id: String| {
        let Claim::Acquired(l) = db.store.claim(&req(id.clone())).await.unwrap() else { panic!() };
        db.store.complete(l, None, WEEK).await.unwrap();
        assert!(db.store.get(&key(&id)).await.unwrap().is_some());
    };
    for i in 0..10 {
        complete_all((0..2).map(|j| req(format!("tiny-{i}-{j}"))).collect()).await;
        db.store.purge(50).await.unwrap();
        one(format!("tiny1-{i}")).await;
    }
    // Grow it (claims only), then complete small batches on the grown table.
    for i in 0..40 {
        let grow: Vec<_> = (0..500).map(|j| req(format!("grow-{i}-{j}"))).collect();
        db.store.claim_many(&grow).await.unwrap();
    }
    const LATE: i64 = 40;
    for i in 0..LATE {
        complete_all((0..2).map(|j| req(format!("late-{i}-{j}"))).collect()).await;
        one(format!("late1-{i}")).await;
    }
    // Purges that find nothing due (every record is kept a week) must not read every row.
    for _ in 0..LATE {
        assert_eq!(db.store.purge(50).await.unwrap(), 0);
    }
    // Redeliveries: claim_many of keys that are taken reads the losers' records.
    for i in 0..LATE {
        let again: Vec<_> = (0..2).map(|j| req(format!("grow-{i}-{j}"))).collect();
        for c in db.store.claim_many(&again).await.unwrap() {
            assert!(matches!(c, Claim::InProgress { .. }), "{c:?}");
        }
    }
    db.store.pool().close().await;

    let url = common::pg_url().unwrap();
    let pool = PgPoolOptions::new().max_connections(1).connect(&url).await.unwrap();
    let stats = format!(
        "SELECT seq_scan, n_tup_upd FROM pg_stat_user_tables \
         WHERE schemaname = '{}' AND relname = 'idem_records'",
        db.schema
    );
    let updates = 3 * (10 + LATE);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let seq_scans = loop {
        let _ = sqlx::query("SELECT pg_stat_clear_snapshot()").execute(&pool).await;
        let (seq, upd): (i64, i64) =
            sqlx::query_as(sqlx::AssertSqlSafe(stats.clone())).fetch_one(&pool).await.unwrap();
        if upd >= updates {
            break seq;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the closed connection's statistics never arrived ({upd} of {updates} updates)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("{seq_scans} sequential scans");
    // Scans on the tiny table are fine (and cheap); one per late batch is the defect.
    assert!(
        seq_scans < LATE,
        "{seq_scans} sequential scans of the records table for {LATE} batches on the grown table"
    );
}
