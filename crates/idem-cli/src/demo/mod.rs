//! `idem demo`: the order-processing story, naive consumer versus idem consumer, same traffic.
//!
//! An order service consumes `OrderPlaced` messages whose message id is the order id. The
//! producer retries sends (duplicates), consumers crash at random points (after the claim,
//! mid-effect, after the database commit, before the ack), leases and visibility timeouts run
//! out, four consumers compete, and one message reuses an order id with different content.
//! Every order must be stored once and charged once through an external payment API.

mod payment;
mod queue;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use idem::engine::{HandlerError, Verb};
use idem::extract::Message;
use idem::sqlite::SqliteStore;
use idem::{DedupKey, Engine, Fingerprint, Outcome, TxInbox as _};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};

use payment::PaymentApi;
use queue::{Delivery, Queue};

/// Settings of one demo run.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DemoArgs {
    /// Number of distinct orders.
    #[arg(long, default_value_t = 2000)]
    orders: usize,
    /// Competing consumers.
    #[arg(long, default_value_t = 4)]
    consumers: usize,
    /// Probability that a delivery crashes its consumer (at a random point).
    #[arg(long, default_value_t = 0.03)]
    crash_rate: f64,
    /// Probability that the producer sends an order twice (a retried send).
    #[arg(long, default_value_t = 0.10)]
    dup_rate: f64,
    /// Queue visibility timeout in milliseconds (an unacked message comes back after it).
    #[arg(long, default_value_t = 300)]
    visibility_ms: u64,
    /// idem lease in milliseconds.
    #[arg(long, default_value_t = 250)]
    lease_ms: u64,
    /// Random seed (traffic and crash points).
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// SQLite file to use (default: a temporary file, deleted afterwards).
    #[arg(long)]
    store: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Naive,
    Idem,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CrashPoint {
    AfterClaim,
    MidEffect,
    AfterCommit,
    BeforeAck,
}

/// A crash armed for one delivery: at its point the handler signals and never returns, and the
/// worker drops everything in flight, as a killed process would.
struct Crash {
    point: Option<CrashPoint>,
    signal: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
}

impl Crash {
    async fn at(&self, p: CrashPoint) {
        if self.point == Some(p) {
            if let Some(tx) = self.signal.lock().unwrap_or_else(|e| e.into_inner()).take() {
                let _ = tx.send(());
            }
            std::future::pending::<()>().await;
        }
    }
}

struct Traffic {
    messages: Vec<Message>,
    order_ids: Vec<String>,
    conflict_id: String,
    original_cents: u64,
}

