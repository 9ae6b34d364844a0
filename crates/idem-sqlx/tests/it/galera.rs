//! MariaDB Galera (three nodes, `.ci/services.sh galera`): the store's conformance suite on one
//! node, and "twins" — the same keys claimed, and marked by the inbox, through two nodes at
//! once. Nodes take no locks for each other: the loser of a race finds out when its write set
//! fails certification (error 1213, retryable), and trying again must see the winner.
//!
//! `IDEM_TEST_GALERA_URLS`: the nodes' `mysql://` URLs, comma-separated (default: 127.0.0.1
//! ports 3311, 3312, 3313, database `test`).
#![cfg(feature = "mysql")]
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use crate::common;

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt as _;
use idem_core::engine::{Cause, FailureKind, HandlerError};
use idem_core::inbox::TxInbox;
use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, Outcome, StoreError};
use idem_sqlx::{MySqlInbox, MySqlStore};
use idem_testkit::service::host_port;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::{AssertSqlSafe, Connection as _};

const URLS_VAR: &str = "IDEM_TEST_GALERA_URLS";
const DEFAULT_URLS: &str = "mysql://root@127.0.0.1:3311/test,mysql://root@127.0.0.1:3312/test,\
                            mysql://root@127.0.0.1:3313/test";
const LEASE: Duration = Duration::from_secs(60);
const KEEP: Duration = Duration::from_secs(86_400);
/// Tries of one delivery before the test gives up on it (each retryable failure is a redelivery).
const TRIES: usize = 100;
/// Held by each twins test: the nodes' conflict counters it reports are then its own (the
/// conformance cases, all on one node, cause none).
static TWINS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The nodes' URLs, if every one answers on TCP: `skipped: …` otherwise, a panic under CI.
fn galera_urls() -> Option<Vec<String>> {
    idem_testkit::service::require_all("Galera", URLS_VAR, DEFAULT_URLS, 2)
}

async fn pool(url: &str) -> MySqlPool {
    MySqlPoolOptions::new()
        .max_connections(16)
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to Galera node {}: {e}", host_port(url)))
}

/// One of a node's `wsrep_*` status values.
async fn wsrep(pool: &MySqlPool, name: &str) -> String {
    let sql = format!("SHOW GLOBAL STATUS LIKE '{name}'");
    let row: Option<(String, String)> =
        sqlx::query_as(AssertSqlSafe(sql)).fetch_optional(pool).await.unwrap();
    row.map(|(_, v)| v).unwrap_or_default()
}

/// Panics unless the pools reach distinct, synced members of one primary component: the twins
/// would prove nothing on one server reached twice, or on plain MariaDB.
async fn assert_one_cluster(pools: &[&MySqlPool]) {
    let mut names = Vec::new();
    for p in pools {
        let (status, state) =
            (wsrep(p, "wsrep_cluster_status").await, wsrep(p, "wsrep_local_state_comment").await);
        assert_eq!(
            (status.as_str(), state.as_str()),
            ("Primary", "Synced"),
            "not a synced Galera node"
        );
        let size: usize = wsrep(p, "wsrep_cluster_size").await.parse().unwrap_or(0);
        assert!(size >= pools.len(), "wsrep_cluster_size {size} < {} nodes", pools.len());
        let name: String =
            sqlx::query_scalar("SELECT @@wsrep_node_name").fetch_one(*p).await.unwrap();
        names.push(name);
    }
    let mut distinct = names.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), names.len(), "two URLs reach the same node: {names:?}");
}

/// Certification failures and brute-force aborts so far, summed over the nodes.
async fn conflicts(pools: &[&MySqlPool]) -> (u64, u64) {
    let mut sum = (0, 0);
    for p in pools {
        sum.0 += wsrep(p, "wsrep_local_cert_failures").await.parse::<u64>().unwrap_or(0);
        sum.1 += wsrep(p, "wsrep_local_bf_aborts").await.parse::<u64>().unwrap_or(0);
    }
    sum
}

/// Waits until `table` is visible on `pool`'s node: DDL replicates in total order, but a node
/// applies it after the one that ran it has returned.
async fn wait_visible(pool: &MySqlPool, table: &str) {
    let probe = format!("SELECT 1 FROM `{table}` LIMIT 0");
    idem_testkit::wait_for(
        &format!("table {table} on every node"),
        Duration::from_secs(10),
        || {
            let probe = probe.clone();
            async move { sqlx::raw_sql(AssertSqlSafe(probe)).execute(pool).await.is_ok() }
        },
    )
    .await;
}

