//! The Redis Streams adapter: consumer groups in, outcomes out as `XACK`, dead letters, or
//! entries left pending for `XAUTOCLAIM`.

mod entry;

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::consumer::{Context, Disposition, HandlerError};
use idem_core::{Consumer, DedupStore, Outcome};
use redis::aio::ConnectionManager;
use redis::streams::{StreamAutoClaimReply, StreamReadReply};
use redis::{Client, RedisError};
use serde::Serialize;
use serde::de::DeserializeOwned;

use entry::Fields;
pub use entry::StreamEntry;

use crate::Error;

/// What [`StreamConsumer::settle`] did with a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Settled {
    /// Entries acknowledged (processed or duplicate).
    pub acked: usize,
    /// Entries copied to the dead-letter stream, then acknowledged.
    pub dead_lettered: usize,
    /// Entries left pending (in progress elsewhere, transient failure): `XAUTOCLAIM` hands them
    /// out again after the idle time.
    pub left_pending: usize,
}

impl std::ops::AddAssign for Settled {
    fn add_assign(&mut self, o: Self) {
        self.acked += o.acked;
        self.dead_lettered += o.dead_lettered;
        self.left_pending += o.left_pending;
    }
}

struct Config {
    stream: String,
    group: String,
    consumer: String,
    dead_letter: String,
    batch: usize,
    block: Duration,
    reclaim_idle: Duration,
    max_deliveries: Option<u64>,
    roles: Arc<Fields>,
}

/// A competing consumer of a Redis stream, made idempotent by a [`Consumer`] engine.
///
/// Each [`poll`](Self::poll): entries idle in the group's pending list for longer than
/// [`reclaim_idle`](StreamConsumerBuilder::reclaim_idle) (their consumer died or stalled) are
/// taken over with `XAUTOCLAIM`, new entries are read with `XREADGROUP`, the batch goes through
/// [`Consumer::process_batch`] (one `claim_many` round trip), and each outcome's
/// [`Disposition`] is applied:
///
/// - `Ack` → `XACK`, only after `process_batch` returned, so after the completion is recorded;
/// - `DeadLetter` → `XADD` to the dead-letter stream (the entry's fields plus `idem-reason`,
///   `idem-source-stream`, `idem-source-id`, `idem-group`), and once that succeeded, `XACK`;
/// - `Retry` → nothing: the entry stays pending and comes back through `XAUTOCLAIM`.
///
/// The steps are public too ([`read`](Self::read), [`handle`](Self::handle),
/// [`settle`](Self::settle)) so a caller can interpose, and tests can crash between them.
///
/// ```no_run
/// use idem_core::{Consumer, consumer::HandlerError};
/// use idem_redis::{RedisStore, StreamConsumer};
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::connect("redis://127.0.0.1/").await?;
/// let engine = Consumer::builder(store).scope("billing").build()?;
/// let client = redis::Client::open("redis://127.0.0.1/")?;
/// let mut orders = StreamConsumer::builder(client, engine)
///     .stream("orders").group("billing").consumer_name("billing-1")
///     .build().await?;
/// let settled = orders
///     .poll(|ctx, _entry| async move { Ok::<_, HandlerError<String>>(ctx.attempt()) })
///     .await?;
/// println!("{settled:?}");
/// # Ok(()) }
/// ```
pub struct StreamConsumer<S> {
    engine: Consumer<S>,
    reader: ConnectionManager,
    conn: ConnectionManager,
    cfg: Config,
    cursor: String,
    last_reclaim: Option<Instant>,
}

impl<S> std::fmt::Debug for StreamConsumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamConsumer")
            .field("stream", &self.cfg.stream)
            .field("group", &self.cfg.group)
            .field("consumer", &self.cfg.consumer)
            .finish_non_exhaustive()
    }
}

/// Configures a [`StreamConsumer`]. Stream, group and consumer name are required.
#[must_use]
pub struct StreamConsumerBuilder<S> {
    client: Client,
    engine: Consumer<S>,
    stream: Option<String>,
    group: Option<String>,
    consumer: Option<String>,
    dead_letter: Option<String>,
    batch: usize,
    block: Duration,
    reclaim_idle: Duration,
    max_deliveries: Option<u64>,
    payload_field: String,
    id_field: String,
    create_group: bool,
}

impl<S> std::fmt::Debug for StreamConsumerBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamConsumerBuilder")
            .field("stream", &self.stream)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

