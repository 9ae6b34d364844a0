//! A RabbitMQ consumer never dead-letters into its own work queue, on the real broker.

use crate::common;

use idem_amqp::lapin::options::{BasicGetOptions, BasicPublishOptions, ExchangeDeclareOptions};
use idem_amqp::lapin::types::FieldTable;
use idem_amqp::lapin::{BasicProperties, ExchangeKind};
use idem_amqp::{AmqpConfig, AmqpConsumer, Error, Topology};
use idem_core::MemoryStore;
use idem_core::consumer::BuildError;

/// Opens a two-phase consumer with `topology` over the broker's connection; the source's error
/// when it refuses.
async fn open(b: &common::Broker, topology: Topology) -> Result<(), Error> {
    let config = AmqpConfig::new(&b.conn, b.queue()).topology(topology);
    let built = AmqpConsumer::builder(config).store(MemoryStore::new()).scope("s").build().await;
    match built {
        Ok(consumer) => {
            consumer.close().await.expect("close");
            Ok(())
        }
        Err(BuildError::Open(e)) => Err(e),
        Err(other) => panic!("expected the source to open or refuse: {other}"),
    }
}

/// A dead letter published as the adapter publishes it (routing key: the work queue) to the
/// default exchange lands in the work queue (what the refusal prevents); that topology, and
/// the dead-letter queue set to the work queue or the delay queue, are refused before anything
/// is declared, naming the exchange and the queue. The default topology opens.
#[tokio::test]
async fn dead_letters_routed_back_into_the_work_queue_are_refused() {
    let Some(b) = common::Broker::new("dl-loop").await else { return };
    let queue = b.queue().to_owned();

    let confirm =
        b.ch.basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions { mandatory: true, immediate: false },
            b"{}",
            BasicProperties::default().with_message_id("o-3".into()),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    assert!(confirm.is_ack());
    let got = b.ch.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await;
    let got = got.expect("basic.get").expect("the dead letter is in the work queue");
    assert_eq!(got.delivery.properties.message_id().as_ref().map(|s| s.as_str()), Some("o-3"));

    let t = Topology::for_queue(queue.as_str());
    let e = open(&b, t.clone().with_dead_letter("", None)).await.expect_err("default exchange");
    assert!(matches!(e, Error::DeadLetterLoop { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("exchange ``") && text.contains(&format!("work queue `{queue}`")),
        "{text}"
    );

    let dlx = format!("{queue}.mine.dlx");
    let e = open(&b, t.clone().with_dead_letter(dlx.as_str(), Some(queue.clone())))
        .await
        .expect_err("the work queue bound to the exchange");
    let text = e.to_string();
    assert!(
        text.contains(&format!("exchange `{dlx}`")) && text.contains("bind the work queue"),
        "{text}"
    );

    let delay = t.delay_queue().to_owned();
    let e = open(&b, t.clone().with_dead_letter(dlx.as_str(), Some(delay.clone())))
        .await
        .expect_err("the delay queue");
    assert!(e.to_string().contains(&format!("delay queue `{delay}`")), "{e}");
    // Nothing was declared for the refused topologies (a passive declare of a missing
    // exchange closes its channel: one of its own).
    let probe = b.conn.create_channel().await.expect("channel");
    let passive = ExchangeDeclareOptions { passive: true, ..ExchangeDeclareOptions::default() };
    let declared = probe
        .exchange_declare(dlx.as_str().into(), ExchangeKind::Direct, passive, FieldTable::default())
        .await;
    assert!(declared.is_err(), "exchange {dlx} was declared");

    open(&b, t).await.expect("the default topology");
    b.cleanup().await;
}
