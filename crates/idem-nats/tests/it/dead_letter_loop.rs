//! The startup checks that keep a consumer from eating its own dead letters and from trusting a
//! stream that keeps messages for ever, on the real server.

use crate::common;

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, Context, stream};
use futures_util::StreamExt;
use idem_core::MemoryStore;
use idem_core::consumer::BuildError;
use idem_nats::{Error, JetStreamConfig, JetStreamConsumer, MSG_ID_HEADER};

use common::{nats_url, suffix};

/// Streams made by one test, deleted when it ends (also when it panics).
struct Streams {
    url: String,
    js: Context,
    names: Vec<String>,
}

impl Streams {
    async fn new(url: &str) -> Self {
        let js = jetstream::new(async_nats::connect(url).await.expect("connect to NATS"));
        Self { url: url.to_owned(), js, names: Vec::new() }
    }

    async fn create(&mut self, name: &str, subjects: &[&str], max_age: Duration) {
        self.js
            .create_stream(stream::Config {
                name: name.to_owned(),
                subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
                max_age,
                ..Default::default()
            })
            .await
            .expect("create stream");
        self.names.push(name.to_owned());
    }

    async fn consumer(&self, stream: &str, name: &str, filter: &str) -> PullConsumer {
        self.js
            .get_stream(stream)
            .await
            .expect("stream")
            .get_or_create_consumer(
                name,
                pull::Config {
                    durable_name: Some(name.to_owned()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: Duration::from_secs(30),
                    max_deliver: 5,
                    filter_subject: filter.to_owned(),
                    ..Default::default()
                },
            )
            .await
            .expect("create consumer")
    }

    async fn publish(&self, subject: &str, id: &str, body: &'static [u8]) {
        let mut h = HeaderMap::new();
        h.insert(MSG_ID_HEADER, id);
        let ack = self.js.publish_with_headers(subject.to_owned(), h, body.into()).await;
        ack.expect("publish").await.expect("publish ack");
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        // On its own thread and runtime: the test's runtime may be unwinding.
        let (url, names) = (self.url.clone(), std::mem::take(&mut self.names));
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            rt.block_on(async {
                if let Ok(c) = async_nats::connect(&url).await {
                    let js = jetstream::new(c);
                    for n in &names {
                        let _ = js.delete_stream(n).await;
                    }
                }
            });
        })
        .join();
    }
}

/// Opens a two-phase consumer over `config`; the source's error when it refuses.
async fn open(config: JetStreamConfig) -> Result<(), Error> {
    let built = JetStreamConsumer::builder(config)
        .store(MemoryStore::new())
        .scope("order-writer")
        .build()
        .await;
    match built {
        Ok(_) => Ok(()),
        Err(BuildError::Open(e)) => Err(e),
        Err(other) => panic!("expected the source to open or refuse: {other}"),
    }
}

const HOUR: Duration = Duration::from_secs(3600);

