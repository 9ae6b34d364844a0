//! Which responses the layer stores (only what the endpoint produced), and how it reads a
//! response body it may store (frame by frame, never past the limit).

#![allow(clippy::unwrap_used)]

use crate::common;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::IntoResponse;
use axum::routing::post;
use bytes::Bytes;
use common::{Req, STREAM_FRAMES, serve};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt as _, Full};
use idem_core::{DedupStore, MemoryStore};
use idem_http::{IdempotencyKeyLayer, stored_by_default};
use tower_layer::Layer as _;
use tower_service::Service;

const BODY: &str = r#"{"amount":1200}"#;

fn layer<St: DedupStore>(store: St) -> IdempotencyKeyLayer<St> {
    IdempotencyKeyLayer::new(store)
        .max_body(1024)
        .allow_anonymous()
        .principal_key(common::principal_key())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_before_the_endpoint_ran_are_not_replayed() {
    let app = serve(layer(MemoryStore::new())).await;
    let mut calls = 0;
    for code in [401, 403, 408, 425, 429, 500, 503] {
        let (path, key) = (format!("/status/{code}"), format!("k-{code}"));
        for attempt in 1..=2 {
            let res = app.send(Req::post(&path, &key, BODY)).await;
            calls += 1;
            assert_eq!(res.status, code, "{}", res.text());
            assert!(!res.replayed(), "{code} replayed on attempt {attempt}");
            assert_eq!(res.text(), format!("status {code} (run {calls})"));
        }
    }
    assert_eq!(app.calls(), calls, "every retry reached the service again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoints_answers_are_stored_and_replayed() {
    let app = serve(layer(MemoryStore::new())).await;
    for (i, code) in [200, 201, 400, 404, 409, 422].into_iter().enumerate() {
        let (path, key) = (format!("/status/{code}"), format!("k-{code}"));
        let first = app.send(Req::post(&path, &key, BODY)).await;
        assert_eq!((first.status.as_u16(), first.replayed()), (code, false));
        let retry = app.send(Req::post(&path, &key, BODY)).await;
        assert!(retry.replayed(), "{code} not replayed");
        assert_eq!((retry.status, &retry.body), (first.status, &first.body));
        assert_eq!(app.calls(), i + 1, "the retry of a {code} ran the endpoint again");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_custom_rule_decides_what_is_stored() {
    let rule = |s: StatusCode, h: &axum::http::HeaderMap| {
        s == StatusCode::TOO_MANY_REQUESTS
            || (s != StatusCode::NOT_FOUND && stored_by_default(s, h))
    };
    let app = serve(layer(MemoryStore::new()).store_response_if(rule)).await;
    // 404 is no longer stored: the retry runs again.
    assert!(!app.send(Req::post("/status/404", "a", BODY)).await.replayed());
    assert!(!app.send(Req::post("/status/404", "a", BODY)).await.replayed());
    assert_eq!(app.calls(), 2);
    // 429 now is.
    assert_eq!(app.send(Req::post("/status/429", "b", BODY)).await.status, 429);
    let retry = app.send(Req::post("/status/429", "b", BODY)).await;
    assert!(retry.replayed());
    assert_eq!(app.calls(), 3);
    // Everything else follows the default.
    assert!(!app.send(Req::post("/status/503", "c", BODY)).await.replayed());
    assert!(!app.send(Req::post("/status/503", "c", BODY)).await.replayed());
    assert_eq!(app.calls(), 5);
}

/// A rate limiter inside the idempotency layer answers 429 before the endpoint runs; the
/// client's retry, once let through, reaches the endpoint and is then stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_from_an_inner_layer_lets_the_retry_reach_the_endpoint() {
    let ran = Arc::new(AtomicUsize::new(0));
    let throttled = Arc::new(AtomicUsize::new(1));
    let (r, t) = (ran.clone(), throttled.clone());
    let app = Router::new()
        .route(
            "/payments",
            post(move || {
                let n = r.fetch_add(1, Ordering::SeqCst) + 1;
                async move { (StatusCode::CREATED, format!("paid (run {n})")) }
            }),
        )
        .layer(middleware::from_fn(move |req: Request, next: Next| {
            let t = t.clone();
            async move {
                // Refuses the first request, lets the others through.
                if t.fetch_sub(1, Ordering::SeqCst) > 0 {
                    (StatusCode::TOO_MANY_REQUESTS, "slow down").into_response()
                } else {
                    next.run(req).await
                }
            }
        }))
        .layer(layer(MemoryStore::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let first = common::send(addr, Req::post("/payments", "k", BODY)).await;
    assert_eq!((first.status.as_u16(), ran.load(Ordering::SeqCst)), (429, 0));
    let retry = common::send(addr, Req::post("/payments", "k", BODY)).await;
    assert_eq!((retry.status.as_u16(), retry.replayed()), (201, false));
    let again = common::send(addr, Req::post("/payments", "k", BODY)).await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    server.abort();
}

/// A body of no known size, larger than the limit: the client gets all of it, byte for byte;
/// the key records that the request ran, so the retry is a 409, not a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_past_the_limit_reaches_the_client_whole_and_is_not_rerun() {
    let app = serve(layer(MemoryStore::new())).await;
    let first = app.send(Req::post("/stream", "k", BODY)).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.body.len(), STREAM_FRAMES * 100);
    for (i, line) in first.text().lines().enumerate() {
        assert!(line.starts_with(&format!("   1:{i:>4}:")), "line {i}: {line}");
    }
    let retry = app.send(Req::post("/stream", "k", BODY)).await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem()["title"], "Request was processed; its response was not stored");
    assert_eq!(app.calls(), 1);
    // Within the limit, the same endpoint's answer is stored and replayed.
    let app = serve(layer(MemoryStore::new()).max_body(STREAM_FRAMES * 100)).await;
    let first = app.send(Req::post("/stream", "k", BODY)).await;
    let retry = app.send(Req::post("/stream", "k", BODY)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(app.calls(), 1);
}

/// An endless body of 100-byte frames, numbered, with no size hint; counts the frames polled.
struct Endless {
    polled: Arc<AtomicUsize>,
    sent: usize,
    /// Fails instead of answering this frame.
    fail_at: Option<usize>,
}

impl Body for Endless {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        self.polled.fetch_add(1, Ordering::SeqCst);
        let i = self.sent;
        self.sent += 1;
        if self.fail_at == Some(i) {
            return Poll::Ready(Some(Err(std::io::Error::other("upstream went away"))));
        }
        Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!("{i:>99}\n"))))))
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::new()
    }
}

