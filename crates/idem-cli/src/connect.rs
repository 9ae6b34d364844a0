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
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
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

/// The CA and client certificate for the servers the CLI connects to (`--tls-ca`, `--tls-cert`,
/// `--tls-key`, or `IDEM_TLS_CA`, `IDEM_TLS_CERT`, `IDEM_TLS_KEY`): added to the OS trust store,
/// and presented when a server asks for a client certificate. A URL's own TLS settings
/// (`sslrootcert=`, `ssl-ca=`, …) win over them.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct TlsArgs {
    /// A CA certificate (PEM) to trust beside the OS trust store, for every server: PostgreSQL
    /// and MySQL (then verified with `verify-full` / `VERIFY_IDENTITY` unless the URL says
    /// otherwise), `rediss://`, `amqps://`, `tls://` (NATS), `kafka+ssl://`.
    #[arg(long, global = true, env = "IDEM_TLS_CA", value_name = "PEM")]
    pub(crate) tls_ca: Option<PathBuf>,
    /// A client certificate (PEM) to present where a server asks for one.
    #[arg(long, global = true, env = "IDEM_TLS_CERT", value_name = "PEM", requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM).
    #[arg(long, global = true, env = "IDEM_TLS_KEY", value_name = "PEM", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
}

impl TlsArgs {
    /// The same settings as environment variables, for a child process of the CLI.
    pub(crate) fn env(&self) -> Vec<(&'static str, &Path)> {
        [
            ("IDEM_TLS_CA", &self.tls_ca),
            ("IDEM_TLS_CERT", &self.tls_cert),
            ("IDEM_TLS_KEY", &self.tls_key),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_deref().map(|v| (k, v)))
        .collect()
    }

    fn client(&self) -> Option<(&Path, &Path)> {
        self.tls_cert.as_deref().zip(self.tls_key.as_deref())
    }
}

static TLS: OnceLock<TlsArgs> = OnceLock::new();

/// Sets the TLS files every connection uses; called once, from `main`.
pub(crate) fn set_tls(tls: TlsArgs) {
    let _ = TLS.set(tls);
}

/// The TLS files given on the command line or in the environment.
pub(crate) fn tls() -> &'static TlsArgs {
    TLS.get_or_init(TlsArgs::default)
}

fn read(path: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading the {what} {}", path.display()))
}

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
            let e = plaintext_hint(url, e.into());
            Err(e.context(format!("cannot connect to {service} at {}", Redacted(url))))
        }
        Err(_) => Err(anyhow!(
            "cannot connect to {service} at {}: no answer within {} s{}",
            Redacted(url),
            CONNECT_TIMEOUT.as_secs(),
            if wants_tls(url) { SILENT_OVER_TLS } else { "" }
        )),
    }
}

/// What a TLS client is told by a server that speaks no TLS: rustls reads the server's plaintext
/// greeting or error as a record (`InvalidContentType`), OpenSSL (librdkafka) as `wrong version
/// number`, sqlx as PostgreSQL's or MySQL's "no TLS here" answer.
const NOT_TLS: [&str; 4] =
    ["InvalidContentType", "wrong version number", "does not support TLS", "CorruptMessage"];

/// A server that speaks no TLS and waits for its own protocol never answers a TLS handshake.
const SILENT_OVER_TLS: &str = " (over TLS: a server that speaks no TLS does not answer a TLS \
                               handshake — is this its plaintext port?)";

/// `e`, with the failed TLS handshake named above the client's error when `url` asks for TLS
/// and the server answered in plaintext (or, on a client's own timeout, did not answer).
fn plaintext_hint(url: &str, e: anyhow::Error) -> anyhow::Error {
    if !wants_tls(url) {
        return e;
    }
    let chain = format!("{e:#}");
    let at = url::Url::parse(url).ok().and_then(|u| {
        let host = u.host_str()?.to_owned();
        Some(u.port().map_or_else(|| host.clone(), |p| format!("{host}:{p}")))
    });
    let at = at.unwrap_or_else(|| "the server".to_owned());
    if NOT_TLS.iter().any(|m| chain.contains(m)) {
        e.context(format!(
            "TLS handshake with {at} failed: the server did not answer with TLS — is this its \
             plaintext port?"
        ))
    } else if chain.contains("timed out") {
        e.context(format!("no answer from {at}{SILENT_OVER_TLS}"))
    } else {
        e
    }
}

