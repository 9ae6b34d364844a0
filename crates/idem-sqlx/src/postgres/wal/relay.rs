//! The WAL outbox as a relay's [`Feed`]: peeks committed messages from the slot, and advances
//! the slot past what the broker confirmed, in order. The loop itself is core's [`Relay`].

use std::time::{Duration, Instant};

use idem_core::StoreError;
use idem_core::outbox::{Builder, Feed, FeedKind, Read, Relay, RelayError, Settled};
use idem_core::telemetry::OUTBOX_WAL_LAG_BYTES;
use sqlx::Connection as _;
use sqlx::postgres::PgConnection;

use super::pgoutput::{committed, format_lsn, parse_lsn};
use super::{PostgresWalOutbox, frame};
use crate::postgres::backend;

/// Publishes what a [`PostgresWalOutbox`] wrote into the WAL, at least once and in commit
/// order, each message under its stable id so that the idem consumer downstream deduplicates
/// copies: core's [`Relay`] reading the outbox's slot.
///
/// Each round, on one connection that holds a session advisory lock on the slot (a second
/// relay on the same slot waits as a standby and takes over when the first one's connection
/// ends): `pg_logical_slot_peek_binary_changes` (pgoutput, messages only) reads committed
/// transactions without consuming them; the relay publishes their messages with confirms;
/// then `pg_replication_slot_advance` moves the slot past the last transaction whose messages
/// — and every earlier one's — the broker confirmed. A failed publish keeps the slot before
/// it (no parking: the slot cannot move past a message without losing it); after
/// `max_attempts` failures in a row the relay stops with [`RelayError::Stuck`]. A relay killed
/// between the confirmation and the advance publishes those messages again when it restarts.
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
pub type WalRelay<P> = Relay<PostgresWalOutbox, P>;

/// Configures a [`WalRelay`]: core's relay [`Builder`] over a WAL slot.
pub type WalRelayBuilder<P> = Builder<PostgresWalOutbox, P>;

/// Why a WAL relay stopped: core's [`RelayError`] (`Busy` when another relay holds the slot,
/// `Stuck` when the oldest message keeps failing).
pub type WalRelayError = RelayError;

/// The connection that holds the slot's lock, and where the slot stands.
#[derive(Debug)]
pub struct WalHold {
    conn: PgConnection,
    confirmed: u64,
    lag_at: Option<Instant>,
}

/// The transactions one peek read: what the slot may move past once confirmed.
#[derive(Debug)]
pub struct WalBatch {
    /// Each committed transaction's end position and how many messages it carried.
    txns: Vec<(u64, usize)>,
    /// The flush position read before the peek.
    flushed: u64,
    /// The peek filled its batch: more may be waiting.
    full: bool,
}

impl Feed for PostgresWalOutbox {
    const KIND: FeedKind = FeedKind::Position;
    const BATCH: usize = 4096;
    const MIN_BATCH: (usize, &'static str) =
        (3, "must be at least 3: a WAL transaction is three records");
    const POLL: Duration = Duration::from_millis(20);
    const BACKOFF: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(10));

    type Hold = WalHold;
    type Batch = WalBatch;

    /// A connection holding the slot's lock, or `None` while another relay holds it.
    async fn take(&self) -> Result<Option<WalHold>, StoreError> {
        let op = "wal relay connect";
        let mut conn = self.pool.acquire().await.map_err(|e| backend(op, e))?.detach();
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
        .bind(self.slot())
        .fetch_optional(&mut conn)
        .await
        .map_err(|e| backend(op, e))?
        .ok_or_else(|| StoreError::backend(op, false, NoSlot(self.slot().to_owned())))?;
        let confirmed = confirmed.as_deref().map(parse_lsn).transpose()?.unwrap_or(0);
        Ok(Some(WalHold { conn, confirmed, lag_at: None }))
    }

