//! The Redis Streams source for the shared driver: a consumer group in, outcomes out as
//! `XACK`, dead-letter entries, or entries left pending for `XAUTOCLAIM`.

mod entry;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idem_core::driver::{Action, DeadLetter, Opening, Source, SourceConfig, headers};
use redis::aio::ConnectionManager;
use redis::streams::{StreamAutoClaimReply, StreamReadReply};
use redis::{Client, RedisError};

use entry::Fields;
pub use entry::StreamEntry;

use crate::Error;

/// A Redis stream's settings for the driver: the stream, the consumer group, this consumer's
/// name, and what is specific to Redis. Batch size and idle wait (the `XREADGROUP` block time)
/// are the driver's ([`Builder`](idem_core::driver::Builder)).
///
/// Defaults: dead letters to `<stream>:dead-letter`; entries idle for 30 s are taken over with
/// `XAUTOCLAIM`; no delivery limit; payload in the field `payload`, message id in `message_id`;
/// the group is created (with the stream) when missing, reading from the stream's start.
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
    client: Client,
    stream: String,
    group: String,
    consumer: String,
    dead_letter: Option<String>,
    reclaim_idle: Duration,
    max_deliveries: Option<u64>,
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
        Self {
            client,
            stream: stream.into(),
            group: group.into(),
            consumer: consumer.into(),
            dead_letter: None,
            reclaim_idle: Duration::from_secs(30),
            max_deliveries: None,
            payload_field: "payload".into(),
            id_field: "message_id".into(),
            create_group: true,
        }
    }

    /// Where conflicts and permanent failures go (default `<stream>:dead-letter`).
    pub fn dead_letter_stream(mut self, key: impl Into<String>) -> Self {
        self.dead_letter = Some(key.into());
        self
    }

    /// How long an entry must sit unacknowledged before any consumer of the group takes it
    /// over with `XAUTOCLAIM` (default 30 s): the redelivery delay of a retry, and of the entries
    /// of a consumer that died. Make it longer than a batch takes.
    pub fn reclaim_idle(mut self, d: Duration) -> Self {
        self.reclaim_idle = d;
        self
    }

    /// Dead-letters an entry, instead of leaving it pending once more, when a retry is due at
    /// its `n`-th delivery (a transient failure that never heals, a key that stays in progress).
    /// Default: no limit, so such an entry keeps coming back.
    pub fn max_deliveries(mut self, n: u64) -> Self {
        self.max_deliveries = Some(n);
        self
    }

    /// The field holding the payload (default `payload`).
    pub fn payload_field(mut self, name: impl Into<String>) -> Self {
        self.payload_field = name.into();
        self
    }

    /// The field the entry's message id is read from (default `message_id`); the engine's key
    /// extractor decides what the key is (see [`StreamEntry`]).
    pub fn id_field(mut self, name: impl Into<String>) -> Self {
        self.id_field = name.into();
        self
    }

    /// Whether opening creates the group (and the stream) when missing, reading from the
    /// stream's start (default true).
    pub fn create_group(mut self, create: bool) -> Self {
        self.create_group = create;
        self
    }
}

/// A consumer-group member of a Redis stream, opened for the driver (see [`StreamConfig`]).
pub struct StreamSource {
    /// For blocking reads (a response timeout longer than the block time).
    reader: ConnectionManager,
    /// For claims, acks and dead letters.
    conn: ConnectionManager,
    stream: String,
    group: String,
    consumer: String,
    dead_letter: String,
    reclaim_idle: Duration,
    max_deliveries: Option<u64>,
    roles: Arc<Fields>,
    reclaim: Mutex<Reclaim>,
}

/// Where the `XAUTOCLAIM` scan is, and when it last ran.
struct Reclaim {
    cursor: String,
    last: Option<Instant>,
}

impl std::fmt::Debug for StreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSource")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .field("consumer", &self.consumer)
            .finish_non_exhaustive()
    }
}