/// Whether `url` asks for TLS: its scheme, or PostgreSQL's `sslmode` / MySQL's `ssl-mode` at
/// `require` or stricter.
fn wants_tls(url: &str) -> bool {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let scheme = scheme.to_ascii_lowercase();
    if ["rediss", "amqps", "tls", "amqp10s", "kafka+ssl", "kafka+sasl-ssl"]
        .contains(&scheme.as_str())
    {
        return true;
    }
    let query = rest.split_once('?').map_or("", |(_, q)| q).to_ascii_lowercase();
    query.split('&').any(|kv| {
        matches!(
            kv.split_once('='),
            Some((
                "sslmode" | "ssl-mode" | "ssl_mode",
                "require"
                    | "required"
                    | "verify-ca"
                    | "verify_ca"
                    | "verify-full"
                    | "verify_identity"
            ))
        )
    })
}

/// A PostgreSQL pool of `pool`'s settings (its acquire timeout becomes the bound).
///
/// One connection is opened on its own first: the pool itself retries a refused connection
/// until its timeout and then reports only "pool timed out", hiding why.
pub(crate) async fn pg_pool(url: &str, pool: PgPoolOptions) -> anyhow::Result<PgPool> {
    let mut opts: PgConnectOptions =
        url.parse().with_context(|| format!("PostgreSQL URL {}", Redacted(url)))?;
    let tls = tls();
    if let Some(ca) = &tls.tls_ca
        && !url.contains("sslrootcert")
    {
        opts = opts.ssl_root_cert(ca);
        if !url.contains("sslmode") {
            opts = opts.ssl_mode(idem::sqlx::postgres::PgSslMode::VerifyFull);
        }
    }
    if let Some((cert, key)) = tls.client()
        && !url.contains("sslcert")
    {
        opts = opts.ssl_client_cert(cert).ssl_client_key(key);
    }
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
    let mut opts: MySqlConnectOptions =
        driver_url.parse().with_context(|| format!("{service} URL {}", Redacted(url)))?;
    let tls = tls();
    if let Some(ca) = &tls.tls_ca
        && !url.contains("ssl-ca")
        && !url.contains("sslca")
    {
        opts = opts.ssl_ca(ca);
        if !url.contains("ssl-mode") && !url.contains("sslmode") {
            opts = opts.ssl_mode(idem::sqlx::mysql::MySqlSslMode::VerifyIdentity);
        }
    }
    if let Some((cert, key)) = tls.client()
        && !url.contains("ssl-cert")
        && !url.contains("sslcert")
    {
        opts = opts.ssl_client_cert(cert).ssl_client_key(key);
    }
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

/// A Redis client for `url`; nothing is connected yet. `rediss://` trusts the OS store and
/// `--tls-ca`, and presents `--tls-cert` when asked.
pub(crate) fn redis_client(url: &str) -> anyhow::Result<redis::Client> {
    let tls = tls();
    let client = if url.starts_with("rediss://") && (tls.tls_ca.is_some() || tls.client().is_some())
    {
        idem::redis::install_crypto_provider();
        let certs = redis::TlsCertificates {
            client_tls: match tls.client() {
                Some((cert, key)) => Some(redis::ClientTlsConfig {
                    client_cert: read(cert, "client certificate")?,
                    client_key: read(key, "client key")?,
                }),
                None => None,
            },
            root_cert: tls.tls_ca.as_deref().map(|ca| read(ca, "CA certificate")).transpose()?,
        };
        redis::Client::build_with_tls(url, certs)
    } else {
        idem::redis::install_crypto_provider();
        redis::Client::open(url)
    };
    client.with_context(|| format!("Redis URL {}", Redacted(url)))
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
    let builder = RedisStore::builder_for(redis_client(url)?);
    let builder = configure(builder.response_timeout(CONNECT_TIMEOUT))?;
    bounded("Redis", url, builder.connect()).await
}

/// The AMQP heartbeat the CLI asks for when the URL names none, in seconds. lapin closes a
/// connection that read nothing for two heartbeats, and RabbitMQ one that sent nothing for two,
/// so a half-open connection (a partition, a peer that lost power) is noticed within about
/// 20–25 s instead of 120 s (RabbitMQ's own 60 s) or never (a server with heartbeats off).
/// `?heartbeat=N` in the URL wins; the lower of the two sides' values is used.
pub(crate) const AMQP_HEARTBEAT_SECS: u16 = 10;

/// `url` with `heartbeat=` [`AMQP_HEARTBEAT_SECS`] added when it names none.
fn with_default_heartbeat(url: &str) -> Cow<'_, str> {
    let query = url.split_once('?').map(|(_, q)| q);
    if query.is_some_and(|q| q.split('&').any(|p| p.starts_with("heartbeat="))) {
        return Cow::Borrowed(url);
    }
    let sep = if query.is_some() { '&' } else { '?' };
    Cow::Owned(format!("{url}{sep}heartbeat={AMQP_HEARTBEAT_SECS}"))
}

