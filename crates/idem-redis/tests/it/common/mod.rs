//! Shared setup for the Redis integration tests: the server URL, fresh namespaces, cleanup.
#![allow(dead_code, unreachable_pub)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
            if let Ok(mut conn) = client.get_connection() {
                sweep(&mut conn, &self.patterns);
            }
        } else if let Ok(mut conn) =
            redis::Client::open(self.url.as_str()).and_then(|c| c.get_connection())
        {
            sweep(&mut conn, &self.patterns);
        }
    }
}

/// Deletes the keys matching each pattern, 500 per `DEL`.
fn sweep(conn: &mut impl redis::ConnectionLike, patterns: &[String]) {
    for p in patterns {
        let keys: Vec<String> = redis::cmd("KEYS").arg(p).query(conn).unwrap_or_default();
        for chunk in keys.chunks(500) {
            let _: Result<i64, _> = redis::cmd("DEL").arg(chunk).query(conn);
        }
    }
}

/// A store in a fresh namespace with a test clock offset, and its cleanup guard.
pub async fn store(url: &str, tag: &str) -> (RedisStore, ClockOffset, Cleanup) {
    store_with(url, tag, true).await
}

/// [`store`], choosing the script-free fresh claim (`fast`) or scripts only.
pub async fn store_with(url: &str, tag: &str, fast: bool) -> (RedisStore, ClockOffset, Cleanup) {
    connect(RedisStore::builder(url).expect("url"), url.to_owned(), tag, fast).await
}

/// A store on the cluster (`urls`) in a fresh namespace with a test clock offset, and its
/// cleanup guard; `fast` chooses the script-free fresh claim.
pub async fn cluster_store(
    urls: &[String],
    tag: &str,
    fast: bool,
) -> (RedisStore, ClockOffset, Cleanup) {
    let builder = RedisStore::cluster_builder(urls.iter().map(String::as_str)).expect("urls");
    let (store, offset, cleanup) = connect(builder, urls.join(","), tag, fast).await;
    assert!(store.connection().is_cluster());
    (store, offset, cleanup)
}

async fn connect(
    builder: idem_redis::RedisStoreBuilder,
    url: String,
    tag: &str,
    fast: bool,
) -> (RedisStore, ClockOffset, Cleanup) {
    let offset = ClockOffset::new();
    let store = builder
        .namespace(&fresh_name(tag))
        .expect("namespace")
        .fast_claim(fast)
        .clock_offset(offset.clone())
        .connect()
        .await
        .expect("connect to redis");
    let cleanup = Cleanup { url, patterns: vec![format!("{}*", store.namespace().key_prefix())] };
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

/// A `redis-server` of our own, killed when dropped.
pub struct Server {
    pub child: Child,
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `redis-server` with `args` on a free port; `None` (skip) when the binary is missing
/// outside CI.
pub fn spawn(args: &[&str]) -> Option<Server> {
    let dir = tempfile::tempdir().expect("tempdir");
    for _ in 0..5 {
        let port = 20_000 + rand::random::<u16>() % 20_000;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--dir", dir.path().to_str().expect("utf-8 path")])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let mut child = match child {
            Ok(c) => c,
            Err(e) if idem_testkit::service::in_ci() => panic!("redis-server not runnable: {e}"),
            Err(_) => {
                eprintln!("skipped: redis-server not installed");
                return None;
            }
        };
        let url = format!("redis://127.0.0.1:{port}/");
        let client = redis::Client::open(url.as_str()).expect("url");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break; // port taken: try another
            }
            if let Ok(mut c) = client.get_connection()
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                return Some(Server { child, url, _dir: dir });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("could not start a private redis-server");
}

impl Server {
    /// The port it listens on.
    pub fn port(&self) -> u16 {
        idem_testkit::service::host_port(&self.url)
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .expect("port")
    }

    /// Sends `signal` (`STOP`, `CONT`, `KILL`) to the server process.
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} {}", self.child.id());
    }
}

/// A private Redis Cluster of `masters` masters with `replicas` replicas each, on free ports
/// (1 s node timeout, replicas that always try a failover); killed when dropped.
pub struct PrivateCluster {
    pub nodes: Vec<Server>,
}

