//! The broker-source conformance suite on the real NATS server: every mode through the same
//! builder calls (two-phase over a store; SQLite, PostgreSQL and MariaDB inboxes), each on a
//! stream of its own. Producer retries are published after JetStream's duplicate window, so the
//! broker really stores and delivers them twice. Also the crash suite (abort between commit
//! and ack, SIGKILL and a dropped connection mid-handler) in both modes, the store on SQLite
//! and on PostgreSQL.

mod common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use common::{DUP_WINDOW, Env};
use idem_core::consumer::headers;
use idem_nats::{JetStreamConfig, JetStreamSource};
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