/// A RabbitMQ (AMQP 0-9-1) connection: `amqps://` is verified TLS (the OS store and
/// `--tls-ca`; `--tls-cert` presented, for `?auth_mechanism=external` say), with a heartbeat of
/// [`AMQP_HEARTBEAT_SECS`] unless the URL names one.
pub(crate) async fn amqp_connection(url: &str) -> anyhow::Result<idem::amqp::lapin::Connection> {
    use idem::amqp::lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
    let props = idem::amqp::lapin::ConnectionProperties::default();
    let tls = tls();
    let config = OwnedTLSConfig {
        identity: match tls.client() {
            Some((cert, key)) => Some(OwnedIdentity::PKCS8 {
                pem: read(cert, "client certificate")?,
                key: read(key, "client key")?,
            }),
            None => None,
        },
        cert_chain: match &tls.tls_ca {
            Some(ca) => Some(String::from_utf8_lossy(&read(ca, "CA certificate")?).into_owned()),
            None => None,
        },
    };
    let runtime = idem::amqp::lapin::runtime::default_runtime()?;
    let with_heartbeat = with_default_heartbeat(url);
    let connecting =
        idem::amqp::lapin::Connection::connect_with_config(&with_heartbeat, props, config, runtime);
    bounded("RabbitMQ", url, connecting).await
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
    let mut options = options.connection_timeout(CONNECT_TIMEOUT);
    let tls = tls();
    if let Some(ca) = &tls.tls_ca {
        options = options.add_root_certificates(ca.clone());
    }
    if let Some((cert, key)) = tls.client() {
        options = options.add_client_certificate(cert.to_owned(), key.to_owned());
    }
    bounded("NATS", url, options.connect(server.as_str())).await
}

/// Where a Kafka cluster is and how to reach it: `kafka://host:port[,host:port]` (plaintext),
/// `kafka+ssl://…` (TLS, trusting the OS store or `--tls-ca`, presenting `--tls-cert`),
/// `kafka+sasl-ssl://user:password@…` and `kafka+sasl://user:password@…` (SASL over TLS or
/// plaintext; `?mechanism=SCRAM-SHA-512`, default PLAIN).
#[derive(Clone)]
pub(crate) struct KafkaTarget {
    pub(crate) brokers: String,
    security: Vec<(&'static str, String)>,
}

impl std::fmt::Debug for KafkaTarget {
    // The SASL password never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let keys: Vec<&str> = self.security.iter().map(|(k, _)| *k).collect();
        f.debug_struct("KafkaTarget")
            .field("brokers", &self.brokers)
            .field("security", &keys)
            .finish()
    }
}

impl KafkaTarget {
    /// The client settings: the brokers and the security settings.
    #[cfg(feature = "kafka")]
    pub(crate) fn config(&self) -> idem::kafka::rdkafka::ClientConfig {
        let mut c = idem::kafka::rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        for (k, v) in &self.security {
            c.set(*k, v);
        }
        c
    }

