//! `amqps://` against RabbitMQ's TLS listener of `.ci/services.sh` (5671): a verified session
//! works (a confirmed publish), a wrong CA or host name is refused, a client certificate logs in
//! with EXTERNAL, and — the regression — `amqps://` against the plaintext port fails instead of
//! connecting in plaintext.

use crate::common;

use std::time::Duration;

use idem_amqp::lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use idem_amqp::lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use idem_amqp::lapin::types::FieldTable;
use idem_amqp::lapin::{BasicProperties, Connection, ConnectionProperties};
use idem_testkit::tls::{Pki, WRONG_HOST};

fn tls_url() -> Option<(String, Pki)> {
    let url = idem_testkit::service::require(
        "RabbitMQ (TLS)",
        "IDEM_TEST_AMQPS_URL",
        "amqps://guest:guest@localhost:5671/%2f",
    )?;
    Some((url, Pki::require()?))
}

fn tls(pki: &Pki, ca: &std::path::Path, client: bool) -> OwnedTLSConfig {
    OwnedTLSConfig {
        identity: client.then(|| OwnedIdentity::PKCS8 {
            pem: pki.read(&pki.client_cert()),
            key: pki.read(&pki.client_key()),
        }),
        cert_chain: Some(String::from_utf8_lossy(&pki.read(ca)).into_owned()),
    }
}

async fn connect(url: &str, config: OwnedTLSConfig) -> Result<Connection, String> {
    let runtime = idem_amqp::lapin::runtime::default_runtime().map_err(|e| e.to_string())?;
    let connecting =
        Connection::connect_with_config(url, ConnectionProperties::default(), config, runtime);
    match tokio::time::timeout(Duration::from_secs(20), connecting).await {
        Ok(r) => r.map_err(|e| format!("{e:#}")),
        Err(_) => Err("no answer within 20 s".into()),
    }
}

fn with_host(url: &str, host: &str) -> String {
    let mut u = url::Url::parse(url).expect("test url");
    u.set_host(Some(host)).expect("host");
    u.to_string()
}

/// A confirmed publish to a queue of the test's own, which it then deletes.
async fn publish_confirmed(conn: &Connection) {
    let ch = conn.create_channel().await.expect("channel");
    ch.confirm_select(ConfirmSelectOptions::default()).await.expect("confirms");
    let queue = format!("idem-tls-{}", common::suffix());
    ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), FieldTable::default())
        .await
        .expect("declare");
    let confirm = ch
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            b"hello",
            BasicProperties::default(),
        )
        .await
        .expect("publish")
        .await
        .expect("confirm");
    assert!(confirm.is_ack(), "the broker must confirm the publish");
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default()).await.expect("delete");
}

#[tokio::test]
async fn amqps_with_our_ca_connects_and_publishes_confirmed() {
    let Some((url, pki)) = tls_url() else { return };
    let conn = connect(&url, tls(&pki, &pki.ca(), false)).await.expect("a verified TLS session");
    publish_confirmed(&conn).await;
    let _ = conn.close(200, "done".into()).await;
}

#[tokio::test]
async fn amqps_refuses_a_wrong_ca_and_a_wrong_host_name() {
    let Some((url, pki)) = tls_url() else { return };
    let e = connect(&url, tls(&pki, &pki.wrong_ca(), false)).await.expect_err("wrong CA refused");
    eprintln!("refused as expected: {e}");
    assert!(e.contains("UnknownIssuer"), "{e}");
    // Every listener also answers on 127.0.0.2, which its certificate does not name.
    let e = connect(&with_host(&url, WRONG_HOST), tls(&pki, &pki.ca(), false))
        .await
        .expect_err("wrong host refused");
    eprintln!("refused as expected: {e}");
    assert!(e.contains("not valid for name"), "{e}");
}

#[tokio::test]
async fn a_client_certificate_logs_in_with_external() {
    let Some((url, pki)) = tls_url() else { return };
    // No password: the broker takes the user from the certificate's CN (`idem-client`).
    let mut u = url::Url::parse(&url).expect("url");
    u.set_username("").expect("user");
    u.set_password(None).expect("password");
    u.set_query(Some("auth_mechanism=external"));
    let external = u.to_string();
    let conn = connect(&external, tls(&pki, &pki.ca(), true)).await.expect("EXTERNAL login");
    publish_confirmed(&conn).await;
    let _ = conn.close(200, "done".into()).await;

    let e = connect(&external, tls(&pki, &pki.ca(), false)).await.err();
    assert!(e.is_some(), "EXTERNAL without a certificate must be refused");
}

/// The regression: lapin built without a TLS backend connected `amqps://` in plaintext.
#[tokio::test]
async fn amqps_against_the_plaintext_port_fails() {
    let Some(plain) = common::url() else { return };
    let tls_on_plain_port = plain.replacen("amqp://", "amqps://", 1);
    assert!(tls_on_plain_port.contains(":5672") || std::env::var("IDEM_TEST_AMQP_URL").is_ok());
    let e = connect(&tls_on_plain_port, OwnedTLSConfig::default()).await.err();
    assert!(e.is_some(), "amqps:// against the plaintext port connected: {tls_on_plain_port}");
}
