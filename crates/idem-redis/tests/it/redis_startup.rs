//! Against a private `redis-server` on a spare port (so server-wide settings and counters are
//! ours alone): the startup checks with an evicting policy or the AOF on, and that
//! concurrent claims share one connection and a batch is one command. Plus the shared server's
//! settings.

use crate::common;

use std::time::Duration;

use common::{PrivateCluster, spawn};
use idem_core::{Claim, ClaimRequest, Completion, DedupKey, DedupStore, Lease};
use idem_redis::{Error, RedisStore, ServerSettings};

/// On a cluster, every master is checked, and the error names the one that evicts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_cluster_master_is_refused_and_named() {
    let Some(cluster) = PrivateCluster::spawn(3, 0, &[]) else { return };
    let urls = cluster.urls();
    let store = RedisStore::cluster_builder(urls.iter().map(String::as_str))
        .expect("urls")
        .connect()
        .await
        .expect("a noeviction cluster is accepted");
    assert!(store.connection().is_cluster() && store.fast_claim());
    let evicting = &cluster.nodes[1];
    let client = redis::Client::open(evicting.url.as_str()).expect("url");
    let mut c = client.get_connection().expect("connect");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("volatile-lru")
        .query(&mut c)
        .expect("config set");
    match RedisStore::cluster_builder(urls.iter().map(String::as_str))
        .expect("urls")
        .connect()
        .await
    {
        Err(e @ Error::ClusterNode { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(&format!("127.0.0.1:{}", evicting.port())), "{msg}");
            assert!(msg.contains("volatile-lru"), "{msg}");
        }
        other => panic!("expected the evicting master to be named, got {other:?}"),
    }
    RedisStore::cluster_builder(urls.iter().map(String::as_str))
        .expect("urls")
        .allow_eviction(true)
        .connect()
        .await
        .expect("allowed");
}

/// A master without slots (a node just added, before a reshard) holds no keys and the cluster
/// client keeps no connection to it: the startup checks leave it out instead of failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_without_slots_does_not_stop_the_store() {
    let Some(mut cluster) = PrivateCluster::spawn(3, 0, &[]) else { return };
    let empty = cluster.add_empty_master(&[]);
    let urls = cluster.urls();
    let store = RedisStore::cluster_builder(urls.iter().map(String::as_str))
        .expect("urls")
        .namespace(&format!("slotless-{}", std::process::id()))
        .expect("namespace")
        .connect()
        .await
        .unwrap_or_else(|e| {
            panic!("127.0.0.1:{} serves no slots, yet: {e}", cluster.nodes[empty].port())
        });
    let key = DedupKey::new("s", "k").expect("key");
    let r = ClaimRequest::new(key, None, Duration::from_secs(30), Duration::from_secs(60));
    assert!(matches!(store.claim(&r).await.expect("claim"), Claim::Acquired(_)));
}

#[tokio::test]
async fn evicting_policy_is_refused_unless_allowed() {
    let Some(server) = spawn(&["--maxmemory-policy", "allkeys-lru", "--appendonly", "no"]) else {
        return;
    };
    match RedisStore::connect(&server.url).await {
        Err(Error::EvictingPolicy { policy }) => assert_eq!(policy, "allkeys-lru"),
        other => panic!("expected EvictingPolicy, got {other:?}"),
    }
    let err = RedisStore::connect(&server.url).await.unwrap_err().to_string();
    assert!(err.contains("noeviction") && err.contains(".allow_eviction(true)"), "{err}");
    let store = RedisStore::builder(&server.url)
        .expect("url")
        .allow_eviction(true)
        .connect()
        .await
        .expect("allowed");
    let mut conn = store.connection().clone();
    let s = ServerSettings::read(&mut conn).await.expect("settings");
    assert_eq!(s.is_persistent(), Some(false));
}

#[tokio::test]
async fn persistence_is_detected() {
    let Some(server) = spawn(&["--appendonly", "yes"]) else { return };
    let store = RedisStore::connect(&server.url).await.expect("noeviction is accepted");
    let s = ServerSettings::read(&mut store.connection().clone()).await.expect("settings");
    assert!(s.aof);
    assert_eq!(s.is_persistent(), Some(true));
    assert!(s.is_noeviction());
}

