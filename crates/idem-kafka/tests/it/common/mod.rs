//! Shared helpers: a real Kafka-protocol broker, topics of the test's own, a PostgreSQL schema
//! of the test's own, and waiting on conditions.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use idem_kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use idem_kafka::rdkafka::client::DefaultClientContext;
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer as _};
use idem_kafka::rdkafka::message::{Header, OwnedHeaders};
use idem_kafka::rdkafka::producer::{FutureProducer, FutureRecord};
use idem_kafka::rdkafka::{ClientConfig, Offset, TopicPartitionList};
use idem_sqlx::PostgresStore;
use sqlx::postgres::{PgPool, PgPoolOptions};

pub const DEFAULT_BROKERS: &str = "127.0.0.1:9092";
pub const PG_DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// The brokers, or `None` (skip) when unreachable outside CI.
pub fn brokers() -> Option<String> {
    idem_testkit::service::require("Kafka (tansu)", "IDEM_TEST_KAFKA_BROKERS", DEFAULT_BROKERS)
}

pub fn pg_url() -> Option<String> {
    idem_testkit::service::require("PostgreSQL", "IDEM_TEST_POSTGRES_URL", PG_DEFAULT_URL)
}

pub fn suffix() -> String {
    format!("{}_{:08x}", std::process::id(), rand::random::<u32>())
}

/// A consumer config for `group` that fails over fast: a short session timeout, and a short
/// poll interval, which is also the rebalance timeout (tansu waits that long for a dead member
/// during a rebalance, not just its session timeout).
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(6);

pub fn config(brokers: &str, group: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("session.timeout.ms", SESSION_TIMEOUT.as_millis().to_string())
        .set("heartbeat.interval.ms", "500")
        .set("max.poll.interval.ms", "10000")
        .set("topic.metadata.refresh.interval.ms", "1000");
    // librdkafka's own debug contexts (`cgrp,fetch`, …) for a failing test's story: they reach
    // `tracing` under the target `librdkafka` (see idem_testkit::process::log_from_env).
    if let Ok(contexts) = std::env::var("IDEM_TEST_RDKAFKA_DEBUG") {
        c.set("debug", contexts);
    }
    c
}

/// A topic to create: name, partitions, configs.
pub type TopicSpec<'a> = (&'a str, i32, &'a [(&'a str, &'a str)]);

/// Topics of the test's own, deleted when dropped (best effort).
pub struct Topics {
    brokers: String,
    pub names: Vec<String>,
}

impl Topics {
    pub async fn create(brokers: &str, spec: &[(&str, i32)]) -> Self {
        let spec: Vec<TopicSpec<'_>> = spec.iter().map(|(n, p)| (*n, *p, &[][..])).collect();
        Self::create_with(brokers, &spec).await
    }

    /// As [`create`](Self::create), each topic with its own configs (`retention.ms`, …).
    pub async fn create_with(brokers: &str, spec: &[TopicSpec<'_>]) -> Self {
        let admin: AdminClient<DefaultClientContext> =
            ClientConfig::new().set("bootstrap.servers", brokers).create().unwrap();
        let new: Vec<NewTopic<'_>> = spec
            .iter()
            .map(|(n, p, configs)| {
                configs
                    .iter()
                    .fold(NewTopic::new(n, *p, TopicReplication::Fixed(1)), |t, (k, v)| t.set(k, v))
            })
            .collect();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        for r in admin.create_topics(&new, &opts).await.unwrap() {
            r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
        }
        Self {
            brokers: brokers.to_owned(),
            names: spec.iter().map(|(n, ..)| (*n).to_owned()).collect(),
        }
    }
}

impl Drop for Topics {
    /// Deletes the topics, waiting at most 15 s: a librdkafka client that does not finish
    /// closing is left on its thread rather than hanging the test.
    fn drop(&mut self) {
        let (brokers, names) = (self.brokers.clone(), self.names.clone());
        let (done, wait) = std::sync::mpsc::channel::<()>();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let Ok(admin) = ClientConfig::new()
                    .set("bootstrap.servers", &brokers)
                    .create::<AdminClient<DefaultClientContext>>()
                else {
                    return;
                };
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let _ = tokio::time::timeout(
                    Duration::from_secs(10),
                    admin.delete_topics(&names, &AdminOptions::new()),
                )
                .await;
            });
            let _ = done.send(());
        });
        let _ = wait.recv_timeout(Duration::from_secs(15));
    }
}

/// A producer writing one record per batch: tansu 0.6.0 answers a fetch that starts inside a
/// multi-record batch with a later batch, skipping records (measured: a consumer assigned at
/// offset 100 of a 1,700-record partition read from 647 on), so a consumer resuming from a
/// committed offset would miss messages no client could see. One record per batch keeps every
/// offset a batch boundary.
pub fn producer(brokers: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("acks", "all")
        .set("linger.ms", "5")
        .set("batch.num.messages", "1")
        .create()
        .unwrap()
}

