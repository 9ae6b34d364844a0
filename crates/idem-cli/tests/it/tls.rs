//! The `idem` binary over TLS, against the TLS listeners of `.ci/services.sh`: the relay reads a
//! PostgreSQL outbox over verified TLS (`--tls-ca`) and publishes to `amqps://`, to
//! `kafka+ssl://`; `idem stats` reads a `rediss://` store; a wrong CA is refused; and `amqps://`
//! against RabbitMQ's plaintext port fails instead of publishing in plaintext.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::process::{Command, Output};

use idem::outbox::{OutboxStore, Outgoing};
use idem_testkit::tls::Pki;

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem")).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn messages(dest: &str, n: usize) -> Vec<Outgoing> {
    (0..n).map(|i| Outgoing::new(dest, format!("m{i}"))).collect()
}

fn pg_tls() -> Option<String> {
    idem_testkit::service::require(
        "postgres (TLS)",
        "IDEM_TEST_POSTGRES_TLS_URL",
        "postgres://postgres@localhost:5433/test",
    )
}

fn amqps() -> Option<String> {
    idem_testkit::service::require(
        "RabbitMQ (TLS)",
        "IDEM_TEST_AMQPS_URL",
        "amqps://guest:guest@localhost:5671/%2f",
    )
}

fn path(p: &std::path::Path) -> &str {
    p.to_str().unwrap()
}

