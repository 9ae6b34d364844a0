//! Access control, endpoint by endpoint: a token used outside its scopes gets `403` and changes
//! nothing; no token, or a wrong one, gets `401`; answers never echo a secret.

use crate::common;

use std::time::Duration;

use idem_core::{
    Claim, ClaimRequest, DedupKey, DedupStore, InspectStore, MemoryStore, RecordState,
};
use idem_serve::wire::LeaseBody;
use serde_json::{Value, json};

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    fn new(base: String) -> Self {
        // reqwest is built without a crypto provider of its own (idem's clients bring ring).
        let _ =
            idem_serve::tokio_rustls::rustls::crypto::ring::default_provider().install_default();
        Self { http: reqwest::Client::new(), base }
    }

    async fn call(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req =
            self.http.request(method.parse().expect("method"), format!("{}{path}", self.base));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let res = req.send().await.expect("send");
        let status = res.status().as_u16();
        let text = res.text().await.expect("body");
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }
}

fn key(scope: &str, id: &str) -> DedupKey {
    DedupKey::new(scope, id).expect("key")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_outside_its_scopes_gets_403_and_changes_nothing() {
    let store = MemoryStore::new();
    let server = common::serve(store.clone()).await;
    let api = Api::new(server.base());
    let orders = Some(common::ORDERS);

    // A record of scope "payments", held by the admin: what the orders token must not touch.
    let held = key("payments", "p-1");
    let Claim::Acquired(lease) = store
        .claim(&ClaimRequest::new(
            held.clone(),
            None,
            Duration::from_secs(60),
            Duration::from_secs(600),
        ))
        .await
        .expect("claim")
    else {
        panic!("first claim acquires");
    };
    let lease_json = serde_json::to_value(LeaseBody::from_lease(&lease)).expect("lease");
    let before = store.get(&held).await.expect("get").expect("record");

    let cases: Vec<(&str, &str, Option<Value>)> = vec![
        ("POST", "/v1/claims", Some(json!({"scope": "payments", "key": "p-2"}))),
        (
            "POST",
            "/v1/claims/batch",
            Some(
                json!({"claims": [{"scope": "orders", "key": "o-9"}, {"scope": "payments", "key": "p-3"}]}),
            ),
        ),
        ("POST", "/v1/complete", Some(json!({"lease": lease_json, "result": "stolen"}))),
        ("POST", "/v1/complete/batch", Some(json!({"items": [{"lease": lease_json}]}))),
        ("POST", "/v1/fail", Some(json!({"lease": lease_json, "reason": "no"}))),
        ("POST", "/v1/release", Some(json!({"lease": lease_json}))),
        ("POST", "/v1/extend", Some(json!({"lease": lease_json, "by_ms": 1000}))),
        ("GET", "/v1/records/payments/p-1", None),
        ("GET", "/v1/records?scope=payments", None),
        ("GET", "/v1/records", None),
        ("GET", "/v1/stats?scope=payments", None),
        ("GET", "/v1/stats", None),
        ("POST", "/v1/records/payments/p-1/release", None),
        ("POST", "/v1/records/payments/p-1/fail", Some(json!({"reason": "no"}))),
        ("POST", "/v1/purge", Some(json!({"limit": 10}))),
    ];
    for (method, path, body) in &cases {
        let (status, problem) = api.call(orders, method, path, body.clone()).await;
        assert_eq!(status, 403, "{method} {path}: {problem}");
        assert_eq!(problem["type"], "forbidden", "{method} {path}: {problem}");
        assert!(problem["detail"].as_str().is_some_and(|d| d.contains("orders")), "{problem}");
        // No token, and a wrong one: 401 before anything else is looked at.
        for token in [None, Some("not-a-known-token-at-all")] {
            let (status, problem) = api.call(token, method, path, body.clone()).await;
            assert_eq!(status, 401, "{method} {path} with {token:?}: {problem}");
        }
    }
    // Nothing changed: the held record is as it was, no other record exists (not even the
    // batch's allowed "orders" claim: a batch is refused whole).
    assert_eq!(store.get(&held).await.expect("get").expect("record"), before);
    let counts = store.count(None).await.expect("count");
    assert_eq!((counts.total(), counts.in_progress), (1, 1));
    assert!(store.get(&key("payments", "p-2")).await.expect("get").is_none());
    assert!(store.get(&key("orders", "o-9")).await.expect("get").is_none());

    // The same token inside its scope works, and the admin token's lease completes.
    let (status, answer) = api
        .call(orders, "POST", "/v1/claims", Some(json!({"scope": "orders", "key": "o-1"})))
        .await;
    assert_eq!((status, answer["outcome"].as_str()), (200, Some("acquired")), "{answer}");
    let (status, _) = api
        .call(Some(common::ADMIN), "POST", "/v1/complete", Some(json!({"lease": lease_json})))
        .await;
    assert_eq!(status, 204);
    assert_eq!(store.get(&held).await.expect("get").expect("record").state, RecordState::Completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_a_400_naming_the_field() {
    let server = common::serve(MemoryStore::new()).await;
    let api = Api::new(server.base());
    let admin = Some(common::ADMIN);
    let cases = [
        (json!({"scope": "orders", "key": "k", "lease_ms": 0}), "lease_ms"),
        (json!({"scope": "orders", "key": "k", "lease_ms": 86_400_001u64}), "lease_ms"),
        (json!({"scope": "orders", "key": "k", "retain_ms": 0}), "retain_ms"),
        (json!({"scope": "orders", "key": "k", "fingerprint": "xyz"}), "fingerprint"),
        (json!({"scope": "orders", "key": "k", "fingerprint": "00", "payload": "p"}), "payload"),
        (json!({"scope": "", "key": "k"}), "key"),
        (json!({"scope": "orders", "key": "a\u{0}b"}), "key"),
        (json!({"scope": "orders"}), "body"),
        (json!({"scope": "orders", "key": "k", "extra": 1}), "body"),
    ];
    for (body, field) in cases {
        let (status, problem) = api.call(admin, "POST", "/v1/claims", Some(body.clone())).await;
        assert_eq!(status, 400, "{body}: {problem}");
        assert_eq!(problem["type"], "invalid", "{body}: {problem}");
        assert_eq!(problem["field"], field, "{body}: {problem}");
    }
    let (status, problem) = api.call(admin, "GET", "/v1/records?limit=5000", None).await;
    assert_eq!(
        (status, problem["field"].as_str(), problem["limit"].as_u64()),
        (400, Some("limit"), Some(1000))
    );
    let (status, problem) = api.call(admin, "GET", "/v1/nowhere", None).await;
    assert_eq!((status, problem["type"].as_str()), (404, Some("not_found")));
    // A lease that was never handed out (forged token) is lost, not applied.
    let forged = json!({"lease": {"scope": "orders", "key": "k", "token": "12345", "attempt": 1, "until_us": 0}});
    let (status, problem) = api.call(admin, "POST", "/v1/complete", Some(forged)).await;
    assert_eq!((status, problem["type"].as_str()), (409, Some("lease_lost")), "{problem}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_listener_serves_the_api() {
    let Some(pki) = idem_testkit::tls::Pki::require() else { return };
    let acceptor =
        idem_serve::tls_acceptor(&pki.read(&pki.server_cert()), &pki.read(&pki.server_key()))
            .expect("acceptor");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = idem_serve::router(MemoryStore::new(), common::tokens(), None);
    let server = tokio::spawn(idem_serve::serve(
        app,
        listener,
        Some(acceptor),
        idem_serve::Limits::default(),
        async {
            let _ = rx.await;
        },
    ));
    // The test certificate names "localhost".
    let remote = idem_serve::RemoteStore::builder(&format!("https://localhost:{port}"))
        .ca_pem(&pki.read(&pki.ca()))
        .expect("ca")
        .token(common::ADMIN)
        .build()
        .expect("client");
    let k = key("orders", "tls-1");
    let claim = remote
        .claim(&ClaimRequest::new(
            k.clone(),
            None,
            Duration::from_secs(30),
            Duration::from_secs(60),
        ))
        .await
        .expect("claim over TLS");
    let Claim::Acquired(lease) = claim else { panic!("acquired") };
    remote.complete(lease, Some(b"ok"), Duration::from_secs(60)).await.expect("complete");
    assert!(matches!(
        remote.claim(&ClaimRequest::new(k, None, Duration::from_secs(30), Duration::from_secs(60))).await,
        Ok(Claim::Completed(r)) if r.result.as_deref() == Some(&b"ok"[..])
    ));
    // A client that does not trust the CA is refused at the handshake.
    let untrusting =
        idem_serve::RemoteStore::new(&format!("https://localhost:{port}")).expect("client");
    assert!(untrusting.check().await.is_err());
    let _ = tx.send(());
    tokio::time::timeout(Duration::from_secs(15), server)
        .await
        .expect("graceful shutdown within the drain timeout")
        .expect("join")
        .expect("serve");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_no_store_hands_out_is_lease_lost_on_sql_stores() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = idem_sqlx::SqliteStore::open(dir.path().join("t.sqlite")).await.expect("store");
    let server = common::serve(store).await;
    let api = Api::new(server.base());
    // Found by hand against SQLite: above i64::MAX the store answered 500 corrupt.
    let forged = json!({"lease": {"scope": "orders", "key": "k", "token": "9223372036854775808", "attempt": 1, "until_us": 0}, "result": "x"});
    let (status, problem) =
        api.call(Some(common::ADMIN), "POST", "/v1/complete", Some(forged)).await;
    assert_eq!((status, problem["type"].as_str()), (409, Some("lease_lost")), "{problem}");
}

// A route called with another method answers a problem document (405), as every other refusal
// does; a body past the API's limit says the limit, not a length it never read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_method_and_a_too_large_body_answer_problem_documents() {
    let server = common::serve(MemoryStore::new()).await;
    let api = Api::new(server.base());
    let (status, body) = api.call(None, "POST", "/readyz", None).await;
    assert_eq!(status, 405, "{body}");
    assert_eq!(body["type"], "method_not_allowed", "{body}");
    assert!(body["detail"].as_str().unwrap().contains("/readyz"), "{body}");
    let huge = json!({ "scope": "orders", "key": "k", "pad": "x".repeat(idem_serve::wire::MAX_BODY_BYTES) });
    let (status, body) = api.call(Some(common::ORDERS), "POST", "/v1/claims", Some(huge)).await;
    assert_eq!(status, 413, "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(detail.contains("API's limit"), "{body}");
    assert!(!detail.contains("0 bytes,"), "{body}");
}

/// A raw HTTP/1.1 request with the given `Host`; answers the status line and the body.
async fn with_host(
    addr: std::net::SocketAddr,
    host: &str,
    token: Option<&str>,
) -> (String, String) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let auth = token.map(|t| format!("authorization: Bearer {t}\r\n")).unwrap_or_default();
    let req = format!("GET /v1/stats HTTP/1.1\r\nhost: {host}\r\n{auth}connection: close\r\n\r\n");
    tcp.write_all(req.as_bytes()).await.expect("write");
    let mut text = String::new();
    tcp.read_to_string(&mut text).await.expect("read");
    let status = text.lines().next().unwrap_or_default().to_owned();
    let body = text.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

// Anonymous access answers loopback names only: a page whose name was re-pointed at 127.0.0.1
// (DNS rebinding) sends its own name as `Host` and is refused; with tokens, `Host` is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anonymous_access_refuses_a_host_that_is_not_loopback() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = idem_serve::router(MemoryStore::new(), idem_serve::Tokens::anonymous(), None);
    tokio::spawn(idem_serve::serve(
        app,
        listener,
        None,
        idem_serve::Limits::default(),
        std::future::pending(),
    ));
    let port = addr.port();
    for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}"), "[::1]".to_owned()] {
        assert_eq!(with_host(addr, &host, None).await.0, "HTTP/1.1 200 OK", "{host}");
    }
    for host in [format!("evil.example:{port}"), "192.168.1.10".to_owned(), "a b".to_owned()] {
        let (status, body) = with_host(addr, &host, None).await;
        assert_eq!(status, "HTTP/1.1 403 Forbidden", "{host}");
        assert!(body.contains("anonymous access answers only localhost"), "{body}");
    }
    let server = common::serve(MemoryStore::new()).await;
    let (status, _) = with_host(server.addr, "idem.internal:7700", Some(common::ADMIN)).await;
    assert_eq!(status, "HTTP/1.1 200 OK", "with tokens, any Host");
}

// Every refusal is counted by reason and logged at debug with its route, never the token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_counted_by_reason() {
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let server = common::serve(MemoryStore::new()).await;
    let api = Api::new(server.base());
    let body = json!({"scope": "payments", "key": "p-1"});
    metrics::set_global_recorder(recorder).expect("the only recorder this test binary installs");
    assert_eq!(api.call(None, "POST", "/v1/claims", Some(body.clone())).await.0, 401);
    assert_eq!(
        api.call(Some("not-a-token-at-all-000"), "POST", "/v1/claims", Some(body.clone())).await.0,
        401
    );
    assert_eq!(api.call(Some(common::ORDERS), "POST", "/v1/claims", Some(body)).await.0, 403);
    let mut seen = std::collections::BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        if key.key().name() == "idem_api_denied_total"
            && let metrics_util::debugging::DebugValue::Counter(n) = value
        {
            let reason =
                key.key().labels().find(|l| l.key() == "reason").map(|l| l.value().to_owned());
            *seen.entry(reason.unwrap_or_default()).or_insert(0) += n;
        }
    }
    for reason in ["missing_token", "unknown_token", "scope"] {
        assert!(seen.get(reason).copied().unwrap_or(0) >= 1, "{reason} not counted: {seen:?}");
    }
}

// A failed store call answers `503` (retryable) without the store's own text, which may name
// hosts, statements or driver internals: that goes to the server's log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failure_answers_503_without_the_stores_text() {
    use idem_testkit::faults::{FaultyStore, Op};
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_next(Op::Claim, 1);
    let server = common::serve(store).await;
    let api = Api::new(server.base());
    let (status, problem) = api
        .call(
            Some(common::ADMIN),
            "POST",
            "/v1/claims",
            Some(json!({"scope": "orders", "key": "o-1"})),
        )
        .await;
    assert_eq!(status, 503, "{problem}");
    assert_eq!(problem["type"], "unavailable");
    assert_eq!(problem["retryable"], true);
    assert!(!problem.to_string().contains("injected fault"), "the store's text: {problem}");
    assert_eq!(problem["detail"], "the store failed (try again); the server's log has its error");
}
