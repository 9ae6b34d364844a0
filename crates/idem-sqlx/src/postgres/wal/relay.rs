//! The WAL relay: peeks committed messages from the slot, publishes them, advances the slot
//! past what the broker confirmed.

use std::future::Future;
use std::time::{Duration, Instant};

use idem_core::StoreError;
use idem_core::outbox::{OutboxMessage, PublishError, Publisher, RelayReport};
use idem_core::telemetry::{
    OUTBOX_FAILURES_TOTAL, OUTBOX_PUBLISH_SECONDS, OUTBOX_PUBLISHED_TOTAL, OUTBOX_WAL_LAG_BYTES,
};
use sqlx::Connection as _;
use sqlx::postgres::PgConnection;

use super::pgoutput::{committed, format_lsn, parse_lsn};
use super::{PostgresWalOutbox, frame};
use crate::postgres::backend;

/// Why a WAL relay stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WalRelayError {
    /// The database failed in a way retrying will not fix (no such slot, `wal_level` not
    /// logical, a message that does not decode), or failed
    /// [`WalRelayBuilder::store_failures`] times in a row.
    #[error("WAL outbox slot failed; the relay stopped")]
    Store(#[source] StoreError),
    /// Another relay holds the slot ([`WalRelay::run_until_empty`] does not wait for it).
    #[error("another relay is reading slot {slot}")]
    Busy {
        /// The slot.
        slot: String,
    },
    /// The oldest unconfirmed message failed [`WalRelayBuilder::max_attempts`] times in a row.
    /// The slot stays before it: nothing after it is lost, nothing is skipped.
    #[error("message {id} failed {attempts} publishes in a row; the slot stays before it")]
    Stuck {
        /// The message's id.
        id: String,
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        #[source]
        source: PublishError,
    },
    /// A setting is out of range.
    #[error("WAL relay setting {field} is invalid: {why}")]
    Config {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
}

#[derive(Debug, Clone)]
struct Settings {
    batch: usize,
    publish_timeout: Duration,
    max_attempts: u32,
    backoff: (Duration, Duration),
    poll: Duration,
    store_failures: u32,
}

/// Configures a [`WalRelay`]; see [`WalRelay::builder`].
#[derive(Debug)]
#[must_use]
pub struct WalRelayBuilder<P> {
    outbox: PostgresWalOutbox,
    publisher: P,
    settings: Settings,
}

impl<P: Publisher> WalRelayBuilder<P> {
    /// Decoded records per peek (default 4,096): each message is one, each transaction two
    /// more. A peek ends on a transaction boundary, so one large transaction is read whole.
    pub fn batch(mut self, n: usize) -> Self {
        self.settings.batch = n;
        self
    }

    /// How long to wait for the broker to confirm a batch (default 10 s).
    pub fn publish_timeout(mut self, d: Duration) -> Self {
        self.settings.publish_timeout = d;
        self
    }

    /// Failed publishes of the oldest unconfirmed message in a row before the relay stops with
    /// [`WalRelayError::Stuck`] (default 10). There is no parking: the slot cannot move past a
    /// message without losing it.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.settings.max_attempts = n;
        self
    }

    /// Backoff between failed attempts: `first`, doubling up to `max` (default 100 ms to 10 s).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.settings.backoff = (first, max);
        self
    }

    /// How long to wait before peeking again when the slot had nothing (default 20 ms), and
    /// how often a standby relay tries to take the slot over.
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.settings.poll = d;
        self
    }

    /// Database failures in a row (each retried after a backoff, on a new connection) before
    /// the relay stops (default 10).
    pub fn store_failures(mut self, n: u32) -> Self {
        self.settings.store_failures = n;
        self
    }

    /// The relay.
    ///
    /// # Errors
    /// [`WalRelayError::Config`] naming the setting: a batch under 3 (a transaction is at
    /// least three records), a zero publish timeout, attempts or poll interval.
    pub fn build(self) -> Result<WalRelay<P>, WalRelayError> {
        let s = &self.settings;
        let bad = |field, why| Err(WalRelayError::Config { field, why });
        if s.batch < 3 {
            return bad("batch", "must be at least 3");
        }
        if s.publish_timeout.is_zero() {
            return bad("publish_timeout", "must be longer than zero");
        }
        if s.max_attempts == 0 {
            return bad("max_attempts", "must be at least 1");
        }
        if s.poll.is_zero() {
            return bad("poll_interval", "must be longer than zero");
        }
        Ok(WalRelay { outbox: self.outbox, publisher: self.publisher, settings: self.settings })
    }
}

