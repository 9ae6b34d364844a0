//! The hidden worker mode (`idem chaos --worker`): one idem consumer writing one ledger entry
//! per handler run, until its stdin closes.

use std::future::Future;
use std::io::Write as _;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use idem::consumer::{Source, SourceConfig};
use idem::engine::{Context, HandlerError};
use idem::extract::Envelope;
use idem::redis::redis::AsyncCommands as _;
use idem::sqlx::{self, AssertSqlSafe};
use idem::{Consumer, MySqlStore, PostgresStore, SqliteStore, Tx};

use super::broker::{self, BrokerUrl, NATS_CONSUMER};
use super::store::{self, Names, StoreUrl};
use super::verdict::POISON;
use super::{ChaosArgs, Fault};
use crate::connect;

/// Inbox markers outlive any redelivery of the run.
const RETAIN: Duration = Duration::from_secs(86_400);
const SCOPE: &str = "chaos";

type HandlerFuture = Pin<Box<dyn Future<Output = Result<(), HandlerError<String>>> + Send>>;

pub(crate) async fn run(args: &ChaosArgs) -> anyhow::Result<u8> {
    let tag = args.tag.as_deref().context("--worker needs --tag")?;
    let broker = BrokerUrl::parse(&args.broker)?;
    let store = StoreUrl::parse(&args.store)?;
    let names = Names::new(tag);
    match &broker {
        BrokerUrl::Amqp(url) => {
            let conn = connect::amqp_connection(url).await?;
            let config = idem::amqp::AmqpConfig::new(&conn, broker.destination(tag))
                .prefetch(64)
                .retry_delay(Duration::from_millis(200), Duration::from_secs(2));
            consume(config, &store, &names, args).await
        }
        BrokerUrl::Nats(url) => {
            let js = broker::nats_connect(url).await?;
            let pull = js
                .get_consumer_from_stream(NATS_CONSUMER, &BrokerUrl::stream(tag))
                .await
                .with_context(|| format!("opening consumer {NATS_CONSUMER} of the run's stream"))?;
            let source =
                idem::nats::JetStreamConfig::new(js, pull, BrokerUrl::dead_letter_subject(tag))
                    .retry_delay(Duration::from_millis(200));
            consume(source, &store, &names, args).await
        }
        BrokerUrl::Redis(url) => {
            let client = connect::redis_client(url)?;
            // A killed worker's entries are taken over by another after this idle time.
            let config = idem::redis::StreamConfig::new(
                client,
                broker.destination(tag),
                broker::STREAM_GROUP,
                format!("worker-{}", std::process::id()),
            )
            .reclaim_idle(Duration::from_secs(2));
            consume(config, &store, &names, args).await
        }
        #[cfg(feature = "kafka")]
        BrokerUrl::Kafka(brokers) => {
            let topic = broker.destination(tag);
            let config = idem::kafka::KafkaConfig::new(
                &super::kafka::consumer_config(brokers, &topic),
                &[topic.as_str()],
                broker.dead_letter(tag),
            )
            .retry_delay(Duration::from_millis(200))
            .close_timeout(Duration::from_secs(5));
            if args.offsets {
                return consume_offsets(config, &store, &names, args).await;
            }
            consume(config, &store, &names, args).await
        }
        #[cfg(not(feature = "kafka"))]
        BrokerUrl::Kafka(_) => anyhow::bail!("this idem was built without the `kafka` feature"),
    }
}

/// Resolves when stdin closes: the orchestrator's stop signal.
async fn stdin_closed() {
    use tokio::io::AsyncReadExt;
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 64];
    while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
}

fn ready() -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    Ok(())
}

/// Effects a worker under `--fault effect-outside-tx` makes before it aborts itself.
const ABORT_AFTER: usize = 20;
static OUTSIDE_EFFECTS: AtomicUsize = AtomicUsize::new(0);

/// `(id, body)` of a chaos message; a payload that is not one is a permanent failure. A poison
/// message (`--poison`) aborts the worker here, as a stack overflow or the OOM killer would.
fn read(m: &impl Envelope) -> Result<(String, String), HandlerError<String>> {
    let v: serde_json::Value = serde_json::from_slice(m.payload())
        .map_err(|e| HandlerError::Permanent(format!("payload: {e}")))?;
    let field = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
    match (field("id"), field("body")) {
        (Some(_), Some(body)) if body == POISON => std::process::abort(),
        (Some(id), Some(body)) => Ok((id, body)),
        _ => Err(HandlerError::Permanent("payload without id and body".into())),
    }
}

