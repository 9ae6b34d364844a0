//! The engine's own cost per message, for `valgrind --tool=callgrind` (instruction counts are
//! repeatable where wall-clock time on two shared cores is not): `N` workload-shaped JSON
//! messages through a [`Consumer`] over the in-process queue, on tokio's current-thread
//! runtime, with a handler that does nothing. `bench/callgrind.sh` runs each path at two
//! sizes and divides the difference by the difference in messages, so start-up cost drops out.
//!
//! ```text
//! cargo build --release -p idem-testkit --example cost
//! cost PATH N
//! ```
//! Paths:
//! - `two-phase-memory`: two-phase over `MemoryStore`, batches of 64 (no I/O at all: the
//!   engine's decision, fingerprint, key, spans and the lane's futures).
//! - `two-phase-memory-1`: the same, one message per batch, pipelined (one message in flight).
//! - `inbox-sqlite`: inbox mode over SQLite (a temporary file), batches of 64.
//! - `two-phase-sqlite`: two-phase over `SqliteStore` (a temporary file), batches of 64.
//! - `bare-sqlite`: the bare durable loop's statements on the same SQLite file, batches of 64
//!   (what a user would write without idem: `INSERT … ON CONFLICT DO NOTHING` of the ids).
//! - `duplicate-memory`: `Engine::process` of a message already completed (key, fingerprint,
//!   claim answered from the store, stored result decoded).

use std::time::Duration;

use idem_core::consumer::{MemoryDelivery, MemoryQueue};
use idem_core::engine::{Backend, HandlerError};
use idem_core::extract::{JsonPointer, Message};
use idem_core::{Consumer, Engine, MemoryStore, Outcome};
use idem_sqlx::SqliteStore;

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

const BATCH: usize = 64;
const DAY: Duration = Duration::from_secs(86_400);

fn main() -> Result<(), BoxErr> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(path), Some(n)) = (args.first(), args.get(1).and_then(|n| n.parse::<usize>().ok()))
    else {
        return Err("usage: cost two-phase-memory|two-phase-memory-1|inbox-sqlite|two-phase-sqlite|bare-sqlite|duplicate-memory N".into());
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(run(path, n))
}

/// The peers' workload's shape: an id, a customer, an amount and a few fields.
fn payload(i: usize) -> Vec<u8> {
    format!(
        r#"{{"message_id":"m-{i:08}","customer_id":"c-{c:05}","amount_cents":{a},"currency":"EUR","items":[{{"sku":"s-{s}","qty":2}}],"created_at":"2026-12-07T00:00:00Z"}}"#,
        c = i % 9973,
        a = 100 + i % 5000,
        s = i % 97,
    )
    .into_bytes()
}

fn queue(n: usize) -> MemoryQueue {
    let q = MemoryQueue::new();
    for i in 0..n {
        q.push("", payload(i));
    }
    q
}

async fn run(path: &str, n: usize) -> Result<(), BoxErr> {
    let dir = tempfile::tempdir()?;
    let sqlite = || async {
        let s = SqliteStore::open(dir.path().join("idem.sqlite")).await?;
        s.migrate().await?;
        Ok::<_, BoxErr>(s)
    };
    let processed = match path {
        "two-phase-memory" => drain(n, BATCH, |b| b.store(MemoryStore::new())).await?,
        "two-phase-memory-1" => drain(n, 1, |b| b.store(MemoryStore::new())).await?,
        "inbox-sqlite" => {
            let s = sqlite().await?;
            drain(n, BATCH, |b| b.inbox(s.inbox(DAY))).await?
        }
        "two-phase-sqlite" => {
            let s = sqlite().await?;
            drain(n, BATCH, |b| b.store(s)).await?
        }
        "bare-sqlite" => {
            let s = sqlite().await?;
            bare(&s, n).await?
        }
        "duplicate-memory" => duplicates(n).await?,
        other => return Err(format!("unknown path {other}").into()),
    };
    if processed != n {
        return Err(format!("{path}: {processed} of {n} messages processed").into());
    }
    println!("{path} {n}");
    Ok(())
}

/// All `n` messages through a consumer (`batch` per fetch, pipelined); how many it processed.
async fn drain<B: Backend>(
    n: usize,
    batch: usize,
    mode: impl FnOnce(
        idem_core::consumer::Builder<MemoryQueue>,
    ) -> idem_core::consumer::Builder<MemoryQueue, B>,
) -> Result<usize, BoxErr> {
    let q = queue(n);
    let c = mode(Consumer::builder(q.clone()))
        .scope("cost")
        .key(JsonPointer::new("/message_id"))
        .retain(DAY)
        .batch(batch)
        .idle_wait(Duration::from_millis(1))
        .build()
        .await?;
    let report = c
        .run(|_, _: MemoryDelivery| async { Ok::<_, HandlerError<String>>(()) }, q.drained())
        .await?;
    Ok(usize::try_from(report.processed)?)
}

/// The bare durable loop's statements: one transaction per batch of 64 ids.
async fn bare(s: &SqliteStore, n: usize) -> Result<usize, BoxErr> {
    sqlx::query("CREATE TABLE IF NOT EXISTS bare_marks (id TEXT PRIMARY KEY)")
        .execute(s.pool())
        .await?;
    let mut done = 0;
    for chunk in (0..n).collect::<Vec<_>>().chunks(BATCH) {
        let mut tx = s.pool().begin().await?;
        let mut q = sqlx::QueryBuilder::new("INSERT INTO bare_marks (id) ");
        q.push_values(chunk, |mut b, i| {
            let v: serde_json::Value = serde_json::from_slice(&payload(*i)).unwrap_or_default();
            b.push_bind(v["message_id"].as_str().unwrap_or_default().to_owned());
        });
        q.push(" ON CONFLICT DO NOTHING");
        done += usize::try_from(q.build().execute(&mut *tx).await?.rows_affected())?;
        tx.commit().await?;
    }
    Ok(done)
}

/// `n` deliveries of one message already completed.
async fn duplicates(n: usize) -> Result<usize, BoxErr> {
    let engine = Engine::builder(MemoryStore::new())
        .scope("cost")
        .key(JsonPointer::new("/message_id"))
        .build()?;
    let msg = Message::new(payload(0));
    let handler = |_| async { Ok::<_, HandlerError<String>>(42_u32) };
    let mut dups = 0;
    let _first = engine.process(&msg, handler).await;
    for _ in 0..n {
        if let Outcome::Duplicate(Some(42)) = engine.process(&msg, handler).await {
            dups += 1;
        }
    }
    Ok(dups)
}
