//! `idem chaos`: a verifier run against your own broker and store. Workers consuming with idem
//! are killed and stalled while they work; at the end the ledger of their effects is compared
//! with what was published.

mod broker;
#[cfg(feature = "kafka")]
mod kafka;
mod run;
mod store;
mod verdict;
mod worker;

use std::collections::HashSet;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context as _, bail};
use idem::outbox::{OutboxId, OutboxMessage, Outgoing};
use rand::Rng;
use rand::seq::SliceRandom;
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

use broker::{Admin, BrokerUrl};
use store::{Ledger, Names, StoreUrl};
use verdict::{Effect, Events, ORIGINAL, POISON, REUSED};

/// `idem chaos --help`: what it does and what the table's columns mean.
pub(crate) const ABOUT: &str = "\
Verifies exactly-once effects on your broker and store. Publishes N messages with producer duplicates (same id, same body) and reused ids (same id, \
another body) into a fresh queue or stream, runs K worker processes consuming them with idem \
(transactional inbox on SQL stores: one ledger row per effect in the handler's transaction; \
two-phase on Redis: RPUSH of <id>:<attempt> to a ledger list, then complete), SIGKILLs a random \
worker at random intervals and starts a new one, then drains and checks the ledger. With \
--push the workers are `idem serve` sidecars pushing each new message to an application process \
that appends <id>:<attempt> to the ledger; the application is killed and stalled too.

Columns of the table:
  attempted               messages published (unique + duplicates + reused)
  unique                  distinct ids published with their original body
  reused (other body)     ids published a second time with another body
  poison (abort)          ids whose handler aborts the worker process (--poison); with --push,
                          poison (HTTP 422): ids the application refuses with 422
  effects                 ledger entries written by handlers
  lost                    unique ids with no effect                        (must be 0)
  duplicated              inbox: an id with more than one row; two-phase: the same
                          <id>:<attempt> twice                             (must be 0)
  reruns after takeover   two-phase: an id run again under a later attempt after its lease
                          was taken over (safe with the downstream idempotency key)
  unexpected              effects of a reused body, or of ids never published (must be 0)
  dead letters            distinct ids in the dead-letter queue (must equal reused + poison)
  crash loops             poison ids dead-lettered after the crash-loop limit (must equal poison);
                          with --push, 4xx dead-lettered
  kills, stalls           SIGKILLs sent; SIGSTOP/SIGCONT pauses longer than the lease
  application kills       --push: of the kills, those of the application (the rest hit sidecars)
  worker exits            workers that ended by themselves (replaced), poison aborts included
  left in broker          messages still queued after the workers stopped
  longest no progress     the longest time the run saw nothing change (no new effect, settled
                          id, dead letter or change in the broker's backlog); --timeout bounds it
  wall time               the whole run

Exit status: 0 when nothing was lost, duplicated or unexpected and every reused id was \
dead-lettered; 1 otherwise (or when nothing progressed for --timeout); 2 when the run could not be set up. The run's \
queue/stream and tables/keys (named idem_chaos_<tag>) are deleted at the end unless --keep.";

/// Where `--broker` is read from when not given; also how workers get it (never in argv).
const BROKER_ENV: &str = "IDEM_CHAOS_BROKER";
/// Where `--store` is read from when not given; also how workers get it (never in argv).
const STORE_ENV: &str = "IDEM_CHAOS_STORE";

/// A fault injected into the workers, to prove the verifier catches it. Test only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Fault {
    /// The ledger row commits on its own connection before the inbox transaction, and each
    /// worker aborts itself between the two after its 20th effect: the redelivered message
    /// runs again, so the run shows duplicates whether or not a kill lands in that window.
    EffectOutsideTx,
}

/// `--kill-every 200ms..1s`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Interval {
    min: Duration,
    max: Duration,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (n, unit) = s.split_at(split);
    let n: f64 =
        n.parse().map_err(|_| format!("{s:?}: expected a number and a unit (ms, s, m)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?}; use ms, s or m")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{s:?}: {e}"))
}

