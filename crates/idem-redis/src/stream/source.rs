//! The consumer-group side of the consumer: reading, reclaiming, dead letters and `XACK`.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use idem_core::RedeliveryWindow;
use idem_core::consumer::{DeadLetter, Source, headers};
use idem_core::engine::Verb;
use redis::streams::{StreamAutoClaimReply, StreamReadReply};
use redis::{RedisError, RedisResult};

use super::delivery::{Delivery, Fields};
use crate::store::Deployment;
use crate::{Error, RedisConnection};

/// The dead-letter copy's field naming the consumer group that gave up on the entry, beside
/// the shared [`headers`](idem_core::consumer::headers).
pub const GROUP_FIELD: &str = "idem-group";

/// How long a blocking read may take beyond its block time before its connection is taken for
/// lost.
const READ_MARGIN: Duration = Duration::from_secs(5);

/// The fields a dead-letter copy sets itself; the entry's own fields of those names (a dead
/// letter put back on the stream) are replaced, not repeated.
const DEAD_LETTER_FIELDS: [&str; 7] = [
    headers::REASON,
    headers::OUTCOME,
    headers::SCOPE,
    headers::SOURCE,
    headers::POSITION,
    headers::DELIVERED,
    GROUP_FIELD,
];

/// How often a consumer looks for entries left pending by others: a quarter of the idle time
/// (at least 50 ms), so an entry comes back at most a quarter late.
pub(super) fn reclaim_period(reclaim_idle: Duration) -> Duration {
    (reclaim_idle / 4).max(Duration::from_millis(50))
}

/// The keys and names a source works with.
#[derive(Debug)]
pub(super) struct Names {
    pub(super) stream: String,
    pub(super) group: String,
    pub(super) consumer: String,
    pub(super) dead_letter: String,
}

/// A consumer-group member of a Redis stream, opened for the consumer (see
/// [`StreamConfig`](crate::StreamConfig) and the [crate docs](crate) for the verbs).
///
/// Each fetch first takes over entries that sat unacknowledged for longer than the idle time
/// (`XAUTOCLAIM`, at most every quarter of it unless the last scan stopped mid-way), then
/// reads new ones (`XREADGROUP … >`, blocking for the consumer's idle wait when nothing was
/// taken over). Blocking reads run on connections of their own, one per batch in flight;
/// claims, acks and dead letters share another.
pub struct StreamSource {
    client: Deployment,
    /// For claims, acks and dead letters (reconnects by itself).
    conn: RedisConnection,
    /// Idle connections for blocking reads: a read blocks its connection for the block time,
    /// so concurrent fetches each take their own.
    readers: Mutex<Vec<RedisConnection>>,
    names: Names,
    roles: Arc<Fields>,
    reclaim_idle: Duration,
    max_deliveries: Option<u64>,
    window: Option<RedeliveryWindow>,
    scan: Mutex<Scan>,
}

/// Where the `XAUTOCLAIM` scan is, and when it last started.
struct Scan {
    cursor: String,
    last: Option<Instant>,
}

impl std::fmt::Debug for StreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSource")
            .field("stream", &self.names.stream)
            .field("group", &self.names.group)
            .field("consumer", &self.names.consumer)
            .finish_non_exhaustive()
    }
}

impl StreamSource {
    pub(super) fn new(
        client: Deployment,
        conn: RedisConnection,
        names: Names,
        roles: Fields,
        reclaim_idle: Duration,
        max_deliveries: Option<u64>,
        window: Option<RedeliveryWindow>,
    ) -> Self {
        Self {
            client,
            conn,
            readers: Mutex::new(Vec::new()),
            names,
            roles: Arc::new(roles),
            reclaim_idle,
            max_deliveries,
            window,
            scan: Mutex::new(Scan { cursor: "0-0".to_owned(), last: None }),
        }
    }

    /// The stream's key.
    pub fn stream(&self) -> &str {
        &self.names.stream
    }

    /// The consumer group.
    pub fn group(&self) -> &str {
        &self.names.group
    }

    /// The dead-letter stream's key.
    pub fn dead_letter_stream(&self) -> &str {
        &self.names.dead_letter
    }

    /// The redelivery window the retention was checked against (`None` without a
    /// [`max_deliveries`](crate::StreamConfig::max_deliveries): unbounded).
    pub fn redelivery_window(&self) -> Option<RedeliveryWindow> {
        self.window
    }

