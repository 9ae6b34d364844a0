//! Store time: timestamps and the clocks that embedded stores read.
//!
//! Server-backed stores (PostgreSQL, MySQL, Redis) read their server's clock. Embedded stores
//! (memory, SQLite) live in the consumer's process, so their clock is a [`Clock`] value: the system
//! clock in production, a [`ManualClock`] or [`TokioClock`] in tests.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch, as measured by a store's clock.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(i64);

impl Timestamp {
    /// From microseconds since the Unix epoch.
    pub const fn from_micros(micros: i64) -> Self {
        Self(micros)
    }

    /// Microseconds since the Unix epoch.
    pub const fn as_micros(self) -> i64 {
        self.0
    }

    /// This instant plus `d` (saturating).
    #[must_use]
    pub fn plus(self, d: Duration) -> Self {
        Self(self.0.saturating_add(duration_micros(d)))
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_micros(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }

    /// From a [`SystemTime`] (saturating far outside ±292,000 years).
    pub fn from_system_time(t: SystemTime) -> Self {
        match t.duration_since(UNIX_EPOCH) {
            Ok(d) => Self(duration_micros(d)),
            Err(e) => Self(duration_micros(e.duration()).saturating_neg()),
        }
    }
}

/// As `2026-12-04 21:30:05 UTC`: the civil date and time, whole seconds.
///
/// ```
/// use idem_core::Timestamp;
/// assert_eq!(Timestamp::from_micros(1_709_251_199_000_000).to_string(), "2024-02-29 23:59:59 UTC");
/// ```
impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.0.div_euclid(1_000_000);
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
        let z = days + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        write!(
            f,
            "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        )
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Timestamp({}µs)", self.0)
    }
}

/// Whole microseconds of `d`, saturating at `i64::MAX`.
pub fn duration_micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// A source of store time.
pub trait Clock: Send + Sync + fmt::Debug + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let d = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        Timestamp(duration_micros(d))
    }
}

/// A clock that moves only when told to: deterministic lease tests with no sleeps.
///
/// ```
/// use std::time::Duration;
/// use idem_core::time::{Clock, ManualClock};
///
/// let clock = ManualClock::new();
/// let t0 = clock.now();
/// clock.advance(Duration::from_secs(5));
/// assert_eq!(clock.now().since(t0), Duration::from_secs(5));
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// Starts at the current system time (so records look plausible when inspected).
    pub fn new() -> Self {
        Self(Arc::new(AtomicI64::new(SystemClock.now().as_micros())))
    }

    /// Moves time forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.0.fetch_add(duration_micros(d), Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }
}

/// System time at creation plus tokio's monotonic time since: follows
/// `#[tokio::test(start_paused = true)]` and `tokio::time::advance`.
#[derive(Debug, Clone)]
pub struct TokioClock {
    base: Timestamp,
    start: tokio::time::Instant,
}

impl TokioClock {
    /// Must be created inside a tokio runtime when time is paused.
    pub fn new() -> Self {
        Self { base: SystemClock.now(), start: tokio::time::Instant::now() }
    }
}

impl Default for TokioClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        self.base.plus(self.start.elapsed())
    }
}

/// An offset added to a *server's* clock, for stores whose leases run on the database or Redis
/// clock (which a test cannot move). Production code leaves it at zero; the conformance suite
/// advances it instead of sleeping. Clones share the offset.
///
/// ```
/// use std::time::Duration;
/// use idem_core::time::ClockSkew;
///
/// let skew = ClockSkew::new();
/// skew.advance(Duration::from_millis(1500));
/// assert_eq!(skew.micros(), 1_500_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ClockSkew(Arc<AtomicI64>);

impl ClockSkew {
    /// No offset.
    pub fn new() -> Self {
        Self::default()
    }

    /// Moves the store's notion of "now" forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.0.fetch_add(duration_micros(d), Ordering::SeqCst);
    }

    /// The offset in microseconds, to add to the server's clock reading.
    pub fn micros(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_the_civil_date_in_utc() {
        assert_eq!(Timestamp::from_micros(0).to_string(), "1970-01-01 00:00:00 UTC");
        let leap = Timestamp::from_micros(1_709_251_199_000_000);
        assert_eq!(leap.to_string(), "2024-02-29 23:59:59 UTC");
        assert_eq!(Timestamp::from_micros(-1_000_000).to_string(), "1969-12-31 23:59:59 UTC");
    }
}