/// A store on the first node and its table, dropped afterwards.
async fn store_on_first(prefix: &str) -> Option<(MySqlStore, common::DropSql)> {
    let urls = galera_urls()?;
    let table = common::unique(prefix);
    let store = MySqlStore::new(pool(&urls[0]).await).with_table_name(&table).unwrap();
    assert_one_cluster(&[store.pool()]).await;
    store.migrate().await.expect("migrate on Galera");
    let guard = common::DropSql {
        url: urls[0].clone(),
        sql: format!("DROP TABLE IF EXISTS `{table}`, `{table}_positions`, `{table}_ledger`"),
    };
    Some((store, guard))
}

mod conformance {
    use super::*;
    use idem_core::time::ClockSkew;
    use idem_testkit::Harness;

    idem_testkit::dedup_store_conformance!(server: || async {
        let (store, guard) = store_on_first("galera_conf").await?;
        let skew = ClockSkew::new();
        let store = store.with_clock_skew(skew.clone());
        Some(Harness::new(store, skew, Duration::from_secs(10)).with_guard(guard))
    });
}

/// Twin stores over one table: the first node's and the second's.
async fn twins(prefix: &str) -> Option<([MySqlStore; 2], common::DropSql)> {
    let urls = galera_urls()?;
    let (a, guard) = store_on_first(prefix).await?;
    let b = MySqlStore::new(pool(&urls[1]).await).with_table_name(a.table()).unwrap();
    assert_one_cluster(&[a.pool(), b.pool()]).await;
    wait_visible(b.pool(), a.table()).await;
    Some(([a, b], guard))
}

fn is_sql_retryable(e: &sqlx::Error) -> bool {
    let number = e
        .as_database_error()
        .and_then(|d| d.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .map(sqlx::mysql::MySqlDatabaseError::number);
    matches!(number, Some(1213 | 1205 | 1047))
}

/// `f` again after each retryable failure (what a redelivery does), counting them in `retries`.
async fn again<T, Fut: Future<Output = Result<T, StoreError>>>(
    what: &str,
    retries: &mut u64,
    mut f: impl FnMut() -> Fut,
) -> T {
    for _ in 0..TRIES {
        match f().await {
            Ok(v) => return v,
            Err(e) if e.is_retryable() => *retries += 1,
            Err(e) => panic!("{what}: {e:#} (not retryable)"),
        }
    }
    panic!("{what}: still failing after {TRIES} tries")
}

/// The same keys claimed through two nodes at once, key by key (16 races in flight) on even
/// rounds and as one `claim_many` batch per node on odd rounds: one `Acquired` per key, the
/// other claim sees it in progress. Once the winners complete, a claim through either node is
/// never `Acquired` again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twins_claim_each_key_once_across_nodes() {
    let _serial = TWINS.lock().await;
    let Some(([a, b], _guard)) = twins("galera_twins").await else { return };
    let before = conflicts(&[a.pool(), b.pool()]).await;
    let started = std::time::Instant::now();
    let (rounds, keys) = (20, 100);
    let mut retries = [0u64; 2];
    let mut stale_after_complete = 0;
    for round in 0..rounds {
        let reqs: Vec<ClaimRequest> = (0..keys)
            .map(|i| {
                let key = DedupKey::new("twins", format!("r{round}-k{i}")).unwrap();
                ClaimRequest::new(key, None, LEASE, KEEP)
            })
            .collect();
        let (on_a, on_b): (Vec<Claim>, Vec<Claim>) = if round % 2 == 0 {
            let races = futures_util::stream::iter(&reqs)
                .map(|req| async {
                    let (mut ra, mut rb) = (0, 0);
                    let (x, y) = tokio::join!(
                        again("claim on node 1", &mut ra, || a.claim(req)),
                        again("claim on node 2", &mut rb, || b.claim(req)),
                    );
                    (x, y, ra, rb)
                })
                .buffered(16)
                .collect::<Vec<_>>()
                .await;
            let mut pairs = (Vec::new(), Vec::new());
            for (x, y, ra, rb) in races {
                pairs.0.push(x);
                pairs.1.push(y);
                retries[0] += ra;
                retries[1] += rb;
            }
            pairs
        } else {
            let (mut ra, mut rb) = (0, 0);
            let pair = tokio::join!(
                again("claim_many on node 1", &mut ra, || a.claim_many(&reqs)),
                again("claim_many on node 2", &mut rb, || b.claim_many(&reqs)),
            );
            retries[0] += ra;
            retries[1] += rb;
            pair
        };
        let mut leases = Vec::new();
        for ((req, x), y) in reqs.iter().zip(on_a).zip(on_b) {
            let key = &req.key;
            match (x, y) {
                (Claim::Acquired(l), Claim::InProgress { .. }) => leases.push((0, l)),
                (Claim::InProgress { .. }, Claim::Acquired(l)) => leases.push((1, l)),
                (x, y) => panic!("round {round}, {key}: node 1 {x:?}, node 2 {y:?}"),
            }
        }
        for (node, lease) in leases {
            let store = [&a, &b][node];
            store.complete(lease, Some(b"done"), KEEP).await.expect("complete the winner");
        }
        // Through the other node too: right after the commit it may not have applied the
        // completion yet (then the lease still looks live), but it never hands the key out.
        for req in &reqs {
            for store in [&a, &b] {
                let mut r = 0;
                match again("claim after complete", &mut r, || store.claim(req)).await {
                    Claim::Completed(_) => {}
                    Claim::InProgress { .. } => stale_after_complete += 1,
                    other => panic!("round {round}, {}: {other:?} after completion", req.key),
                }
            }
        }
    }
    let after = conflicts(&[a.pool(), b.pool()]).await;
    println!(
        "twins (store): {rounds} rounds × {keys} keys through 2 nodes in {:.1} s; retryable \
         errors seen by the claims: node 1 {}, node 2 {}; server-side certification failures \
         {}, brute-force aborts {}; claims after completion that still saw it in progress: {}",
        started.elapsed().as_secs_f64(),
        retries[0],
        retries[1],
        after.0 - before.0,
        after.1 - before.1,
        stale_after_complete,
    );
}

