//! The outbox end to end, under SIGKILL: queue A → consumer 1 (PostgreSQL inbox + order row +
//! outbox message, one transaction) → relay → queue B → consumer 2 (its own inbox) → ledger.
//!
//! 10,000 unique orders plus 2,000 duplicates (20 %) go into A. Two consumer-1 processes, two
//! relays and one consumer-2 process run as children of the test; every 150–600 ms one of them,
//! picked at random, is killed with SIGKILL and started again, until the ledger is complete.
//! Then the survivors are stopped gracefully and the test checks: every order stored once,
//! every ledger entry once, every outbox row sent (none pending, none parked), both queues
//! drained. On RabbitMQ and on NATS JetStream, with the outbox table and with the WAL outbox
//! (`pg_logical_emit_message`, read from a replication slot by two relays, one a standby).
#![cfg(all(feature = "amqp", feature = "nats", feature = "postgres"))]
#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed setup step is the test failing

use std::future::Future;
use std::time::Duration;

use idem::engine::HandlerError;
use idem::extract::Envelope;
use idem::outbox::{OutboxMessage, OutboxStore, Outgoing, Publisher, Relay};
use idem::sqlx::{self, AssertSqlSafe};
use idem::{PostgresStore, Tx};
use idem_testkit::process::{child_entry, spawn_child, stdin_closed};
use rand::Rng;
use tokio::io::AsyncBufReadExt;

const UNIQUE: usize = 10_000;
const DUPLICATES: usize = 2_000;
const SPEC: &str = "IDEM_CHAIN_SPEC";
const WEEK: Duration = Duration::from_secs(7 * 86_400);

type HandlerFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<(), HandlerError<String>>> + Send>>;

