//! `rediss://`: refusing it without TLS, and a crypto provider for redis' rustls.

use redis::Client;

use crate::Error;

/// A client for `url`, refusing a TLS URL this build cannot honour.
pub(crate) fn client(url: &str) -> Result<Client, Error> {
    let scheme = url.split_once("://").map_or("", |(s, _)| s);
    if matches!(scheme, "rediss" | "valkeys") && !cfg!(feature = "rustls") {
        return Err(Error::TlsUnavailable { scheme: scheme.to_owned() });
    }
    Client::open(url).map_err(Error::redis("open"))
}

/// Makes rustls' `ring` provider the process default, unless one is installed already; returns
/// whether this call installed it.
///
/// The redis client asks rustls for the process-wide provider when it opens a `rediss://`
/// connection, and panics when there is none (rustls picks one itself only when exactly one of
/// its providers is compiled in). The store and the streams source call this before
/// connecting; call it yourself before connecting a `redis::Client` of your own over TLS (a
/// [`StreamPublisher`](crate::StreamPublisher)'s, say). A provider you installed first is kept.
///
/// ```
/// idem_redis::install_crypto_provider();
/// assert!(!idem_redis::install_crypto_provider(), "the second call is a no-op");
/// ```
#[cfg(feature = "rustls")]
pub fn install_crypto_provider() -> bool {
    rustls::crypto::CryptoProvider::get_default().is_none()
        && rustls::crypto::ring::default_provider().install_default().is_ok()
}

/// [`install_crypto_provider`] where TLS is built in; nothing otherwise.
pub(crate) fn ensure_crypto_provider() {
    #[cfg(feature = "rustls")]
    let _ = install_crypto_provider();
}
