//! RabbitMQ's redelivery window, for the retention check.

use std::time::Duration;

use idem_core::RedeliveryWindow;

/// RabbitMQ's default `consumer_timeout` (30 minutes): a delivery unacked for longer closes
/// the channel and is redelivered.
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The redelivery window of a RabbitMQ queue.
///
/// A message is redelivered when its consumer's channel closes without acking it, or when the
/// broker's `consumer_timeout` (default 30 min, `rabbitmq.conf`, or per queue with the
/// `x-consumer-timeout` argument on 3.12+) runs out. How many times: unbounded on classic
/// queues; on quorum queues, the `x-delivery-limit` argument (RabbitMQ 4.0+ defaults it to 20;
/// 3.x has no default), after which the message is dead-lettered or dropped. So the window is
/// `delivery_limit × consumer_timeout + message TTL + dead-letter allowance`. For classic queues
/// pick the number of redeliveries you are willing to cover (the default here is 20).
///
/// ```
/// use std::time::Duration;
/// use idem_amqp::RabbitWindow;
///
/// let w = RabbitWindow::new().delivery_limit(5).dead_letter_allowance(Duration::from_secs(86_400));
/// assert_eq!(w.to_redelivery_window().minimum(), Duration::from_secs(5 * 1800 + 86_400));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub struct RabbitWindow {
    consumer_timeout: Duration,
    delivery_limit: u32,
    message_ttl: Duration,
    dead_letter_allowance: Duration,
}

impl Default for RabbitWindow {
    fn default() -> Self {
        Self::new()
    }
}

impl RabbitWindow {
    /// Defaults: `consumer_timeout` 30 min, 20 deliveries, no TTL, no dead-letter allowance.
    pub fn new() -> Self {
        Self {
            consumer_timeout: DEFAULT_CONSUMER_TIMEOUT,
            delivery_limit: 20,
            message_ttl: Duration::ZERO,
            dead_letter_allowance: Duration::ZERO,
        }
    }

    /// The broker's (or the queue's) `consumer_timeout`.
    pub fn consumer_timeout(mut self, timeout: Duration) -> Self {
        self.consumer_timeout = timeout;
        self
    }

    /// The quorum queue's `x-delivery-limit` (or the redeliveries to cover on a classic queue).
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = limit;
        self
    }

    /// The queue's `x-message-ttl` (how long a message may wait before its first delivery).
    pub fn message_ttl(mut self, ttl: Duration) -> Self {
        self.message_ttl = ttl;
        self
    }

    /// How long a dead-lettered message may wait before an operator resubmits it.
    pub fn dead_letter_allowance(mut self, allowance: Duration) -> Self {
        self.dead_letter_allowance = allowance;
        self
    }

    /// The core's window, for [`RedeliveryWindow::check`].
    pub fn to_redelivery_window(self) -> RedeliveryWindow {
        RedeliveryWindow::new(self.delivery_limit, self.consumer_timeout)
            .message_ttl(self.message_ttl)
            .dead_letter_allowance(self.dead_letter_allowance)
    }
}
