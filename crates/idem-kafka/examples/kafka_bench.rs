//! Messages/s through the Kafka adapter beside the same consumer loop with no dedup.
//!
//! `cargo run --release -p idem-kafka --example kafka_bench [messages] [batch]`
//! (brokers from `IDEM_TEST_KAFKA_BROKERS`, PostgreSQL from `IDEM_TEST_POSTGRES_URL`, MariaDB
//! from `IDEM_TEST_MYSQL_URL`).
//!
//! One topic of 3 partitions holds `messages` records (default 20,000; 20% are producer
//! duplicates). Each row is a consumer group of its own reading the whole topic from the start,
//! timed from the first poll until every record is settled:
//! - `commit only`: the same poll-a-batch / commit-the-batch loop on rdkafka, no store;
//! - the adapter in two-phase mode over memory, SQLite and PostgreSQL;
//! - the adapter in inbox mode over SQLite, PostgreSQL and MariaDB (one transaction per batch);
//! - the adapter in offset-inbox mode over PostgreSQL (one transaction per batch; positions
//!   only, then positions with markers for producer duplicates). Positions only, the 20%
//!   duplicates run again (the idempotent-producer contract is not met by this producer on
//!   purpose: the rate is what counts there).
//!
//! `… --example kafka_bench [messages] [batch] offset` runs only `commit only` and the two
//! offset rows.
#![allow(clippy::unwrap_used, clippy::cast_precision_loss)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem_core::consumer::{Builder, Settlement};
use idem_core::engine::HandlerError;
use idem_core::engine::Verb;
use idem_core::inbox::OffsetInbox;
use idem_core::{Backend, MemoryStore};
use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::rdkafka::{ClientConfig, Message as _, Offset, TopicPartitionList};
use idem_kafka::{Delivery, KafkaConfig, KafkaConsumer};
use idem_sqlx::{MySqlStore, PostgresStore, SqliteStore};

fn config(brokers: &str, group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers).set("group.id", group).set("auto.offset.reset", "earliest");
    c
}

async fn commit_only(brokers: &str, topic: &str, group: &str, n: usize, batch: usize) -> Duration {
    let mut cc = config(brokers, group);
    cc.set("enable.auto.commit", "false").set("enable.auto.offset.store", "false");
    let c: Arc<StreamConsumer> = Arc::new(cc.create().unwrap());
    c.subscribe(&[topic]).unwrap();
    let mut seen = 0;
    let mut started = None;
    while seen < n {
        let mut offs: Vec<(i32, i64)> = Vec::new();
        let mut wait = Duration::from_secs(10);
        while offs.len() < batch {
            match tokio::time::timeout(wait, c.recv()).await {
                Ok(Ok(m)) => {
                    started.get_or_insert_with(Instant::now);
                    offs.push((m.partition(), m.offset()));
                }
                _ => break,
            }
            wait = Duration::from_millis(5);
        }
        seen += offs.len();
        let mut tpl = TopicPartitionList::new();
        for p in 0..3 {
            if let Some(o) = offs.iter().filter(|(q, _)| *q == p).map(|(_, o)| *o).max() {
                tpl.add_partition_offset(topic, p, Offset::Offset(o + 1)).unwrap();
            }
        }
        let c2 = Arc::clone(&c);
        tokio::task::spawn_blocking(move || c2.commit(&tpl, CommitMode::Sync))
            .await
            .unwrap()
            .unwrap();
    }
    let took = started.unwrap().elapsed();
    let _ =
        tokio::time::timeout(Duration::from_secs(10), tokio::task::spawn_blocking(move || drop(c)))
            .await;
    took
}

/// Runs `start` until `n` messages settled (counted by the hook); the time from the first one.
async fn timed<F, Fut>(n: usize, start: F) -> Duration
where
    F: FnOnce(
        Arc<AtomicUsize>,
        Arc<std::sync::Mutex<Option<Instant>>>,
        tokio::sync::oneshot::Receiver<()>,
    ) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let done = Arc::new(AtomicUsize::new(0));
    let first = Arc::new(std::sync::Mutex::new(None));
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(start(Arc::clone(&done), Arc::clone(&first), stopped));
    while done.load(Ordering::SeqCst) < n {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took = first.lock().unwrap().unwrap().elapsed();
    let _ = stop.send(());
    task.await.unwrap();
    took
}