fn pg_url() -> Option<String> {
    idem_testkit::service::require(
        "postgres",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
}

/// What a child runs: `<broker> <role> <pg url> <schema> <A> <B> <outbox>`, the outbox being
/// `table` or `wal`.
struct Spec {
    broker: String,
    outbox: String,
    role: String,
    pg: String,
    schema: String,
    a: String,
    b: String,
}

impl Spec {
    fn parse(s: &str) -> Self {
        let p: Vec<&str> = s.split(' ').collect();
        let own = |i: usize| p[i].to_owned();
        let (broker, outbox) = (own(0), own(6));
        Self { broker, role: own(1), pg: own(2), schema: own(3), a: own(4), b: own(5), outbox }
    }

    fn line(&self, role: &str) -> String {
        let (pg, s, a, b, o) = (&self.pg, &self.schema, &self.a, &self.b, &self.outbox);
        format!("{} {role} {pg} {s} {a} {b} {o}", self.broker)
    }

    /// The WAL outbox (slot and prefix named after the schema), when the chain uses it.
    fn wal(&self, store: &PostgresStore) -> Option<idem::postgres::PostgresWalOutbox> {
        (self.outbox == "wal").then(|| {
            let wal = store.wal_outbox().with_slot_name(&self.schema).unwrap();
            wal.with_prefix(&self.schema).unwrap()
        })
    }
}

/// The two stores: consumer 1's inbox table beside the outbox, consumer 2's inbox table.
async fn stores(spec: &Spec) -> (PostgresStore, PostgresStore) {
    let pool =
        sqlx::postgres::PgPoolOptions::new().max_connections(6).connect(&spec.pg).await.unwrap();
    let one = PostgresStore::new(pool.clone()).with_schema(&spec.schema).unwrap();
    let two = one.clone().with_table_name("c2_records").unwrap();
    (one, two)
}

/// Consumer 1: stores the order and enqueues its `accepted` message for B, in the inbox's
/// transaction.
fn order_writer<M: Envelope>(
    spec: &Spec,
    store: &PostgresStore,
) -> impl Fn(Tx<idem::PostgresInbox>, M) -> HandlerFuture + Sync {
    let insert = format!("INSERT INTO \"{}\".orders (id) VALUES ($1)", spec.schema);
    let (outbox, wal, dest) = (store.outbox(), spec.wal(store), spec.b.clone());
    move |mut tx, m| {
        let (insert, outbox, dest) = (insert.clone(), outbox.clone(), dest.clone());
        let wal = wal.clone();
        let id = m.message_id().unwrap_or_default().to_owned();
        Box::pin(async move {
            let fail = |e: String| HandlerError::Transient(e);
            sqlx::query(AssertSqlSafe(insert))
                .bind(&id)
                .execute(&mut *tx)
                .await
                .map_err(|e| fail(e.to_string()))?;
            let msg = Outgoing::new(dest, id);
            match wal {
                Some(wal) => wal.enqueue(&mut tx, msg).await,
                None => outbox.enqueue(&mut tx, msg).await,
            }
            .map_err(|e| fail(e.to_string()))?;
            Ok(())
        })
    }
}

/// Consumer 2: one ledger row per delivery it processes (no dedup of its own: a second row for
/// an order is a duplicated effect).
fn ledger_writer<M: Envelope>(
    spec: &Spec,
) -> impl Fn(Tx<idem::PostgresInbox>, M) -> HandlerFuture + Sync {
    let insert = format!("INSERT INTO \"{}\".ledger (order_id) VALUES ($1)", spec.schema);
    move |mut tx, m| {
        let insert = insert.clone();
        let order = String::from_utf8_lossy(m.payload()).into_owned();
        Box::pin(async move {
            sqlx::query(AssertSqlSafe(insert))
                .bind(order)
                .execute(&mut *tx)
                .await
                .map_err(|e| HandlerError::Transient(e.to_string()))?;
            Ok(())
        })
    }
}

async fn run_relay<P: Publisher>(spec: &Spec, store: &PostgresStore, publisher: P) {
    if let Some(wal) = spec.wal(store) {
        let relay = idem::postgres::WalRelay::builder(wal, publisher)
            .publish_timeout(Duration::from_secs(2))
            .poll_interval(Duration::from_millis(50))
            .build()
            .unwrap();
        println!("ready");
        relay.run(stdin_closed()).await.unwrap();
        return;
    }
    let relay = Relay::builder(store.outbox(), publisher)
        .batch(128)
        .lease(Duration::from_secs(3))
        .publish_timeout(Duration::from_secs(2))
        .poll_interval(Duration::from_millis(200))
        .build()
        .unwrap();
    println!("ready");
    relay.run(stdin_closed()).await.unwrap();
}

/// Runs consumer 1 or 2 on its queue until stdin closes.
async fn consume<C: idem::consumer::SourceConfig>(
    config: C,
    role: &str,
    spec: &Spec,
    store: &PostgresStore,
) {
    let consumer = idem::Consumer::builder(config)
        .inbox(store.inbox(WEEK))
        .scope(role)
        .batch(32)
        .idle_wait(Duration::from_millis(50))
        .build()
        .await
        .unwrap();
    println!("ready");
    let ended = if role == "consumer1" {
        consumer.run(order_writer(spec, store), stdin_closed()).await
    } else {
        consumer.run(ledger_writer(spec), stdin_closed()).await
    };
    ended.unwrap();
}

/// The child process: one role of the chain, until its stdin closes or it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child process of the outbox chain tests"]
async fn chain_child() {
    let spec = Spec::parse(&std::env::var(SPEC).expect("run by the chain tests"));
    let (one, two) = stores(&spec).await;
    match spec.broker.as_str() {
        "amqp" => amqp::child(&spec, &one, &two).await,
        "nats" => nats::child(&spec, &one, &two).await,
        other => panic!("unknown broker {other}"),
    }
}

async fn count(pool: &sqlx::PgPool, sql: String) -> (i64, i64) {
    sqlx::query_as(AssertSqlSafe(sql)).fetch_one(pool).await.unwrap()
}

/// The parent: sets up, feeds A, runs and kills the children, then checks the effects.
async fn chain<B: Broker>(broker: B, name: &str, outbox: &str) {
    let Some(pg) = pg_url() else { return };
    if outbox == "wal" && !logical(&pg).await {
        return;
    }
    let Some(broker) = broker.connect().await else { return };
    let tag = format!("{}_{}", std::process::id(), rand::rng().random::<u32>());
    let spec = Spec {
        broker: name.to_owned(),
        outbox: outbox.to_owned(),
        role: String::new(),
        pg: pg.clone(),
        schema: format!("idem_chain_{tag}"),
        a: format!("chain.{tag}.a"),
        b: format!("chain.{tag}.b"),
    };
    let (one, two) = stores(&spec).await;
    one.migrate().await.unwrap();
    two.migrate().await.unwrap();
    one.outbox().migrate().await.unwrap();
    let wal = spec.wal(&one);
    if let Some(wal) = &wal {
        wal.create_slot().await.unwrap();
    }
    let pool = one.pool().clone();
    let s = &spec.schema;
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE \"{s}\".orders (id TEXT NOT NULL); CREATE TABLE \"{s}\".ledger (order_id TEXT NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    broker.create(&spec).await;

    let ids = idem_testkit::workload::ids_with_duplicates("order", UNIQUE, DUPLICATES);
    let messages: Vec<OutboxMessage> = ids
        .iter()
        .map(|id| {
            Outgoing::new(spec.a.clone(), id.clone()).id(idem::outbox::OutboxId::new(id).unwrap())
        })
        .map(|m| m.into_message(idem::outbox::OutboxId::random))
        .collect();
    for chunk in messages.chunks(500) {
        for r in broker.publisher().await.publish(chunk).await {
            r.expect("input published");
        }
    }

    let roles = ["consumer1", "consumer1", "relay", "relay", "consumer2"];
    let start = |role: &str| {
        let mut child =
            spawn_child(&child_entry(module_path!(), "chain_child"), &[(SPEC, &spec.line(role))]);
        let out = child.stdout.take().unwrap();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(out).lines();
            while let Ok(Some(l)) = lines.next_line().await {
                if l.contains("panicked") || l.contains("error") {
                    eprintln!("child: {l}");
                }
            }
        });
        child
    };
    let mut children: Vec<_> = roles.iter().map(|r| start(r)).collect();
    let ledger = format!("SELECT count(*), count(DISTINCT order_id) FROM \"{s}\".ledger");
    let orders = format!("SELECT count(*), count(DISTINCT id) FROM \"{s}\".orders");
    let mut kills = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    loop {
        let pause = rand::rng().random_range(150..600);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let (_, distinct) = count(&pool, ledger.clone()).await;
        if distinct >= UNIQUE as i64 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the chain stalled at {distinct} orders after {kills} kills"
        );
        for (c, role) in children.iter_mut().zip(roles) {
            if let Some(status) = c.try_wait().unwrap() {
                panic!("a {role} process ended by itself ({status}); see its output above");
            }
        }
        let victim = rand::rng().random_range(0..children.len());
        children[victim].kill().await.unwrap(); // SIGKILL
        kills += 1;
        children[victim] = start(roles[victim]);
    }
    // Complete: let the survivors finish what they hold, then stop them gracefully.
    let outbox = one.outbox();
    // (The WAL outbox has no rows: the ledger and the drained queues below say it all.)
    idem_testkit::wait_for("every outbox row sent", Duration::from_secs(60), || async {
        let c = outbox.counts().await.unwrap();
        c.pending == 0
    })
    .await;
    idem_testkit::wait_for("both queues drained", Duration::from_secs(60), || async {
        broker.backlog(&spec).await == (0, 0)
    })
    .await;
    for mut c in children {
        drop(c.stdin.take());
        let status = tokio::time::timeout(Duration::from_secs(30), c.wait())
            .await
            .expect("a child stops when asked")
            .unwrap();
        assert!(status.success(), "a child failed while stopping: {status}");
    }
    assert!(kills >= 5, "only {kills} kills happened: the chain ran too fast to test crashes");
    assert_eq!(
        count(&pool, orders).await,
        (UNIQUE as i64, UNIQUE as i64),
        "orders stored once each"
    );
    assert_eq!(
        count(&pool, ledger).await,
        (UNIQUE as i64, UNIQUE as i64),
        "downstream effect once per order"
    );
    let c = outbox.counts().await.unwrap();
    let rows = if wal.is_some() { 0 } else { UNIQUE as u64 };
    assert_eq!((c.pending, c.parked, c.sent), (0, 0, rows), "one outbox row per order, all sent");
    assert_eq!(broker.backlog(&spec).await, (0, 0), "both queues drained");
    println!(
        "{name} ({} outbox): {UNIQUE} orders + {DUPLICATES} duplicates through the chain, {kills} SIGKILLs",
        spec.outbox
    );
    broker.delete(&spec).await;
    if let Some(wal) = &wal {
        wal.drop_slot().await.unwrap();
    }
    sqlx::raw_sql(AssertSqlSafe(format!("DROP SCHEMA \"{s}\" CASCADE")))
        .execute(&pool)
        .await
        .unwrap();
}

