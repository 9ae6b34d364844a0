//! Shared helpers: RabbitMQ's AMQP 1.0 plugin, a queue of the test's own (declared over
//! AMQP 0-9-1, where queue arguments and counts are available), and an AMQP 1.0 producer.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use fe2o3_amqp::types::messaging::{
    ApplicationProperties, Body, Data, Message, MessageId, Outcome, Properties,
};
use fe2o3_amqp::types::primitives::{Binary, SimpleValue, Value};
use fe2o3_amqp::{Connection, Receiver, Sender, Session};
use idem_amqp10::fe2o3_amqp;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use tokio::sync::Mutex;

pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672";
const ADMIN_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The AMQP 1.0 URL, or `None` (after printing a skip) when RabbitMQ does not answer.
pub fn url() -> Option<String> {
    idem_testkit::service::require("RabbitMQ (AMQP 1.0)", "IDEM_TEST_AMQP10_URL", DEFAULT_URL)
}

pub fn suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// A work queue and its dead-letter queue. The work queue dead-letters `rejected` messages
/// to the dead-letter queue (queue arguments), so both dead-letter modes can be tested.
pub struct Broker {
    pub url: String,
    pub name: String,
    admin: lapin::Channel,
    _admin_conn: lapin::Connection,
    producer: Mutex<(
        fe2o3_amqp::connection::ConnectionHandle<()>,
        fe2o3_amqp::session::SessionHandle<()>,
        Sender,
    )>,
}

impl Broker {
    pub async fn new(test: &str) -> Option<Self> {
        let url = url()?;
        let name = format!("idem-amqp10-{test}-{}", suffix());
        let broker = Self::open(url, name).await;
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        let dlq = format!("{}.dlq", broker.name);
        broker
            .admin
            .queue_declare(dlq.as_str().into(), durable, FieldTable::default())
            .await
            .unwrap();
        let mut args = FieldTable::default();
        args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(LongString::from("")));
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(LongString::from(dlq)),
        );
        broker.admin.queue_declare(broker.name.as_str().into(), durable, args).await.unwrap();
        Some(broker)
    }

    /// The queue `name` of another process (a crash test's child): declares nothing.
    pub async fn attach(name: &str) -> Self {
        Self::open(url().expect("RabbitMQ's AMQP 1.0 plugin"), name.to_owned()).await
    }

    async fn open(url: String, name: String) -> Self {
        let admin_url = std::env::var("IDEM_TEST_AMQP_URL").unwrap_or_else(|_| ADMIN_URL.into());
        let conn = lapin::Connection::connect(&admin_url, lapin::ConnectionProperties::default())
            .await
            .unwrap();
        let admin = conn.create_channel().await.unwrap();
        let mut connection =
            Connection::open(format!("idem-test-producer-{}", suffix()), url.as_str())
                .await
                .unwrap();
        let mut session = Session::begin(&mut connection).await.unwrap();
        let sender =
            Sender::attach(&mut session, "producer", format!("/amq/queue/{name}")).await.unwrap();
        Self {
            url,
            name,
            admin,
            _admin_conn: conn,
            producer: Mutex::new((connection, session, sender)),
        }
    }

    pub fn address(&self) -> String {
        format!("/amq/queue/{}", self.name)
    }

    pub fn dlq_address(&self) -> String {
        format!("/amq/queue/{}.dlq", self.name)
    }

    /// Publishes `body` with `message-id` = `id` (if any) and string application properties,
    /// waiting for the broker's `accepted`.
    pub async fn publish(&self, id: Option<&str>, body: &[u8], props: &[(&str, &str)]) {
        let properties = Properties {
            message_id: id.map(|i| MessageId::String(i.to_owned())),
            ..Properties::default()
        };
        self.publish_with(properties, body, props).await;
    }

    /// As [`publish`](Self::publish), with the message's properties as given.
    pub async fn publish_with(&self, properties: Properties, body: &[u8], props: &[(&str, &str)]) {
        let mut app = ApplicationProperties::default();
        for (k, v) in props {
            app.0.insert((*k).to_owned(), SimpleValue::String((*v).to_owned()));
        }
        let message = Message {
            header: None,
            delivery_annotations: None,
            message_annotations: None,
            properties: Some(properties),
            application_properties: Some(app),
            body: Body::<Value>::Data(vec![Data(Binary::from(body.to_vec()))].into()),
            footer: None,
        };
        let mut p = self.producer.lock().await;
        let outcome = p.2.send(message).await.unwrap();
        assert!(matches!(outcome, Outcome::Accepted(_)), "publish not accepted: {outcome:?}");
    }

    /// Ready messages in `queue` (not counting delivered and unsettled ones).
    pub async fn count(&self, queue: &str) -> u32 {
        let passive = QueueDeclareOptions { passive: true, ..Default::default() };
        self.admin
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .unwrap()
            .message_count()
    }

    /// Takes the first message at `address` (waiting up to 5 s), over AMQP 1.0.
    pub async fn take(&self, address: &str) -> Option<Message<Body<Value>>> {
        let mut connection =
            Connection::open(format!("idem-test-take-{}", suffix()), self.url.as_str())
                .await
                .unwrap();
        let mut session = Session::begin(&mut connection).await.unwrap();
        let mut rx = Receiver::attach(&mut session, "taker", address).await.unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), rx.recv::<Body<Value>>()).await;
        let m = match got {
            Ok(Ok(d)) => {
                rx.accept(&d).await.unwrap();
                Some(d.into_message())
            }
            _ => None,
        };
        let _ = tokio::time::timeout(Duration::from_secs(2), rx.close()).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), connection.close()).await;
        m
    }

    /// Takes every dead letter: `(message-id, string application properties)`, over AMQP 1.0.
    pub async fn drain_dlq(&self) -> Vec<(Option<String>, HashMap<String, String>)> {
        let mut connection =
            Connection::open(format!("idem-test-dlq-{}", suffix()), self.url.as_str())
                .await
                .unwrap();
        let mut session = Session::begin(&mut connection).await.unwrap();
        let mut rx =
            Receiver::attach(&mut session, "dlq-reader", self.dlq_address()).await.unwrap();
        let mut out = Vec::new();
        while let Ok(Ok(d)) =
            tokio::time::timeout(Duration::from_millis(500), rx.recv::<Body<Value>>()).await
        {
            rx.accept(&d).await.unwrap();
            let m = d.into_message();
            let id = m.properties.as_ref().and_then(|p| p.message_id.as_ref()).map(|id| match id {
                MessageId::String(s) => s.clone(),
                other => format!("{other:?}"),
            });
            let headers = m
                .application_properties
                .map(|a| {
                    a.0.into_iter()
                        .filter_map(|(k, v)| match v {
                            SimpleValue::String(s) => Some((k, s)),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push((id, headers));
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), rx.close()).await;
        let _ = tokio::time::timeout(Duration::from_secs(2), connection.close()).await;
        out
    }

    pub async fn cleanup(self) {
        let mut p = self.producer.into_inner();
        let _ = tokio::time::timeout(Duration::from_secs(2), p.0.close()).await;
        for q in [self.name.clone(), format!("{}.dlq", self.name)] {
            let _ = self.admin.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
        }
    }
}
