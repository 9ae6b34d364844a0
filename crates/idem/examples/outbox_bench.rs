//! Outbox relay throughput beside a bare publish-with-confirms loop to the same broker, same
//! run; and commit-to-confirmed latency with `LISTEN/NOTIFY` and with polling.
//!
//! ```sh
//! cargo run --release -p idem-consumer --features amqp,nats,postgres --example outbox_bench -- [messages] [rounds]
//! ```
//!
//! Throughput, per broker (RabbitMQ, NATS JetStream), alternating `rounds` times:
//! - **bare**: the broker client alone — publish in windows of 256, wait for every confirmation
//!   of a window, next window (what a hand-written producer with confirms does);
//! - **relay**: `messages` rows already committed in a PostgreSQL outbox; the relay (batch 256,
//!   2 loops) leases, publishes with confirms and marks them sent until none is left.
//!
//! - **WAL relay**: `messages` committed into the WAL outbox (`pg_logical_emit_message`, 1,000
//!   per transaction), drained from its slot by a `WalRelay` (4,096 records per peek).
//!
//! Latency (RabbitMQ): a producer commits one outbox row every 10 ms (idle) or 50-row
//! transactions back to back (load) while a relay runs; the time from each commit returning to
//! the broker's confirmation, p50/p99, with the relay woken by `LISTEN/NOTIFY` or polling every
//! 100 ms; then the WAL relay polling its slot every 20 ms (its default) and every 100 ms.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem::PostgresStore;
use idem::amqp::AmqpPublisher;
use idem::amqp::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
    QueuePurgeOptions,
};
use idem::amqp::lapin::types::FieldTable;
use idem::amqp::lapin::{BasicProperties, Connection, ConnectionProperties};
use idem::nats::JetStreamPublisher;
use idem::nats::async_nats::{self, HeaderMap, jetstream};
use idem::outbox::{
    OutboxCounts, OutboxError, OutboxId, OutboxMessage, OutboxStore, Outgoing, Pending,
    PublishError, PublishFailure, Publisher, Relay, Ticket, UnsentRow,
};
use idem::sqlx::{self, AssertSqlSafe};
use idem::{PostgresOutbox, StoreError};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[path = "common/outbox_wal.rs"]
mod wal;