fn order_json(id: &str, cents: u64) -> String {
    format!(r#"{{"type":"OrderPlaced","order_id":"{id}","customer":"c-{id}","cents":{cents}}}"#)
}

fn traffic(args: &DemoArgs) -> Traffic {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut messages = Vec::new();
    let mut order_ids = Vec::new();
    let mut cents_of = HashMap::new();
    for n in 0..args.orders {
        let id = format!("order-{n:06}");
        let cents = rng.random_range(500..50_000u64);
        let msg = Message::new(order_json(&id, cents)).with_message_id(&id);
        messages.push(msg.clone());
        if rng.random::<f64>() < args.dup_rate {
            // The producer's retry lands a few positions later: both copies may be in flight.
            let at = (messages.len() + rng.random_range(0..8usize)).min(messages.len());
            messages.insert(at, msg);
        }
        cents_of.insert(id.clone(), cents);
        order_ids.push(id);
    }
    // One order id reused for different content, sent last.
    let conflict_id = order_ids[order_ids.len() / 3].clone();
    let original_cents = cents_of[&conflict_id];
    messages.push(
        Message::new(order_json(&conflict_id, original_cents + 1)).with_message_id(&conflict_id),
    );
    Traffic { messages, order_ids, conflict_id, original_cents }
}

#[derive(Debug, Default)]
struct Report {
    deliveries: u64,
    duplicate_deliveries: u64,
    crashes: u64,
    rows: u64,
    stored_twice: u64,
    charged_twice: u64,
    charged_orders: u64,
    conflicts_dead_lettered: u64,
    other_dead_letters: Vec<String>,
    lost: u64,
    conflict_row_wrong: bool,
    drained: bool,
    elapsed: Duration,
    orders: usize,
}

impl Report {
    fn rate(&self) -> f64 {
        self.orders as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    fn anomalies(&self) -> Vec<String> {
        let mut a = Vec::new();
        if !self.drained {
            a.push("the queue did not drain: messages were left unacked".to_owned());
        }
        if self.stored_twice > 0 {
            a.push(format!("{} orders stored more than once", self.stored_twice));
        }
        if self.charged_twice > 0 {
            a.push(format!("{} customers charged more than once", self.charged_twice));
        }
        if self.lost > 0 {
            a.push(format!("{} orders never stored", self.lost));
        }
        if self.conflicts_dead_lettered != 1 {
            a.push(format!(
                "{} conflicting messages dead-lettered, expected exactly 1",
                self.conflicts_dead_lettered
            ));
        }
        if self.conflict_row_wrong {
            a.push("the reused order id's stored row is not the original order".to_owned());
        }
        for d in &self.other_dead_letters {
            a.push(format!("unexpected dead letter: {d}"));
        }
        a
    }
}

/// Runs the demo; returns whether the idem run was free of anomalies.
pub(crate) async fn run(args: DemoArgs) -> anyhow::Result<bool> {
    let tmp = tempfile::tempdir().context("creating a temporary directory")?;
    let path = args.store.clone().unwrap_or_else(|| tmp.path().join("idem-demo.sqlite"));
    let t = traffic(&args);
    println!(
        "idem demo: {} orders, {} messages sent ({} producer duplicates, 1 order id reused with other content),",
        t.order_ids.len(),
        t.messages.len(),
        t.messages.len() - t.order_ids.len() - 1
    );
    println!(
        "           {} competing consumers crashing on {:.0}% of deliveries, visibility timeout {} ms, lease {} ms",
        args.consumers,
        args.crash_rate * 100.0,
        args.visibility_ms,
        args.lease_ms
    );
    println!("           store: {}\n", path.display());

    let opts = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // Survives the process crashes the demo simulates; see `idem bench` for FULL.
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(5));
    let store = SqliteStore::open_with(opts).await.context("opening the SQLite store")?;
    let nonce = format!("{:08x}", rand::rng().random::<u32>());

    let naive = run_mode(Mode::Naive, &args, &t, &store, &nonce).await?;
    let idem = run_mode(Mode::Idem, &args, &t, &store, &nonce).await?;
    print_table(&naive, &idem);

    let anomalies = idem.anomalies();
    println!();
    if anomalies.is_empty() {
        println!(
            "naive: {} double charges, {} duplicate orders, the reused id stored silently.",
            naive.charged_twice, naive.stored_twice
        );
        println!(
            "idem:  every order stored once and charged once; the reused id was dead-lettered and reported."
        );
        Ok(true)
    } else {
        println!("ANOMALIES in the idem run:");
        for a in anomalies {
            println!("  - {a}");
        }
        Ok(false)
    }
}

async fn run_mode(
    mode: Mode,
    args: &DemoArgs,
    t: &Traffic,
    store: &SqliteStore,
    nonce: &str,
) -> anyhow::Result<Report> {
    let name = match mode {
        Mode::Naive => "naive",
        Mode::Idem => "idem",
    };
    let table = format!("orders_{name}_{nonce}");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (order_id TEXT NOT NULL, cents INTEGER NOT NULL, charge_id INTEGER NOT NULL)"
    )))
    .execute(store.pool())
    .await?;
    let queue = Arc::new(Queue::new(t.messages.clone(), Duration::from_millis(args.visibility_ms)));
    let payments = Arc::new(PaymentApi::default());
    let consumer = Engine::builder(store.clone())
        .scope(format!("orders-payment-{nonce}"))
        .lease(Duration::from_millis(args.lease_ms))
        .retain(Duration::from_secs(86_400))
        .build()?;
    let inbox = store.inbox(Duration::from_secs(86_400));
    let db_scope = format!("orders-db-{nonce}");
    let rng = Arc::new(Mutex::new(StdRng::seed_from_u64(args.seed ^ 0x5eed)));
    let crashes = Arc::new(std::sync::atomic::AtomicU64::new(0));

    let bar = indicatif::ProgressBar::new(t.messages.len() as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{prefix:>6} [{bar:40}] {pos}/{len} messages settled",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_prefix(name);
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..args.consumers {
        let w = Worker {
            mode,
            queue: Arc::clone(&queue),
            payments: Arc::clone(&payments),
            consumer: consumer.clone(),
            inbox: inbox.clone(),
            pool: store.pool().clone(),
            table: table.clone(),
            db_scope: db_scope.clone(),
            rng: Arc::clone(&rng),
            crash_rate: args.crash_rate,
            crashes: Arc::clone(&crashes),
        };
        workers.push(tokio::spawn(w.run()));
    }
    let all = futures_util::future::join_all(workers);
    tokio::pin!(all);
    let deadline = tokio::time::sleep(Duration::from_secs(120));
    tokio::pin!(deadline);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let drained = loop {
        tokio::select! {
            res = &mut all => {
                for r in res { r??; }
                break true;
            }
            _ = &mut deadline => break false,
            _ = tick.tick() => bar.set_position(queue.progress().0 as u64),
        }
    };
    bar.set_position(queue.progress().0 as u64);
    bar.finish();
    let elapsed = started.elapsed();

    let rows: Vec<(String, i64)> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT order_id, cents FROM {table}")))
            .fetch_all(store.pool())
            .await?;
    let mut per_order: HashMap<&str, Vec<i64>> = HashMap::new();
    for (id, cents) in &rows {
        per_order.entry(id.as_str()).or_default().push(*cents);
    }
    let dead = queue.dead_letters();
    let mut report = Report {
        deliveries: queue.deliveries(),
        crashes: crashes.load(std::sync::atomic::Ordering::SeqCst),
        rows: rows.len() as u64,
        stored_twice: per_order.values().filter(|v| v.len() > 1).count() as u64,
        charged_twice: payments.charged_twice() as u64,
        charged_orders: payments.charged_orders() as u64,
        lost: t.order_ids.iter().filter(|id| !per_order.contains_key(id.as_str())).count() as u64,
        conflict_row_wrong: per_order
            .get(t.conflict_id.as_str())
            .is_none_or(|v| v.iter().any(|c| u64::try_from(*c).ok() != Some(t.original_cents))),
        drained,
        elapsed,
        orders: t.order_ids.len(),
        ..Report::default()
    };
    report.duplicate_deliveries = report.deliveries.saturating_sub(t.order_ids.len() as u64);
    for (msg, reason) in dead {
        if reason.starts_with("conflict")
            && msg.message_id.as_deref() == Some(t.conflict_id.as_str())
        {
            report.conflicts_dead_lettered += 1;
        } else {
            report.other_dead_letters.push(format!("{:?}: {reason}", msg.message_id));
        }
    }
    Ok(report)
}

