//! `idem_http_requests_total{outcome}` counts every guarded request's outcome. Its own test
//! binary: the recorder is process-global (the layer's work runs on spawned tasks).

#[path = "it/common/mod.rs"]
mod common;

use common::{Req, serve};
use idem_core::MemoryStore;
use idem_http::IdempotencyKeyLayer;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_outcome_is_counted() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().expect("the only recorder in this binary");

    let layer = IdempotencyKeyLayer::new(MemoryStore::new()).scope_prefix("api");
    let app = serve(layer.clone().allow_anonymous()).await;
    let body = r#"{"cents":1}"#;
    // The same layer without the opt-out refuses a keyed request without a principal…
    serve(layer.clone()).await.send(Req::post("/payments", "k", body)).await;
    // …and, without a principal key, one with a principal.
    app.send(Req::post("/payments", "k", body).user("u")).await;
    // First: `/flaky` answers 503 on the server's first handler call.
    app.send(Req::post("/flaky", "f", body)).await;
    app.send(Req::post("/payments", "k", body)).await;
    app.send(Req::post("/payments", "k", body)).await;
    app.send(Req::post("/payments", "k", r#"{"cents":2}"#)).await;
    app.send(Req { key: Some(b""), ..Req::post("/payments", "", body) }).await;
    app.send(Req { key: None, ..Req::post("/payments", "", body) }).await;
    // An inner layer's 429 is not stored.
    app.send(Req::post("/status/429", "t", body)).await;

    let snap = snapshotter.snapshot().into_vec();
    let count = |outcome: &str| {
        snap.iter()
            .find_map(|(k, _, _, v)| {
                let key = k.key();
                let matches = key.name() == "idem_http_requests_total"
                    && key.labels().any(|l| l.key() == "outcome" && l.value() == outcome)
                    && key.labels().any(|l| l.key() == "scope_prefix" && l.value() == "api");
                match v {
                    DebugValue::Counter(c) if matches => Some(*c),
                    _ => None,
                }
            })
            .unwrap_or(0)
    };
    for (outcome, n) in [
        ("stored", 1),
        ("replayed", 1),
        ("reused", 1),
        ("released", 2),
        ("malformed_key", 1),
        ("no_key", 1),
        ("no_principal", 1),
        ("no_principal_key", 1),
        ("in_progress", 0),
    ] {
        assert_eq!(count(outcome), n, "{outcome}");
    }
}
