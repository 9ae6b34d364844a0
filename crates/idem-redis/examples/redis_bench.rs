//! Throughput of `RedisStore` beside the raw Redis commands, of the Redis Streams adapter
//! beside the bare consumer-group loop, and the peers' workload through the idem engine; each
//! in one run, so the ratios compare like with like.
//!
//! ```text
//! cargo run --release -p idem-redis --example redis_bench -- primitives [N]
//! cargo run --release -p idem-redis --example redis_bench -- streams [N] [BATCH] [IN FLIGHT]
//! cargo run --release -p idem-redis --example redis_bench -- workload [FILE] [REPEATS]
//! ```
//! - `primitives` (median of 3 runs per cell): per message, at 1, 16 and 64 concurrent tasks
//!   sharing one multiplexed connection: `RedisStore` claim + complete; raw `SET k v NX PX
//!   60000`; raw `SET NX` then `SET XX` (the two writes a claim + complete needs); then the same
//!   with 16 messages per task per round trip (`claim_many` + 16 completes; explicit pipelines of
//!   16 for the raw commands).
//! - `streams`: `N` entries (default 20,000) read through a consumer group, `BATCH` (default 64)
//!   per read and `IN FLIGHT` (default 1) batches at once, timed from the first read to the last
//!   acknowledgement: the bare `XREADGROUP COUNT batch` + `XACK` loop, then the adapter with a
//!   no-op handler, two-phase over `MemoryStore`, `SqliteStore`, `PostgresStore` and
//!   `RedisStore`, and in inbox mode over SQLite, PostgreSQL and MariaDB; then the bare loop
//!   again. Each row shows its ratio to the mean of the two bare rows. PostgreSQL from
//!   `IDEM_TEST_POSTGRES_URL`, MariaDB from `IDEM_TEST_MYSQL_URL`; what it creates is dropped.
//! - `workload`: `/tmp/peers/workload.jsonl` (from `../shared/peers/setup_peers.sh`) through
//!   `Consumer::process` at 1, 16 and 64 tasks, and through `Consumer::process_batch` (one
//!   `claim_many` per batch of 16 or 64), key = JSON `/message_id`, with the peers' handler and
//!   exactly-once check; shapes `cLxB` and `sLxB` run it through a `Consumer` over the
//!   in-process queue instead (`L` lanes, batches of `B`; `c` pipelined, `s` not), so `c1x1`
//!   is a sequential consumer, one handler at a time. Records carry a 60 s TTL, so nothing
//!   needs cleaning up.

#[path = "redis_bench/durable.rs"]
mod durable;
#[path = "redis_bench/lanes.rs"]
mod lanes;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_core::engine::{Context, HandlerError};
use idem_core::extract::{JsonPointer, Message};
use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, Engine, Outcome};
use idem_redis::RedisStore;
use serde::{Deserialize, Serialize};

