//! The broker-source conformance suite on the real NATS server: every mode through the same
//! builder calls (two-phase over a store; SQLite, PostgreSQL and MariaDB inboxes), each on a
//! stream of its own. Producer retries are published after JetStream's duplicate window, so the
//! broker really stores and delivers them twice. Also the crash suite (abort between commit
//! and ack, SIGKILL and a dropped connection mid-handler) in both modes, the store on SQLite
//! and on PostgreSQL.

use crate::common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use common::{DUP_WINDOW, Env};
use idem_core::consumer::headers;
use idem_dlq::{DlqError, OnConflict, Workbench};
use idem_nats::{JetStreamConfig, JetStreamDeadLetters, JetStreamSource};
use idem_testkit::crash::CrashHarness;
use idem_testkit::source::{BoxFuture, DeadCopy, SourceHarness};

const CONSUMER: &str = "modes";

struct Harness {
    env: Env,
    pull: PullConsumer,
    /// When each id was last published: a repeat waits out the duplicate window.
    seen: Mutex<HashMap<String, tokio::time::Instant>>,
}

impl SourceHarness for Harness {
    type Source = JetStreamSource;
    type Config<'a> = JetStreamConfig;

    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // The server forgets ids on a timer, up to twice the window late.
            let last = self.seen.lock().expect("seen").get(id).copied();
            if let Some(at) = last {
                tokio::time::sleep_until(at + DUP_WINDOW * 3).await;
            }
            self.env.publish(id, body).await;
            self.seen.lock().expect("seen").insert(id.to_owned(), tokio::time::Instant::now());
        })
    }

    fn config(&self) -> JetStreamConfig {
        JetStreamConfig::new(self.env.js.clone(), self.pull.clone(), &self.env.dlq_subject)
            .retry_delay(Duration::from_millis(100))
    }

    fn settled(&self) -> BoxFuture<'_, bool> {
        Box::pin(async { self.env.pending(CONSUMER).await == (0, 0) })
    }

    fn dead_letters(&self) -> BoxFuture<'_, Vec<DeadCopy>> {
        Box::pin(async {
            self.env
                .dead_letters()
                .await
                .into_iter()
                .map(|m| {
                    let headers = m
                        .headers
                        .iter()
                        .flat_map(|(k, vs)| {
                            let k: &str = k.as_ref();
                            vs.first().map(|v| (k.to_owned(), v.as_str().to_owned()))
                        })
                        .collect::<std::collections::HashMap<_, _>>();
                    let message_id = headers.get(headers::ORIGINAL_MESSAGE_ID).cloned();
                    DeadCopy { message_id, headers }
                })
                .collect()
        })
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(self.env.cleanup())
    }
}

impl CrashHarness for Harness {
    fn spec(&self) -> String {
        self.env.suffix().to_owned()
    }

    fn attach(sfx: &str) -> BoxFuture<'static, Self> {
        let sfx = sfx.to_owned();
        Box::pin(async move {
            let url = common::nats_url().expect("NATS");
            let env = Env::attach(&url, &sfx).await;
            Harness::with(env).await
        })
    }
}

impl Harness {
    async fn with(env: Env) -> Self {
        let pull = env.consumer(CONSUMER, Duration::from_secs(5), 10).await;
        Self { env, pull, seen: Mutex::default() }
    }
}

async fn harness(_name: &str) -> Option<Harness> {
    let url = common::nats_url()?;
    Some(Harness::with(Env::new(&url).await).await)
}

idem_testkit::source_conformance!(harness);
idem_testkit::crash_conformance!(Harness, harness, postgres);

/// The dead-letter workbench through the real consumer: read back, replay by the rules (a
/// conflict refused, then accepted as new), replayed twice, purged.
#[tokio::test]
async fn workbench() {
    let Some(h) = harness("workbench").await else { return };
    let queue = JetStreamDeadLetters::new(
        h.env.js.clone(),
        h.env.dlq_stream.clone(),
        h.env.dlq_subject.clone(),
    );
    idem_testkit::dlq::workbench(h, queue).await;
}

/// A replay whose message id the destination stream still holds in its duplicate window would
/// be dropped by JetStream: it fails, and the dead letter stays.
#[tokio::test]
async fn a_replay_inside_the_duplicate_window_is_not_published() {
    let Some(url) = common::nats_url() else { return };
    let env = Env::with_duplicate_window(&url, Duration::from_secs(120)).await;
    let source = format!("{}.m", env.subject);
    env.publish("x-1", b"{}").await;
    let mut h = async_nats::HeaderMap::new();
    for (k, v) in [
        (headers::ORIGINAL_MESSAGE_ID, "x-1"),
        (headers::OUTCOME, "failed_permanent"),
        (headers::REASON, "declined"),
        (headers::KEY, "x-1"),
        (headers::SCOPE, "s"),
        (headers::SOURCE, source.as_str()),
        ("Nats-Msg-Id", "idem-dlq:T:1"),
    ] {
        h.insert(k, v);
    }
    env.js
        .publish_with_headers(env.dlq_subject.clone(), h, b"{}".to_vec().into())
        .await
        .expect("dead letter")
        .await
        .expect("dead letter ack");
    let queue = JetStreamDeadLetters::new(env.js.clone(), &env.dlq_stream, &env.dlq_subject);
    let bench = Workbench::new(&queue);
    let letters = bench.list(10).await.expect("list");
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].message_id.as_deref(), Some("x-1"));
    assert!(letters[0].header("Nats-Msg-Id").is_none(), "{letters:?}");

    let err = bench.replay(&letters, OnConflict::Refuse).await.expect_err("a dropped replay");
    match &err {
        DlqError::NotPublished { letter, why } => {
            assert_eq!(letter, &letters[0].id);
            assert!(why.contains("duplicate window") && why.contains("x-1"), "{why}");
        }
        other => panic!("expected NotPublished, got {other:?}"),
    }
    assert_eq!(bench.list(10).await.expect("list").len(), 1, "the dead letter was removed");
    let stored = env
        .js
        .get_stream(&env.name)
        .await
        .expect("stream")
        .info()
        .await
        .expect("info")
        .state
        .messages;
    assert_eq!(stored, 1, "the replay was stored after all");
    env.cleanup().await;
}
