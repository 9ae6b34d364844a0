//! Push mode's client: what it does not trust. A redirect is not followed, the proxy variables
//! are ignored, an answer is read up to its limit, and the endpoint's password stays out of
//! every error and `Debug`.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode, header};
use axum::routing::post;
use idem_core::engine::{Cause, FailureKind};
use idem_core::extract::Message;
use idem_core::{Engine, MemoryStore, Outcome};
use idem_serve::{PushError, Pusher};

type Pushed = Outcome<serde_json::Value, PushError>;

/// Serves `router` on a loopback port of its own.
async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    addr
}

/// An endpoint that counts its requests and answers `answer`.
async fn counting(
    answer: impl Fn() -> (StatusCode, HeaderMap, Vec<u8>) + Clone + Send + Sync + 'static,
) -> (SocketAddr, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&hits);
    let router = Router::new().route(
        "/{*path}",
        post(move || {
            let (seen, answer) = (Arc::clone(&seen), answer.clone());
            async move {
                seen.fetch_add(1, Ordering::SeqCst);
                answer()
            }
        }),
    );
    (serve(router).await, hits)
}

fn ok() -> (StatusCode, HeaderMap, Vec<u8>) {
    (StatusCode::OK, HeaderMap::new(), br#"{"ok":true}"#.to_vec())
}

/// Pushes one message through an engine (the context a push-mode consumer gives).
async fn push(pusher: &Pusher, id: &str) -> Pushed {
    let engine = Engine::builder(MemoryStore::new()).scope("push").build().unwrap();
    let msg = Message::new(br#"{"order":"o-1"}"#.to_vec()).with_message_id(id);
    let m = &msg;
    engine.process(m, |ctx| async move { pusher.push(&ctx, m).await }).await
}

fn failure(out: &Pushed) -> (FailureKind, &PushError) {
    match out {
        Outcome::Failed(f) => match &f.cause {
            Cause::Handler(e) => (f.kind, e),
            other => panic!("not the push's failure: {other}"),
        },
        other => panic!("not a failure: {other:?}"),
    }
}

// A 307 (or 308) would resend the body to wherever the answer points: it is a failed push with
// its status, retried by the rules, and nothing reaches the other listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_a_failed_push_and_is_not_followed() {
    let (elsewhere, elsewhere_hits) = counting(ok).await;
    let (endpoint, hits) = counting(move || {
        let mut h = HeaderMap::new();
        h.insert(header::LOCATION, format!("http://{elsewhere}/stolen").parse().unwrap());
        (StatusCode::TEMPORARY_REDIRECT, h, Vec::new())
    })
    .await;
    let pusher = Pusher::new(&format!("http://{endpoint}/orders"), Duration::from_secs(5)).unwrap();
    let out = push(&pusher, "m-1").await;
    let (kind, e) = failure(&out);
    assert_eq!(kind, FailureKind::Transient, "{e}");
    assert!(matches!(e, PushError::Status { status: 307, .. }), "{e}");
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    assert_eq!(elsewhere_hits.load(Ordering::SeqCst), 0, "the redirect was followed");
}

// HTTP_PROXY / HTTPS_PROXY / ALL_PROXY point at a listener of the test; the push goes straight
// to the (loopback) endpoint and nothing reaches the proxy. The variables are set for a child
// process only (this test binary again, running `proxy_variables_child`): setting them here
// would reach every other test's HTTP client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_variables_are_ignored() {
    let (endpoint, hits) = counting(ok).await;
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_url = format!("http://{}", proxy.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&connections);
    tokio::spawn(async move {
        while let Ok((_conn, _)) = proxy.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
        }
    });
    let child = tokio::process::Command::new(std::env::current_exe().unwrap())
        .args(["push::proxy_variables_child", "--exact", "--ignored", "--nocapture"])
        .env("IDEM_TEST_PUSH_ENDPOINT", format!("http://{endpoint}/orders"))
        .env("HTTP_PROXY", &proxy_url)
        .env("HTTPS_PROXY", &proxy_url)
        .env("ALL_PROXY", &proxy_url)
        .env("http_proxy", &proxy_url)
        .env_remove("NO_PROXY")
        .env_remove("no_proxy")
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), child).await.unwrap().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the child failed:\n{text}");
    assert!(text.contains("1 passed"), "the child test did not run:\n{text}");
    assert_eq!(hits.load(Ordering::SeqCst), 1, "the push did not reach the endpoint");
    assert_eq!(connections.load(Ordering::SeqCst), 0, "the push went through the proxy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a child process of the_proxy_variables_are_ignored"]
async fn proxy_variables_child() {
    let endpoint = std::env::var("IDEM_TEST_PUSH_ENDPOINT").unwrap();
    assert!(std::env::var("HTTP_PROXY").is_ok(), "run by the_proxy_variables_are_ignored");
    let pusher = Pusher::new(&endpoint, Duration::from_secs(5)).unwrap();
    let out = push(&pusher, "m-1").await;
    assert!(matches!(out, Outcome::Processed(_)), "{out:?}");
}

// An answer is read up to the limit and no further; a larger 2xx body completes the push
// without a stored result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_answer_is_read_up_to_the_limit() {
    let (endpoint, _) =
        counting(|| (StatusCode::OK, HeaderMap::new(), vec![b'x'; 4 * 1024 * 1024])).await;
    let pusher = Pusher::new(&format!("http://{endpoint}/orders"), Duration::from_secs(5))
        .unwrap()
        .max_response_bytes(1024);
    let out = push(&pusher, "m-1").await;
    assert!(matches!(out, Outcome::Processed(serde_json::Value::Null)), "{out:?}");
    // Within the limit, the body is the stored result.
    let small = Pusher::new(&format!("http://{endpoint}/orders"), Duration::from_secs(5))
        .unwrap()
        .max_response_bytes(8 * 1024 * 1024);
    assert!(
        matches!(push(&small, "m-2").await, Outcome::Processed(serde_json::Value::String(s)) if s.len() == 4 * 1024 * 1024)
    );
}

// A password in the endpoint URL appears in no error and no `Debug` output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoints_password_never_appears() {
    const PLANTED: &str = "pl4nted-s3cret";
    // A port nothing listens on: the push fails in transport, with the URL in reqwest's error.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let endpoint = format!("http://app:{PLANTED}@{addr}/orders?token={PLANTED}");
    let pusher = Pusher::new(&endpoint, Duration::from_secs(2)).unwrap();
    let debug = format!("{pusher:?}");
    assert!(!debug.contains(PLANTED), "{debug}");
    let out = push(&pusher, "m-1").await;
    let (kind, e) = failure(&out);
    assert_eq!(kind, FailureKind::Transient);
    assert!(matches!(e, PushError::Transport(_)), "{e}");
    let shown = format!("{out:?} / {e} / {}", idem_core::ErrorChain(e));
    assert!(!shown.contains(PLANTED), "{shown}");
    let bad = Pusher::new(&format!("ftp://app:{PLANTED}@x/"), Duration::from_secs(1)).unwrap_err();
    assert!(!bad.to_string().contains(PLANTED), "{bad}");
}