    async fn read(
        &self,
        h: &mut WalHold,
        max: usize,
        _lease: Duration,
    ) -> Result<Read<WalBatch>, StoreError> {
        // The flush position first: when the peek returns less than a batch, every
        // transaction committed before it was decoded, and the slot may move up to it.
        let rows: Vec<(String, Option<Vec<u8>>)> = sqlx::query_as(
            "SELECT l.l0::text, c.data FROM (SELECT pg_current_wal_flush_lsn() AS l0) l \
             LEFT JOIN LATERAL pg_logical_slot_peek_binary_changes($1, l.l0, $2, \
               'proto_version', '1', 'publication_names', $1, 'messages', 'true') c ON true",
        )
        .bind(self.slot())
        .bind(i32::try_from(max).unwrap_or(i32::MAX))
        .fetch_all(&mut h.conn)
        .await
        .map_err(|e| backend("wal relay peek", e))?;
        let flushed = rows.first().map(|r| parse_lsn(&r.0)).transpose()?.unwrap_or(0);
        let records: Vec<Vec<u8>> = rows.into_iter().filter_map(|r| r.1).collect();
        let full = records.len() >= max;
        let txns = committed(&records, self.prefix())?;
        let mut messages = Vec::new();
        for t in &txns {
            for m in &t.messages {
                messages.push(frame::decode(m)?);
            }
        }
        let txns = txns.iter().map(|t| (t.end_lsn, t.messages.len())).collect();
        // Not full: every transaction committed before the flush position was read.
        Ok(Read::new(messages, WalBatch { txns, flushed, full }, full))
    }

    /// Advances the slot past every transaction whose messages, and all before them, were
    /// confirmed; past the flush position too when everything was and the peek was not full.
    async fn acknowledge(
        &self,
        h: &mut WalHold,
        b: WalBatch,
        settled: &[Settled],
        _keep_sent: bool,
    ) -> Result<u64, StoreError> {
        let ok = settled.iter().take_while(|s| s.is_sent()).count();
        let (mut target, mut seen, mut published) = (h.confirmed, 0usize, 0u64);
        for &(end, n) in &b.txns {
            seen += n;
            if seen > ok {
                break;
            }
            target = target.max(end);
            published += n as u64;
        }
        if ok == settled.len() && !b.full {
            target = target.max(b.flushed);
        }
        if target > h.confirmed {
            sqlx::query("SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)")
                .bind(self.slot())
                .bind(format_lsn(target))
                .execute(&mut h.conn)
                .await
                .map_err(|e| backend("wal relay advance", e))?;
            h.confirmed = target;
        }
        self.observe_lag(h).await;
        Ok(published)
    }

    /// Unlocks the slot and closes the connection, so that the next relay can take the slot
    /// at once (a connection merely dropped keeps the lock until the server notices).
    async fn release(&self, mut h: WalHold) {
        let _ = sqlx::query("SELECT pg_advisory_unlock(hashtext($1))")
            .bind(self.lock_key())
            .execute(&mut h.conn)
            .await;
        let _ = h.conn.close().await;
    }

    fn describe(&self) -> String {
        format!("slot {}", self.slot())
    }
}

impl PostgresWalOutbox {
    fn lock_key(&self) -> String {
        format!("idem-wal-relay:{}", self.slot())
    }

    /// Sets the lag gauge, at most once a second.
    async fn observe_lag(&self, h: &mut WalHold) {
        if h.lag_at.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        h.lag_at = Some(Instant::now());
        let lag: Result<Option<i64>, _> = sqlx::query_scalar(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots \
             WHERE slot_name = $1",
        )
        .bind(self.slot())
        .fetch_one(&mut h.conn)
        .await;
        match lag {
            Ok(Some(bytes)) => {
                #[allow(clippy::cast_precision_loss)] // a gauge: bytes past 2^53 need no precision
                metrics::gauge!(OUTBOX_WAL_LAG_BYTES, "slot" => self.slot().to_owned())
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
