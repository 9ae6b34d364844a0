//! `idem bench`: SQLite store throughput beside the bare SQL primitive, in the same run, on the
//! same kind of database file, through the same driver.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use idem::engine::HandlerError;
use idem::extract::Message;
use idem::sqlite::SqliteStore;
use idem::{Claim, ClaimRequest, DedupKey, DedupStore, Engine, Outcome};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

/// Settings of a benchmark run.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchArgs {
    /// Messages per measurement.
    #[arg(long, default_value_t = 5000)]
    messages: usize,
    /// Keys per batch for the batched measurements.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Concurrent tasks for the per-message measurements (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    concurrency: Vec<usize>,
    /// SQLite `synchronous` mode: `full` (durable on power loss) or `normal`.
    #[arg(long, default_value = "full", value_parser = ["full", "normal"])]
    synchronous: String,
    /// Directory for the database files (default: a temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
}

struct Row {
    name: String,
    ops: usize,
    elapsed: Duration,
}

impl Row {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

fn opts(path: &Path, sync: SqliteSynchronous) -> SqliteConnectOptions {
    SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(sync)
        .busy_timeout(Duration::from_secs(5))
}

async fn raw_pool(path: &Path, sync: SqliteSynchronous) -> anyhow::Result<SqlitePool> {
    let pool = SqlitePoolOptions::new().max_connections(1).connect_with(opts(path, sync)).await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS raw (k BLOB PRIMARY KEY NOT NULL, state INTEGER NOT NULL) WITHOUT ROWID")
        .execute(&pool)
        .await?;
    Ok(pool)
}

fn key_bytes(run: &str, i: usize) -> Vec<u8> {
    DedupKey::new(run, format!("m-{i}")).map(|k| k.hash().0.to_vec()).unwrap_or_default()
}

async fn timed<F, Fut>(name: String, ops: usize, f: F) -> anyhow::Result<Row>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let started = Instant::now();
    f().await?;
    let row = Row { name, ops, elapsed: started.elapsed() };
    eprintln!("  {:<58} {:>10.0} /s", row.name, row.rate());
    Ok(row)
}

