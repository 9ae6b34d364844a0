//! TLS settings for `amqps://` and Service Bus: which roots to trust, and a client certificate.

use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject as _;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

use crate::error::Error;

/// How an `amqps://` connection (and every Service Bus connection) verifies the server and
/// proves who the client is. Rustls on `ring`; the server's certificate is always verified
/// against the trusted roots and the host name — there is no switch to turn that off.
///
/// By default the operating system's trust store is trusted (plus Mozilla's bundled roots with
/// the crate feature `webpki-roots`), which is what Azure Service Bus needs. A private broker
/// signed by your own CA adds it with [`ca_pem`](Self::ca_pem); a broker that wants a client
/// certificate gets one with [`client_pem`](Self::client_pem).
///
/// ```no_run
/// use idem_amqp10::{Amqp10Config, Tls};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let tls = Tls::new()
///     .ca_pem(&std::fs::read("/etc/idem/ca.pem")?)?
///     .client_pem(&std::fs::read("/etc/idem/client.pem")?, &std::fs::read("/etc/idem/client.key")?)?;
/// let config = Amqp10Config::new("amqps://broker.internal:5671", "/amq/queue/orders").tls(tls);
/// # let _ = config; Ok(()) }
/// ```
#[derive(Clone, Default)]
#[must_use]
pub struct Tls {
    extra_roots: Vec<CertificateDer<'static>>,
    only_extra_roots: bool,
    client: Option<(Vec<CertificateDer<'static>>, Arc<PrivateKeyDer<'static>>)>,
}

impl std::fmt::Debug for Tls {
    // The private key never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("extra_roots", &self.extra_roots.len())
            .field("only_extra_roots", &self.only_extra_roots)
            .field("client_certificate", &self.client.is_some())
            .finish()
    }
}

impl Tls {
    /// The default: the OS trust store (and the bundled roots with feature `webpki-roots`),
    /// no client certificate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also trust the CA certificates in `pem` (one or more `BEGIN CERTIFICATE` blocks).
    ///
    /// # Errors
    /// [`Error::Config`] (`tls.ca`) when `pem` holds no certificate or one does not parse.
    pub fn ca_pem(mut self, pem: &[u8]) -> Result<Self, Error> {
        let certs = certificates(pem, "tls.ca")?;
        self.extra_roots.extend(certs);
        Ok(self)
    }

    /// Trust only the CAs given with [`ca_pem`](Self::ca_pem), not the OS store: a broker
    /// on a private PKI that must not be impersonated by any public CA.
    pub fn only_given_cas(mut self) -> Self {
        self.only_extra_roots = true;
        self
    }

    /// Present this client certificate (chain first, PEM) and its private key (PKCS#8, PKCS#1
    /// or SEC1 PEM) when the broker asks for one.
    ///
    /// # Errors
    /// [`Error::Config`] (`tls.client_cert` / `tls.client_key`) when either does not parse.
    pub fn client_pem(mut self, cert_chain: &[u8], key: &[u8]) -> Result<Self, Error> {
        let chain = certificates(cert_chain, "tls.client_cert")?;
        let key = PrivateKeyDer::from_pem_slice(key)
            .map_err(|e| Error::config("tls.client_key", format!("no private key: {e}")))?;
        self.client = Some((chain, Arc::new(key)));
        Ok(self)
    }

    /// The rustls configuration these settings make.
    pub(crate) fn client_config(&self) -> Result<Arc<ClientConfig>, Error> {
        let mut roots = RootCertStore::empty();
        if !self.only_extra_roots {
            let native = rustls_native_certs::load_native_certs();
            // Unreadable entries of the OS store are skipped, as every TLS client does; an
            // empty store with no given CA fails below with a clear message.
            let _ = roots.add_parsable_certificates(native.certs);
            #[cfg(feature = "webpki-roots")]
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        }
        for cert in &self.extra_roots {
            roots
                .add(cert.clone())
                .map_err(|e| Error::config("tls.ca", format!("not a usable CA: {e}")))?;
        }
        if roots.is_empty() {
            return Err(Error::config(
                "tls.ca",
                "no trusted root: the OS trust store is empty and no CA was given \
                 (install ca-certificates, give a CA, or enable the feature `webpki-roots`)",
            ));
        }
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::config("tls", e.to_string()))?
            .with_root_certificates(roots);
        let config = match &self.client {
            Some((chain, key)) => builder
                .with_client_auth_cert(chain.clone(), key.clone_key())
                .map_err(|e| Error::config("tls.client_cert", e.to_string()))?,
            None => builder.with_no_client_auth(),
        };
        Ok(Arc::new(config))
    }
}

fn certificates(pem: &[u8], field: &'static str) -> Result<Vec<CertificateDer<'static>>, Error> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::config(field, format!("not PEM certificates: {e}")))?;
    if certs.is_empty() {
        return Err(Error::config(field, "no `BEGIN CERTIFICATE` block"));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_what_is_not_a_certificate() {
        let e = Tls::new().ca_pem(b"not pem").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("tls.ca"), "{e}");
        let e = Tls::new().client_pem(b"", b"").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("tls.client_cert"), "{e}");
    }

    #[test]
    fn only_given_cas_without_a_ca_is_refused() {
        let e = Tls::new().only_given_cas().client_config().err().map(|e| e.to_string());
        assert!(e.unwrap_or_default().contains("no trusted root"));
    }
}
