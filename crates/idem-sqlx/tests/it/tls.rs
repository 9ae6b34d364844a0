//! TLS to the real PostgreSQL and MariaDB TLS listeners of `.ci/services.sh`: a verified
//! session works (the store claims over it), a wrong CA or host name is refused, a client
//! certificate logs in, and a URL that requires TLS never falls back to a plaintext port.
#![cfg(all(feature = "postgres", feature = "mysql", feature = "rustls"))]

use crate::common;

use std::time::Duration;

use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore as _, Fingerprint};
use idem_sqlx::{MySqlStore, PostgresStore};
use idem_testkit::tls::{Pki, WRONG_HOST};

fn pg_tls() -> Option<(String, Pki)> {
    let base = idem_testkit::service::require(
        "postgres (TLS)",
        "IDEM_TEST_POSTGRES_TLS_URL",
        "postgres://postgres@localhost:5433/test",
    )?;
    Some((base, Pki::require()?))
}

fn mysql_tls() -> Option<(String, Pki)> {
    let base = idem_testkit::service::require(
        "mysql (TLS)",
        "IDEM_TEST_MYSQL_TLS_URL",
        "mysql://root@localhost:3307/test",
    )?;
    Some((base, Pki::require()?))
}

/// `url` with `pairs` added to its query.
fn with_query(url: &str, pairs: &[(&str, &str)]) -> String {
    let mut u = url::Url::parse(url).expect("test url");
    for (k, v) in pairs {
        u.query_pairs_mut().append_pair(k, v);
    }
    u.to_string()
}

/// `url` with its host replaced.
fn with_host(url: &str, host: &str) -> String {
    let mut u = url::Url::parse(url).expect("test url");
    u.set_host(Some(host)).expect("host");
    u.to_string()
}

/// `url` with its user replaced.
fn with_user(url: &str, user: &str) -> String {
    let mut u = url::Url::parse(url).expect("test url");
    u.set_username(user).expect("user");
    u.to_string()
}

/// The whole error chain, for matching on the cause.
fn chain(e: &dyn std::error::Error) -> String {
    idem_core::ErrorChain(e).to_string()
}

async fn pg_pool(url: &str) -> Result<sqlx::PgPool, sqlx::Error> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
}

async fn my_pool(url: &str) -> Result<sqlx::MySqlPool, sqlx::Error> {
    sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
}

fn key(scope: &str) -> DedupKey {
    DedupKey::new(scope, "o-1").expect("key")
}

#[tokio::test]
async fn postgres_verify_full_with_our_ca_encrypts_and_the_store_claims_over_it() {
    let Some((base, pki)) = pg_tls() else { return };
    let ca = pki.ca();
    let url = with_query(
        &base,
        &[("sslmode", "verify-full"), ("sslrootcert", ca.to_str().unwrap_or_default())],
    );
    let pool = pg_pool(&url).await.expect("verify-full with our CA");
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .expect("pg_stat_ssl");
    assert!(ssl, "the session must be encrypted");

    let schema = common::unique("idem_tls");
    let _drop = common::DropSql {
        url: url.clone(),
        sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"),
    };
    let store = PostgresStore::new(pool).with_schema(&schema).expect("schema");
    store.migrate().await.expect("migrate over TLS");
    let req = ClaimRequest::new(
        key("tls"),
        Some(Fingerprint::of_bytes(b"x")),
        Duration::from_secs(30),
        Duration::from_secs(60),
    );
    assert!(matches!(store.claim(&req).await.expect("claim"), Claim::Acquired(_)));
}

#[tokio::test]
async fn postgres_refuses_a_wrong_ca_and_a_wrong_host_name() {
    let Some((base, pki)) = pg_tls() else { return };
    let wrong = pki.wrong_ca();
    let url = with_query(
        &base,
        &[("sslmode", "verify-full"), ("sslrootcert", wrong.to_str().unwrap_or_default())],
    );
    let e = pg_pool(&url).await.err().map(|e| chain(&e)).expect("a wrong CA must be refused");
    eprintln!("refused as expected: {e}");
    assert!(e.contains("UnknownIssuer"), "{e}");

    // Every listener also answers on 127.0.0.2, which its certificate does not name.
    let ca = pki.ca();
    let url = with_query(
        &with_host(&base, WRONG_HOST),
        &[("sslmode", "verify-full"), ("sslrootcert", ca.to_str().unwrap_or_default())],
    );
    let e = pg_pool(&url).await.err().map(|e| chain(&e)).expect("a wrong host must be refused");
    eprintln!("refused as expected: {e}");
    assert!(e.contains("not valid for name"), "{e}");
}

#[tokio::test]
async fn postgres_client_certificate_logs_in_and_none_is_refused() {
    let Some((base, pki)) = pg_tls() else { return };
    let (ca, cert, key) = (pki.ca(), pki.client_cert(), pki.client_key());
    let s = |p: &std::path::Path| p.to_str().unwrap_or_default().to_owned();
    let user = with_user(&base, "idem_client");
    let url = with_query(
        &user,
        &[
            ("sslmode", "verify-full"),
            ("sslrootcert", &s(&ca)),
            ("sslcert", &s(&cert)),
            ("sslkey", &s(&key)),
        ],
    );
    let pool = pg_pool(&url).await.expect("client certificate login");
    let who: String =
        sqlx::query_scalar("SELECT current_user").fetch_one(&pool).await.expect("who");
    assert_eq!(who, "idem_client");

    let url = with_query(&user, &[("sslmode", "verify-full"), ("sslrootcert", &s(&ca))]);
    assert!(pg_pool(&url).await.is_err(), "without a certificate idem_client must be refused");
}

