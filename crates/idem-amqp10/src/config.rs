//! The settings of an AMQP 1.0 source, and how it opens.

use std::time::Duration;

use idem_core::RedeliveryWindow;
use idem_core::consumer::{Opening, SourceConfig};

use crate::connect::Endpoint;
use crate::error::Error;
use crate::source::{Amqp10Source, Dialect};
use crate::tls::Tls;

/// Where dead letters go.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLetters {
    /// A copy is sent to this address (e.g. RabbitMQ's `/queue/orders.dlq`) with the `idem-*`
    /// application properties, and the original is accepted only once the broker has accepted
    /// the copy. Works on every broker; the copy keeps the original `message-id`.
    ///
    /// Opening refuses an address whose copies would come back to the source
    /// ([`Error::DeadLetterLoop`]): the source address itself, another name of the same
    /// RabbitMQ queue (`/queue/orders` for the source `/amq/queue/orders`, or the default
    /// exchange with `orders` as routing key), or, for a source bound to an exchange
    /// (`/topic/orders.#`), the same exchange with a routing key the binding takes
    /// (`/topic/orders.dlq`). Routes the addresses do not show (bindings of other exchanges,
    /// exchange types) are not followed.
    Address(String),
    /// The original is settled `rejected` with the reason as the error description; the broker
    /// moves it to its own dead-letter destination in the same step (RabbitMQ: the queue's
    /// dead-letter exchange, set by policy or queue argument — **without one, RabbitMQ drops a
    /// rejected message**; Service Bus always uses its dead-letter sub-queue, which a receiver
    /// of the entity never receives from, so it cannot loop). Where the broker's dead-letter
    /// exchange routes is not checked.
    Reject,
}

/// Settings for an AMQP 1.0 consumer: the broker's URL, the source address and what the
/// broker does not say about itself. Opened by the [`Consumer`](idem_core::Consumer) builder.
///
/// ```
/// use std::time::Duration;
/// use idem_amqp10::{Amqp10Config, DeadLetters};
///
/// let config = Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672", "/amq/queue/orders")
///     .dead_letters(DeadLetters::Address("/queue/orders.dlq".into()))
///     .prefetch(256)
///     .retry_delay(Duration::from_millis(200), Duration::from_secs(5))
///     .redelivery_window(Duration::from_secs(30 * 60));
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Amqp10Config {
    pub(crate) endpoint: Endpoint,
    pub(crate) address: String,
    pub(crate) dead_letters: DeadLetters,
    pub(crate) retry_delay: (Duration, Duration),
    pub(crate) prefetch: u32,
    pub(crate) batch_wait: Duration,
    pub(crate) verb_timeout: Duration,
    pub(crate) redelivery_window: Option<Duration>,
    pub(crate) dialect: Dialect,
    pub(crate) tls: Tls,
}

impl Amqp10Config {
    /// A consumer of `address` on the broker at `url` (`amqp://user:pass@host:port`; SASL
    /// PLAIN when the URL has a user, ANONYMOUS otherwise; `amqps://` for TLS, verified per
    /// [`tls`](Self::tls)). Dead letters are rejected ([`DeadLetters::Reject`]) until told
    /// otherwise.
    pub fn new(url: impl Into<String>, address: impl Into<String>) -> Self {
        Self {
            endpoint: Endpoint::Url(url.into()),
            address: address.into(),
            dead_letters: DeadLetters::Reject,
            retry_delay: (Duration::from_millis(200), Duration::from_secs(5)),
            prefetch: 128,
            batch_wait: Duration::from_millis(2),
            verb_timeout: Duration::from_secs(10),
            redelivery_window: None,
            dialect: Dialect::Generic,
            tls: Tls::default(),
        }
    }

    /// How `amqps://` verifies the broker and which client certificate it presents (default:
    /// the OS trust store, no client certificate). Ignored for `amqp://`.
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = tls;
        self
    }

    /// Where dead letters go (default [`DeadLetters::Reject`]).
    pub fn dead_letters(mut self, dead_letters: DeadLetters) -> Self {
        self.dead_letters = dead_letters;
        self
    }

    /// The link credit: how many unsettled deliveries the broker may push ahead of the
    /// handlers (default 128; raised to `batch × concurrency` when that is larger).
    pub fn prefetch(mut self, prefetch: u32) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// How long a fetch waits for more deliveries once the first has arrived (default 2 ms).
    pub fn batch_wait(mut self, wait: Duration) -> Self {
        self.batch_wait = wait;
        self
    }

    /// Bounds on how long a message found in progress elsewhere is held before it is given
    /// back to the broker (the other lease's remaining time, clamped; default 200 ms – 5 s).
    /// AMQP 1.0 has no delayed redelivery: the message stays locked to this consumer meanwhile.
    pub fn retry_delay(mut self, min: Duration, max: Duration) -> Self {
        self.retry_delay = (min, max);
        self
    }

    /// The bound on closing links and the connection (default 10 s): RabbitMQ's AMQP 1.0
    /// plugin answers a closing detach without `closed=true`, so a close is never awaited
    /// forever.
    pub fn verb_timeout(mut self, timeout: Duration) -> Self {
        self.verb_timeout = timeout;
        self
    }

    /// The longest the broker may take to redeliver a message after its first delivery
    /// (RabbitMQ: `consumer_timeout`, 30 min by default). The consumer refuses a shorter
    /// dedup retention when it is built. AMQP 1.0 gives no way to read it from the broker.
    pub fn redelivery_window(mut self, window: Duration) -> Self {
        self.redelivery_window = Some(window);
        self
    }

    pub(crate) fn check(&self, opening: &Opening<'_>) -> Result<(), Error> {
        if self.address.is_empty() {
            return Err(Error::config("address", "is empty"));
        }
        if let DeadLetters::Address(a) = &self.dead_letters {
            if a.is_empty() {
                return Err(Error::config("dead_letters", "the address is empty"));
            }
            if let Some(how) = crate::address::loop_between(&self.address, a) {
                return Err(Error::DeadLetterLoop {
                    address: self.address.clone(),
                    dead_letters: a.clone(),
                    how,
                });
            }
        }
        if self.prefetch == 0 {
            return Err(Error::config("prefetch", "must be at least 1"));
        }
        if self.retry_delay.0 > self.retry_delay.1 {
            return Err(Error::config("retry_delay", "min is above max"));
        }
        if self.verb_timeout.is_zero() {
            return Err(Error::config("verb_timeout", "must be above zero"));
        }
        if let Some(window) = self.window() {
            window.check(opening.retention)?;
        }
        Ok(())
    }

    fn window(&self) -> Option<RedeliveryWindow> {
        match &self.dialect {
            // One delivery may come back once, after the stated window.
            Dialect::Generic => self.redelivery_window.map(|w| RedeliveryWindow::new(1, w)),
            Dialect::ServiceBus(sb) => Some(sb.window()),
        }
    }
}

impl SourceConfig for Amqp10Config {
    type Source = Amqp10Source;

    async fn open(self, opening: Opening<'_>) -> Result<Amqp10Source, Error> {
        self.check(&opening)?;
        Amqp10Source::open(self, opening).await
    }
}
