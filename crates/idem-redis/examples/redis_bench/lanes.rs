//! The peers' workload through a [`Consumer`] over the in-process queue: one handler at a
//! time per lane, as a sequential consumer of a broker would run it. Pipelined (`c` shapes),
//! the claim of message k + 1 goes out while message k's handler runs and its completion is
//! recorded; unpipelined (`s` shapes), each message pays its claim and its completion in turn.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use idem_core::consumer::{MemoryDelivery, MemoryQueue};
use idem_core::engine::{Context, HandlerError};
use idem_core::extract::JsonPointer;
use idem_core::{Consumer, DedupKey};
use idem_redis::RedisStore;

use super::{BoxErr, LEASE, RETAIN, receipt, run_id};

/// One run: `lanes` × `batch`, pipelined or not; messages/s and whether every unique message
/// ran exactly once and every copy was answered as a duplicate.
pub(crate) async fn run(
    url: &str,
    lines: &[String],
    ids: &Arc<HashMap<String, usize>>,
    lanes: usize,
    batch: usize,
    pipelined: bool,
) -> Result<(f64, bool), BoxErr> {
    let store = RedisStore::builder(url)?.namespace(&run_id())?.connect().await?;
    let q = MemoryQueue::new();
    for l in lines {
        q.push("", l.as_bytes().to_vec());
    }
    let consumer = Consumer::builder(q.clone())
        .store(store)
        .scope("orders")
        .key(JsonPointer::new("/message_id"))
        .lease(LEASE)
        .retain(RETAIN)
        .batch(batch)
        .concurrency(lanes)
        .pipeline(pipelined)
        .idle_wait(Duration::from_millis(10))
        .build()
        .await?;
    let runs: Arc<Vec<AtomicU32>> = Arc::new((0..ids.len()).map(|_| AtomicU32::new(0)).collect());
    let (r, ids2) = (runs.clone(), ids.clone());
    let handler = move |ctx: Context, m: MemoryDelivery| {
        let (r, ids) = (r.clone(), ids2.clone());
        async move {
            let id = ctx.key().map(DedupKey::id).unwrap_or_default();
            if let Some(&ix) = ids.get(id) {
                r[ix].fetch_add(1, Ordering::Relaxed);
            }
            receipt(m.payload()).map_err(|e| HandlerError::Permanent(e.to_string()))
        }
    };
    let started = Instant::now();
    let report = consumer.run(handler, q.drained()).await?;
    let rate = lines.len() as f64 / started.elapsed().as_secs_f64();
    let unique = ids.len() as u64;
    let once = runs.iter().all(|n| n.load(Ordering::Relaxed) == 1)
        && report.processed == unique
        && report.duplicates == lines.len() as u64 - unique
        && report.acked == lines.len() as u64;
    Ok((rate, once))
}