fn counting(
    done: Arc<AtomicUsize>,
    first: Arc<std::sync::Mutex<Option<Instant>>>,
) -> impl Fn(&Settlement<'_, Delivery>) + Send + Sync + 'static {
    move |s| {
        first.lock().unwrap().get_or_insert_with(Instant::now);
        if !matches!(s.verb, Verb::Retry { .. }) {
            done.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// The adapter in the mode `mode` chooses (`.store(s)`: two-phase; `.inbox(i)`:
/// transactional), no-op handler.
async fn driven<B: Backend + 'static>(
    brokers: &str,
    topic: &str,
    group: &str,
    n: usize,
    batch: usize,
    mode: impl FnOnce(Builder<KafkaConfig>) -> Builder<KafkaConfig, B> + Send + 'static,
) -> Duration {
    let kafka = KafkaConfig::new(&config(brokers, group), &[topic], format!("{topic}-dlq"));
    let group = group.to_owned();
    timed(n, move |done, first, stopped| async move {
        let c = mode(KafkaConsumer::builder(kafka))
            .scope(group)
            .retain(Duration::from_secs(86_400))
            .batch(batch)
            .on_settle(counting(done, first))
            .build()
            .await
            .unwrap();
        c.run(|_, _| async { Ok::<_, HandlerError<String>>(()) }, async {
            let _ = stopped.await;
        })
        .await
        .unwrap();
    })
    .await
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(20_000);
    let brokers =
        std::env::var("IDEM_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let batch: usize = std::env::args().nth(2).and_then(|a| a.parse().ok()).unwrap_or(100);
    let pg = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let my = std::env::var("IDEM_TEST_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into());
    let sfx = format!("{}_{:06x}", std::process::id(), rand::random::<u32>() & 0xff_ffff);
    let topic = format!("idem-bench-{sfx}");
    let admin: AdminClient<DefaultClientContext> =
        ClientConfig::new().set("bootstrap.servers", &brokers).create().unwrap();
    let dlq = format!("{topic}-dlq");
    for r in admin
        .create_topics(
            &[
                NewTopic::new(&topic, 3, TopicReplication::Fixed(1)),
                NewTopic::new(&dlq, 1, TopicReplication::Fixed(1)),
            ],
            &AdminOptions::new(),
        )
        .await
        .unwrap()
    {
        r.unwrap();
    }
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("linger.ms", "5")
        // tansu 0.6.0 skips records when a fetch starts inside a multi-record batch.
        .set("batch.num.messages", "1")
        .create()
        .unwrap();
    let unique = n * 4 / 5;
    let sends = (0..n).map(|i| {
        let id = format!("m-{}", if i < unique { i } else { (i * 7) % unique });
        let body = format!(r#"{{"id":"{id}"}}"#);
        let hs =
            OwnedHeaders::new().insert(Header { key: "message-id", value: Some(id.as_bytes()) });
        let (p, topic) = (&producer, &topic);
        async move {
            p.send(
                FutureRecord::to(topic).key(id.as_bytes()).payload(body.as_bytes()).headers(hs),
                Duration::from_secs(60),
            )
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        }
    });
    futures_util::future::join_all(sends).await;
    println!("{n} messages ({unique} unique) on {topic}, 3 partitions, batches of {batch}\n");

    let dir = tempfile::tempdir().unwrap();
    let pg_store = PostgresStore::connect(&pg)
        .await
        .unwrap()
        .with_schema(&format!("idem_kbench_{sfx}"))
        .unwrap();
    pg_store.migrate().await.unwrap();
    let my_store = MySqlStore::connect(&my)
        .await
        .unwrap()
        .with_table_name(&format!("idem_kbench_{sfx}"))
        .unwrap();
    my_store.migrate().await.unwrap();
    let rate = |d: Duration| n as f64 / d.as_secs_f64();
    let base = rate(commit_only(&brokers, &topic, &format!("g0-{sfx}"), n, batch).await);
    println!("{:<36} {:>9.0} msg/s  1.00×", "commit only (no dedup)", base);
    let row = |name: &str, d: Duration| {
        let r = rate(d);
        println!("{name:<36} {r:>9.0} msg/s  {:.2}×", r / base);
    };
    let g = |i: u32| format!("g{i}-{sfx}");
    let day = Duration::from_secs(86_400);
    let offsets = OffsetInbox::new(pg_store.inbox(Duration::from_secs(3600)));
    let positions_only = offsets.clone().without_markers();
    row(
        "offset inbox, PostgreSQL",
        driven(&brokers, &topic, &g(7), n, batch, move |b| b.offset_inbox(positions_only)).await,
    );
    row(
        "offset inbox + 1 h markers, PostgreSQL",
        driven(&brokers, &topic, &g(8), n, batch, move |b| b.offset_inbox(offsets)).await,
    );
    let only_offsets = std::env::args().nth(3).is_some_and(|a| a == "offset");
    if only_offsets {
        cleanup(&admin, &topic, &dlq, &pg_store, &my_store, &sfx).await;
        return;
    }
    row(
        "two-phase, memory",
        driven(&brokers, &topic, &g(1), n, batch, |b| b.store(MemoryStore::new())).await,
    );
    let sqlite = SqliteStore::open(dir.path().join("b.sqlite")).await.unwrap();
    row(
        "two-phase, SQLite",
        driven(&brokers, &topic, &g(2), n, batch, move |b| b.store(sqlite)).await,
    );
    let pg = pg_store.clone();
    row(
        "two-phase, PostgreSQL",
        driven(&brokers, &topic, &g(3), n, batch, move |b| b.store(pg)).await,
    );
    let inbox = SqliteStore::open(dir.path().join("i.sqlite")).await.unwrap().inbox(day);
    row("inbox, SQLite", driven(&brokers, &topic, &g(4), n, batch, move |b| b.inbox(inbox)).await);
    let inbox = pg_store.inbox(day);
    row(
        "inbox, PostgreSQL",
        driven(&brokers, &topic, &g(5), n, batch, move |b| b.inbox(inbox)).await,
    );
    let inbox = my_store.inbox(day);
    row("inbox, MariaDB", driven(&brokers, &topic, &g(6), n, batch, move |b| b.inbox(inbox)).await);
    cleanup(&admin, &topic, &dlq, &pg_store, &my_store, &sfx).await;
}

async fn cleanup(
    admin: &AdminClient<DefaultClientContext>,
    topic: &str,
    dlq: &str,
    pg_store: &PostgresStore,
    my_store: &MySqlStore,
    sfx: &str,
) {
    let _ = admin.delete_topics(&[topic, dlq], &AdminOptions::new()).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA idem_kbench_{sfx} CASCADE")))
        .execute(pg_store.pool())
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP TABLE idem_kbench_{sfx}, idem_kbench_{sfx}_positions"
    )))
    .execute(my_store.pool())
    .await
    .unwrap();
}
