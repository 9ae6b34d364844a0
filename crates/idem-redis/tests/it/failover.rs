//! Failover on a private Redis Cluster of 3 masters with 2 replicas each (so a shard keeps a
//! replica after one is promoted): what happens to claims and
//! completions the store acknowledged before a master died, with Redis' asynchronous
//! replication and with `wait_for_replicas`.
//!
//! 1. **Asynchronous replication loses acknowledged claims.** The namespace's replicas are
//!    stopped (SIGSTOP) and their replication links filled with padding, so the master's
//!    writes cannot reach them; claims are acknowledged by the master alone; the master is
//!    killed (SIGKILL) and the replicas resumed, one of them promoted. The acknowledged claims are gone: a
//!    redelivery of those messages would run their handlers again. With `wait_for_replicas`,
//!    the same claims are refused (a retryable error: the message is not acknowledged) instead
//!    of acknowledged.
//! 2. **With `wait_for_replicas`, a plain master failure loses nothing acknowledged.** Tasks
//!    claim and complete keys while the master is killed mid-run; after the failover every key
//!    the store acknowledged as completed is still completed, and the store serves again
//!    within seconds, through the same `RedisStore`.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{PrivateCluster, Server};
use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, StoreError};
use idem_redis::RedisStore;

const LEASE: Duration = Duration::from_secs(60);
const RETAIN: Duration = Duration::from_secs(600);

fn req(scope: &str, i: usize) -> ClaimRequest {
    ClaimRequest::new(DedupKey::new(scope, format!("k-{i}")).expect("key"), None, LEASE, RETAIN)
}

/// A namespace whose slot is served by a master other than those in `avoid`.
fn namespace_on_another_master(
    cluster: &PrivateCluster,
    via: &Server,
    avoid: &[usize],
) -> (String, usize, Vec<usize>) {
    for i in 0.. {
        let name = format!("fo-{}-{i}", std::process::id());
        let (m, replicas) = cluster.shard_of(&format!("idem:{{{name}}}:"), via);
        if !avoid.contains(&m) && replicas.len() == 2 {
            return (name, m, replicas);
        }
    }
    unreachable!()
}

async fn store(cluster: &PrivateCluster, ns: &str, wait: bool) -> RedisStore {
    let urls = cluster.urls();
    let mut b = RedisStore::cluster_builder(urls.iter().map(String::as_str))
        .expect("urls")
        .namespace(ns)
        .expect("namespace");
    if wait {
        b = b.wait_for_replicas(1, Duration::from_millis(300));
    }
    b.connect().await.expect("connect")
}

