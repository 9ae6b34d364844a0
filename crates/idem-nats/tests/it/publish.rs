//! The outbox publisher on the real NATS server: the shared publisher suite (read back through
//! `JetStreamConsumer`), then what is JetStream's own — its duplicate window, size limits,
//! subjects no stream captures, subjects and headers NATS cannot carry.

use crate::common;

use std::error::Error as _;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::stream;
use common::{DUP_WINDOW, Env};
use idem_core::outbox::{OutboxId, OutboxMessage, PublishError, Publisher};
use idem_nats::{JetStreamConfig, JetStreamPublisher, JetStreamSource, Refused};
use idem_testkit::publisher::{BoxFuture, PublisherHarness};

struct Harness {
    env: Env,
    pull: PullConsumer,
    publisher: JetStreamPublisher,
    destination: String,
}

impl Harness {
    async fn new() -> Option<Self> {
        let url = common::nats_url()?;
        let env = Env::new(&url).await;
        let pull = env.consumer("publisher", Duration::from_secs(5), 10).await;
        let publisher = JetStreamPublisher::new(env.js.clone());
        let destination = format!("{}.m", env.subject);
        Some(Self { env, pull, publisher, destination })
    }
}

impl PublisherHarness for Harness {
    type Publisher = JetStreamPublisher;
    type Source = JetStreamSource;
    type Config<'a> = JetStreamConfig;

    fn publisher(&self) -> JetStreamPublisher {
        self.publisher.clone()
    }

    fn destination(&self) -> &str {
        &self.destination
    }

    fn config(&self) -> JetStreamConfig {
        JetStreamConfig::new(self.env.js.clone(), self.pull.clone(), &self.env.dlq_subject)
    }

    /// A subject outside every stream.
    fn missing_destination(&self) -> Option<String> {
        Some(format!("nostream.{}", common::suffix()))
    }

    /// The stream's duplicate window is 100 ms; the server forgets ids on a timer, up to twice
    /// the window late.
    fn before_republish(&self) -> BoxFuture<'_, ()> {
        Box::pin(tokio::time::sleep(DUP_WINDOW * 3))
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(self.env.cleanup())
    }
}

idem_testkit::publisher_conformance!(|_name: &'static str| Harness::new());

fn message(subject: &str, payload: Vec<u8>, headers: &[(&str, &str)]) -> OutboxMessage {
    OutboxMessage::from_parts(
        OutboxId::random(),
        subject.to_owned(),
        payload,
        headers.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        None,
    )
}

async fn stored(env: &Env) -> u64 {
    env.js.get_stream(&env.name).await.expect("stream").info().await.expect("info").state.messages
}

fn kind(e: &PublishError) -> Option<PublishErrorKind> {
    e.source()?.downcast_ref::<async_nats::jetstream::context::PublishError>().map(|e| e.kind())
}

/// Within the stream's duplicate window JetStream drops a second publish of an id and answers
/// `duplicate: true`: the message is stored, so the publisher reports success.
#[tokio::test]
async fn a_copy_within_the_duplicate_window_is_confirmed_and_dropped() {
    let Some(h) = Harness::new().await else { return };
    let m = message(&h.destination, b"{}".to_vec(), &[]);
    let results = h.publisher.publish(&[m.clone(), m.clone()]).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    assert!(h.publisher.publish(&[m]).await[0].is_ok());
    assert_eq!(stored(&h.env).await, 1, "JetStream stored the id once");
    h.cleanup().await;
}

/// A subject no stream captures is a retryable `StreamNotFound` (no responders), naming the
/// subject.
#[tokio::test]
async fn no_stream_is_a_retryable_failure_that_says_so() {
    let Some(h) = Harness::new().await else { return };
    let subject = format!("nostream.{}", common::suffix());
    let r = h.publisher.publish(&[message(&subject, b"{}".to_vec(), &[])]).await;
    let e = r[0].as_ref().expect_err("no stream captures the subject");
    assert!(e.is_retryable());
    assert_eq!(e.destination(), subject);
    assert_eq!(kind(e), Some(PublishErrorKind::StreamNotFound), "{e:?}");
    h.cleanup().await;
}

/// Too large for the server (`max_payload`, checked by the client) or for the stream
/// (`max_msg_size`, refused by the server): never retried. The rest of the batch is published.
#[tokio::test]
async fn a_message_too_large_is_not_retried() {
    let Some(h) = Harness::new().await else { return };
    let small = format!("{}.small", common::suffix());
    h.env
        .js
        .create_stream(stream::Config {
            name: format!("{}_SMALL", h.env.name),
            subjects: vec![small.clone()],
            max_message_size: 100,
            ..Default::default()
        })
        .await
        .expect("create stream");
    let max_payload = h.env.client.server_info().max_payload;
    let batch = [
        message(&h.destination, vec![b'x'; max_payload], &[]),
        message(&small, vec![b'x'; 200], &[]),
        message(&h.destination, b"{}".to_vec(), &[]),
    ];
    let results = h.publisher.publish(&batch).await;
    for (r, want) in
        results.iter().zip([PublishErrorKind::MaxPayloadExceeded, PublishErrorKind::Other])
    {
        let e = r.as_ref().expect_err("too large");
        assert!(!e.is_retryable(), "{e:?}");
        assert_eq!(kind(e), Some(want), "{e:?}");
    }
    assert!(results[2].is_ok(), "{results:?}");
    let _ = h.env.js.delete_stream(format!("{}_SMALL", h.env.name)).await;
    h.cleanup().await;
}

/// Subjects and headers NATS cannot carry are refused before sending, never retried.
#[tokio::test]
async fn invalid_subjects_and_headers_are_refused() {
    let Some(h) = Harness::new().await else { return };
    let batch = [
        message(&format!("{}.*", h.env.subject), b"{}".to_vec(), &[]),
        message(&format!("{}..m", h.env.subject), b"{}".to_vec(), &[]),
        message(&h.destination, b"{}".to_vec(), &[("a:b", "v")]),
        message(&h.destination, b"{}".to_vec(), &[("ok", "é")]),
    ];
    let results = h.publisher.publish(&batch).await;
    let refused = |i: usize| {
        let e = results[i].as_ref().expect_err("refused");
        assert!(!e.is_retryable());
        e.source().and_then(|s| s.downcast_ref::<Refused>()).cloned()
    };
    assert!(matches!(refused(0), Some(Refused::InvalidSubject { .. })));
    assert!(matches!(refused(1), Some(Refused::InvalidSubject { .. })));
    assert_eq!(refused(2), Some(Refused::InvalidHeader { name: "a:b".to_owned() }));
    assert!(results[3].is_ok(), "a UTF-8 value is fine: {results:?}");
    h.cleanup().await;
}
