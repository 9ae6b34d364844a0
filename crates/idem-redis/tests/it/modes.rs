//! The broker-source conformance suite on a real Redis: every mode through the same builder
//! calls (two-phase over a store — `SqliteStore`, and this crate's `RedisStore`; SQLite,
//! PostgreSQL and MariaDB inboxes), each on a stream of its own; and the crash suite (abort
//! between commit and `XACK`, SIGKILL and a dropped connection mid-handler) in both modes. Both
//! suites run again on the Redis Cluster (module `cluster`).

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{Cleanup, group_state};
use idem_core::consumer::headers;
use idem_dlq::DeadLetterQueue;
use idem_redis::{GROUP_FIELD, StreamConfig, StreamDeadLetters, StreamSource};
use idem_testkit::crash::CrashHarness;
use idem_testkit::source::{BoxFuture, DeadCopy, SourceHarness};
use redis::aio::ConnectionLike;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::streams::StreamRangeReply;

/// One server, or a cluster (its node URLs joined by commas).
enum Server {
    One(redis::Client, redis::aio::MultiplexedConnection),
    Cluster(ClusterClient, ClusterConnection),
}

impl Server {
    async fn connect(url: &str) -> Self {
        if url.contains(',') {
            let client = ClusterClient::new(url.split(',')).expect("cluster client");
            let conn = client.get_async_connection().await.expect("cluster connection");
            Self::Cluster(client, conn)
        } else {
            let client = redis::Client::open(url).expect("client");
            let conn = client.get_multiplexed_async_connection().await.expect("connection");
            Self::One(client, conn)
        }
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> T {
        async fn on<T: redis::FromRedisValue>(mut c: impl ConnectionLike, cmd: &redis::Cmd) -> T {
            cmd.query_async(&mut c).await.expect("redis command")
        }
        match self {
            Self::One(_, c) => on(c.clone(), cmd).await,
            Self::Cluster(_, c) => on(c.clone(), cmd).await,
        }
    }
}

struct Harness {
    url: String,
    server: Server,
    stream: String,
    group: String,
    /// Consumers made so far: each gets a name of its own (`<pid>-<n>`).
    consumers: AtomicUsize,
    /// Deletes the stream's keys when dropped (the parent's only).
    _cleanup: Option<Cleanup>,
}

impl SourceHarness for Harness {
    type Source = StreamSource;
    type Config<'a> = StreamConfig;

    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let mut xadd = redis::cmd("XADD");
            xadd.arg(&self.stream).arg("*").arg("message_id").arg(id).arg("payload").arg(body);
            let _: String = self.server.query(&xadd).await;
        })
    }

    /// A failed entry comes back once it has been pending for 200 ms.
    fn config(&self) -> StreamConfig {
        let n = self.consumers.fetch_add(1, Ordering::SeqCst);
        let name = format!("c{}-{n}", std::process::id());
        let (stream, group) = (&self.stream, &self.group);
        match &self.server {
            Server::One(client, _) => StreamConfig::new(client.clone(), stream, group, name),
            Server::Cluster(client, _) => {
                StreamConfig::cluster(client.clone(), stream, group, name)
            }
        }
        .reclaim_idle(Duration::from_millis(200))
    }

    fn settled(&self) -> BoxFuture<'_, bool> {
        Box::pin(async {
            // Every entry of the stream, those a dead-letter replay added included.
            let n: usize = self.server.query(redis::cmd("XLEN").arg(&self.stream)).await;
            let state = match &self.server {
                Server::One(_, c) => group_state(&mut c.clone(), &self.stream, &self.group).await,
                Server::Cluster(_, c) => {
                    group_state(&mut c.clone(), &self.stream, &self.group).await
                }
            };
            state == Some((0, n))
        })
    }

    fn dead_letters(&self) -> BoxFuture<'_, Vec<DeadCopy>> {
        Box::pin(async {
            let mut xrange = redis::cmd("XRANGE");
            xrange.arg(format!("{}:dead-letter", self.stream)).arg("-").arg("+");
            let dead: StreamRangeReply = self.server.query(&xrange).await;
            dead.ids
                .iter()
                .map(|e| {
                    let headers = e
                        .map
                        .keys()
                        .filter_map(|k| e.get::<String>(k).map(|v| (k.clone(), v)))
                        .collect::<std::collections::HashMap<_, _>>();
                    assert_eq!(headers.get(GROUP_FIELD), Some(&self.group), "{headers:?}");
                    assert_eq!(headers.get(headers::SOURCE), Some(&self.stream), "{headers:?}");
                    DeadCopy { message_id: headers.get("message_id").cloned(), headers }
                })
                .collect()
        })
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(async move { drop(self) })
    }
}

