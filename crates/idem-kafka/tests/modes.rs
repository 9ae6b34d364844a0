//! The broker-source conformance suite on a real Kafka-protocol broker (tansu): every mode
//! through the same builder calls (two-phase over a store; SQLite, PostgreSQL and MariaDB
//! inboxes), each on a topic of 2 partitions and a consumer group of its own. Also the crash
//! suite (abort between commit and offset commit, SIGKILL and a dropped connection
//! mid-handler, each followed by a rebalance) in both modes, the store on SQLite and on
//! PostgreSQL.

mod common;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use common::Topics;
use idem_kafka::rdkafka::producer::FutureProducer;
use idem_kafka::{KafkaConfig, KafkaSource};
use idem_testkit::crash::CrashHarness;
use idem_testkit::source::{BoxFuture, DeadCopy, SourceHarness};

const PARTITIONS: i32 = 2;

struct Harness {
    brokers: String,
    topic: String,
    dlq: String,
    group: String,
    producer: FutureProducer,
    /// Each partition's end offset as the broker acknowledged the records published so far.
    ends: Mutex<HashMap<i32, i64>>,
    /// Deletes the topics when dropped (the parent's only).
    _topics: Option<Topics>,
}

impl SourceHarness for Harness {
    type Source = KafkaSource;
    type Config<'a> = KafkaConfig;

    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let rec = [(id.to_owned(), body.to_vec())];
            let ends = common::produce(&self.producer, &self.topic, &rec, None).await;
            let mut all = self.ends.lock().expect("ends");
            for (p, o) in ends {
                let e = all.entry(p).or_insert(0);
                *e = (*e).max(o);
            }
        })
    }

    fn config(&self) -> KafkaConfig {
        KafkaConfig::new(
            &common::config(&self.brokers, &self.group),
            &[self.topic.as_str()],
            &self.dlq,
        )
        .retry_delay(Duration::from_millis(100))
    }

    /// The group's commits reached every partition's end.
    fn settled(&self) -> BoxFuture<'_, bool> {
        Box::pin(async {
            let ends = self.ends.lock().expect("ends").clone();
            let got = common::committed(&self.brokers, &self.group, &self.topic, PARTITIONS).await;
            ends.iter().all(|(p, o)| got.get(p) == Some(o))
        })
    }

    fn dead_letters(&self) -> BoxFuture<'_, Vec<DeadCopy>> {
        Box::pin(async {
            common::read_all(&self.brokers, &self.dlq, 1)
                .await
                .into_iter()
                .map(|(_, headers)| DeadCopy {
                    message_id: headers.get("message-id").cloned(),
                    headers,
                })
                .collect()
        })
    }

    fn cleanup(self) -> BoxFuture<'static, ()> {
        Box::pin(async move { drop(self) })
    }
}

impl CrashHarness for Harness {
    fn spec(&self) -> String {
        format!("{} {} {}", self.topic, self.dlq, self.group)
    }

    fn attach(spec: &str) -> BoxFuture<'static, Self> {
        let names: Vec<String> = spec.split(' ').map(str::to_owned).collect();
        Box::pin(async move {
            let [topic, dlq, group] = <[String; 3]>::try_from(names).expect("topic dlq group");
            let brokers = common::brokers().expect("the Kafka broker");
            let producer = common::producer(&brokers);
            Harness { brokers, topic, dlq, group, producer, ends: Mutex::default(), _topics: None }
        })
    }
}

async fn harness(name: &str) -> Option<Harness> {
    let brokers = common::brokers()?;
    let sfx = common::suffix();
    let name = name.replace('_', "-");
    let (topic, dlq, group) =
        (format!("idem-{name}-{sfx}"), format!("idem-{name}-{sfx}-dlq"), format!("g-{sfx}"));
    let topics = Topics::create(&brokers, &[(&topic, PARTITIONS), (&dlq, 1)]).await;
    let producer = common::producer(&brokers);
    Some(Harness {
        brokers,
        topic,
        dlq,
        group,
        producer,
        ends: Mutex::new(HashMap::new()),
        _topics: Some(topics),
    })
}

idem_testkit::source_conformance!(harness);
idem_testkit::crash_conformance!(Harness, harness, postgres);