/// A SQLite outbox holding `n` messages for `dest`, in `dir`.
async fn sqlite_outbox(dir: &std::path::Path, dest: &str, n: usize) -> std::path::PathBuf {
    let file = dir.join("app.sqlite");
    let store = idem::SqliteStore::open(&file).await.unwrap();
    let outbox = store.outbox();
    outbox.migrate().await.unwrap();
    outbox.send(messages(dest, n)).await.unwrap();
    file
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_reads_postgres_and_publishes_to_rabbitmq_over_verified_tls() {
    let (Some(pg), Some(amqps), Some(pki)) = (pg_tls(), amqps(), Pki::require()) else { return };
    let Some(admin) = idem_testkit::service::require(
        "RabbitMQ",
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    ) else {
        return;
    };
    use idem::amqp::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use idem::amqp::lapin::types::FieldTable;
    let conn = idem::amqp::lapin::Connection::connect(&admin, Default::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let queue = format!("idem-cli-tls-{}", std::process::id());
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await
        .unwrap();
    // The outbox, written by the library over verified TLS.
    let schema = format!("idem_cli_tls_{}", std::process::id());
    let verified = format!("{pg}?sslmode=verify-full&sslrootcert={}", path(&pki.ca()));
    let store =
        idem::PostgresStore::connect(&verified).await.unwrap().with_schema(&schema).unwrap();
    let outbox = store.outbox();
    outbox.migrate().await.unwrap();
    outbox.send(messages(&queue, 10)).await.unwrap();

    // The binary: no TLS setting in either URL; --tls-ca makes PostgreSQL verify-full.
    let ca = pki.ca();
    let run = idem(&[
        "relay",
        "--outbox",
        &pg,
        "--schema",
        &schema,
        "--to",
        &amqps,
        "--tls-ca",
        path(&ca),
        "--once",
    ]);
    assert!(run.status.success(), "{}", text(&run));
    assert!(text(&run).contains("published 10"), "{}", text(&run));
    let opts = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::durable() };
    let q = ch.queue_declare(queue.as_str().into(), opts, FieldTable::default()).await.unwrap();
    assert_eq!(q.message_count(), 10);

    // The same through IDEM_TLS_CA, and a wrong CA refused by PostgreSQL and RabbitMQ alike.
    let wrong = pki.wrong_ca();
    let o =
        idem(&["relay", "--outbox", &pg, "--schema", &schema, "--stats", "--tls-ca", path(&wrong)]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("UnknownIssuer"), "{}", text(&o));
    let o = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["relay", "--outbox", &pg, "--schema", &schema, "--stats"])
        .env("IDEM_TLS_CA", path(&ca))
        .output()
        .unwrap();
    assert!(text(&o).contains("pending 0, sent 10, parked 0"), "{}", text(&o));

    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    idem::sqlx::raw_sql(idem::sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(store.pool())
        .await
        .unwrap();
}

/// TLS asked of a plaintext port, on every backend the local services offer: the error names the
/// failed handshake and asks whether this is the plaintext port, above the client's own error.
#[test]
fn tls_to_a_plaintext_port_says_so_on_every_backend() {
    let mut cases: Vec<Vec<String>> = Vec::new();
    let v = |args: &[&str]| args.iter().map(|a| (*a).to_owned()).collect::<Vec<_>>();
    if idem_testkit::service::require(
        "postgres",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://127.0.0.1:5432",
    )
    .is_some()
    {
        cases.push(v(&[
            "stats",
            "--store",
            "postgres://postgres@127.0.0.1:5432/test?sslmode=require",
        ]));
    }
    if idem_testkit::service::require("mariadb", "IDEM_TEST_MYSQL_URL", "mysql://127.0.0.1:3306")
        .is_some()
    {
        cases.push(v(&["stats", "--store", "mysql://root@127.0.0.1:3306/test?ssl-mode=REQUIRED"]));
    }
    if idem_testkit::service::require("redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379")
        .is_some()
    {
        cases.push(v(&["stats", "--store", "rediss://127.0.0.1:6379"]));
    }
    if idem_testkit::service::require("RabbitMQ", "IDEM_TEST_AMQP_URL", "amqp://127.0.0.1:5672")
        .is_some()
    {
        cases.push(v(&[
            "dlq",
            "list",
            "--broker",
            "amqps://guest:guest@127.0.0.1:5672/%2f",
            "--queue",
            "q",
        ]));
    }
    if idem_testkit::service::require("nats", "IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222")
        .is_some()
    {
        cases.push(v(&["dlq", "list", "--broker", "tls://127.0.0.1:4222", "--queue", "q"]));
    }
    for args in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = idem(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(text(&o).contains("is this its plaintext port?"), "{args:?}: {}", text(&o));
    }
}

/// The regression: `idem relay --to amqps://…` published over plaintext when lapin had no TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_to_the_plaintext_port_fails_and_publishes_nothing() {
    let Some(plain) = idem_testkit::service::require(
        "RabbitMQ",
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = sqlite_outbox(dir.path(), "idem-cli-tls-never", 1).await;
    let amqps_on_plain_port = plain.replacen("amqp://", "amqps://", 1);
    let o = idem(&["relay", "--outbox", path(&file), "--to", &amqps_on_plain_port, "--once"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("cannot connect to RabbitMQ"), "{}", text(&o));
    assert!(!text(&o).contains("published"), "{}", text(&o));
}

#[test]
fn stats_reads_a_rediss_store_with_our_ca_and_refuses_a_wrong_one() {
    let Some(url) = idem_testkit::service::require(
        "redis (TLS)",
        "IDEM_TEST_REDIS_TLS_URL",
        "rediss://localhost:6380/",
    ) else {
        return;
    };
    let Some(pki) = Pki::require() else { return };
    let ns = format!("idem-cli-tls-{}", std::process::id());
    let (ca, wrong) = (pki.ca(), pki.wrong_ca());
    let o = idem(&["stats", "--store", &url, "--prefix", &ns, "--tls-ca", path(&ca)]);
    assert!(o.status.success(), "{}", text(&o));
    let o = idem(&["stats", "--store", &url, "--prefix", &ns, "--tls-ca", path(&wrong)]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("UnknownIssuer"), "{}", text(&o));
}

#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_to_kafka_over_tls() {
    use idem::kafka::rdkafka::ClientConfig;
    use idem::kafka::rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use idem::kafka::rdkafka::client::DefaultClientContext;
    let Some(brokers) = idem_testkit::service::require(
        "Kafka (TLS)",
        "IDEM_TEST_KAFKA_TLS_BROKERS",
        "localhost:9093",
    ) else {
        return;
    };
    let Some(pki) = Pki::require() else { return };
    let ca = pki.ca();
    let topic = format!("idem-cli-tls-{}", std::process::id());
    let mut admin = ClientConfig::new();
    admin
        .set("bootstrap.servers", &brokers)
        .set("security.protocol", "SSL")
        .set("ssl.ca.location", path(&ca));
    let admin: AdminClient<DefaultClientContext> = admin.create().unwrap();
    let opts = AdminOptions::new().operation_timeout(Some(std::time::Duration::from_secs(10)));
    let new = NewTopic::new(&topic, 1, TopicReplication::Fixed(1));
    for r in admin.create_topics(&[new], &opts).await.unwrap() {
        r.unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let file = sqlite_outbox(dir.path(), &topic, 5).await;
    let to = format!("kafka+ssl://{brokers}");
    let o = idem(&["relay", "--outbox", path(&file), "--to", &to, "--tls-ca", path(&ca), "--once"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("published 5"), "{}", text(&o));
    let wrong = pki.wrong_ca();
    let o =
        idem(&["relay", "--outbox", path(&file), "--to", &to, "--tls-ca", path(&wrong), "--once"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}