    /// Whether the settings are plaintext, without SASL.
    pub(crate) fn is_plain(&self) -> bool {
        self.security.is_empty()
    }
}

/// Parses a Kafka URL (see [`KafkaTarget`]); a malformed one is refused without being shown.
pub(crate) fn kafka_target(url: &str) -> anyhow::Result<KafkaTarget> {
    const FORMS: &str = "expected kafka://host:port[,host:port], kafka+ssl://…, \
                         kafka+sasl-ssl://user:password@… or kafka+sasl://user:password@…";
    let (scheme, rest) = url.split_once("://").unwrap_or(("", ""));
    let (tls_on, sasl) = match scheme {
        "kafka" => (false, false),
        "kafka+ssl" => (true, false),
        "kafka+sasl-ssl" => (true, true),
        "kafka+sasl" => (false, true),
        _ => bail!("{}: not a Kafka URL; {FORMS}", Redacted(url)),
    };
    let (authority, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = authority.trim_end_matches('/');
    let (user_info, brokers) = match authority.rsplit_once('@') {
        Some((u, b)) => (Some(u), b),
        None => (None, authority),
    };
    if brokers.is_empty() || brokers.contains(['/', '#', '@']) || (user_info.is_some() != sasl) {
        bail!("{}: {FORMS} (credentials only with SASL)", Redacted(url));
    }
    let mut security = Vec::new();
    if tls_on || sasl {
        let protocol = match (tls_on, sasl) {
            (true, true) => "SASL_SSL",
            (true, false) => "SSL",
            _ => "SASL_PLAINTEXT",
        };
        security.push(("security.protocol", protocol.to_owned()));
    }
    if let Some(user_info) = user_info {
        let (user, password) = user_info.split_once(':').unwrap_or((user_info, ""));
        let decode =
            |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
        let mut mechanism = "PLAIN".to_owned();
        for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
            match k.as_ref() {
                "mechanism" => mechanism = v.to_ascii_uppercase(),
                _ => bail!("{}: unknown parameter (only `mechanism`)", Redacted(url)),
            }
        }
        security.push(("sasl.mechanism", mechanism));
        security.push(("sasl.username", decode(user)));
        security.push(("sasl.password", decode(password)));
    } else if !query.is_empty() {
        bail!("{}: {FORMS} (parameters only with SASL)", Redacted(url));
    }
    if tls_on {
        let tls = tls();
        if let Some(ca) = &tls.tls_ca {
            security.push(("ssl.ca.location", ca.display().to_string()));
        }
        if let Some((cert, key)) = tls.client() {
            security.push(("ssl.certificate.location", cert.display().to_string()));
            security.push(("ssl.key.location", key.display().to_string()));
        }
        security.push(("ssl.endpoint.identification.algorithm", "https".to_owned()));
    }
    Ok(KafkaTarget { brokers: brokers.to_owned(), security })
}