/// Twin inboxes over one table with a ledger without a unique key: each key's business row is
/// written once, whichever node's transaction commits first. Even rounds deliver each message
/// alone (`TxInbox::process`, 16 in flight per node); odd rounds run one batch transaction per
/// node over all the round's keys (mark all, write the acquired, commit). A retryable failure
/// is a redelivery: the same delivery is run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twins_write_each_inbox_effect_once_across_nodes() {
    let _serial = TWINS.lock().await;
    let Some(([a, b], _guard)) = twins("galera_inbox").await else { return };
    let ledger = format!("{}_ledger", a.table());
    let ddl = format!("CREATE TABLE `{ledger}` (id VARCHAR(64) NOT NULL, node INT NOT NULL)");
    sqlx::raw_sql(AssertSqlSafe(ddl)).execute(a.pool()).await.unwrap();
    wait_visible(b.pool(), &ledger).await;
    let inboxes = [a.inbox(KEEP), b.inbox(KEEP)];
    let insert = format!("INSERT INTO `{ledger}` (id, node) VALUES (?, ?)");
    let before = conflicts(&[a.pool(), b.pool()]).await;
    let started = std::time::Instant::now();
    let (rounds, keys) = (20, 100);
    let mut failed_commits = [0u64; 2];
    let mut other_retries = [0u64; 2];
    for round in 0..rounds {
        let ids: Vec<String> = (0..keys).map(|i| format!("r{round}-k{i}")).collect();
        if round % 2 == 0 {
            let per_node = |node: usize| {
                let (inbox, insert, ids) = (&inboxes[node], &insert, &ids);
                async move {
                    let tallies = futures_util::stream::iter(ids)
                        .map(|id| deliver_alone(inbox, node, id, insert))
                        .buffer_unordered(16)
                        .collect::<Vec<_>>()
                        .await;
                    tallies.into_iter().fold((0, 0), |s, t| (s.0 + t.0, s.1 + t.1))
                }
            };
            let (x, y) = tokio::join!(per_node(0), per_node(1));
            for (node, (commits, others)) in [x, y].into_iter().enumerate() {
                failed_commits[node] += commits;
                other_retries[node] += others;
            }
        } else {
            let (x, y) = tokio::join!(
                deliver_batch(&inboxes[0], 0, &ids, &insert),
                deliver_batch(&inboxes[1], 1, &ids, &insert),
            );
            for (node, (commits, others)) in [x, y].into_iter().enumerate() {
                failed_commits[node] += commits;
                other_retries[node] += others;
            }
        }
    }
    // Read on the first node once it has applied everything committed anywhere.
    let mut conn = sqlx::MySqlConnection::connect(&galera_urls().unwrap()[0]).await.unwrap();
    sqlx::raw_sql("SET SESSION wsrep_sync_wait = 1").execute(&mut conn).await.unwrap();
    let rows: Vec<(String, i64, i32)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT id, count(*), min(node) FROM `{ledger}` GROUP BY id"
    )))
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let counts: HashMap<String, i64> = rows.iter().map(|(id, n, _)| (id.clone(), *n)).collect();
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "effects not written exactly once: {twice:?}");
    assert_eq!(counts.len(), rounds * keys, "effects lost");
    let won_by_2 = rows.iter().filter(|(_, _, node)| *node == 1).count();
    let after = conflicts(&[a.pool(), b.pool()]).await;
    println!(
        "twins (inbox): {rounds} rounds × {keys} keys through 2 nodes in {:.1} s, {} effects \
         once each ({won_by_2} by node 2); commits failed retryably: node 1 {}, node 2 {}; \
         other retryable failures (marks, writes): node 1 {}, node 2 {}; server-side \
         certification failures {}, brute-force aborts {}",
        started.elapsed().as_secs_f64(),
        counts.len(),
        failed_commits[0],
        failed_commits[1],
        other_retries[0],
        other_retries[1],
        after.0 - before.0,
        after.1 - before.1,
    );
}