/// What the chain needs from a broker.
trait Broker: Sized {
    type Publisher: Publisher;
    fn connect(self) -> impl Future<Output = Option<Self>>;
    fn create(&self, spec: &Spec) -> impl Future<Output = ()>;
    fn publisher(&self) -> impl Future<Output = Self::Publisher>;
    /// Messages of A and of B not yet acknowledged.
    fn backlog(&self, spec: &Spec) -> impl Future<Output = (u64, u64)>;
    fn delete(&self, spec: &Spec) -> impl Future<Output = ()>;
}

mod amqp {
    use super::*;
    use idem::amqp::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use idem::amqp::lapin::types::FieldTable;
    use idem::amqp::lapin::{Connection, ConnectionProperties};
    use idem::amqp::{AmqpConfig, AmqpPublisher};

    fn url() -> Option<String> {
        idem_testkit::service::require(
            "amqp",
            "IDEM_TEST_AMQP_URL",
            "amqp://guest:guest@127.0.0.1:5672/%2f",
        )
    }

    pub(super) struct Rabbit(Option<Connection>);

    impl Rabbit {
        pub(super) fn new() -> Self {
            Self(None)
        }

        fn conn(&self) -> &Connection {
            self.0.as_ref().unwrap()
        }
    }

    impl Broker for Rabbit {
        type Publisher = AmqpPublisher;