const WINDOW: usize = 256;
const PAYLOAD: usize = 200;
/// The relay's default retention of sent rows.
const KEEP: Duration = Duration::from_secs(24 * 3600);

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(3);
    let pg = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let amqp = std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let nats = std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let sfx = std::process::id();
    let schema = format!("outbox_bench_{sfx}");
    let store = PostgresStore::connect(&pg).await?.with_schema(&schema)?;
    let outbox = store.outbox();
    outbox.migrate().await?;
    let wal = wal::outbox(&store, &schema).await?;
    println!(
        "{n} messages of {PAYLOAD} bytes, {rounds} rounds; PostgreSQL outbox, relay batch {} × {} loops",
        relay_batch(),
        relay_lanes()
    );

    // `OUTBOX_BENCH_ONLY=amqp`, `=nats` or `=latency` runs one part alone.
    let only = std::env::var("OUTBOX_BENCH_ONLY").unwrap_or_default();
    let runs = |part: &str| only.is_empty() || only == part;
    // RabbitMQ
    let conn = Connection::connect(&amqp, ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let queue = format!("outbox-bench-{sfx}");
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await?;
    let (mut bare, mut relayed, mut deleting, mut walled) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..if runs("amqp") { rounds } else { 0 } {
        let t = Instant::now();
        for start in (0..n).step_by(WINDOW) {
            let mut confirms = Vec::with_capacity(WINDOW);
            for i in start..(start + WINDOW).min(n) {
                let props = BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(format!("m-{i}").into());
                confirms.push(
                    ch.basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        BasicPublishOptions::default(),
                        &[7u8; PAYLOAD],
                        props,
                    )
                    .await?,
                );
            }
            for c in confirms {
                c.await?;
            }
        }
        bare.push(n as f64 / t.elapsed().as_secs_f64());
        ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default()).await?;
        let publisher = AmqpPublisher::new(conn.create_channel().await?).await?;
        relayed.push(relay_rate(&outbox, publisher, &queue, n, KEEP).await?);
        ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default()).await?;
        let publisher = AmqpPublisher::new(conn.create_channel().await?).await?;
        deleting.push(relay_rate(&outbox, publisher, &queue, n, Duration::ZERO).await?);
        ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default()).await?;
        let publisher = AmqpPublisher::new(conn.create_channel().await?).await?;
        walled.push(wal::rate(&wal, publisher, &queue, n).await?);
        ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default()).await?;
    }
    if runs("amqp") {
        report("RabbitMQ", &bare, &relayed, &deleting, &walled);
    }

    // NATS JetStream
    let client = async_nats::connect(&nats).await?;
    let js = jetstream::new(client);
    let (stream, subject) = (format!("OUTBOX_BENCH_{sfx}"), format!("outbox.bench.{sfx}"));
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        duplicate_window: Duration::from_secs(1),
        ..Default::default()
    })
    .await?;
    let (mut bare, mut relayed, mut deleting, mut walled) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..if runs("nats") { rounds } else { 0 } {
        let t = Instant::now();
        for start in (0..n).step_by(WINDOW) {
            let mut acks = Vec::with_capacity(WINDOW);
            for i in start..(start + WINDOW).min(n) {
                let mut h = HeaderMap::new();
                h.insert("Nats-Msg-Id", format!("r{round}-m-{i}").as_str());
                acks.push(
                    js.publish_with_headers(subject.clone(), h, vec![7u8; PAYLOAD].into()).await?,
                );
            }
            for a in acks {
                a.await?;
            }
        }
        bare.push(n as f64 / t.elapsed().as_secs_f64());
        let publisher = JetStreamPublisher::new(js.clone());
        relayed.push(relay_rate(&outbox, publisher, &subject, n, KEEP).await?);
        let publisher = JetStreamPublisher::new(js.clone());
        deleting.push(relay_rate(&outbox, publisher, &subject, n, Duration::ZERO).await?);
        walled.push(wal::rate(&wal, JetStreamPublisher::new(js.clone()), &subject, n).await?);
    }
    if runs("nats") {
        report("NATS JetStream", &bare, &relayed, &deleting, &walled);
    }
    js.delete_stream(&stream).await?;

    // Latency, RabbitMQ.
    for (load, label) in
        if runs("latency") { vec![(false, "idle"), (true, "under load")] } else { vec![] }
    {
        for notify in [true, false] {
            let publisher = AmqpPublisher::new(conn.create_channel().await?).await?;
            let (p50, p99, count) = latency(&store, publisher, &queue, load, notify).await?;
            let wake = if notify { "LISTEN/NOTIFY" } else { "polling 100 ms" };
            println!(
                "latency commit → confirmed, {label}, {wake}: p50 {p50:.1} ms, p99 {p99:.1} ms ({count} messages)"
            );
            ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default()).await?;
        }
        for poll in [Duration::from_millis(20), Duration::from_millis(100)] {
            let publisher = AmqpPublisher::new(conn.create_channel().await?).await?;
            let (p50, p99, count) = wal::latency(&wal, publisher, &queue, load, poll).await?;
            println!(
                "latency commit → confirmed, {label}, WAL relay polling {poll:?}: p50 {p50:.1} ms, p99 {p99:.1} ms ({count} messages)"
            );
            ch.queue_purge(queue.as_str().into(), QueuePurgeOptions::default()).await?;
        }
    }

    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await?;
    wal::drop(&wal).await?;
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(store.pool())
        .await?;
    Ok(())
}

/// Rows per claim (`OUTBOX_BENCH_BATCH`, default 256).
fn relay_batch() -> usize {
    std::env::var("OUTBOX_BENCH_BATCH").ok().and_then(|s| s.parse().ok()).unwrap_or(WINDOW)
}