struct Worker {
    mode: Mode,
    queue: Arc<Queue>,
    payments: Arc<PaymentApi>,
    consumer: Engine<SqliteStore>,
    inbox: idem::sqlite::SqliteInbox,
    pool: sqlx::SqlitePool,
    table: String,
    db_scope: String,
    rng: Arc<Mutex<StdRng>>,
    crash_rate: f64,
    crashes: Arc<std::sync::atomic::AtomicU64>,
}

struct Order {
    id: String,
    cents: u64,
}

fn parse(msg: &Message) -> Option<Order> {
    let v: serde_json::Value = serde_json::from_slice(&msg.payload).ok()?;
    Some(Order { id: v.get("order_id")?.as_str()?.to_owned(), cents: v.get("cents")?.as_u64()? })
}

impl Worker {
    async fn run(self) -> anyhow::Result<()> {
        while let Some(d) = self.queue.receive().await {
            let point = {
                let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
                (rng.random::<f64>() < self.crash_rate).then(|| match rng.random_range(0..4) {
                    0 => CrashPoint::AfterClaim,
                    1 => CrashPoint::MidEffect,
                    2 => CrashPoint::AfterCommit,
                    _ => CrashPoint::BeforeAck,
                })
            };
            let (tx, rx) = tokio::sync::oneshot::channel();
            let crash = Crash { point, signal: Mutex::new(Some(tx)) };
            let work = async {
                match self.mode {
                    Mode::Naive => self.naive(&d, &crash).await,
                    Mode::Idem => self.idem(&d, &crash).await,
                }
            };
            tokio::select! {
                biased;
                _ = rx => {
                    // Crashed: everything in flight is dropped, nothing is acked; the consumer
                    // restarts and the queue redelivers after the visibility timeout.
                    self.crashes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                res = work => res?,
            }
        }
        Ok(())
    }

    /// What many consumers do: charge with a key per attempt (or none), insert, ack.
    async fn naive(&self, d: &Delivery, crash: &Crash) -> anyhow::Result<()> {
        let Some(o) = parse(&d.message) else {
            self.queue.dead_letter(d, "unparseable".into());
            return Ok(());
        };
        crash.at(CrashPoint::AfterClaim).await;
        let charge = self.payments.charge(&format!("delivery-{}", d.receipt), &o.id, o.cents).await;
        crash.at(CrashPoint::MidEffect).await;
        let mut conn = self.pool.acquire().await?;
        insert(&mut conn, &self.table, &o, charge).await?;
        drop(conn);
        crash.at(CrashPoint::AfterCommit).await;
        crash.at(CrashPoint::BeforeAck).await;
        self.queue.ack(d);
        Ok(())
    }

    /// Two-phase claim for the payment (order id's downstream key as the payment's idempotency
    /// key) and a transactional inbox for the order row; ack only after both are durable.
    async fn idem(&self, d: &Delivery, crash: &Crash) -> anyhow::Result<()> {
        let outcome = self
            .consumer
            .process(&d.message, |ctx| async move {
                crash.at(CrashPoint::AfterClaim).await;
                let o = parse(&d.message)
                    .ok_or_else(|| HandlerError::Permanent("unparseable order".to_owned()))?;
                let pay_key = ctx.downstream_key().unwrap_or_default().to_owned();
                let charge = self.payments.charge(&pay_key, &o.id, o.cents).await;
                crash.at(CrashPoint::MidEffect).await;
                let key = DedupKey::new(self.db_scope.clone(), o.id.clone())
                    .map_err(|e| HandlerError::Permanent(e.to_string()))?;
                let fp = Fingerprint::of_json_bytes(&d.message.payload).ok();
                let (table, id, cents) = (self.table.clone(), o.id.clone(), o.cents);
                let stored = self
                    .inbox
                    .process(&key, fp, move |mut tx| async move {
                        insert(&mut tx, &table, &Order { id, cents }, charge)
                            .await
                            .map_err(|e| HandlerError::Transient(e.to_string()))
                    })
                    .await;
                match stored {
                    Outcome::Processed(()) | Outcome::Duplicate(_) => {}
                    Outcome::Conflict(_) => {
                        return Err(HandlerError::Permanent(
                            "order row exists with other content".to_owned(),
                        ));
                    }
                    other => return Err(HandlerError::Transient(format!("{:?}", other.verb()))),
                }
                crash.at(CrashPoint::AfterCommit).await;
                Ok::<u64, HandlerError<String>>(charge)
            })
            .await;
        crash.at(CrashPoint::BeforeAck).await;
        match outcome.verb() {
            Verb::Ack => self.queue.ack(d),
            Verb::Retry { after } => self.queue.nack(d, after.unwrap_or(Duration::from_millis(20))),
            Verb::DeadLetter { reason } => self.queue.dead_letter(d, reason),
            _ => self.queue.nack(d, Duration::from_millis(20)),
        }
        Ok(())
    }
}

async fn insert(
    conn: &mut sqlx::SqliteConnection,
    table: &str,
    o: &Order,
    charge: u64,
) -> Result<(), sqlx::Error> {
    // `table` is built from a fixed prefix and a hex nonce, never from input.
    sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {table} VALUES (?1, ?2, ?3)")))
        .bind(&o.id)
        .bind(i64::try_from(o.cents).unwrap_or(i64::MAX))
        .bind(i64::try_from(charge).unwrap_or(i64::MAX))
        .execute(conn)
        .await?;
    Ok(())
}

fn print_table(naive: &Report, idem: &Report) {
    let rows: Vec<(&str, String, String)> = vec![
        ("deliveries", naive.deliveries.to_string(), idem.deliveries.to_string()),
        (
            "duplicate deliveries",
            naive.duplicate_deliveries.to_string(),
            idem.duplicate_deliveries.to_string(),
        ),
        ("consumer crashes injected", naive.crashes.to_string(), idem.crashes.to_string()),
        ("orders stored (rows)", naive.rows.to_string(), idem.rows.to_string()),
        ("orders stored twice", naive.stored_twice.to_string(), idem.stored_twice.to_string()),
        ("orders charged", naive.charged_orders.to_string(), idem.charged_orders.to_string()),
        (
            "customers charged twice",
            naive.charged_twice.to_string(),
            idem.charged_twice.to_string(),
        ),
        (
            "conflicts dead-lettered",
            naive.conflicts_dead_lettered.to_string(),
            idem.conflicts_dead_lettered.to_string(),
        ),
        ("orders lost", naive.lost.to_string(), idem.lost.to_string()),
        (
            "messages/s (orders / wall time)",
            format!("{:.0}", naive.rate()),
            format!("{:.0}", idem.rate()),
        ),
    ];
    println!();
    println!("{:<34} {:>10} {:>10}", "", "naive", "idem");
    println!("{:-<34} {:->10} {:->10}", "", "", "");
    for (label, a, b) in rows {
        println!("{label:<34} {a:>10} {b:>10}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_can_fail() {
        let clean = Report { drained: true, conflicts_dead_lettered: 1, ..Report::default() };
        assert!(clean.anomalies().is_empty(), "{:?}", clean.anomalies());
        for bad in [
            Report { stored_twice: 1, ..clean_report() },
            Report { charged_twice: 2, ..clean_report() },
            Report { lost: 1, ..clean_report() },
            Report { conflicts_dead_lettered: 0, ..clean_report() },
            Report { drained: false, ..clean_report() },
            Report { conflict_row_wrong: true, ..clean_report() },
        ] {
            assert!(!bad.anomalies().is_empty(), "{bad:?}");
        }
    }

    fn clean_report() -> Report {
        Report { drained: true, conflicts_dead_lettered: 1, ..Report::default() }
    }

    #[test]
    fn traffic_has_duplicates_and_one_conflict() {
        let args = DemoArgs {
            orders: 500,
            consumers: 4,
            crash_rate: 0.0,
            dup_rate: 0.1,
            visibility_ms: 300,
            lease_ms: 250,
            seed: 1,
            store: None,
        };
        let t = traffic(&args);
        assert_eq!(t.order_ids.len(), 500);
        assert!(t.messages.len() > 520, "{}", t.messages.len());
        let last = t.messages.last().unwrap();
        assert_eq!(last.message_id.as_deref(), Some(t.conflict_id.as_str()));
    }
}
