//! The layer keeps callers apart only when authentication ran before it and put a `Principal`
//! in the request. Layered the other way round, every request reaches it without one: it must
//! refuse them (500, logged once) rather than let one user's retry replay another's response.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::{Arc, Mutex, OnceLock};

use common::{Order, Req, serve_in};
use idem_core::MemoryStore;
use idem_http::IdempotencyKeyLayer;
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt as _};

const BODY: &str = r#"{"amount":1200,"currency":"EUR"}"#;

/// The `ERROR` events of this test binary, each rendered as `field=value …`.
#[derive(Clone, Default)]
struct Errors(Arc<Mutex<Vec<String>>>);

impl Errors {
    /// The recorder, installed once for the binary (the layer's work runs on spawned tasks, so
    /// a thread-local subscriber would miss it).
    fn global() -> Self {
        static ERRORS: OnceLock<Errors> = OnceLock::new();
        ERRORS
            .get_or_init(|| {
                let errors = Errors::default();
                let subscriber = tracing_subscriber::registry().with(errors.clone());
                tracing::subscriber::set_global_default(subscriber).unwrap();
                errors
            })
            .clone()
    }

    /// Events mentioning `needle` (each test uses its own scope prefix).
    fn mentioning(&self, needle: &str) -> Vec<String> {
        self.0.lock().unwrap().iter().filter(|e| e.contains(needle)).cloned().collect()
    }
}

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={value:?} ", field.name()));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Errors {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::ERROR {
            let mut text = Text(String::new());
            event.record(&mut text);
            self.0.lock().unwrap().push(text.0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_after_the_layer_is_refused_and_no_response_crosses_users() {
    let errors = Errors::global();
    let layer = IdempotencyKeyLayer::new(MemoryStore::new()).scope_prefix("idem-first");
    let app = serve_in(layer, Order::IdemFirst).await;
    let alice = app.send(Req::post("/payments", "k", BODY).user("alice")).await;
    assert_eq!(alice.status, 500, "{}", alice.text());
    let p = alice.problem();
    let detail = p["detail"].as_str().unwrap();
    assert!(detail.contains("authentication") && detail.contains("before"), "{p}");
    assert!(detail.contains(".allow_anonymous()"), "{p}");
    let bob = app.send(Req::post("/payments", "k", BODY).user("bob")).await;
    assert_eq!(bob.status, 500, "{}", bob.text());
    assert!(!bob.replayed(), "bob got alice's response");
    assert_eq!(app.calls(), 0, "the handler ran for a request without a principal");
    let logged = errors.mentioning("idem-first");
    assert_eq!(logged.len(), 1, "logged once per layer: {logged:?}");
    assert!(logged[0].contains("authentication"), "{logged:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_before_the_layer_keeps_principals_apart() {
    let errors = Errors::global();
    let layer = IdempotencyKeyLayer::new(MemoryStore::new()).scope_prefix("auth-first");
    let app = serve_in(layer, Order::AuthFirst).await;
    let alice = app.send(Req::post("/payments", "k", BODY).user("alice")).await;
    let bob = app.send(Req::post("/payments", "k", BODY).user("bob")).await;
    assert_eq!((alice.status.as_u16(), bob.status.as_u16()), (201, 201));
    assert!(!bob.replayed(), "bob got alice's response");
    assert_ne!(bob.body, alice.body);
    let alice_again = app.send(Req::post("/payments", "k", BODY).user("alice")).await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(app.calls(), 2);
    assert!(errors.mentioning("auth-first").is_empty());
    // A caller the authentication let through without a principal is refused, not pooled
    // with the other anonymous callers, unless the layer allows anonymous callers.
    let anonymous = app.send(Req::post("/payments", "k", BODY)).await;
    assert_eq!(anonymous.status, 500, "{}", anonymous.text());
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_key_pass_through_without_a_principal() {
    let layer = IdempotencyKeyLayer::new(MemoryStore::new()).scope_prefix("no-key");
    let app = serve_in(layer, Order::IdemFirst).await;
    let req = Req { key: None, ..Req::post("/payments", "", BODY) };
    assert_eq!(app.send(req).await.status, 201);
    assert_eq!(app.calls(), 1);
}