impl PrivateCluster {
    /// `None` (skip, printed) when `redis-server` is missing outside CI.
    pub fn spawn(masters: usize, replicas: usize, extra: &[&str]) -> Option<Self> {
        let mut nodes = Vec::new();
        for _ in 0..masters * (1 + replicas) {
            nodes.push(Self::node(extra)?);
        }
        let addrs: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())).collect();
        let out = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(out.status.success(), "cluster create: {}", String::from_utf8_lossy(&out.stdout));
        let cluster = Self { nodes };
        let all: Vec<&Server> = cluster.nodes.iter().collect();
        cluster.wait_ok(&all, Duration::from_secs(30));
        // `cluster_state:ok` only says the slots are covered: the replicas' roles reach the
        // other nodes by gossip, later. Until then a node may still list a replica as a master
        // without slots, so wait until every node sees every replica.
        let replicas_seen = |nodes: String| {
            nodes.lines().filter(|l| l.split_whitespace().nth(2).is_some_and(is_replica)).count()
        };
        Self::wait_for(&all, Duration::from_secs(30), "every node to see its replicas", |n| {
            Self::cluster_nodes(n).map(replicas_seen) == Some(masters * replicas)
        });
        Some(cluster)
    }

    /// A cluster node, not yet part of any cluster.
    fn node(extra: &[&str]) -> Option<Server> {
        let mut args = vec![
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            "1000",
            "--cluster-replica-validity-factor",
            "0",
            "--appendonly",
            "no",
            "--maxmemory-policy",
            "noeviction",
        ];
        args.extend_from_slice(extra);
        spawn(&args)
    }

    /// Starts one more node and has it join the cluster as a master without slots (as
    /// `redis-cli --cluster add-node` does before a reshard); returns its index in `nodes`.
    pub fn add_empty_master(&mut self, extra: &[&str]) -> usize {
        let node = Self::node(extra).expect("redis-server");
        let client = redis::Client::open(self.nodes[0].url.as_str()).expect("url");
        let mut c = client.get_connection().expect("connect");
        let _: () = redis::cmd("CLUSTER")
            .arg("MEET")
            .arg("127.0.0.1")
            .arg(node.port())
            .query(&mut c)
            .expect("cluster meet");
        let addr = format!("127.0.0.1:{}@", node.port());
        self.nodes.push(node);
        let all: Vec<&Server> = self.nodes.iter().collect();
        let knows_it = |nodes: String| {
            nodes.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 7
                    && f[1].starts_with(&addr)
                    && f[2].contains("master")
                    && f[7] == "connected"
            })
        };
        Self::wait_for(&all, Duration::from_secs(30), "every node to know the new one", |n| {
            Self::cluster_nodes(n).is_some_and(knows_it)
        });
        self.nodes.len() - 1
    }

    /// The node URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.url.clone()).collect()
    }

    /// `CLUSTER NODES` as seen by `node`.
    pub fn cluster_nodes(node: &Server) -> Option<String> {
        Self::cluster_cmd(node, "NODES")
    }

    /// `CLUSTER <sub>` (`NODES`, `INFO`) as `node` answers it; `None` when it does not.
    fn cluster_cmd(node: &Server, sub: &str) -> Option<String> {
        let client = redis::Client::open(node.url.as_str()).ok()?;
        let mut c = client.get_connection_with_timeout(Duration::from_secs(1)).ok()?;
        redis::cmd("CLUSTER").arg(sub).query(&mut c).ok()
    }

    /// Waits until every node of `nodes` says `cluster_state:ok`.
    pub fn wait_ok(&self, nodes: &[&Server], within: Duration) {
        Self::wait_for(nodes, within, "the private cluster to be ok", |n| {
            Self::cluster_cmd(n, "INFO").is_some_and(|i| i.contains("cluster_state:ok"))
        });
    }

    /// Waits until `ok` holds for every node of `nodes`.
    fn wait_for(nodes: &[&Server], within: Duration, what: &str, ok: impl Fn(&Server) -> bool) {
        let deadline = Instant::now() + within;
        while !nodes.iter().all(|n| ok(n)) {
            assert!(Instant::now() < deadline, "waited {within:?} for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The master serving `key`'s slot and its replicas (indexes into `nodes`), as `via` sees
    /// the cluster.
    pub fn shard_of(&self, key: &str, via: &Server) -> (usize, Vec<usize>) {
        let client = redis::Client::open(via.url.as_str()).expect("url");
        let mut c = client.get_connection().expect("connect");
        let slot: u16 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(key).query(&mut c).expect("slot");
        let nodes = Self::cluster_nodes(via).expect("cluster nodes");
        let index = |addr: &str| {
            let port: u16 = addr
                .split('@')
                .next()
                .and_then(|a| a.rsplit_once(':'))
                .and_then(|(_, p)| p.parse().ok())
                .expect("port");
            self.nodes.iter().position(|n| n.port() == port).expect("a node of ours")
        };
        let mut master = None;
        for line in nodes.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 9 || !f[2].contains("master") || f[2].contains("fail") {
                continue;
            }
            let serves = f[8..].iter().any(|r| {
                let (a, b) = r.split_once('-').unwrap_or((r, r));
                matches!((a.parse::<u16>(), b.parse::<u16>()), (Ok(a), Ok(b)) if a <= slot && slot <= b)
            });
            if serves {
                master = Some((f[0].to_owned(), index(f[1])));
            }
        }
        let (id, m) = master.expect("a master serves the slot");
        let replicas = nodes
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .filter(|f| f.len() > 3 && f[3] == id && !f[2].contains("fail"))
            .map(|f| index(f[1]))
            .collect();
        (m, replicas)
    }
}

/// Whether a `CLUSTER NODES` flags field marks a live replica.
fn is_replica(flags: &str) -> bool {
    let flags: Vec<&str> = flags.split(',').collect();
    flags.contains(&"slave") && !flags.iter().any(|f| f.starts_with("fail") || *f == "handshake")
}
