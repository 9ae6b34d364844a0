//! A webhook receiver that applies each event once, however often the sender redelivers it.
//!
//! ```sh
//! cargo run -p idem-consumer --features axum --example webhook_receiver
//! ```
//!
//! Webhook senders retry a delivery until they see a `2xx`, so a receiver gets the same event
//! again after a timeout, a lost response or a deploy. Two ways to deduplicate by the sender's
//! event id:
//!
//! - `/webhooks/github`: the id is a header (`X-GitHub-Delivery`, kept on redelivery; Standard
//!   Webhooks' `webhook-id` works the same). The `Idempotency-Key` layer, told that header's name,
//!   stores the first response and replays it. The verified sender is the principal, stored as a
//!   keyed hash (`IDEM_PRINCIPAL_KEY`).
//! - `/webhooks/stripe`: the id is in the body (`{"id":"evt_…"}`). The handler runs the
//!   consumer engine with a JSON-pointer key, exactly as a queue consumer would.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderName, StatusCode};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use idem::engine::HandlerError;
use idem::extract::{JsonPointer, Message};
use idem::http::{IdempotencyKeyLayer, KeyFormat, Principal, PrincipalKey};
use idem::{Engine, Outcome, SqliteStore};

#[derive(Clone)]
struct Receiver {
    stripe: Engine<SqliteStore>,
    applied: Arc<AtomicU32>,
}

async fn github(State(r): State<Receiver>, _body: Bytes) -> &'static str {
    r.applied.fetch_add(1, Ordering::SeqCst);
    "applied"
}

async fn stripe(State(r): State<Receiver>, body: Bytes) -> (StatusCode, String) {
    let event = Message::new(body.to_vec());
    let applied = &r.applied;
    let outcome = r
        .stripe
        .process(&event, |_ctx| async move {
            applied.fetch_add(1, Ordering::SeqCst);
            Ok::<_, HandlerError<String>>("applied".to_owned())
        })
        .await;
    match outcome {
        // 2xx tells the sender to stop retrying: the effect is recorded (now or before).
        Outcome::Processed(s) => (StatusCode::OK, s),
        Outcome::Duplicate(s) => (StatusCode::OK, format!("duplicate ({})", s.unwrap_or_default())),
        // Another worker holds this event: let the sender come back.
        Outcome::InProgressElsewhere { .. } => (StatusCode::CONFLICT, "in progress".into()),
        // Same event id, different content: refuse and alert; never drop it silently.
        Outcome::Conflict(c) => (StatusCode::UNPROCESSABLE_ENTITY, c.to_string()),
        other => (StatusCode::SERVICE_UNAVAILABLE, format!("{:?}", other.verb())),
    }
}

// Stand-in for signature verification: a verified delivery's sender is the principal, so two
// senders' ids never collide.
async fn verify(mut req: Request, next: Next) -> Response {
    req.extensions_mut().insert(Principal::new("github-app-1"));
    next.run(req).await
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await?;
    let receiver = Receiver {
        stripe: Engine::builder(store.clone())
            .scope("webhooks/stripe")
            .key(JsonPointer::new("/id"))
            .build()?,
        applied: Arc::default(),
    };
    // The same secret on every instance. Demo only: a real service refuses to start without it.
    let secret = std::env::var("IDEM_PRINCIPAL_KEY")
        .unwrap_or_else(|_| "demo secret; set IDEM_PRINCIPAL_KEY in production".to_owned());
    let github_dedup = IdempotencyKeyLayer::new(store)
        .principal_key(PrincipalKey::new(secret)?)
        .header(HeaderName::from_static("x-github-delivery"))
        // GitHub's delivery ids are UUIDs: anything else is refused with 400.
        .key_format(KeyFormat::Uuid)
        .required(true);
    let app = Router::new()
        .route(
            "/webhooks/github",
            // `verify` is added last, so it runs first and the sender is in the scope.
            post(github).layer(github_dedup).layer(middleware::from_fn(verify)),
        )
        .route("/webhooks/stripe", post(stripe))
        .with_state(receiver.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });

    let push = r#"{"ref":"refs/heads/main","after":"9f2c"}"#;
    let paid = r#"{"id":"evt_1","type":"invoice.paid","data":{"invoice":"in_7"}}"#;
    let deliveries = [
        ("/webhooks/github", Some("72d3162e-cc78-11e3-81ab-4c9367dc0958"), push),
        ("/webhooks/github", Some("72d3162e-cc78-11e3-81ab-4c9367dc0958"), push), // redelivery
        ("/webhooks/stripe", None, paid),
        ("/webhooks/stripe", None, paid), // redelivery after a lost 200
        (
            "/webhooks/stripe",
            None,
            r#"{"id":"evt_2","type":"invoice.paid","data":{"invoice":"in_8"}}"#,
        ),
        ("/webhooks/stripe", None, r#"{"id":"evt_1","type":"invoice.voided","data":{}}"#), // same id, other content
    ];
    for (path, delivery, body) in deliveries {
        let (status, replayed, text) = deliver(addr, path, delivery, body).await?;
        let mark = if replayed { " [replayed]" } else { "" };
        println!("{path:<18} {:<40} → {status}{mark} {text}", delivery.unwrap_or(""));
    }
    let applied = receiver.applied.load(Ordering::SeqCst);
    println!("events applied: {applied} (of 6 deliveries: 3 distinct events, 1 conflict)");
    if applied != 3 {
        return Err(format!("expected 3 applied events, got {applied}").into());
    }
    Ok(())
}

async fn deliver(
    addr: SocketAddr,
    path: &str,
    delivery: Option<&str>,
    body: &str,
) -> Result<(u16, bool, String), Box<dyn std::error::Error>> {
    let stream = tokio::net::TcpStream::connect(addr).await?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let mut req = hyper::Request::post(path)
        .header("host", addr.to_string())
        .header("content-type", "application/json");
    if let Some(id) = delivery {
        req = req.header("x-github-delivery", id);
    }
    let res =
        sender.send_request(req.body(Full::new(Bytes::copy_from_slice(body.as_bytes())))?).await?;
    let status = res.status().as_u16();
    let replayed = res.headers().contains_key("idempotent-replayed");
    let text = String::from_utf8(res.into_body().collect().await?.to_bytes().to_vec())?;
    Ok((status, replayed, text))
}
