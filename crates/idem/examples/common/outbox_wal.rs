//! The WAL outbox's part of `outbox_bench`: the relay's drain rate and commit → confirmed
//! latency, on the same brokers and PostgreSQL as the table relay.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::PostgresStore;
use idem::outbox::{OutboxId, Outgoing, Publisher};
use idem::postgres::{PostgresWalOutbox, WalRelay};

use super::{Error, PAYLOAD, Timed};

/// A WAL outbox with a slot of its own (created here; [`drop`] removes it).
pub(crate) async fn outbox(store: &PostgresStore, name: &str) -> Result<PostgresWalOutbox, Error> {
    let wal = store.wal_outbox().with_slot_name(name)?.with_prefix(name)?;
    wal.create_slot().await?;
    Ok(wal)
}

/// Records per peek (`OUTBOX_BENCH_WAL_BATCH`, default 4096).
pub(crate) fn batch() -> usize {
    std::env::var("OUTBOX_BENCH_WAL_BATCH").ok().and_then(|s| s.parse().ok()).unwrap_or(4096)
}

/// Commits `n` messages (1,000 per transaction; not timed), then times the relay draining them.
pub(crate) async fn rate<P: Publisher>(
    wal: &PostgresWalOutbox,
    publisher: P,
    dest: &str,
    n: usize,
) -> Result<f64, Error> {
    for start in (0..n).step_by(1000) {
        let batch = (start..(start + 1000).min(n))
            .map(|_| Outgoing::new(dest, vec![7u8; PAYLOAD]))
            .collect();
        wal.send(batch).await?;
    }
    let relay = WalRelay::builder(wal.clone(), publisher).batch(batch()).build()?;
    let t = Instant::now();
    let report = relay.run_until_empty().await?;
    let rate = report.published as f64 / t.elapsed().as_secs_f64();
    println!("  WAL relay {rate:.0} msgs/s ({} peeks)", report.batches);
    assert_eq!(report.published, n as u64, "{report}");
    Ok(rate)
}

/// Commit returned → broker confirmed, p50 / p99 in ms, and how many: one message every 10 ms
/// (idle) or 50-message transactions back to back (load), for 4 s, the relay polling every
/// `poll`.
pub(crate) async fn latency<P: Publisher>(
    wal: &PostgresWalOutbox,
    publisher: P,
    dest: &str,
    load: bool,
    poll: Duration,
) -> Result<(f64, f64, usize), Error> {
    let confirmed = Arc::new(Mutex::new(HashMap::new()));
    let timed = Timed { inner: publisher, confirmed: Arc::clone(&confirmed) };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let relay = WalRelay::builder(wal.clone(), timed).batch(batch()).poll_interval(poll).build()?;
    let task = tokio::spawn(async move {
        relay
            .run(async move {
                let _ = stop_rx.await;
            })
            .await
    });
    let mut committed: Vec<(OutboxId, Instant)> = Vec::new();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let mut tx = wal.pool().begin().await?;
        let rows = if load { 50 } else { 1 };
        let mut ids = Vec::with_capacity(rows);
        for _ in 0..rows {
            ids.push(wal.enqueue(&mut tx, Outgoing::new(dest, vec![7u8; PAYLOAD])).await?);
        }
        tx.commit().await?;
        let at = Instant::now();
        committed.extend(ids.into_iter().map(|id| (id, at)));
        if !load {
            tokio::time::sleep(Duration::from_millis(10)).await; // the idle producer's pace
        }
    }
    let measured = super::confirmed_latency(&committed, &confirmed).await;
    let _ = stop_tx.send(());
    task.await??;
    Ok(measured)
}

/// Drops the slot (and its publication).
pub(crate) async fn drop(wal: &PostgresWalOutbox) -> Result<(), Error> {
    wal.drop_slot().await?;
    Ok(())
}
