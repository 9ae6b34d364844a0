//! The broker-source conformance suite on RabbitMQ's AMQP 1.0 plugin: every mode through the
//! same builder calls (two-phase over a store; SQLite, PostgreSQL and MariaDB inboxes), each
//! on a queue of its own, dead letters copied to an address; and the crash suite (abort between
//! commit and `accepted`, SIGKILL and a dropped connection mid-handler) in both modes.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::Broker;
use idem_amqp10::{Amqp10Config, Amqp10Source, DeadLetters};
use idem_testkit::crash::CrashHarness;
use idem_testkit::source::{BoxFuture, DeadCopy, SourceHarness};

struct Harness(Broker);

impl SourceHarness for Harness {
    type Source = Amqp10Source;
    type Config<'a> = Amqp10Config;

    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()> {
        Box::pin(self.0.publish(Some(id), body, &[]))
    }

    fn config(&self) -> Amqp10Config {
        Amqp10Config::new(self.0.url.clone(), self.0.address())
            .dead_letters(DeadLetters::Address(self.0.dlq_address()))
            .retry_delay(Duration::from_millis(100), Duration::from_millis(500))
    }

    fn settled(&self) -> BoxFuture<'_, bool> {
        Box::pin(async { self.0.count(&self.0.name).await == 0 })
    }

    fn dead_letters(&self) -> BoxFuture<'_, Vec<DeadCopy>> {
        Box::pin(async {
            self.0
                .drain_dlq()
                .await
                .into_iter()
                .map(|(message_id, headers)| DeadCopy { message_id, headers })
                .collect()
        })
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(self.0.cleanup())
    }
}

impl CrashHarness for Harness {
    fn spec(&self) -> String {
        self.0.name.clone()
    }

    fn attach(name: &str) -> BoxFuture<'static, Self> {
        let name = name.to_owned();
        Box::pin(async move { Harness(Broker::attach(&name).await) })
    }
}

async fn harness(name: &str) -> Option<Harness> {
    Broker::new(&name.replace('_', "-")).await.map(Harness)
}

idem_testkit::source_conformance!(harness);
idem_testkit::crash_conformance!(Harness, harness);
