//! The broker-source conformance suite on the real NATS server: every mode through the same
//! builder calls (two-phase over a store; SQLite, PostgreSQL and MariaDB inboxes), each on a
//! stream of its own. Producer retries are published after JetStream's duplicate window, so the
//! broker really stores and delivers them twice.

mod common;

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use common::{DUP_WINDOW, Env};
use idem_core::consumer::headers;
use idem_nats::{JetStreamConfig, JetStreamSource};
use idem_testkit::source::{BoxFuture, DeadCopy, SourceHarness};

const CONSUMER: &str = "modes";

struct Harness {
    env: Env,
    pull: PullConsumer,
    /// Ids published so far, and when the last publish was: a repeat waits out the window.
    seen: Mutex<(HashSet<String>, tokio::time::Instant)>,
}

impl SourceHarness for Harness {
    type Source = JetStreamSource;
    type Config<'a> = JetStreamConfig;

    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let wait_until = {
                let seen = self.seen.lock().expect("seen");
                seen.0.contains(id).then(|| seen.1 + DUP_WINDOW * 3)
            };
            if let Some(at) = wait_until {
                tokio::time::sleep_until(at).await;
            }
            self.env.publish(id, body).await;
            let mut seen = self.seen.lock().expect("seen");
            seen.0.insert(id.to_owned());
            seen.1 = tokio::time::Instant::now();
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

idem_testkit::source_conformance!(|_name: &'static str| async move {
    let url = common::nats_url()?;
    let env = Env::new(&url).await;
    let pull = env.consumer(CONSUMER, Duration::from_secs(5), 10).await;
    let seen = Mutex::new((HashSet::new(), tokio::time::Instant::now()));
    Some(Harness { env, pull, seen })
});
