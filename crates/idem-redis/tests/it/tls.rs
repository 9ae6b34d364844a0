//! `rediss://` against the real TLS Redis of `.ci/services.sh`: a verified session works (the
//! store claims over it), a wrong CA or host name is refused, a client certificate is presented
//! where the server demands one, and `rediss://` against the plaintext server fails.
#![cfg(feature = "rustls")]

use crate::common;

use std::time::Duration;

use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore as _, Fingerprint};
use idem_redis::RedisStore;
use idem_testkit::tls::{Pki, WRONG_HOST};
use redis::{Client, ClientTlsConfig, TlsCertificates};

fn tls_url() -> Option<(String, Pki)> {
    let url = idem_testkit::service::require(
        "redis (TLS)",
        "IDEM_TEST_REDIS_TLS_URL",
        "rediss://localhost:6380/",
    )?;
    Some((url, Pki::require()?))
}

/// The TLS Redis that requires a client certificate (`--tls-auth-clients yes`).
fn mtls_url() -> Option<(String, Pki)> {
    let url = idem_testkit::service::require(
        "redis (TLS, client certificates required)",
        "IDEM_TEST_REDIS_MTLS_URL",
        "rediss://localhost:6381/",
    )?;
    Some((url, Pki::require()?))
}

fn certs(pki: &Pki, ca: &std::path::Path, client: bool) -> TlsCertificates {
    TlsCertificates {
        client_tls: client.then(|| ClientTlsConfig {
            client_cert: pki.read(&pki.client_cert()),
            client_key: pki.read(&pki.client_key()),
        }),
        root_cert: Some(pki.read(ca)),
    }
}

/// The whole error chain, for matching on the cause.
fn chain(e: &dyn std::error::Error) -> String {
    idem_core::ErrorChain(e).to_string()
}

fn with_host(url: &str, host: &str) -> String {
    let mut u = url::Url::parse(url).expect("test url");
    u.set_host(Some(host)).expect("host");
    u.to_string()
}

async fn store(client: Client, ns: &str) -> Result<RedisStore, idem_redis::Error> {
    let builder = RedisStore::builder_for(client)
        .namespace(ns)?
        .allow_eviction(true)
        .response_timeout(Duration::from_secs(5));
    tokio::time::timeout(Duration::from_secs(20), builder.connect())
        .await
        .unwrap_or_else(|_| panic!("connect did not end within 20 s"))
}

/// Claims one key in the test's own namespace; its record expires with the 60 s retention, so
/// nothing is left behind on the TLS server.
async fn claims_once(store: &RedisStore) {
    let key = DedupKey::new("tls", "o-1").expect("key");
    let req = ClaimRequest::new(
        key,
        Some(Fingerprint::of_bytes(b"x")),
        Duration::from_secs(30),
        Duration::from_secs(60),
    );
    assert!(matches!(store.claim(&req).await.expect("claim over TLS"), Claim::Acquired(_)));
}

#[tokio::test]
async fn rediss_with_our_ca_connects_and_the_store_claims_over_it() {
    let Some((url, pki)) = tls_url() else { return };
    let ns = common::fresh_name("tls");
    let client =
        Client::build_with_tls(url.as_str(), certs(&pki, &pki.ca(), false)).expect("client");
    let store = store(client, &ns).await.expect("a verified TLS session");
    claims_once(&store).await;
}

#[tokio::test]
async fn rediss_refuses_a_wrong_ca_and_a_wrong_host_name() {
    let Some((url, pki)) = tls_url() else { return };
    let ns = common::fresh_name("tls");
    let client =
        Client::build_with_tls(url.as_str(), certs(&pki, &pki.wrong_ca(), false)).expect("client");
    let e = store(client, &ns).await.err().map(|e| chain(&e)).expect("wrong CA refused");
    eprintln!("refused as expected: {e}");
    assert!(e.contains("UnknownIssuer"), "{e}");

    // Every listener also answers on 127.0.0.2, which its certificate does not name.
    let wrong_host = with_host(&url, WRONG_HOST);
    let client =
        Client::build_with_tls(wrong_host.as_str(), certs(&pki, &pki.ca(), false)).expect("client");
    let e = store(client, &ns).await.err().map(|e| chain(&e)).expect("wrong host refused");
    eprintln!("refused as expected: {e}");
    assert!(e.contains("not valid for name"), "{e}");
}

#[tokio::test]
async fn a_client_certificate_is_presented_where_the_server_demands_one() {
    let Some((url, pki)) = mtls_url() else { return };
    let ns = common::fresh_name("mtls");
    let client =
        Client::build_with_tls(url.as_str(), certs(&pki, &pki.ca(), true)).expect("client");
    let store = store(client, &ns).await.expect("mutual TLS");
    claims_once(&store).await;

    let client =
        Client::build_with_tls(url.as_str(), certs(&pki, &pki.ca(), false)).expect("client");
    assert!(store_fails(client, &ns).await, "no client certificate must be refused");
}

async fn store_fails(client: Client, ns: &str) -> bool {
    store(client, ns).await.is_err()
}

#[tokio::test]
async fn rediss_against_the_plaintext_server_fails() {
    let Some(plain) = common::url() else { return };
    let tls = plain.replacen("redis://", "rediss://", 1);
    let e = tokio::time::timeout(Duration::from_secs(20), RedisStore::connect(&tls))
        .await
        .expect("bounded")
        .err();
    assert!(e.is_some(), "rediss:// against a plaintext server must not connect");
}
