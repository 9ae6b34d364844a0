//! The store's connection: one standalone server, or a Redis Cluster with every command of a
//! namespace routed to the node that owns the namespace's hash slot.

use redis::aio::{ConnectionLike, ConnectionManager, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// Which deployment a store or a stream lives on.
#[derive(Clone)]
pub(crate) enum Deployment {
    Single(Box<redis::Client>),
    Cluster(Box<redis::cluster::ClusterClient>),
}

impl std::fmt::Debug for Deployment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "Single",
            Self::Cluster(_) => "Cluster",
        })
    }
}

/// A multiplexed connection to one Redis server or to a Redis Cluster; cheap to clone (clones
/// share the sockets). It implements [`ConnectionLike`], so any `redis` command runs on it.
///
/// On a cluster, keyed commands go to the node owning the key's slot (following `MOVED` and
/// `ASK` redirections, and the new master after a failover).
#[derive(Clone)]
pub struct RedisConnection(Inner);

#[derive(Clone)]
enum Inner {
    Single(ConnectionManager),
    /// A plain connection (no reconnection): the streams source's blocking readers.
    Plain(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Inner::Single(_) => "RedisConnection::Single",
            Inner::Plain(_) => "RedisConnection::Plain",
            Inner::Cluster(_) => "RedisConnection::Cluster",
        })
    }
}

impl RedisConnection {
    pub(crate) fn single(c: ConnectionManager) -> Self {
        Self(Inner::Single(c))
    }

    pub(crate) fn plain(c: MultiplexedConnection) -> Self {
        Self(Inner::Plain(c))
    }

    pub(crate) fn cluster(c: ClusterConnection) -> Self {
        Self(Inner::Cluster(c))
    }

    /// Whether this is a cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self.0, Inner::Cluster(_))
    }

    /// Runs a keyless command (`SCAN`, `WAIT`, `INFO`) on the master that owns `slot_key`'s
    /// slot; on a standalone server, simply runs it.
    pub(crate) async fn on_slot_master(
        &self,
        slot_key: &str,
        cmd: Cmd,
    ) -> redis::RedisResult<Value> {
        match &self.0 {
            Inner::Single(c) => cmd.query_async(&mut c.clone()).await,
            Inner::Plain(c) => cmd.query_async(&mut c.clone()).await,
            Inner::Cluster(c) => {
                let route = SingleNodeRoutingInfo::SpecificNode(Route::with_key(
                    slot_key,
                    SlotAddr::Master,
                ));
                c.clone().route_command(cmd, RoutingInfo::SingleNode(route)).await
            }
        }
    }
}

/// One cluster node, by address: every command sent on it goes there (for the startup checks).
pub(crate) struct NodeConn {
    conn: ClusterConnection,
    host: String,
    port: u16,
}

impl RedisConnection {
    /// The node at `host:port`, on a cluster connection; `None` on a standalone one.
    pub(crate) fn node(&self, host: &str, port: u16) -> Option<NodeConn> {
        match &self.0 {
            Inner::Single(_) | Inner::Plain(_) => None,
            Inner::Cluster(c) => Some(NodeConn { conn: c.clone(), host: host.to_owned(), port }),
        }
    }
}

impl NodeConn {
    fn route(&self) -> SingleNodeRoutingInfo {
        SingleNodeRoutingInfo::ByAddress { host: self.host.clone(), port: self.port }
    }
}

impl ConnectionLike for NodeConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        let route = RoutingInfo::SingleNode(self.route());
        Box::pin(self.conn.route_command(cmd.clone(), route))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        let route = self.route();
        Box::pin(self.conn.route_pipeline(pipeline.clone(), offset, count, route))
    }

    fn get_db(&self) -> i64 {
        0
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.0 {
            Inner::Single(c) => c.req_packed_command(cmd),
            Inner::Plain(c) => c.req_packed_command(cmd),
            Inner::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.0 {
            Inner::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Inner::Plain(c) => c.req_packed_commands(pipeline, offset, count),
            Inner::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.0 {
            Inner::Single(c) => c.get_db(),
            Inner::Plain(c) => c.get_db(),
            Inner::Cluster(c) => c.get_db(),
        }
    }
}