    fn scan(&self) -> MutexGuard<'_, Scan> {
        self.scan.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn readers(&self) -> MutexGuard<'_, Vec<RedisConnection>> {
        self.readers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Entries that sat unacknowledged for longer than the idle time (their consumer died,
    /// stalled, or left them pending for a retry), each with its delivery count.
    async fn reclaim(&self, max: usize) -> Result<Vec<Delivery>, Error> {
        let cursor = {
            let mut scan = self.scan();
            // A scan that stopped mid-way goes on at once; a new one waits for its period.
            let due = scan.cursor != "0-0"
                || scan.last.is_none_or(|t| t.elapsed() >= reclaim_period(self.reclaim_idle));
            if !due {
                return Ok(Vec::new());
            }
            scan.last = Some(Instant::now());
            scan.cursor.clone()
        };
        let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(&self.names.stream)
            .arg(&self.names.group)
            .arg(&self.names.consumer)
            .arg(u64::try_from(self.reclaim_idle.as_millis()).unwrap_or(u64::MAX))
            .arg(&cursor)
            .arg("COUNT")
            .arg(max)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis("XAUTOCLAIM"))?;
        self.scan().cursor = reply.next_stream_id;
        if reply.claimed.is_empty() {
            return Ok(Vec::new());
        }
        tracing::debug!(target: "idem", stream = %self.names.stream, n = reply.claimed.len(),
            "took over entries left pending");
        // XAUTOCLAIM counted this delivery; the pending list says how many there were.
        let mut pipe = redis::pipe();
        for e in &reply.claimed {
            pipe.cmd("XPENDING")
                .arg(&self.names.stream)
                .arg(&self.names.group)
                .arg(&e.id)
                .arg(&e.id)
                .arg(1);
        }
        let counts: Vec<Vec<(String, String, u64, u64)>> =
            pipe.query_async(&mut self.conn.clone()).await.map_err(Error::redis("XPENDING"))?;
        Ok(reply
            .claimed
            .into_iter()
            .zip(counts)
            .map(|(e, row)| {
                // Acknowledged meanwhile by its first consumer: at least a second delivery.
                let delivered = row.first().map_or(2, |r| r.3);
                Delivery::from_reply(e.id, e.map, &self.roles, delivered)
            })
            .collect())
    }

    /// New entries (`XREADGROUP … >`), blocking up to `block` for the first when given, on a
    /// reader connection of its own. A connection that failed or hung is dropped; the next
    /// read opens another.
    async fn read_new(
        &self,
        count: usize,
        block: Option<Duration>,
    ) -> Result<Vec<Delivery>, Error> {
        let idle = self.readers().pop();
        let mut conn = match idle {
            Some(c) => c,
            // The consumer bounds each read; the connection itself waits as long as it blocks.
            None => match &self.client {
                Deployment::Single(client) => {
                    let config = redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(READ_MARGIN))
                        .set_response_timeout(None);
                    RedisConnection::plain(
                        client
                            .get_multiplexed_async_connection_with_config(&config)
                            .await
                            .map_err(Error::redis("connect"))?,
                    )
                }
                Deployment::Cluster(client) => {
                    let config = redis::cluster::ClusterConfig::new()
                        .set_connection_timeout(READ_MARGIN)
                        .set_response_timeout(Duration::from_secs(24 * 3600));
                    RedisConnection::cluster(
                        client
                            .get_async_connection_with_config(config)
                            .await
                            .map_err(Error::redis("connect"))?,
                    )
                }
            },
        };
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg(&self.names.group).arg(&self.names.consumer).arg("COUNT").arg(count);
        if let Some(wait) = block {
            // BLOCK 0 would wait forever.
            cmd.arg("BLOCK").arg(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1));
        }
        cmd.arg("STREAMS").arg(&self.names.stream).arg(">");
        let limit = block.unwrap_or_default() + READ_MARGIN;
        let read: RedisResult<Option<StreamReadReply>> =
            match tokio::time::timeout(limit, cmd.query_async(&mut conn)).await {
                Ok(r) => r,
                Err(_) => return Err(Error::Timeout { op: "XREADGROUP", after: limit }),
            };
        let reply = read.map_err(Error::redis("XREADGROUP"))?;
        self.readers().push(conn);
        Ok(reply
            .map(|r| r.keys)
            .unwrap_or_default()
            .into_iter()
            .flat_map(|k| k.ids)
            .map(|e| Delivery::from_reply(e.id, e.map, &self.roles, 1))
            .collect())
    }
}

impl Source for StreamSource {
    type Delivery = Delivery;
    type Error = Error;

    /// Entries left pending first (`XAUTOCLAIM`), then new ones (`XREADGROUP … >`, blocking
    /// up to `wait` only when nothing was taken over).
    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>, Error> {
        let mut out = self.reclaim(max).await?;
        let room = max.saturating_sub(out.len());
        if room > 0 {
            let block = out.is_empty().then_some(wait);
            out.extend(self.read_new(room, block).await?);
        }
        Ok(out)
    }

    /// The group or the stream is gone (`NOGROUP`): reading again cannot help.
    fn is_fatal(&self, error: &Error) -> bool {
        matches!(error, Error::Redis { source, .. } if source.code() == Some("NOGROUP"))
    }

