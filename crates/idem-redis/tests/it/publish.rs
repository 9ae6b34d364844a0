//! The outbox publisher on a real Redis: the shared publisher suite (read back through
//! `StreamConsumer`), then what is Redis' own — the entry's fields, trimming, a key of another
//! type, fields a header would shadow, the replica wait.

use crate::common;

use std::error::Error as _;
use std::time::Duration;

use common::Cleanup;
use idem_core::outbox::{OutboxId, OutboxMessage, Publisher};
use idem_redis::{Refused, StreamConfig, StreamPublisher, StreamSource};
use idem_testkit::publisher::{BoxFuture, PublisherHarness};
use redis::AsyncCommands;
use redis::streams::StreamRangeReply;

struct Harness {
    client: redis::Client,
    conn: redis::aio::ConnectionManager,
    stream: String,
    _cleanup: Cleanup,
}

impl Harness {
    async fn new(tag: &str) -> Option<Self> {
        let url = common::url()?;
        let stream = common::fresh_name(tag);
        let _cleanup = Cleanup { url: url.clone(), patterns: vec![format!("{stream}*")] };
        let client = redis::Client::open(url.as_str()).expect("client");
        let conn = client.get_connection_manager().await.expect("connect");
        Some(Self { client, conn, stream, _cleanup })
    }

    async fn entries(&self) -> StreamRangeReply {
        self.conn.clone().xrange_all(&self.stream).await.expect("xrange")
    }
}

impl PublisherHarness for Harness {
    type Publisher = StreamPublisher;
    type Source = StreamSource;
    type Config<'a> = StreamConfig;

    fn publisher(&self) -> StreamPublisher {
        StreamPublisher::new(self.conn.clone())
    }

    fn destination(&self) -> &str {
        &self.stream
    }

    fn config(&self) -> StreamConfig {
        StreamConfig::new(self.client.clone(), &self.stream, "readers", "r-1")
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(async move { drop(self) })
    }
}

idem_testkit::publisher_conformance!(|name: &'static str| Harness::new(name));

fn message(dest: &str, headers: &[(&str, &str)]) -> OutboxMessage {
    OutboxMessage::from_parts(
        OutboxId::random(),
        dest.to_owned(),
        br#"{"order":"o-1"}"#.to_vec(),
        headers.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        None,
    )
}

#[tokio::test]
async fn an_entry_holds_id_payload_and_headers_as_fields() {
    let Some(h) = Harness::new("pub-fields").await else { return };
    let m = message(&h.stream, &[("content-type", "application/json")]);
    assert!(h.publisher().publish(std::slice::from_ref(&m)).await[0].is_ok());
    let custom = message(&h.stream, &[]);
    let p = h.publisher().id_field("mid").payload_field("body");
    assert!(p.publish(std::slice::from_ref(&custom)).await[0].is_ok());
    let got = h.entries().await;
    let field = |i: usize, k: &str| got.ids[i].get::<Vec<u8>>(k);
    assert_eq!(got.ids[0].map.len(), 3, "{:?}", got.ids[0]);
    assert_eq!(field(0, "message_id"), Some(m.id().as_str().as_bytes().to_vec()));
    assert_eq!(field(0, "payload"), Some(m.payload().to_vec()));
    assert_eq!(field(0, "content-type"), Some(b"application/json".to_vec()));
    assert_eq!(field(1, "mid"), Some(custom.id().as_str().as_bytes().to_vec()));
    assert_eq!(field(1, "body"), Some(custom.payload().to_vec()));
    h.cleanup().await;
}

#[tokio::test]
async fn max_len_trims_the_stream_approximately() {
    let Some(h) = Harness::new("pub-trim").await else { return };
    let p = h.publisher().max_len(100);
    for _ in 0..10 {
        let batch: Vec<_> = (0..100).map(|_| message(&h.stream, &[])).collect();
        assert!(p.publish(&batch).await.iter().all(Result::is_ok));
    }
    let len: usize = h.conn.clone().xlen(&h.stream).await.expect("xlen");
    // `~` trims whole macro-nodes (100 entries each by default): about 100, never all 1,000.
    assert!((100..=300).contains(&len), "{len} entries left");
    h.cleanup().await;
}

/// A key of another type is a destination no retry fixes; a header shadowing the id or payload
/// field is refused before writing. Neither keeps the rest of the batch from being written.
#[tokio::test]
async fn a_key_of_another_type_and_a_shadowing_header_are_not_retried() {
    let Some(h) = Harness::new("pub-wrongtype").await else { return };
    let string_key = format!("{}-string", h.stream);
    let () = h.conn.clone().set(&string_key, "x").await.expect("set");
    let batch = [
        message(&string_key, &[]),
        message(&h.stream, &[("Message_Id", "forged")]),
        message(&h.stream, &[]),
    ];
    let results = h.publisher().publish(&batch).await;
    let e = results[0].as_ref().expect_err("WRONGTYPE");
    assert!(!e.is_retryable());
    assert_eq!(e.destination(), string_key);
    let e = results[1].as_ref().expect_err("shadowing header");
    assert!(!e.is_retryable());
    let r = e.source().and_then(|s| s.downcast_ref::<Refused>()).cloned();
    assert_eq!(r, Some(Refused::ShadowedField { name: "Message_Id".to_owned(), role: "id" }));
    assert!(results[2].is_ok(), "{results:?}");
    assert_eq!(h.entries().await.ids.len(), 1);
    h.cleanup().await;
}

/// The test server has no replicas: a batch that asks for one is written, then fails
/// (retryable) once the wait times out.
#[tokio::test]
async fn too_few_replicas_is_a_retryable_failure() {
    let Some(h) = Harness::new("pub-wait").await else { return };
    let none = h.publisher().wait_for_replicas(0, Duration::from_millis(10));
    assert!(none.publish(&[message(&h.stream, &[])]).await[0].is_ok());
    let one = h.publisher().wait_for_replicas(1, Duration::from_millis(50));
    let results = one.publish(&[message(&h.stream, &[]), message(&h.stream, &[])]).await;
    for r in &results {
        let e = r.as_ref().expect_err("no replica acknowledged");
        assert!(e.is_retryable());
        let r = e.source().and_then(|s| s.downcast_ref::<Refused>()).cloned();
        assert_eq!(r, Some(Refused::Replicas { acked: 0, wanted: 1 }));
    }
    h.cleanup().await;
}
