//! The queues and exchange the adapter uses beside the work queue.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{Channel, ExchangeKind};

use crate::Error;

/// Header counting a message's trips through the delay queue.
pub const DELAYS_HEADER: &str = "idem-delays";

/// Whether `name` is one of RabbitMQ's sender-selected distribution headers (`CC`, `BCC`): the
/// broker routes a publish carrying them to those routing keys as well, and keeps `CC` on the
/// message it delivers. A copy idem makes (a delayed retry, a dead letter, a replay) is for one
/// queue, so they stay off it; sent as text (a replay) the broker refuses the publish outright.
pub(crate) fn is_routing_header(name: &str) -> bool {
    name == "CC" || name == "BCC"
}

/// Names of the work queue and its companions.
///
/// - **delay queue** (`<queue>.idem.delay`): no consumers; each message carries a per-message
///   TTL (`expiration`) and dead-letters back to the work queue through the default exchange
///   when it expires. Used for "in progress elsewhere": the copy comes back after the other
///   consumer's lease. RabbitMQ expires per-message TTLs only at the head of a queue, so a
///   short delay queued behind a long one waits for it; the adapter clamps delays to
///   `[min_delay, max_delay]` to keep them alike.
/// - **dead-letter exchange** (`<queue>.idem.dlx`, direct) bound to the **dead-letter queue**
///   (`<queue>.idem.dlq`) with the work queue's name as routing key. Conflicts and permanent
///   failures are republished there with the `idem-*` headers of
///   [`idem_core::consumer::headers`] (reason, outcome, scope, `idem-source` = the work queue),
///   under publisher confirms, before the original is acked.
///
/// # Dead letters that would come back
/// Opening refuses ([`Error::DeadLetterLoop`]) a topology whose dead letters would be routed
/// back into the work queue by what idem itself declares or what every broker has:
/// - the dead-letter exchange is the default exchange (`""` or `amq.default`), which routes the
///   routing key `<queue>` to the work queue itself;
/// - the dead-letter queue is the work queue, which idem would then bind to the dead-letter
///   exchange;
/// - the dead-letter queue is the delay queue, whose expired messages idem routes back into the
///   work queue (and a dead letter, which has no expiry, would stay at its head and hold up
///   every delay behind it).
///
/// Bindings made by others are not seen: AMQP 0-9-1 offers no way to list them (only the
/// management HTTP API does). So an exchange of yours given with `with_dead_letter(x, None)`
/// that routes `<queue>` back to the work queue, directly or through an exchange-to-exchange
/// binding, is not caught; give it a routing path of its own.
///
/// ```
/// use idem_amqp::Topology;
///
/// let t = Topology::for_queue("orders");
/// assert_eq!(t.delay_queue(), "orders.idem.delay");
/// assert_eq!(t.dead_letter_queue(), Some("orders.idem.dlq"));
/// let mine = t.with_dead_letter("ops.dlx", None);
/// assert_eq!((mine.dead_letter_exchange(), mine.dead_letter_queue()), ("ops.dlx", None));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub(crate) queue: String,
    pub(crate) delay_queue: String,
    pub(crate) dead_letter_exchange: String,
    pub(crate) dead_letter_queue: Option<String>,
}

impl Topology {
    /// The default companions of `queue`.
    pub fn for_queue(queue: impl Into<String>) -> Self {
        let queue = queue.into();
        Self {
            delay_queue: format!("{queue}.idem.delay"),
            dead_letter_exchange: format!("{queue}.idem.dlx"),
            dead_letter_queue: Some(format!("{queue}.idem.dlq")),
            queue,
        }
    }

    /// The work queue.
    pub fn queue(&self) -> &str {
        &self.queue
    }

    /// The delay queue.
    pub fn delay_queue(&self) -> &str {
        &self.delay_queue
    }

    /// The dead-letter exchange.
    pub fn dead_letter_exchange(&self) -> &str {
        &self.dead_letter_exchange
    }

    /// The dead-letter queue bound to the exchange, if the adapter declares one.
    pub fn dead_letter_queue(&self) -> Option<&str> {
        self.dead_letter_queue.as_deref()
    }

    /// Uses another delay queue.
    #[must_use]
    pub fn with_delay_queue(mut self, name: impl Into<String>) -> Self {
        self.delay_queue = name.into();
        self
    }

    /// Uses another dead-letter exchange, and binds `queue` to it (`None`: the exchange is
    /// yours and already routes somewhere; the adapter still publishes with `mandatory`, so an
    /// unroutable dead-letter is never acked away).
    #[must_use]
    pub fn with_dead_letter(mut self, exchange: impl Into<String>, queue: Option<String>) -> Self {
        self.dead_letter_exchange = exchange.into();
        self.dead_letter_queue = queue;
        self
    }

