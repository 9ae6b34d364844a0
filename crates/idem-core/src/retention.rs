//! Retention: how long records must outlive the broker's longest redelivery window.

use std::fmt;
use std::time::Duration;

/// The longest time after a first delivery at which the same message may still arrive.
///
/// `max_deliveries × redelivery_timeout + message_ttl + dead_letter_allowance`: a message can be
/// delivered up to `max_deliveries` times, each after a lock/visibility/ack-wait timeout, may sit
/// in the queue for its time-to-live first, and may be resubmitted from the dead-letter queue by
/// an operator within the allowance. A record purged before that is a duplicate let through.
///
/// ```
/// use std::time::Duration;
/// use idem_core::RedeliveryWindow;
///
/// let w = RedeliveryWindow::new(10, Duration::from_secs(300))
///     .message_ttl(Duration::from_secs(3600))
///     .dead_letter_allowance(Duration::from_secs(86_400));
/// assert_eq!(w.minimum(), Duration::from_secs(10 * 300 + 3600 + 86_400));
/// let err = w.check(Duration::from_secs(3600)).unwrap_err();
/// assert!(err.to_string().contains("10 deliveries × 5m"));
/// assert!(w.check(Duration::from_secs(7 * 86_400)).is_ok());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct RedeliveryWindow {
    max_deliveries: u32,
    redelivery_timeout: Duration,
    message_ttl: Duration,
    dead_letter_allowance: Duration,
}

impl RedeliveryWindow {
    /// A window for a broker that delivers at most `max_deliveries` times, redelivering after
    /// `redelivery_timeout` (lock duration, visibility timeout, ack wait).
    pub fn new(max_deliveries: u32, redelivery_timeout: Duration) -> Self {
        Self {
            max_deliveries,
            redelivery_timeout,
            message_ttl: Duration::ZERO,
            dead_letter_allowance: Duration::ZERO,
        }
    }

    /// How long a message may wait in the queue before its first delivery.
    pub fn message_ttl(mut self, ttl: Duration) -> Self {
        self.message_ttl = ttl;
        self
    }

    /// How long a dead-lettered message may wait before an operator resubmits it.
    pub fn dead_letter_allowance(mut self, allowance: Duration) -> Self {
        self.dead_letter_allowance = allowance;
        self
    }

    /// The minimum retention.
    pub fn minimum(&self) -> Duration {
        self.redelivery_timeout
            .saturating_mul(self.max_deliveries)
            .saturating_add(self.message_ttl)
            .saturating_add(self.dead_letter_allowance)
    }

    /// Checks that `retention` covers the window.
    ///
    /// # Errors
    /// [`RetentionTooShort`] showing the arithmetic.
    pub fn check(&self, retention: Duration) -> Result<(), RetentionTooShort> {
        if retention < self.minimum() {
            return Err(RetentionTooShort { retention, window: *self });
        }
        Ok(())
    }
}

/// A configured retention shorter than the redelivery window. Its message shows the window's
/// arithmetic, leaving out the terms that are zero for the broker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct RetentionTooShort {
    /// The retention that was configured.
    pub retention: Duration,
    /// The window it must cover.
    pub window: RedeliveryWindow,
}

impl fmt::Display for RetentionTooShort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = &self.window;
        let (retention, minimum) = (human(self.retention), human(w.minimum()));
        write!(f, "retention {retention} is shorter than the redelivery window {minimum}")?;
        let mut terms = Vec::new();
        if w.max_deliveries > 0 && !w.redelivery_timeout.is_zero() {
            let n = w.max_deliveries;
            let unit = if n == 1 { "delivery" } else { "deliveries" };
            let timeout = human(w.redelivery_timeout);
            terms.push(format!("{n} {unit} × {timeout} (redelivery timeout)"));
        }
        if !w.message_ttl.is_zero() {
            terms.push(format!("{} (message TTL)", human(w.message_ttl)));
        }
        if !w.dead_letter_allowance.is_zero() {
            terms.push(format!("{} (dead-letter allowance)", human(w.dead_letter_allowance)));
        }
        if !terms.is_empty() {
            write!(f, " = {}", terms.join(" + "))?;
        }
        f.write_str("; records would be purged while duplicates can still arrive")
    }
}

/// Formats a duration as `1d 2h 3m 4s` (zero parts omitted; sub-second values in ms).
pub fn human(d: Duration) -> impl fmt::Display {
    struct H(Duration);
    impl fmt::Display for H {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            let total = self.0.as_secs();
            if total == 0 {
                return write!(f, "{}ms", self.0.as_millis());
            }
            let parts = [
                (total / 86_400, "d"),
                (total / 3600 % 24, "h"),
                (total / 60 % 60, "m"),
                (total % 60, "s"),
            ];
            let mut first = true;
            for (n, unit) in parts {
                if n > 0 {
                    if !first {
                        f.write_str(" ")?;
                    }
                    write!(f, "{n}{unit}")?;
                    first = false;
                }
            }
            Ok(())
        }
    }
    H(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shows_the_arithmetic() {
        let w = RedeliveryWindow::new(5, Duration::from_secs(60))
            .message_ttl(Duration::from_secs(600))
            .dead_letter_allowance(Duration::from_secs(3600));
        assert_eq!(w.minimum(), Duration::from_secs(300 + 600 + 3600));
        let msg = w.check(Duration::from_secs(60)).unwrap_err().to_string();
        assert_eq!(
            msg,
            "retention 1m is shorter than the redelivery window 1h 15m = 5 deliveries × 1m (redelivery timeout) + 10m (message TTL) + 1h (dead-letter allowance); records would be purged while duplicates can still arrive"
        );
        assert!(w.check(w.minimum()).is_ok());
        assert!(w.check(w.minimum() - Duration::from_secs(1)).is_err());
    }

    #[test]
    fn leaves_out_the_terms_a_broker_does_not_have() {
        // Kafka: only the topic's retention; a generic AMQP 1.0 queue: one redelivery.
        let topic =
            RedeliveryWindow::new(0, Duration::ZERO).message_ttl(Duration::from_secs(7 * 86_400));
        let msg = topic.check(Duration::from_secs(86_400)).unwrap_err().to_string();
        assert_eq!(
            msg,
            "retention 1d is shorter than the redelivery window 7d = 7d (message TTL); records would be purged while duplicates can still arrive"
        );
        let once = RedeliveryWindow::new(1, Duration::from_secs(600));
        let msg = once.check(Duration::from_secs(60)).unwrap_err().to_string();
        assert!(msg.contains("= 1 delivery × 10m (redelivery timeout);"), "{msg}");
    }

    #[test]
    fn human_formats() {
        assert_eq!(human(Duration::from_millis(250)).to_string(), "250ms");
        assert_eq!(human(Duration::from_secs(90_061)).to_string(), "1d 1h 1m 1s");
    }
}
