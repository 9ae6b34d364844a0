//! Messages/s end to end through the AMQP 1.0 source on RabbitMQ's AMQP 1.0 plugin, beside a
//! bare fe2o3-amqp loop (same credit, same batches, dispositions of a batch sent together, no
//! dedup), measured in one run.
//!
//! `cargo run --release -p idem-amqp10 --example amqp10_bench -- [messages] [batch]`
//!
//! For each mode a fresh queue is filled with N unique messages (publishing is not timed), then
//! the clock runs until every message is settled (the close is timed apart). The handler does nothing, so the figures are
//! the price of the broker round trips and of idempotency. Broker: `IDEM_TEST_AMQP10_URL`
//! (default `amqp://guest:guest@127.0.0.1:5672`; queues declared and deleted over AMQP 0-9-1 at
//! `IDEM_TEST_AMQP_URL`); PostgreSQL: `IDEM_TEST_POSTGRES_URL`, in a schema of its own dropped
//! at the end.

use std::time::{Duration, Instant};

use fe2o3_amqp::link::receiver::CreditMode;
use fe2o3_amqp::types::messaging::{Body, Data, Message, MessageId, Properties};
use fe2o3_amqp::types::primitives::{Binary, Value};
use fe2o3_amqp::{Connection, Receiver, Sender, Session};
use idem_amqp10::{Amqp10Config, Amqp10Consumer, fe2o3_amqp};
use idem_core::consumer::Builder;
use idem_core::engine::HandlerError;
use idem_core::{Backend, MemoryStore};
use idem_sqlx::{PostgresStore, SqliteStore};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

const DAY: Duration = Duration::from_secs(86_400);

#[tokio::main]
async fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(10_000);
    let batch: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(64);
    let url = std::env::var("IDEM_TEST_AMQP10_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".to_owned());
    let admin_url = std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
    let admin =
        lapin::Connection::connect(&admin_url, lapin::ConnectionProperties::default()).await?;
    let ch = admin.create_channel().await?;
    let pg_url = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let sfx = format!("{:08x}", rand::random::<u32>());
    let schema = format!("amqp10_bench_{sfx}");
    let pg = PostgresStore::connect(&pg_url).await?.with_schema(&schema)?;
    pg.migrate().await?;
    let dir = tempfile::tempdir()?;
    let credit = u32::try_from(2 * batch)?;
    println!("RabbitMQ AMQP 1.0; {n} messages, batch {batch}, credit {credit}");

    for mode in [
        "accept-only",
        "two-phase MemoryStore",
        "two-phase PostgresStore",
        "inbox PostgreSQL",
        "inbox SQLite",
        "accept-only",
    ] {
        let queue = format!("idem-amqp10-bench-{sfx}-{}", rand::random::<u32>());
        let durable = lapin::options::QueueDeclareOptions::durable();
        ch.queue_declare(queue.as_str().into(), durable, lapin::types::FieldTable::default())
            .await?;
        fill(&url, &queue, n).await?;
        let address = format!("/amq/queue/{queue}");
        let config = Amqp10Config::new(url.clone(), address.clone()).prefetch(credit);
        let (elapsed, closing) = match mode {
            "accept-only" => bare(&url, &address, n, batch, credit).await?,
            "two-phase MemoryStore" => {
                drive(Amqp10Consumer::builder(config).store(MemoryStore::new()), n, batch).await?
            }
            "two-phase PostgresStore" => {
                drive(Amqp10Consumer::builder(config).store(pg.clone()), n, batch).await?
            }
            "inbox PostgreSQL" => {
                drive(Amqp10Consumer::builder(config).inbox(pg.inbox(DAY)), n, batch).await?
            }
            _ => {
                let sqlite = SqliteStore::open(dir.path().join(format!("{queue}.sqlite"))).await?;
                drive(Amqp10Consumer::builder(config).inbox(sqlite.inbox(DAY)), n, batch).await?
            }
        };
        let secs = elapsed.as_secs_f64();
        println!(
            "{mode:<26} {:>9.0} msgs/s  ({secs:.2} s; close {:.0} ms)",
            n as f64 / secs,
            closing.as_secs_f64() * 1e3
        );
        ch.queue_delete(queue.as_str().into(), lapin::options::QueueDeleteOptions::default())
            .await?;
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(pg.pool())
        .await?;
    Ok(())
}