fn parse_interval(s: &str) -> Result<Interval, String> {
    let (a, b) =
        s.split_once("..").ok_or_else(|| format!("{s:?}: expected MIN..MAX, as 200ms..1s"))?;
    let (min, max) = (parse_duration(a)?, parse_duration(b)?);
    if min.is_zero() || min > max {
        return Err(format!("{s:?}: MIN must be above zero and not above MAX"));
    }
    Ok(Interval { min, max })
}

/// `idem chaos`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ChaosArgs {
    /// The broker: amqp://… (RabbitMQ), nats://… (JetStream), redis://… (Redis Streams) or
    /// kafka://host:port (Kafka; the `kafka` feature). Or set IDEM_CHAOS_BROKER (keeps a
    /// password out of the shell history and `ps`; never shown).
    #[arg(long, value_name = "URL", env = BROKER_ENV, hide_env_values = true)]
    broker: String,
    /// The store: a SQLite file, postgres://…, mysql://… (inbox mode) or redis://… (two-phase).
    /// Several mysql:// URLs separated by commas are the nodes of one cluster (Galera): worker i
    /// uses URL i mod n, or the next that answers; the setup and the verdict use the first that
    /// answers. Or set IDEM_CHAOS_STORE (not IDEM_STORE: a run creates and drops tables, so it
    /// never picks up the operator tools' store by accident).
    #[arg(long, value_name = "FILE|URL", env = STORE_ENV, hide_env_values = true)]
    store: String,
    /// Messages published in all (unique + duplicates + reused).
    #[arg(long, default_value_t = 10_000)]
    messages: usize,
    /// Share of the messages that repeat an id with the same body.
    #[arg(long, default_value_t = 0.2)]
    duplicates: f64,
    /// Share of the messages that reuse an id with another body (must be dead-lettered).
    #[arg(long, default_value_t = 0.005)]
    reused: f64,
    /// Worker processes running at once.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// SIGKILL a random worker after a random pause in this range (then start a new one).
    #[arg(long, default_value = "200ms..1s", value_parser = parse_interval)]
    kill_every: Interval,
    /// Also SIGSTOP one worker for longer than the lease, then SIGCONT it.
    #[arg(long)]
    stall: bool,
    /// The idem lease of each claim.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    lease: Duration,
    /// Give up when nothing has progressed for this long: no new effect, settled id or dead
    /// letter, and no change in the broker's backlog. A slow machine makes a run longer, not
    /// red; a run that stops moving (a lost message, a stuck consumer) fails.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    timeout: Duration,
    /// Keep the run's queue, stream, tables and keys.
    #[arg(long)]
    keep: bool,
    /// Ids (beyond --messages) whose handler calls abort() in the worker, as a handler that
    /// overflows its stack or is OOM-killed would: each must be dead-lettered as a crash loop
    /// once its deaths reach the limit (5): in two-phase mode (a redis:// store) by its lease,
    /// in inbox mode (a SQL store) by the crash note its redeliveries run under. Not with
    /// --offsets (positions only: no key to count on).
    #[arg(long, default_value_t = 0)]
    poison: usize,
    /// Kafka with a SQL store: the offset inbox (each partition's position commits with the
    /// ledger row; markers catch the producer duplicates). The run also checks that the
    /// positions table holds one row per partition.
    #[arg(long)]
    offsets: bool,
    /// Push mode: the workers are `idem serve` sidecars whose push consumer POSTs each new
    /// message to an application process (started by the run) that writes the ledger; kills
    /// and stalls hit the sidecars and the application alike. Poison ids (--poison) are
    /// answered 422 by the application and must be dead-lettered with that status. Needs a
    /// redis:// store (the sidecars' two-phase store and the application's ledger).
    #[arg(long)]
    push: bool,
    /// TEST ONLY: make the workers wrong on purpose, to see the verifier fail.
    #[arg(long, value_enum)]
    fault: Option<Fault>,
    /// Run as one worker (started by `idem chaos`).
    #[arg(long, hide = true)]
    worker: bool,
    /// The run's tag (worker mode).
    #[arg(long, hide = true)]
    tag: Option<String>,
    /// Run as the push-mode application on this port (with --worker).
    #[arg(long, hide = true)]
    app_port: Option<u16>,
}