const LEASE: Duration = Duration::from_secs(30);
const RETAIN: Duration = Duration::from_secs(60);
const BATCH: usize = 16;
/// `workload` shapes, tasks × messages per `process_batch` (1: `process`), from
/// `IDEM_BENCH_SHAPES` (`1x1,16x1`) or these.
const SHAPES: &str = "1x1,16x1,32x1,64x1,1x16,2x16,1x32,4x64";

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// `IDEM_BENCH_WORKERS` sets the runtime's worker threads (default: one per core).
fn main() -> Result<(), BoxErr> {
    let workers = std::env::var("IDEM_BENCH_WORKERS").ok();
    // `0`: tokio's current-thread runtime, everything on the main thread (as a one-message-at-a-
    // time consumer would run: no wake-up crosses threads).
    let mut rt = match workers.as_deref() {
        Some("0") => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    if let Some(n) = workers.and_then(|v| v.parse().ok()).filter(|&n: &usize| n > 0) {
        rt.worker_threads(n);
    }
    rt.enable_all().build()?.block_on(run())
}

async fn run() -> Result<(), BoxErr> {
    let url = std::env::var("IDEM_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into());
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("primitives") => {
            let n = args.get(1).map_or(Ok(100_000), |s| s.parse())?;
            primitives(&url, n).await
        }
        // For profiling: only the store's claim + complete, `store TASKS PER_CALL N [scripts|coalesce|wait]`.
        Some("store") => {
            let tasks = args.get(1).map_or(Ok(16), |s| s.parse())?;
            let per_call = args.get(2).map_or(Ok(1), |s| s.parse())?;
            let n = args.get(3).map_or(Ok(200_000), |s| s.parse())?;
            let variant = args.get(4).map_or("", String::as_str);
            let mut b = RedisStore::builder(&url)?
                .namespace(&run_id())?
                .fast_claim(variant != "scripts")
                .coalesce_completions(variant == "coalesce");
            if variant == "wait" {
                b = b.wait_for_replicas(1, Duration::from_secs(1));
            }
            let store = b.connect().await?;
            let rate = store_rate(&store, n, tasks, per_call).await?;
            println!("store {tasks} tasks x {per_call}: {rate:.0} msgs/s");
            Ok(())
        }
        Some("cluster") => {
            let n = args.get(1).map_or(Ok(60_000), |s| s.parse())?;
            cluster(&url, n).await
        }
        Some("wait") => {
            let n = args.get(1).map_or(Ok(60_000), |s| s.parse())?;
            wait_cost(&url, n).await
        }
        Some("workload") => {
            let file = args.get(1).map_or("/tmp/peers/workload.jsonl", String::as_str);
            let repeats = args.get(2).map_or(Ok(3), |s| s.parse())?;
            workload(&url, file, repeats).await
        }
        Some("streams") => {
            let n = args.get(1).map_or(Ok(20_000), |s| s.parse())?;
            let batch = args.get(2).map_or(Ok(64), |s| s.parse())?;
            let lanes = args.get(3).map_or(Ok(1), |s| s.parse())?;
            streams::run(&url, n, batch, lanes).await
        }
        _ => Err("usage: redis_bench primitives [N] | workload [FILE] [REPEATS] | streams [N] [BATCH] [IN FLIGHT]"
            .into()),
    }
}

fn run_id() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!("bench-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Median of three runs of [`drive`], each with its own key range (`run` is added to `i`).
async fn median3<F, Fut>(n: usize, tasks: usize, per_call: usize, op: F) -> Result<f64, BoxErr>
where
    F: Fn(usize) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = Result<(), BoxErr>> + Send,
{
    let mut rates = Vec::new();
    for run in 0..3 {
        let op = op.clone();
        rates.push(drive(n, tasks, per_call, move |i| op(run * 10_000_000 + i)).await?);
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[1])
}

/// Runs `op(i)` for i in 0..n (stepping by `per_call`) over `tasks` concurrent tasks; returns
/// items per second.
async fn drive<F, Fut>(n: usize, tasks: usize, per_call: usize, op: F) -> Result<f64, BoxErr>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<(), BoxErr>> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let op = Arc::new(op);
    let started = Instant::now();
    let mut handles = Vec::new();
    for _ in 0..tasks {
        let next = next.clone();
        let op = op.clone();
        handles.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(per_call, Ordering::Relaxed);
                if i >= n {
                    return Ok::<_, BoxErr>(());
                }
                op(i).await?;
            }
        }));
    }
    for h in handles {
        h.await??;
    }
    Ok(n as f64 / started.elapsed().as_secs_f64())
}

async fn set_nx(conn: &mut impl redis::aio::ConnectionLike, key: &str) -> Result<(), BoxErr> {
    let r: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg("v")
        .arg("NX")
        .arg("PX")
        .arg(60_000)
        .query_async(conn)
        .await?;
    if r.is_none() {
        return Err(format!("{key} existed").into());
    }
    Ok(())
}