/// One message in its own transaction until it is decided; (failed commits, other retryable
/// failures).
async fn deliver_alone(inbox: &MySqlInbox, node: usize, id: &str, insert: &str) -> (u64, u64) {
    let key = DedupKey::new("twins", id).unwrap();
    let mut tally = (0, 0);
    for _ in 0..TRIES {
        let outcome = inbox
            .process(&key, None, |mut tx| async move {
                let q = sqlx::query(AssertSqlSafe(insert.to_owned()))
                    .bind(id)
                    .bind(i32::try_from(node).unwrap());
                match q.execute(&mut *tx).await {
                    Ok(_) => Ok(()),
                    Err(e) if is_sql_retryable(&e) => Err(HandlerError::Transient(e.to_string())),
                    Err(e) => Err(HandlerError::Permanent(e.to_string())),
                }
            })
            .await;
        match outcome {
            Outcome::Processed(()) | Outcome::Duplicate(_) => return tally,
            Outcome::Failed(f) => match f.cause {
                Cause::Store(StoreError::Backend { op: "commit", retryable: true, .. }) => {
                    tally.0 += 1;
                }
                Cause::Store(e) if e.is_retryable() => tally.1 += 1,
                Cause::Handler(_) if f.kind == FailureKind::Transient => tally.1 += 1,
                other => panic!("{key} on node {}: {other}", node + 1),
            },
            other => panic!("{key} on node {}: {:?}", node + 1, other.kind()),
        }
    }
    panic!("{key} on node {}: undecided after {TRIES} deliveries", node + 1)
}

/// All of `ids` in one transaction (mark all, write the acquired, commit) until it commits;
/// (failed commits, other retryable failures).
async fn deliver_batch(
    inbox: &MySqlInbox,
    node: usize,
    ids: &[String],
    insert: &str,
) -> (u64, u64) {
    let items: Vec<_> =
        ids.iter().map(|id| (DedupKey::new("twins", id.as_str()).unwrap(), None)).collect();
    let mut tally = (0, 0);
    for _ in 0..TRIES {
        let mut tx = match inbox.begin().await {
            Ok(tx) => tx,
            Err(e) if e.is_retryable() => {
                tally.1 += 1;
                continue;
            }
            Err(e) => panic!("begin on node {}: {e:#}", node + 1),
        };
        let claims = match inbox.mark_many(MySqlInbox::connection(&mut tx), &items).await {
            Ok(c) => c,
            Err(e) if e.is_retryable() => {
                tally.1 += 1;
                continue;
            }
            Err(e) => panic!("mark_many on node {}: {e:#}", node + 1),
        };
        let mut written = Ok(());
        for ((key, _), claim) in items.iter().zip(&claims) {
            match claim {
                Claim::Acquired(_) => {
                    let q = sqlx::query(AssertSqlSafe(insert.to_owned()))
                        .bind(key.id())
                        .bind(i32::try_from(node).unwrap());
                    if let Err(e) = q.execute(MySqlInbox::connection(&mut tx)).await {
                        written = Err(e);
                        break;
                    }
                }
                Claim::Completed(_) => {}
                other => panic!("{key} on node {}: {other:?}", node + 1),
            }
        }
        match written {
            Ok(()) => {}
            Err(e) if is_sql_retryable(&e) => {
                tally.1 += 1;
                continue;
            }
            Err(e) => panic!("ledger write on node {}: {e}", node + 1),
        }
        match inbox.commit(tx).await {
            Ok(_) => return tally,
            Err(e) if e.is_retryable() => tally.0 += 1,
            Err(e) => panic!("commit on node {}: {e:#}", node + 1),
        }
    }
    panic!("batch on node {}: not committed after {TRIES} tries", node + 1)
}