/// Publishes what a [`PostgresWalOutbox`] wrote into the WAL, at least once and in commit
/// order, each message under its stable id so that the idem consumer downstream deduplicates
/// copies.
///
/// Each round, on one connection that holds a session advisory lock on the slot (a second
/// relay on the same slot waits as a standby and takes over when the first one's connection
/// ends): `pg_logical_slot_peek_binary_changes` (pgoutput, messages only) reads committed
/// transactions without consuming them; the relay publishes their messages with confirms;
/// then `pg_replication_slot_advance` moves the slot past the last transaction whose messages
/// — and every earlier one's — the broker confirmed. A relay killed between the confirmation
/// and the advance publishes those messages again when it restarts.
///
/// ```no_run
/// use idem_core::outbox::RecordingPublisher;
/// use idem_sqlx::postgres::{PostgresWalOutbox, WalRelay};
///
/// # async fn run(pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
/// let outbox = PostgresWalOutbox::new(pool);
/// outbox.create_slot().await?;
/// let relay = WalRelay::builder(outbox, RecordingPublisher::new()).build()?;
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// # drop(stop);
/// let report = relay.run(async { let _ = stopped.await; }).await?; // until `stop` is sent
/// println!("{report}");
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct WalRelay<P> {
    outbox: PostgresWalOutbox,
    publisher: P,
    settings: Settings,
}

/// The connection that holds the slot's lock, and where the slot stands.
struct Held {
    conn: PgConnection,
    confirmed: u64,
    lag_at: Option<Instant>,
}

/// What one round did.
struct Round {
    /// Messages confirmed and advanced past.
    published: u64,
    /// The peek filled its batch: more may be waiting.
    more: bool,
    /// The first failed publish, with the message's id.
    failed: Option<(String, PublishError)>,
}

impl<P: Publisher> WalRelay<P> {
    /// Starts configuring a relay from `outbox`'s slot to `publisher`.
    pub fn builder(outbox: PostgresWalOutbox, publisher: P) -> WalRelayBuilder<P> {
        let settings = Settings {
            batch: 4096,
            publish_timeout: Duration::from_secs(10),
            max_attempts: 10,
            backoff: (Duration::from_millis(100), Duration::from_secs(10)),
            poll: Duration::from_millis(20),
            store_failures: 10,
        };
        WalRelayBuilder { outbox, publisher, settings }
    }

    /// The outbox.
    pub fn outbox(&self) -> &PostgresWalOutbox {
        &self.outbox
    }

