//! Shared helpers: a real broker, a queue of the test's own, and waiting on conditions.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::collections::HashMap;
use std::time::Duration;

use idem_amqp::lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use idem_amqp::lapin::types::{AMQPValue, FieldTable, LongString};
use idem_amqp::lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use idem_amqp::{Delivery, Topology};
use idem_core::consumer::{Settlement, headers};
use idem_core::engine::Verb;
use tokio::sync::mpsc;

pub const DEFAULT_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

pub fn url() -> Option<String> {
    idem_testkit::service::require("RabbitMQ", "IDEM_TEST_AMQP_URL", DEFAULT_URL)
}

pub fn suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// A report as the hook saw it, owned.
#[derive(Debug, Clone)]
pub struct Seen {
    pub key: Option<String>,
    pub outcome: &'static str,
    pub verb: Verb,
    pub redelivered: bool,
    pub delays: u32,
    pub payload: Vec<u8>,
}

pub type Hook = Box<dyn Fn(&Settlement<'_, Delivery>) + Send + Sync>;

pub fn reporter() -> (Hook, mpsc::UnboundedReceiver<Seen>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let hook = move |r: &Settlement<'_, Delivery>| {
        let _ = tx.send(Seen {
            key: r.key.map(|k| k.id().to_owned()),
            outcome: r.outcome.as_str(),
            verb: r.verb.clone(),
            redelivered: r.message.redelivered(),
            delays: r.message.delays(),
            payload: r.message.payload().to_vec(),
        });
    };
    (Box::new(hook), rx)
}

/// Collects reports until `done` holds over all of them, or panics after `limit`.
pub async fn wait_for(
    rx: &mut mpsc::UnboundedReceiver<Seen>,
    seen: &mut Vec<Seen>,
    limit: Duration,
    done: impl Fn(&[Seen]) -> bool,
) {
    let deadline = tokio::time::Instant::now() + limit;
    while !done(seen) {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(s)) => seen.push(s),
            Ok(None) => panic!("reporter closed; seen so far: {seen:#?}"),
            Err(_) => panic!("condition not reached within {limit:?}; seen: {seen:#?}"),
        }
    }
}

pub struct Broker {
    pub url: String,
    pub conn: Connection,
    pub ch: Channel,
    pub topology: Topology,
    cleaned: bool,
}

impl Drop for Broker {
    /// A failing test still deletes its queues: on a fresh connection, from a thread with a
    /// runtime of its own (the test's runtime may be unwinding).
    fn drop(&mut self) {
        if self.cleaned {
            return;
        }
        let (url, t) = (self.url.clone(), self.topology.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let Ok(conn) = Connection::connect(&url, ConnectionProperties::default()).await
                else {
                    return;
                };
                let Ok(ch) = conn.create_channel().await else { return };
                let mut queues = vec![t.queue().to_owned(), t.delay_queue().to_owned()];
                queues.extend(t.dead_letter_queue().map(str::to_owned));
                for q in queues {
                    let _ = ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
                }
                let _ = ch
                    .exchange_delete(
                        t.dead_letter_exchange().into(),
                        ExchangeDeleteOptions::default(),
                    )
                    .await;
                let _ = conn.close(200, "".into()).await;
            });
        })
        .join();
    }
}

