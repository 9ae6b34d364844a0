//! The broker-source conformance suite on a real Redis: every mode through the same builder
//! calls (two-phase over a store — `SqliteStore`, and this crate's `RedisStore`; SQLite,
//! PostgreSQL and MariaDB inboxes), each on a stream of its own.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{Cleanup, group_state};
use idem_core::consumer::headers;
use idem_redis::{GROUP_FIELD, StreamConfig, StreamSource};
use idem_testkit::source::{BoxFuture, DeadCopy, SourceHarness};
use redis::AsyncCommands;

struct Harness {
    client: redis::Client,
    conn: redis::aio::MultiplexedConnection,
    stream: String,
    group: String,
    published: AtomicUsize,
    _cleanup: Cleanup,
}

impl SourceHarness for Harness {
    type Source = StreamSource;
    type Config<'a> = StreamConfig;

    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let fields: [(&str, &[u8]); 2] = [("message_id", id.as_bytes()), ("payload", body)];
            let _: String = self.conn.clone().xadd(&self.stream, "*", &fields).await.expect("xadd");
            self.published.fetch_add(1, Ordering::SeqCst);
        })
    }

    /// A failed entry comes back once it has been pending for 200 ms.
    fn config(&self) -> StreamConfig {
        StreamConfig::new(self.client.clone(), &self.stream, &self.group, "c1")
            .reclaim_idle(Duration::from_millis(200))
    }

    fn settled(&self) -> BoxFuture<'_, bool> {
        Box::pin(async {
            let n = self.published.load(Ordering::SeqCst);
            group_state(&mut self.conn.clone(), &self.stream, &self.group).await == Some((0, n))
        })
    }

    fn dead_letters(&self) -> BoxFuture<'_, Vec<DeadCopy>> {
        Box::pin(async {
            let dead: redis::streams::StreamRangeReply = self
                .conn
                .clone()
                .xrange_all(format!("{}:dead-letter", self.stream))
                .await
                .expect("xrange");
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

async fn harness(name: &str) -> Option<Harness> {
    let url = common::url()?;
    let stream = common::fresh_name(name);
    let cleanup = Cleanup { url: url.clone(), patterns: vec![format!("{stream}*")] };
    let client = redis::Client::open(url.as_str()).expect("client");
    let conn = client.get_multiplexed_async_connection().await.expect("conn");
    let group = name.replace('_', "-");
    Some(Harness { client, conn, stream, group, published: AtomicUsize::new(0), _cleanup: cleanup })
}

idem_testkit::source_conformance!(|name: &'static str| harness(name));

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_phase_on_the_redis_store() {
    let Some(h) = harness("two-phase-redis").await else { return };
    let Some(url) = common::url() else { return };
    let (store, _offset, _cleanup) = common::store(&url, "modes-2p").await;
    idem_testkit::source::two_phase_on(h, store).await;
}