impl StreamSource {
    /// The dead-letter stream's key.
    pub fn dead_letter_stream(&self) -> &str {
        &self.dead_letter
    }

    fn reclaim_state(&self) -> std::sync::MutexGuard<'_, Reclaim> {
        self.reclaim.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Entries left pending by dead or stalled consumers (`XAUTOCLAIM`), at most every quarter
    /// of the idle time unless a full page came back, each with its delivery count when a
    /// delivery limit is set.
    async fn reclaim(&self, max: usize) -> Result<Vec<StreamEntry>, Error> {
        let every = (self.reclaim_idle / 4).max(Duration::from_millis(50));
        let cursor = {
            let mut st = self.reclaim_state();
            let due = st.cursor != "0-0" || st.last.is_none_or(|t| t.elapsed() >= every);
            if !due {
                return Ok(Vec::new());
            }
            st.last = Some(Instant::now());
            st.cursor.clone()
        };
        let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&self.consumer)
            .arg(u64::try_from(self.reclaim_idle.as_millis()).unwrap_or(u64::MAX))
            .arg(&cursor)
            .arg("COUNT")
            .arg(max)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(Error::redis("XAUTOCLAIM"))?;
        self.reclaim_state().cursor = reply.next_stream_id;
        if !reply.claimed.is_empty() {
            tracing::debug!(target: "idem", stream = %self.stream, n = reply.claimed.len(),
                "reclaimed entries left pending by another consumer");
        }
        let mut entries: Vec<StreamEntry> = reply
            .claimed
            .into_iter()
            .map(|e| StreamEntry::from_reply(e.id, e.map, &self.roles, 2))
            .collect();
        if self.max_deliveries.is_none() || entries.is_empty() {
            return Ok(entries);
        }
        // XAUTOCLAIM counted this delivery; read each entry's count from the pending list.
        let mut pipe = redis::pipe();
        for e in &entries {
            pipe.cmd("XPENDING").arg(&self.stream).arg(&self.group).arg(e.id()).arg(e.id()).arg(1);
        }
        let rows: Vec<Vec<(String, String, u64, u64)>> =
            pipe.query_async(&mut self.conn.clone()).await.map_err(Error::redis("XPENDING"))?;
        for (e, row) in entries.iter_mut().zip(rows) {
            if let Some((_, _, _, n)) = row.first() {
                e.set_deliveries(*n);
            }
        }
        Ok(entries)
    }
}

impl SourceConfig for StreamConfig {
    type Source = StreamSource;

    /// Checks the settings, connects (two connections: one for blocking reads, one for acks and
    /// dead letters) and creates the group if asked.
    async fn open(self, opening: Opening<'_>) -> Result<StreamSource, Error> {
        for (field, value) in
            [("stream", &self.stream), ("group", &self.group), ("consumer", &self.consumer)]
        {
            if value.is_empty() {
                return Err(Error::Config { field, problem: "is empty" });
            }
        }
        if let Some(n) = self.max_deliveries {
            // Each delivery may wait `reclaim_idle` before the next: retention must cover them all.
            let deliveries = u32::try_from(n).unwrap_or(u32::MAX);
            idem_core::RetentionWindow::new(deliveries, self.reclaim_idle)
                .check(opening.retention)?;
        }
        let conn_cfg = |timeout| {
            redis::aio::ConnectionManagerConfig::new()
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(3)
        };
        // The driver's idle wait is the block time; a read may take that long and more.
        let reader = self
            .client
            .get_connection_manager_with_config(conn_cfg(Duration::from_secs(65)))
            .await
            .map_err(Error::redis("connect"))?;
        let mut conn = self
            .client
            .get_connection_manager_with_config(conn_cfg(Duration::from_secs(5)))
            .await
            .map_err(Error::redis("connect"))?;
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
        }
        Ok(StreamSource {
            reader,
            conn,
            dead_letter: self.dead_letter.unwrap_or_else(|| format!("{}:dead-letter", self.stream)),
            stream: self.stream,
            group: self.group,
            consumer: self.consumer,
            reclaim_idle: self.reclaim_idle,
            max_deliveries: self.max_deliveries,
            roles: Arc::new(Fields { payload: self.payload_field, id: self.id_field }),
            reclaim: Mutex::new(Reclaim { cursor: "0-0".to_owned(), last: None }),
        })
    }
}