/// Runs the verifier (or, with `--worker`, one worker); the exit code.
pub(crate) async fn run(args: ChaosArgs) -> anyhow::Result<u8> {
    if args.worker {
        if args.app_port.is_some() {
            return worker::push_app(&args).await;
        }
        return worker::run(&args).await;
    }
    let broker = BrokerUrl::parse(&args.broker)?;
    let store = StoreUrl::parse(&args.store)?;
    if args.offsets
        && (!matches!(broker, BrokerUrl::Kafka(_)) || matches!(store, StoreUrl::Redis(_)))
    {
        bail!("--offsets needs a kafka:// broker and a SQL store (the offset inbox)");
    }
    if args.push && (!matches!(store, StoreUrl::Redis(_)) || args.offsets || args.fault.is_some()) {
        bail!(
            "--push needs a redis:// store (the sidecars' store and the application's ledger), \
             and neither --offsets nor --fault"
        );
    }
    if args.poison > 0 && args.offsets {
        bail!(
            "--poison needs markers (two-phase mode, or the transactional inbox): the offset \
             inbox keeps positions only, so it has no key to count a crash loop's deaths on"
        );
    }
    let plan = Plan::new(&args)?;
    let names = Names::new(&plan.tag);
    let admin = Admin::create(&broker, &plan.tag).await?;
    let ledger = match Ledger::create(&store, &names).await {
        Ok(l) => l,
        Err(e) => {
            let _ = admin.delete().await;
            return Err(e);
        }
    };
    let outcome = run::verify(&args, &plan, &broker, &admin, &store, &names, &ledger).await;
    if args.keep {
        eprintln!("kept: queue/stream and tables/keys tagged {}", plan.tag);
    } else {
        let (a, b) = (admin.delete().await, ledger.drop_all(&store, &names).await);
        a.context("deleting the run's queue or stream")?;
        b.context("dropping the run's tables or keys")?;
    }
    outcome
}

/// SIGKILLs a random worker that is not stalled and starts a new one in its place.
async fn kill_one(
    workers: &mut [Worker],
    events: &mut Events,
    rng: &mut rand::rngs::ThreadRng,
    args: &ChaosArgs,
    tag: &str,
) -> anyhow::Result<()> {
    let candidates: Vec<usize> = (0..workers.len()).filter(|i| !workers[*i].stalled).collect();
    // Push mode kills both kinds in every run: a sidecar first, then the application at the
    // first kill that finds it running (it may be the one stalled), then any of them. (The
    // application's kill was the second kill only: when it was stalled then, a run could end
    // without killing it, 0 of 18 kills once.)
    let is_app = |i: &usize| matches!(workers[*i].role, Role::App(_));
    let app = candidates.iter().copied().find(is_app);
    let sidecars: Vec<usize> = candidates.iter().copied().filter(|i| !is_app(i)).collect();
    let pick = if events.kills == events.app_kills && !sidecars.is_empty() {
        sidecars.get(rng.random_range(0..sidecars.len())).copied()
    } else if let Some(a) = app.filter(|_| events.app_kills == 0) {
        Some(a)
    } else {
        candidates.get(rng.random_range(0..candidates.len().max(1))).copied()
    };
    if let Some(i) = pick {
        workers[i].child.kill().await.context("killing a worker")?;
        events.kills += 1;
        if matches!(workers[i].role, Role::App(_)) {
            events.app_kills += 1;
        }
        let role = workers[i].role.clone();
        workers[i] = Worker::start(args, tag, role).await?;
    }
    Ok(())
}