    /// Runs until `shutdown` completes (the batch in flight is published and advanced first),
    /// waiting as a standby while another relay holds the slot.
    ///
    /// # Errors
    /// [`WalRelayError::Store`] when the slot fails for good; [`WalRelayError::Stuck`].
    ///
    /// # Cancel safety
    /// Cancel safe in effect: dropped midway, the slot stays where it was, and messages
    /// published since the last advance are published again by the next relay.
    pub async fn run(
        &self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<RelayReport, WalRelayError> {
        let s = &self.settings;
        tokio::pin!(shutdown);
        let mut report = RelayReport::default();
        let (mut store_failures, mut attempts) = (0u32, 0u32);
        let mut held: Option<Held> = None;
        loop {
            let wait = match held.as_mut() {
                None => match self.take().await {
                    Ok(Some(h)) => {
                        held = Some(h);
                        Duration::ZERO
                    }
                    Ok(None) => s.poll,
                    Err(e) => self.store_failed(e, &mut store_failures, &mut report)?,
                },
                Some(h) => match self.round(h, &mut report).await {
                    Ok(r) => {
                        store_failures = 0;
                        self.after(r, &mut attempts)?
                    }
                    Err(e) => {
                        held = None; // a new connection next time; the lock goes with the old
                        self.store_failed(e, &mut store_failures, &mut report)?
                    }
                },
            };
            let stop = if wait.is_zero() {
                futures_util::FutureExt::now_or_never(shutdown.as_mut()).is_some()
            } else {
                tokio::select! {
                    () = tokio::time::sleep(wait) => false,
                    () = &mut shutdown => true,
                }
            };
            if stop {
                if let Some(h) = held {
                    self.release(h).await;
                }
                return Ok(report);
            }
        }
    }

    /// Publishes until the slot has nothing committed left, then returns: for tests, scripts
    /// and `idem relay --once`.
    ///
    /// # Errors
    /// [`WalRelayError::Busy`] when another relay holds the slot; otherwise as
    /// [`run`](Self::run), without retrying database failures.
    ///
    /// # Cancel safety
    /// As [`run`](Self::run).
    pub async fn run_until_empty(&self) -> Result<RelayReport, WalRelayError> {
        let mut report = RelayReport::default();
        let mut held = match self.take().await.map_err(WalRelayError::Store)? {
            Some(h) => h,
            None => return Err(WalRelayError::Busy { slot: self.outbox.slot().to_owned() }),
        };
        let mut attempts = 0;
        let ended = loop {
            let r = match self.round(&mut held, &mut report).await {
                Ok(r) => r,
                Err(e) => break Err(WalRelayError::Store(e)),
            };
            let more = r.more || r.failed.is_some();
            match self.after(r, &mut attempts) {
                Ok(_) if !more => break Ok(report),
                Ok(wait) => tokio::time::sleep(wait).await,
                Err(e) => break Err(e),
            }
        };
        self.release(held).await;
        ended
    }

    /// Unlocks the slot and closes the connection, so that the next relay can take the slot
    /// at once (a connection merely dropped keeps the lock until the server notices).
    async fn release(&self, mut h: Held) {
        let _ = sqlx::query("SELECT pg_advisory_unlock(hashtext($1))")
            .bind(self.lock_key())
            .execute(&mut h.conn)
            .await;
        let _ = h.conn.close().await;
    }

    fn lock_key(&self) -> String {
        format!("idem-wal-relay:{}", self.outbox.slot())
    }

    /// Counts a round's failure; the wait before the next round (zero when more is waiting).
    fn after(&self, r: Round, attempts: &mut u32) -> Result<Duration, WalRelayError> {
        let s = &self.settings;
        let Some((id, e)) = r.failed else {
            *attempts = 0;
            return Ok(if r.more || r.published > 0 { Duration::ZERO } else { s.poll });
        };
        *attempts += 1;
        metrics::counter!(OUTBOX_FAILURES_TOTAL, "parked" => "false").increment(1);
        let reason = idem_core::ErrorChain(&e).to_string();
        if *attempts >= s.max_attempts {
            tracing::error!(%id, attempts = *attempts, error = %reason, "WAL relay stuck");
            return Err(WalRelayError::Stuck { id, attempts: *attempts, source: e });
        }
        let wait = backoff(s.backoff.0, s.backoff.1, *attempts);
        tracing::warn!(%id, attempts = *attempts, retry_in = ?wait, error = %reason,
            "publish failed; the slot stays before it");
        Ok(wait)
    }

    fn store_failed(
        &self,
        e: StoreError,
        in_a_row: &mut u32,
        report: &mut RelayReport,
    ) -> Result<Duration, WalRelayError> {
        let s = &self.settings;
        if !e.is_retryable() || *in_a_row + 1 >= s.store_failures {
            return Err(WalRelayError::Store(e));
        }
        *in_a_row += 1;
        report.store_failures += 1;
        let wait = backoff(s.backoff.0, s.backoff.1.min(Duration::from_secs(5)), *in_a_row);
        tracing::warn!(error = %e, retry_in = ?wait, "WAL outbox slot failed; retrying");
        Ok(wait)
    }

    /// A connection holding the slot's lock, or `None` while another relay holds it.
    async fn take(&self) -> Result<Option<Held>, StoreError> {
        let op = "wal relay connect";
        let mut conn = self.outbox.pool.acquire().await.map_err(|e| backend(op, e))?.detach();
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtext($1))")
            .bind(self.lock_key())
            .fetch_one(&mut conn)
            .await
            .map_err(|e| backend(op, e))?;
        if !got {
            let _ = conn.close().await;
            return Ok(None);
        }
        let confirmed: Option<String> = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(self.outbox.slot())
        .fetch_optional(&mut conn)
        .await
        .map_err(|e| backend(op, e))?
        .ok_or_else(|| StoreError::backend(op, false, NoSlot(self.outbox.slot().to_owned())))?;
        let confirmed = confirmed.as_deref().map(parse_lsn).transpose()?.unwrap_or(0);
        Ok(Some(Held { conn, confirmed, lag_at: None }))
    }

