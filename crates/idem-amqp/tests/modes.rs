//! The broker-source conformance suite on the real RabbitMQ: every mode through the same
//! builder calls (two-phase over a store; SQLite, PostgreSQL and MariaDB inboxes), each on a
//! queue of its own; and the crash suite (abort between commit and ack, SIGKILL and a dropped
//! connection mid-handler) in both modes, the store on SQLite and on PostgreSQL.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::Broker;
use idem_amqp::{AmqpConfig, AmqpSource};
use idem_testkit::crash::CrashHarness;
use idem_testkit::source::{BoxFuture, DeadCopy, SourceHarness};

struct Harness(Broker);

impl SourceHarness for Harness {
    type Source = AmqpSource;
    type Config<'a> = AmqpConfig<'a>;

    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()> {
        Box::pin(self.0.publish(Some(id), body, &[]))
    }

    fn config(&self) -> AmqpConfig<'_> {
        AmqpConfig::new(&self.0.conn, self.0.queue())
            .retry_delay(Duration::from_millis(100), Duration::from_millis(500))
    }

    /// Nothing ready in the work queue or the delay queue (unacked deliveries count as ready
    /// again once the consumer is gone, which the suite checks after the run).
    fn settled(&self) -> BoxFuture<'_, bool> {
        Box::pin(async {
            self.0.count(self.0.queue()).await == 0
                && self.0.count(self.0.topology.delay_queue()).await == 0
        })
    }

    fn dead_letters(&self) -> BoxFuture<'_, Vec<DeadCopy>> {
        Box::pin(async {
            self.0
                .drain_dlq_headers()
                .await
                .into_iter()
                .map(|(message_id, headers, _)| DeadCopy { message_id, headers })
                .collect()
        })
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(self.0.cleanup())
    }
}

impl CrashHarness for Harness {
    fn spec(&self) -> String {
        self.0.queue().to_owned()
    }

    fn attach(queue: &str) -> BoxFuture<'static, Self> {
        let queue = queue.to_owned();
        Box::pin(async move { Harness(Broker::attach(&queue).await) })
    }
}

async fn harness(name: &str) -> Option<Harness> {
    Broker::new(&name.replace('_', "-")).await.map(Harness)
}

idem_testkit::source_conformance!(harness);
idem_testkit::crash_conformance!(Harness, harness, postgres);