        async fn connect(self) -> Option<Self> {
            let url = url()?;
            Some(Self(Some(
                Connection::connect(&url, ConnectionProperties::default()).await.unwrap(),
            )))
        }

        async fn create(&self, spec: &Spec) {
            let ch = self.conn().create_channel().await.unwrap();
            for q in [&spec.a, &spec.b] {
                ch.queue_declare(
                    q.as_str().into(),
                    QueueDeclareOptions::durable(),
                    FieldTable::default(),
                )
                .await
                .unwrap();
            }
        }

        async fn publisher(&self) -> AmqpPublisher {
            AmqpPublisher::new(self.conn().create_channel().await.unwrap()).await.unwrap()
        }

        async fn backlog(&self, spec: &Spec) -> (u64, u64) {
            let ch = self.conn().create_channel().await.unwrap();
            let mut n = [0u64; 2];
            for (i, q) in [&spec.a, &spec.b].into_iter().enumerate() {
                let opts = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::durable() };
                let info =
                    ch.queue_declare(q.as_str().into(), opts, FieldTable::default()).await.unwrap();
                n[i] = u64::from(info.message_count());
            }
            (n[0], n[1])
        }

        async fn delete(&self, spec: &Spec) {
            let ch = self.conn().create_channel().await.unwrap();
            for q in [&spec.a, &spec.b] {
                let _ = ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
            }
        }
    }

    pub(super) async fn child(spec: &Spec, one: &PostgresStore, two: &PostgresStore) {
        let conn =
            Connection::connect(&url().unwrap(), ConnectionProperties::default()).await.unwrap();
        match spec.role.as_str() {
            "relay" => {
                run_relay(
                    spec,
                    one,
                    AmqpPublisher::new(conn.create_channel().await.unwrap()).await.unwrap(),
                )
                .await
            }
            role => {
                let (queue, store) =
                    if role == "consumer1" { (&spec.a, one) } else { (&spec.b, two) };
                consume(AmqpConfig::new(&conn, queue.as_str()), role, spec, store).await;
            }
        }
    }
}

mod nats {
    use super::*;
    use idem::nats::async_nats::{self, jetstream};
    use idem::nats::{JetStreamConfig, JetStreamPublisher};

    fn url() -> Option<String> {
        idem_testkit::service::require_nats("IDEM_TEST_NATS_URL", "127.0.0.1:4222")
    }

