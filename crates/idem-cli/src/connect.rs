//! Every connection the CLI opens, one function per client, each bounded in time.
//!
//! A server that refuses the connection, rejects the credentials, speaks another protocol or
//! does not answer at all is reported within [`CONNECT_TIMEOUT`], as
//! `cannot connect to <service> at <address>: <why>`, the address shown without its password
//! or secret parameters ([`idem::redact`]). A verb that talks to two servers (relay: outbox,
//! then broker; chaos: broker, then store) connects to them one after the other, so it gives
//! up within twice the bound. SQLite is a file, not a server: its wait is its busy timeout.
//!
//! The clients' own limits are set to the bound as well where they have one (sqlx's acquire
//! timeout, redis' connection and response timeouts, the NATS connection timeout, librdkafka's
//! metadata timeout), so their error, which says why, usually comes before the outer
//! `tokio::time::timeout`, which can only say that nothing came back.

use std::borrow::Cow;
use std::future::Future;
use std::time::Duration;

use anyhow::{Context as _, anyhow, bail};
use idem::redact::Redacted;
use idem::redis::RedisStore;
use idem::redis::redis::{self, aio::ConnectionManager, aio::ConnectionManagerConfig};
use idem::sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions};
use idem::sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use idem::sqlx::sqlite::{SqliteConnectOptions, SqlitePool, SqlitePoolOptions};
use idem::sqlx::{ConnectOptions as _, Connection as _};

/// How long the CLI waits for one server to accept a connection (and, for clients that have
/// one, to answer a request) before it gives up with an error. `idem --help` says 10 s.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `connecting` for at most [`CONNECT_TIMEOUT`]; an error names `service` and `url`
/// (redacted) and keeps the client's error as its cause.
async fn bounded<T, E>(
    service: &str,
    url: &str,
    connecting: impl Future<Output = Result<T, E>>,
) -> anyhow::Result<T>
where
    E: Into<anyhow::Error>,
{
    match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            Err(e.into().context(format!("cannot connect to {service} at {}", Redacted(url))))
        }
        Err(_) => Err(anyhow!(
            "cannot connect to {service} at {}: no answer within {} s",
            Redacted(url),
            CONNECT_TIMEOUT.as_secs()
        )),
    }
}

/// A PostgreSQL pool of `pool`'s settings (its acquire timeout becomes the bound).
///
/// One connection is opened on its own first: the pool itself retries a refused connection
/// until its timeout and then reports only "pool timed out", hiding why.
pub(crate) async fn pg_pool(url: &str, pool: PgPoolOptions) -> anyhow::Result<PgPool> {
    let opts: PgConnectOptions =
        url.parse().with_context(|| format!("PostgreSQL URL {}", Redacted(url)))?;
    bounded("PostgreSQL", url, async move {
        opts.connect().await?.close().await?;
        pool.acquire_timeout(CONNECT_TIMEOUT).connect_with(opts).await
    })
    .await
}

/// A MySQL or MariaDB pool (`mysql://` or `mariadb://`), as [`pg_pool`].
pub(crate) async fn mysql_pool(url: &str, pool: MySqlPoolOptions) -> anyhow::Result<MySqlPool> {
    let (service, driver_url) = match url.strip_prefix("mariadb://") {
        // The driver knows only `mysql://`; MariaDB speaks the same protocol.
        Some(rest) => ("MariaDB", Cow::Owned(format!("mysql://{rest}"))),
        None => ("MySQL", Cow::Borrowed(url)),
    };
    let opts: MySqlConnectOptions =
        driver_url.parse().with_context(|| format!("{service} URL {}", Redacted(url)))?;
    bounded(service, url, async move {
        opts.connect().await?.close().await?;
        pool.acquire_timeout(CONNECT_TIMEOUT).connect_with(opts).await
    })
    .await
}