/// Publishes `n` unique messages, waiting for every `accepted`.
async fn fill(url: &str, queue: &str, n: usize) -> Result<()> {
    let mut connection = Connection::open(format!("{queue}-producer"), url).await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut sender =
        Sender::attach(&mut session, "producer", format!("/amq/queue/{queue}")).await?;
    let mut pending = Vec::with_capacity(1024);
    for i in 0..n {
        let message = Message {
            header: None,
            delivery_annotations: None,
            message_annotations: None,
            properties: Some(Properties {
                message_id: Some(MessageId::String(format!("m-{i}"))),
                ..Properties::default()
            }),
            application_properties: None,
            body: Body::<Value>::Data(
                vec![Data(Binary::from(format!(r#"{{"order":{i}}}"#).into_bytes()))].into(),
            ),
            footer: None,
        };
        pending.push(sender.send_batchable(message).await?);
        if pending.len() == 1024 {
            for p in pending.drain(..) {
                p.await?;
            }
        }
    }
    for p in pending {
        p.await?;
    }
    drop(sender); // RabbitMQ answers a closing detach without closed=true: do not wait on it
    let _ = tokio::time::timeout(Duration::from_secs(2), connection.close()).await;
    Ok(())
}

/// The bare loop (timed from the attach to the last disposition; the close is timed apart):
/// receive up to `batch` (2 ms batch wait, as the source), accept them together;
/// credit granted as the source grants it (once the last grant is used up, topping the
/// unsettled back up to the window: fe2o3's automatic credit overran RabbitMQ's link).
async fn bare(
    url: &str,
    address: &str,
    n: usize,
    batch: usize,
    credit: u32,
) -> Result<(Duration, Duration)> {
    let started = Instant::now();
    // As the source connects: TCP_NODELAY, or Nagle and delayed ACKs stall each credit round trip
    // by ~40 ms.
    let parsed = url::Url::parse(url)?;
    let tcp = tokio::net::TcpStream::connect((
        parsed.host_str().unwrap_or("127.0.0.1"),
        parsed.port().unwrap_or(5672),
    ))
    .await?;
    tcp.set_nodelay(true)?;
    let mut connection = Connection::builder()
        .container_id(format!("bare-{}", rand::random::<u32>()))
        .sasl_profile(fe2o3_amqp::sasl_profile::SaslProfile::Plain {
            username: parsed.username().to_owned(),
            password: parsed.password().unwrap_or_default().to_owned(),
        })
        .open_with_stream(tcp)
        .await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut rx = Receiver::builder()
        .name("bare")
        .source(address.to_owned())
        .credit_mode(CreditMode::Manual)
        .auto_accept(false)
        .attach(&mut session)
        .await?;
    rx.set_credit(credit).await?;
    let mut left = credit;
    let mut done = 0;
    while done < n {
        let mut infos = Vec::with_capacity(batch);
        let first = rx.recv::<Body<Value>>().await?;
        infos.push(fe2o3_amqp::link::delivery::DeliveryInfo::from(first));
        while infos.len() < batch {
            match tokio::time::timeout(Duration::from_millis(2), rx.recv::<Body<Value>>()).await {
                Ok(d) => infos.push(d?.into()),
                Err(_) => break,
            }
        }
        left -= u32::try_from(infos.len())?;
        done += infos.len();
        rx.accept_all(infos).await?;
        if left == 0 {
            rx.set_credit(credit).await?; // nothing is unsettled after accept_all
            left = credit;
        }
    }
    let elapsed = started.elapsed();
    let closing = Instant::now();
    let _ = tokio::time::timeout(Duration::from_secs(10), connection.close()).await;
    Ok((elapsed, closing.elapsed()))
}

/// The source on the shared consumer, polled batch by batch until `n` messages are settled
/// (timed from the build; the close is timed apart).
async fn drive<B: Backend + 'static>(
    builder: Builder<Amqp10Config, B>,
    n: usize,
    batch: usize,
) -> Result<(Duration, Duration)>
where
    B::Ctx: Send,
{
    let started = Instant::now();
    let consumer = builder.scope("bench").batch(batch).build().await?;
    let mut acked = 0;
    while acked < n as u64 {
        acked += consumer.poll(|_, _| async { Ok::<_, HandlerError<String>>(()) }).await?.acked;
    }
    let elapsed = started.elapsed();
    let closing = Instant::now();
    consumer.close().await?;
    Ok((elapsed, closing.elapsed()))
}
