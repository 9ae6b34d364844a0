//! `idem relay` end to end on real servers: an outbox filled by the library, drained by the
//! binary into the broker, counted on both sides.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::process::{Command, Output};

use idem::outbox::{OutboxStore, Outgoing};

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem")).args(args).output().unwrap()
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

fn messages(dest: &str, n: usize) -> Vec<Outgoing> {
    (0..n).map(|i| Outgoing::new(dest, format!("m{i}")).header("k", "v")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_a_sqlite_outbox_into_a_redis_stream() {
    let Some(url) =
        idem_testkit::service::require("redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379")
    else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("app.sqlite");
    let store = idem::SqliteStore::open(&file).await.unwrap();
    let outbox = store.outbox();
    outbox.migrate().await.unwrap();
    let stream = format!("idem-cli-relay-{}", std::process::id());
    outbox.send(messages(&stream, 50)).await.unwrap();
    let path = file.to_str().unwrap();

    let stats = idem(&["relay", "--outbox", path, "--stats"]);
    assert!(text(&stats).contains("pending 50, sent 0, parked 0"), "{}", text(&stats));
    let run = idem(&["relay", "--outbox", path, "--to", &url, "--once"]);
    assert!(run.status.success(), "{}", text(&run));
    assert!(text(&run).contains("published 50"), "{}", text(&run));
    assert!(text(&run).contains("pending 0, sent 50, parked 0"), "{}", text(&run));

    let client = idem::redis::redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let len: u64 =
        idem::redis::redis::cmd("XLEN").arg(&stream).query_async(&mut conn).await.unwrap();
    let _: u64 = idem::redis::redis::cmd("DEL").arg(&stream).query_async(&mut conn).await.unwrap();
    assert_eq!(len, 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_a_postgres_outbox_into_rabbitmq() {
    let Some(pg) = idem_testkit::service::require(
        "postgres",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ) else {
        return;
    };
    let Some(amqp) = idem_testkit::service::require(
        "amqp",
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    ) else {
        return;
    };
    use idem::amqp::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
    use idem::amqp::lapin::types::FieldTable;
    let conn = idem::amqp::lapin::Connection::connect(&amqp, Default::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let queue = format!("idem-cli-relay-{}", std::process::id());
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::durable(), FieldTable::default())
        .await
        .unwrap();
    let schema = format!("idem_cli_relay_{}", std::process::id());
    let store = idem::PostgresStore::connect(&pg).await.unwrap().with_schema(&schema).unwrap();
    let outbox = store.outbox();
    outbox.migrate().await.unwrap();
    outbox.send(messages(&queue, 40)).await.unwrap();
    // One message to a queue that does not exist: returned by the broker, retried, not sent.
    outbox.send(messages("idem-cli-no-such-queue", 1)).await.unwrap();

    let run = idem(&["relay", "--outbox", &pg, "--schema", &schema, "--to", &amqp, "--once"]);
    assert!(run.status.success(), "{}", text(&run));
    assert!(text(&run).contains("published 40, retried 1"), "{}", text(&run));
    assert!(text(&run).contains("pending 1, sent 40, parked 0"), "{}", text(&run));
    let opts = QueueDeclareOptions { passive: true, ..QueueDeclareOptions::durable() };
    let q = ch.queue_declare(queue.as_str().into(), opts, FieldTable::default()).await.unwrap();
    assert_eq!(q.message_count(), 40);

    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    idem::sqlx::raw_sql(idem::sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(store.pool())
        .await
        .unwrap();
}

#[test]
fn relay_refuses_what_it_cannot_use() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("none.sqlite");
    let o = idem(&["relay", "--outbox", missing.to_str().unwrap(), "--stats"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("no database file"), "{}", text(&o));
    let o = idem(&["relay", "--outbox", "oracle://db", "--stats"]);
    assert!(
        text(&o).contains("unknown scheme") && text(&o).contains("postgres://"),
        "{}",
        text(&o)
    );
    let file = dir.path().join("a.sqlite");
    std::fs::File::create(&file).unwrap();
    let o = idem(&["relay", "--outbox", file.to_str().unwrap(), "--to", "ftp://x"]);
    assert!(text(&o).contains("--to ftp://x: unknown scheme"), "{}", text(&o));
    let o = idem(&["relay", "--outbox", file.to_str().unwrap()]);
    assert!(text(&o).contains("--to is required"), "{}", text(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_drains_a_wal_slot_into_nats() {
    let Some(pg) = idem_testkit::service::require(
        "postgres",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ) else {
        return;
    };
    let Some(nats) = idem_testkit::service::require_nats("IDEM_TEST_NATS_URL", "127.0.0.1:4222")
    else {
        return;
    };
    let pool = idem::sqlx::PgPool::connect(&pg).await.unwrap();
    let level: String = idem::sqlx::query_scalar("SHOW wal_level").fetch_one(&pool).await.unwrap();
    if level != "logical" {
        assert!(!idem_testkit::service::in_ci(), "wal_level is {level} and CI=true");
        eprintln!("skipped: PostgreSQL wal_level is {level}, the WAL outbox needs logical");
        return;
    }
    use idem::nats::async_nats::{self, jetstream};
    let js = jetstream::new(async_nats::connect(&nats).await.unwrap());
    let tag = format!("{}_{}", std::process::id(), rand::random::<u32>());
    let (slot, subject, stream) =
        (format!("idem_cli_wal_{tag}"), format!("cli.wal.{tag}"), format!("CLI_WAL_{tag}"));
    js.create_stream(jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .unwrap();
    let wal = idem::postgres::PostgresWalOutbox::new(pool)
        .with_slot_name(&slot)
        .unwrap()
        .with_prefix(&slot)
        .unwrap();
    let base = ["relay", "--outbox", &pg, "--wal-slot", &slot, "--wal-prefix", &slot];
    let with = |rest: &[&str]| idem(&[&base[..], rest].concat());
    let made = with(&["--create-slot"]);
    assert!(text(&made).contains("ready"), "{}", text(&made));
    wal.send(messages(&subject, 30)).await.unwrap();
    let stats = with(&["--stats"]);
    assert!(text(&stats).contains("lag "), "{}", text(&stats));
    let to = if nats.contains("://") { nats.clone() } else { format!("nats://{nats}") };
    let run = with(&["--to", &to, "--once"]);
    assert!(run.status.success(), "{}", text(&run));
    assert!(text(&run).contains("published 30"), "{}", text(&run));
    let info = js.get_stream(&stream).await.unwrap().info().await.unwrap().state.messages;
    assert_eq!(info, 30);
    let dropped = with(&["--drop-slot"]);
    assert!(text(&dropped).contains("dropped"), "{}", text(&dropped));
    assert_eq!(wal.lag_bytes().await.unwrap(), None);
    js.delete_stream(&stream).await.unwrap();
}
