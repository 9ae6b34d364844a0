//! `idem dlq`: read dead letters back, group them, show one with its store record, replay or
//! purge them, on every broker idem consumes from. The rules (a conflict is never replayed under
//! its key; a dead letter is removed only after its replay is confirmed) are idem-core's
//! `Workbench`; this file opens the broker's dead-letter destination and prints.

use std::sync::Arc;

use anyhow::{Context as _, bail};
use base64::Engine as _;
use idem::DedupKey;
use idem::dlq::{DeadLetterQueue, Letter, MAX_LETTERS, OnConflict, Workbench, group};
use idem::redact::Redacted;
use serde_json::json;

use crate::connect;
use crate::ops::show::{clean, json_line};
use crate::ops::{StoreArgs, StoreOptions};

/// `idem dlq --help`.
pub(crate) const ABOUT: &str = "Read dead letters back, grouped by cause; show one with the \
store's record for its key; replay them to where they were consumed from, or purge them.

--broker is the broker the consumers read (amqp:// or amqps:// for RabbitMQ, nats:// or tls:// \
for NATS JetStream, redis:// or rediss:// for Redis Streams, kafka:// for Kafka with the `kafka` \
feature, amqp10:// or amqp10s:// for an AMQP 1.0 broker, or an Azure Service Bus connection \
string); --queue is the queue, subject, stream or topic they consume; the dead letters are where \
idem's consumer puts them by default (--dead-letter names another place).

Replay rules: a message that failed is sent again under the same key, so the consumer runs it \
again. A conflict (its key was already used by another payload) is never replayed under its key: \
--conflicts discard removes it, --conflicts accept-as-new sends it as a new message under a \
derived id (<id>.accepted.<hex>). A dead letter is removed only after the broker confirmed its \
replay: at worst it is sent twice, and the consumer deduplicates it.";

/// The dead-letter destination.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct Where {
    /// The broker (see `idem dlq --help`). Or set IDEM_BROKER, which keeps a password out of
    /// the shell history and `ps`.
    #[arg(long, value_name = "URL", env = "IDEM_BROKER", hide_env_values = true)]
    broker: String,
    /// The queue, subject, stream or topic the consumers read.
    #[arg(long)]
    queue: String,
    /// Where the dead letters are, when not idem's default for --queue.
    #[arg(long, value_name = "NAME")]
    dead_letter: Option<String>,
}