impl Broker {
    /// A connection and a fresh work queue `idem-test-<tag>-<random>`.
    pub async fn new(tag: &str) -> Option<Self> {
        let url = url()?;
        let conn = Connection::connect(&url, ConnectionProperties::default()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        let queue = format!("idem-test-{tag}-{}", suffix());
        ch.queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::durable(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        Some(Self { url, conn, ch, topology: Topology::for_queue(queue), cleaned: false })
    }

    /// The broker of another process's `queue` (a crash test's child): never deletes it.
    pub async fn attach(queue: &str) -> Self {
        let url = url().expect("RabbitMQ");
        let conn = Connection::connect(&url, ConnectionProperties::default()).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        Self { url, conn, ch, topology: Topology::for_queue(queue), cleaned: true }
    }

    pub fn queue(&self) -> &str {
        self.topology.queue()
    }

    /// Publishes to the work queue and waits for the broker's confirm.
    pub async fn publish(&self, id: Option<&str>, body: &[u8], headers: &[(&str, &str)]) {
        let mut props = BasicProperties::default().with_delivery_mode(2);
        if let Some(id) = id {
            props = props.with_message_id(id.into());
        }
        if !headers.is_empty() {
            let mut h = FieldTable::default();
            for (k, v) in headers {
                h.insert((*k).into(), AMQPValue::LongString(LongString::from(*v)));
            }
            props = props.with_headers(h);
        }
        let confirm = self
            .ch
            .basic_publish(
                "".into(),
                self.queue().into(),
                BasicPublishOptions::default(),
                body,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack());
    }

    /// Ready messages in `queue` (passive declare on a channel of its own).
    pub async fn count(&self, queue: &str) -> u32 {
        let ch = self.conn.create_channel().await.unwrap();
        let q = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions { passive: true, ..QueueDeclareOptions::default() },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let _ = ch.close(200, "".into()).await;
        q.message_count()
    }

    /// Waits until `queue` holds `n` ready messages.
    pub async fn wait_count(&self, queue: &str, n: u32, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let c = self.count(queue).await;
            if c == n {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "{queue} has {c} messages, want {n}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Takes every message of the dead-letter queue: (message id, reason header, body).
    pub async fn drain_dlq(&self) -> Vec<(Option<String>, Option<String>, Vec<u8>)> {
        let mut out = Vec::new();
        let dlq = self.topology.dead_letter_queue().unwrap();
        while let Some(m) =
            self.ch.basic_get(dlq.into(), BasicGetOptions { no_ack: true }).await.unwrap()
        {
            let d = m.delivery;
            let reason = d.properties.headers().as_ref().and_then(|h| {
                h.inner().get(headers::REASON).and_then(|v| match v {
                    AMQPValue::LongString(s) => Some(s.to_string()),
                    _ => None,
                })
            });
            out.push((d.properties.message_id().as_ref().map(|s| s.to_string()), reason, d.data));
        }
        out
    }

    /// Takes every message of the dead-letter queue: (message id, its string headers — the
    /// shared `idem-*` names among them —, body).
    pub async fn drain_dlq_headers(
        &self,
    ) -> Vec<(Option<String>, HashMap<String, String>, Vec<u8>)> {
        let mut out = Vec::new();
        let dlq = self.topology.dead_letter_queue().unwrap();
        while let Some(m) =
            self.ch.basic_get(dlq.into(), BasicGetOptions { no_ack: true }).await.unwrap()
        {
            let d = m.delivery;
            let mut h = HashMap::new();
            for (k, v) in
                d.properties.headers().as_ref().map(|h| h.inner().clone()).unwrap_or_default()
            {
                if let AMQPValue::LongString(s) = v {
                    h.insert(k.to_string(), s.to_string());
                }
            }
            out.push((d.properties.message_id().as_ref().map(|s| s.to_string()), h, d.data));
        }
        out
    }

    /// Deletes the work queue and its companions.
    pub async fn cleanup(mut self) {
        self.cleaned = true;
        let t = &self.topology;
        let mut queues = vec![t.queue().to_owned(), t.delay_queue().to_owned()];
        queues.extend(t.dead_letter_queue().map(str::to_owned));
        for q in queues {
            let _ = self.ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
        }
        let _ = self
            .ch
            .exchange_delete(t.dead_letter_exchange().into(), ExchangeDeleteOptions::default())
            .await;
        let _ = self.conn.close(200, "".into()).await;
    }

    pub async fn connect(&self) -> Connection {
        Connection::connect(&self.url, ConnectionProperties::default()).await.unwrap()
    }
}

pub const PG_DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

#[allow(unused_imports)] // not every test file uses it
pub use pg::PgSchema;

mod pg {
    use idem_sqlx::PostgresStore;
    use sqlx::postgres::{PgPool, PgPoolOptions};

    use super::PG_DEFAULT_URL;

    /// A schema of the test's own on PostgreSQL, dropped on success and, from `Drop`, on failure.
    pub struct PgSchema {
        pub pool: PgPool,
        pub name: String,
        dropped: bool,
    }

    impl PgSchema {
        /// Connects, (re)creates schema `name` and migrates a `PostgresStore` into it.
        pub async fn create(url: &str, name: String) -> (Self, PostgresStore) {
            let pool = PgPoolOptions::new().max_connections(4).connect(url).await.unwrap();
            let this = Self { pool, name, dropped: false };
            this.exec(&format!("DROP SCHEMA IF EXISTS {} CASCADE", this.name)).await;
            let store = PostgresStore::new(this.pool.clone()).with_schema(&this.name).unwrap();
            store.migrate().await.unwrap();
            (this, store)
        }

        pub async fn exec(&self, sql: &str) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned())).execute(&self.pool).await.unwrap();
        }

        pub async fn drop_now(mut self) {
            self.exec(&format!("DROP SCHEMA {} CASCADE", self.name)).await;
            self.dropped = true;
        }
    }

    impl Drop for PgSchema {
        fn drop(&mut self) {
            if self.dropped {
                return;
            }
            let (url, name) = (
                std::env::var("IDEM_TEST_POSTGRES_URL")
                    .unwrap_or_else(|_| PG_DEFAULT_URL.to_owned()),
                self.name.clone(),
            );
            let _ = std::thread::spawn(move || {
                let rt =
                    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async move {
                    if let Ok(pool) = PgPoolOptions::new().max_connections(1).connect(&url).await {
                        let sql = format!("DROP SCHEMA IF EXISTS {name} CASCADE");
                        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&pool).await;
                    }
                });
            })
            .join();
        }
    }
}
