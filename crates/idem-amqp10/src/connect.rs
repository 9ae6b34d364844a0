//! Opening the connection and the session: TCP, TLS on `ring`, SASL.

use std::sync::Arc;
use std::time::Duration;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::sasl_profile::SaslProfile;
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::{Connection, Session};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::ServerName;

use crate::error::Error;
use crate::servicebus::Credential;
use crate::tls::Tls;

/// Where and how to connect.
#[derive(Clone)]
pub(crate) enum Endpoint {
    /// `amqp://user:pass@host:port` or `amqps://…`.
    Url(String),
    /// A Service Bus namespace: TLS on 5671, SASL ANONYMOUS, then a `$cbs` token.
    ServiceBus { namespace: String, host: String, port: u16, tls: bool, credential: Credential },
}

impl std::fmt::Debug for Endpoint {
    // Never print a password or a key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // The password and secret query parameters (`?password=`, `?sig=`…) as ***.
            Self::Url(u) => write!(f, "{}", idem_core::redact::Redacted(u)),
            Self::ServiceBus { namespace, host, port, .. } => {
                write!(f, "servicebus://{namespace} at {host}:{port}")
            }
        }
    }
}

pub(crate) struct Opened {
    pub(crate) connection: ConnectionHandle<()>,
    pub(crate) session: SessionHandle<()>,
    pub(crate) addr: String,
}

struct Target {
    /// The server's name: the AMQP `open` hostname and the TLS server name.
    name: String,
    /// Where to connect.
    host: String,
    port: u16,
    tls: bool,
    sasl: SaslProfile,
}

fn target(endpoint: &Endpoint) -> Result<Target, Error> {
    match endpoint {
        Endpoint::Url(raw) => {
            let url = url::Url::parse(raw).map_err(|e| Error::config("url", e.to_string()))?;
            let tls = match url.scheme() {
                "amqp" => false,
                "amqps" => true,
                other => {
                    return Err(Error::config(
                        "url",
                        format!("scheme `{other}` is not amqp or amqps"),
                    ));
                }
            };
            let host =
                url.host_str().ok_or_else(|| Error::config("url", "has no host"))?.to_owned();
            let port = url.port().unwrap_or(if tls { 5671 } else { 5672 });
            let user = percent_encoding::percent_decode_str(url.username())
                .decode_utf8_lossy()
                .into_owned();
            let sasl = if user.is_empty() {
                SaslProfile::Anonymous
            } else {
                let password = url.password().unwrap_or_default();
                let password =
                    percent_encoding::percent_decode_str(password).decode_utf8_lossy().into_owned();
                SaslProfile::Plain { username: user, password }
            };
            Ok(Target { name: host.clone(), host, port, tls, sasl })
        }
        Endpoint::ServiceBus { namespace, host, port, tls, .. } => Ok(Target {
            name: namespace.clone(),
            host: host.clone(),
            port: *port,
            tls: *tls,
            sasl: SaslProfile::Anonymous,
        }),
    }
}

/// Connects, opens the AMQP connection and begins one session, each step bounded.
pub(crate) async fn open(
    endpoint: &Endpoint,
    tls_settings: &Tls,
    container_id: &str,
    bound: Duration,
) -> Result<Opened, Error> {
    let t = target(endpoint)?;
    // Built before connecting, so a bad CA or key is a configuration error, not a retry.
    let tls_config = if t.tls { Some(tls_settings.client_config()?) } else { None };
    let addr = format!("{}:{}", t.host, t.port);
    let tcp = tokio::time::timeout(bound, TcpStream::connect(&addr))
        .await
        .map_err(|_| Error::Timeout { verb: "connect", after: bound })?
        .map_err(|source| Error::Connect { addr: addr.clone(), source })?;
    tcp.set_nodelay(true).map_err(|source| Error::Connect { addr: addr.clone(), source })?;
    let builder = Connection::builder()
        .container_id(container_id)
        .hostname(t.name.as_str())
        .scheme("amqp")
        .sasl_profile(t.sasl);
    let opening = async {
        if let Some(config) = tls_config {
            let stream = tls(config, &t.name, tcp)
                .await
                .map_err(|source| Error::Tls { addr: addr.clone(), source })?;
            builder.open_with_stream(stream).await
        } else {
            builder.open_with_stream(tcp).await
        }
        .map_err(|source| Error::Open { addr: addr.clone(), source })
    };
    let mut connection = tokio::time::timeout(bound, opening)
        .await
        .map_err(|_| Error::Timeout { verb: "open", after: bound })??;
    let session = tokio::time::timeout(bound, Session::begin(&mut connection))
        .await
        .map_err(|_| Error::Timeout { verb: "begin", after: bound })?
        .map_err(Error::Begin)?;
    Ok(Opened { connection, session, addr })
}

/// A verified TLS stream to `host` (certificate chain and name), per `config`.
async fn tls(
    config: Arc<tokio_rustls::rustls::ClientConfig>,
    host: &str,
    tcp: TcpStream,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let name = ServerName::try_from(host.to_owned()).map_err(std::io::Error::other)?;
    TlsConnector::from(config).connect(name, tcp).await
}
