//! An AMQP 1.0 consumer never dead-letters to an address its source receives from, on
//! RabbitMQ's AMQP 1.0 plugin.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::Broker;
use fe2o3_amqp::types::messaging::{Body, Message, Outcome};
use fe2o3_amqp::types::primitives::Value;
use fe2o3_amqp::{Connection, Receiver, Sender, Session};
use idem_amqp10::{Amqp10Config, Amqp10Consumer, DeadLetters, Error, fe2o3_amqp};
use idem_core::MemoryStore;
use idem_core::consumer::BuildError;

/// Opens a two-phase consumer over `config`; the source's error when it refuses.
async fn open(config: Amqp10Config) -> Result<(), Error> {
    let built = Amqp10Consumer::builder(config).store(MemoryStore::new()).scope("s").build().await;
    match built {
        Ok(consumer) => {
            consumer.close().await.unwrap();
            Ok(())
        }
        Err(BuildError::Open(e)) => Err(e),
        Err(other) => panic!("expected the source to open or refuse: {other}"),
    }
}

/// RabbitMQ names one queue as `/amq/queue/q` and `/queue/q`: a copy sent to the second is
/// received from the first (what the refusal prevents). Dead letters to the source address or
/// to another name of its queue are refused, naming both addresses; the dead-letter queue
/// opens.
#[tokio::test]
async fn a_dead_letter_address_that_reaches_the_source_queue_is_refused() {
    let Some(b) = Broker::new("dl-loop").await else { return };
    let source = b.address();
    let other_name = format!("/queue/{}", b.name);

    // The demonstration on a plain queue of its own: RabbitMQ 3.x declares the queue of a
    // `/queue/q` target as it would a new one (not durable, no arguments), and refuses the
    // attach when the queue exists with other settings, as the broker's work queue does.
    let plain = format!("idem-amqp10-plain-{}", common::suffix());
    let admin_url = std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let admin = lapin::Connection::connect(&admin_url, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    let ch = admin.create_channel().await.unwrap();
    ch.queue_declare(plain.as_str().into(), Default::default(), Default::default()).await.unwrap();
    let mut connection = Connection::open("idem-test-loop", b.url.as_str()).await.unwrap();
    let mut session = Session::begin(&mut connection).await.unwrap();
    let target = format!("/queue/{plain}");
    let mut tx = Sender::attach(&mut session, "dead-letters", target.as_str()).await.unwrap();
    let outcome = tx.send(Message::from("o-3 dead letter")).await.unwrap();
    assert!(matches!(outcome, Outcome::Accepted(_)), "{outcome:?}");
    let from = format!("/amq/queue/{plain}");
    let mut rx = Receiver::attach(&mut session, "source", from.as_str()).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(10), rx.recv::<Body<Value>>())
        .await
        .expect("the copy sent to /queue/q reaches /amq/queue/q")
        .unwrap();
    rx.accept(&d).await.unwrap();
    let _ = tokio::time::timeout(Duration::from_secs(2), tx.close()).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), rx.close()).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), connection.close()).await;
    ch.queue_delete(plain.as_str().into(), Default::default()).await.unwrap();
    let _ = admin.close(200, "".into()).await;

    for target in [source.clone(), other_name, format!("/exchange/amq.default/{}", b.name)] {
        let config = Amqp10Config::new(b.url.clone(), source.clone())
            .dead_letters(DeadLetters::Address(target.clone()));
        let e = open(config).await.expect_err("a loop");
        assert!(matches!(e, Error::DeadLetterLoop { .. }), "{target}: {e}");
        let text = e.to_string();
        assert!(
            text.contains(&format!("`{target}`")) && text.contains(&format!("`{source}`")),
            "{text}"
        );
    }

    let config = Amqp10Config::new(b.url.clone(), source)
        .dead_letters(DeadLetters::Address(b.dlq_address()));
    open(config).await.expect("the dead-letter queue");
    b.cleanup().await;
}
