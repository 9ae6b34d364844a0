//! NATS over TLS against the listeners of `.ci/services.sh`: `tls://` with our CA and an nkey
//! login (4223) carries JetStream; a creds-file login (4224, operator mode); a client
//! certificate where the server requires one (4225); a wrong CA, a wrong host name and a TLS URL
//! against the plaintext server are refused.
#![cfg(feature = "nkeys")]

use crate::common;

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use async_nats::{Client, ConnectOptions};
use idem_testkit::tls::{Pki, WRONG_HOST};

fn listener(service: &str, env: &str, default: &str) -> Option<(String, Pki)> {
    let url = idem_testkit::service::require(service, env, default)?;
    Some((url, Pki::require()?))
}

fn nkey(pki: &Pki) -> String {
    String::from_utf8_lossy(&pki.read(&pki.dir().join("user.nk"))).trim().to_owned()
}

async fn connect(opts: ConnectOptions, url: &str) -> Result<Client, String> {
    let opts = opts.connection_timeout(Duration::from_secs(10));
    match tokio::time::timeout(Duration::from_secs(20), opts.connect(url)).await {
        Ok(r) => r.map_err(|e| {
            let mut s = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(e) = source {
                s.push_str(": ");
                s.push_str(&e.to_string());
                source = e.source();
            }
            s
        }),
        Err(_) => Err("no answer within 20 s".into()),
    }
}

fn with_host(url: &str, host: &str) -> String {
    url.replacen("localhost", host, 1)
}

/// A JetStream round trip: a stream of the test's own, a publish acknowledged by it, deleted.
async fn jetstream_round_trip(client: Client) {
    let js = jetstream::new(client);
    let name = format!("TLS_{}", common::suffix());
    let subject = format!("tls.{}", common::suffix());
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![subject.clone()],
        ..Default::default()
    })
    .await
    .expect("create stream over TLS");
    let ack = js.publish(subject, "hello".into()).await.expect("publish").await.expect("ack");
    assert_eq!(ack.stream, name);
    js.delete_stream(&name).await.expect("delete stream");
}

#[tokio::test]
async fn tls_with_our_ca_and_an_nkey_carries_jetstream() {
    let Some((url, pki)) =
        listener("NATS (TLS, nkey)", "IDEM_TEST_NATS_TLS_URL", "tls://localhost:4223")
    else {
        return;
    };
    let opts = ConnectOptions::with_nkey(nkey(&pki)).add_root_certificates(pki.ca());
    let client = connect(opts, &url).await.expect("TLS + nkey");
    jetstream_round_trip(client).await;

    let e = connect(ConnectOptions::new().add_root_certificates(pki.ca()), &url).await.err();
    assert!(e.is_some(), "without the nkey the server must refuse");
}

#[tokio::test]
async fn a_wrong_ca_and_a_wrong_host_name_are_refused() {
    let Some((url, pki)) =
        listener("NATS (TLS, nkey)", "IDEM_TEST_NATS_TLS_URL", "tls://localhost:4223")
    else {
        return;
    };
    let opts = ConnectOptions::with_nkey(nkey(&pki)).add_root_certificates(pki.wrong_ca());
    let e = connect(opts, &url).await.expect_err("wrong CA refused");
    eprintln!("refused as expected: {e}");
    assert!(e.contains("UnknownIssuer"), "{e}");

    let opts = ConnectOptions::with_nkey(nkey(&pki)).add_root_certificates(pki.ca());
    let e = connect(opts, &with_host(&url, WRONG_HOST)).await.expect_err("wrong host refused");
    eprintln!("refused as expected: {e}");
    assert!(e.contains("not valid for name"), "{e}");
}

#[tokio::test]
async fn a_creds_file_logs_in() {
    let Some((url, pki)) =
        listener("NATS (TLS, creds)", "IDEM_TEST_NATS_CREDS_URL", "tls://localhost:4224")
    else {
        return;
    };
    let opts = ConnectOptions::with_credentials_file(pki.dir().join("user.creds"))
        .await
        .expect("read creds")
        .add_root_certificates(pki.ca());
    let client = connect(opts, &url).await.expect("creds login");
    jetstream_round_trip(client).await;

    let e = connect(ConnectOptions::new().add_root_certificates(pki.ca()), &url).await.err();
    assert!(e.is_some(), "without creds the server must refuse");
}

#[tokio::test]
async fn a_client_certificate_is_required_and_accepted() {
    let Some((url, pki)) =
        listener("NATS (mutual TLS)", "IDEM_TEST_NATS_MTLS_URL", "tls://localhost:4225")
    else {
        return;
    };
    let opts = ConnectOptions::new()
        .add_root_certificates(pki.ca())
        .add_client_certificate(pki.client_cert(), pki.client_key());
    let client = connect(opts, &url).await.expect("mutual TLS");
    client.flush().await.expect("a round trip");

    let e = connect(ConnectOptions::new().add_root_certificates(pki.ca()), &url).await.err();
    assert!(e.is_some(), "without a client certificate the server must refuse");
}

#[tokio::test]
async fn a_tls_url_against_the_plaintext_server_fails() {
    let Some(plain) = common::nats_url() else { return };
    let host_port = plain.trim_start_matches("nats://");
    let e = connect(ConnectOptions::new(), &format!("tls://{host_port}")).await.err();
    assert!(e.is_some(), "tls:// against a plaintext server connected");
    let e = connect(ConnectOptions::new().require_tls(true), host_port).await.err();
    assert!(e.is_some(), "require_tls against a plaintext server connected");
}
