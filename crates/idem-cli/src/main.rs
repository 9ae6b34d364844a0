//! `idem`: the demo, the benchmark and operator tools.

mod bench;
mod bench_sql;
mod demo;
mod ops;
mod relay;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "idem",
    version,
    about = "Idempotent message consumers: demo, benchmark and operator tools"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The order-processing story: a naive consumer and an idem consumer on the same faulty traffic.
    Demo(demo::DemoArgs),
    /// SQLite store throughput beside the bare SQL primitive, same run.
    Bench(bench::BenchArgs),
    /// PostgreSQL or MySQL store throughput (per message, inbox, group commit, batches) beside
    /// the bare SQL primitives, same run.
    BenchSql(bench_sql::BenchSqlArgs),
    /// List records.
    Inspect {
        #[command(flatten)]
        store: ops::StoreArgs,
        /// Only this scope.
        #[arg(long)]
        scope: Option<String>,
        /// Only this state (in_progress, completed, released, failed, in_doubt).
        #[arg(long)]
        state: Option<String>,
        /// At most this many, most recent first.
        #[arg(long, default_value_t = 50)]
        limit: usize,
    },
    /// Count records by state.
    Stats {
        #[command(flatten)]
        store: ops::StoreArgs,
        /// Only this scope.
        #[arg(long)]
        scope: Option<String>,
    },
    /// Delete expired records in bounded batches.
    Purge {
        #[command(flatten)]
        store: ops::StoreArgs,
        /// Records per batch.
        #[arg(long, default_value_t = 1000)]
        batch: usize,
    },
    /// Publish what handlers enqueued in an outbox table (PostgreSQL, MySQL or SQLite) to
    /// RabbitMQ, NATS JetStream, Redis Streams or Kafka, at least once, each message under its
    /// stable id; or show the outbox's counts, or retry parked rows.
    Relay(relay::RelayArgs),
    /// Release a record (in progress, in doubt, failed) so the next delivery runs again.
    Release {
        #[command(flatten)]
        store: ops::StoreArgs,
        /// The key's scope.
        scope: String,
        /// The key's id.
        id: String,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("off")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo(args) => demo::run(args).await.map(|ok| if ok { 0 } else { 1 }),
        Command::Bench(args) => bench::run(args).await.map(|()| 0),
        Command::BenchSql(args) => bench_sql::run(args).await.map(|()| 0),
        Command::Inspect { store, scope, state, limit } => {
            ops::inspect(&store, scope, state, limit).await.map(|()| 0)
        }
        Command::Stats { store, scope } => ops::stats(&store, scope).await.map(|()| 0),
        Command::Purge { store, batch } => ops::purge(&store, batch).await.map(|()| 0),
        Command::Release { store, scope, id } => ops::release(&store, scope, id).await.map(|()| 0),
        Command::Relay(args) => relay::run(args).await.map(|()| 0),
    };
    match result {
        Ok(code) => std::process::ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}
