//! Serving the router: plain HTTP or TLS, HTTP/1.1 and HTTP/2, with graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// How long open connections get to finish after the shutdown signal.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

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

/// Serves `app` on `listener` (through `tls` when given) until `shutdown` resolves, then stops
/// accepting and lets open requests finish for up to [`DRAIN_TIMEOUT`].
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve(
    app: Router,
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let Some(tls) = tls else {
        return axum::serve(listener, app).with_graceful_shutdown(shutdown).await;
    };
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
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
            () = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        let tls = tls.clone();
        let app = app.clone();
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(DRAIN_TIMEOUT, tls.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => return,
            };
            let conn = builder.serve_connection_with_upgrades(
                TokioIo::new(stream),
                TowerToHyperService::new(app),
            );
            if let Err(e) = watcher.watch(conn.into_owned()).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown()).await.is_err() {
        tracing::warn!("connections still open after {DRAIN_TIMEOUT:?}; closing them");
    }
    Ok(())
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
    let mut app = crate::http::routes(state.clone())
        .route("/openapi.json", axum::routing::get(crate::openapi::document));
    if let Some(extra) = extra {
        app = app.merge(extra);
    }
    app.route_service("/idem.v1.Claims/{*method}", crate::grpc::service(state))
        .layer(axum::extract::DefaultBodyLimit::max(crate::wire::MAX_BODY_BYTES))
}
