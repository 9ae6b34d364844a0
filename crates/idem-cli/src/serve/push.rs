//! Push mode: a consumer per `[[push]]` entry, whose handler POSTs each new message to the
//! application (two-phase: the store's record is the application's exactly-once proof).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use anyhow::{Context as _, bail};
use idem::consumer::{Source, SourceConfig};
use idem::engine::Context;
use idem::extract::{Envelope, Header, JsonPointer, MessageId};
use idem::redact::Redacted;
use idem::{Consumer, DedupStore, FingerprintSpec};
use idem_serve::Pusher;
use idem_serve::config::PushConfig;
use tokio::sync::watch;

use crate::connect;

pub(crate) type Running = Pin<Box<dyn Future<Output = anyhow::Result<()>> + Send>>;

/// Connects the consumer of `p` and checks it can run; the returned future runs it until `stop`
/// turns true.
pub(crate) async fn start<S: DedupStore + Clone>(
    p: PushConfig,
    store: S,
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Running> {
    let broker = match (&p.broker, &p.broker_env) {
        (Some(b), _) => b.clone(),
        (None, Some(var)) => std::env::var(var).with_context(|| {
            format!("push {}: the environment variable {var} is not set", p.name)
        })?,
        (None, None) => bail!("push {}: no broker", p.name),
    };
    let group = p.group.clone().unwrap_or_else(|| format!("idem-{}", p.name));
    let scheme = broker.split_once("://").map_or("", |(s, _)| s);
    let at = || format!("push {} on {}", p.name, Redacted(&broker));
    match scheme {
        "amqp" | "amqps" => {
            // One connection per push consumer for the life of the process; the source
            // borrows it, so it is leaked rather than dropped (its heartbeats keep running).
            let conn: &'static _ =
                Box::leak(Box::new(connect::amqp_connection(&broker).await.with_context(at)?));
            // The default dead-letter exchange of the queue, bound to the configured queue.
            let defaults = idem::amqp::Topology::for_queue(&p.source);
            let exchange = defaults.dead_letter_exchange().to_owned();
            let topology = defaults.with_dead_letter(exchange, Some(p.dead_letter.clone()));
            let config = idem::amqp::AmqpConfig::new(conn, &p.source)
                .topology(topology)
                // A full batch for every lane in flight (the driver's default batch is 64).
                .prefetch(u16::try_from(p.concurrency * 64).unwrap_or(u16::MAX));
            consume(config, &p, store, stop).await.with_context(at)
        }
        "nats" | "tls" => {
            let js = idem::nats::async_nats::jetstream::new(
                connect::nats_client(&broker).await.with_context(at)?,
            );
            let pull = js.get_consumer_from_stream(&group, &p.source).await.with_context(|| {
                format!("{}: durable consumer {group} of stream {}", at(), p.source)
            })?;
            let config = idem::nats::JetStreamConfig::new(js, pull, p.dead_letter.clone());
            consume(config, &p, store, stop).await.with_context(at)
        }
        "redis" | "rediss" => {
            let client = connect::redis_client(&broker).with_context(at)?;
            let config = idem::redis::StreamConfig::new(
                client,
                &p.source,
                &group,
                format!("{group}-{}", std::process::id()),
            )
            .dead_letter_stream(p.dead_letter.clone())
            // A dead sidecar's entries are taken over once its leases could have run out.
            .reclaim_idle(Duration::from_millis(p.lease_ms));
            consume(config, &p, store, stop).await.with_context(at)
        }
        #[cfg(feature = "kafka")]
        s if s.starts_with("kafka") => {
            let target = connect::kafka_target(&broker)?;
            let mut c = target.config();
            // A killed sidecar's partitions move to the others within seconds, not the
            // client's default 45 s.
            c.set("group.id", &group)
                .set("session.timeout.ms", "10000")
                .set("heartbeat.interval.ms", "1000");
            let config =
                idem::kafka::KafkaConfig::new(&c, &[p.source.as_str()], p.dead_letter.clone());
            consume(config, &p, store, stop).await.with_context(at)
        }
        other => bail!(
            "push {}: broker scheme {other:?} is not one of amqp(s)://, nats://, tls://, \
             redis(s)://{}",
            p.name,
            if cfg!(feature = "kafka") {
                ", kafka://"
            } else {
                " (kafka:// needs the kafka feature)"
            }
        ),
    }
}

async fn consume<C, S>(
    config: C,
    p: &PushConfig,
    store: S,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<Running>
where
    C: SourceConfig + 'static,
    <C::Source as Source>::Delivery: Envelope,
    <C::Source as Source>::Error: Send + Sync,
    S: DedupStore,
{
    let mut pusher = Pusher::new(&p.endpoint, Duration::from_millis(p.timeout_ms))?
        .max_response_bytes(p.max_response_bytes);
    if let Some(names) = &p.forward_headers {
        pusher = pusher.forward_headers(names.clone());
    }
    if let Some(proxy) = &p.proxy {
        pusher = pusher.proxy(proxy)?;
    }
    if let Some(ca) = &p.tls_ca {
        let pem = std::fs::read(ca)
            .with_context(|| format!("push {}: tls_ca {}", p.name, ca.display()))?;
        pusher = pusher.ca_pem(&pem)?;
    }
    let builder = Consumer::builder(config)
        .scope(p.scope.as_str())
        .lease(Duration::from_millis(p.lease_ms))
        .concurrency(p.concurrency)
        .crash_loop_limit(p.crash_loop_limit)
        .fingerprint(if p.fingerprint { FingerprintSpec::Bytes } else { FingerprintSpec::None });
    let builder = if let Some(h) = p.key.strip_prefix("header:") {
        builder.key(Header::new(h))
    } else if let Some(ptr) = p.key.strip_prefix("json:") {
        builder.key(JsonPointer::new(ptr))
    } else {
        builder.key(MessageId)
    };
    let driver = builder.store(store).build().await?;
    let name = p.name.clone();
    tracing::info!(consumer = %name, endpoint = %Redacted(&p.endpoint), "push consumer started");
    Ok(Box::pin(async move {
        let handler = move |ctx: Context, m: <C::Source as Source>::Delivery| {
            let pusher = pusher.clone();
            async move { pusher.push(&ctx, &m).await }
        };
        driver
            .run(handler, async move {
                let _ = stop.wait_for(|s| *s).await;
            })
            .await
            .map(drop)
            .with_context(|| format!("push consumer {name}"))
    }))
}
