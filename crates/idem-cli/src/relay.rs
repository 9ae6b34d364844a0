//! `idem relay`: publishes what handlers enqueued in an outbox table.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};
use idem::outbox::{OutboxCounts, OutboxStore, Publisher, Relay, RelayReport};

/// Where the outbox is and where its messages go.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RelayArgs {
    /// The outbox's database: a SQLite file, or a `postgres://` or `mysql://` URL.
    #[arg(long)]
    outbox: String,
    /// PostgreSQL schema of the outbox table.
    #[arg(long, default_value = "idem")]
    schema: String,
    /// Outbox table name.
    #[arg(long, default_value = "idem_outbox")]
    table: String,
    /// The broker: `amqp://…` (RabbitMQ), `nats://…` (JetStream), `redis://…` (Streams) or
    /// `kafka://host:port[,host:port]`. Not needed with --stats or --retry-parked.
    #[arg(long)]
    to: Option<String>,
    /// RabbitMQ exchange to publish to (default: the default exchange, where a destination is
    /// a queue name).
    #[arg(long)]
    exchange: Option<String>,
    /// Rows leased per claim.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Claim–publish–mark loops running at once.
    #[arg(long, default_value_t = 2)]
    concurrency: usize,
    /// Seconds a claim holds its rows; a relay that dies leaves them to another after this.
    #[arg(long, default_value_t = 30)]
    lease_secs: u64,
    /// Publish attempts before a row is parked.
    #[arg(long, default_value_t = 10)]
    max_attempts: u32,
    /// Hours sent rows are kept before they are purged.
    #[arg(long, default_value_t = 24)]
    retain_sent_hours: u64,
    /// Publish until nothing is due, then exit (for scripts and cron).
    #[arg(long)]
    once: bool,
    /// Print the outbox's rows by state and exit.
    #[arg(long)]
    stats: bool,
    /// Make up to N parked rows due again (after fixing what made them fail), then exit.
    #[arg(long, value_name = "N")]
    retry_parked: Option<usize>,
}

pub(crate) async fn run(args: RelayArgs) -> anyhow::Result<()> {
    let url = args.outbox.as_str();
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        // Only the outbox table is created: the store's own table is not needed here.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(url)
            .await
            .with_context(|| format!("connecting to {url}"))?;
        let store = idem::PostgresStore::new(pool).with_schema(&args.schema)?;
        let outbox = store.outbox().with_table_name(&args.table)?;
        outbox.migrate().await?;
        with_outbox(outbox, &args).await
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let store =
            idem::MySqlStore::connect(url).await.with_context(|| format!("connecting to {url}"))?;
        let outbox = store.outbox().with_table_name(&args.table)?;
        outbox.migrate().await?;
        with_outbox(outbox, &args).await
    } else if url.contains("://") {
        bail!("--outbox {url}: unknown scheme; expected a SQLite file, postgres:// or mysql://")
    } else {
        anyhow::ensure!(Path::new(url).exists(), "--outbox: no database file at {url}");
        let store = idem::SqliteStore::open(url).await.with_context(|| format!("opening {url}"))?;
        let outbox = store.outbox().with_table_name(&args.table)?;
        outbox.migrate().await?;
        with_outbox(outbox, &args).await
    }
}

async fn with_outbox<S: OutboxStore>(outbox: S, args: &RelayArgs) -> anyhow::Result<()> {
    if args.stats {
        print_counts(&outbox.counts().await?);
        return Ok(());
    }
    if let Some(n) = args.retry_parked {
        let revived = outbox.retry_parked(n).await?;
        println!("{revived} parked rows are due again");
        return Ok(());
    }
    let Some(to) = args.to.as_deref() else {
        bail!("--to is required to publish: amqp://…, nats://…, redis://… or kafka://host:port")
    };
    if to.starts_with("amqp://") || to.starts_with("amqps://") {
        let conn = idem::amqp::lapin::Connection::connect(to, Default::default())
            .await
            .with_context(|| format!("connecting to {to}"))?;
        let mut publisher = idem::amqp::AmqpPublisher::new(conn.create_channel().await?).await?;
        if let Some(x) = &args.exchange {
            publisher = publisher.exchange(x.clone());
        }
        relay(outbox, publisher, args).await
    } else if to.starts_with("nats://") {
        let client = idem::nats::async_nats::connect(to.trim_start_matches("nats://"))
            .await
            .with_context(|| format!("connecting to {to}"))?;
        let publisher =
            idem::nats::JetStreamPublisher::new(idem::nats::async_nats::jetstream::new(client));
        relay(outbox, publisher, args).await
    } else if to.starts_with("redis://") || to.starts_with("rediss://") {
        let client = idem::redis::redis::Client::open(to).with_context(|| format!("--to {to}"))?;
        let conn =
            client.get_connection_manager().await.with_context(|| format!("connecting to {to}"))?;
        relay(outbox, idem::redis::StreamPublisher::new(conn), args).await
    } else if let Some(brokers) = to.strip_prefix("kafka://") {
        kafka(outbox, brokers, args).await
    } else {
        bail!("--to {to}: unknown scheme; expected amqp://, nats://, redis:// or kafka://")
    }
}

#[cfg(feature = "kafka")]
async fn kafka<S: OutboxStore>(outbox: S, brokers: &str, args: &RelayArgs) -> anyhow::Result<()> {
    let publisher =
        idem::kafka::KafkaPublisher::new(brokers).with_context(|| format!("kafka://{brokers}"))?;
    relay(outbox, publisher, args).await
}

#[cfg(not(feature = "kafka"))]
async fn kafka<S: OutboxStore>(_: S, _: &str, _: &RelayArgs) -> anyhow::Result<()> {
    bail!("this idem was built without Kafka; rebuild with `--features kafka`")
}

async fn relay<S: OutboxStore, P: Publisher>(
    outbox: S,
    publisher: P,
    args: &RelayArgs,
) -> anyhow::Result<()> {
    let lease = Duration::from_secs(args.lease_secs);
    let relay = Relay::builder(outbox, publisher)
        .batch(args.batch)
        .concurrency(args.concurrency)
        .lease(lease)
        .publish_timeout(lease / 3)
        .max_attempts(args.max_attempts)
        .retain_sent(Duration::from_secs(args.retain_sent_hours * 3600))
        .build()?;
    let started = std::time::Instant::now();
    let report: RelayReport = if args.once {
        relay.run_until_empty().await?
    } else {
        eprintln!("relaying until Ctrl-C");
        relay
            .run(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?
    };
    let secs = started.elapsed().as_secs_f64();
    println!("{report} in {secs:.1} s ({:.0} msgs/s)", report.published as f64 / secs.max(1e-9));
    print_counts(&relay.store().counts().await?);
    Ok(())
}

fn print_counts(c: &OutboxCounts) {
    println!("outbox: pending {}, sent {}, parked {}", c.pending, c.sent, c.parked);
}
