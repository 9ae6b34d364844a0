//! A payment endpoint made idempotent with the `Idempotency-Key` header.
//!
//! ```sh
//! cargo run -p idem-consumer --features axum --example axum_idempotency_key            # scripted client, then exit
//! cargo run -p idem-consumer --features axum --example axum_idempotency_key -- --serve 127.0.0.1:3000
//! curl -i -X POST localhost:3000/payments -H 'authorization: Bearer tok_4f1c9a' \
//!      -H 'idempotency-key: order-42' -H 'content-type: application/json' -d '{"cents":1200}'
//! ```
//!
//! The store is the embedded SQLite file (a temporary one here). Authentication looks the bearer
//! token up and puts the customer's id in the request as its `Principal` (the id, not the token:
//! a token changes when it is refreshed, and a retry with the new one must still be the same
//! caller), so one customer's key never replays another's charge. The layer stores and logs only
//! a keyed hash of that id (`IDEM_PRINCIPAL_KEY`, the same secret on every instance). The charge
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
use idem::http::{IdempotencyKeyLayer, IdempotentRequest, Principal, PrincipalKey};

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

/// Stand-in for the session or token store: bearer token → customer id. `cust_1` holds two
/// tokens, as after a refresh.
const TOKENS: [(&str, &str); 3] =
    [("tok_4f1c9a", "cust_1"), ("tok_refreshed_77d0e2", "cust_1"), ("tok_b83e51", "cust_2")];

// Stand-in for real authentication: the token names the customer; the customer's id, never the
// token, is the principal.
async fn authenticate(mut req: Request, next: Next) -> Response {
    let token = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let customer = token.and_then(|t| TOKENS.iter().find(|(known, _)| *known == t));
    match customer {
        Some((_, customer)) => {
            req.extensions_mut().insert(Principal::new(*customer));
            next.run(req).await
        }
        None => (StatusCode::UNAUTHORIZED, "a valid bearer token is required").into_response(),
    }
}

/// The secret principals are hashed with: the same on every instance, for as long as responses
/// are retained. Demo only: a real service refuses to start without it.
fn principal_key() -> Result<PrincipalKey, idem::http::PrincipalKeyError> {
    let secret = std::env::var("IDEM_PRINCIPAL_KEY")
        .unwrap_or_else(|_| "demo secret; set IDEM_PRINCIPAL_KEY in production".to_owned());
    PrincipalKey::new(secret)
}

async fn app(store: SqliteStore, provider: Provider) -> Result<Router, Box<dyn std::error::Error>> {
    let idempotency = IdempotencyKeyLayer::new(store)
        .principal_key(principal_key()?)
        .required(true)
        .lease(Duration::from_secs(30))
        .retain(Duration::from_secs(24 * 3600));
    Ok(Router::new()
        .route("/payments", post(pay))
        .with_state(provider)
        // axum runs the layer added last first: authentication, then idempotency, so the
        // principal is in the scope. Added the other way round, the idempotency layer would see
        // no principal and refuse every keyed request with a 500 (its log says why).
        .layer(idempotency)
        .layer(middleware::from_fn(authenticate)))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await?;
    let provider = Provider::default();
    let router = app(store, provider.clone()).await?;

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
    let (cust_1, cust_1_refreshed, cust_2) = (TOKENS[0].0, TOKENS[1].0, TOKENS[2].0);
    let steps = [
        ("first request", cust_1, Some("order-42"), body),
        ("client retries (timeout)", cust_1, Some("order-42"), body),
        ("retries after token refresh", cust_1_refreshed, Some("order-42"), body),
        ("same key, other amount", cust_1, Some("order-42"), r#"{"cents":9900}"#),
        ("no Idempotency-Key", cust_1, None, body),
        ("other customer, same key", cust_2, Some("order-42"), body),
        ("refused charge", cust_1, Some("order-43"), r#"{"cents":0}"#),
        ("refused charge, retried", cust_1, Some("order-43"), r#"{"cents":0}"#),
        ("unknown token", "tok_forged", Some("order-44"), body),
    ];
    let mut replays = 0;
    for (what, token, key, body) in steps {
        let (status, replayed, text) = post_json(addr, token, key, body).await?;
        replays += u32::from(replayed);
        let mark = if replayed { " [replayed]" } else { "" };
        println!("{what:<28} → {status}{mark} {text}");
    }
    let charges = provider.charges.load(Ordering::SeqCst);
    println!("provider charged {charges} times (one per customer and key), {replays} replays");
    // Had the token been the principal, the retry after the refresh would have charged again.
    if (charges, replays) != (2, 3) {
        return Err(format!("expected 2 charges and 3 replays, got {charges} and {replays}").into());
    }
    Ok(())
}

async fn post_json(
    addr: SocketAddr,
    token: &str,
    key: Option<&str>,
    body: &str,
) -> Result<(u16, bool, String), Box<dyn std::error::Error>> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = hyper::Request::post("/payments")
        .header("host", addr.to_string())
        .header("authorization", format!("Bearer {token}"))
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