/// Claims `r` again until the store answers (it may fail while the cluster fails over).
async fn claim_after_failover(store: &RedisStore, r: &ClaimRequest) -> Claim {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match store.claim(r).await {
            Ok(c) => return c,
            Err(e) => assert!(Instant::now() < deadline, "no answer after the failover: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_loses_acknowledged_claims_unless_the_store_waits_for_a_replica() {
    let Some(cluster) =
        PrivateCluster::spawn(3, 2, &["--client-output-buffer-limit", "replica 0 0 0"])
    else {
        return;
    };

    // ---- 1. Asynchronous replication, replica cut off -------------------------------------
    let via = &cluster.nodes[0];
    let (ns, m, replicas) = namespace_on_another_master(&cluster, via, &[]);
    let master = &cluster.nodes[m];
    let plain = store(&cluster, &ns, false).await;
    let waiting = store(&cluster, &ns, true).await;
    for &r in &replicas {
        cluster.nodes[r].signal("STOP");
    }
    // Fill the replication link beyond the sockets' buffers, so what follows stays in the
    // master's memory.
    let padding = vec![b'x'; 1 << 20];
    let mut conn = plain.connection().clone();
    for i in 0..48 {
        let _: () = redis::cmd("SET")
            .arg(format!("idem:{{{ns}}}:padding-{i}"))
            .arg(&padding)
            .query_async(&mut conn)
            .await
            .expect("padding");
    }
    let mut acknowledged = Vec::new();
    for i in 0..100 {
        let r = req("async", i);
        assert!(matches!(plain.claim(&r).await.expect("claim"), Claim::Acquired(_)));
        acknowledged.push(r);
    }
    // The same claims through a store that waits for a replica: refused, not acknowledged.
    for i in 0..3 {
        match waiting.claim(&req("waited", i)).await {
            Err(e @ StoreError::Backend { retryable: true, .. }) => {
                let msg =
                    std::error::Error::source(&e).map(ToString::to_string).unwrap_or_default();
                assert!(msg.contains("on 0 of the 1 replicas"), "{msg}");
            }
            other => panic!("a claim no replica acknowledged was answered {other:?}"),
        }
    }
    master.signal("KILL");
    for &r in &replicas {
        cluster.nodes[r].signal("CONT");
    }
    let survivors: Vec<&Server> =
        cluster.nodes.iter().enumerate().filter(|(i, _)| *i != m).map(|(_, n)| n).collect();
    cluster.wait_ok(&survivors, Duration::from_secs(30));
    let started = Instant::now();
    let mut lost = 0;
    for r in &acknowledged {
        match claim_after_failover(&plain, r).await {
            Claim::Acquired(_) => lost += 1,
            Claim::InProgress { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    println!(
        "asynchronous replication: {lost} of {} acknowledged claims lost by the failover \
         (store answering again {:?} after the cluster was ok)",
        acknowledged.len(),
        started.elapsed()
    );
    assert!(lost > 0, "the replica was cut off: the acknowledged claims cannot have survived");

    // ---- 2. wait_for_replicas, a master killed mid-run -------------------------------------
    let (ns2, m2, _) = namespace_on_another_master(&cluster, survivors[0], &[m]);
    let waiting = store(&cluster, &ns2, true).await;
    let completed: Arc<std::sync::Mutex<Vec<ClaimRequest>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..8 {
        let (s, done, stop) = (waiting.clone(), Arc::clone(&completed), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let mut errors = 0u32;
            for i in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let r = req("waited-run", t * 1_000_000 + i);
                let Ok(Claim::Acquired(lease)) = s.claim(&r).await else {
                    errors += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                if s.complete(lease, Some(b"done"), RETAIN).await.is_ok() {
                    done.lock().expect("done").push(r);
                } else {
                    errors += 1;
                }
            }
            errors
        }));
    }
    let count = || completed.lock().expect("done").len();
    idem_testkit::wait_for("the waiting store to make progress", Duration::from_secs(20), || {
        let n = count();
        async move { n >= 300 }
    })
    .await;
    let before_kill = count();
    let killed_at = Instant::now();
    cluster.nodes[m2].signal("KILL");
    // Run on until the store has acknowledged completions again after the failover.
    idem_testkit::wait_for("completions after the failover", Duration::from_secs(30), || {
        let n = count();
        async move { n >= before_kill + 300 }
    })
    .await;
    let recovered = killed_at.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut errors = 0;
    for t in tasks {
        errors += t.await.expect("task");
    }
    let done = std::mem::take(&mut *completed.lock().expect("done"));
    let mut lost = Vec::new();
    for r in &done {
        match claim_after_failover(&waiting, r).await {
            Claim::Completed(rec) if rec.result.as_deref() == Some(&b"done"[..]) => {}
            other => lost.push((r.key.id().to_owned(), format!("{other:?}"))),
        }
    }
    println!(
        "wait_for_replicas(1): {} completions acknowledged ({before_kill} before the kill), \
         {} lost; {errors} operations failed meanwhile; acknowledging again {recovered:?} after \
         the kill",
        done.len(),
        lost.len()
    );
    assert!(lost.is_empty(), "acknowledged completions lost: {lost:?}");
}
