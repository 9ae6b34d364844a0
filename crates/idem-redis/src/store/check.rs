//! The startup safety checks (R14): eviction policy and persistence.

use redis::aio::ConnectionLike;

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
        let save: Result<Vec<String>, _> =
            redis::cmd("CONFIG").arg("GET").arg("save").query_async(conn).await;
        Ok(Self {
            maxmemory_policy: info_field(&memory, "maxmemory_policy")
                .unwrap_or("unknown")
                .to_owned(),
            rdb: save.ok().map(|kv| kv.get(1).is_some_and(|v| !v.trim().is_empty())),
            aof: info_field(&persistence, "aof_enabled") == Some("1"),
        })
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

fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')).map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(policy: &str, rdb: Option<bool>, aof: bool) -> ServerSettings {
        ServerSettings { maxmemory_policy: policy.to_owned(), rdb, aof }
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