/// A SQLite pool on a local file. Not bounded by [`CONNECT_TIMEOUT`]: opening waits at most
/// the busy timeout of `opts` for another process's write lock (a chaos worker stalled on
/// purpose can hold it for longer than the bound).
pub(crate) async fn sqlite_pool(
    opts: SqliteConnectOptions,
    pool: SqlitePoolOptions,
) -> anyhow::Result<SqlitePool> {
    let file = opts.get_filename().display().to_string();
    pool.connect_with(opts).await.with_context(|| format!("opening SQLite database {file}"))
}

/// A Redis client for `url`; nothing is connected yet.
pub(crate) fn redis_client(url: &str) -> anyhow::Result<redis::Client> {
    redis::Client::open(url).with_context(|| format!("Redis URL {}", Redacted(url)))
}

/// A Redis connection manager (it reconnects by itself); requests time out after the bound.
pub(crate) async fn redis_manager(url: &str) -> anyhow::Result<ConnectionManager> {
    let client = redis_client(url)?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(CONNECT_TIMEOUT))
        // Each reconnection tries three times; the first connection fails fast on a refusal.
        .set_number_of_retries(2);
    bounded("Redis", url, client.get_connection_manager_with_config(config)).await
}

/// A Redis dedup store: `configure` sets the namespace and the rest on a builder whose
/// response timeout is the bound.
pub(crate) async fn redis_store(
    url: &str,
    configure: impl FnOnce(
        idem::redis::RedisStoreBuilder,
    ) -> anyhow::Result<idem::redis::RedisStoreBuilder>,
) -> anyhow::Result<RedisStore> {
    let builder =
        RedisStore::builder(url).with_context(|| format!("Redis URL {}", Redacted(url)))?;
    let builder = configure(builder.response_timeout(CONNECT_TIMEOUT))?;
    bounded("Redis", url, builder.connect()).await
}

/// A RabbitMQ (AMQP 0-9-1) connection.
pub(crate) async fn amqp_connection(url: &str) -> anyhow::Result<idem::amqp::lapin::Connection> {
    let props = idem::amqp::lapin::ConnectionProperties::default();
    bounded("RabbitMQ", url, idem::amqp::lapin::Connection::connect(url, props)).await
}

/// A NATS client (it reconnects by itself once connected). `nats://user:password@host` logs in
/// with a user and password, `nats://token@host` with a token.
///
/// The client ignores credentials in the URL and logs the URL it is given (at debug level), so
/// they are taken out of it here and handed over as options.
pub(crate) async fn nats_client(url: &str) -> anyhow::Result<idem::nats::async_nats::Client> {
    use idem::nats::async_nats::ConnectOptions;
    let mut server = url::Url::parse(url).with_context(|| format!("NATS URL {}", Redacted(url)))?;
    if server.query().is_some() || server.fragment().is_some() {
        bail!(
            "NATS URL {}: takes no parameters (credentials go in the user-info: \
             nats://user:password@host or nats://token@host)",
            Redacted(url)
        );
    }
    let decode = |s: &str| {
        let decoded = percent_encoding::percent_decode_str(s).decode_utf8();
        decoded.map(|d| d.into_owned()).with_context(|| format!("NATS URL {}", Redacted(url)))
    };
    let user = decode(server.username())?;
    let options = match server.password().map(decode).transpose()? {
        Some(password) => ConnectOptions::with_user_and_password(user, password),
        None if !user.is_empty() => ConnectOptions::with_token(user),
        None => ConnectOptions::new(),
    };
    // Neither fails on a URL with a host.
    let _ = server.set_username("");
    let _ = server.set_password(None);
    let options = options.connection_timeout(CONNECT_TIMEOUT);
    bounded("NATS", url, options.connect(server.as_str())).await
}

/// The `host:port[,host:port]` list of a `kafka://` URL. Credentials have no place in it (the
/// CLI sets no SASL): a user-info or a query is refused, without being shown.
pub(crate) fn kafka_brokers(url: &str) -> anyhow::Result<&str> {
    let Some(brokers) = url.strip_prefix("kafka://") else {
        bail!("{}: not a kafka:// URL", Redacted(url))
    };
    let brokers = brokers.trim_end_matches('/');
    if brokers.contains(['@', '?', '#', '/']) || brokers.is_empty() {
        bail!(
            "{}: expected kafka://host:port[,host:port] (no user, password, path or parameters)",
            Redacted(url)
        );
    }
    Ok(brokers)
}