/// The inbox handler for one SQL database: the ledger row joins the batch's transaction, or
/// (under `--fault effect-outside-tx`) commits on its own before it.
macro_rules! sql_writer {
    ($inbox:ty, $pool:expr, $sql:expr, $fault:expr) => {{
        let (pool, sql, outside) = ($pool.clone(), $sql, $fault);
        move |mut tx: Tx<$inbox>, m: <C::Source as Source>::Delivery| -> HandlerFuture {
            let read = read(&m);
            let (pool, sql) = (pool.clone(), sql.clone());
            Box::pin(async move {
                let (id, body) = read?;
                let q = sqlx::query(AssertSqlSafe(sql)).bind(id).bind(body);
                let done = if outside { q.execute(&pool).await } else { q.execute(&mut *tx).await };
                done.map_err(|e| HandlerError::Transient(e.to_string()))?;
                if outside && OUTSIDE_EFFECTS.fetch_add(1, Ordering::SeqCst) + 1 == ABORT_AFTER {
                    // The effect is committed, the inbox transaction is not: the redelivered
                    // message runs again, whatever the kills do.
                    std::process::abort();
                }
                Ok(())
            })
        }
    }};
}

async fn consume<C>(
    config: C,
    store: &StoreUrl,
    names: &Names,
    args: &ChaosArgs,
) -> anyhow::Result<u8>
where
    C: SourceConfig,
    <C::Source as Source>::Delivery: Envelope,
    <C::Source as Source>::Error: Send + Sync,
{
    let outside = args.fault == Some(Fault::EffectOutsideTx);
    let ledger = names.ledger_table(store);
    let builder = Consumer::builder(config)
        .scope(SCOPE)
        .lease(args.lease)
        .batch(32)
        .idle_wait(Duration::from_millis(100));
    match store {
        StoreUrl::Postgres(url) => {
            let pool = store::pg_pool(url, 4).await?;
            let inbox = PostgresStore::new(pool.clone()).with_schema(&names.base)?.inbox(RETAIN);
            let driver = builder.inbox(inbox).build().await?;
            ready()?;
            let sql = format!("INSERT INTO {ledger} (id, body) VALUES ($1, $2)");
            driver
                .run(sql_writer!(idem::PostgresInbox, pool, sql, outside), stdin_closed())
                .await?;
        }
        StoreUrl::MySql(url) => {
            let pool = store::my_pool(url, 4).await?;
            let inbox = MySqlStore::new(pool.clone()).with_table_name(&names.base)?.inbox(RETAIN);
            let driver = builder.inbox(inbox).build().await?;
            ready()?;
            let sql = format!("INSERT INTO {ledger} (id, body) VALUES (?, ?)");
            driver.run(sql_writer!(idem::MySqlInbox, pool, sql, outside), stdin_closed()).await?;
        }
        StoreUrl::Sqlite(path) => {
            let pool = store::sqlite_pool(path).await?;
            let inbox = SqliteStore::new(pool.clone()).with_table_name(&names.base)?.inbox(RETAIN);
            let driver = builder.inbox(inbox).build().await?;
            ready()?;
            // SQLite has one connection per worker, held by the batch: a write "outside" it
            // would wait for itself, so the fault opens a second pool.
            let pool = if outside { store::sqlite_pool(path).await? } else { pool };
            let sql = format!("INSERT INTO {ledger} (id, body) VALUES (?, ?)");
            driver.run(sql_writer!(idem::SqliteInbox, pool, sql, outside), stdin_closed()).await?;
        }
        StoreUrl::Redis(url) => {
            anyhow::ensure!(
                !outside,
                "--fault effect-outside-tx needs a SQL store (two-phase effects are outside already)"
            );
            let dedup = connect::redis_store(url, |builder| {
                Ok(builder.namespace(&names.base)?.response_timeout(Duration::from_secs(2)))
            })
            .await?;
            let driver = builder.store(dedup).build().await?;
            let conn = connect::redis_manager(url).await?;
            let key = names.redis_ledger();
            ready()?;
            let handler =
                move |ctx: Context, m: <C::Source as Source>::Delivery| -> HandlerFuture {
                    let read = read(&m);
                    let (mut conn, key) = (conn.clone(), key.clone());
                    Box::pin(async move {
                        let (id, body) = read?;
                        let entry = format!("{id}:{}:{body}", ctx.attempt());
                        let _: i64 = conn
                            .rpush(key, entry)
                            .await
                            .map_err(|e| HandlerError::Transient(e.to_string()))?;
                        Ok(())
                    })
                };
            driver.run(handler, stdin_closed()).await?;
        }
    }
    Ok(0)
}

/// A source that seeks to an offset inbox's stored positions (Kafka).
trait Seeks: Sized {
    fn seek_to(self, positions: impl idem::inbox::PositionReader) -> Self;
}

#[cfg(feature = "kafka")]
impl Seeks for idem::kafka::KafkaConfig {
    fn seek_to(self, positions: impl idem::inbox::PositionReader) -> Self {
        self.stored_positions(positions)
    }
}

