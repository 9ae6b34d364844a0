//! JetStream's own `Nats-Msg-Id` duplicate window, as an idem user meets it: a re-publish of an
//! id inside the window is dropped by the server (its publish ack says `duplicate`), so the
//! consumer — and idem — sees one message for two publishes.

use crate::common;

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::publish::PublishAck;
use common::{Env, nats_url};
use idem_core::MemoryStore;
use idem_core::consumer::Report;
use idem_core::engine::HandlerError;
use idem_nats::{JetStreamConfig, JetStreamConsumer};

async fn publish(env: &Env, id: &str, body: &'static [u8]) -> PublishAck {
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", id);
    env.js
        .publish_with_headers(format!("{}.m", env.subject), h, body.into())
        .await
        .expect("publish")
        .await
        .expect("publish ack")
}

#[tokio::test]
async fn a_republish_inside_the_window_is_dropped_before_idem_sees_it() {
    let Some(url) = nats_url() else { return };
    // A window far longer than the test, so every publish below falls inside it.
    let env = Env::with_duplicate_window(&url, Duration::from_secs(120)).await;
    let first = publish(&env, "order-1", br#"{"cents":1200}"#).await;
    let retry = publish(&env, "order-1", br#"{"cents":1200}"#).await;
    // The window compares ids only: another body under the same id is dropped too, so idem
    // never gets to report it as a conflict.
    let reused = publish(&env, "order-1", br#"{"cents":9900}"#).await;
    assert!(!first.duplicate);
    assert!(retry.duplicate && reused.duplicate, "{retry:?} {reused:?}");
    assert_eq!((retry.sequence, reused.sequence), (first.sequence, first.sequence));
    let mut stream = env.js.get_stream(&env.name).await.expect("stream");
    assert_eq!(stream.info().await.expect("info").state.messages, 1, "one stored message");

    let pull = env.consumer("window", Duration::from_secs(30), 5).await;
    let nats =
        JetStreamConsumer::builder(JetStreamConfig::new(env.js.clone(), pull, &env.dlq_subject))
            .store(MemoryStore::new())
            .scope("window")
            .build()
            .await
            .expect("adapter");
    let handler = |_, d: idem_nats::Delivery| async move {
        Ok::<_, HandlerError<String>>(d.payload_bytes().to_vec())
    };
    let mut total = Report::default();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while total.acked < 1 {
        assert!(tokio::time::Instant::now() < deadline, "nothing delivered: {total}");
        total += nats.poll(handler).await.expect("poll");
    }
    // Three publishes, one delivery: processed once, and no duplicate for idem to count.
    assert_eq!((total.processed, total.duplicates, total.conflicts), (1, 0, 0), "{total}");
    let info = stream.consumer_info("window").await.expect("consumer info");
    assert_eq!((info.delivered.stream_sequence, info.num_pending), (first.sequence, 0));
    env.cleanup().await;
}