    /// One peek, publish and advance.
    async fn round(&self, h: &mut Held, report: &mut RelayReport) -> Result<Round, StoreError> {
        let s = &self.settings;
        let slot = self.outbox.slot();
        // The flush position first: when the peek returns less than a batch, every
        // transaction committed before it was decoded, and the slot may move up to it.
        let rows: Vec<(String, Option<Vec<u8>>)> = sqlx::query_as(
            "SELECT l.l0::text, c.data FROM (SELECT pg_current_wal_flush_lsn() AS l0) l \
             LEFT JOIN LATERAL pg_logical_slot_peek_binary_changes($1, l.l0, $2, \
               'proto_version', '1', 'publication_names', $1, 'messages', 'true') c ON true",
        )
        .bind(slot)
        .bind(i32::try_from(s.batch).unwrap_or(i32::MAX))
        .fetch_all(&mut h.conn)
        .await
        .map_err(|e| backend("wal relay peek", e))?;
        let flushed = rows.first().map(|r| parse_lsn(&r.0)).transpose()?.unwrap_or(0);
        let records: Vec<Vec<u8>> = rows.into_iter().filter_map(|r| r.1).collect();
        let more = records.len() >= s.batch;
        let txns = committed(&records, self.outbox.prefix())?;
        let mut messages: Vec<OutboxMessage> = Vec::new();
        for t in &txns {
            for m in &t.messages {
                messages.push(frame::decode(m)?);
            }
        }
        let (ok, failed) = if messages.is_empty() {
            (0, None)
        } else {
            report.batches += 1;
            self.publish(&messages).await
        };
        // Past every transaction whose messages, and all before them, were confirmed.
        let (mut target, mut seen) = (h.confirmed, 0usize);
        for t in &txns {
            seen += t.messages.len();
            if seen > ok {
                break;
            }
            target = target.max(t.end_lsn);
        }
        let published = txns
            .iter()
            .take_while(|t| t.end_lsn <= target)
            .map(|t| t.messages.len() as u64)
            .sum::<u64>();
        if failed.is_none() && !more {
            target = target.max(flushed);
        }
        if target > h.confirmed {
            sqlx::query("SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)")
                .bind(slot)
                .bind(format_lsn(target))
                .execute(&mut h.conn)
                .await
                .map_err(|e| backend("wal relay advance", e))?;
            h.confirmed = target;
        }
        report.published += published;
        metrics::counter!(OUTBOX_PUBLISHED_TOTAL).increment(published);
        let again = messages.len() as u64 - published;
        if failed.is_some() {
            report.retried += again;
        }
        self.observe_lag(h).await;
        Ok(Round { published, more, failed })
    }

    /// Publishes `messages` in order; how many of them, from the first, the broker confirmed,
    /// and the first failure.
    async fn publish(&self, messages: &[OutboxMessage]) -> (usize, Option<(String, PublishError)>) {
        let started = Instant::now();
        let results =
            tokio::time::timeout(self.settings.publish_timeout, self.publisher.publish(messages))
                .await;
        metrics::histogram!(OUTBOX_PUBLISH_SECONDS).record(started.elapsed().as_secs_f64());
        let fail = |i: usize, why: String| {
            let m: &OutboxMessage = &messages[i];
            Some((m.id().to_string(), PublishError::new(m.destination(), true, why)))
        };
        match results {
            Err(_) => (0, fail(0, "not confirmed within the publish timeout".into())),
            Ok(r) if r.len() != messages.len() => {
                let why = format!("publisher answered {} results for {}", r.len(), messages.len());
                (0, fail(0, why))
            }
            Ok(r) => {
                let mut ok = 0;
                for (m, r) in messages.iter().zip(r) {
                    match r {
                        Ok(()) => ok += 1,
                        Err(e) => return (ok, Some((m.id().to_string(), e))),
                    }
                }
                (ok, None)
            }
        }
    }

    /// Sets the lag gauge, at most once a second.
    async fn observe_lag(&self, h: &mut Held) {
        if h.lag_at.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        h.lag_at = Some(Instant::now());
        let lag: Result<Option<i64>, _> = sqlx::query_scalar(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots \
             WHERE slot_name = $1",
        )
        .bind(self.outbox.slot())
        .fetch_one(&mut h.conn)
        .await;
        match lag {
            Ok(Some(bytes)) => {
                #[allow(clippy::cast_precision_loss)] // a gauge: bytes past 2^53 need no precision
                metrics::gauge!(OUTBOX_WAL_LAG_BYTES, "slot" => self.outbox.slot().to_owned())
                    .set(bytes.max(0) as f64);
            }
            Ok(None) => {}
            Err(e) => tracing::debug!(error = %e, "WAL slot lag not read"),
        }
    }
}

/// The slot does not exist.
#[derive(Debug, thiserror::Error)]
#[error(
    "replication slot {0} does not exist: create it (idem relay --create-slot, or PostgresWalOutbox::create_slot)"
)]
struct NoSlot(String);

/// `first × 2^(n−1)`, at most `max`.
fn backoff(first: Duration, max: Duration, n: u32) -> Duration {
    first.saturating_mul(1u32 << n.saturating_sub(1).min(20)).min(max)
}
