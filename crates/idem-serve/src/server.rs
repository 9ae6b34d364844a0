//! Serving the router: plain HTTP or TLS, HTTP/1.1 and HTTP/2, within [`Limits`], with a
//! bounded graceful shutdown.

use crate::ApiError;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tower::ServiceExt as _;

/// How long open connections get to finish after the shutdown signal ([`Limits`]'s default).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// What the listener lets clients hold: connections, streams, requests and time. Every bound
/// applies before a token is checked, so a caller without one costs at most its headers.
///
/// In `idem serve`'s file, the `[limits]` table (every key optional):
///
/// ```toml
/// [limits]
/// max_connections = 1024           # open connections; one more is closed at once
/// max_streams_per_connection = 100 # HTTP/2 streams at a time on one connection
/// max_in_flight = 512              # requests being answered; one more gets 503 `busy`
/// header_timeout_ms = 10000        # TLS handshake and headers of a connection's first request
/// request_timeout_ms = 30000       # reading a request's body and answering it: 408 after
/// idle_timeout_ms = 60000          # an HTTP/2 connection with no request for this long is closed
/// drain_timeout_ms = 10000         # after SIGTERM: open requests finish, then connections close
/// ```
///
/// ```
/// use std::time::Duration;
/// let limits = idem_serve::Limits::default().max_connections(64).header_timeout(Duration::from_secs(5));
/// assert_eq!(limits.max_connections, 64);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct Limits {
    /// Open connections (default 1024). One more is accepted and closed at once.
    pub max_connections: usize,
    /// HTTP/2 streams at a time on one connection (default 100); a client opens more only as
    /// earlier ones end.
    pub max_streams_per_connection: u32,
    /// Requests being answered at a time, on every connection together (default 512); one more
    /// is answered `503` (`busy`, retryable) at once.
    pub max_in_flight: usize,
    /// The TLS handshake, and the headers of each HTTP/1.1 request (of the first request on an
    /// HTTP/2 connection), must arrive within this many ms (default 10,000).
    pub header_timeout_ms: u64,
    /// Reading a request's body and answering it (default 30,000 ms): past it, `408`
    /// (`request_timeout`, retryable).
    pub request_timeout_ms: u64,
    /// An HTTP/2 connection with no request open for this long is closed (default 60,000 ms).
    /// An HTTP/1.1 connection waits for its next request's headers `header_timeout_ms`.
    pub idle_timeout_ms: u64,
    /// After the shutdown signal, open requests get this long to finish (default 10,000 ms);
    /// then every connection is closed.
    pub drain_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_streams_per_connection: 100,
            max_in_flight: 512,
            header_timeout_ms: 10_000,
            request_timeout_ms: 30_000,
            idle_timeout_ms: 60_000,
            drain_timeout_ms: ms(DRAIN_TIMEOUT),
        }
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The largest value of each time bound: an hour.
const MAX_TIMEOUT_MS: u64 = 3_600_000;