impl<S: DedupStore> StreamConsumerBuilder<S> {
    /// The stream to read.
    pub fn stream(mut self, key: impl Into<String>) -> Self {
        self.stream = Some(key.into());
        self
    }

    /// The consumer group (competing consumers share one).
    pub fn group(mut self, name: impl Into<String>) -> Self {
        self.group = Some(name.into());
        self
    }

    /// This consumer's name within the group (unique per process).
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.consumer = Some(name.into());
        self
    }

    /// Where conflicts and permanent failures go (default `<stream>:dead-letter`).
    pub fn dead_letter_stream(mut self, key: impl Into<String>) -> Self {
        self.dead_letter = Some(key.into());
        self
    }

    /// Most entries per read (default 64).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch = n;
        self
    }

    /// How long a read waits for new entries (default 1 s).
    pub fn block(mut self, d: Duration) -> Self {
        self.block = d;
        self
    }

    /// How long an entry must sit unacknowledged before any consumer of the group takes it
    /// over with `XAUTOCLAIM` (default 30 s). Make it longer than a normal batch takes.
    pub fn reclaim_idle(mut self, d: Duration) -> Self {
        self.reclaim_idle = d;
        self
    }

    /// Dead-letter an entry that `XAUTOCLAIM` hands out for the `n + 1`-th time without an
    /// outcome that settled it (a transient failure that never heals, a handler that always
    /// stalls). Default: no limit, so such an entry keeps coming back.
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

    /// Whether [`build`](Self::build) creates the group (and the stream) when missing, reading
    /// from the stream's start (default true).
    pub fn create_group(mut self, create: bool) -> Self {
        self.create_group = create;
        self
    }

    /// Connects (two connections: one for blocking reads, one for acks and dead letters) and
    /// creates the group if asked.
    ///
    /// # Errors
    /// [`Error::Config`] for a missing setting; [`Error::Redis`] when the server refuses.
    pub async fn build(self) -> Result<StreamConsumer<S>, Error> {
        let need = |v: Option<String>, field| {
            v.filter(|s| !s.is_empty()).ok_or(Error::Config { field, problem: "is not set" })
        };
        let stream = need(self.stream, "stream")?;
        let group = need(self.group, "group")?;
        let consumer = need(self.consumer, "consumer_name")?;
        if self.batch == 0 {
            return Err(Error::Config { field: "batch_size", problem: "must be at least 1" });
        }
        let conn_cfg = |timeout| {
            redis::aio::ConnectionManagerConfig::new()
                .set_response_timeout(Some(timeout))
                .set_number_of_retries(3)
        };
        let reader = self
            .client
            .get_connection_manager_with_config(conn_cfg(self.block + Duration::from_secs(5)))
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
                .arg(&stream)
                .arg(&group)
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
        Ok(StreamConsumer {
            engine: self.engine,
            reader,
            conn,
            cfg: Config {
                dead_letter: self.dead_letter.unwrap_or_else(|| format!("{stream}:dead-letter")),
                stream,
                group,
                consumer,
                batch: self.batch,
                block: self.block,
                reclaim_idle: self.reclaim_idle,
                max_deliveries: self.max_deliveries,
                roles: Arc::new(Fields { payload: self.payload_field, id: self.id_field }),
            },
            cursor: "0-0".to_owned(),
            last_reclaim: None,
        })
    }
}

