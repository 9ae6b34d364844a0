//! Shared setup for the tests on the real NATS server.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
use async_nats::jetstream::{self, Context, stream};

/// The main stream's duplicate window (the server's minimum).
pub const DUP_WINDOW: Duration = Duration::from_millis(100);

/// The main stream's `max_age`.
pub const MAX_AGE: Duration = Duration::from_secs(3600);

/// The server URL, or `None` (skip) when it is down outside CI.
pub fn nats_url() -> Option<String> {
    idem_testkit::service::require_nats("IDEM_TEST_NATS_URL", "127.0.0.1:4222")
}

/// A stream and dead-letter stream with random names, deleted by [`Env::cleanup`].
pub struct Env {
    pub url: String,
    pub client: async_nats::Client,
    pub js: Context,
    pub name: String,
    pub subject: String,
    pub dlq_stream: String,
    pub dlq_subject: String,
}

pub fn suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

impl Env {
    /// Streams `T_<sfx>` on `t.<sfx>.>` (messages kept for [`MAX_AGE`]) and `T_<sfx>_DLQ` on
    /// `dlq.<sfx>`. The main stream's duplicate window is the server's minimum, 100 ms, so a
    /// producer's retry with the same `Nats-Msg-Id` sent after it ([`Env::retry`]) is stored and delivered: JetStream's send-side
    /// dedup does not cover a retry that comes late, and idem must.
    pub async fn new(url: &str) -> Self {
        Self::with_duplicate_window(url, DUP_WINDOW).await
    }

    /// [`Env::new`] with the main stream's duplicate window set to `window`.
    pub async fn with_duplicate_window(url: &str, window: Duration) -> Self {
        let env = Self::attach(url, &suffix()).await;
        env.js
            .create_stream(stream::Config {
                name: env.name.clone(),
                subjects: vec![format!("{}.>", env.subject)],
                duplicate_window: window,
                // A bounded age, which the consumer's retention check needs.
                max_age: MAX_AGE,
                ..Default::default()
            })
            .await
            .expect("create stream");
        env.js
            .create_stream(stream::Config {
                name: env.dlq_stream.clone(),
                subjects: vec![env.dlq_subject.clone()],
                ..Default::default()
            })
            .await
            .expect("create dlq stream");
        env
    }

    /// The streams of suffix `sfx`, made by another process (a crash test's parent); they are
    /// deleted when this is dropped, so a child never drops it.
    pub async fn attach(url: &str, sfx: &str) -> Self {
        let client = async_nats::connect(url).await.expect("connect to NATS");
        let js = jetstream::new(client.clone());
        let (name, subject) = (format!("T_{sfx}"), format!("t.{sfx}"));
        let (dlq_stream, dlq_subject) = (format!("{name}_DLQ"), format!("dlq.{sfx}"));
        Self { url: url.to_owned(), client, js, name, subject, dlq_stream, dlq_subject }
    }

    /// The suffix [`attach`](Self::attach) takes.
    pub fn suffix(&self) -> &str {
        self.subject.strip_prefix("t.").unwrap_or_default()
    }

    pub async fn consumer(&self, name: &str, ack_wait: Duration, max_deliver: i64) -> PullConsumer {
        self.js
            .get_stream(&self.name)
            .await
            .expect("stream")
            .get_or_create_consumer(
                name,
                pull::Config {
                    durable_name: Some(name.to_owned()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait,
                    max_deliver,
                    ..Default::default()
                },
            )
            .await
            .expect("create consumer")
    }

    /// Publishes and awaits the publish ack; panics if JetStream merged it as a duplicate.
    pub async fn publish(&self, id: &str, body: &[u8]) -> u64 {
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", id);
        let ack = self
            .js
            .publish_with_headers(format!("{}.m", self.subject), h, body.to_vec().into())
            .await
            .expect("publish")
            .await
            .expect("publish ack");
        assert!(!ack.duplicate, "JetStream dropped a publish of {id} as a duplicate");
        ack.sequence
    }

    /// A producer's retry of a message last published at `last`: sent once JetStream's
    /// duplicate window has passed (the retry of a producer that timed out waiting for its
    /// publish ack), so it is stored as another copy. The server forgets ids on a timer, up to
    /// twice the window late, hence three windows. Sets `last` to now.
    pub async fn retry(&self, id: &str, body: &[u8], last: &mut tokio::time::Instant) -> u64 {
        tokio::time::sleep_until(*last + DUP_WINDOW * 3).await;
        let seq = self.publish(id, body).await;
        *last = tokio::time::Instant::now();
        seq
    }

    pub async fn pending(&self, consumer: &str) -> (u64, usize) {
        let s = self.js.get_stream(&self.name).await.expect("stream");
        let i = s.consumer_info(consumer).await.expect("consumer info");
        (i.num_pending, i.num_ack_pending)
    }

    pub async fn dead_letters(&self) -> Vec<async_nats::jetstream::message::StreamMessage> {
        let mut s = self.js.get_stream(&self.dlq_stream).await.expect("dlq stream");
        let n = s.info().await.expect("dlq info").state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=n {
            if let Ok(m) = s.get_raw_message(seq).await {
                out.push(m);
            }
        }
        out
    }

    /// Deletes the streams now (they are also deleted on drop, even when the test panics).
    pub async fn cleanup(self) {
        let _ = self.js.delete_stream(&self.name).await;
        let _ = self.js.delete_stream(&self.dlq_stream).await;
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // On its own thread and runtime: the test's runtime may be unwinding.
        let (url, names) = (self.url.clone(), [self.name.clone(), self.dlq_stream.clone()]);
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

pub fn header<'a>(
    m: &'a async_nats::jetstream::message::StreamMessage,
    name: &str,
) -> Option<&'a str> {
    m.headers.get(name).map(async_nats::HeaderValue::as_str)
}

/// The PostgreSQL URL, or `None` (skip) when it is down outside CI.
pub fn pg_url() -> Option<String> {
    idem_testkit::service::require(
        "PostgreSQL",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
}

/// A PostgreSQL schema name owned by one test: dropped (with everything in it) when this guard
/// drops, panics included.
pub struct PgSchema {
    pub url: String,
    pub name: String,
}

impl PgSchema {
    pub fn new(url: &str, name: &str) -> Self {
        Self { url: url.to_owned(), name: name.to_owned() }
    }
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        let (url, sql) =
            (self.url.clone(), format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name));
        // Its own thread and runtime: the test's runtime may be the one this drop blocks.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            rt.block_on(async move {
                use sqlx::Connection as _;
                if let Ok(mut c) = sqlx::PgConnection::connect(&url).await {
                    let sql = format!("SET lock_timeout = '5s'; {sql}");
                    if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut c).await {
                        eprintln!("could not drop the test schema: {e}");
                    }
                }
            });
        })
        .join();
    }
}
