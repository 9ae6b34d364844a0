//! `idem relay`: publishes what handlers enqueued in an outbox table.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context as _, bail};
use idem::outbox::{OutboxCounts, OutboxStore, Publisher, Relay, RelayReport};
use idem::redact::Redacted;
use idem::sqlx;

use crate::connect;

#[path = "relay_wal.rs"]
mod wal;

/// Where the outbox is and where its messages go.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct RelayArgs {
    /// The outbox's database: a SQLite file, or a `postgres://` or `mysql://` URL. Or set
    /// IDEM_OUTBOX (keeps a password out of the shell history and `ps`; never shown).
    #[arg(long, value_name = "FILE|URL", env = "IDEM_OUTBOX", hide_env_values = true)]
    outbox: String,
    /// PostgreSQL schema of the outbox table.
    #[arg(long, default_value = "idem")]
    schema: String,
    /// Outbox table name.
    #[arg(long, default_value = "idem_outbox")]
    table: String,
    /// Relay the WAL outbox read from this logical replication slot (PostgreSQL with
    /// `wal_level = logical`) instead of the outbox table.
    #[arg(long, value_name = "SLOT")]
    wal_slot: Option<String>,
    /// Prefix of the WAL outbox's messages (with --wal-slot).
    #[arg(long, default_value = "idem_outbox", requires = "wal_slot")]
    wal_prefix: String,
    /// Create the slot and its publication if missing, then exit (with --wal-slot).
    #[arg(long, requires = "wal_slot")]
    create_slot: bool,
    /// Drop the slot and its publication, then exit (with --wal-slot). Messages not yet
    /// relayed are LOST.
    #[arg(long, requires = "wal_slot", conflicts_with = "create_slot")]
    drop_slot: bool,
    /// The broker: `amqp://…` (RabbitMQ), `nats://…` (JetStream), `redis://…` (Streams) or
    /// `kafka://host:port[,host:port]`. Not needed with --stats or --retry-parked. Or set
    /// IDEM_TO (keeps a password out of the shell history and `ps`; never shown).
    #[arg(long, value_name = "URL", env = "IDEM_TO", hide_env_values = true)]
    to: Option<String>,
    /// RabbitMQ exchange to publish to (default: the default exchange, where a destination is
    /// a queue name).
    #[arg(long)]
    exchange: Option<String>,
    /// Rows leased per claim (default 256); with --wal-slot, decoded records per peek
    /// (default 4096: one per message, two more per transaction).
    #[arg(long)]
    batch: Option<usize>,
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
        let pool =
            connect::pg_pool(url, sqlx::postgres::PgPoolOptions::new().max_connections(4)).await?;
        if let Some(slot) = &args.wal_slot {
            return wal::run(pool, slot, &args).await;
        }
        let store = idem::PostgresStore::new(pool).with_schema(&args.schema)?;
        let outbox = store.outbox().with_table_name(&args.table)?;
        outbox.migrate().await?;
        with_outbox(outbox, &args).await
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let pool =
            connect::mysql_pool(url, sqlx::mysql::MySqlPoolOptions::new().max_connections(4))
                .await?;
        let outbox = idem::MySqlStore::new(pool).outbox().with_table_name(&args.table)?;
        outbox.migrate().await?;
        with_outbox(outbox, &args).await
    } else if args.wal_slot.is_some() {
        bail!("--wal-slot needs a postgres:// --outbox: the WAL outbox is PostgreSQL's")
    } else if url.contains("://") {
        bail!(
            "--outbox {}: unknown scheme; expected a SQLite file, postgres:// or mysql://",
            Redacted(url)
        )
    } else {
        // A path shows as it is; `user:password@host` without a scheme does not.
        anyhow::ensure!(Path::new(url).exists(), "--outbox: no database file at {}", Redacted(url));
        let store = idem::SqliteStore::open(url)
            .await
            .with_context(|| format!("opening {}", Redacted(url)))?;
        let outbox = store.outbox().with_table_name(&args.table)?;
        outbox.migrate().await?;
        with_outbox(outbox, &args).await
    }
}