/// Which dead letters an action takes.
#[derive(Debug, Clone, clap::Args)]
#[group(required = true, multiple = false)]
pub(crate) struct Select {
    /// These dead letters (ids as `list` prints them); repeat the flag for more.
    #[arg(long = "id", value_name = "ID")]
    ids: Vec<String>,
    /// Every dead letter of this group (its id as `list` prints it).
    #[arg(long, value_name = "GROUP")]
    group: Option<String>,
    /// Every dead letter.
    #[arg(long)]
    all: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum Conflicts {
    /// Leave conflicts dead-lettered (and say so).
    Refuse,
    /// Remove conflicts without sending them.
    Discard,
    /// Send conflicts again as new messages under a derived id.
    AcceptAsNew,
}

#[derive(Debug, clap::Subcommand)]
pub(crate) enum DlqCommand {
    /// The dead letters, grouped by scope, outcome and cause, then one line each. Read only.
    List {
        #[command(flatten)]
        at: Where,
        /// Read at most this many.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// One JSON object per dead letter and line, with its group and every header.
        #[arg(long)]
        json: bool,
    },
    /// One dead letter: its headers, its payload and, with --store, the store's record for
    /// its key. Read only.
    Show {
        #[command(flatten)]
        at: Where,
        /// The dead letter's id, as `list` prints it.
        id: String,
        #[command(flatten)]
        store: StoreOptions,
        /// Look for it among at most this many.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Send dead letters back to where they were consumed from (conflicts as --conflicts
    /// says), then remove them.
    Replay {
        #[command(flatten)]
        at: Where,
        #[command(flatten)]
        select: Select,
        /// What to do with conflicts.
        #[arg(long, value_enum, default_value = "refuse")]
        conflicts: Conflicts,
        /// Look among at most this many.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// Say what would be done, do nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Remove dead letters without sending them.
    Purge {
        #[command(flatten)]
        at: Where,
        #[command(flatten)]
        select: Select,
        /// Look among at most this many.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
        /// Say what would be removed, remove nothing.
        #[arg(long)]
        dry_run: bool,
    },
}

pub(crate) async fn run(cmd: DlqCommand) -> anyhow::Result<()> {
    match cmd {
        DlqCommand::List { at, limit, json } => {
            let bench = at.open().await?;
            let letters = list(&bench, limit).await?;
            print_list(&letters, limit, json);
            Ok(())
        }
        DlqCommand::Show { at, id, store, limit, json } => {
            let bench = at.open().await?;
            let letters = list(&bench, limit).await?;
            let Some(l) = letters.iter().find(|l| l.id == id) else {
                bail!(
                    "no dead letter {} among the first {} of {}",
                    clean(&id),
                    letters.len(),
                    bench.queue().describe()
                );
            };
            let record = match store.args() {
                Some(store) => record_of(&store, l).await?,
                None => None,
            };
            print_letter(l, record.as_ref(), json);
            Ok(())
        }
        DlqCommand::Replay { at, select, conflicts, limit, dry_run } => {
            let bench = at.open().await?;
            let chosen = select.pick(list(&bench, limit).await?)?;
            let on_conflict = match conflicts {
                Conflicts::Refuse => OnConflict::Refuse,
                Conflicts::Discard => OnConflict::Discard,
                Conflicts::AcceptAsNew => OnConflict::AcceptAsNew,
            };
            if dry_run {
                for l in &chosen {
                    println!("{}", plan_line(l, on_conflict));
                }
                println!("dry run: nothing was sent or removed");
                return Ok(());
            }
            let report = bench.replay(&chosen, on_conflict).await?;
            for id in &report.replayed {
                println!("replayed   {}", clean(id));
            }
            for (id, new_id) in &report.accepted_as_new {
                println!("accepted   {} as new message {}", clean(id), clean(new_id));
            }
            for id in &report.discarded {
                println!("discarded  {}", clean(id));
            }
            for (id, why) in &report.refused {
                println!("left       {}: {}", clean(id), clean(why));
            }
            println!("{report}; {} removed from {}", report.removed, bench.queue().describe());
            Ok(())
        }
        DlqCommand::Purge { at, select, limit, dry_run } => {
            let bench = at.open().await?;
            let chosen = select.pick(list(&bench, limit).await?)?;
            if dry_run {
                for l in &chosen {
                    println!("would remove {}", clean(&l.id));
                }
                println!("dry run: {} would be removed", chosen.len());
                return Ok(());
            }
            let n = bench.purge(&chosen).await?;
            println!("{n} dead letters removed from {}", bench.queue().describe());
            Ok(())
        }
    }
}

async fn list(
    bench: &Workbench<Arc<dyn DeadLetterQueue>>,
    limit: usize,
) -> anyhow::Result<Vec<Letter>> {
    anyhow::ensure!(
        (1..=MAX_LETTERS).contains(&limit),
        "--limit {limit}: must be between 1 and {MAX_LETTERS}"
    );
    Ok(bench.list(limit).await?)
}

impl Where {
    async fn open(&self) -> anyhow::Result<Workbench<Arc<dyn DeadLetterQueue>>> {
        let q = open_queue(&self.broker, &self.queue, self.dead_letter.as_deref()).await?;
        Ok(Workbench::new(q))
    }
}

impl Select {
    /// The selected letters, in the order read; an id or group that matches nothing is an error.
    fn pick(&self, letters: Vec<Letter>) -> anyhow::Result<Vec<Letter>> {
        if self.all {
            return Ok(letters);
        }
        if let Some(g) = &self.group {
            let chosen: Vec<Letter> = letters.into_iter().filter(|l| l.in_group(g)).collect();
            anyhow::ensure!(!chosen.is_empty(), "--group {}: no dead letter in it", clean(g));
            return Ok(chosen);
        }
        let missing: Vec<&String> =
            self.ids.iter().filter(|id| !letters.iter().any(|l| &l.id == *id)).collect();
        anyhow::ensure!(
            missing.is_empty(),
            "--id: no dead letter {}",
            missing.iter().map(|m| clean(m).into_owned()).collect::<Vec<_>>().join(", ")
        );
        Ok(letters.into_iter().filter(|l| self.ids.contains(&l.id)).collect())
    }
}

/// What a replay would do with `l`, in one line.
fn plan_line(l: &Letter, on_conflict: OnConflict) -> String {
    let to = l.source().unwrap_or("?");
    let id = clean(&l.id);
    match (l.is_conflict(), on_conflict) {
        (false, _) if l.source().is_none() => format!("would leave {id}: no idem-source header"),
        (false, _) => format!("would replay {id} to {} under its key", clean(to)),
        (true, OnConflict::Discard) => format!("would discard conflict {id}"),
        (true, OnConflict::AcceptAsNew) => match &l.message_id {
            Some(m) => format!(
                "would send conflict {id} to {} as new message {}",
                clean(to),
                clean(&idem::dlq::accepted_id(m, &l.payload))
            ),
            None => format!("would leave conflict {id}: no message id"),
        },
        (true, _) => {
            format!("would leave conflict {id} (choose --conflicts discard or accept-as-new)")
        }
    }
}

fn print_list(letters: &[Letter], limit: usize, as_json: bool) {
    if as_json {
        for l in letters {
            println!("{}", json_line(&letter_json(l)));
        }
        return;
    }
    if letters.is_empty() {
        println!("no dead letters");
        return;
    }
    println!("{:<12} {:>6}  {:<20} {:<18} cause", "group", "count", "scope", "outcome");
    for g in group(letters) {
        println!(
            "{:<12} {:>6}  {:<20} {:<18} {}",
            g.key.id(),
            g.ids.len(),
            clean(&g.key.scope),
            clean(&g.key.outcome),
            clean(&g.key.reason)
        );
    }
    println!();
    println!("{:<24} {:<12} {:<28} {:<18} reason", "id", "group", "message id", "outcome");
    for l in letters {
        let reason: String = l.reason().unwrap_or("").chars().take(70).collect();
        println!(
            "{:<24} {:<12} {:<28} {:<18} {}",
            clean(&l.id),
            l.group().id(),
            clean(l.message_id.as_deref().unwrap_or("-")),
            clean(l.outcome().unwrap_or("-")),
            clean(&reason)
        );
    }
    if letters.len() == limit {
        println!("(the first {limit}; --limit reads more)");
    }
}

fn letter_json(l: &Letter) -> serde_json::Value {
    let headers: serde_json::Map<String, serde_json::Value> =
        l.headers.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
    json!({
        "id": l.id,
        "group": l.group().id(),
        "message_id": l.message_id,
        "content_type": l.content_type,
        "content_encoding": l.content_encoding,
        "correlation_id": l.correlation_id,
        "timestamp_us": l.timestamp.map(|t| idem::Timestamp::from_system_time(t).as_micros()),
        "outcome": l.outcome(),
        "reason": l.reason(),
        "scope": l.scope(),
        "key": l.key(),
        "source": l.source(),
        "headers": headers,
        "payload": payload_text(&l.payload),
    })
}

/// The payload as text when it is UTF-8, else as `base64:<…>`.
fn payload_text(p: &[u8]) -> String {
    match std::str::from_utf8(p) {
        Ok(s) => s.to_owned(),
        Err(_) => format!("base64:{}", base64::engine::general_purpose::STANDARD.encode(p)),
    }
}

async fn record_of(store: &StoreArgs, l: &Letter) -> anyhow::Result<Option<idem::Record>> {
    let (Some(scope), Some(key)) = (l.scope(), l.key()) else {
        return Ok(None);
    };
    let key = DedupKey::new(scope, key).context("the dead letter's idem-scope and idem-key")?;
    Ok(store.open().await?.get(&key).await?)
}

fn print_letter(l: &Letter, record: Option<&idem::Record>, as_json: bool) {
    if as_json {
        let mut v = letter_json(l);
        v["record"] = match record {
            Some(r) => json!({
                "state": r.state.as_str(),
                "attempt": r.attempt,
                "result": r.result.as_deref().map(payload_text),
            }),
            None => serde_json::Value::Null,
        };
        println!("{}", json_line(&v));
        return;
    }
    println!("id          {}", clean(&l.id));
    println!("group       {} ({})", l.group().id(), clean(&l.group().to_string()));
    println!("message id  {}", clean(l.message_id.as_deref().unwrap_or("-")));
    if let Some(ct) = &l.content_type {
        println!("type        {}", clean(ct));
    }
    if let Some(ce) = &l.content_encoding {
        println!("encoding    {}", clean(ce));
    }
    if let Some(c) = &l.correlation_id {
        println!("correlation {}", clean(c));
    }
    if let Some(t) = l.timestamp {
        println!("sent        {}", idem::Timestamp::from_system_time(t));
    }
    println!("headers");
    for (k, v) in &l.headers {
        println!("  {}: {}", clean(k), clean(v));
    }
    println!("payload ({} bytes)", l.payload.len());
    println!("  {}", clean(&payload_text(&l.payload)));
    match record {
        Some(r) => {
            let result = r.result.as_deref().map(payload_text).unwrap_or_default();
            println!(
                "record      {} (attempt {}){}",
                r.state,
                r.attempt,
                if result.is_empty() { String::new() } else { format!(": {}", clean(&result)) }
            );
        }
        None if l.key().is_none() => println!("record      - (no idem-key header)"),
        None => println!("record      none (give --store to look it up, or it has expired)"),
    }
}

/// The dead-letter destination of consumers reading `queue` on `broker`: `dead_letter`, or
/// where idem's consumer puts them by default.
///
/// # Errors
/// An unsupported scheme, a broker that cannot be reached (naming it), a destination that
/// does not exist.
pub(crate) async fn open_queue(
    broker: &str,
    queue: &str,
    dead_letter: Option<&str>,
) -> anyhow::Result<Arc<dyn DeadLetterQueue>> {
    let scheme = broker.split_once("://").map_or("", |(s, _)| s);
    match scheme {
        "amqp" | "amqps" => {
            // The queue's channels live as long as the connection: one per process (a
            // command, or the console's queue), never closed before exit.
            let conn: &'static _ = Box::leak(Box::new(connect::amqp_connection(broker).await?));
            let q = match dead_letter {
                Some(dl) => idem::amqp::AmqpDeadLetters::new(conn, dl).await?,
                None => idem::amqp::AmqpDeadLetters::for_source(conn, queue).await?,
            };
            Ok(Arc::new(q))
        }
        "nats" | "tls" => {
            let js = idem::nats::async_nats::jetstream::new(connect::nats_client(broker).await?);
            let q = match dead_letter {
                Some(dl) => idem::nats::JetStreamDeadLetters::on_subject(js, dl).await?,
                None => idem::nats::JetStreamDeadLetters::for_source(js, queue).await?,
            };
            Ok(Arc::new(q))
        }
        "redis" | "rediss" => {
            let conn = connect::redis_manager(broker).await?;
            let q = match dead_letter {
                Some(dl) => idem::redis::StreamDeadLetters::new(conn, dl),
                None => idem::redis::StreamDeadLetters::for_source(conn, queue),
            };
            Ok(Arc::new(q))
        }
        "amqp10" | "amqp10s" => {
            // An AMQP 1.0 broker: its dead letters are where the consumer was told to put
            // them (RabbitMQ's reject path names no address).
            let Some(address) = dead_letter else {
                bail!(
                    "--broker {}: an AMQP 1.0 consumer's dead letters are at the address it was \
                     given (DeadLetters::Address); name it with --dead-letter",
                    Redacted(broker)
                );
            };
            let url = broker.replacen("amqp10", "amqp", 1);
            Ok(Arc::new(idem::amqp10::Amqp10DeadLetters::new(url, address)))
        }
        _ if broker.starts_with("Endpoint=sb://") => {
            let sb = idem::amqp10::ServiceBus::from_connection_string(broker)
                .context("--broker: the Service Bus connection string")?;
            if dead_letter.is_some() {
                bail!(
                    "--dead-letter: a Service Bus queue's dead letters are always its \
                       `{queue}/$deadletterqueue` sub-queue; leave --dead-letter out"
                );
            }
            let q = idem::amqp10::Amqp10DeadLetters::for_service_bus(&sb.queue(queue));
            Ok(Arc::new(q))
        }
        #[cfg(feature = "kafka")]
        s if s.starts_with("kafka") => {
            let target = connect::kafka_target(broker)?;
            let topic = dead_letter
                .map_or_else(|| idem::kafka::KafkaDeadLetters::topic_for(queue), str::to_owned);
            Ok(Arc::new(idem::kafka::KafkaDeadLetters::with_config(&target.config(), topic)?))
        }
        _ => bail!(
            "--broker {}: unsupported scheme; expected amqp://, amqps://, nats://, tls://, \
             redis://, rediss://, kafka://, amqp10://, amqp10s:// or a Service Bus connection \
             string",
            Redacted(broker)
        ),
    }
}