/// Checks that a Kafka broker of `target` answers a metadata request within the bound.
/// librdkafka's clients connect lazily and retry forever, so without this an unreachable
/// cluster shows only as publishes that time out minutes later.
#[cfg(feature = "kafka")]
pub(crate) async fn kafka_reachable(target: &KafkaTarget) -> anyhow::Result<()> {
    use idem::kafka::rdkafka::producer::{BaseProducer, Producer as _};
    let (tx, rx) = tokio::sync::oneshot::channel();
    let config = target.config();
    // librdkafka blocks; a client's close can hang against some brokers, so the probe runs on
    // a thread of its own that is abandoned if it outlives the bound.
    std::thread::Builder::new()
        .name("idem: kafka probe".into())
        .spawn(move || {
            let probe = || -> anyhow::Result<()> {
                let producer: BaseProducer = config.create()?;
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
    let url = format!("kafka://{}", target.brokers);
    bounded("Kafka", &url, async { rx.await.map_err(|_| anyhow!("the probe's thread panicked"))? })
        .await
}

/// An idempotent Kafka producer for `target`, once a broker has answered.
#[cfg(feature = "kafka")]
pub(crate) async fn kafka_publisher(
    target: &KafkaTarget,
) -> anyhow::Result<idem::kafka::KafkaPublisher> {
    kafka_reachable(target).await?;
    idem::kafka::KafkaPublisher::with_config(&target.config())
        .with_context(|| format!("creating a Kafka producer for kafka://{}", target.brokers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_amqp_url_gets_a_heartbeat_unless_it_names_one() {
        assert_eq!(with_default_heartbeat("amqp://h/%2f"), "amqp://h/%2f?heartbeat=10");
        assert_eq!(
            with_default_heartbeat("amqp://h/%2f?frame_max=8192"),
            "amqp://h/%2f?frame_max=8192&heartbeat=10"
        );
        assert_eq!(
            with_default_heartbeat("amqp://h/%2f?heartbeat=30"),
            "amqp://h/%2f?heartbeat=30"
        );
        assert_eq!(with_default_heartbeat("amqp://h/%2f?heartbeat=0"), "amqp://h/%2f?heartbeat=0");
    }

    #[test]
    fn kafka_urls_say_how_to_connect_and_never_echo_a_password() {
        let t = kafka_target("kafka://a:9092,b:9092/").ok();
        assert_eq!(
            t.as_ref().map(|t| (t.brokers.as_str(), t.is_plain())),
            Some(("a:9092,b:9092", true))
        );
        let t = kafka_target("kafka+sasl-ssl://app:hunter2@a:9093?mechanism=scram-sha-512").ok();
        let t = t.map(|t| t.security).unwrap_or_default();
        assert!(t.contains(&("security.protocol", "SASL_SSL".to_owned())), "{t:?}");
        assert!(t.contains(&("sasl.mechanism", "SCRAM-SHA-512".to_owned())), "{t:?}");
        assert!(t.contains(&("sasl.password", "hunter2".to_owned())), "{t:?}");
        let dbg = format!("{:?}", kafka_target("kafka+sasl://app:hunter2@a:9092").ok());
        assert!(!dbg.contains("hunter2"), "{dbg}");
        for bad in [
            "kafka://u:hunter2@a:9092",
            "kafka://a:9092?sasl.password=hunter2",
            "kafka://",
            "kafka+sasl-ssl://a:9093",
            "kafka+sasl://u:hunter2@a:9092?password=hunter2",
            "kafkas://a:9092",
        ] {
            let e = kafka_target(bad).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("kafka") && !e.contains("hunter2"), "{bad}: {e}");
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

    #[test]
    fn a_plaintext_answer_to_tls_is_named_with_its_port() {
        let e = plaintext_hint(
            "amqps://guest:hunter2@127.0.0.1:5672/%2f",
            anyhow!("IO error: received corrupt message of type InvalidContentType"),
        );
        assert_eq!(
            format!("{e:#}"),
            "TLS handshake with 127.0.0.1:5672 failed: the server did not answer with TLS — is \
             this its plaintext port?: IO error: received corrupt message of type \
             InvalidContentType"
        );
        let pg = plaintext_hint(
            "postgres://u@h:5432/db?sslmode=require",
            anyhow!(
                "error occurred while attempting to establish a TLS connection: server does not support TLS"
            ),
        );
        assert!(format!("{pg:#}").starts_with("TLS handshake with h:5432 failed"), "{pg:#}");
        let redis = plaintext_hint("rediss://h:6379", anyhow!("Redis `connect` failed: timed out"));
        assert!(format!("{redis:#}").contains("is this its plaintext port?"), "{redis:#}");
        // Without TLS asked for, or for another failure, the client's error is left alone.
        let plain = plaintext_hint("amqp://h:5672", anyhow!("InvalidContentType"));
        assert_eq!(format!("{plain:#}"), "InvalidContentType");
        let refused = plaintext_hint("rediss://h:6380", anyhow!("Connection refused"));
        assert_eq!(format!("{refused:#}"), "Connection refused");
        assert!(wants_tls("mysql://u@h/db?ssl-mode=VERIFY_IDENTITY"));
        assert!(!wants_tls("postgres://u@h/db?sslmode=prefer"));
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