#[tokio::test]
async fn shared_server_passes_the_check() {
    let Some(url) = common::url() else { return };
    let store = RedisStore::connect(&url).await.expect("the shared server is noeviction");
    let s = ServerSettings::read(&mut store.connection().clone()).await.expect("settings");
    assert!(s.is_noeviction(), "{s:?}");
}

#[tokio::test]
async fn bad_namespace_is_refused() {
    let err =
        RedisStore::builder("redis://127.0.0.1/").expect("url").namespace("a}{b").unwrap_err();
    assert!(matches!(err, Error::InvalidNamespace { .. }), "{err}");
}

fn info_field(info: &str, name: &str) -> i64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(-1)
}

fn calls(stats: &str, cmd: &str) -> i64 {
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{cmd}:calls=")))
        .and_then(|v| v.split(',').next()?.parse().ok())
        .unwrap_or(0)
}

fn evalsha_calls(stats: &str) -> i64 {
    calls(stats, "evalsha")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_share_one_connection_and_a_batch_is_one_round_trip() {
    let Some(server) = spawn(&["--appendonly", "no"]) else { return };
    let store = RedisStore::connect(&server.url).await.expect("connect");
    let req = |i: usize| {
        ClaimRequest::new(
            DedupKey::new("pipe", format!("k-{i}")).expect("key"),
            None,
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
    };
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let s = store.clone();
            let r = req(i);
            tokio::spawn(async move { s.claim(&r).await })
        })
        .collect();
    for t in tasks {
        assert!(matches!(t.await.expect("task").expect("claim"), Claim::Acquired(_)));
    }
    let mut conn = store.connection().clone();
    let clients: String =
        redis::cmd("INFO").arg("clients").query_async(&mut conn).await.expect("info");
    let stats: String = redis::cmd("INFO").arg("stats").query_async(&mut conn).await.expect("info");
    assert_eq!(info_field(&clients, "connected_clients"), 1, "64 tasks, one connection");
    // The store's connection, plus the one `spawn` pinged the server with.
    assert_eq!(info_field(&stats, "total_connections_received"), 2);

    let stats = |mut conn: idem_redis::RedisConnection| async move {
        let s: String =
            redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.expect("info");
        (evalsha_calls(&s), calls(&s, "set"), calls(&s, "get"), calls(&s, "time"))
    };

    // Fresh keys: one script (the batch is one atomic step) whose `SET … NX GET`s write them;
    // no `GET`, and no `TIME` (the fresh records carry the store's estimate of the server
    // clock). A first batch loads the script: EVALSHA answers NOSCRIPT once on a fresh server.
    assert!(store.fast_claim(), "Redis 7 takes the fast path");
    let _ = store.claim_many(&[req(998), req(999)]).await.expect("claim_many");
    let (e0, s0, g0, t0) = stats(conn.clone()).await;
    let reqs: Vec<ClaimRequest> = (100..400).map(req).collect();
    let claims = store.claim_many(&reqs).await.expect("claim_many");
    let (e1, s1, g1, t1) = stats(conn.clone()).await;
    assert!(claims.iter().all(|c| matches!(c, Claim::Acquired(_))));
    assert_eq!(
        (e1 - e0, s1 - s0, g1 - g0, t1 - t0),
        (1, 300, 0, 0),
        "300 fresh claims: one script, 300 SETs, no GET, no TIME"
    );

    // Released keys are decided in the same script, from the value their `SET … NX GET` found.
    for c in claims.into_iter().take(10) {
        let Claim::Acquired(lease) = c else { unreachable!() };
        store.release(lease).await.expect("release");
    }
    let (e0, ..) = stats(conn.clone()).await;
    let again = store.claim_many(&reqs[..20]).await.expect("claim_many");
    let (e1, ..) = stats(conn.clone()).await;
    assert!(again[..10].iter().all(|c| matches!(c, Claim::Acquired(l) if l.attempt() == 2)));
    assert!(again[10..].iter().all(|c| matches!(c, Claim::InProgress { .. })));
    assert_eq!(e1 - e0, 1, "10 released keys, one script call");

    // Without the fast path, the batch is one script (loaded above).
    let scripts = RedisStore::builder(&server.url)
        .expect("url")
        .fast_claim(false)
        .connect()
        .await
        .expect("connect");
    assert!(!scripts.fast_claim());
    let (e0, ..) = stats(conn.clone()).await;
    let reqs: Vec<ClaimRequest> = (400..700).map(req).collect();
    let claims = scripts.claim_many(&reqs).await.expect("claim_many");
    let (e1, ..) = stats(conn.clone()).await;
    assert!(claims.iter().all(|c| matches!(c, Claim::Acquired(_))));
    assert_eq!(e1 - e0, 1, "300 claims, one script call");
}

