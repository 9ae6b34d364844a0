//! `idem`: the demo, the benchmark and operator tools.

mod bench;
mod bench_sql;
mod chaos;
mod connect;
mod demo;
mod dlq;
mod ops;
mod relay;
mod scrub;
mod serve;
mod signals;

use clap::{Parser, Subcommand};

/// `idem --help`. The 10 s is `connect::CONNECT_TIMEOUT`.
const LONG_ABOUT: &str = "Idempotent message consumers: demo, benchmark and operator tools.

The operator verbs (inspect, stats, purge, release, fail) work on every store: --store takes a \
SQLite file or a postgres://, mysql://, mariadb:// or redis:// URL, with --schema (PostgreSQL), \
--table (SQL stores) and --prefix (Redis namespace).

Secrets: every URL argument can come from an environment variable instead (IDEM_STORE, \
IDEM_OUTBOX, IDEM_TO, IDEM_CHAOS_BROKER, IDEM_CHAOS_STORE, IDEM_BENCH_URL), which keeps passwords \
out of the shell history and out of `ps`; --help never shows their values. Messages and logs \
show URLs with the password and secret parameters (password, token, sig, SharedAccessKey…) as ***.

TLS: amqps://, rediss://, tls:// (NATS), kafka+ssl:// and kafka+sasl-ssl:// (Kafka) are verified \
TLS, trusting the OS store. PostgreSQL and MySQL follow their own clients: sslmode=verify-full \
(or verify-ca) and ssl-mode=VERIFY_IDENTITY (or VERIFY_CA) verify the server; sslmode=require, \
ssl-mode=REQUIRED and a URL with no mode (PostgreSQL's default is prefer) encrypt without \
verifying whom they talk to. --tls-ca adds a CA (and makes PostgreSQL and MySQL verify-full), \
--tls-cert/--tls-key present a client certificate. A URL that asks for TLS never connects in \
plaintext.

Timeouts: every server gets 10 s to accept a connection; past that, or on a refusal, the verb \
exits with an error naming the service and its address. A verb that talks to two servers \
(relay, chaos) connects to them one after the other, so it gives up within 20 s.";

#[derive(Parser)]
#[command(
    name = "idem",
    version,
    about = "Idempotent message consumers: demo, benchmark and operator tools",
    long_about = LONG_ABOUT
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    tls: connect::TlsArgs,
}

#[derive(Subcommand)]
enum Command {
    /// The order-processing story: a naive consumer and an idem consumer on the same faulty traffic.
    Demo(demo::DemoArgs),
    /// Verify exactly-once effects on your broker and store: workers killed and stalled while
    /// they consume, then a table of lost, duplicated and unexpected effects.
    #[command(long_about = chaos::ABOUT)]
    Chaos(chaos::ChaosArgs),
    /// SQLite store throughput beside the bare SQL primitive, same run.
    Bench(bench::BenchArgs),
    /// PostgreSQL or MySQL store throughput (per message, inbox, group commit, batches) beside
    /// the bare SQL primitives, same run.
    BenchSql(bench_sql::BenchSqlArgs),
    /// List dedup records: what a key's state is, its attempt count, its stored result or
    /// failure reason. Read only.
    Inspect(ops::InspectArgs),
    /// Count records by state (and by scope), with the oldest in-progress lease: a quick check
    /// for stuck consumers and records parked in doubt. Read only.
    Stats(ops::StatsArgs),
    /// Delete expired records (retention passed, no live lease) in bounded batches, so claims
    /// are never blocked for longer than one batch. Consumers' stores also purge on their own.
    Purge {
        #[command(flatten)]
        store: ops::StoreArgs,
        /// Records deleted per batch (one statement or script each).
        #[arg(long, default_value_t = 1000)]
        batch: usize,
        /// Stop after deleting this many in all.
        #[arg(long)]
        max: Option<u64>,
    },
    /// Publish what handlers enqueued in an outbox table (PostgreSQL, MySQL or SQLite) to
    /// RabbitMQ, NATS JetStream, Redis Streams or Kafka, at least once, each message under its
    /// stable id; or show the outbox's counts, or retry parked rows.
    Relay(relay::RelayArgs),
    /// Dead letters: list them grouped by cause, show one with its store record, replay them
    /// by the rules (a conflict never under its key) or purge them, on any broker.
    #[command(long_about = dlq::ABOUT)]
    Dlq {
        #[command(subcommand)]
        command: dlq::DlqCommand,
    },
    /// Serve the claim API (HTTP/JSON) over a store for services in any language, and push
    /// each new message of configured queues to an application endpoint.
    #[command(long_about = serve::ABOUT)]
    Serve(serve::ServeArgs),
    /// Release a record (in progress, in doubt, failed, even completed) so the next delivery
    /// runs the handler again. A consumer still holding its lease is fenced out: its completion
    /// fails with "lease lost" and changes nothing.
    Release {
        #[command(flatten)]
        store: ops::StoreArgs,
        /// The key's scope.
        scope: String,
        /// The key's id.
        id: String,
    },
    /// Mark a record failed, after checking that its effect did not happen: for records parked
    /// in doubt (or stuck in progress). The reason is stored on the record; a resubmitted
    /// message runs the handler again. A consumer still holding its lease is fenced out.
    /// Refuses completed records (use `release` to run one again on purpose).
    Fail {
        #[command(flatten)]
        store: ops::StoreArgs,
        /// The key's scope.
        #[arg(long)]
        scope: String,
        /// The key's id.
        #[arg(long)]
        id: String,
        /// Why, for whoever reads the record next (shown by `inspect`).
        #[arg(long)]
        reason: String,
    },
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Client libraries' log lines and error causes may hold a password idem never printed.
    let scrubber = std::sync::Arc::new(scrub::Scrubber::from_process());
    let cli = Cli::parse();
    // A server logs by default; the one-shot verbs only when RUST_LOG asks.
    let (default_filter, json) = match &cli.command {
        Command::Serve(a) => ("info", a.log_format == "json"),
        _ => ("off", false),
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let writer = scrub::Stderr(std::sync::Arc::clone(&scrubber));
    if json {
        tracing_subscriber::fmt().json().with_env_filter(filter).with_writer(writer).init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(writer).init();
    }
    connect::set_tls(cli.tls.clone());
    let result = match cli.command {
        Command::Demo(args) => demo::run(args).await.map(|ok| if ok { 0 } else { 1 }),
        Command::Chaos(args) => chaos::run(args).await,
        Command::Bench(args) => bench::run(args).await.map(|()| 0),
        Command::BenchSql(args) => bench_sql::run(args).await.map(|()| 0),
        Command::Inspect(args) => ops::inspect(args).await.map(|()| 0),
        Command::Stats(args) => ops::stats(args).await.map(|()| 0),
        Command::Purge { store, batch, max } => ops::purge(&store, batch, max).await.map(|()| 0),
        Command::Release { store, scope, id } => ops::release(&store, scope, id).await.map(|()| 0),
        Command::Fail { store, scope, id, reason } => {
            ops::fail(&store, scope, id, reason).await.map(|()| 0)
        }
        Command::Relay(args) => relay::run(args).await.map(|()| 0),
        Command::Serve(args) => serve::run(args, &scrubber).await.map(|()| 0),
        Command::Dlq { command } => dlq::run(command).await.map(|()| 0),
    };
    match result {
        Ok(code) => std::process::ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {}", scrubber.scrub(&format!("{e:#}")));
            std::process::ExitCode::from(2)
        }
    }
}