impl CrashHarness for Harness {
    fn spec(&self) -> String {
        format!("{} {} {}", self.url, self.stream, self.group)
    }

    fn attach(spec: &str) -> BoxFuture<'static, Self> {
        let parts: Vec<String> = spec.split(' ').map(str::to_owned).collect();
        Box::pin(async move {
            let [url, stream, group] = <[String; 3]>::try_from(parts).expect("url stream group");
            Harness::on(url, stream, group, None).await
        })
    }
}

impl Harness {
    async fn on(url: String, stream: String, group: String, cleanup: Option<Cleanup>) -> Self {
        let server = Server::connect(&url).await;
        let consumers = AtomicUsize::new(0);
        Self { url, server, stream, group, consumers, _cleanup: cleanup }
    }

    /// A fresh stream on `url` (one server, or node URLs joined by commas); on a cluster its
    /// keys share one slot (`{…}`).
    async fn fresh(url: String, name: &str) -> Self {
        let stream = format!("{{{}}}", common::fresh_name(name));
        let cleanup = Cleanup { url: url.clone(), patterns: vec![format!("{stream}*")] };
        Self::on(url, stream, name.replace('_', "-"), Some(cleanup)).await
    }
}

async fn harness(name: &str) -> Option<Harness> {
    Some(Harness::fresh(common::url()?, name).await)
}

idem_testkit::source_conformance!(harness);
idem_testkit::crash_conformance!(Harness, harness);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_on_the_redis_store() {
    let Some(h) = harness("two-phase-redis").await else { return };
    let Some(url) = common::url() else { return };
    let (store, _offset, _cleanup) = common::store(&url, "modes-2p").await;
    idem_testkit::source::two_phase_on(h, store).await;
}

/// Both suites on the Redis Cluster, and two-phase over the `RedisStore` on it.
mod cluster {
    use super::{Harness, common, workbench_on};

    async fn harness(name: &str) -> Option<Harness> {
        Some(Harness::fresh(common::cluster_urls()?.join(","), name).await)
    }

    idem_testkit::source_conformance!(harness);
    idem_testkit::crash_conformance!(Harness, harness);

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_phase_on_the_redis_store() {
        let Some(h) = harness("two-phase-redis").await else { return };
        let Some(urls) = common::cluster_urls() else { return };
        let (store, _offset, _cleanup) = common::cluster_store(&urls, "modes-2p", true).await;
        idem_testkit::source::two_phase_on(h, store).await;
    }

    /// The workbench with the dead-letter stream and the consumed stream on the cluster.
    #[tokio::test]
    async fn workbench() {
        let Some(h) = harness("workbench").await else { return };
        workbench_on(h).await;
    }
}

/// The dead-letter workbench on `h`'s default dead-letter stream, through the real consumer.
async fn workbench_on(h: Harness) {
    let queue: Box<dyn DeadLetterQueue> = match &h.server {
        Server::One(_, c) => Box::new(StreamDeadLetters::for_source(c.clone(), &h.stream)),
        Server::Cluster(_, c) => Box::new(StreamDeadLetters::for_source(c.clone(), &h.stream)),
    };
    idem_testkit::dlq::workbench(h, queue).await;
}

#[tokio::test]
async fn workbench() {
    let Some(h) = harness("workbench").await else { return };
    workbench_on(h).await;
}