/// The issue's layout: a stream on `orders.>` and dead letters to `orders.dlq`. A dead letter
/// published there is fetched by the same consumer as a new message under a new key (what the
/// check prevents), so opening is refused, naming the subject, the stream and its subject.
#[tokio::test]
async fn a_dead_letter_subject_the_consumed_stream_captures_is_refused() {
    let Some(url) = nats_url() else { return };
    let mut s = Streams::new(&url).await;
    let sfx = suffix();
    let (name, orders) = (format!("ORDERS_{sfx}"), format!("orders_{sfx}"));
    let (all, placed, dlq) =
        (format!("{orders}.>"), format!("{orders}.placed"), format!("{orders}.dlq"));
    s.create(&name, &[&all], HOUR).await;

    // What the refusal prevents: the dead-letter copy of o-3, published as the adapter would,
    // comes back to the consumer that dead-lettered it, as a message with a key of its own.
    let pull = s.consumer(&name, "writer", "").await;
    s.publish(&placed, "o-3", br#"{"amount":9999}"#).await;
    s.publish(&dlq, &format!("idem-dlq:{name}:1"), br#"{"amount":9999}"#).await;
    let mut got = Vec::new();
    let mut batch = pull.fetch().max_messages(10).messages().await.expect("fetch");
    while let Some(m) = batch.next().await {
        let m = m.expect("message");
        let id =
            m.headers.as_ref().and_then(|h| h.get(MSG_ID_HEADER)).map(|v| v.as_str().to_owned());
        got.push((m.subject.to_string(), id));
    }
    assert_eq!(
        got,
        [
            (placed.clone(), Some("o-3".to_owned())),
            (dlq.clone(), Some(format!("idem-dlq:{name}:1")))
        ],
        "the consumer fetches its own dead letter as a new message"
    );

    let e = open(JetStreamConfig::new(s.js.clone(), pull, &dlq)).await.expect_err("a loop");
    assert!(matches!(e, Error::DeadLetterLoop { .. }), "{e}");
    let text = e.to_string();
    for part in
        [&format!("`{dlq}`"), &format!("stream `{name}`"), &format!("`{all}`"), "no filter subject"]
    {
        assert!(text.contains(part), "{part} missing from: {text}");
    }

    // A filter that still matches the dead-letter subject does not help.
    let star = s.consumer(&name, "star", &format!("{orders}.*")).await;
    let e = open(JetStreamConfig::new(s.js.clone(), star, &dlq)).await.expect_err("a loop");
    assert!(e.to_string().contains(&format!("filter subject `{orders}.*` matches it")), "{e}");
}

/// The same stream captures the subject, but this consumer's filter excludes it, or another
/// stream captures it: both open.
#[tokio::test]
async fn a_dead_letter_subject_the_consumer_never_reads_is_accepted() {
    let Some(url) = nats_url() else { return };
    let mut s = Streams::new(&url).await;
    let sfx = suffix();
    let (name, orders) = (format!("ORDERS_{sfx}"), format!("orders_{sfx}"));
    let (dlq_name, outside) = (format!("DLQ_{sfx}"), format!("dlq.orders_{sfx}"));
    s.create(&name, &[&format!("{orders}.>")], HOUR).await;
    s.create(&dlq_name, &[&outside], Duration::ZERO).await;

    let filtered = s.consumer(&name, "placed-only", &format!("{orders}.placed")).await;
    open(JetStreamConfig::new(s.js.clone(), filtered, format!("{orders}.dlq")))
        .await
        .expect("filtered");

    let all = s.consumer(&name, "writer", "").await;
    open(JetStreamConfig::new(s.js.clone(), all, &outside)).await.expect("a stream of its own");
}

/// A stream that sources the dead-letter stream brings the dead letters back too.
#[tokio::test]
async fn a_stream_that_sources_the_dead_letter_stream_is_refused() {
    let Some(url) = nats_url() else { return };
    let mut s = Streams::new(&url).await;
    let sfx = suffix();
    let (dlq_name, dlq) = (format!("DLQ_{sfx}"), format!("dlq.orders_{sfx}"));
    let (orders_name, orders) = (format!("ORDERS_{sfx}"), format!("orders_{sfx}"));
    let agg = format!("ALL_{sfx}");
    s.create(&dlq_name, &[&dlq], HOUR).await;
    s.create(&orders_name, &[&orders], HOUR).await;
    s.js.create_stream(stream::Config {
        name: agg.clone(),
        max_age: HOUR,
        sources: Some(vec![
            stream::Source { name: orders_name.clone(), ..Default::default() },
            stream::Source { name: dlq_name.clone(), ..Default::default() },
        ]),
        ..Default::default()
    })
    .await
    .expect("create the aggregate stream");
    s.names.push(agg.clone());
    let pull = s.consumer(&agg, "writer", "").await;
    let e = open(JetStreamConfig::new(s.js.clone(), pull, &dlq)).await.expect_err("a loop");
    assert!(e.to_string().contains(&format!("sources stream `{dlq_name}`")), "{e}");
}

/// Wildcards, empty tokens and spaces are refused before anything is asked of the server.
#[tokio::test]
async fn a_dead_letter_subject_that_is_not_plain_is_refused() {
    let Some(url) = nats_url() else { return };
    let mut s = Streams::new(&url).await;
    let sfx = suffix();
    let name = format!("ORDERS_{sfx}");
    s.create(&name, &[&format!("orders_{sfx}")], HOUR).await;
    for bad in ["dlq.*", "dlq.>", "dlq..orders", "", "dlq orders"] {
        let pull = s.consumer(&name, "writer", "").await;
        let e = open(JetStreamConfig::new(s.js.clone(), pull, bad)).await.expect_err(bad);
        assert!(matches!(e, Error::DeadLetterSubject { .. }), "{bad:?}: {e}");
    }
}

/// A stream without `max_age` keeps a late copy for ever: refused unless the consumer states
/// how long to assume, and that assumption is then checked against the retention.
#[tokio::test]
async fn a_stream_without_max_age_needs_an_assumed_one() {
    let Some(url) = nats_url() else { return };
    let mut s = Streams::new(&url).await;
    let sfx = suffix();
    let (name, dlq_name) = (format!("FOREVER_{sfx}"), format!("FOREVER_{sfx}_DLQ"));
    let dlq = format!("dlq.forever_{sfx}");
    s.create(&name, &[&format!("forever_{sfx}")], Duration::ZERO).await;
    s.create(&dlq_name, &[&dlq], Duration::ZERO).await;

    let pull = s.consumer(&name, "writer", "").await;
    let e =
        open(JetStreamConfig::new(s.js.clone(), pull.clone(), &dlq)).await.expect_err("unbounded");
    assert!(matches!(e, Error::UnboundedMaxAge { .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains(&format!("`{name}`")) && text.contains("assume_max_age"), "{text}");

    let stated = JetStreamConfig::new(s.js.clone(), pull.clone(), &dlq).assume_max_age(HOUR);
    open(stated).await.expect("an assumed max_age");

    // The assumption counts in the window: 30 days do not fit the default 7-day retention.
    let long = JetStreamConfig::new(s.js.clone(), pull, &dlq).assume_max_age(HOUR * 24 * 30);
    let e = open(long).await.expect_err("retention too short");
    assert!(matches!(e, Error::Retention(_)) && e.to_string().contains("30d"), "{e}");
}