impl Limits {
    /// With at most `n` open connections.
    #[must_use]
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n;
        self
    }

    /// With at most `n` HTTP/2 streams at a time per connection.
    #[must_use]
    pub fn max_streams_per_connection(mut self, n: u32) -> Self {
        self.max_streams_per_connection = n;
        self
    }

    /// With at most `n` requests answered at a time.
    #[must_use]
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// With this bound on the TLS handshake and on request headers.
    #[must_use]
    pub fn header_timeout(mut self, d: Duration) -> Self {
        self.header_timeout_ms = ms(d);
        self
    }

    /// With this bound on reading a request's body and answering it.
    #[must_use]
    pub fn request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout_ms = ms(d);
        self
    }

    /// Closing connections with no request open for this long.
    #[must_use]
    pub fn idle_timeout(mut self, d: Duration) -> Self {
        self.idle_timeout_ms = ms(d);
        self
    }

    /// With this bound on the drain after the shutdown signal.
    #[must_use]
    pub fn drain_timeout(mut self, d: Duration) -> Self {
        self.drain_timeout_ms = ms(d);
        self
    }

    /// Checks every bound: counts at least 1, times from 1 ms to an hour.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`](crate::config::ConfigError::Invalid) naming the key
    /// (`limits.header_timeout_ms`) and its range.
    pub fn validate(&self) -> Result<(), crate::config::ConfigError> {
        let invalid = |field: &str, problem: String| crate::config::ConfigError::Invalid {
            field: format!("limits.{field}"),
            problem,
        };
        for (field, n, max) in [
            ("max_connections", self.max_connections, 1_000_000),
            ("max_in_flight", self.max_in_flight, 1_000_000),
            ("max_streams_per_connection", self.max_streams_per_connection as usize, 10_000),
        ] {
            if !(1..=max).contains(&n) {
                return Err(invalid(field, format!("is {n}; give 1 to {max}")));
            }
        }
        for (field, v) in [
            ("header_timeout_ms", self.header_timeout_ms),
            ("request_timeout_ms", self.request_timeout_ms),
            ("idle_timeout_ms", self.idle_timeout_ms),
            ("drain_timeout_ms", self.drain_timeout_ms),
        ] {
            if !(1..=MAX_TIMEOUT_MS).contains(&v) {
                return Err(invalid(field, format!("is {v} ms; give 1 to {MAX_TIMEOUT_MS} ms")));
            }
        }
        Ok(())
    }

    fn header_timeout_d(&self) -> Duration {
        Duration::from_millis(self.header_timeout_ms)
    }
    fn idle_timeout_d(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }
    fn drain_timeout_d(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }
}

/// The listener's TLS could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// The certificate file holds no certificate, or one does not parse.
    #[error("tls.cert: {0}")]
    Cert(String),
    /// The key file holds no private key, or it does not parse.
    #[error("tls.key: {0}")]
    Key(String),
    /// The key does not match the certificate, or rustls refused them.
    #[error("tls: {0}")]
    Config(String),
}

/// A TLS acceptor (TLS 1.2 and 1.3, rustls on `ring`, ALPN `h2` and `http/1.1`) from PEM: the
/// certificate chain (leaf first) and its private key (PKCS#8, PKCS#1 or SEC1).
///
/// # Errors
/// [`TlsError`] naming the file at fault.
pub fn tls_acceptor(cert_pem: &[u8], key_pem: &[u8]) -> Result<TlsAcceptor, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Cert(e.to_string()))?;
    if certs.is_empty() {
        return Err(TlsError::Cert("no BEGIN CERTIFICATE block".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Key(e.to_string()))?;
    let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Serves `app` on `listener` (through `tls` when given), HTTP/1.1 and HTTP/2, within `limits`,
/// until `shutdown` resolves; then stops accepting, lets open requests finish for up to
/// `limits.drain_timeout_ms` and closes every connection. It returns within that bound.
///
/// # Errors
/// [`ConfigError`](crate::config::ConfigError) as an I/O error of kind `InvalidInput` when a
/// limit is out of range.
pub async fn serve(
    app: Router,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    limits
        .validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let limits = Arc::new(limits);
    let app = app.layer(axum::middleware::from_fn_with_state(
        Arc::new(Bounds {
            in_flight: Arc::new(Semaphore::new(limits.max_in_flight)),
            timeout: Duration::from_millis(limits.request_timeout_ms),
        }),
        bound_request,
    ));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout_d());
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.max_streams_per_connection)
        .max_header_list_size(HEADER_LIST_BYTES);
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut open = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            Some(_) = open.join_next() => continue,
            () = &mut shutdown => break,
        };
        let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
            // Closed at once: the client sees its connection end, not a queue.
            tracing::debug!(%peer, limit = limits.max_connections, "connection refused: at the limit");
            metrics::counter!(REFUSED_CONNECTIONS_TOTAL).increment(1);
            drop(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let conn = Conn {
            tls: tls.clone(),
            app: app.clone(),
            builder: builder.clone(),
            limits: Arc::clone(&limits),
            stop: stop_rx.clone(),
        };
        open.spawn(async move {
            conn.run(tcp, peer).await;
            drop(permit);
        });
    }
    let _ = stop_tx.send(true);
    // Each connection bounds its own drain; this bound only guards against a bug there.
    let all = async { while open.join_next().await.is_some() {} };
    if tokio::time::timeout(limits.drain_timeout_d() + Duration::from_secs(1), all).await.is_err() {
        tracing::warn!("connections still open after the drain; closing them");
        open.shutdown().await;
    }
    Ok(())
}

