//! A real axum server on 127.0.0.1:0 behind the layer, and a plain hyper client.

#![allow(dead_code, unreachable_pub)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idem_core::DedupStore;
use idem_http::{IdempotencyKeyLayer, IdempotentRequest, Principal, PrincipalKey};
use tokio::sync::{Semaphore, watch};

/// Test time limit for any wait on a condition.
pub const WAIT: Duration = Duration::from_secs(10);

/// The secret the test layers hash principals with.
pub fn principal_key() -> PrincipalKey {
    PrincipalKey::new("a test secret, 32 bytes or more.").expect("long enough")
}

#[derive(Clone)]
pub struct Handlers {
    /// How many times any handler ran (`watch` so tests can wait for a count).
    pub calls: Arc<watch::Sender<usize>>,
    /// `/slow` waits for a permit here before answering (its first attempt)…
    pub gate: Arc<Semaphore>,
    /// …or here (later attempts, which took an expired lease over).
    pub retry_gate: Arc<Semaphore>,
}

pub struct App {
    pub addr: SocketAddr,
    pub h: Handlers,
    _server: tokio::task::JoinHandle<()>,
}

impl App {
    pub fn calls(&self) -> usize {
        *self.h.calls.borrow()
    }

    /// Waits until handlers ran at least `n` times.
    pub async fn wait_calls(&self, n: usize) {
        let mut rx = self.h.calls.subscribe();
        tokio::time::timeout(WAIT, rx.wait_for(|c| *c >= n))
            .await
            .expect("handler calls did not reach the count in time")
            .expect("sender alive");
    }

    pub async fn send(&self, req: Req<'_>) -> Reply {
        send(self.addr, req).await
    }
}

fn bump(h: &Handlers) -> usize {
    let mut n = 0;
    h.calls.send_modify(|c| {
        *c += 1;
        n = *c;
    });
    n
}

// A payment: 201, a fresh id per run (so a replay is told apart from a second run), a header.
async fn pay(State(h): State<Handlers>, body: Bytes) -> Response {
    let n = bump(&h);
    let id = format!("pay_{n}_{}", std::process::id());
    let mut res = (
        StatusCode::CREATED,
        [("content-type", "application/json"), ("x-payment-id", id.as_str())],
        format!(r#"{{"id":"{id}","run":{n},"echo":{}}}"#, body.len()),
    )
        .into_response();
    res.headers_mut().append("link", HeaderValue::from_static("</payments>; rel=\"collection\""));
    res.headers_mut().append("link", HeaderValue::from_static("</docs>; rel=\"help\""));
    res
}

async fn slow(
    State(h): State<Handlers>,
    Extension(idem): Extension<IdempotentRequest>,
    body: Bytes,
) -> Response {
    bump(&h);
    let gate = if idem.attempt() == 1 { &h.gate } else { &h.retry_gate };
    let permit = gate.acquire().await.expect("gate open");
    permit.forget();
    let n = *h.calls.borrow();
    let text =
        format!("slow attempt {} done after {n} calls, {} bytes", idem.attempt(), body.len());
    (StatusCode::OK, text).into_response()
}

// 503 on its first run, 201 afterwards.
async fn flaky(
    State(h): State<Handlers>,
    Extension(idem): Extension<IdempotentRequest>,
) -> Response {
    if bump(&h) == 1 {
        (StatusCode::SERVICE_UNAVAILABLE, "try later").into_response()
    } else {
        let body = format!("created on attempt {} ({})", idem.attempt(), idem.downstream_key());
        (StatusCode::CREATED, body).into_response()
    }
}

async fn invalid(State(h): State<Handlers>) -> Response {
    let n = bump(&h);
    (StatusCode::BAD_REQUEST, format!("invalid card (run {n})")).into_response()
}

async fn big(State(h): State<Handlers>) -> Response {
    bump(&h);
    (StatusCode::OK, "x".repeat(4096)).into_response()
}

// Answers the status in the path: what an inner layer (auth, rate limit) or the endpoint sends.
async fn status(State(h): State<Handlers>, Path(code): Path<u16>) -> Response {
    let n = bump(&h);
    let status = StatusCode::from_u16(code).expect("test status");
    (status, format!("status {code} (run {n})")).into_response()
}

/// `/stream` answers 64 frames of 100 bytes with no size hint, so the layer learns its size
/// only by reading it.
pub const STREAM_FRAMES: usize = 64;

async fn stream(State(h): State<Handlers>) -> Response {
    let n = bump(&h);
    let frames = (0..STREAM_FRAMES).map(move |i| {
        Ok::<_, std::convert::Infallible>(Bytes::from(format!(
            "{n:>4}:{i:>4}:{}\n",
            "x".repeat(89)
        )))
    });
    axum::body::Body::from_stream(futures_util::stream::iter(frames)).into_response()
}

async fn order_pay(State(h): State<Handlers>) -> Response {
    let n = bump(&h);
    (StatusCode::CREATED, format!("order paid (run {n})")).into_response()
}

async fn list(State(h): State<Handlers>) -> &'static str {
    bump(&h);
    "list"
}

