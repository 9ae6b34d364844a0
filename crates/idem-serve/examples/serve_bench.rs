//! Claim + complete through an `idem serve` sidecar (HTTP/JSON and gRPC) beside the same store
//! in process and the raw Redis commands, in one run: the sidecar's overhead as a ratio.
//!
//! ```sh
//! cargo build --release -p idem-cli -p idem-serve --example serve_bench
//! $CARGO_TARGET_DIR/release/examples/serve_bench $CARGO_TARGET_DIR/release/idem [messages]
//! ```
//!
//! The sidecar is a separate `idem serve` process on a Redis store (a fresh namespace, deleted
//! at the end); the in-process store is a `RedisStore` on the same server. Each cell claims and
//! completes `messages` fresh keys with 1 and 16 tasks in flight; the median of 3 is printed,
//! and the sidecar's resident memory idle and its peak under that load.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::BufRead as _;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore};
use idem_serve::RemoteStore;
use idem_serve::grpc::pb;
use idem_serve::grpc::pb::claims_client::ClaimsClient;

const TOKEN: &str = "bench-secret-0123456789";
const REDIS: &str = "redis://127.0.0.1:6379/";
const LEASE: Duration = Duration::from_secs(30);
const RETAIN: Duration = Duration::from_secs(600);

/// Runs `one(i)` for `i` in `0..n` on `tasks` tasks; messages per second.
async fn rate<F, Fut>(n: usize, tasks: usize, one: F) -> f64
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let one = Arc::new(one);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let (one, next) = (Arc::clone(&one), Arc::clone(&next));
        set.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                one(i).await;
            }
        });
    }
    while set.join_next().await.is_some() {}
    n as f64 / started.elapsed().as_secs_f64()
}

async fn claim_complete<S: DedupStore>(store: &S, scope: &str, i: usize) {
    let key = DedupKey::new(scope, format!("k{i}")).unwrap();
    let Claim::Acquired(lease) =
        store.claim(&ClaimRequest::new(key, None, LEASE, RETAIN)).await.unwrap()
    else {
        panic!("fresh key not acquired");
    };
    store.complete(lease, Some(b"{\"ok\":true}"), RETAIN).await.unwrap();
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    let _ = idem_serve::tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().collect();
    let idem = args.get(1).expect("usage: serve_bench <path to idem> [messages]").clone();
    let n: usize = args.get(2).map_or(20_000, |s| s.parse().unwrap());
    let ns = format!("serve-bench-{}", std::process::id());

    let mut child = Command::new(&idem)
        .arg("serve")
        .env("IDEM_STORE", REDIS)
        .env("IDEM_SERVE_LISTEN", "127.0.0.1:0")
        .env("IDEM_SERVE_TOKENS", format!("bench:*:{TOKEN}"))
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start idem serve");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let base = line.trim().strip_prefix("listening on ").expect("listening line").to_owned();

    let remote = RemoteStore::new(&base).unwrap().token(TOKEN);
    let local = idem_redis::RedisStore::builder(REDIS).unwrap().namespace(&ns).unwrap();
    let local = local.connect().await.unwrap();
    let channel =
        tonic::transport::Channel::from_shared(base.clone()).unwrap().connect().await.unwrap();
    let grpc = ClaimsClient::new(channel);
    let raw = redis::Client::open(REDIS).unwrap().get_multiplexed_async_connection().await.unwrap();

    // The sidecar's memory: idle (connected, no request yet), and its peak under the load below.
    let pid = child.id();
    let idle_kib = memory_kib(pid, "VmRSS:");
    println!("messages per cell: {n}; median of 3; msgs/s (claim + complete)");
    println!(
        "| tasks | raw SET NX + SET XX | RedisStore in process | sidecar HTTP/JSON | sidecar gRPC | HTTP / in process | gRPC / in process |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for tasks in [1usize, 16] {
        let mut cells = vec![Vec::new(); 4];
        for round in 0..3 {
            let tag = format!("{ns}-{tasks}-{round}");
            let c = raw.clone();
            let t = tag.clone();
            cells[0].push(
                rate(n, tasks, move |i| {
                    let (mut c, t) = (c.clone(), t.clone());
                    async move {
                        let k = format!("idem:{{{t}}}:raw:{i}");
                        let _: Option<String> = redis::cmd("SET")
                            .arg(&k)
                            .arg("p")
                            .arg("NX")
                            .arg("PX")
                            .arg(30_000)
                            .query_async(&mut c)
                            .await
                            .unwrap();
                        let _: Option<String> = redis::cmd("SET")
                            .arg(&k)
                            .arg("done")
                            .arg("XX")
                            .arg("PX")
                            .arg(600_000)
                            .query_async(&mut c)
                            .await
                            .unwrap();
                    }
                })
                .await,
            );
            let s = local.clone();
            let scope = format!("{tag}-local");
            cells[1].push(
                rate(n, tasks, move |i| {
                    let (s, scope) = (s.clone(), scope.clone());
                    async move { claim_complete(&s, &scope, i).await }
                })
                .await,
            );
            let s = remote.clone();
            let scope = format!("{tag}-http");
            cells[2].push(
                rate(n, tasks, move |i| {
                    let (s, scope) = (s.clone(), scope.clone());
                    async move { claim_complete(&s, &scope, i).await }
                })
                .await,
            );
            let g = grpc.clone();
            let scope = format!("{tag}-grpc");
            cells[3].push(
                rate(n, tasks, move |i| {
                    let (mut g, scope) = (g.clone(), scope.clone());
                    async move {
                        let mut req = tonic::Request::new(pb::ClaimRequest {
                            scope,
                            key: format!("k{i}"),
                            ..Default::default()
                        });
                        req.metadata_mut()
                            .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
                        let a = g.claim(req).await.unwrap().into_inner();
                        let Some(pb::claim_answer::Outcome::Acquired(acq)) = a.outcome else {
                            panic!("fresh key not acquired")
                        };
                        let mut req = tonic::Request::new(pb::CompleteRequest {
                            lease: acq.lease,
                            result: Some(b"{\"ok\":true}".to_vec()),
                            retain_ms: None,
                        });
                        req.metadata_mut()
                            .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
                        g.complete(req).await.unwrap();
                    }
                })
                .await,
            );
        }
        let m: Vec<f64> = cells.into_iter().map(median).collect();
        println!(
            "| {tasks} | {:.0} | {:.0} | {:.0} | {:.0} | **{:.2}** | **{:.2}** |",
            m[0],
            m[1],
            m[2],
            m[3],
            m[2] / m[1],
            m[3] / m[1]
        );
    }
    println!(
        "sidecar memory: {} KiB resident idle; {} KiB peak (VmHWM) under the load above; {} KiB \
         resident after it",
        idle_kib,
        memory_kib(pid, "VmHWM:"),
        memory_kib(pid, "VmRSS:")
    );
    let _ = child.kill();
    let _ = child.wait();
    // The sidecar's records live in the default namespace under the bench's scopes; both
    // namespaces' keys expire with their retention (10 min) and the raw keys with theirs.
}

/// A `/proc/<pid>/status` field in KiB (`VmRSS:`, `VmHWM:`).
fn memory_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}