/// Connections refused at [`Limits::max_connections`].
pub(crate) const REFUSED_CONNECTIONS_TOTAL: &str = "idem_api_refused_connections_total";

/// Requests refused at [`Limits::max_in_flight`] (`busy`) or cut at the request timeout.
pub(crate) const REQUESTS_BOUNDED_TOTAL: &str = "idem_api_bounded_requests_total";

/// The largest HTTP/2 header block read: the API's headers are a token and a content type.
const HEADER_LIST_BYTES: u32 = 64 * 1024;

/// The bounds every request passes: a slot among `max_in_flight`, and the request timeout.
struct Bounds {
    in_flight: Arc<Semaphore>,
    timeout: Duration,
}

async fn bound_request(
    State(b): State<Arc<Bounds>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let grpc = crate::grpc::is_grpc(req.headers());
    let answer = |e: ApiError| e.respond(grpc);
    let Ok(_slot) = b.in_flight.try_acquire() else {
        metrics::counter!(REQUESTS_BOUNDED_TOTAL, "reason" => "busy").increment(1);
        return answer(ApiError::Busy);
    };
    match tokio::time::timeout(b.timeout, next.run(req)).await {
        Ok(res) => res,
        Err(_) => {
            metrics::counter!(REQUESTS_BOUNDED_TOTAL, "reason" => "timeout").increment(1);
            answer(ApiError::RequestTimeout { ms: ms(b.timeout) })
        }
    }
}

/// One accepted connection: its TLS handshake, its requests, its idle and drain bounds.
struct Conn {
    tls: Option<TlsAcceptor>,
    app: Router,
    builder: auto::Builder<TokioExecutor>,
    limits: Arc<Limits>,
    stop: watch::Receiver<bool>,
}

impl Conn {
    async fn run(self, tcp: TcpStream, peer: std::net::SocketAddr) {
        let started = tokio::time::Instant::now();
        let Some(tls) = self.tls.clone() else {
            return self.serve(TokioIo::new(tcp), peer, started).await;
        };
        match tokio::time::timeout(self.limits.header_timeout_d(), tls.accept(tcp)).await {
            Ok(Ok(stream)) => self.serve(TokioIo::new(stream), peer, started).await,
            Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
            Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
        }
    }

    async fn serve<I>(self, io: TokioIo<I>, peer: std::net::SocketAddr, started: Instant)
    where
        I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let activity = Arc::new(Activity::new(started));
        let seen = Arc::clone(&activity);
        let app = self.app;
        let svc = tower::service_fn(move |req: axum::extract::Request<hyper::body::Incoming>| {
            let open = seen.open();
            let call = app.clone().oneshot(req.map(axum::body::Body::new));
            async move {
                let res = call.await;
                drop(open);
                res
            }
        });
        let conn = self.builder.serve_connection_with_upgrades(io, TowerToHyperService::new(svc));
        let mut conn = std::pin::pin!(conn);
        let mut stop = self.stop;
        let mut draining: Option<Instant> = None;
        loop {
            let deadline = match draining {
                Some(end) => end,
                None => activity.quiet_until(&self.limits),
            };
            tokio::select! {
                done = conn.as_mut() => {
                    if let Err(e) = done {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                    return;
                }
                _ = stop.wait_for(|s| *s), if draining.is_none() => {
                    conn.as_mut().graceful_shutdown();
                    draining = Some(Instant::now() + self.limits.drain_timeout_d());
                }
                // A request ended: the deadline moves.
                () = activity.ended.notified(), if draining.is_none() => {}
                () = tokio::time::sleep_until(deadline) => {
                    if draining.is_some() {
                        tracing::debug!(%peer, "connection closed: still open after the drain");
                        return;
                    }
                    if activity.quiet_until(&self.limits) <= Instant::now() {
                        tracing::debug!(%peer, "connection closed: idle");
                        conn.as_mut().graceful_shutdown();
                        draining = Some(Instant::now() + self.limits.drain_timeout_d());
                    }
                }
            }
        }
    }
}