/// The offset inbox over a SQL store (`--offsets`): the ledger row and the partition's position
/// commit together; the source seeks to the stored positions on each assignment.
#[cfg_attr(not(feature = "kafka"), allow(dead_code))]
async fn consume_offsets<C>(
    config: C,
    store: &StoreUrl,
    names: &Names,
    args: &ChaosArgs,
) -> anyhow::Result<u8>
where
    C: SourceConfig + Seeks,
    <C::Source as Source>::Delivery: Envelope,
    <C::Source as Source>::Error: Send + Sync,
{
    use idem::inbox::OffsetInbox;
    let ledger = names.ledger_table(store);
    let outside = args.fault == Some(Fault::EffectOutsideTx);
    macro_rules! build {
        ($inbox:expr) => {{
            let inbox = OffsetInbox::new($inbox);
            Consumer::builder(config.seek_to(inbox.clone()))
                .scope(SCOPE)
                .batch(32)
                .idle_wait(Duration::from_millis(100))
                .offset_inbox(inbox)
                .build()
                .await?
        }};
    }
    match store {
        StoreUrl::Postgres(url) => {
            let pool = store::pg_pool(url, 4).await?;
            let driver =
                build!(PostgresStore::new(pool.clone()).with_schema(&names.base)?.inbox(RETAIN));
            ready()?;
            let sql = format!("INSERT INTO {ledger} (id, body) VALUES ($1, $2)");
            driver
                .run(sql_writer!(idem::PostgresInbox, pool, sql, outside), stdin_closed())
                .await?;
        }
        StoreUrl::MySql(url) => {
            let pool = store::my_pool(url, 4).await?;
            let driver =
                build!(MySqlStore::new(pool.clone()).with_table_name(&names.base)?.inbox(RETAIN));
            ready()?;
            let sql = format!("INSERT INTO {ledger} (id, body) VALUES (?, ?)");
            driver.run(sql_writer!(idem::MySqlInbox, pool, sql, outside), stdin_closed()).await?;
        }
        StoreUrl::Sqlite(path) => {
            let pool = store::sqlite_pool(path).await?;
            let driver =
                build!(SqliteStore::new(pool.clone()).with_table_name(&names.base)?.inbox(RETAIN));
            ready()?;
            let pool = if outside { store::sqlite_pool(path).await? } else { pool };
            let sql = format!("INSERT INTO {ledger} (id, body) VALUES (?, ?)");
            driver.run(sql_writer!(idem::SqliteInbox, pool, sql, outside), stdin_closed()).await?;
        }
        StoreUrl::Redis(_) => anyhow::bail!("--offsets needs a SQL store"),
    }
    Ok(0)
}

/// The push-mode application (`idem chaos --push` starts it): each request it receives is one
/// effect, appended to the run's ledger as `<id>:<attempt>:<body>` (attempt from
/// `Idem-Attempt`), so the verdict counts what a real application would have done; poison
/// bodies are refused with 422 and write nothing. Runs until its stdin closes.
pub(crate) async fn push_app(args: &ChaosArgs) -> anyhow::Result<u8> {
    use axum::http::{HeaderMap, StatusCode};

    let tag = args.tag.as_deref().context("--app-port needs --tag")?;
    let port = args.app_port.context("--app-port")?;
    let StoreUrl::Redis(url) = StoreUrl::parse(&args.store)? else {
        anyhow::bail!("the push-mode application keeps its ledger in a redis:// store");
    };
    let conn = connect::redis_manager(&url).await?;
    let key = Names::new(tag).redis_ledger();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .with_context(|| format!("binding the application's port {port}"))?;
    let handler = move |headers: HeaderMap, body: axum::body::Bytes| {
        let (mut conn, key) = (conn.clone(), key.clone());
        async move {
            let v: serde_json::Value = match serde_json::from_slice(&body) {
                Ok(v) => v,
                Err(e) => return (StatusCode::BAD_REQUEST, format!("not JSON: {e}")),
            };
            let field = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
            let (Some(id), Some(body)) = (field("id"), field("body")) else {
                return (StatusCode::BAD_REQUEST, "no id and body".to_owned());
            };
            if body == POISON {
                return (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "poison: refused by the application".into(),
                );
            }
            let attempt = headers
                .get("idem-attempt")
                .and_then(|a| a.to_str().ok())
                .and_then(|a| a.parse::<u32>().ok())
                .unwrap_or(0);
            let entry = format!("{id}:{attempt}:{body}");
            match conn.rpush::<_, _, i64>(key, entry).await {
                Ok(_) => (StatusCode::OK, format!("{{\"applied\":{id:?}}}")),
                Err(e) => (StatusCode::SERVICE_UNAVAILABLE, format!("ledger: {e}")),
            }
        }
    };
    let app = axum::Router::new().fallback(axum::routing::post(handler));
    ready()?;
    axum::serve(listener, app).with_graceful_shutdown(stdin_closed()).await?;
    Ok(0)
}