#[tokio::test]
async fn postgres_tls_required_against_the_plaintext_server_fails() {
    let Some(plain) = common::pg_url() else { return };
    for mode in ["require", "verify-full"] {
        let url = with_query(&plain, &[("sslmode", mode)]);
        let e = PostgresStore::connect(&url).await.err().map(|e| chain(&e));
        let e = e.unwrap_or_else(|| panic!("sslmode={mode} against a plaintext server connected"));
        assert!(e.to_lowercase().contains("tls") || e.to_lowercase().contains("ssl"), "{e}");
    }
}

#[tokio::test]
async fn mysql_verify_identity_with_our_ca_encrypts_and_the_store_claims_over_it() {
    let Some((base, pki)) = mysql_tls() else { return };
    let ca = pki.ca();
    let url = with_query(
        &base,
        &[("ssl-mode", "VERIFY_IDENTITY"), ("ssl-ca", ca.to_str().unwrap_or_default())],
    );
    let pool = my_pool(&url).await.expect("VERIFY_IDENTITY with our CA");
    let (_, cipher): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_cipher'")
        .fetch_one(&pool)
        .await
        .expect("Ssl_cipher");
    assert!(!cipher.is_empty(), "the session must be encrypted");

    let table = common::unique("idem_tls");
    let _drop = common::DropSql {
        url: url.clone(),
        sql: format!("DROP TABLE IF EXISTS {table}, {table}_positions"),
    };
    let store = MySqlStore::new(pool).with_table_name(&table).expect("table");
    store.migrate().await.expect("migrate over TLS");
    let req = ClaimRequest::new(
        key("tls"),
        Some(Fingerprint::of_bytes(b"x")),
        Duration::from_secs(30),
        Duration::from_secs(60),
    );
    assert!(matches!(store.claim(&req).await.expect("claim"), Claim::Acquired(_)));
}

#[tokio::test]
async fn mysql_refuses_a_wrong_ca_and_a_wrong_host_name() {
    let Some((base, pki)) = mysql_tls() else { return };
    let wrong = pki.wrong_ca();
    let url = with_query(
        &base,
        &[("ssl-mode", "VERIFY_IDENTITY"), ("ssl-ca", wrong.to_str().unwrap_or_default())],
    );
    let e = my_pool(&url).await.err().map(|e| chain(&e)).expect("a wrong CA must be refused");
    eprintln!("refused as expected: {e}");
    assert!(e.contains("UnknownIssuer"), "{e}");

    let ca = pki.ca();
    let url = with_query(
        &with_host(&base, WRONG_HOST),
        &[("ssl-mode", "VERIFY_IDENTITY"), ("ssl-ca", ca.to_str().unwrap_or_default())],
    );
    let e = my_pool(&url).await.err().map(|e| chain(&e)).expect("a wrong host must be refused");
    eprintln!("refused as expected: {e}");
    assert!(e.contains("not valid for name"), "{e}");
}

#[tokio::test]
async fn mysql_client_certificate_logs_in_and_none_is_refused() {
    let Some((base, pki)) = mysql_tls() else { return };
    let (ca, cert, key) = (pki.ca(), pki.client_cert(), pki.client_key());
    let s = |p: &std::path::Path| p.to_str().unwrap_or_default().to_owned();
    let user = with_user(&base, "idem_client");
    let url = with_query(
        &user,
        &[
            ("ssl-mode", "VERIFY_IDENTITY"),
            ("ssl-ca", &s(&ca)),
            ("ssl-cert", &s(&cert)),
            ("ssl-key", &s(&key)),
        ],
    );
    let pool = my_pool(&url).await.expect("client certificate login");
    let who: String = sqlx::query_scalar("SELECT SUBSTRING_INDEX(CURRENT_USER(), '@', 1)")
        .fetch_one(&pool)
        .await
        .expect("who");
    assert_eq!(who, "idem_client");

    let url = with_query(&user, &[("ssl-mode", "VERIFY_IDENTITY"), ("ssl-ca", &s(&ca))]);
    assert!(my_pool(&url).await.is_err(), "without a certificate idem_client must be refused");
}

#[tokio::test]
async fn mysql_tls_required_against_the_plaintext_server_fails() {
    let Some(plain) = common::mysql_url() else { return };
    for mode in ["REQUIRED", "VERIFY_IDENTITY"] {
        let url = with_query(&plain, &[("ssl-mode", mode)]);
        let e = MySqlStore::connect(&url).await.err().map(|e| chain(&e));
        let e = e.unwrap_or_else(|| panic!("ssl-mode={mode} against a plaintext server connected"));
        assert!(e.to_lowercase().contains("tls") || e.to_lowercase().contains("ssl"), "{e}");
    }
}
