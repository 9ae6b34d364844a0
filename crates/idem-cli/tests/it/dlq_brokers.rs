//! `idem dlq` through the binary on every broker's real server: two dead letters put where a
//! consumer of `--queue` puts them, listed as one group, one replayed (and found back at its
//! source), the other purged. `tests/it/dlq.rs` walks the whole story (a real consumer, the store
//! record, conflicts) on Redis; this file shows each broker's `--broker` URL reaches its queue.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test setup: a failure is the test failing

use std::future::Future;
use std::process::{Command, Output};
use std::time::Duration;

use idem_testkit::service::require;
use idem_testkit::wait_for;
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(30);

/// The idem headers of a dead letter from a consumer of `source` in scope `billing`.
fn dead_letter_headers(source: &str) -> Vec<(&'static str, String)> {
    vec![
        ("idem-outcome", "failed_permanent".to_owned()),
        ("idem-reason", "handler failed: card declined".to_owned()),
        ("idem-scope", "billing".to_owned()),
        ("idem-source", source.to_owned()),
    ]
}

/// The two dead letters each test puts: (message id, payload).
const LETTERS: [(&str, &str); 2] = [("w-1", r#"{"w":1}"#), ("w-2", r#"{"w":2}"#)];

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem")).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn ok(verb: &str, extra: &[&str], at: &[&str]) -> String {
    let mut args = vec!["dlq", verb];
    args.extend_from_slice(extra);
    args.extend_from_slice(at);
    let o = idem(&args);
    assert!(o.status.success(), "idem {}: {}", args.join(" "), text(&o));
    text(&o)
}

fn letters(at: &[&str]) -> Vec<Value> {
    ok("list", &["--json"], at).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// The walk, once the two [`LETTERS`] are in place: `at` is the `--broker …` arguments,
/// `at_source` counts the messages at the dead letters' source.
async fn walk<F, Fut>(at: &[&str], at_source: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = u64>,
{
    wait_for("2 dead letters listed", LIMIT, || async { letters(at).len() == 2 }).await;
    let all = letters(at);
    assert_eq!(all[0]["group"], all[1]["group"], "{all:?}");
    assert_eq!(all[0]["outcome"], "failed_permanent", "{all:?}");
    assert_eq!(all[0]["scope"], "billing", "{all:?}");
    let table = ok("list", &[], at);
    assert!(table.contains("billing") && table.contains("card declined"), "{table}");
    let first = all.iter().find(|l| l["payload"] == LETTERS[0].1).expect("w-1 listed");
    let second = all.iter().find(|l| l["payload"] == LETTERS[1].1).expect("w-2 listed");
    let shown = ok("show", &[first["id"].as_str().unwrap()], at);
    assert!(shown.contains("idem-reason: handler failed: card declined"), "{shown}");

    let out = ok("replay", &["--id", first["id"].as_str().unwrap()], at);
    assert!(out.contains("1 replayed under their key"), "{out}");
    wait_for("the replay at its source", LIMIT, || async { at_source().await == 1 }).await;
    let left = letters(at);
    assert_eq!(left.len(), 1, "{left:?}");
    assert_eq!(left[0]["id"], second["id"]);

    let out = ok("purge", &["--all"], at);
    assert!(out.contains("1 dead letters removed"), "{out}");
    assert!(letters(at).is_empty());
    assert_eq!(at_source().await, 1, "a purge sends nothing");
}

fn suffix() -> String {
    format!("{}-{:08x}", std::process::id(), rand_u32())
}

/// Enough randomness for a name no earlier run used (the clock's nanoseconds).
fn rand_u32() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default()
}

/// Declares RabbitMQ queues the broker deletes 10 minutes after their last use, so a failed
/// run leaves nothing for long.
async fn declare_expiring(ch: &idem::amqp::lapin::Channel, queues: [&String; 2]) {
    use idem::amqp::lapin::options::QueueDeclareOptions;
    use idem::amqp::lapin::types::{AMQPValue, FieldTable};
    let mut expiring = FieldTable::default();
    expiring.insert("x-expires".into(), AMQPValue::LongInt(600_000));
    for q in queues {
        let options = QueueDeclareOptions::durable();
        ch.queue_declare(q.as_str().into(), options, expiring.clone()).await.unwrap();
    }
}

/// Ready messages in a RabbitMQ queue (a passive declare).
async fn ready(ch: idem::amqp::lapin::Channel, queue: String) -> u64 {
    use idem::amqp::lapin::options::QueueDeclareOptions;
    use idem::amqp::lapin::types::FieldTable;
    let passive = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() };
    let q = ch.queue_declare(queue.as_str().into(), passive, FieldTable::default()).await;
    u64::from(q.unwrap().message_count())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_on_rabbitmq() {
    use idem::amqp::lapin::options::{
        BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions,
    };
    use idem::amqp::lapin::types::{AMQPValue, FieldTable, LongString};
    use idem::amqp::lapin::{BasicProperties, Connection, ConnectionProperties};

    let Some(url) =
        require("rabbitmq", "IDEM_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
    else {
        return;
    };
    let conn = Connection::connect(&url, ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let queue = format!("idem-cli-dlq-{}", suffix());
    let dlq = format!("{queue}.idem.dlq");
    declare_expiring(&ch, [&queue, &dlq]).await;
    for (id, body) in LETTERS {
        let mut h = FieldTable::default();
        for (k, v) in dead_letter_headers(&queue) {
            h.insert(k.into(), AMQPValue::LongString(LongString::from(v)));
        }
        let props = BasicProperties::default().with_message_id(id.into()).with_headers(h);
        let publish = BasicPublishOptions::default();
        let sent =
            ch.basic_publish("".into(), dlq.as_str().into(), publish, body.as_bytes(), props);
        assert!(sent.await.unwrap().await.unwrap().is_ack());
    }
    walk(&["--broker", &url, "--queue", &queue], || ready(ch.clone(), queue.clone())).await;
    for q in [&queue, &dlq] {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_on_nats_jetstream() {
    use idem::nats::async_nats::{self, HeaderMap, jetstream};

    let Some(url) =
        idem_testkit::service::require_nats("IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222")
    else {
        return;
    };
    // CI gives the bare `host:port` the NATS crates take; the CLI wants a scheme.
    let url = if url.contains("://") { url } else { format!("nats://{url}") };
    let js = jetstream::new(async_nats::connect(url.as_str()).await.unwrap());
    let sfx = suffix().replace('-', "_");
    let (stream, dlq_stream) = (format!("IDEMCLI_{sfx}"), format!("IDEMCLI_{sfx}_DLQ"));
    let source = format!("cli.{sfx}.orders");
    let dlq = idem::nats::JetStreamDeadLetters::subject_for(&source);
    for (name, subject) in [(&stream, &source), (&dlq_stream, &dlq)] {
        let config = jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            // A stream a failed run leaves behind empties itself.
            max_age: Duration::from_secs(600),
            ..Default::default()
        };
        js.create_stream(config).await.unwrap();
    }
    for (id, body) in LETTERS {
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", format!("idem-dlq:{stream}:{id}").as_str());
        h.insert("idem-original-message-id", id);
        for (k, v) in dead_letter_headers(&source) {
            h.insert(k, v.as_str());
        }
        let ack = js.publish_with_headers(dlq.clone(), h, body.as_bytes().to_vec().into());
        ack.await.unwrap().await.unwrap();
    }
    let depth = || {
        let js = js.clone();
        let stream = stream.clone();
        async move { js.get_stream(&stream).await.unwrap().info().await.unwrap().state.messages }
    };
    walk(&["--broker", &url, "--queue", &source], depth).await;
    for s in [&stream, &dlq_stream] {
        js.delete_stream(s).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_on_amqp_1_0() {
    use idem::amqp::lapin::options::QueueDeleteOptions;
    use idem::amqp10::fe2o3_amqp::types::messaging::{
        ApplicationProperties, Body, Data, Message, MessageId, Outcome, Properties,
    };
    use idem::amqp10::fe2o3_amqp::types::primitives::{Binary, SimpleValue, Value as AmqpValue};
    use idem::amqp10::fe2o3_amqp::{Connection, Sender, Session};

    let Some(url) =
        require("RabbitMQ (AMQP 1.0)", "IDEM_TEST_AMQP10_URL", "amqp://guest:guest@127.0.0.1:5672")
    else {
        return;
    };
    // The queues are made over AMQP 0-9-1 (AMQP 1.0 has no declare), on the same broker.
    let admin = std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let conn = idem::amqp::lapin::Connection::connect(&admin, Default::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let queue = format!("idem-cli-dlq10-{}", suffix());
    let dlq = format!("{queue}.dlq");
    declare_expiring(&ch, [&queue, &dlq]).await;
    let (source, dlq_address) = (format!("/amq/queue/{queue}"), format!("/amq/queue/{dlq}"));

    let mut amqp = Connection::open("idem-cli-dlq-test", url.as_str()).await.unwrap();
    let mut session = Session::begin(&mut amqp).await.unwrap();
    let mut sender = Sender::attach(&mut session, "put", dlq_address.as_str()).await.unwrap();
    for (id, body) in LETTERS {
        let mut app = ApplicationProperties::default();
        for (k, v) in dead_letter_headers(&source) {
            app.0.insert(k.to_owned(), SimpleValue::String(v));
        }
        let message = Message {
            header: None,
            delivery_annotations: None,
            message_annotations: None,
            properties: Some(Properties {
                message_id: Some(MessageId::String(id.to_owned())),
                ..Properties::default()
            }),
            application_properties: Some(app),
            body: Body::<AmqpValue>::Data(
                vec![Data(Binary::from(body.as_bytes().to_vec()))].into(),
            ),
            footer: None,
        };
        let outcome = sender.send(message).await.unwrap();
        assert!(matches!(outcome, Outcome::Accepted(_)), "put not accepted: {outcome:?}");
    }
    // Done with this producer; how its link ends is not under test.
    let _ = sender.close().await;
    let _ = session.end().await;
    let _ = amqp.close().await;

    let broker = url.replacen("amqp", "amqp10", 1);
    let at = ["--broker", &broker, "--queue", &queue, "--dead-letter", &dlq_address];
    walk(&at, || ready(ch.clone(), queue.clone())).await;
    for q in [&queue, &dlq] {
        ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    }
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_on_kafka() {
    use idem::kafka::rdkafka::ClientConfig;
    use idem::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use idem::kafka::rdkafka::consumer::{BaseConsumer, Consumer};
    use idem::kafka::rdkafka::message::{Header, OwnedHeaders};
    use idem::kafka::rdkafka::producer::{FutureProducer, FutureRecord};

    let Some(brokers) = require("Kafka (tansu)", "IDEM_TEST_KAFKA_BROKERS", "127.0.0.1:9092")
    else {
        return;
    };
    let topic = format!("idem-cli-dlq-{}", suffix());
    let dlq = idem::kafka::KafkaDeadLetters::topic_for(&topic);
    let admin: AdminClient<_> =
        ClientConfig::new().set("bootstrap.servers", &brokers).create().unwrap();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let new = [&topic, &dlq].map(|t| NewTopic::new(t, 1, TopicReplication::Fixed(1)));
    for r in admin.create_topics(&new, &opts).await.unwrap() {
        r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
    }
    let producer: FutureProducer =
        ClientConfig::new().set("bootstrap.servers", &brokers).create().unwrap();
    for (id, body) in LETTERS {
        let mut h = OwnedHeaders::new().insert(Header { key: "message-id", value: Some(id) });
        for (k, v) in dead_letter_headers(&topic) {
            h = h.insert(Header { key: k, value: Some(v.as_str()) });
        }
        let record = FutureRecord::to(&dlq).key(id).payload(body).headers(h);
        producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).unwrap();
    }
    let watcher: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("{topic}-watch"))
        .create()
        .unwrap();
    let depth = || {
        let w = watcher.fetch_watermarks(&topic, 0, Duration::from_secs(10));
        let (low, high) = w.unwrap();
        std::future::ready(u64::try_from(high - low).unwrap())
    };
    let broker = format!("kafka://{brokers}");
    walk(&["--broker", &broker, "--queue", &topic], depth).await;
    let _ = admin.delete_topics(&[topic.as_str(), dlq.as_str()], &opts).await;
}