/// One message per call (claim + complete), or `per_call` per call (`claim_many` + concurrent
/// completes).
async fn store_rate(
    store: &RedisStore,
    n: usize,
    tasks: usize,
    per_call: usize,
) -> Result<f64, BoxErr> {
    let run = run_id();
    let s = store.clone();
    median3(n, tasks, per_call, move |i| {
        let s = s.clone();
        let r = run.clone();
        async move {
            let reqs = (i..i + per_call)
                .map(|j| {
                    DedupKey::new(r.clone(), format!("m-{j}"))
                        .map(|k| ClaimRequest::new(k, None, LEASE, RETAIN))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let claims = if per_call == 1 {
                vec![s.claim(&reqs[0]).await?]
            } else {
                s.claim_many(&reqs).await?
            };
            let done = claims.into_iter().map(|c| {
                let s = s.clone();
                async move {
                    match c {
                        Claim::Acquired(l) => {
                            s.complete(l, None, RETAIN).await.map_err(BoxErr::from)
                        }
                        _ => Err(BoxErr::from("not acquired")),
                    }
                }
            });
            for d in futures_util::future::join_all(done).await {
                d?;
            }
            Ok(())
        }
    })
    .await
}

async fn primitives(url: &str, n: usize) -> Result<(), BoxErr> {
    let store = RedisStore::builder(url)?.namespace(&run_id())?.connect().await?;
    let scripts =
        RedisStore::builder(url)?.namespace(&run_id())?.fast_claim(false).connect().await?;
    let conn = store.connection().clone();
    println!(
        "| tasks | msgs per round trip | RedisStore claim+complete | scripts only (before) | raw SET NX PX | raw SET NX + SET XX | store / raw 2-cmd |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for tasks in [1usize, 16, 32, 64] {
        let n = if tasks == 1 { n / 4 } else { n } / BATCH * BATCH;
        let run = run_id();
        let st = store_rate(&store, n, tasks, 1).await?;
        let sc = store_rate(&scripts, n, tasks, 1).await?;
        let c = conn.clone();
        let r = run.clone();
        let raw1 = median3(n, tasks, 1, move |i| {
            let mut c = c.clone();
            let key = format!("bench:{r}:a:{i}");
            async move { set_nx(&mut c, &key).await }
        })
        .await?;
        let c = conn.clone();
        let r = run.clone();
        let raw2 = median3(n, tasks, 1, move |i| {
            let mut c = c.clone();
            let key = format!("bench:{r}:b:{i}");
            async move {
                set_nx(&mut c, &key).await?;
                let _: Option<String> = redis::cmd("SET")
                    .arg(&key)
                    .arg("done")
                    .arg("XX")
                    .arg("PX")
                    .arg(60_000)
                    .query_async(&mut c)
                    .await?;
                Ok(())
            }
        })
        .await?;
        println!("| {tasks} | 1 | {st:.0} | {sc:.0} | {raw1:.0} | {raw2:.0} | {:.2} |", st / raw2);

        // Batches of 16 per round trip.
        let stb = store_rate(&store, n, tasks, BATCH).await?;
        let scb = store_rate(&scripts, n, tasks, BATCH).await?;
        let c = conn.clone();
        let r = run.clone();
        let rawb1 = median3(n, tasks, BATCH, move |i| {
            let mut c = c.clone();
            let mut p = redis::pipe();
            for j in i..i + BATCH {
                p.cmd("SET")
                    .arg(format!("bench:{r}:c:{j}"))
                    .arg("v")
                    .arg("NX")
                    .arg("PX")
                    .arg(60_000);
            }
            async move {
                let _: Vec<Option<String>> = p.query_async(&mut c).await?;
                Ok(())
            }
        })
        .await?;
        let c = conn.clone();
        let r = run.clone();
        let rawb2 = median3(n, tasks, BATCH, move |i| {
            let mut c = c.clone();
            let mut p1 = redis::pipe();
            let mut p2 = redis::pipe();
            for j in i..i + BATCH {
                let k = format!("bench:{r}:d:{j}");
                p1.cmd("SET").arg(&k).arg("v").arg("NX").arg("PX").arg(60_000);
                p2.cmd("SET").arg(&k).arg("done").arg("XX").arg("PX").arg(60_000);
            }
            async move {
                let _: Vec<Option<String>> = p1.query_async(&mut c).await?;
                let _: Vec<Option<String>> = p2.query_async(&mut c).await?;
                Ok(())
            }
        })
        .await?;
        println!(
            "| {tasks} | {BATCH} | {stb:.0} | {scb:.0} | {rawb1:.0} | {rawb2:.0} | {:.2} |",
            stb / rawb2
        );
    }
    Ok(())
}

/// The cluster's node URLs: `IDEM_REDIS_CLUSTER_URLS` (comma-separated) or ports 7000-7002.
fn cluster_urls() -> Vec<String> {
    std::env::var("IDEM_REDIS_CLUSTER_URLS")
        .unwrap_or_else(|_| {
            "redis://127.0.0.1:7000/,redis://127.0.0.1:7001/,redis://127.0.0.1:7002/".into()
        })
        .split(',')
        .map(str::to_owned)
        .collect()
}

/// Claim + complete on the single server beside the cluster: one namespace (one master), and
/// three namespaces on three masters with the tasks split between them.
async fn cluster(url: &str, n: usize) -> Result<(), BoxErr> {
    let urls = cluster_urls();
    let on_cluster = |ns: String| {
        let urls = urls.clone();
        async move {
            RedisStore::cluster_builder(urls.iter().map(String::as_str))?
                .namespace(&ns)?
                .connect()
                .await
        }
    };
    // Three namespaces whose slots are on three different masters.
    let probe = on_cluster(run_id()).await?;
    let mut spread: Vec<RedisStore> = Vec::new();
    let mut masters = std::collections::HashSet::new();
    for i in 0..200 {
        let ns = format!("{}-{i}", run_id());
        let v: redis::Value = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(format!("idem:{{{ns}}}:"))
            .query_async(&mut probe.connection().clone())
            .await?;
        let slot: i64 = redis::from_redis_value(v)?;
        let shard = slot * 3 / 16384; // `redis-cli --cluster create` splits slots evenly
        if masters.insert(shard) {
            spread.push(on_cluster(ns).await?);
        }
        if spread.len() == 3 {
            break;
        }
    }
    println!(
        "| tasks | single server | cluster, 1 namespace | cluster, 3 namespaces on 3 masters | cluster / single (1 ns) | (3 ns) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    // Tasks in all: the 3-namespace column gives each namespace a third of them.
    for tasks in [3usize, 48, 96] {
        let n = if tasks == 3 { n / 4 } else { n };
        let single = RedisStore::builder(url)?.namespace(&run_id())?.connect().await?;
        let one = on_cluster(run_id()).await?;
        let s = store_rate(&single, n, tasks, 1).await?;
        let c1 = store_rate(&one, n, tasks, 1).await?;
        let started = Instant::now();
        let per = tasks / 3;
        let runs = spread.iter().map(|st| store_rate(st, n / 3, per, 1));
        for r in futures_util::future::join_all(runs).await {
            r?;
        }
        // Each store_rate is a median of 3 runs: 3 × n/3 × 3 messages in all.
        let c3 = (3 * (n / 3) * 3) as f64 / started.elapsed().as_secs_f64();
        println!("| {tasks} | {s:.0} | {c1:.0} | {c3:.0} | {:.2} | {:.2} |", c1 / s, c3 / s);
    }
    Ok(())
}

/// What `wait_for_replicas(1, …)` costs: claim + complete with and without it, on a server
/// with a replica (start one with `redis-server --port 6380 --replicaof 127.0.0.1 6379`).
async fn wait_cost(url: &str, n: usize) -> Result<(), BoxErr> {
    println!("| tasks | asynchronous | wait_for_replicas(1) | ratio |");
    println!("|---:|---:|---:|---:|");
    for tasks in [1usize, 16, 64] {
        let n = if tasks == 1 { n / 4 } else { n };
        let plain = RedisStore::builder(url)?.namespace(&run_id())?.connect().await?;
        let waiting = RedisStore::builder(url)?
            .namespace(&run_id())?
            .wait_for_replicas(1, Duration::from_secs(1))
            .connect()
            .await?;
        let a = store_rate(&plain, n, tasks, 1).await?;
        let w = store_rate(&waiting, n, tasks, 1).await?;
        println!("| {tasks} | {a:.0} | {w:.0} | {:.2} |", w / a);
    }
    Ok(())
}

#[derive(Deserialize)]
struct Order {
    order_id: u64,
    items: Vec<Item>,
}

#[derive(Deserialize)]
struct Item {
    qty: u64,
    price_cents: u64,
}

#[derive(Serialize, Deserialize, PartialEq, Eq, Debug, Clone)]
struct Receipt {
    order_id: u64,
    total_cents: u64,
    item_count: u64,
    status: String,
}

fn receipt(payload: &[u8]) -> Result<Receipt, serde_json::Error> {
    let o: Order = serde_json::from_slice(payload)?;
    Ok(Receipt {
        order_id: o.order_id,
        total_cents: o.items.iter().map(|i| i.qty * i.price_cents).sum(),
        item_count: o.items.iter().map(|i| i.qty).sum(),
        status: "processed".into(),
    })
}

async fn workload(url: &str, file: &str, repeats: usize) -> Result<(), BoxErr> {
    let text = std::fs::read_to_string(file)?;
    let lines: Arc<Vec<String>> = Arc::new(text.lines().map(str::to_owned).collect());
    // message_id -> index of its counter: the ledger of handler runs (it does not deduplicate).
    let mut ids: HashMap<String, usize> = HashMap::new();
    for l in lines.iter() {
        let v: serde_json::Value = serde_json::from_str(l)?;
        let id = v["message_id"].as_str().ok_or("no message_id")?.to_owned();
        let n = ids.len();
        ids.entry(id).or_insert(n);
    }
    let ids = Arc::new(ids);
    println!("workload: {} messages, {} unique", lines.len(), ids.len());
    println!("| tasks × batch | in flight | runs msgs/s | median msgs/s | exactly once |");
    println!("|---|---:|---|---:|---|");
    let shapes = std::env::var("IDEM_BENCH_SHAPES").unwrap_or_else(|_| SHAPES.to_owned());
    let shapes: Vec<(Option<bool>, usize, usize)> = shapes
        .split(',')
        .map(|s| {
            let s = s.trim();
            let (lanes, s) = match s.as_bytes().first() {
                Some(b'c') => (Some(true), &s[1..]),
                Some(b's') => (Some(false), &s[1..]),
                _ => (None, s),
            };
            let (t, b) = s.split_once('x').ok_or("shape is [c|s]TASKSxBATCH")?;
            Ok::<_, BoxErr>((lanes, t.trim().parse()?, b.trim().parse()?))
        })
        .collect::<Result<_, _>>()?;
    for (lanes, inflight, batch) in shapes {
        let mut rates = Vec::new();
        let mut all_ok = true;
        if let Some(pipelined) = lanes {
            for _ in 0..repeats {
                let (rate, once) =
                    lanes::run(url, &lines, &ids, inflight, batch, pipelined).await?;
                all_ok &= once;
                rates.push(rate);
            }
            let mut sorted = rates.clone();
            sorted.sort_by(f64::total_cmp);
            let runs: Vec<String> = rates.iter().map(|r| format!("{r:.0}")).collect();
            let mode = if pipelined { "consumer, pipelined" } else { "consumer, sequential" };
            println!(
                "| {mode} {inflight} × {batch} | {} | {} | {:.0} | {} |",
                inflight * batch,
                runs.join(" / "),
                sorted[sorted.len() / 2],
                if all_ok { "OK" } else { "FAIL" }
            );
            continue;
        }
        for _ in 0..repeats {
            let store = RedisStore::builder(url)?.namespace(&run_id())?.connect().await?;
            let consumer = Engine::builder(store)
                .scope("orders")
                .key(JsonPointer::new("/message_id"))
                .lease(LEASE)
                .retain(RETAIN)
                .build()?;
            let runs: Arc<Vec<AtomicU32>> =
                Arc::new((0..ids.len()).map(|_| AtomicU32::new(0)).collect());
            let bad = Arc::new(AtomicUsize::new(0));
            let (l, c, r, ids2, b) =
                (lines.clone(), consumer.clone(), runs.clone(), ids.clone(), bad.clone());
            let rate = drive(lines.len(), inflight, batch, move |i| {
                let (l, c, r, ids, b) = (l.clone(), c.clone(), r.clone(), ids2.clone(), b.clone());
                async move {
                    let msgs: Vec<Message> = l[i..(i + batch).min(l.len())]
                        .iter()
                        .map(|line| Message::new(line.as_bytes().to_vec()))
                        .collect();
                    let handler = |ctx: Context, m: &Message| {
                        let (r, ids) = (r.clone(), ids.clone());
                        let payload = m.payload.clone();
                        async move {
                            let id = ctx.key().map(DedupKey::id).unwrap_or_default();
                            if let Some(&ix) = ids.get(id) {
                                r[ix].fetch_add(1, Ordering::Relaxed);
                            }
                            receipt(&payload).map_err(|e| HandlerError::Permanent(e.to_string()))
                        }
                    };
                    let outcomes = if batch == 1 {
                        let m = &msgs[0];
                        vec![c.process(m, |ctx| handler(ctx, m)).await]
                    } else {
                        c.process_batch(&msgs, handler).await
                    };
                    for (m, o) in msgs.iter().zip(outcomes) {
                        let expected = receipt(&m.payload)?;
                        match o {
                            Outcome::Processed(got) | Outcome::Duplicate(Some(got))
                                if got == expected => {}
                            _ => {
                                b.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Ok(())
                }
            })
            .await?;
            let once = runs.iter().all(|n| n.load(Ordering::Relaxed) == 1)
                && bad.load(Ordering::Relaxed) == 0;
            all_ok &= once;
            rates.push(rate);
        }
        let mut sorted = rates.clone();
        sorted.sort_by(f64::total_cmp);
        let median = sorted[sorted.len() / 2];
        let runs: Vec<String> = rates.iter().map(|r| format!("{r:.0}")).collect();
        println!(
            "| {inflight} × {batch} | {} | {} | {median:.0} | {} |",
            inflight * batch,
            runs.join(" / "),
            if all_ok { "OK" } else { "FAIL" }
        );
    }
    Ok(())
}

mod streams {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use idem_core::consumer::Builder;
    use idem_core::engine::HandlerError;
    use idem_core::{Backend, MemoryStore};
    use idem_redis::{RedisStore, StreamConfig, StreamConsumer};
    use idem_sqlx::{MySqlStore, PostgresStore, SqliteStore};
    use idem_testkit::bare::BareMarks;
    use redis::aio::MultiplexedConnection;

    use super::BoxErr;

    const DAY: Duration = Duration::from_secs(86_400);
    /// The block time of both loops' reads (the adapter's idle wait).
    const BLOCK: Duration = Duration::from_millis(100);

    const MODES: [&str; 12] = [
        "bare XREADGROUP + XACK",
        "two-phase MemoryStore",
        "two-phase SqliteStore",
        "two-phase PostgresStore",
        "two-phase RedisStore",
        "inbox SQLite",
        "inbox PostgreSQL",
        "inbox MySQL",
        "bare durable SQLite",
        "bare durable PostgreSQL",
        "bare durable MySQL",
        "bare (again)",
    ];

    async fn fill(conn: &mut MultiplexedConnection, stream: &str, n: usize) -> Result<(), BoxErr> {
        for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
            let mut pipe = redis::pipe();
            for i in chunk {
                pipe.cmd("XADD")
                    .arg(stream)
                    .arg("*")
                    .arg("message_id")
                    .arg(format!("m-{i}"))
                    .arg("payload")
                    .arg(format!(r#"{{"order":{i}}}"#))
                    .ignore();
            }
            let () = pipe.query_async(conn).await?;
        }
        Ok(())
    }

    /// `lanes` loops, each on its own connection, of `XREADGROUP COUNT batch BLOCK` + one
    /// `XACK`, until `n` are acknowledged.
    async fn bare(
        client: &redis::Client,
        stream: &str,
        n: usize,
        batch: usize,
        lanes: usize,
    ) -> Result<Duration, BoxErr> {
        let mut conn = client.get_multiplexed_async_connection().await?;
        let () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream)
            .arg("bare")
            .arg("0")
            .query_async(&mut conn)
            .await?;
        let mut conns = Vec::new();
        for _ in 0..lanes {
            conns.push(client.get_multiplexed_async_connection().await?);
        }
        let done = AtomicUsize::new(0);
        let lane = |(k, mut conn): (usize, MultiplexedConnection)| {
            let done = &done;
            async move {
                while done.load(Ordering::SeqCst) < n {
                    let reply: Option<redis::streams::StreamReadReply> = redis::cmd("XREADGROUP")
                        .arg("GROUP")
                        .arg("bare")
                        .arg(format!("c{k}"))
                        .arg("COUNT")
                        .arg(batch)
                        .arg("BLOCK")
                        .arg(BLOCK.as_millis().to_string())
                        .arg("STREAMS")
                        .arg(stream)
                        .arg(">")
                        .query_async(&mut conn)
                        .await?;
                    let ids: Vec<String> = reply
                        .map(|r| r.keys)
                        .unwrap_or_default()
                        .into_iter()
                        .flat_map(|k| k.ids.into_iter().map(|e| e.id))
                        .collect();
                    if ids.is_empty() {
                        continue;
                    }
                    let _: i64 = redis::cmd("XACK")
                        .arg(stream)
                        .arg("bare")
                        .arg(&ids)
                        .query_async(&mut conn)
                        .await?;
                    done.fetch_add(ids.len(), Ordering::SeqCst);
                }
                Ok::<_, BoxErr>(())
            }
        };
        let t = Instant::now();
        for r in futures_util::future::join_all(conns.into_iter().enumerate().map(lane)).await {
            r?;
        }
        Ok(t.elapsed())
    }

    /// The adapter in the mode `mode` chooses (`.store(s)`: two-phase; `.inbox(i)`:
    /// transactional) with a no-op handler, from its first read until every entry was handled
    /// and the last batch settled.
    async fn driven<B: Backend>(
        client: &redis::Client,
        stream: &str,
        group: &str,
        mode: impl FnOnce(Builder<StreamConfig>) -> Builder<StreamConfig, B>,
        n: usize,
        batch: usize,
        lanes: usize,
    ) -> Result<Duration, BoxErr> {
        let c =
            mode(StreamConsumer::builder(StreamConfig::new(client.clone(), stream, group, "c")))
                .scope(group)
                .retain(DAY)
                .batch(batch)
                .concurrency(lanes)
                .pipeline(idem_testkit::bare::pipelined())
                .idle_wait(BLOCK)
                .build()
                .await?;
        let done = AtomicUsize::new(0);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let stop = std::sync::Mutex::new(Some(stop));
        let t = Instant::now();
        let report = c
            .run(
                |_, _| {
                    if done.fetch_add(1, Ordering::SeqCst) + 1 >= n
                        && let Some(s) = stop.lock().ok().and_then(|mut s| s.take())
                    {
                        let _ = s.send(());
                    }
                    async { Ok::<_, HandlerError<String>>(()) }
                },
                async {
                    let _ = stopped.await;
                },
            )
            .await?;
        let elapsed = t.elapsed();
        if report.processed != n as u64 || report.acked != n as u64 {
            return Err(
                format!("{group}: not every entry processed once and acked: {report}").into()
            );
        }
        if report.retried > 0 {
            // Redis cannot redeliver sooner: each retry waited for reclaim_idle (30 s).
            println!(
                "  ({group}: {} retried after {} transient failures; each waits reclaim_idle)",
                report.retried, report.failed_transient
            );
        }
        Ok(elapsed)
    }

    pub(super) async fn run(url: &str, n: usize, batch: usize, lanes: usize) -> Result<(), BoxErr> {
        let client = redis::Client::open(url)?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        let sfx = super::run_id();
        let pg_url = std::env::var("IDEM_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let my_url = std::env::var("IDEM_TEST_MYSQL_URL")
            .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
        let schema = sfx.replace('-', "_");
        let pg = PostgresStore::connect(&pg_url).await?.with_schema(&schema)?;
        let my = MySqlStore::connect(&my_url).await?.with_table_name(&schema)?;
        let dir = tempfile::tempdir()?;
        let measured =
            measure(&client, &mut conn, &sfx, url, &pg, &my, dir.path(), n, batch, lanes).await;
        // Cleaned up whatever happened.
        let keys: Vec<String> =
            redis::cmd("KEYS").arg(format!("*{sfx}*")).query_async(&mut conn).await?;
        for chunk in keys.chunks(500) {
            let _: i64 = redis::cmd("DEL").arg(chunk).query_async(&mut conn).await?;
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE")))
            .execute(pg.pool())
            .await?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS `{schema}`")))
            .execute(my.pool())
            .await?;
        let rows = measured?;
        let base = (rows[0].1 + rows[rows.len() - 1].1) / 2.0;
        println!("\n{n} entries, batch {batch}, {lanes} batch(es) in flight (no-op handler)\n");
        println!("| mode | entries/s | vs bare (mean of both runs) |\n| --- | ---: | ---: |");
        for (mode, rate) in &rows {
            println!("| {mode} | {rate:.0} | {:.2} |", rate / base);
        }
        Ok(())
    }

    /// Every mode in turn, each with its own group (the adapter's) or stream (the bare loop's).
    #[allow(clippy::too_many_arguments)]
    async fn measure(
        client: &redis::Client,
        conn: &mut MultiplexedConnection,
        sfx: &str,
        url: &str,
        pg: &PostgresStore,
        my: &MySqlStore,
        dir: &std::path::Path,
        n: usize,
        batch: usize,
        lanes: usize,
    ) -> Result<Vec<(&'static str, f64)>, BoxErr> {
        let stream = format!("{sfx}-stream");
        fill(conn, &stream, n).await?;
        pg.migrate().await?;
        my.migrate().await?;
        let mut rows = Vec::new();
        for (i, mode) in MODES.into_iter().enumerate() {
            let group = format!("g{i}");
            let (s, g) = (stream.as_str(), group.as_str());
            let took = match i {
                0 | 11 => {
                    let own = format!("{sfx}-bare{i}");
                    fill(conn, &own, n).await?;
                    bare(client, &own, n, batch, lanes).await?
                }
                1 => driven(client, s, g, |b| b.store(MemoryStore::new()), n, batch, lanes).await?,
                2 => {
                    let store = SqliteStore::open(dir.join("two-phase.sqlite")).await?;
                    driven(client, s, g, |b| b.store(store), n, batch, lanes).await?
                }
                3 => driven(client, s, g, |b| b.store(pg.clone()), n, batch, lanes).await?,
                4 => {
                    let ns = format!("{sfx}-ns");
                    let store = RedisStore::builder(url)?.namespace(&ns)?.connect().await?;
                    driven(client, s, g, |b| b.store(store), n, batch, lanes).await?
                }
                5 => {
                    let inbox = SqliteStore::open(dir.join("inbox.sqlite")).await?.inbox(DAY);
                    driven(client, s, g, |b| b.inbox(inbox), n, batch, lanes).await?
                }
                6 => driven(client, s, g, |b| b.inbox(pg.inbox(DAY)), n, batch, lanes).await?,
                7 => driven(client, s, g, |b| b.inbox(my.inbox(DAY)), n, batch, lanes).await?,
                _ => {
                    let own = format!("{sfx}-durable{i}");
                    fill(conn, &own, n).await?;
                    let table = format!("bare_{}_{i}", sfx.replace('-', "_"));
                    let marks = match i {
                        8 => {
                            let store = SqliteStore::open(dir.join("bare.sqlite")).await?;
                            BareMarks::Sqlite(store.pool().clone(), table)
                        }
                        9 => BareMarks::Postgres(pg.pool().clone(), table),
                        _ => BareMarks::MySql(my.pool().clone(), table),
                    };
                    super::durable::run(client, &own, &marks, n, batch, lanes, BLOCK).await?
                }
            };
            #[allow(clippy::cast_precision_loss)]
            let rate = n as f64 / took.as_secs_f64();
            println!("{mode:<26} {rate:>9.0} entries/s");
            rows.push((mode, rate));
        }
        Ok(rows)
    }
}