/// The handler: answers an [`Endless`] body and counts its calls.
#[derive(Clone)]
struct Endpoint {
    calls: Arc<AtomicUsize>,
    polled: Arc<AtomicUsize>,
    fail_at: Option<usize>,
}

impl Service<http::Request<Full<Bytes>>> for Endpoint {
    type Response = http::Response<Endless>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Request<Full<Bytes>>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let body = Endless { polled: self.polled.clone(), sent: 0, fail_at: self.fail_at };
        std::future::ready(Ok(http::Response::new(body)))
    }
}

fn endpoint(fail_at: Option<usize>) -> Endpoint {
    Endpoint { calls: Arc::default(), polled: Arc::default(), fail_at }
}

fn keyed() -> http::Request<Full<Bytes>> {
    http::Request::post("/feed")
        .header("idempotency-key", "k")
        .body(Full::new(Bytes::from_static(BODY.as_bytes())))
        .unwrap()
}

#[tokio::test]
async fn an_endless_body_is_read_only_to_the_first_frame_past_the_limit() {
    let ep = endpoint(None);
    let mut svc = layer(MemoryStore::new()).layer(ep.clone());
    let res = svc.call(keyed()).await.unwrap();
    // 1024 bytes allowed: frames 0..=10 (1,100 bytes) read, not one more.
    assert_eq!(ep.polled.load(Ordering::SeqCst), 11);
    assert_eq!(res.status(), 200);
    let mut body = res.into_body();
    let head = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert_eq!(head.len(), 1100, "the frames read come first, whole");
    assert!(head.ends_with(format!("{:>99}\n", 10).as_bytes()));
    for i in 11..20 {
        let frame = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(frame, format!("{i:>99}\n"), "then the rest, in order");
    }
    assert_eq!(ep.polled.load(Ordering::SeqCst), 20, "the client drives the rest");
    drop(body);
    // The effect happened and was not stored: the retry is refused, the handler not rerun.
    let retry = svc.call(keyed()).await.unwrap();
    assert_eq!(retry.status(), 409);
    let text = retry.into_body().collect().await.unwrap().to_bytes();
    assert!(std::str::from_utf8(&text).unwrap().contains("its response was not stored"));
    assert_eq!(ep.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_failing_before_the_limit_releases_the_key() {
    let ep = endpoint(Some(3));
    let mut svc = layer(MemoryStore::new()).layer(ep.clone());
    let res = svc.call(keyed()).await.unwrap();
    assert_eq!(res.status(), 500);
    assert_eq!(ep.polled.load(Ordering::SeqCst), 4);
    // Released: the retry runs the handler again (and its body fails again).
    let retry = svc.call(keyed()).await.unwrap();
    assert_eq!(retry.status(), 500);
    assert_eq!(ep.calls.load(Ordering::SeqCst), 2);
}
