//! The layer keeps callers apart only when authentication ran before it and put a `Principal`
//! in the request. Layered the other way round, every request reaches it without one: it must
//! refuse them (a plain 500; the advice logged once) rather than let one user's retry replay
//! another's response. The principal itself never reaches the store or the logs: only its
//! keyed hash does.
//!
//! A binary of its own: it installs a process-global `tracing` subscriber that collects every
//! event of the binary.

#![allow(clippy::unwrap_used)]

#[path = "it/common/mod.rs"]
mod common;

use std::sync::{Arc, Mutex, OnceLock};

use common::{Order, Reply, Req, serve_in};
use idem_core::{InspectStore, ListFilter, MemoryStore};
use idem_http::{IdempotencyKeyLayer, Principal};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, SubscriberExt as _};

const BODY: &str = r#"{"amount":1200,"currency":"EUR"}"#;

/// Every event and span of this test binary, at every level, rendered as
/// `LEVEL message field=value …`.
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<String>>>);

impl Logs {
    /// The recorder, installed once for the binary (the layer's work runs on spawned tasks, so
    /// a thread-local subscriber would miss it).
    fn global() -> Self {
        static LOGS: OnceLock<Logs> = OnceLock::new();
        LOGS.get_or_init(|| {
            let logs = Logs::default();
            let subscriber = tracing_subscriber::registry().with(logs.clone());
            tracing::subscriber::set_global_default(subscriber).unwrap();
            logs
        })
        .clone()
    }

    fn push(&self, line: String) {
        self.0.lock().unwrap().push(line);
    }

    /// Lines mentioning `needle`.
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

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Logs {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut text = Text(format!("{} ", event.metadata().level()));
        event.record(&mut text);
        self.push(text.0);
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
        let mut text = Text(format!("SPAN {} ", attrs.metadata().name()));
        attrs.record(&mut text);
        self.push(text.0);
    }

    fn on_record(&self, _: &Id, values: &Record<'_>, _: Context<'_, S>) {
        let mut text = Text("SPAN RECORD ".to_owned());
        values.record(&mut text);
        self.push(text.0);
    }
}

fn layer(prefix: &str) -> IdempotencyKeyLayer<MemoryStore> {
    IdempotencyKeyLayer::new(MemoryStore::new())
        .scope_prefix(prefix)
        .principal_key(common::principal_key())
}

/// A plain 500: nothing about the server's layers, principals or settings.
fn assert_plain_500(res: &Reply) {
    assert_eq!(res.status, 500, "{}", res.text());
    let p = res.problem();
    assert_eq!(p["type"], "about:blank", "{p}");
    assert_eq!(p["title"], "Internal Server Error", "{p}");
    assert_eq!(p["detail"], "the request was not processed", "{p}");
    let text = res.text().to_lowercase();
    for advice in ["authentication", "principal", "layer", "anonymous", "extension", "secret"] {
        assert!(!text.contains(advice), "the body mentions {advice:?}: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_after_the_layer_is_refused_and_no_response_crosses_users() {
    let logs = Logs::global();
    let app = serve_in(layer("idem-first"), Order::IdemFirst).await;
    let alice = app.send(Req::post("/payments", "k", BODY).user("alice")).await;
    assert_plain_500(&alice);
    let bob = app.send(Req::post("/payments", "k", BODY).user("bob")).await;
    assert_plain_500(&bob);
    assert!(!bob.replayed(), "bob got alice's response");
    assert_eq!(app.calls(), 0, "the handler ran for a request without a principal");
    // Another layer (another router) makes the same mistake: the advice is not logged again.
    let other = serve_in(layer("idem-first-2"), Order::IdemFirst).await;
    assert_plain_500(&other.send(Req::post("/payments", "k", BODY).user("carol")).await);
    // Once per process, whichever test of this binary hit it first.
    let logged = logs.mentioning("authentication layer must run before");
    assert_eq!(logged.len(), 1, "logged once per process: {logged:?}");
    assert!(
        logged[0].starts_with("ERROR") && logged[0].contains(".allow_anonymous()"),
        "{logged:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_before_the_layer_keeps_principals_apart() {
    let app = serve_in(layer("auth-first"), Order::AuthFirst).await;
    let alice = app.send(Req::post("/payments", "k", BODY).user("alice")).await;
    let bob = app.send(Req::post("/payments", "k", BODY).user("bob")).await;
    assert_eq!((alice.status.as_u16(), bob.status.as_u16()), (201, 201));
    assert!(!bob.replayed(), "bob got alice's response");
    assert_ne!(bob.body, alice.body);
    let alice_again = app.send(Req::post("/payments", "k", BODY).user("alice")).await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(app.calls(), 2);
    // A caller the authentication let through without a principal is refused, not pooled
    // with the other anonymous callers, unless the layer allows anonymous callers.
    let anonymous = app.send(Req::post("/payments", "k", BODY)).await;
    assert_plain_500(&anonymous);
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_without_a_principal_key_is_a_plain_500() {
    let logs = Logs::global();
    let no_key = IdempotencyKeyLayer::new(MemoryStore::new()).scope_prefix("no-principal-key");
    let app = serve_in(no_key, Order::AuthFirst).await;
    assert_plain_500(&app.send(Req::post("/payments", "k", BODY).user("alice")).await);
    assert_plain_500(&app.send(Req::post("/payments", "k", BODY).user("alice")).await);
    assert_eq!(app.calls(), 0);
    let logged = logs.mentioning("no key to hash it with");
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert!(logged[0].starts_with("ERROR") && logged[0].contains(".principal_key("), "{logged:?}");
    // Requests without a key do not need one.
    let req = Req { key: None, ..Req::post("/payments", "", BODY).user("alice") };
    assert_eq!(app.send(req).await.status, 201);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_principal_never_reaches_the_store_or_the_logs() {
    let logs = Logs::global();
    let who = "alice.smith@example.com";
    let store = MemoryStore::new();
    let layer = IdempotencyKeyLayer::new(store.clone())
        .scope_prefix("hashed")
        .principal_key(common::principal_key());
    let app = serve_in(layer, Order::AuthFirst).await;
    assert_eq!(app.send(Req::post("/payments", "k", BODY).user(who)).await.status, 201);
    assert!(app.send(Req::post("/payments", "k", BODY).user(who)).await.replayed());
    // The handler's own view: the store key, and the downstream key derived from it.
    assert_eq!(app.send(Req::post("/flaky", "k", BODY).user(who)).await.status, 201);

    let tag = common::principal_key().tag(&Principal::new(who));
    let records = store.list(&ListFilter::new(10)).await.unwrap();
    assert_eq!(records.len(), 2, "{records:?}");
    for r in &records {
        assert!(r.scope.ends_with(&tag), "{}", r.scope);
        assert!(!r.scope.contains(who) && !r.id.contains(who), "{r:?}");
        let result = String::from_utf8_lossy(r.result.as_deref().unwrap_or_default()).into_owned();
        assert!(!result.contains(who), "{result}");
    }
    // The spans carry the tag (so the capture works), never the principal.
    assert!(!logs.mentioning(&tag).is_empty(), "no span with the scope was captured");
    assert_eq!(logs.mentioning(who), Vec::<String>::new());
    assert!(!format!("{:?}", Principal::new(who)).contains("alice"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_a_key_pass_through_without_a_principal() {
    let app = serve_in(layer("no-key"), Order::IdemFirst).await;
    let req = Req { key: None, ..Req::post("/payments", "", BODY) };
    assert_eq!(app.send(req).await.status, 201);
    assert_eq!(app.calls(), 1);
}
