//! The stream's settings, checked and opened into a [`StreamSource`].

use std::time::Duration;

use idem_core::RedeliveryWindow;
use idem_core::consumer::{Opening, SourceConfig};
use redis::streams::StreamInfoGroupsReply;
use redis::{Client, RedisError};

use super::delivery::Fields;
use super::source::{Names, StreamSource};
use crate::store::Deployment;
use crate::{Error, RedisConnection};

/// A Redis stream's settings for the consumer: the stream, the consumer group, this consumer's
/// name, and what is specific to Redis. Batch size and idle wait (the `XREADGROUP` block time)
/// are the consumer's ([`Builder`](idem_core::consumer::Builder)).
///
/// Defaults: dead letters to `<stream>:dead-letter`; entries idle for 30 s are taken over with
/// `XAUTOCLAIM`; no delivery limit; payload in the field `payload`, message id in `message_id`;
/// the group is created (with the stream) when missing, reading from the stream's start.
///
/// Every setting is checked when the consumer is built; an error names the setting
/// ([`Error::Config`]).
///
/// ```
/// use std::time::Duration;
/// use idem_redis::StreamConfig;
///
/// # fn f(client: redis::Client) {
/// let config = StreamConfig::new(client, "orders", "billing", "billing-1")
///     .reclaim_idle(Duration::from_secs(60))
///     .max_deliveries(10);
/// # }
/// ```
#[derive(Debug)]
#[must_use]
pub struct StreamConfig {
    client: Deployment,
    stream: String,
    group: String,
    consumer: String,
    dead_letter: Option<String>,
    reclaim_idle: Duration,
    max_deliveries: Option<u64>,
    dead_letter_allowance: Duration,
    payload_field: String,
    id_field: String,
    create_group: bool,
}

impl StreamConfig {
    /// Reads `stream` as `consumer` (unique per process) of the consumer `group` (competing
    /// consumers share one).
    pub fn new(
        client: Client,
        stream: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
    ) -> Self {
        Self::with(
            Deployment::Single(Box::new(client)),
            stream.into(),
            group.into(),
            consumer.into(),
        )
    }

    /// [`new`](Self::new) for a stream on a Redis Cluster: commands on the stream go to the
    /// master owning its slot (following redirections and failovers), each blocking read on a
    /// cluster connection of its own.
    ///
    /// ```
    /// use idem_redis::StreamConfig;
    ///
    /// # fn f() -> Result<(), redis::RedisError> {
    /// let nodes = ["redis://127.0.0.1:7000/", "redis://127.0.0.1:7001/"];
    /// let config = StreamConfig::cluster(redis::cluster::ClusterClient::new(nodes)?,
    ///                                    "{orders}", "billing", "billing-1");
    /// # Ok(()) }
    /// ```
    pub fn cluster(
        client: redis::cluster::ClusterClient,
        stream: impl Into<String>,
        group: impl Into<String>,
        consumer: impl Into<String>,
    ) -> Self {
        Self::with(
            Deployment::Cluster(Box::new(client)),
            stream.into(),
            group.into(),
            consumer.into(),
        )
    }

    fn with(client: Deployment, stream: String, group: String, consumer: String) -> Self {
        Self {
            client,
            stream,
            group,
            consumer,
            dead_letter: None,
            reclaim_idle: Duration::from_secs(30),
            max_deliveries: None,
            dead_letter_allowance: Duration::ZERO,
            payload_field: "payload".into(),
            id_field: "message_id".into(),
            create_group: true,
        }
    }

    /// Where conflicts, permanent failures and entries past
    /// [`max_deliveries`](Self::max_deliveries) go (default `<stream>:dead-letter`). Not the
    /// consumed stream itself: the group would read each dead letter back as a new entry, so
    /// opening refuses it ([`Error::DeadLetterLoop`]).
    pub fn dead_letter_stream(mut self, key: impl Into<String>) -> Self {
        self.dead_letter = Some(key.into());
        self
    }

    /// How long an entry must sit unacknowledged before any consumer of the group takes it
    /// over with `XAUTOCLAIM` (default 30 s, at least 1 ms): the redelivery delay of a retry,
    /// and of the entries of a consumer that died. Make it longer than a batch takes, or the
    /// batch's entries are handed to another consumer while they are still being handled.
    pub fn reclaim_idle(mut self, d: Duration) -> Self {
        self.reclaim_idle = d;
        self
    }

    /// The most times an entry is delivered (at least 1): when a retry is due at its `n`-th
    /// delivery (a transient failure that never heals, a key that stays in progress), the entry
    /// is dead-lettered instead of being left pending once more. So the handler runs at most
    /// `n` times, about `reclaim_idle` apart, and the dedup records must outlive that window
    /// (checked when the consumer is built). Default: no limit, so such an entry keeps coming
    /// back.
    pub fn max_deliveries(mut self, n: u64) -> Self {
        self.max_deliveries = Some(n);
        self
    }

    /// How long a dead-lettered entry may wait before an operator puts it back on the stream;
    /// added to the redelivery window the retention must cover (default zero). Only checked
    /// with a [`max_deliveries`](Self::max_deliveries).
    pub fn dead_letter_allowance(mut self, d: Duration) -> Self {
        self.dead_letter_allowance = d;
        self
    }

