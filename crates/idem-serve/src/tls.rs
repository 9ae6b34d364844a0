//! The HTTP clients' TLS (RemoteStore, push mode): rustls on `ring`, the OS trust store plus any
//! CA given, set up here so no process-wide crypto provider has to be installed first.

use std::sync::Arc;

use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

/// A client builder whose `https://` connections trust the OS store and `extra`.
pub(crate) fn client_builder(
    extra: &[CertificateDer<'static>],
) -> Result<reqwest::ClientBuilder, String> {
    let mut roots = RootCertStore::empty();
    // Unreadable system certificates are skipped, as every rustls user does; a missing store
    // leaves only `extra`, and an https:// server signed by neither fails its handshake.
    let (_, _) = roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    for c in extra {
        roots.add(c.clone()).map_err(|e| format!("CA certificate: {e}"))?;
    }
    let mut config = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(reqwest::Client::builder().tls_backend_preconfigured(config))
}
