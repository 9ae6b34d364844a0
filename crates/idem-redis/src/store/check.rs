//! The startup safety checks: eviction policy and persistence.

use redis::aio::ConnectionLike;

use super::RedisConnection;
use crate::Error;

/// What the server says about eviction and persistence.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerSettings {
    /// `maxmemory-policy` (from `INFO memory`).
    pub maxmemory_policy: String,
    /// Whether RDB snapshots are configured (`CONFIG GET save` not empty); `None` when `CONFIG`
    /// is refused (managed services often rename it).
    pub rdb: Option<bool>,
    /// Whether the append-only file is on (`INFO persistence` `aof_enabled`).
    pub aof: bool,
    /// `redis_version` (from `INFO server`), `unknown` when absent.
    pub redis_version: String,
}

impl ServerSettings {
    /// Reads the settings from the server (what
    /// [`RedisStoreBuilder::connect`](crate::RedisStoreBuilder::connect) checks).
    ///
    /// ```no_run
    /// use idem_redis::{RedisStore, ServerSettings};
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idem_redis::Error> {
    /// let store = RedisStore::connect("redis://127.0.0.1/").await?;
    /// let settings = ServerSettings::read(&mut store.connection().clone()).await?;
    /// println!("policy {}, persistent {:?}", settings.maxmemory_policy, settings.is_persistent());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Redis`] when `INFO` fails.
    ///
    /// # Cancel safety
    /// Cancel safe on a multiplexed connection or a connection manager, which discard the
    /// reply of a dropped command; a plain connection dropped mid-command may be left with a
    /// reply unread: drop that connection too.
    pub async fn read(conn: &mut impl ConnectionLike) -> Result<Self, Error> {
        let memory: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(conn)
            .await
            .map_err(Error::redis("INFO memory"))?;
        let persistence: String = redis::cmd("INFO")
            .arg("persistence")
            .query_async(conn)
            .await
            .map_err(Error::redis("INFO persistence"))?;
        let server: String = redis::cmd("INFO")
            .arg("server")
            .query_async(conn)
            .await
            .map_err(Error::redis("INFO server"))?;
        let save: Result<Vec<String>, _> =
            redis::cmd("CONFIG").arg("GET").arg("save").query_async(conn).await;
        Ok(Self {
            maxmemory_policy: info_field(&memory, "maxmemory_policy")
                .unwrap_or("unknown")
                .to_owned(),
            rdb: save.ok().map(|kv| kv.get(1).is_some_and(|v| !v.trim().is_empty())),
            aof: info_field(&persistence, "aof_enabled") == Some("1"),
            redis_version: info_field(&server, "redis_version").unwrap_or("unknown").to_owned(),
        })
    }

    /// Whether the server takes `SET … NX GET` (Redis ≥ 7.0), which the fast claim needs.
    pub fn supports_set_nx_get(&self) -> bool {
        self.redis_version
            .split('.')
            .next()
            .and_then(|major| major.parse::<u32>().ok())
            .is_some_and(|major| major >= 7)
    }

    /// Whether the policy never evicts keys.
    pub fn is_noeviction(&self) -> bool {
        self.maxmemory_policy == "noeviction"
    }

    /// Whether a restart keeps the records (RDB or AOF on); `None` when unknown.
    pub fn is_persistent(&self) -> Option<bool> {
        if self.aof { Some(true) } else { self.rdb }
    }

    /// Refuses an evicting policy unless `allow_eviction`; warns when persistence is off.
    ///
    /// # Errors
    /// [`Error::EvictingPolicy`].
    pub fn enforce(&self, allow_eviction: bool) -> Result<(), Error> {
        if !self.is_noeviction() {
            if !allow_eviction {
                return Err(Error::EvictingPolicy { policy: self.maxmemory_policy.clone() });
            }
            tracing::warn!(target: "idem", policy = %self.maxmemory_policy,
                "Redis may evict dedup records (allowed by allow_eviction): an evicted key's next delivery runs again");
        }
        match self.is_persistent() {
            Some(true) => {}
            Some(false) => tracing::warn!(target: "idem",
                "Redis persistence is off (no RDB snapshots, no AOF): a Redis restart forgets every dedup record, \
                 and redeliveries after it run their handlers again"),
            None => tracing::warn!(target: "idem",
                "could not read Redis' RDB settings (CONFIG refused) and the AOF is off: check that persistence is on"),
        }
        Ok(())
    }
}

/// Reads and enforces the settings of every master of the cluster behind `conn` that serves
/// slots (from `CLUSTER NODES`); returns them. An error names the master.
///
/// A master without slots holds no keys, and the cluster client keeps no connection to it (it
/// connects to the nodes `CLUSTER SLOTS` lists): a node just added before a reshard, or a
/// replica that another node's gossip still shows as a master. Such nodes are not checked.
pub(crate) async fn check_masters(
    conn: &RedisConnection,
    allow_eviction: bool,
) -> Result<Vec<ServerSettings>, Error> {
    let mut out = Vec::new();
    for (node, settings) in read_masters(conn).await? {
        settings
            .enforce(allow_eviction)
            .map_err(|e| Error::ClusterNode { node, source: Box::new(e) })?;
        out.push(settings);
    }
    Ok(out)
}

/// The settings of every master that serves slots, each with its `host:port`.
pub(crate) async fn read_masters(
    conn: &RedisConnection,
) -> Result<Vec<(String, ServerSettings)>, Error> {
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(&mut conn.clone())
        .await
        .map_err(Error::redis("CLUSTER NODES"))?;
    let masters = masters(&nodes);
    if masters.is_empty() {
        return Err(Error::Redis {
            op: "CLUSTER NODES",
            source: redis::RedisError::from((
                redis::ErrorKind::Client,
                "the cluster reports no reachable master",
            )),
        });
    }
    let mut out = Vec::with_capacity(masters.len());
    for (host, port) in masters {
        let node = format!("{host}:{port}");
        let Some(mut on) = conn.node(&host, port) else { break };
        let settings = ServerSettings::read(&mut on)
            .await
            .map_err(|e| Error::ClusterNode { node: node.clone(), source: Box::new(e) })?;
        out.push((node, settings));
    }
    Ok(out)
}

/// The `host`, `port` of each master in a `CLUSTER NODES` reply that serves at least one slot
/// and is not marked failed.
fn masters(nodes: &str) -> Vec<(String, u16)> {
    nodes
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let addr = f.nth(1)?;
            let flags = f.next()?;
            let flags: Vec<&str> = flags.split(',').collect();
            if !flags.contains(&"master") || flags.iter().any(|f| f.starts_with("fail")) {
                return None;
            }
            // After the flags: master id, ping sent, pong received, epoch, link state, then the
            // slots (`0-5460`, `5461`; `[…]` entries are migrations in progress).
            if !f.skip(5).any(|slot| slot.starts_with(|c: char| c.is_ascii_digit())) {
                return None;
            }
            let hostport = addr.split(['@', ',']).next()?;
            let (host, port) = hostport.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect()
}

fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')).map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(policy: &str, rdb: Option<bool>, aof: bool) -> ServerSettings {
        ServerSettings {
            maxmemory_policy: policy.to_owned(),
            rdb,
            aof,
            redis_version: "7.0.15".to_owned(),
        }
    }

    #[test]
    fn versions_and_cluster_masters() {
        let mut s = settings("noeviction", None, true);
        assert!(s.supports_set_nx_get());
        s.redis_version = "6.2.14".into();
        assert!(!s.supports_set_nx_get());
        s.redis_version = "unknown".into();
        assert!(!s.supports_set_nx_get());
        let nodes = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7001@17001 master - 0 1 2 connected 5461-10922
c3 127.0.0.1:7002@17002,host.example master,fail - 0 1 3 connected
d4 127.0.0.1:7003@17003 slave a1 0 1 1 connected
e5 ::1:7004@17004 master - 0 1 4 connected 10923-16383
f6 127.0.0.1:7005@17005 master - 0 1 0 connected
g7 127.0.0.1:7006@17006 master - 0 1 5 connected [42->-a1]
";
        assert_eq!(
            masters(nodes),
            vec![("127.0.0.1".into(), 7000), ("127.0.0.1".into(), 7001), ("::1".into(), 7004)]
        );
    }

    #[test]
    fn refuses_evicting_policies_unless_allowed() {
        assert!(settings("noeviction", Some(false), false).enforce(false).is_ok());
        let err = settings("allkeys-lru", Some(true), false).enforce(false).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("allkeys-lru") && msg.contains(".allow_eviction(true)"), "{msg}");
        assert!(settings("volatile-ttl", None, true).enforce(true).is_ok());
    }

    #[test]
    fn persistence_and_info_parsing() {
        assert_eq!(settings("noeviction", Some(false), true).is_persistent(), Some(true));
        assert_eq!(settings("noeviction", Some(false), false).is_persistent(), Some(false));
        assert_eq!(settings("noeviction", None, false).is_persistent(), None);
        let info = "# Memory\r\nused_memory:1\r\nmaxmemory_policy:noeviction\r\n";
        assert_eq!(info_field(info, "maxmemory_policy"), Some("noeviction"));
        assert_eq!(info_field(info, "maxmemory"), None);
    }
}