/// Splits `0..n` over `c` tasks and runs `f(i)` for each index.
async fn spread<F, Fut>(n: usize, c: usize, f: F) -> anyhow::Result<()>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = anyhow::Result<()>> + Send,
{
    let f = Arc::new(f);
    let mut tasks = Vec::new();
    for t in 0..c {
        let f = Arc::clone(&f);
        tasks.push(tokio::spawn(async move {
            let mut i = t;
            while i < n {
                f(i).await?;
                i += c;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(())
}

pub(crate) async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let tmp = tempfile::tempdir()?;
    let dir = args.dir.clone().unwrap_or_else(|| tmp.path().to_owned());
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let sync = if args.synchronous == "full" {
        SqliteSynchronous::Full
    } else {
        SqliteSynchronous::Normal
    };
    let n = args.messages;
    let b = args.batch.max(1);
    eprintln!(
        "idem bench: SQLite (WAL, synchronous={}), {n} messages per row, files in {}",
        args.synchronous,
        dir.display()
    );
    let mut rows = Vec::new();

    // Bare primitives through sqlx, one connection, same file settings.
    let raw = raw_pool(&dir.join("raw.sqlite"), sync).await?;
    let p = raw.clone();
    rows.push(
        timed("raw: INSERT … ON CONFLICT DO NOTHING, 1 key per commit".into(), n, || async move {
            for i in 0..n {
                sqlx::query("INSERT INTO raw VALUES (?1, 0) ON CONFLICT DO NOTHING")
                    .bind(key_bytes("raw1", i))
                    .execute(&p)
                    .await?;
            }
            Ok(())
        })
        .await?,
    );
    let p = raw.clone();
    rows.push(
        timed(
            "raw: INSERT then UPDATE (claim + complete), 2 commits per key".into(),
            n,
            || async move {
                for i in 0..n {
                    let k = key_bytes("raw2", i);
                    sqlx::query("INSERT INTO raw VALUES (?1, 0) ON CONFLICT DO NOTHING")
                        .bind(&k)
                        .execute(&p)
                        .await?;
                    sqlx::query("UPDATE raw SET state = 1 WHERE k = ?1")
                        .bind(&k)
                        .execute(&p)
                        .await?;
                }
                Ok(())
            },
        )
        .await?,
    );
    let p = raw.clone();
    rows.push(
        timed(
            format!("raw: INSERT … ON CONFLICT DO NOTHING, {b} keys per commit"),
            n,
            || async move {
                for chunk in (0..n).collect::<Vec<_>>().chunks(b) {
                    let mut tx = p.begin().await?;
                    for &i in chunk {
                        sqlx::query("INSERT INTO raw VALUES (?1, 0) ON CONFLICT DO NOTHING")
                            .bind(key_bytes("raw3", i))
                            .execute(&mut *tx)
                            .await?;
                    }
                    tx.commit().await?;
                }
                Ok(())
            },
        )
        .await?,
    );
    raw.close().await;

    let store = SqliteStore::open_with(opts(&dir.join("idem.sqlite"), sync)).await?;
    let lease = Duration::from_secs(30);
    let keep = Duration::from_secs(86_400);
    let req = move |run: &str, i: usize| -> anyhow::Result<ClaimRequest> {
        Ok(ClaimRequest::new(DedupKey::new(run, format!("m-{i}"))?, None, lease, keep))
    };
    let s = store.clone();
    rows.push(
        timed("idem: SqliteStore claim, 1 key per commit".into(), n, || async move {
            for i in 0..n {
                let Claim::Acquired(_lease) = s.claim(&req("claim", i)?).await? else {
                    anyhow::bail!("key {i} not acquired")
                };
            }
            Ok(())
        })
        .await?,
    );
    for &c in &args.concurrency {
        let s = store.clone();
        let run = format!("cc-{c}");
        rows.push(
            timed(format!("idem: claim + complete per message, {c} task(s)"), n, || async move {
                spread(n, c, move |i| {
                    let (s, run) = (s.clone(), run.clone());
                    async move {
                        let Claim::Acquired(l) = s.claim(&req(&run, i)?).await? else {
                            anyhow::bail!("key {i} not acquired")
                        };
                        s.complete(l, Some(b"ok"), keep).await?;
                        Ok(())
                    }
                })
                .await
            })
            .await?,
        );
    }
    let s = store.clone();
    rows.push(
        timed(format!("idem: claim_many({b}), one commit per batch"), n, || async move {
            for chunk in (0..n).collect::<Vec<_>>().chunks(b) {
                let reqs =
                    chunk.iter().map(|&i| req("many", i)).collect::<anyhow::Result<Vec<_>>>()?;
                let claims = s.claim_many(&reqs).await?;
                anyhow::ensure!(
                    claims.iter().all(|c| matches!(c, Claim::Acquired(_))),
                    "batch not acquired"
                );
            }
            Ok(())
        })
        .await?,
    );
    let consumer =
        Engine::builder(store.clone()).scope("engine").lease(lease).retain(keep).build()?;
    rows.push(
        timed(
            "idem: Consumer::process end to end (no-op handler), 1 task".into(),
            n,
            || async move {
                for i in 0..n {
                    let msg =
                        Message::new(format!(r#"{{"n":{i}}}"#)).with_message_id(format!("m-{i}"));
                    let out: Outcome<u8, String> = consumer
                        .process(&msg, |_ctx| async { Ok::<u8, HandlerError<String>>(1) })
                        .await;
                    anyhow::ensure!(
                        matches!(out, Outcome::Processed(1)),
                        "message {i}: {}",
                        out.kind().as_str()
                    );
                }
                Ok(())
            },
        )
        .await?,
    );
    store.pool().close().await;

    let peak = peak_rss_kib();
    println!();
    println!(
        "| measurement (SQLite WAL, synchronous={}) | ops/s | ops | seconds |",
        args.synchronous
    );
    println!("| --- | ---: | ---: | ---: |");
    for r in &rows {
        println!("| {} | {:.0} | {} | {:.2} |", r.name, r.rate(), r.ops, r.elapsed.as_secs_f64());
    }
    println!();
    let rate = |prefix: &str| rows.iter().find(|r| r.name.starts_with(prefix)).map(Row::rate);
    if let (Some(idem), Some(raw)) =
        (rate("idem: SqliteStore claim, 1"), rate("raw: INSERT … ON CONFLICT DO NOTHING, 1"))
    {
        println!("claim vs bare insert (1 commit each): {:.2}×", idem / raw);
    }
    if let (Some(idem), Some(raw)) =
        (rate("idem: claim + complete per message, 1"), rate("raw: INSERT then UPDATE"))
    {
        println!("claim + complete vs bare insert + update (2 commits each): {:.2}×", idem / raw);
    }
    if let (Some(idem), Some(raw)) =
        (rate("idem: claim_many"), rate(&format!("raw: INSERT … ON CONFLICT DO NOTHING, {b}")))
    {
        println!("claim_many({b}) vs bare {b}-row transaction: {:.2}×", idem / raw);
    }
    match peak {
        Some(kib) => println!("peak memory (VmHWM): {:.1} MiB", kib as f64 / 1024.0),
        None => println!("peak memory: unavailable (no /proc/self/status)"),
    }
    Ok(())
}

/// Peak resident set size of this process, from Linux's `/proc/self/status`.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