impl<S: DedupStore> StreamConsumer<S> {
    /// A builder over a client and an engine (whose scope, lease, retention and key extractor
    /// apply).
    pub fn builder(client: Client, engine: Consumer<S>) -> StreamConsumerBuilder<S> {
        StreamConsumerBuilder {
            client,
            engine,
            stream: None,
            group: None,
            consumer: None,
            dead_letter: None,
            batch: 64,
            block: Duration::from_secs(1),
            reclaim_idle: Duration::from_secs(30),
            max_deliveries: None,
            payload_field: "payload".into(),
            id_field: "message_id".into(),
            create_group: true,
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Consumer<S> {
        &self.engine
    }

    /// The dead-letter stream's key.
    pub fn dead_letter_stream(&self) -> &str {
        &self.cfg.dead_letter
    }

    /// Reads the next batch: first entries of dead or stalled consumers (`XAUTOCLAIM`, at most
    /// every quarter of the idle time unless a full page came back), then new ones
    /// (`XREADGROUP … >`, waiting up to the block time when nothing was reclaimed).
    ///
    /// # Errors
    /// [`Error::Redis`].
    ///
    /// # Cancel safety
    /// Not cancel safe: entries read by a dropped call stay pending for this consumer until
    /// `XAUTOCLAIM` hands them out again after the idle time. Nothing is lost.
    pub async fn read(&mut self) -> Result<Vec<StreamEntry>, Error> {
        let mut out = self.reclaim().await?;
        let room = self.cfg.batch.saturating_sub(out.len());
        if room == 0 {
            return Ok(out);
        }
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP").arg(&self.cfg.group).arg(&self.cfg.consumer).arg("COUNT").arg(room);
        if out.is_empty() {
            cmd.arg("BLOCK").arg(u64::try_from(self.cfg.block.as_millis()).unwrap_or(u64::MAX));
        }
        cmd.arg("STREAMS").arg(&self.cfg.stream).arg(">");
        let reply: Option<StreamReadReply> =
            cmd.query_async(&mut self.reader).await.map_err(Error::redis("XREADGROUP"))?;
        for key in reply.map(|r| r.keys).unwrap_or_default() {
            out.extend(
                key.ids.into_iter().map(|e| StreamEntry::from_reply(e.id, e.map, &self.cfg.roles)),
            );
        }
        Ok(out)
    }

    async fn reclaim(&mut self) -> Result<Vec<StreamEntry>, Error> {
        let every = (self.cfg.reclaim_idle / 4).max(Duration::from_millis(50));
        let due = self.cursor != "0-0" || self.last_reclaim.is_none_or(|t| t.elapsed() >= every);
        if !due {
            return Ok(Vec::new());
        }
        self.last_reclaim = Some(Instant::now());
        let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
            .arg(&self.cfg.stream)
            .arg(&self.cfg.group)
            .arg(&self.cfg.consumer)
            .arg(u64::try_from(self.cfg.reclaim_idle.as_millis()).unwrap_or(u64::MAX))
            .arg(&self.cursor)
            .arg("COUNT")
            .arg(self.cfg.batch)
            .query_async(&mut self.conn)
            .await
            .map_err(Error::redis("XAUTOCLAIM"))?;
        self.cursor = reply.next_stream_id;
        if !reply.claimed.is_empty() {
            tracing::debug!(target: "idem", stream = %self.cfg.stream, n = reply.claimed.len(),
                "reclaimed entries left pending by another consumer");
        }
        let entries: Vec<StreamEntry> = reply
            .claimed
            .into_iter()
            .map(|e| StreamEntry::from_reply(e.id, e.map, &self.cfg.roles))
            .collect();
        let Some(max) = self.cfg.max_deliveries else { return Ok(entries) };
        if entries.is_empty() {
            return Ok(entries);
        }
        // XAUTOCLAIM counted this delivery; read each entry's count from the pending list.
        let mut pipe = redis::pipe();
        for e in &entries {
            pipe.cmd("XPENDING")
                .arg(&self.cfg.stream)
                .arg(&self.cfg.group)
                .arg(e.id())
                .arg(e.id())
                .arg(1);
        }
        let rows: Vec<Vec<(String, String, u64, u64)>> =
            pipe.query_async(&mut self.conn).await.map_err(Error::redis("XPENDING"))?;
        let mut keep = Vec::new();
        let mut dead = Vec::new();
        for (e, row) in entries.into_iter().zip(rows) {
            match row.first() {
                Some((_, _, _, n)) if *n > max => dead.push((
                    e,
                    format!("delivered {n} times without being settled (max_deliveries {max})"),
                )),
                _ => keep.push(e),
            }
        }
        if !dead.is_empty() {
            let refs: Vec<(&StreamEntry, String)> =
                dead.iter().map(|(e, r)| (e, r.clone())).collect();
            self.dead_letter(&refs).await?;
            let ids: Vec<&str> = refs.iter().map(|(e, _)| e.id()).collect();
            self.ack(&ids).await?;
            tracing::warn!(target: "idem", stream = %self.cfg.stream, n = ids.len(),
                "dead-lettered entries over max_deliveries");
        }
        Ok(keep)
    }

    /// Copies entries to the dead-letter stream with their reasons (one pipeline), returning
    /// once every copy is written.
    async fn dead_letter(&mut self, items: &[(&StreamEntry, String)]) -> Result<(), Error> {
        if items.is_empty() {
            return Ok(());
        }
        let mut pipe = redis::pipe();
        for (entry, reason) in items {
            let c = pipe.cmd("XADD").arg(&self.cfg.dead_letter).arg("*");
            for (k, v) in entry.fields() {
                c.arg(k).arg(v);
            }
            c.arg("idem-reason")
                .arg(reason)
                .arg("idem-source-stream")
                .arg(&self.cfg.stream)
                .arg("idem-source-id")
                .arg(entry.id())
                .arg("idem-group")
                .arg(&self.cfg.group);
        }
        let _: Vec<String> =
            pipe.query_async(&mut self.conn).await.map_err(Error::redis("XADD dead letter"))?;
        Ok(())
    }

    async fn ack(&mut self, ids: &[&str]) -> Result<(), Error> {
        if ids.is_empty() {
            return Ok(());
        }
        let _: i64 = redis::cmd("XACK")
            .arg(&self.cfg.stream)
            .arg(&self.cfg.group)
            .arg(ids)
            .query_async(&mut self.conn)
            .await
            .map_err(Error::redis("XACK"))?;
        Ok(())
    }

    /// Runs a batch through the engine: one `claim_many` round trip, then the acquired
    /// handlers concurrently, each completion recorded before this returns. Acknowledges
    /// nothing: pass the outcomes to [`settle`](Self::settle).
    pub async fn handle<'m, T, E, F, Fut>(
        &self,
        entries: &'m [StreamEntry],
        handler: F,
    ) -> Vec<Outcome<T, E>>
    where
        T: Serialize + DeserializeOwned,
        E: Display,
        F: Fn(Context, &'m StreamEntry) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        self.engine.process_batch(entries, handler).await
    }

    /// Applies each outcome's [`Disposition`]: dead letters first (`XADD`, pipelined), then one
    /// `XACK` for the acked and the dead-lettered entries. An entry whose dead letter could not
    /// be written is not acked.
    ///
    /// # Errors
    /// [`Error::Redis`]; when the dead-letter write fails nothing of the batch is acked (the
    /// processed entries come back as duplicates).
    ///
    /// # Panics
    /// Never; `entries` and `outcomes` are zipped, and a length mismatch leaves the extra
    /// entries pending.
    pub async fn settle<T, E: Display>(
        &mut self,
        entries: &[StreamEntry],
        outcomes: &[Outcome<T, E>],
    ) -> Result<Settled, Error> {
        let mut done = Settled::default();
        let mut ack: Vec<&str> = Vec::new();
        let mut dead: Vec<(&StreamEntry, String)> = Vec::new();
        for (entry, outcome) in entries.iter().zip(outcomes) {
            match outcome.disposition() {
                Disposition::Ack => {
                    ack.push(entry.id());
                    done.acked += 1;
                }
                Disposition::DeadLetter { reason } => {
                    ack.push(entry.id());
                    dead.push((entry, reason));
                    done.dead_lettered += 1;
                }
                _ => done.left_pending += 1,
            }
        }
        done.left_pending += entries.len().saturating_sub(outcomes.len());
        // Written and confirmed before the ack: a crash in between dead-letters the entry
        // twice, never zero times.
        self.dead_letter(&dead).await?;
        self.ack(&ack).await?;
        Ok(done)
    }

    /// One round: [`read`](Self::read), [`handle`](Self::handle), [`settle`](Self::settle).
    /// The handler gets its own copy of the entry, so its future may outlive the batch.
    ///
    /// # Errors
    /// [`Error::Redis`] from reading or settling (store failures are outcomes: the entries
    /// stay pending).
    pub async fn poll<T, E, F, Fut>(&mut self, handler: F) -> Result<Settled, Error>
    where
        T: Serialize + DeserializeOwned,
        E: Display,
        F: Fn(Context, StreamEntry) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let entries = self.read().await?;
        if entries.is_empty() {
            return Ok(Settled::default());
        }
        let outcomes = self.handle(&entries, |ctx, e| handler(ctx, e.clone())).await;
        self.settle(&entries, &outcomes).await
    }

    /// Polls until `shutdown` resolves (checked between rounds, so a batch in flight is always
    /// settled), returning the totals.
    ///
    /// # Errors
    /// The first [`Error::Redis`] from a round.
    pub async fn run<T, E, F, Fut>(
        &mut self,
        handler: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Settled, Error>
    where
        T: Serialize + DeserializeOwned,
        E: Display,
        F: Fn(Context, StreamEntry) -> Fut,
        Fut: Future<Output = Result<T, HandlerError<E>>>,
    {
        let mut total = Settled::default();
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let stop = std::future::poll_fn(|cx| {
                std::task::Poll::Ready(shutdown.as_mut().poll(cx).is_ready())
            })
            .await;
            if stop {
                return Ok(total);
            }
            total += self.poll(&handler).await?;
        }
    }
}
