//! The outbox publisher on the real RabbitMQ: the shared publisher suite (read back through
//! `AmqpConsumer`), then what is RabbitMQ's own — the properties, a missing exchange, names
//! AMQP cannot carry.
#![allow(clippy::unwrap_used)]

use crate::common;

use common::Broker;
use idem_amqp::lapin::options::BasicGetOptions;
use idem_amqp::lapin::types::AMQPValue;
use idem_amqp::{AmqpConfig, AmqpPublisher, AmqpSource, Refused};
use idem_core::outbox::{OutboxId, OutboxMessage, Publisher};
use idem_testkit::publisher::{BoxFuture, PublisherHarness};

struct Harness {
    broker: Broker,
    publisher: AmqpPublisher,
}

impl Harness {
    async fn new(tag: &str) -> Option<Self> {
        let broker = Broker::new(tag).await?;
        let publisher =
            AmqpPublisher::new(broker.conn.create_channel().await.unwrap()).await.unwrap();
        Some(Self { broker, publisher })
    }
}

impl PublisherHarness for Harness {
    type Publisher = AmqpPublisher;
    type Source = AmqpSource;
    type Config<'a> = AmqpConfig<'a>;

    fn publisher(&self) -> AmqpPublisher {
        self.publisher.clone()
    }

    fn destination(&self) -> &str {
        self.broker.queue()
    }

    fn config(&self) -> AmqpConfig<'_> {
        AmqpConfig::new(&self.broker.conn, self.broker.queue())
    }

    /// A routing key no queue is bound to on the default exchange.
    fn missing_destination(&self) -> Option<String> {
        Some(format!("{}-missing", self.broker.queue()))
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(self.broker.cleanup())
    }
}

idem_testkit::publisher_conformance!(|name: &'static str| async move {
    Harness::new(&name.replace('_', "-")).await
});

fn message(dest: &str, headers: &[(&str, &str)]) -> OutboxMessage {
    OutboxMessage::from_parts(
        OutboxId::random(),
        dest.to_owned(),
        br#"{"order":"o-1"}"#.to_vec(),
        headers.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        None,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn properties_carry_id_headers_and_persistence() {
    let Some(h) = Harness::new("pub-props").await else { return };
    let m = message(h.broker.queue(), &[("content-type", "application/json"), ("tenant", "t-1")]);
    let transient = message(h.broker.queue(), &[]);
    assert!(h.publisher.publish(std::slice::from_ref(&m)).await[0].is_ok());
    let p = h.publisher.clone().persistent(false);
    assert!(p.publish(std::slice::from_ref(&transient)).await[0].is_ok());
    let get = |ch: &idem_amqp::lapin::Channel| {
        let (ch, q) = (ch.clone(), h.broker.queue().to_owned());
        async move {
            ch.basic_get(q.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
                .expect("a message")
                .delivery
        }
    };
    let d = get(&h.broker.ch).await;
    let props = &d.properties;
    assert_eq!(props.message_id().as_ref().map(|s| s.as_str()), Some(m.id().as_str()));
    assert_eq!(*props.delivery_mode(), Some(2));
    assert_eq!(props.content_type().as_ref().map(|s| s.as_str()), Some("application/json"));
    let tenant = props.headers().as_ref().and_then(|t| t.inner().get("tenant").cloned());
    assert!(matches!(tenant, Some(AMQPValue::LongString(s)) if s.to_string() == "t-1"));
    assert_eq!(d.data, m.payload());
    let d = get(&h.broker.ch).await;
    assert_eq!(*d.properties.delivery_mode(), None, "persistent(false) publishes transient");
    h.cleanup().await;
}

/// RabbitMQ closes a channel that publishes to a missing exchange: every message of the batch
/// fails retryably, and so does every later publish until the publisher is rebuilt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_exchange_closes_the_channel() {
    let Some(h) = Harness::new("pub-noexchange").await else { return };
    let p = h.publisher.clone().exchange(format!("{}-no-such-exchange", h.broker.queue()));
    let batch = [message("k", &[]), message("k", &[])];
    for r in p.publish(&batch).await {
        let e = r.expect_err("published to a missing exchange");
        assert!(e.is_retryable(), "{e:?}");
        let cause = std::error::Error::source(&e).unwrap();
        assert!(cause.downcast_ref::<idem_amqp::lapin::Error>().is_some(), "{cause:?}");
    }
    assert!(!p.is_open(), "the broker closed the channel");
    let later = h.publisher.publish(&[message(h.broker.queue(), &[])]).await;
    assert!(later[0].as_ref().is_err_and(|e| e.is_retryable()), "{later:?}");
    h.cleanup().await;
}

/// A header name AMQP cannot carry is refused before publishing, and not retried; the rest of
/// the batch is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlong_header_name_is_refused() {
    let Some(h) = Harness::new("pub-longname").await else { return };
    let long = "h".repeat(256);
    let batch =
        [message(h.broker.queue(), &[(long.as_str(), "v")]), message(h.broker.queue(), &[])];
    let results = h.publisher.publish(&batch).await;
    let e = results[0].as_ref().expect_err("a 256-byte header name");
    assert!(!e.is_retryable());
    let cause = std::error::Error::source(e).unwrap().downcast_ref::<Refused>();
    assert_eq!(cause, Some(&Refused::TooLong { what: "header name", len: 256 }));
    assert!(results[1].is_ok(), "{results:?}");
    assert!(h.publisher.is_open());
    h.cleanup().await;
}

/// A batch dropped before its confirms came (the relay's publish timeout) leaves them pending;
/// a return of the next batch must not be taken by one of them, or an unroutable message of the
/// next batch would count as published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_does_not_swallow_the_next_batchs_returns() {
    let Some(h) = Harness::new("pub-dropped").await else { return };
    let missing = format!("{}-missing", h.broker.queue());
    for round in 0..50 {
        let abandoned: Vec<_> = (0..50).map(|_| message(h.broker.queue(), &[])).collect();
        let cut = std::time::Duration::from_micros(200);
        let _ = tokio::time::timeout(cut, h.publisher.publish(&abandoned)).await;
        let next = [message(&missing, &[]), message(h.broker.queue(), &[])];
        let results = h.publisher.publish(&next).await;
        assert!(results[0].is_err(), "round {round}: an unroutable message was confirmed");
        assert!(results[1].is_ok(), "round {round}: {results:?}");
    }
    h.cleanup().await;
}