/// When a connection last had a request open, and how many it has.
struct Activity {
    epoch: Instant,
    /// Requests open now.
    open: AtomicUsize,
    /// Requests answered so far (0: the header timeout applies, not the idle one).
    served: AtomicU64,
    /// When the last request ended, in ms since `epoch`.
    last_ms: AtomicU64,
    /// Told when a request ends (one waiter: the connection's task).
    ended: Notify,
}

impl Activity {
    fn new(epoch: Instant) -> Self {
        Self {
            epoch,
            open: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            last_ms: AtomicU64::new(0),
            ended: Notify::new(),
        }
    }

    fn open(self: &Arc<Self>) -> Open {
        self.open.fetch_add(1, Ordering::SeqCst);
        Open(Arc::clone(self))
    }

    /// Until when the connection may stay as it is: with a request open, one idle period from
    /// now (the request timeout bounds the request); otherwise the header timeout after the
    /// connection opened, before its first request, and the idle timeout after its last.
    fn quiet_until(&self, limits: &Limits) -> Instant {
        if self.open.load(Ordering::SeqCst) > 0 {
            return Instant::now() + limits.idle_timeout_d();
        }
        let last = self.epoch + Duration::from_millis(self.last_ms.load(Ordering::SeqCst));
        if self.served.load(Ordering::SeqCst) == 0 {
            last + limits.header_timeout_d()
        } else {
            last + limits.idle_timeout_d()
        }
    }
}

/// A request open on a connection; its end (answered, or dropped by a reset) is noted.
struct Open(Arc<Activity>);

impl Drop for Open {
    fn drop(&mut self) {
        let a = &self.0;
        a.last_ms.store(ms(a.epoch.elapsed()), Ordering::SeqCst);
        a.served.fetch_add(1, Ordering::SeqCst);
        a.open.fetch_sub(1, Ordering::SeqCst);
        a.ended.notify_one();
    }
}

/// The claim API over a store: every route of `/v1`, `/healthz`, `/readyz`, `/openapi.json`,
/// `/metrics` when given a renderer, and the gRPC service `idem.v1.Claims` (HTTP/2, same port). Serve it with [`serve`](crate::serve) or any axum server.
///
/// ```
/// use idem_serve::{Scopes, Token, Tokens};
///
/// let tokens = Tokens::new(vec![
///     Token::new("orders-service", "a-long-random-secret", Scopes::from_list(["orders"]))?,
/// ])?;
/// let app: axum::Router = idem_serve::router(idem_core::MemoryStore::new(), tokens, None);
/// # Ok::<_, Box<dyn std::error::Error>>(())
/// ```
pub fn router<S: idem_core::DedupStore + idem_core::InspectStore>(
    store: S,
    tokens: crate::Tokens,
    metrics: Option<crate::MetricsRender>,
) -> Router {
    assemble(
        crate::ops::AppState { store: Arc::new(store), tokens: Arc::new(tokens), metrics },
        None,
    )
}

/// The API's routes, with `extra` routes (the console's) beside them.
pub(crate) fn assemble(state: crate::ops::AppState, extra: Option<Router>) -> Router {
    let anonymous = state.tokens.is_anonymous();
    let mut app = crate::http::routes(state.clone())
        .route("/openapi.json", axum::routing::get(crate::openapi::document));
    if let Some(extra) = extra {
        app = app.merge(extra);
    }
    app = app
        .route_service("/idem.v1.Claims/{*method}", crate::grpc::service(state))
        .layer(axum::extract::DefaultBodyLimit::max(crate::wire::MAX_BODY_BYTES));
    if anonymous {
        app = app.layer(axum::middleware::from_fn(crate::auth::loopback_host_only));
    }
    // Outermost: it sees every refusal, the anonymous host check's included.
    app.layer(axum::middleware::from_fn(crate::ops::audit))
}
