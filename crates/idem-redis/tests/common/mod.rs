//! Shared setup for the Redis integration tests: the server URL, fresh namespaces, cleanup.
#![allow(dead_code, unreachable_pub)]

use idem_redis::{ClockOffset, RedisStore};

/// The test server's URL, or `None` (skip, printed) when it does not answer outside CI.
pub fn url() -> Option<String> {
    idem_testkit::service::require("redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/")
}

/// The local Redis Cluster's node URLs (comma-separated in `IDEM_TEST_REDIS_CLUSTER_URLS`; the
/// 3-master cluster `.ci/services.sh` starts on ports 7000-7002), or `None` (skip, printed)
/// when it does not answer outside CI.
pub fn cluster_urls() -> Option<Vec<String>> {
    let urls = idem_testkit::service::require(
        "redis-cluster",
        "IDEM_TEST_REDIS_CLUSTER_URLS",
        "redis://127.0.0.1:7000/,redis://127.0.0.1:7001/,redis://127.0.0.1:7002/",
    )?;
    Some(urls.split(',').map(str::trim).filter(|u| !u.is_empty()).map(str::to_owned).collect())
}

/// A namespace no other test uses.
pub fn fresh_name(tag: &str) -> String {
    format!("t-{tag}-{}-{:016x}", std::process::id(), rand::random::<u64>())
}

/// Deletes every key matching `pattern` when dropped (the test's own namespace or streams).
/// `url` is one server, or a cluster's node URLs separated by commas.
pub struct Cleanup {
    pub url: String,
    pub patterns: Vec<String>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if self.url.contains(',') {
            // A cluster: KEYS goes to every master, DEL is split by slot.
            let Ok(client) = redis::cluster::ClusterClient::new(self.url.split(',')) else {
                return;
            };
            let Ok(mut conn) = client.get_connection() else { return };
            for p in &self.patterns {
                let keys: Vec<String> =
                    redis::cmd("KEYS").arg(p).query(&mut conn).unwrap_or_default();
                for k in keys {
                    let _: Result<i64, _> = redis::cmd("DEL").arg(k).query(&mut conn);
                }
            }
            return;
        }
        let Ok(client) = redis::Client::open(self.url.as_str()) else { return };
        let Ok(mut conn) = client.get_connection() else { return };
        for p in &self.patterns {
            let keys: Vec<String> = redis::cmd("KEYS").arg(p).query(&mut conn).unwrap_or_default();
            for chunk in keys.chunks(500) {
                let _: Result<i64, _> = redis::cmd("DEL").arg(chunk).query(&mut conn);
            }
        }
    }
}

/// A store in a fresh namespace with a test clock offset, and its cleanup guard.
pub async fn store(url: &str, tag: &str) -> (RedisStore, ClockOffset, Cleanup) {
    store_with(url, tag, true).await
}

/// [`store`], choosing the script-free fresh claim (`fast`) or scripts only.
pub async fn store_with(url: &str, tag: &str, fast: bool) -> (RedisStore, ClockOffset, Cleanup) {
    let name = fresh_name(tag);
    let offset = ClockOffset::new();
    let store = RedisStore::builder(url)
        .expect("url")
        .namespace(&name)
        .expect("namespace")
        .fast_claim(fast)
        .clock_offset(offset.clone())
        .connect()
        .await
        .expect("connect to redis");
    let cleanup = Cleanup {
        url: url.to_owned(),
        patterns: vec![format!("{}*", store.namespace().key_prefix())],
    };
    (store, offset, cleanup)
}

/// A store on the cluster (`urls`) in a fresh namespace with a test clock offset, and its
/// cleanup guard; `fast` chooses the script-free fresh claim.
pub async fn cluster_store(
    urls: &[String],
    tag: &str,
    fast: bool,
) -> (RedisStore, ClockOffset, Cleanup) {
    let name = fresh_name(tag);
    let offset = ClockOffset::new();
    let store = RedisStore::cluster_builder(urls.iter().map(String::as_str))
        .expect("urls")
        .namespace(&name)
        .expect("namespace")
        .fast_claim(fast)
        .clock_offset(offset.clone())
        .connect()
        .await
        .expect("connect to the redis cluster");
    assert!(store.connection().is_cluster());
    let cleanup = Cleanup {
        url: urls.join(","),
        patterns: vec![format!("{}*", store.namespace().key_prefix())],
    };
    (store, offset, cleanup)
}

/// The group's pending count and entries read (`XINFO GROUPS`), or `None` without the group.
pub async fn group_state(
    conn: &mut (impl redis::aio::ConnectionLike + Send),
    stream: &str,
    group: &str,
) -> Option<(usize, usize)> {
    let reply: redis::streams::StreamInfoGroupsReply =
        redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(conn).await.ok()?;
    let g = reply.groups.into_iter().find(|g| g.name == group)?;
    Some((g.pending, g.entries_read.unwrap_or(0)))
}