    /// The field holding the payload (default `payload`).
    pub fn payload_field(mut self, name: impl Into<String>) -> Self {
        self.payload_field = name.into();
        self
    }

    /// The field the entry's message id is read from (default `message_id`); the engine's key
    /// extractor decides what the key is (see [`Delivery`](crate::Delivery)).
    pub fn id_field(mut self, name: impl Into<String>) -> Self {
        self.id_field = name.into();
        self
    }

    /// Whether opening creates the group (and the stream) when missing, reading from the
    /// stream's start (default true). When false, a missing group is an error.
    pub fn create_group(mut self, create: bool) -> Self {
        self.create_group = create;
        self
    }

    /// Every setting that can be wrong on its own, with the field it concerns.
    fn validate(&self) -> Result<(), Error> {
        let bad = |field, problem| Err(Error::Config { field, problem });
        for (field, value) in [
            ("stream", &self.stream),
            ("group", &self.group),
            ("consumer", &self.consumer),
            ("payload_field", &self.payload_field),
            ("id_field", &self.id_field),
        ] {
            if value.is_empty() {
                return bad(field, "is empty");
            }
        }
        match self.dead_letter.as_deref() {
            Some("") => return bad("dead_letter_stream", "is empty"),
            Some(d) if d == self.stream => {
                return Err(Error::DeadLetterLoop {
                    dead_letter: d.to_owned(),
                    stream: self.stream.clone(),
                });
            }
            _ => {}
        }
        if self.reclaim_idle < Duration::from_millis(1) {
            // XAUTOCLAIM with a zero idle time takes every entry in flight from its consumer.
            return bad("reclaim_idle", "must be at least 1 ms");
        }
        if self.max_deliveries == Some(0) {
            return bad("max_deliveries", "must be at least 1");
        }
        Ok(())
    }

    /// The gap between two deliveries of an entry that is left pending: the idle time, then
    /// up to one reclaim period until a consumer's next `XAUTOCLAIM` sees it.
    fn redelivery_gap(&self) -> Duration {
        self.reclaim_idle + super::source::reclaim_period(self.reclaim_idle)
    }
}

impl SourceConfig for StreamConfig {
    type Source = StreamSource;

    /// Checks the settings and the redelivery window against the retention, connects, and
    /// creates the group if asked (or checks that it exists).
    async fn open(self, opening: Opening<'_>) -> Result<StreamSource, Error> {
        crate::tls::ensure_crypto_provider();
        self.validate()?;
        let window = match self.max_deliveries {
            Some(n) => {
                let window = RedeliveryWindow::new(
                    u32::try_from(n).unwrap_or(u32::MAX),
                    self.redelivery_gap(),
                )
                .dead_letter_allowance(self.dead_letter_allowance);
                window.check(opening.retention)?;
                if let Some(lease) = opening.lease
                    && self.reclaim_idle.saturating_mul(u32::try_from(n - 1).unwrap_or(u32::MAX))
                        < lease
                {
                    tracing::warn!(target: "idem", stream = %self.stream, ?lease,
                        reclaim_idle = ?self.reclaim_idle, max_deliveries = n,
                        "the lease outlasts the deliveries: an entry whose consumer died while \
                         handling it may be dead-lettered as in progress elsewhere");
                }
                Some(window)
            }
            None => None,
        };
        let mut conn = match &self.client {
            Deployment::Single(client) => RedisConnection::single(
                client
                    .get_connection_manager_with_config(
                        redis::aio::ConnectionManagerConfig::new()
                            .set_response_timeout(Some(Duration::from_secs(5)))
                            .set_connection_timeout(Some(Duration::from_secs(5)))
                            .set_number_of_retries(3),
                    )
                    .await
                    .map_err(Error::redis("connect"))?,
            ),
            Deployment::Cluster(client) => RedisConnection::cluster(
                client.get_async_connection().await.map_err(Error::redis("connect"))?,
            ),
        };
        if self.create_group {
            let made: Result<(), RedisError> = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&self.stream)
                .arg(&self.group)
                .arg("0")
                .arg("MKSTREAM")
                .query_async(&mut conn)
                .await;
            if let Err(e) = made
                && e.code() != Some("BUSYGROUP")
            {
                return Err(Error::Redis { op: "XGROUP CREATE", source: e });
            }
        } else {
            let groups: Result<StreamInfoGroupsReply, RedisError> =
                redis::cmd("XINFO").arg("GROUPS").arg(&self.stream).query_async(&mut conn).await;
            let exists = match groups {
                Ok(g) => g.groups.iter().any(|g| g.name == self.group),
                // `ERR no such key`: no stream, so no group either.
                Err(e) if e.code() == Some("ERR") => false,
                Err(e) => return Err(Error::Redis { op: "XINFO GROUPS", source: e }),
            };
            if !exists {
                return Err(Error::Config {
                    field: "group",
                    problem: "does not exist on the stream (and create_group is false)",
                });
            }
        }
        let names = Names {
            dead_letter: self.dead_letter.unwrap_or_else(|| format!("{}:dead-letter", self.stream)),
            stream: self.stream,
            group: self.group,
            consumer: self.consumer,
        };
        let roles = Fields { payload: self.payload_field, id: self.id_field };
        Ok(StreamSource::new(
            self.client,
            conn,
            names,
            roles,
            self.reclaim_idle,
            self.max_deliveries,
            window,
        ))
    }
}
