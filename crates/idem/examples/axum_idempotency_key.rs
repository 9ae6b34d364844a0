//! A payment endpoint made idempotent with the `Idempotency-Key` header.
//!
//! ```sh
//! cargo run -p idem-consumer --features axum --example axum_idempotency_key            # scripted client, then exit
//! cargo run -p idem-consumer --features axum --example axum_idempotency_key -- --serve 127.0.0.1:3000
//! curl -i -X POST localhost:3000/payments -H 'authorization: Bearer cust_1' \
//!      -H 'idempotency-key: order-42' -H 'content-type: application/json' -d '{"cents":1200}'
//! ```
//!
//! The store is the embedded SQLite file (a temporary one here). Authentication turns the bearer
//! token into a `Principal`, so one customer's key never replays another's charge. The charge
//! goes to a (fake) payment provider with a downstream idempotency key derived from ours.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idem::SqliteStore;
use idem::http::{IdempotencyKeyLayer, IdempotentRequest, Principal};

#[derive(Clone, Default)]
struct Provider {
    charges: Arc<AtomicU32>,
}

#[derive(serde::Deserialize)]
struct Charge {
    cents: u64,
}

async fn pay(
    State(provider): State<Provider>,
    Extension(customer): Extension<Principal>,
    idem: Option<Extension<IdempotentRequest>>,
    Json(charge): Json<Charge>,
) -> Response {
    if charge.cents == 0 {
        // A 4xx is stored too: the retry gets the same refusal without running this again.
        return (StatusCode::UNPROCESSABLE_ENTITY, "amount must be positive").into_response();
    }
    // The provider deduplicates by this key, so even a takeover after a crash charges once.
    let downstream = idem.map(|Extension(i)| i.downstream_key()).unwrap_or_default();
    let n = provider.charges.fetch_add(1, Ordering::SeqCst) + 1;
    let body = serde_json::json!({
        "payment": format!("pay_{n}"),
        "customer": customer.as_str(),
        "cents": charge.cents,
        "provider_idempotency_key": downstream,
    });
    (StatusCode::CREATED, Json(body)).into_response()
}

// Stand-in for real authentication: the bearer token is the customer id.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_owned);
    match token {
        Some(customer) => {
            req.extensions_mut().insert(Principal::new(customer));
            next.run(req).await
        }
        None => (StatusCode::UNAUTHORIZED, "bearer token required").into_response(),
    }
}

async fn app(store: SqliteStore, provider: Provider) -> Router {
    let idempotency = IdempotencyKeyLayer::new(store)
        .required(true)
        .lease(Duration::from_secs(30))
        .retain(Duration::from_secs(24 * 3600));
    Router::new()
        .route("/payments", post(pay))
        .with_state(provider)
        // axum runs the layer added last first: authentication, then idempotency, so the
        // principal is in the scope. Added the other way round, the idempotency layer would see
        // no principal and refuse every keyed request with a 500 (its log says why).
        .layer(idempotency)
        .layer(middleware::from_fn(authenticate))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await?;
    let provider = Provider::default();
    let router = app(store, provider.clone()).await;

    let serve_at = std::env::args().skip_while(|a| a != "--serve").nth(1);
    let listener =
        tokio::net::TcpListener::bind(serve_at.as_deref().unwrap_or("127.0.0.1:0")).await?;
    let addr = listener.local_addr()?;
    if serve_at.is_some() {
        println!("listening on http://{addr}");
        axum::serve(listener, router).await?;
        return Ok(());
    }
    tokio::spawn(async move { axum::serve(listener, router).await });

    let body = r#"{"cents":1200}"#;
    let steps = [
        ("first request", "cust_1", Some("order-42"), body),
        ("client retries (timeout)", "cust_1", Some("order-42"), body),
        ("same key, other amount", "cust_1", Some("order-42"), r#"{"cents":9900}"#),
        ("no Idempotency-Key", "cust_1", None, body),
        ("other customer, same key", "cust_2", Some("order-42"), body),
        ("refused charge", "cust_1", Some("order-43"), r#"{"cents":0}"#),
        ("refused charge, retried", "cust_1", Some("order-43"), r#"{"cents":0}"#),
    ];
    for (what, customer, key, body) in steps {
        let (status, replayed, text) = post_json(addr, customer, key, body).await?;
        let mark = if replayed { " [replayed]" } else { "" };
        println!("{what:<28} → {status}{mark} {text}");
    }
    let charges = provider.charges.load(Ordering::SeqCst);
    println!("provider charged {charges} times (one per customer and key)");
    if charges != 2 {
        return Err(format!("expected 2 charges, got {charges}").into());
    }
    Ok(())
}

async fn post_json(
    addr: SocketAddr,
    customer: &str,
    key: Option<&str>,
    body: &str,
) -> Result<(u16, bool, String), Box<dyn std::error::Error>> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = hyper::Request::post("/payments")
        .header("host", addr.to_string())
        .header("authorization", format!("Bearer {customer}"))
        .header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let res = sender.send_request(req.body(Full::new(bytes_of(body)))?).await?;
    let status = res.status().as_u16();
    let replayed = res.headers().contains_key("idempotent-replayed");
    let text = String::from_utf8(res.into_body().collect().await?.to_bytes().to_vec())?;
    Ok((status, replayed, text))
}

fn bytes_of(s: &str) -> hyper::body::Bytes {
    hyper::body::Bytes::copy_from_slice(s.as_bytes())
}