    fn stream(subject: &str) -> String {
        subject.replace('.', "_").to_uppercase()
    }

    pub(super) struct Nats(Option<jetstream::Context>);

    impl Nats {
        pub(super) fn new() -> Self {
            Self(None)
        }

        fn js(&self) -> &jetstream::Context {
            self.0.as_ref().unwrap()
        }
    }

    impl Broker for Nats {
        type Publisher = JetStreamPublisher;

        async fn connect(self) -> Option<Self> {
            let url = url()?;
            Some(Self(Some(jetstream::new(async_nats::connect(&url).await.unwrap()))))
        }

        async fn create(&self, spec: &Spec) {
            for (subject, durable) in [(&spec.a, "consumer1"), (&spec.b, "consumer2")] {
                let s = self
                    .js()
                    .create_stream(jetstream::stream::Config {
                        name: stream(subject),
                        subjects: vec![subject.clone(), format!("{subject}.dlq")],
                        // JetStream's own dedup window would hide the relay's re-publishes;
                        // keep it short so that idem's dedup is what the test exercises.
                        duplicate_window: Duration::from_millis(100),
                        // A bounded age: the consumer refuses a stream that keeps messages
                        // for ever.
                        max_age: Duration::from_secs(3600),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                s.create_consumer(jetstream::consumer::pull::Config {
                    durable_name: Some(durable.to_owned()),
                    filter_subject: subject.clone(),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: Duration::from_secs(3),
                    max_deliver: 50,
                    ..Default::default()
                })
                .await
                .unwrap();
            }
        }

        async fn publisher(&self) -> JetStreamPublisher {
            JetStreamPublisher::new(self.js().clone())
        }

        async fn backlog(&self, spec: &Spec) -> (u64, u64) {
            let mut n = [0u64; 2];
            for (i, (subject, durable)) in
                [(&spec.a, "consumer1"), (&spec.b, "consumer2")].into_iter().enumerate()
            {
                let mut c: jetstream::consumer::PullConsumer =
                    self.js().get_consumer_from_stream(durable, &stream(subject)).await.unwrap();
                let info = c.info().await.unwrap();
                n[i] = info.num_pending + info.num_ack_pending as u64;
            }
            (n[0], n[1])
        }

        async fn delete(&self, spec: &Spec) {
            for subject in [&spec.a, &spec.b] {
                let _ = self.js().delete_stream(stream(subject)).await;
            }
        }
    }

    pub(super) async fn child(spec: &Spec, one: &PostgresStore, two: &PostgresStore) {
        let js = jetstream::new(async_nats::connect(&url().unwrap()).await.unwrap());
        match spec.role.as_str() {
            "relay" => run_relay(spec, one, JetStreamPublisher::new(js)).await,
            role => {
                let (subject, store) =
                    if role == "consumer1" { (&spec.a, one) } else { (&spec.b, two) };
                let pull = js.get_consumer_from_stream(role, &stream(subject)).await.unwrap();
                let source = JetStreamConfig::new(js.clone(), pull, format!("{subject}.dlq"));
                consume(source, role, spec, store).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_on_rabbitmq_survives_sigkill() {
    chain(amqp::Rabbit::new(), "amqp", "table").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_on_nats_survives_sigkill() {
    chain(nats::Nats::new(), "nats", "table").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_chain_on_rabbitmq_survives_sigkill() {
    chain(amqp::Rabbit::new(), "amqp", "wal").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_chain_on_nats_survives_sigkill() {
    chain(nats::Nats::new(), "nats", "wal").await;
}

/// Whether PostgreSQL decodes logically; prints a skip when not (a failure under `CI=true`).
async fn logical(pg: &str) -> bool {
    let pool = sqlx::PgPool::connect(pg).await.unwrap();
    let level: String = sqlx::query_scalar("SHOW wal_level").fetch_one(&pool).await.unwrap();
    if level != "logical" {
        assert!(!idem_testkit::service::in_ci(), "wal_level is {level} and CI=true");
        eprintln!("skipped: PostgreSQL wal_level is {level}, the WAL outbox needs logical");
    }
    level == "logical"
}