/// A store that coalesces completions, on `server`.
async fn coalescing(server: &common::Server) -> RedisStore {
    RedisStore::builder(&server.url)
        .expect("url")
        .coalesce_completions(true)
        .connect()
        .await
        .expect("connect")
}

/// Claims the fresh key `k-<i>`.
async fn claim_fresh(store: &RedisStore, i: usize) -> (ClaimRequest, Lease) {
    let req = ClaimRequest::new(
        DedupKey::new("coalesce", format!("k-{i}")).expect("key"),
        None,
        Duration::from_secs(30),
        Duration::from_secs(60),
    );
    let Claim::Acquired(l) = store.claim(&req).await.expect("claim") else { panic!() };
    (req, l)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_completions_share_a_script() {
    let Some(server) = spawn(&["--appendonly", "no"]) else { return };
    let store = coalescing(&server).await;
    let mut conn = store.connection().clone();
    let n: i64 = 200;
    let mut leases = Vec::new();
    for i in 0..200 {
        leases.push(claim_fresh(&store, i).await);
    }
    // Load the script first, so the count below is of calls only.
    let (req0, l0) = leases.pop().expect("lease");
    let copy = Lease::new(l0.key().clone(), None, l0.token(), 1, l0.until(), None);
    store.complete(l0, Some(b"r"), Duration::from_secs(60)).await.expect("complete");
    let before: String =
        redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.expect("info");
    let mut reqs = vec![req0];
    let mut done = Vec::new();
    for (req, l) in leases {
        reqs.push(req);
        let s = store.clone();
        done.push(tokio::spawn(
            async move { s.complete(l, Some(b"r"), Duration::from_secs(60)).await },
        ));
    }
    for d in done {
        d.await.expect("task").expect("complete");
    }
    let after: String =
        redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.expect("info");
    let scripts = evalsha_calls(&after) - evalsha_calls(&before);
    assert!(scripts < (n - 1) / 2, "{} completions in {scripts} scripts", n - 1);
    // Every answer is the record's own: completed with its result, and a repeat is fenced.
    for req in &reqs {
        let Claim::Completed(r) = store.claim(req).await.expect("claim") else { panic!() };
        assert_eq!(r.result.as_deref(), Some(&b"r"[..]));
    }
    let again = store.complete(copy, None, Duration::from_secs(60)).await;
    assert!(matches!(again, Err(idem_core::StoreError::LeaseLost { .. })), "{again:?}");
}

/// Completions whose callers are cancelled mid-flight strand nothing: the queue is handed on,
/// and later completions are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_coalesced_completions_strand_nothing() {
    let Some(server) = spawn(&["--appendonly", "no"]) else { return };
    let store = coalescing(&server).await;
    for round in 0..20 {
        let mut tasks = Vec::new();
        for i in 0..16 {
            let (_, l) = claim_fresh(&store, round * 100 + i).await;
            let s = store.clone();
            tasks.push(tokio::spawn(
                async move { s.complete(l, None, Duration::from_secs(60)).await },
            ));
        }
        tokio::task::yield_now().await;
        for t in &tasks[..8] {
            t.abort();
        }
        for t in tasks.into_iter().skip(8) {
            let answer = tokio::time::timeout(Duration::from_secs(5), t).await;
            assert!(matches!(answer, Ok(Ok(Ok(())))), "round {round}: {answer:?}");
        }
    }
    let (req, l) = claim_fresh(&store, 9_999).await;
    tokio::time::timeout(Duration::from_secs(5), store.complete(l, None, Duration::from_secs(60)))
        .await
        .expect("a later completion is answered")
        .expect("complete");
    assert!(matches!(store.claim(&req).await.expect("claim"), Claim::Completed(_)));
}