/// Relay loops (`OUTBOX_BENCH_LANES`, default 2).
fn relay_lanes() -> usize {
    std::env::var("OUTBOX_BENCH_LANES").ok().and_then(|s| s.parse().ok()).unwrap_or(2)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn report(broker: &str, bare: &[f64], relayed: &[f64], deleting: &[f64], walled: &[f64]) {
    let show = |v: &[f64]| v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(" / ");
    let line = |what: &str, v: &[f64]| {
        println!("{broker}: {what:<34} {} msgs/s (median {:.0})", show(v), median(v));
    };
    line("bare publish-with-confirms", bare);
    line("relay, sent rows kept 24 h", relayed);
    line("relay, rows deleted when confirmed", deleting);
    line("WAL relay", walled);
    println!(
        "{broker}: relay / bare = {:.2}× (kept), {:.2}× (deleted)",
        median(relayed) / median(bare),
        median(deleting) / median(bare)
    );
    println!("{broker}: WAL relay / bare = {:.2}×", median(walled) / median(bare));
}

/// Fills the outbox with `n` committed rows (not timed), then times the relay draining them.
async fn relay_rate<P: Publisher>(
    outbox: &PostgresOutbox,
    publisher: P,
    dest: &str,
    n: usize,
    retain_sent: Duration,
) -> Result<f64, Error> {
    for start in (0..n).step_by(1000) {
        let batch = (start..(start + 1000).min(n))
            .map(|_| Outgoing::new(dest, vec![7u8; PAYLOAD]))
            .collect();
        outbox.send(batch).await?;
    }
    let spent = Arc::new(Spent::default());
    let store = Profiled { inner: outbox.clone(), spent: Arc::clone(&spent) };
    let publisher = Profiled { inner: publisher, spent: Arc::clone(&spent) };
    let relay = Relay::builder(store, publisher)
        .batch(relay_batch())
        .concurrency(relay_lanes())
        .retain_sent(retain_sent)
        .build()?;
    let t = Instant::now();
    let report = relay.run_until_empty().await?;
    let wall = t.elapsed();
    let rate = report.published as f64 / wall.as_secs_f64();
    let mode = if retain_sent.is_zero() { "deleted when confirmed" } else { "sent rows kept" };
    println!(
        "  relay ({mode}) {rate:.0} msgs/s; time inside (summed over loops): {}",
        spent.show(wall)
    );
    assert_eq!(report.published, n as u64, "{report}");
    outbox.purge_sent(Duration::ZERO, usize::MAX).await?;
    Ok(rate)
}

/// Time spent in each relay step, summed over its loops.
#[derive(Default)]
struct Spent {
    claim: Mutex<Duration>,
    publish: Mutex<Duration>,
    mark: Mutex<Duration>,
}

impl Spent {
    fn add(slot: &Mutex<Duration>, d: Duration) {
        *slot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) += d;
    }

    fn show(&self, wall: Duration) -> String {
        let get =
            |m: &Mutex<Duration>| *m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let pct = |d: Duration| 100.0 * d.as_secs_f64() / wall.as_secs_f64();
        format!(
            "claim {:.0} %, publish {:.0} %, mark sent {:.0} % of wall time",
            pct(get(&self.claim)),
            pct(get(&self.publish)),
            pct(get(&self.mark))
        )
    }
}

/// A store or publisher that times its calls into a [`Spent`].
struct Profiled<T> {
    inner: T,
    spent: Arc<Spent>,
}

impl<S: OutboxStore> OutboxStore for Profiled<S> {
    async fn send(&self, m: Vec<Outgoing>) -> Result<Vec<OutboxId>, OutboxError> {
        self.inner.send(m).await
    }
    async fn claim(&self, limit: usize, lease: Duration) -> Result<Vec<Pending>, StoreError> {
        let t = Instant::now();
        let r = self.inner.claim(limit, lease).await;
        Spent::add(&self.spent.claim, t.elapsed());
        r
    }
    async fn mark_sent(&self, tickets: &[Ticket]) -> Result<u64, StoreError> {
        let t = Instant::now();
        let r = self.inner.mark_sent(tickets).await;
        Spent::add(&self.spent.mark, t.elapsed());
        r
    }
    async fn remove_sent(&self, tickets: &[Ticket]) -> Result<u64, StoreError> {
        let t = Instant::now();
        let r = self.inner.remove_sent(tickets).await;
        Spent::add(&self.spent.mark, t.elapsed());
        r
    }
    async fn mark_failed(&self, f: &[PublishFailure]) -> Result<u64, StoreError> {
        self.inner.mark_failed(f).await
    }
    async fn purge_sent(&self, d: Duration, limit: usize) -> Result<u64, StoreError> {
        self.inner.purge_sent(d, limit).await
    }
    async fn retry_parked(&self, limit: usize) -> Result<u64, StoreError> {
        self.inner.retry_parked(limit).await
    }
    async fn counts(&self) -> Result<OutboxCounts, StoreError> {
        self.inner.counts().await
    }

    async fn unsent(&self, limit: usize) -> Result<Vec<UnsentRow>, StoreError> {
        self.inner.unsent(limit).await
    }
}

impl<P: Publisher> Publisher for Profiled<P> {
    async fn publish(&self, batch: &[OutboxMessage]) -> Vec<Result<(), PublishError>> {
        let t = Instant::now();
        let r = self.inner.publish(batch).await;
        Spent::add(&self.spent.publish, t.elapsed());
        r
    }
}

/// An outbox whose relay polls instead of listening.
#[derive(Clone)]
struct Polling(PostgresOutbox);