/// Checks that a Kafka broker of `brokers` answers a metadata request within the bound.
/// librdkafka's clients connect lazily and retry forever, so without this an unreachable
/// cluster shows only as publishes that time out minutes later.
#[cfg(feature = "kafka")]
pub(crate) async fn kafka_reachable(brokers: &str) -> anyhow::Result<()> {
    use idem::kafka::rdkafka::ClientConfig;
    use idem::kafka::rdkafka::producer::{BaseProducer, Producer as _};
    let (tx, rx) = tokio::sync::oneshot::channel();
    let list = brokers.to_owned();
    // librdkafka blocks; a client's close can hang against some brokers, so the probe runs on
    // a thread of its own that is abandoned if it outlives the bound.
    std::thread::Builder::new()
        .name("idem: kafka probe".into())
        .spawn(move || {
            let probe = || -> anyhow::Result<()> {
                let producer: BaseProducer =
                    ClientConfig::new().set("bootstrap.servers", &list).create()?;
                // librdkafka retries a refused or silent broker until the timeout, then says
                // "broker transport failure".
                let within = CONNECT_TIMEOUT * 9 / 10;
                producer.client().fetch_metadata(None, within).with_context(|| {
                    format!("no answer within {} s to a metadata request", within.as_secs())
                })?;
                Ok(())
            };
            drop(tx.send(probe()));
        })
        .context("starting a thread to reach Kafka")?;
    let url = format!("kafka://{brokers}");
    bounded("Kafka", &url, async { rx.await.map_err(|_| anyhow!("the probe's thread panicked"))? })
        .await
}

/// An idempotent Kafka producer for `brokers`, once a broker has answered.
#[cfg(feature = "kafka")]
pub(crate) async fn kafka_publisher(brokers: &str) -> anyhow::Result<idem::kafka::KafkaPublisher> {
    kafka_reachable(brokers).await?;
    idem::kafka::KafkaPublisher::new(brokers)
        .with_context(|| format!("creating a Kafka producer for kafka://{brokers}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kafka_urls_take_hosts_only_and_never_echo_a_password() {
        assert_eq!(kafka_brokers("kafka://a:9092,b:9092/").ok(), Some("a:9092,b:9092"));
        for bad in ["kafka://u:hunter2@a:9092", "kafka://a:9092?sasl.password=hunter2", "kafka://"]
        {
            let e = kafka_brokers(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("expected kafka://host:port") && !e.contains("hunter2"), "{e}");
        }
    }

    #[tokio::test]
    async fn a_refused_connection_names_the_service_and_hides_the_password() {
        let url = "postgres://u:hunter2@127.0.0.1:1/db?password=hunter2";
        let e = pg_pool(url, PgPoolOptions::new()).await.err().map(|e| format!("{e:#}"));
        let e = e.unwrap_or_default();
        assert!(
            e.starts_with("cannot connect to PostgreSQL at postgres://u:***@127.0.0.1:1/db"),
            "{e}"
        );
        assert!(!e.contains("hunter2"), "{e}");
    }

    #[tokio::test]
    async fn nats_urls_with_parameters_are_refused_without_showing_them() {
        let e = nats_client("nats://127.0.0.1:1?token=hunter2").await.err().map(|e| e.to_string());
        let e = e.unwrap_or_default();
        assert!(e.contains("takes no parameters") && !e.contains("hunter2"), "{e}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_server_is_given_up_on_after_the_bound() {
        let e = bounded(
            "NATS",
            "nats://u:hunter2@h:4222",
            std::future::pending::<anyhow::Result<()>>(),
        )
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert_eq!(e, "cannot connect to NATS at nats://u:***@h:4222: no answer within 10 s");
    }
}