// What an application's authentication does: turn the caller's credentials into a Principal.
async fn auth(mut req: Request, next: Next) -> Response {
    if let Some(user) = req.headers().get("x-user").and_then(|v| v.to_str().ok()) {
        let p = Principal::new(user.to_owned());
        req.extensions_mut().insert(p);
    }
    next.run(req).await
}

/// Which middleware sees a request first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Authentication, then the idempotency layer (the order the layer needs).
    AuthFirst,
    /// The idempotency layer, then authentication (the mistake the layer must refuse).
    IdemFirst,
}

/// The test routes behind `layer` (and the auth middleware in front of it).
pub fn router<St: DedupStore + 'static>(layer: IdempotencyKeyLayer<St>) -> (Router, Handlers) {
    router_in(layer, Order::AuthFirst)
}

/// The test routes behind `layer` and the auth middleware, in `order`.
pub fn router_in<St: DedupStore + 'static>(
    layer: IdempotencyKeyLayer<St>,
    order: Order,
) -> (Router, Handlers) {
    let h = Handlers {
        calls: Arc::new(watch::channel(0).0),
        gate: Arc::new(Semaphore::new(0)),
        retry_gate: Arc::new(Semaphore::new(0)),
    };
    let app = Router::new()
        .route("/payments", post(pay).get(list))
        .route("/slow", post(slow))
        .route("/flaky", post(flaky))
        .route("/invalid", post(invalid))
        .route("/big", post(big))
        .route("/status/{code}", post(status))
        .route("/stream", post(stream))
        .route("/orders/{id}/pay", post(order_pay))
        .route("/list", get(list))
        .with_state(h.clone());
    // axum runs the layer added last first.
    let app = match order {
        Order::AuthFirst => app.layer(layer).layer(middleware::from_fn(auth)),
        Order::IdemFirst => app.layer(middleware::from_fn(auth)).layer(layer),
    };
    (app, h)
}

/// Serves [`router`] on 127.0.0.1:0.
pub async fn serve<St: DedupStore + 'static>(layer: IdempotencyKeyLayer<St>) -> App {
    serve_in(layer, Order::AuthFirst).await
}

/// Serves [`router_in`] on 127.0.0.1:0.
pub async fn serve_in<St: DedupStore + 'static>(
    layer: IdempotencyKeyLayer<St>,
    order: Order,
) -> App {
    let (app, h) = router_in(layer, order);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        axum::serve(listener, app).await.expect("server");
    });
    App { addr, h, _server: server }
}

#[derive(Clone, Copy)]
pub struct Req<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub key: Option<&'a [u8]>,
    pub user: Option<&'a str>,
    pub body: &'a str,
}

impl<'a> Req<'a> {
    pub fn post(path: &'a str, key: &'a str, body: &'a str) -> Self {
        Self { method: "POST", path, key: Some(key.as_bytes()), user: None, body }
    }

    pub fn user(mut self, user: &'a str) -> Self {
        self.user = Some(user);
        self
    }
}

#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn replayed(&self) -> bool {
        self.headers.get("idempotent-replayed").is_some_and(|v| v == "true")
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The problem document; panics unless the reply is `application/problem+json`.
    pub fn problem(&self) -> serde_json::Value {
        assert_eq!(
            self.headers.get("content-type").map(|v| v.as_bytes()),
            Some(&b"application/problem+json"[..]),
            "not a problem reply: {self:?}"
        );
        let v: serde_json::Value = serde_json::from_slice(&self.body).expect("problem is JSON");
        assert_eq!(v["status"], self.status.as_u16(), "{v}");
        assert!(
            v["type"].as_str().is_some_and(|t| t.starts_with("https://") || t == "about:blank"),
            "{v}"
        );
        assert!(v["title"].is_string(), "{v}");
        v
    }

    /// Headers that describe the response (not this transmission, not the replay marker).
    pub fn stable_headers(&self) -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<_> = self
            .headers
            .iter()
            .filter(|(n, _)| !matches!(n.as_str(), "date" | "idempotent-replayed"))
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect();
        v.sort();
        v
    }
}

/// One request on its own connection, through hyper's client.
pub async fn send(addr: SocketAddr, req: Req<'_>) -> Reply {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("handshake");
    tokio::spawn(conn);
    let mut b = hyper::Request::builder()
        .method(req.method)
        .uri(req.path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    if let Some(k) = req.key {
        b = b.header("idempotency-key", HeaderValue::from_bytes(k).expect("test key"));
    }
    if let Some(u) = req.user {
        b = b.header("x-user", u);
    }
    let request = b.body(Full::new(Bytes::copy_from_slice(req.body.as_bytes()))).expect("request");
    let res = tokio::time::timeout(WAIT, sender.send_request(request))
        .await
        .expect("response in time")
        .expect("response");
    let (parts, body) = res.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Reply { status: parts.status, headers: parts.headers, body }
}