/// What is published.
struct Plan {
    tag: String,
    /// Originals and duplicates, shuffled.
    first: Vec<(String, &'static str)>,
    unique: HashSet<String>,
    /// Ids published again with another body once their original has an effect.
    reused: Vec<String>,
    /// Ids whose handler aborts the worker.
    poison: HashSet<String>,
}

impl Plan {
    fn new(args: &ChaosArgs) -> anyhow::Result<Self> {
        let ratio = |r: f64, what: &str| -> anyhow::Result<usize> {
            anyhow::ensure!((0.0..1.0).contains(&r), "--{what} {r}: expected a share in [0, 1)");
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // in [0, messages)
            Ok((args.messages as f64 * r).round() as usize)
        };
        let (dups, reused) = (ratio(args.duplicates, "duplicates")?, ratio(args.reused, "reused")?);
        let Some(unique) = args.messages.checked_sub(dups + reused).filter(|u| *u > 0) else {
            bail!(
                "--messages {} leaves no unique message after the duplicates and reused",
                args.messages
            )
        };
        anyhow::ensure!(reused <= unique, "--reused: more reused ids than unique ones");
        anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
        let mut rng = rand::rng();
        let tag = format!("{:08x}", rng.random::<u32>());
        let ids: Vec<String> = (0..unique).map(|i| format!("{tag}-{i:06}")).collect();
        let mut first: Vec<(String, &str)> = ids.iter().map(|id| (id.clone(), ORIGINAL)).collect();
        for _ in 0..dups {
            first.push((ids[rng.random_range(0..unique)].clone(), ORIGINAL));
        }
        first.shuffle(&mut rng);
        let mut picked = ids.clone();
        picked.shuffle(&mut rng);
        picked.truncate(reused);
        let reused = picked;
        let poison: HashSet<String> =
            (0..args.poison).map(|i| format!("{tag}-poison-{i:03}")).collect();
        for id in &poison {
            let at = rng.random_range(0..=first.len());
            first.insert(at, (id.clone(), POISON));
        }
        Ok(Self { tag, first, unique: ids.into_iter().collect(), reused, poison })
    }

    fn attempted(&self) -> u64 {
        (self.first.len() + self.reused.len()) as u64
    }
}

fn message(destination: &str, id: &str, body: &str) -> anyhow::Result<OutboxMessage> {
    let payload = serde_json::json!({ "id": id, "body": body }).to_string();
    Ok(Outgoing::new(destination, payload).id(OutboxId::new(id)?).into_message(OutboxId::random))
}

/// What a worker process is.
#[derive(Debug, Clone)]
enum Role {
    /// `idem chaos --worker`: a consumer writing the ledger.
    Consumer,
    /// Push mode: `idem serve --config <file>`, a sidecar pushing to the application.
    Sidecar(std::path::PathBuf),
    /// Push mode: the application, writing the ledger, on this port.
    App(u16),
}

/// One worker process.
struct Worker {
    child: Child,
    stalled: bool,
    role: Role,
}

impl Worker {
    /// The command of a worker: the broker and store URLs go in its environment, where only
    /// the same user (and root) can read them, never in its arguments, which `ps` shows to
    /// every user of the machine.
    fn command(exe: &std::path::Path, args: &ChaosArgs, tag: &str, role: &Role) -> Command {
        let mut cmd = Command::new(exe);
        match role {
            Role::Consumer => {
                cmd.args(["chaos", "--worker", "--tag", tag])
                    .args(["--lease", &format!("{}ms", args.lease.as_millis())]);
            }
            Role::Sidecar(config) => {
                // Quiet unless asked: conflicts and startup warnings would bury the table.
                let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "error".into());
                cmd.arg("serve").arg("--config").arg(config).env("RUST_LOG", log);
            }
            Role::App(port) => {
                cmd.args(["chaos", "--worker", "--tag", tag, "--app-port", &port.to_string()]);
            }
        }
        cmd.env(BROKER_ENV, &args.broker)
            .env(STORE_ENV, store::for_worker(&args.store))
            .envs(crate::connect::tls().env())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        if args.fault == Some(Fault::EffectOutsideTx) {
            cmd.args(["--fault", "effect-outside-tx"]);
        }
        if args.offsets {
            cmd.arg("--offsets");
        }
        cmd
    }

