//! The server's clock, read without a round trip: an anchor from the server's `TIME` plus the
//! monotonic time elapsed since, re-anchored every few seconds.
//!
//! Only the script-free fresh claim uses it, to stamp the record it writes with `SET … NX`
//! (creation time, lease end, expiry, fencing token), and to decide, from a record that
//! `SET … NX GET` returned, the answers that write nothing (completed, conflict, a lease
//! still clearly live). Everything that changes an existing record still reads `TIME` inside
//! its script. The anchor is the server's clock, never the consumer's wall clock: a consumer
//! whose clock is wrong by minutes stamps the same times as one whose clock is right.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem_core::{StoreError, Timestamp};

use super::{ClockOffset, RedisStore, backend};

/// How long an anchor is used before the next claim takes a fresh one.
pub(crate) const REFRESH: Duration = Duration::from_secs(5);

/// Margin, added to the anchor's own uncertainty, inside which a time comparison is left to a
/// script: a lease or a retention that ends this close to now is decided by the server.
pub(crate) const MARGIN_US: i64 = 2_000;

#[derive(Debug, Clone, Copy)]
struct Anchor {
    /// Server time (µs), taken at the middle of the round trip that read it.
    server_us: i64,
    at: Instant,
    /// Half the round trip that read it: how far off the anchor can be.
    uncertainty_us: i64,
}

/// The estimate, shared by clones of a store.
#[derive(Debug, Default)]
pub(crate) struct ServerClock {
    anchor: Mutex<Option<Anchor>>,
    /// When a caller last set out to re-anchor: the others keep the old anchor meanwhile.
    refreshing: Mutex<Option<Instant>>,
}

/// An estimate of the server's time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Estimate {
    pub(crate) now_us: i64,
    /// Compare with times at least this far from `now_us`; closer ones go to a script.
    pub(crate) margin_us: i64,
}

impl ServerClock {
    /// The estimate, or `None` when there is no anchor or it is older than [`REFRESH`].
    pub(crate) fn estimate(&self) -> Option<Estimate> {
        self.estimate_within(REFRESH)
    }

    /// The estimate from an anchor at most `max_age` old.
    pub(crate) fn estimate_within(&self, max_age: Duration) -> Option<Estimate> {
        let a = (*self.anchor.lock().unwrap_or_else(std::sync::PoisonError::into_inner))?;
        let age = a.at.elapsed();
        if age > max_age {
            return None;
        }
        let age_us = i64::try_from(age.as_micros()).ok()?;
        Some(Estimate { now_us: a.server_us + age_us, margin_us: a.uncertainty_us + MARGIN_US })
    }

    /// Whether this caller should read the server's time now: one caller per second does
    /// while the anchor is stale; the others use the old one (up to twice [`REFRESH`] old), so
    /// many concurrent claims do not all read `TIME` at once.
    pub(crate) fn should_refresh(&self) -> bool {
        let mut r = self.refreshing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if r.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return false;
        }
        *r = Some(Instant::now());
        true
    }

    /// Records a server time read between `sent` and `received`.
    pub(crate) fn anchor(&self, server_us: i64, sent: Instant, received: Instant) {
        let rtt = received.saturating_duration_since(sent);
        let half = rtt / 2;
        let a = Anchor {
            server_us,
            at: sent + half,
            uncertainty_us: i64::try_from(half.as_micros()).unwrap_or(i64::MAX / 4),
        };
        let mut slot = self.anchor.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Keep the more precise of two fresh anchors.
        let keep_old = slot.is_some_and(|old| {
            old.at.elapsed() < REFRESH / 2 && old.uncertainty_us < a.uncertainty_us
        });
        if !keep_old {
            *slot = Some(a);
        }
    }
}

impl RedisStore {
    /// The store's clock: Redis `TIME` (plus a test offset, if any).
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: a read; the shared connection discards the reply of a dropped call.
    pub async fn now(&self) -> Result<Timestamp, StoreError> {
        Ok(Timestamp::from_micros(self.server_time(self.offset_us()).await?))
    }

    /// `TIME` (µs) plus `offset`, from the node holding the namespace (the key only routes).
    async fn server_time(&self, offset: i64) -> Result<i64, StoreError> {
        self.scripts
            .now
            .key(self.ns.key_prefix())
            .arg(offset)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend("now", e))
    }

    /// Reads the server clock for the fast claim path (without the test offset: it is added
    /// when the estimate is used, so moving it takes effect at once).
    pub(super) async fn anchor_clock(&self) -> Result<Option<Estimate>, StoreError> {
        let Some(clock) = &self.clock else { return Ok(None) };
        let sent = Instant::now();
        let server = self.server_time(0).await?;
        clock.anchor(server, sent, Instant::now());
        Ok(clock.estimate())
    }

    /// The server clock estimate (test offset included) for a fast claim, re-anchored when
    /// old; `None` when claims go to the script.
    pub(super) async fn estimate(&self) -> Result<Option<Estimate>, StoreError> {
        let Some(clock) = &self.clock else { return Ok(None) };
        let est = match clock.estimate() {
            Some(e) => Some(e),
            None if clock.should_refresh() => self.anchor_clock().await?,
            None => match clock.estimate_within(2 * REFRESH) {
                Some(e) => Some(e),
                None => self.anchor_clock().await?,
            },
        };
        Ok(est.map(|e| Estimate { now_us: e.now_us + self.offset_us(), ..e }))
    }

    pub(super) fn offset_us(&self) -> i64 {
        self.offset.as_ref().map_or(0, ClockOffset::micros)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_from_the_anchor_and_expires_it() {
        let c = ServerClock::default();
        assert!(c.estimate().is_none());
        let sent = Instant::now();
        c.anchor(1_000_000, sent, sent + Duration::from_micros(400));
        let e = c.estimate().expect("fresh anchor");
        assert!(e.now_us >= 1_000_000 - 200, "{e:?}");
        assert!(e.margin_us >= 200 + MARGIN_US, "{e:?}");
        // A later, less precise anchor does not replace a fresh precise one.
        c.anchor(5_000_000, sent, sent + Duration::from_millis(50));
        assert!(c.estimate().expect("anchor").now_us < 2_000_000);
        // One caller per second re-anchors.
        assert!(c.should_refresh());
        assert!(!c.should_refresh());
    }
}