    /// Keeps a batch this consumer holds from being taken over while it waits for its turn or
    /// its handlers run: every quarter of the idle time, `XCLAIM … JUSTID` of its entries
    /// resets their idle time (the delivery count is left alone). Only entries idle for an
    /// eighth of it or more are claimed, so an entry another consumer has just taken over is
    /// not taken back (and if one were, the store still decides who runs it).
    async fn keep_alive(&self, batch: &[Delivery]) {
        let every = reclaim_period(self.reclaim_idle);
        let min_idle = u64::try_from((self.reclaim_idle / 8).as_millis()).unwrap_or(u64::MAX);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            let mut cmd = redis::cmd("XCLAIM");
            cmd.arg(&self.names.stream).arg(&self.names.group).arg(&self.names.consumer);
            cmd.arg(min_idle);
            for e in batch {
                cmd.arg(e.id());
            }
            cmd.arg("JUSTID");
            let claimed: RedisResult<Vec<String>> = cmd.query_async(&mut self.conn.clone()).await;
            if let Err(e) = claimed {
                tracing::warn!(target: "idem", stream = %self.names.stream, error = %e,
                    "keep-alive XCLAIM failed; the batch may be taken over and found in progress");
            }
        }
    }

    /// With [`max_deliveries`](crate::StreamConfig::max_deliveries), once the entry has been
    /// delivered that many times: leaving it pending would hand it out once more.
    fn give_up(&self, entry: &Delivery) -> Option<String> {
        let max = self.max_deliveries?;
        (entry.delivered() >= max)
            .then(|| format!("gave up after {} deliveries (max_deliveries)", entry.delivered()))
    }

    /// One pipeline of `XADD`s to the dead-letter stream, answered per entry: the entry's
    /// fields, the `idem-*` headers, `idem-source` (the stream), `idem-source-position` (the
    /// entry id), `idem-delivered` and `idem-group`. A copy made twice (a crash before the ack)
    /// is harmless.
    async fn dead_letter(&self, items: &[(&Delivery, DeadLetter)]) -> Vec<Result<(), Error>> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for (entry, dl) in items {
            let c = pipe.cmd("XADD").arg(&self.names.dead_letter).arg("*");
            for (k, v) in entry.fields() {
                if !DEAD_LETTER_FIELDS.iter().any(|f| k.eq_ignore_ascii_case(f)) {
                    c.arg(k).arg(v);
                }
            }
            for (name, value) in dl.headers() {
                c.arg(name).arg(value);
            }
            c.arg(headers::SOURCE)
                .arg(&self.names.stream)
                .arg(headers::POSITION)
                .arg(entry.id())
                .arg(headers::DELIVERED)
                .arg(entry.delivered())
                .arg(GROUP_FIELD)
                .arg(&self.names.group);
        }
        let written: RedisResult<Vec<RedisResult<String>>> =
            pipe.query_async(&mut self.conn.clone()).await;
        match written {
            Ok(each) => {
                let mut each = each.into_iter();
                items
                    .iter()
                    .map(|_| match each.next() {
                        Some(Ok(_)) => Ok(()),
                        Some(Err(source)) => Err(Error::Redis { op: "XADD dead letter", source }),
                        None => Err(Error::Redis {
                            op: "XADD dead letter",
                            source: (redis::ErrorKind::Parse, "no reply for this copy").into(),
                        }),
                    })
                    .collect()
            }
            Err(e) => {
                let e = Arc::new(e);
                items
                    .iter()
                    .map(|_| Err(Error::Shared { op: "XADD dead letter", source: Arc::clone(&e) }))
                    .collect()
            }
        }
    }

    /// One `XACK` for the acknowledged and dead-lettered entries. Retries and releases are left
    /// pending: `XAUTOCLAIM` hands them out again once they have been idle for `reclaim_idle`
    /// (Redis cannot delay a redelivery, so a retry's suggested delay is not honoured).
    async fn settle(&self, items: Vec<(Delivery, Verb)>) -> Result<u64, Error> {
        let ids: Vec<&str> = items
            .iter()
            .filter(|(_, v)| matches!(v, Verb::Ack | Verb::DeadLetter { .. }))
            .map(|(e, _)| e.id())
            .collect();
        if ids.is_empty() {
            return Ok(0);
        }
        let acked: Result<i64, RedisError> = redis::cmd("XACK")
            .arg(&self.names.stream)
            .arg(&self.names.group)
            .arg(&ids)
            .query_async(&mut self.conn.clone())
            .await;
        match acked {
            Ok(_) => Ok(0),
            // The connection manager reconnects; the entries stay pending, come back through
            // XAUTOCLAIM and are found done.
            Err(e) => {
                tracing::warn!(target: "idem", stream = %self.names.stream, error = %e,
                    n = ids.len(), "XACK failed; the entries stay pending and come back as duplicates");
                Ok(u64::try_from(ids.len()).unwrap_or(u64::MAX))
            }
        }
    }
}