    /// Starts the worker and waits for its `ready` line (a sidecar's `listening on …`).
    async fn start(args: &ChaosArgs, tag: &str, role: Role) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("locating the idem binary")?;
        let mut cmd = Self::command(&exe, args, tag, &role);
        let mut child = cmd.spawn().context("starting a worker")?;
        let stdout = child.stdout.take().context("worker stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(l) = lines.next_line().await? {
                if l == "ready" || l.starts_with("listening on ") {
                    return Ok::<bool, std::io::Error>(true);
                }
            }
            Ok(false)
        })
        .await;
        match ready {
            Ok(Ok(true)) => Ok(Self { child, stalled: false, role }),
            Ok(_) => {
                let status = child.wait().await?;
                bail!("a worker ended before it was ready ({status}); its error is above")
            }
            Err(_) => bail!("a worker was not ready within 30 s"),
        }
    }

    /// Asks the worker to stop: a sidecar by SIGTERM, the others by closing their stdin.
    fn stop(&mut self) -> anyhow::Result<()> {
        match self.role {
            Role::Sidecar(_) => self.signal("-TERM"),
            Role::Consumer | Role::App(_) => {
                drop(self.child.stdin.take());
                Ok(())
            }
        }
    }

    fn signal(&self, sig: &str) -> anyhow::Result<()> {
        let pid = self.child.id().context("worker already ended")?;
        let ok = std::process::Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .with_context(|| format!("kill {sig} {pid}"))?
            .success();
        anyhow::ensure!(ok, "kill {sig} {pid} failed");
        Ok(())
    }
}

/// A loopback port free right now (for the push-mode application).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// The sidecars' `idem serve` configuration: anonymous on loopback, the run's Redis namespace
/// as the store, one push consumer of the run's destination. URLs stay in the environment.
fn push_config(
    args: &ChaosArgs,
    broker: &BrokerUrl,
    tag: &str,
    names: &Names,
    port: u16,
) -> String {
    // NATS consumers are read from their stream (which holds the run's subject).
    let destination = match broker {
        BrokerUrl::Nats(_) => BrokerUrl::stream(tag),
        _ => broker.destination(tag),
    };
    let dead_letter = broker.dead_letter(tag);
    let group = match broker {
        BrokerUrl::Amqp(_) => String::new(),
        BrokerUrl::Nats(_) => broker::NATS_CONSUMER.to_owned(),
        BrokerUrl::Redis(_) => broker::STREAM_GROUP.to_owned(),
        BrokerUrl::Kafka(_) => BrokerUrl::kafka_group(&destination),
    };
    let lease = u64::try_from(args.lease.as_millis()).unwrap_or(u64::MAX).max(3);
    let group = if group.is_empty() { String::new() } else { format!("group = {group:?}\n") };
    format!(
        "listen = \"127.0.0.1:0\"\nmetrics = false\n\n[store]\nurl_env = {STORE_ENV:?}\n\
         prefix = {prefix:?}\n\n[auth]\nanonymous = true\n\n[[push]]\nname = \"chaos\"\n\
         broker_env = {BROKER_ENV:?}\nsource = {destination:?}\ndead_letter = {dead_letter:?}\n\
         scope = \"chaos\"\nendpoint = \"http://127.0.0.1:{port}/\"\nlease_ms = {lease}\n\
         timeout_ms = {timeout}\nconcurrency = 16\n{group}",
        prefix = names.base,
        timeout = lease / 3,
    )
}

fn applied_reused(effects: &[Effect], id: &str) -> bool {
    effects.iter().any(|e| e.id == id && e.body == REUSED)
}

#[cfg(test)]
mod tests;