    /// Refuses names that send dead letters (or delayed copies) back into the work queue
    /// through what idem declares or every broker has (see
    /// [the list](Topology#dead-letters-that-would-come-back)).
    pub(crate) fn check(&self) -> Result<(), Error> {
        let queue = self.queue.as_str();
        let config = |what: &str| Err(Error::Config(format!("{what} is empty")));
        if queue.is_empty() {
            return config("the work queue's name");
        }
        if self.delay_queue.is_empty() {
            return config("the delay queue's name");
        }
        if self.delay_queue == queue {
            return Err(Error::Config(format!(
                "the delay queue `{queue}` is the work queue: delayed copies would be redelivered \
                 at once instead of after their delay; name another queue"
            )));
        }
        let exchange = self.dead_letter_exchange.as_str();
        let how = if exchange.is_empty() || exchange == "amq.default" {
            format!("the default exchange routes routing key `{queue}` to queue `{queue}`")
        } else if self.dead_letter_queue.as_deref() == Some(queue) {
            format!("idem would bind the work queue to it with routing key `{queue}`")
        } else if self.dead_letter_queue.as_deref() == Some(self.delay_queue.as_str()) {
            format!(
                "its queue is the delay queue `{}`, whose expired messages go back to the work \
                 queue (and a dead letter, which never expires, would hold up every delay \
                 behind it)",
                self.delay_queue
            )
        } else {
            return Ok(());
        };
        Err(Error::DeadLetterLoop { exchange: exchange.to_owned(), queue: queue.to_owned(), how })
    }

    /// Checks the work queue exists and declares the companions (idempotent).
    pub(crate) async fn declare(&self, ch: &Channel) -> Result<(), Error> {
        let step = |what: &'static str| move |source| Error::Topology { what, source };
        ch.queue_declare(
            self.queue.as_str().into(),
            QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() },
            FieldTable::default(),
        )
        .await
        .map_err(step("work queue (passive declare)"))?;
        let mut args = FieldTable::default();
        args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(LongString::from("")));
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(LongString::from(self.queue.as_str())),
        );
        ch.queue_declare(self.delay_queue.as_str().into(), QueueDeclareOptions::durable(), args)
            .await
            .map_err(step("delay queue"))?;
        ch.exchange_declare(
            self.dead_letter_exchange.as_str().into(),
            ExchangeKind::Direct,
            ExchangeDeclareOptions { durable: true, ..ExchangeDeclareOptions::default() },
            FieldTable::default(),
        )
        .await
        .map_err(step("dead-letter exchange"))?;
        if let Some(dlq) = &self.dead_letter_queue {
            ch.queue_declare(
                dlq.as_str().into(),
                QueueDeclareOptions::durable(),
                FieldTable::default(),
            )
            .await
            .map_err(step("dead-letter queue"))?;
            ch.queue_bind(
                dlq.as_str().into(),
                self.dead_letter_exchange.as_str().into(),
                self.queue.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(step("dead-letter binding"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loop_of(t: &Topology) -> String {
        match t.check() {
            Err(e @ Error::DeadLetterLoop { .. }) => e.to_string(),
            other => panic!("expected a loop, got {other:?}"),
        }
    }

    #[test]
    fn dead_letters_routed_back_by_what_idem_declares_are_refused() {
        let t = Topology::for_queue("orders");
        assert!(t.check().is_ok());
        let e = loop_of(&t.clone().with_dead_letter("", None));
        assert!(e.contains("exchange ``") && e.contains("default exchange routes"), "{e}");
        assert!(loop_of(&t.clone().with_dead_letter("amq.default", None)).contains("default"));
        let e = loop_of(&t.clone().with_dead_letter("orders.dlx", Some("orders".into())));
        assert!(e.contains("`orders.dlx`") && e.contains("bind the work queue"), "{e}");
        let e =
            loop_of(&t.clone().with_dead_letter("orders.dlx", Some("orders.idem.delay".into())));
        assert!(e.contains("delay queue `orders.idem.delay`"), "{e}");
        // An exchange of the user's is taken at its word: its bindings cannot be seen.
        assert!(t.clone().with_dead_letter("ops.dlx", None).check().is_ok());
    }

    #[test]
    fn a_delay_queue_that_is_the_work_queue_is_refused() {
        let t = Topology::for_queue("orders").with_delay_queue("orders");
        assert!(matches!(t.check(), Err(Error::Config(m)) if m.contains("delay queue `orders`")));
    }
}