/// A consumer at one message in flight sends the completion of message k and the claim of
/// message k + 1 in one pipeline: one completion script and one plain `SET` (no claim script,
/// no `TIME`), and a batch of one claimed alone is a plain `SET` too. A script the server lost
/// (`NOSCRIPT`: flushed, or a restart) is sent again, for the completion and for a batch claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_and_the_next_claim_are_one_write() {
    let Some(server) = spawn(&["--appendonly", "no"]) else { return };
    let store = RedisStore::connect(&server.url).await.expect("connect");
    let mut conn = store.connection().clone();
    let req = |i: usize| {
        ClaimRequest::new(
            DedupKey::new("ride", format!("k-{i}")).expect("key"),
            None,
            Duration::from_secs(30),
            Duration::from_secs(60),
        )
    };
    let done = |lease: Lease| Completion {
        lease,
        result: Some(b"r".to_vec()),
        retain_for: Duration::from_secs(60),
    };
    let stats = |mut conn: idem_redis::RedisConnection| async move {
        let s: String =
            redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.expect("info");
        (evalsha_calls(&s), calls(&s, "set"), calls(&s, "time"), calls(&s, "script|load"))
    };
    let acquired = |claims: Result<Vec<Claim>, idem_core::StoreError>| -> Vec<Lease> {
        claims
            .expect("claim half")
            .into_iter()
            .map(|c| match c {
                Claim::Acquired(l) => l,
                other => panic!("expected a fresh key acquired, got {other:?}"),
            })
            .collect()
    };

    let (t0, s0) = (stats(conn.clone()).await.2, stats(conn.clone()).await.1);
    let mut lease = acquired(store.claim_many(&[req(0)]).await).pop().expect("lease");
    let (_, s1, t1, _) = stats(conn.clone()).await;
    assert_eq!((s1 - s0, t1 - t0 <= 1), (1, true), "a batch of one: one plain SET");

    // The first completion script on this server: NOSCRIPT, loaded, sent again.
    let (completed, claims) = store.complete_and_claim(vec![done(lease)], &[req(1)]).await;
    assert!(completed.expect("complete half")[0].is_ok());
    lease = acquired(claims).pop().expect("lease");
    for i in 2..12 {
        let (e0, s0, t0, _) = stats(conn.clone()).await;
        let (completed, claims) = store.complete_and_claim(vec![done(lease)], &[req(i)]).await;
        let (e1, s1, t1, _) = stats(conn.clone()).await;
        assert!(completed.expect("complete half")[0].is_ok());
        lease = acquired(claims).pop().expect("lease");
        // commandstats counts the script's own `SET` too: 2 = the completion's + the claim's.
        assert_eq!((e1 - e0, s1 - s0, t1 - t0), (1, 2, 0), "one script, one plain SET, no TIME");
    }

    // Scripts flushed: both the completion and a batch claim are loaded and sent again.
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut conn).await.expect("flush");
    let (.., l0) = stats(conn.clone()).await;
    let (completed, claims) =
        store.complete_and_claim(vec![done(lease)], &[req(20), req(21)]).await;
    assert!(completed.expect("complete half after SCRIPT FLUSH")[0].is_ok());
    let leases = acquired(claims);
    let (.., l1) = stats(conn.clone()).await;
    assert_eq!((leases.len(), l1 - l0), (2, 2), "both scripts loaded again");
    let key = req(11).key;
    match store.claim(&req(11)).await.expect("claim") {
        Claim::Completed(rec) => assert_eq!(rec.result.as_deref(), Some(&b"r"[..]), "{key}"),
        other => panic!("{key} must be completed, got {other:?}"),
    }
}
