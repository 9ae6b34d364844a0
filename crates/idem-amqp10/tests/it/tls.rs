//! `amqps://` against RabbitMQ's AMQP 1.0 plugin on its TLS listener (5671): a consumer with our
//! CA receives and accepts over a verified session; a wrong CA, a wrong host name and the
//! plaintext port are refused with [`Error::Tls`]; a client certificate is presented.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::Broker;
use idem_amqp10::{Amqp10Config, Amqp10Consumer, Delivery, Error, Tls};
use idem_core::engine::{Context, HandlerError};
use idem_core::{MemoryStore, consumer};
use idem_testkit::tls::{Pki, WRONG_HOST};

fn tls_url() -> Option<(String, Pki)> {
    let url = idem_testkit::service::require(
        "RabbitMQ (AMQP 1.0, TLS)",
        "IDEM_TEST_AMQP10S_URL",
        "amqps://guest:guest@localhost:5671",
    )?;
    Some((url, Pki::require()?))
}

async fn ok(_: Context, _: Delivery) -> Result<(), HandlerError<String>> {
    Ok(())
}

async fn open(
    config: Amqp10Config,
) -> Result<Amqp10Consumer<MemoryStore>, consumer::BuildError<Error>> {
    let building = Amqp10Consumer::builder(config)
        .idle_wait(Duration::from_millis(200))
        .store(MemoryStore::new())
        .scope("tls")
        .build();
    tokio::time::timeout(Duration::from_secs(30), building).await.expect("bounded open")
}

fn with_host(url: &str, host: &str) -> String {
    let mut u = url::Url::parse(url).unwrap();
    u.set_host(Some(host)).unwrap();
    u.to_string()
}

/// Whether `e` is a refused TLS handshake (not a timeout, not some other failure).
fn is_tls_refusal(e: &consumer::BuildError<Error>) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if matches!(s.downcast_ref::<Error>(), Some(Error::Tls { .. })) {
            return true;
        }
        source = s.source();
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_with_our_ca_receives_over_a_verified_session() {
    let Some((url, pki)) = tls_url() else { return };
    let Some(b) = Broker::new("tls").await else { return };
    b.publish(Some("o-1"), br#"{"n":1}"#, &[]).await;
    let tls = Tls::new().ca_pem(&pki.read(&pki.ca())).unwrap().only_given_cas();
    let c = open(Amqp10Config::new(url, b.address()).tls(tls)).await.expect("verified TLS");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut total = consumer::Report::default();
    while total.processed < 1 {
        assert!(tokio::time::Instant::now() < deadline, "not received: {total}");
        total += c.poll(ok).await.unwrap();
    }
    assert_eq!(total.acked, 1, "{total}");
    c.close().await.unwrap();
    assert_eq!(b.count(&b.name).await, 0);
    b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_ca_a_wrong_host_and_the_plaintext_port_are_refused() {
    let Some((url, pki)) = tls_url() else { return };
    let Some(b) = Broker::new("tls-refused").await else { return };
    let ours = || Tls::new().ca_pem(&pki.read(&pki.ca())).unwrap().only_given_cas();

    let wrong = Tls::new().ca_pem(&pki.read(&pki.wrong_ca())).unwrap().only_given_cas();
    let e = open(Amqp10Config::new(url.clone(), b.address()).tls(wrong)).await.err().unwrap();
    assert!(is_tls_refusal(&e), "wrong CA: {e:#}");

    // Every listener also answers on 127.0.0.2, which its certificate does not name.
    let config = Amqp10Config::new(with_host(&url, WRONG_HOST), b.address()).tls(ours());
    let e = open(config).await.err().unwrap();
    assert!(is_tls_refusal(&e), "wrong host: {e:#}");

    // `amqps://` to the plaintext listener: a handshake error, never a plaintext session.
    let plain = url::Url::parse(&common::url().unwrap()).unwrap();
    let port = plain.port().unwrap_or(5672);
    let e = open(
        Amqp10Config::new(format!("amqps://guest:guest@localhost:{port}"), b.address()).tls(ours()),
    )
    .await
    .err()
    .unwrap();
    assert!(is_tls_refusal(&e), "amqps to the plaintext port: {e:#}");
    b.cleanup().await;
}

/// RabbitMQ's AMQP 1.0 plugin cannot prove a client certificate was used: fe2o3-amqp's SASL
/// EXTERNAL sends no initial response, which RabbitMQ 3.10 fails, and 5671 does not require
/// certificates. So a TLS server of the test's own that requires one is the witness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_certificate_is_presented_to_a_server_that_requires_one() {
    use tokio_rustls::rustls::pki_types::pem::PemObject as _;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio_rustls::rustls::server::WebPkiClientVerifier;
    use tokio_rustls::rustls::{RootCertStore, ServerConfig};

    let Some(pki) = Pki::require() else { return };
    let provider = std::sync::Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&pki.read(&pki.ca())) {
        roots.add(c.unwrap()).unwrap();
    }
    let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider.clone())
        .build()
        .unwrap();
    let chain: Vec<_> =
        CertificateDer::pem_slice_iter(&pki.read(&pki.server_cert())).map(Result::unwrap).collect();
    let key = PrivateKeyDer::from_pem_slice(&pki.read(&pki.server_key())).unwrap();
    let server = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(server));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    // Accepts two connections; reports for each whether the handshake verified a client
    // certificate, then hangs up (no AMQP is spoken: the client's open then fails).
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        for _ in 0..2 {
            let (tcp, _) = listener.accept().await.unwrap();
            let verified = match acceptor.accept(tcp).await {
                Ok(tls) => tls.get_ref().1.peer_certificates().is_some_and(|c| !c.is_empty()),
                Err(_) => false,
            };
            let _ = tx.send(verified);
        }
    });
    let url = format!("amqps://guest:guest@localhost:{port}");
    let ca = || Tls::new().ca_pem(&pki.read(&pki.ca())).unwrap().only_given_cas();
    let with_cert =
        ca().client_pem(&pki.read(&pki.client_cert()), &pki.read(&pki.client_key())).unwrap();
    let _ = open(Amqp10Config::new(url.clone(), "/queue/x").tls(with_cert)).await;
    assert_eq!(rx.recv().await, Some(true), "the server must have verified our certificate");
    let _ = open(Amqp10Config::new(url, "/queue/x").tls(ca())).await;
    assert_eq!(rx.recv().await, Some(false), "without one the server's handshake must fail");
}