async fn with_outbox<S: OutboxStore>(outbox: S, args: &RelayArgs) -> anyhow::Result<()> {
    if args.create_slot || args.drop_slot {
        bail!("--create-slot and --drop-slot need --wal-slot")
    }
    if args.stats {
        print_counts(&outbox.counts().await?);
        return Ok(());
    }
    if let Some(n) = args.retry_parked {
        let revived = outbox.retry_parked(n).await?;
        println!("{revived} parked rows are due again");
        return Ok(());
    }
    to_broker(Table(outbox), args).await
}

/// What a relay reads: an outbox table or a WAL slot. The broker is picked once, in
/// [`to_broker`], for both.
pub(crate) trait Source {
    /// Relays to `publisher` as `args` say.
    async fn relay<P: Publisher>(self, publisher: P, args: &RelayArgs) -> anyhow::Result<()>;
}

struct Table<S>(S);

impl<S: OutboxStore> Source for Table<S> {
    async fn relay<P: Publisher>(self, publisher: P, args: &RelayArgs) -> anyhow::Result<()> {
        relay(self.0, publisher, args).await
    }
}

/// Connects to the broker `--to` names and relays `source` to it.
pub(crate) async fn to_broker<R: Source>(source: R, args: &RelayArgs) -> anyhow::Result<()> {
    let outbox = source;
    let Some(to) = args.to.as_deref() else {
        bail!("--to is required to publish: amqp://…, nats://…, redis://… or kafka://host:port")
    };
    if to.starts_with("amqp://") || to.starts_with("amqps://") {
        let conn = connect::amqp_connection(to).await?;
        let mut publisher = idem::amqp::AmqpPublisher::new(conn.create_channel().await?).await?;
        if let Some(x) = &args.exchange {
            publisher = publisher.exchange(x.clone());
        }
        outbox.relay(publisher, args).await
    } else if to.starts_with("nats://") || to.starts_with("tls://") {
        let client = connect::nats_client(to).await?;
        let publisher =
            idem::nats::JetStreamPublisher::new(idem::nats::async_nats::jetstream::new(client));
        outbox.relay(publisher, args).await
    } else if to.starts_with("redis://") || to.starts_with("rediss://") {
        let conn = connect::redis_manager(to).await?;
        outbox.relay(idem::redis::StreamPublisher::new(conn), args).await
    } else if to.starts_with("kafka://") || to.starts_with("kafka+") {
        kafka(outbox, &connect::kafka_target(to)?, args).await
    } else {
        bail!(
            "--to {}: unknown scheme; expected amqp://, nats://, redis:// or kafka://",
            Redacted(to)
        )
    }
}

#[cfg(feature = "kafka")]
async fn kafka<R: Source>(
    outbox: R,
    target: &connect::KafkaTarget,
    args: &RelayArgs,
) -> anyhow::Result<()> {
    outbox.relay(connect::kafka_publisher(target).await?, args).await
}

#[cfg(not(feature = "kafka"))]
async fn kafka<R: Source>(_: R, _: &connect::KafkaTarget, _: &RelayArgs) -> anyhow::Result<()> {
    bail!("this idem was built without Kafka; rebuild with `--features kafka`")
}

async fn relay<S: OutboxStore, P: Publisher>(
    outbox: S,
    publisher: P,
    args: &RelayArgs,
) -> anyhow::Result<()> {
    let lease = Duration::from_secs(args.lease_secs);
    let relay = Relay::builder(outbox, publisher)
        .batch(args.batch.unwrap_or(256))
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
        let stop = crate::signals::shutdown()?;
        eprintln!("relaying until SIGTERM or Ctrl-C");
        relay.run(stop).await?
    };
    let secs = started.elapsed().as_secs_f64();
    println!("{report} in {secs:.1} s ({:.0} msgs/s)", report.published as f64 / secs.max(1e-9));
    print_counts(&relay.store().counts().await?);
    Ok(())
}

fn print_counts(c: &OutboxCounts) {
    println!("outbox: pending {}, sent {}, parked {}", c.pending, c.sent, c.parked);
}