impl OutboxStore for Polling {
    async fn send(&self, m: Vec<Outgoing>) -> Result<Vec<OutboxId>, OutboxError> {
        self.0.send(m).await
    }
    async fn claim(&self, limit: usize, lease: Duration) -> Result<Vec<Pending>, StoreError> {
        self.0.claim(limit, lease).await
    }
    async fn mark_sent(&self, t: &[Ticket]) -> Result<u64, StoreError> {
        self.0.mark_sent(t).await
    }
    async fn remove_sent(&self, t: &[Ticket]) -> Result<u64, StoreError> {
        self.0.remove_sent(t).await
    }
    async fn mark_failed(&self, f: &[PublishFailure]) -> Result<u64, StoreError> {
        self.0.mark_failed(f).await
    }
    async fn purge_sent(&self, d: Duration, limit: usize) -> Result<u64, StoreError> {
        self.0.purge_sent(d, limit).await
    }
    async fn retry_parked(&self, limit: usize) -> Result<u64, StoreError> {
        self.0.retry_parked(limit).await
    }
    async fn counts(&self) -> Result<OutboxCounts, StoreError> {
        self.0.counts().await
    }

    async fn unsent(&self, limit: usize) -> Result<Vec<UnsentRow>, StoreError> {
        self.0.unsent(limit).await
    }
}

/// A publisher that notes when each message was confirmed.
struct Timed<P> {
    inner: P,
    confirmed: Arc<Mutex<HashMap<OutboxId, Instant>>>,
}

impl<P: Publisher> Publisher for Timed<P> {
    async fn publish(&self, batch: &[OutboxMessage]) -> Vec<Result<(), PublishError>> {
        let out = self.inner.publish(batch).await;
        let now = Instant::now();
        let mut c = self.confirmed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (m, r) in batch.iter().zip(&out) {
            if r.is_ok() {
                c.entry(m.id().clone()).or_insert(now);
            }
        }
        out
    }
}

async fn latency<P: Publisher>(
    store: &PostgresStore,
    publisher: P,
    dest: &str,
    load: bool,
    notify: bool,
) -> Result<(f64, f64, usize), Error> {
    let outbox = store.outbox();
    let confirmed = Arc::new(Mutex::new(HashMap::new()));
    let timed = Timed { inner: publisher, confirmed: Arc::clone(&confirmed) };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let stop = async move {
        let _ = stop_rx.await;
    };
    let poll = if notify { Duration::from_secs(1) } else { Duration::from_millis(100) };
    let relay_task = {
        let outbox = outbox.clone();
        tokio::spawn(async move {
            if notify {
                let relay = Relay::builder(outbox, timed)
                    .batch(WINDOW)
                    .concurrency(2)
                    .poll_interval(poll)
                    .build()?;
                relay.run(stop).await
            } else {
                let relay = Relay::builder(Polling(outbox), timed)
                    .batch(WINDOW)
                    .concurrency(2)
                    .poll_interval(poll)
                    .build()?;
                relay.run(stop).await
            }
        })
    };
    // Let the relay reach its first wait (and LISTEN) before measuring.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut committed: Vec<(OutboxId, Instant)> = Vec::new();
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        let mut tx = store.pool().begin().await?;
        let rows = if load { 50 } else { 1 };
        let mut ids = Vec::with_capacity(rows);
        for _ in 0..rows {
            ids.push(outbox.enqueue(&mut tx, Outgoing::new(dest, vec![7u8; PAYLOAD])).await?);
        }
        tx.commit().await?;
        let at = Instant::now();
        committed.extend(ids.into_iter().map(|id| (id, at)));
        if !load {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let measured = confirmed_latency(&committed, &confirmed).await;
    let _ = stop_tx.send(());
    relay_task.await??;
    outbox.purge_sent(Duration::ZERO, usize::MAX).await?;
    Ok(measured)
}

/// Waits (up to 30 s) until every committed message was confirmed, then gives commit →
/// confirmed p50 / p99 in ms and how many were confirmed.
async fn confirmed_latency(
    committed: &[(OutboxId, Instant)],
    confirmed: &Mutex<HashMap<OutboxId, Instant>>,
) -> (f64, f64, usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let done = confirmed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len();
        if done >= committed.len() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut ms: Vec<f64> = {
        let c = confirmed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        committed
            .iter()
            .filter_map(|(id, at)| {
                c.get(id).map(|t| t.saturating_duration_since(*at).as_secs_f64() * 1000.0)
            })
            .collect()
    };
    ms.sort_by(f64::total_cmp);
    let pct =
        |p: usize| ms.get((ms.len().saturating_sub(1)) * p / 100).copied().unwrap_or(f64::NAN);
    (pct(50), pct(99), ms.len())
}