/// Produces `(id, body)` records keyed by id with a `message-id` header (to `partition` when
/// given), returning each partition's end offset (last offset + 1) as the broker acknowledged.
pub async fn produce(
    p: &FutureProducer,
    topic: &str,
    records: &[(String, Vec<u8>)],
    partition: Option<i32>,
) -> HashMap<i32, i64> {
    let sends = records.iter().map(|(id, body)| {
        let hs =
            OwnedHeaders::new().insert(Header { key: "message-id", value: Some(id.as_bytes()) });
        let mut rec = FutureRecord::to(topic).key(id.as_bytes()).payload(body).headers(hs);
        if let Some(n) = partition {
            rec = rec.partition(n);
        }
        p.send(rec, Duration::from_secs(30))
    });
    let mut ends = HashMap::new();
    for r in futures_util::future::join_all(sends).await {
        let d = r.map_err(|(e, _)| e).unwrap();
        let e = ends.entry(d.partition).or_insert(0);
        *e = (*e).max(d.offset + 1);
    }
    ends
}

/// A client of `group` that never joins it: for offset fetches and commits from outside.
fn outsider(brokers: &str, group: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()
        .unwrap()
}

/// Commits `offset` of `topic`'s partition 0 for `group` from outside the group, as another
/// member would. tansu accepts a commit without checking the member or its generation; Kafka
/// would refuse it from a non-member of an active group.
pub async fn commit_from_outside(brokers: &str, group: &str, topic: &str, offset: i64) {
    use idem_kafka::rdkafka::consumer::CommitMode;
    let (brokers, group, topic) = (brokers.to_owned(), group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, 0, Offset::Offset(offset)).unwrap();
        outsider(&brokers, &group).commit(&tpl, CommitMode::Sync).unwrap();
    })
    .await
    .unwrap();
}

/// The group's committed offsets of `topic`'s partitions `0..n` (no group join: an offset fetch).
pub async fn committed(brokers: &str, group: &str, topic: &str, n: i32) -> HashMap<i32, i64> {
    let (brokers, group, topic) = (brokers.to_owned(), group.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let c = outsider(&brokers, &group);
        let mut tpl = TopicPartitionList::new();
        for p in 0..n {
            tpl.add_partition(&topic, p);
        }
        let got = c.committed_offsets(tpl, Duration::from_secs(10)).unwrap();
        let out = got
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(o) => Some((e.partition(), o)),
                _ => None,
            })
            .collect();
        // Closing a consumer that never joined a group is quick; still keep it off the runtime.
        drop(c);
        out
    })
    .await
    .unwrap()
}

/// Reads every record of `topic` (1 partition) from the start until `n` are read.
pub async fn read_all(
    brokers: &str,
    topic: &str,
    n: usize,
) -> Vec<(Vec<u8>, HashMap<String, String>)> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        use idem_kafka::rdkafka::Message as _;
        use idem_kafka::rdkafka::message::Headers as _;
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", format!("reader-{}", suffix()))
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&topic, 0, Offset::Beginning).unwrap();
        c.assign(&tpl).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut out = Vec::new();
        while out.len() < n && std::time::Instant::now() < deadline {
            if let Some(Ok(m)) = c.poll(Duration::from_millis(200)) {
                let hs = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| {
                                (
                                    h.key.to_owned(),
                                    String::from_utf8_lossy(h.value.unwrap_or_default())
                                        .into_owned(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                out.push((m.payload().unwrap_or_default().to_vec(), hs));
            }
        }
        out
    })
    .await
    .unwrap()
}

/// Polls `check` every 100 ms until it returns `Some`, or panics after `limit` with `what`.
pub async fn eventually<T, Fut: Future<Output = Option<T>>>(
    limit: Duration,
    what: &str,
    check: impl FnMut() -> Fut,
) -> T {
    eventually_or(limit, check)
        .await
        .unwrap_or_else(|| panic!("not reached within {limit:?}: {what}"))
}

/// As [`eventually`], but `None` after `limit` instead of a panic (for diagnostics).
pub async fn eventually_or<T, Fut: Future<Output = Option<T>>>(
    limit: Duration,
    mut check: impl FnMut() -> Fut,
) -> Option<T> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A PostgreSQL schema of the test's own holding the store and a ledger; dropped on success
/// and, from `Drop`, on failure.
pub struct PgSchema {
    pub pool: PgPool,
    pub name: String,
    url: String,
    dropped: bool,
}

impl PgSchema {
    pub async fn create(url: &str, name: String) -> (Self, PostgresStore) {
        let pool = PgPoolOptions::new().max_connections(8).connect(url).await.unwrap();
        let this = Self { pool, name, url: url.to_owned(), dropped: false };
        this.exec(&format!("DROP SCHEMA IF EXISTS {} CASCADE", this.name)).await;
        let store = PostgresStore::new(this.pool.clone()).with_schema(&this.name).unwrap();
        store.migrate().await.unwrap();
        // The ledger has no unique constraint: a second effect of one key shows as a second row.
        this.exec(&format!(
            "CREATE TABLE {}.ledger (key text NOT NULL, body bytea, who text)",
            this.name
        ))
        .await;
        (this, store)
    }

    pub async fn exec(&self, sql: &str) {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned())).execute(&self.pool).await.unwrap();
    }

    pub async fn drop_now(mut self) {
        self.exec(&format!("DROP SCHEMA {} CASCADE", self.name)).await;
        self.dropped = true;
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let (url, name) = (self.url.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                if let Ok(pool) = PgPoolOptions::new().max_connections(1).connect(&url).await {
                    let sql = format!("DROP SCHEMA IF EXISTS {name} CASCADE");
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pool).await;
                }
            });
        })
        .join();
    }
}