impl Source for StreamSource {
    type Message = StreamEntry;
    type Error = Error;

    /// Entries of dead or stalled consumers first (`XAUTOCLAIM`), then new ones (`XREADGROUP …
    /// >`, blocking up to `wait` when nothing was reclaimed).
    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<StreamEntry>, Error> {
        let mut out = self.reclaim(max).await?;
        let room = max.saturating_sub(out.len());
        if room == 0 {
            return Ok(out);
        }
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg(&self.group).arg(&self.consumer).arg("COUNT").arg(room);
        if out.is_empty() {
            cmd.arg("BLOCK").arg(u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1));
        }
        cmd.arg("STREAMS").arg(&self.stream).arg(">");
        let reply: Option<StreamReadReply> =
            cmd.query_async(&mut self.reader.clone()).await.map_err(Error::redis("XREADGROUP"))?;
        for key in reply.map(|r| r.keys).unwrap_or_default() {
            out.extend(
                key.ids.into_iter().map(|e| StreamEntry::from_reply(e.id, e.map, &self.roles, 1)),
            );
        }
        Ok(out)
    }

    fn give_up(&self, entry: &StreamEntry) -> Option<String> {
        let max = self.max_deliveries?;
        (entry.deliveries() >= max)
            .then(|| format!("gave up after {} deliveries (max_deliveries)", entry.deliveries()))
    }

    /// One pipeline of `XADD`s to the dead-letter stream: the entry's fields, the `idem-*`
    /// headers, `idem-source` (the stream), `idem-source-position` (the entry id) and
    /// `idem-group`. A copy made twice (a crash before the ack) is harmless.
    async fn dead_letter(&self, items: &[(&StreamEntry, DeadLetter)]) -> Vec<Result<(), Error>> {
        let mut pipe = redis::pipe();
        for (entry, dl) in items {
            let c = pipe.cmd("XADD").arg(&self.dead_letter).arg("*");
            for (k, v) in entry.fields() {
                c.arg(k).arg(v);
            }
            for (name, value) in dl.headers() {
                c.arg(name).arg(value);
            }
            c.arg(headers::SOURCE)
                .arg(&self.stream)
                .arg(headers::POSITION)
                .arg(entry.id())
                .arg("idem-group")
                .arg(&self.group);
        }
        let written: Result<Vec<String>, RedisError> =
            pipe.query_async(&mut self.conn.clone()).await;
        match written {
            Ok(_) => items.iter().map(|_| Ok(())).collect(),
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
    /// pending: `XAUTOCLAIM` hands them out again after the idle time (Redis has no delayed
    /// redelivery, so the retry delay cannot be honoured more precisely).
    async fn settle(&self, items: Vec<(StreamEntry, Action)>) -> Result<u64, Error> {
        let ids: Vec<&str> = items
            .iter()
            .filter(|(_, a)| matches!(a, Action::Ack | Action::DeadLettered { .. }))
            .map(|(e, _)| e.id())
            .collect();
        if ids.is_empty() {
            return Ok(0);
        }
        let acked: Result<i64, RedisError> = redis::cmd("XACK")
            .arg(&self.stream)
            .arg(&self.group)
            .arg(&ids)
            .query_async(&mut self.conn.clone())
            .await;
        match acked {
            Ok(_) => Ok(0),
            // Left pending, they come back through XAUTOCLAIM and are found done.
            Err(e) => {
                tracing::warn!(target: "idem", stream = %self.stream, error = %e, n = ids.len(),
                    "XACK failed; the entries stay pending and come back as duplicates");
                Ok(u64::try_from(ids.len()).unwrap_or(u64::MAX))
            }
        }
    }
}
