//! The layer through real HTTP: an axum server on 127.0.0.1 and a hyper client, against the
//! memory and SQLite stores.

// Helpers shared by the #[tokio::test]s are not themselves tests, so clippy's test exemption
// does not reach them.
#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::{App, Req, serve};
use idem_core::{DedupStore, MemoryStore};
use idem_http::{IdempotencyKeyLayer, KeyFormat};
use idem_sqlx::SqliteStore;
use idem_testkit::faults::{FaultyStore, Op};

/// Runs each case against every store: `$name::memory`, `$name::sqlite`.
macro_rules! each_store {
    ($($case:ident),* $(,)?) => {$(
        mod $case {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn memory() {
                super::$case(idem_core::MemoryStore::new()).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                let dir = tempfile::tempdir().unwrap();
                let store = idem_sqlx::SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
                super::$case(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                let Some(url) = idem_testkit::service::require(
                    "postgres", "IDEM_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test",
                ) else { return };
                let schema = format!("idem_http_{}_{}", stringify!($case), std::process::id());
                let pool = sqlx::postgres::PgPoolOptions::new().max_connections(8).connect(&url).await.unwrap();
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {schema} CASCADE")))
                    .execute(&pool).await.unwrap();
                let store = idem_sqlx::PostgresStore::new(pool.clone()).with_schema(&schema).unwrap();
                store.migrate().await.unwrap();
                super::$case(store).await;
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                    .execute(&pool).await.unwrap();
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn redis() {
                let Some(url) = idem_testkit::service::require(
                    "redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/",
                ) else { return };
                let ns = format!("http_{}_{}", stringify!($case), std::process::id());
                let store = idem_redis::RedisStore::builder(&url).unwrap()
                    .namespace(&ns).unwrap().connect().await.unwrap();
                let mut conn = store.connection().clone();
                let store_prefix = store.namespace().key_prefix().to_owned();
                super::$case(store).await;
                let keys: Vec<String> = redis::cmd("KEYS").arg(format!("{}*", store_prefix))
                    .query_async(&mut conn).await.unwrap();
                if !keys.is_empty() {
                    let _: i64 = redis::cmd("DEL").arg(&keys).query_async(&mut conn).await.unwrap();
                }
            }
        }
    )*};
}

each_store!(
    first_request_runs_and_retry_replays,
    in_flight_key_is_409,
    reused_key_with_other_body_is_422,
    missing_required_key_is_400,
    malformed_keys_are_400_naming_the_problem,
    server_error_releases_the_key,
    client_error_is_stored_and_replayed,
    fifty_concurrent_identical_requests_run_once,
    other_principal_is_not_a_replay,
);

/// Most cases send no principal; `tests/principal.rs` covers the layer without this opt-out.
fn layer<St: DedupStore>(store: St) -> IdempotencyKeyLayer<St> {
    IdempotencyKeyLayer::new(store)
        .max_body(1024)
        .allow_anonymous()
        .principal_key(common::principal_key())
}

const BODY: &str = r#"{"amount":1200,"currency":"EUR"}"#;

// 1. First request runs; its retry gets the stored response, byte for byte, marked replayed.
async fn first_request_runs_and_retry_replays<St: DedupStore + 'static>(store: St) {
    let app = serve(layer(store)).await;
    let first = app.send(Req::post("/payments", "k-1", BODY)).await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());
    let retry = app.send(Req::post("/payments", "k-1", BODY)).await;
    assert_eq!(app.calls(), 1, "the handler ran again");
    assert!(retry.replayed(), "{:?}", retry.headers);
    assert_eq!(retry.status, first.status);
    assert_eq!(retry.body, first.body, "replay is not byte-identical");
    assert_eq!(retry.stable_headers(), first.stable_headers());
    assert_eq!(retry.headers.get_all("link").iter().count(), 2, "repeated headers kept");
    // The quoted form of the draft standard names the same key.
    let quoted = app.send(Req::post("/payments", "\"k-1\"", BODY)).await;
    assert!(quoted.replayed());
    // Another key is another request.
    let other = app.send(Req::post("/payments", "k-2", BODY)).await;
    assert!(!other.replayed());
    assert_ne!(other.body, first.body);
    assert_eq!(app.calls(), 2);
}

// 2. The same key while the first request is in flight: 409 with Retry-After.
async fn in_flight_key_is_409<St: DedupStore + 'static>(store: St) {
    let app = serve(layer(store)).await;
    let addr = app.addr;
    let first =
        tokio::spawn(async move { common::send(addr, Req::post("/slow", "k", BODY)).await });
    app.wait_calls(1).await;
    let second = app.send(Req::post("/slow", "k", BODY)).await;
    assert_eq!(second.status, 409, "{}", second.text());
    let p = second.problem();
    assert_eq!(p["title"], "A request is outstanding for this Idempotency-Key");
    assert!(second.headers.contains_key("retry-after"));
    app.h.gate.add_permits(1);
    let first = first.await.unwrap();
    assert_eq!(first.status, 200);
    let third = app.send(Req::post("/slow", "k", BODY)).await;
    assert!(third.replayed());
    assert_eq!(third.body, first.body);
    assert_eq!(app.calls(), 1);
}

// 3. The same key with a different body (or path, or method): 422.
async fn reused_key_with_other_body_is_422<St: DedupStore + 'static>(store: St) {
    let app = serve(layer(store)).await;
    assert_eq!(app.send(Req::post("/payments", "k", BODY)).await.status, 201);
    let other = app.send(Req::post("/payments", "k", r#"{"amount":9999}"#)).await;
    assert_eq!(other.status, 422, "{}", other.text());
    assert_eq!(other.problem()["title"], "Idempotency-Key is already used");
    let patch = Req { method: "PATCH", ..Req::post("/payments", "k", BODY) };
    assert_eq!(app.send(patch).await.status, 422);
    let query = app.send(Req::post("/payments?currency=USD", "k", BODY)).await;
    assert_eq!(query.status, 422);
    assert_eq!(app.calls(), 1);
}

// 4. A required key missing: 400.
async fn missing_required_key_is_400<St: DedupStore + 'static>(store: St) {
    let app = serve(layer(store).required(true)).await;
    let req = Req { key: None, ..Req::post("/payments", "", BODY) };
    let res = app.send(req).await;
    assert_eq!(res.status, 400);
    let p = res.problem();
    assert_eq!(p["title"], "Idempotency-Key is missing");
    assert!(p["detail"].as_str().unwrap().contains("POST /payments"), "{p}");
    assert_eq!(app.calls(), 0);
    // Methods the layer does not guard pass through without a key.
    let get = Req { method: "GET", key: None, ..Req::post("/payments", "", "") };
    assert_eq!(app.send(get).await.status, 200);
    assert_eq!(app.calls(), 1);
}

// 5. Malformed keys: 400 naming the problem; the handler never runs.
async fn malformed_keys_are_400_naming_the_problem<St: DedupStore + 'static>(store: St) {
    let app = serve(layer(store).max_key_len(64)).await;
    let long = "k".repeat(65);
    let cases: [(&[u8], &str); 5] = [
        (b"", "is empty"),
        (b"\"\"", "is empty"),
        (long.as_bytes(), "65 bytes long, longer than the limit of 64 bytes"),
        (b"ab\tcd", "control or non-ASCII character at byte 2"),
        (b"ab\xc3\xa9", "control or non-ASCII character at byte 2"),
    ];
    for (key, says) in cases {
        let req = Req { key: Some(key), ..Req::post("/payments", "", BODY) };
        let res = app.send(req).await;
        assert_eq!(res.status, 400, "{key:?}: {}", res.text());
        let p = res.problem();
        assert_eq!(p["title"], "Idempotency-Key is malformed");
        assert!(p["detail"].as_str().unwrap().contains(says), "{key:?}: {p}");
    }
    assert_eq!(app.calls(), 0);
}

// 6a. A 5xx releases the key: the retry runs the handler again, and is then stored.
async fn server_error_releases_the_key<St: DedupStore + 'static>(store: St) {
    let app = serve(layer(store)).await;
    let first = app.send(Req::post("/flaky", "k", BODY)).await;
    assert_eq!(first.status, 503);
    let retry = app.send(Req::post("/flaky", "k", BODY)).await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert!(retry.text().starts_with("created on attempt 2 (idem-"), "{}", retry.text());
    assert_eq!(app.calls(), 2);
    let again = app.send(Req::post("/flaky", "k", BODY)).await;
    assert!(again.replayed());
    assert_eq!((again.status, again.body), (retry.status, retry.body));
    assert_eq!(app.calls(), 2);
}

// 6b. A 4xx is stored and replayed: the handler does not run again.
async fn client_error_is_stored_and_replayed<St: DedupStore + 'static>(store: St) {
    let app = serve(layer(store)).await;
    let first = app.send(Req::post("/invalid", "k", BODY)).await;
    assert_eq!(first.status, 400);
    let retry = app.send(Req::post("/invalid", "k", BODY)).await;
    assert!(retry.replayed());
    assert_eq!((retry.status, &retry.body), (first.status, &first.body));
    assert_eq!(app.calls(), 1);
}

// 50 concurrent identical requests: the handler runs once; one 2xx from it, the rest are
// byte-identical replays or 409s.
async fn fifty_concurrent_identical_requests_run_once<St: DedupStore + 'static>(store: St) {
    let app = serve(layer(store)).await;
    let addr = app.addr;
    let answered = std::sync::Arc::new(tokio::sync::watch::channel(0usize).0);
    let sends: Vec<_> = (0..50)
        .map(|_| {
            let answered = answered.clone();
            tokio::spawn(async move {
                let r = common::send(addr, Req::post("/slow", "k", BODY)).await;
                answered.send_modify(|n| *n += 1);
                r
            })
        })
        .collect();
    // Hold the handler until 25 of the others were answered while it was in flight (409s),
    // then let it finish: the rest race its completion and get 409s or replays.
    app.wait_calls(1).await;
    let mut rx = answered.subscribe();
    tokio::time::timeout(common::WAIT, rx.wait_for(|n| *n >= 25)).await.unwrap().unwrap();
    app.h.gate.add_permits(1);
    let mut replies = Vec::new();
    for s in sends {
        replies.push(s.await.unwrap());
    }
    assert_eq!(app.calls(), 1, "the handler ran more than once");
    let original: Vec<_> = replies.iter().filter(|r| r.status == 200 && !r.replayed()).collect();
    assert_eq!(original.len(), 1, "exactly one response comes from the handler");
    let original = original[0];
    let mut conflicts = 0;
    for r in &replies {
        match r.status.as_u16() {
            200 if r.replayed() => {
                assert_eq!(r.body, original.body, "replay is not byte-identical");
                assert_eq!(r.stable_headers(), original.stable_headers());
            }
            200 => {}
            409 => {
                r.problem();
                conflicts += 1;
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    let replays = replies.iter().filter(|r| r.replayed()).count();
    assert_eq!(1 + replays + conflicts, 50);
    assert!(conflicts >= 25, "{conflicts} conflicts while the handler was held");
    // Afterwards every retry is a replay.
    let late = app.send(Req::post("/slow", "k", BODY)).await;
    assert!(late.replayed());
    assert_eq!(late.body, original.body);
    eprintln!("50 concurrent: 1 from the handler, {replays} replays, {conflicts} × 409");
}

// A key reused by another principal is that principal's own request, never a replay.
async fn other_principal_is_not_a_replay<St: DedupStore + 'static>(store: St) {
    let app = serve(layer(store)).await;
    let alice = app.send(Req::post("/payments", "k", BODY).user("alice")).await;
    let bob = app.send(Req::post("/payments", "k", BODY).user("bob")).await;
    assert_eq!((alice.status.as_u16(), bob.status.as_u16()), (201, 201));
    assert!(!bob.replayed(), "bob got alice's response");
    assert_ne!(bob.body, alice.body);
    assert_eq!(app.calls(), 2);
    let anonymous = app.send(Req::post("/payments", "k", BODY)).await;
    assert!(!anonymous.replayed());
    let alice_again = app.send(Req::post("/payments", "k", BODY).user("alice")).await;
    assert!(alice_again.replayed());
    assert_eq!(alice_again.body, alice.body);
    assert_eq!(app.calls(), 3);
}

#[tokio::test]
async fn keys_of_another_format_are_400_naming_the_rule() {
    let app = serve(layer(MemoryStore::new()).key_format(KeyFormat::Uuid)).await;
    let res = app.send(Req::post("/payments", "order-42", BODY)).await;
    assert_eq!(res.status, 400, "{}", res.text());
    let p = res.problem();
    assert_eq!(p["title"], "Idempotency-Key is malformed");
    let detail = p["detail"].as_str().unwrap();
    assert!(detail.contains("Idempotency-Key header must be a UUID (8-4-4-4-12"), "{p}");
    assert_eq!(app.calls(), 0);
    // A UUID in either case, bare or quoted, is accepted.
    let uuid = "6F9619FF-8B86-D011-B42D-00C04FC964FF";
    assert_eq!(app.send(Req::post("/payments", uuid, BODY)).await.status, 201);
    let quoted = format!("\"{}\"", uuid.to_lowercase());
    assert_eq!(app.send(Req::post("/payments", &quoted, BODY)).await.status, 201);
    assert_eq!(app.calls(), 2);

    let ulid = KeyFormat::matching("a ULID (26 characters)", |k| k.len() == 26);
    let app = serve(layer(MemoryStore::new()).key_format(ulid)).await;
    let res = app.send(Req::post("/payments", "too-short", BODY)).await;
    assert_eq!(res.status, 400);
    let p = res.problem();
    assert!(p["detail"].as_str().unwrap().ends_with("must be a ULID (26 characters)"), "{p}");
    assert_eq!(
        app.send(Req::post("/payments", "01ARZ3NDEKTSV4RRFFQ69G5FAV", BODY)).await.status,
        201
    );
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn optional_key_absent_passes_through() {
    let app = serve(layer(MemoryStore::new())).await;
    let req = Req { key: None, ..Req::post("/payments", "", BODY) };
    assert_eq!(app.send(req).await.status, 201);
    assert_eq!(app.send(req).await.status, 201);
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn oversized_request_is_413_and_oversized_response_is_not_rerun() {
    let app = serve(layer(MemoryStore::new())).await;
    let big = "x".repeat(2048);
    let res = app.send(Req::post("/payments", "k", &big)).await;
    assert_eq!(res.status, 413);
    res.problem();
    assert_eq!(app.calls(), 0);
    // `/big` answers 4 KiB, over the 1 KiB limit: the client gets it whole, the key is parked.
    let first = app.send(Req::post("/big", "k", BODY)).await;
    assert_eq!((first.status.as_u16(), first.body.len()), (200, 4096));
    let retry = app.send(Req::post("/big", "k", BODY)).await;
    assert_eq!(retry.status, 409);
    assert_eq!(retry.problem()["title"], "Request was processed; its response was not stored");
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn store_down_is_503_and_the_handler_does_not_run() {
    let store = FaultyStore::new(MemoryStore::new());
    store.fail_next(Op::Claim, 1);
    let app = serve(layer(store.clone())).await;
    let res = app.send(Req::post("/payments", "k", BODY)).await;
    assert_eq!(res.status, 503);
    res.problem();
    assert_eq!(res.headers["retry-after"], "1");
    assert_eq!(app.calls(), 0);
    assert_eq!(app.send(Req::post("/payments", "k", BODY)).await.status, 201);
}

#[cfg(feature = "axum")]
#[tokio::test]
async fn scope_is_the_route_template_with_axum() {
    let app = serve(layer(MemoryStore::new())).await;
    assert_eq!(app.send(Req::post("/orders/1/pay", "k", BODY)).await.status, 201);
    // Same route, other path: the key was used for another request.
    assert_eq!(app.send(Req::post("/orders/2/pay", "k", BODY)).await.status, 422);
    // Another route has its own keys.
    assert_eq!(app.send(Req::post("/payments", "k", BODY)).await.status, 201);
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_survive_a_restart_with_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.sqlite");
    let first = {
        let app: App = serve(layer(SqliteStore::open(&path).await.unwrap())).await;
        app.send(Req::post("/payments", "k", BODY)).await
    };
    let app = serve(layer(SqliteStore::open(&path).await.unwrap())).await;
    let retry = app.send(Req::post("/payments", "k", BODY)).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(app.calls(), 0);
}

// hyper drops the request future when the client goes away; the claimed request still finishes
// and its response is stored, so the client's retry is a replay, not a second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_request_future_does_not_cancel_the_handler() {
    use tower_service::Service;
    let (router, h) = common::router(layer(MemoryStore::new()));
    let mut svc = router;
    let request = || {
        axum::http::Request::post("/slow")
            .header("idempotency-key", "k")
            .body(axum::body::Body::from(BODY))
            .unwrap()
    };
    std::future::poll_fn(|cx| Service::<axum::extract::Request>::poll_ready(&mut svc, cx))
        .await
        .unwrap();
    let call = svc.call(request());
    let mut calls = h.calls.subscribe();
    tokio::select! {
        _ = call => panic!("the handler is held; the call cannot finish"),
        r = tokio::time::timeout(common::WAIT, calls.wait_for(|n| *n >= 1)) => { r.unwrap().unwrap(); }
    }
    // The call future is dropped here, mid-handler. Let the handler finish.
    h.gate.add_permits(1);
    let deadline = tokio::time::Instant::now() + common::WAIT;
    loop {
        let res = svc.call(request()).await.unwrap();
        if res.headers().contains_key("idempotent-replayed") {
            break;
        }
        assert_eq!(res.status(), 409, "while the handler runs, only 409s");
        assert!(tokio::time::Instant::now() < deadline, "the dropped request never completed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(*h.calls.borrow(), 1);
}

// A request that outlives its lease is taken over by the retry (attempt 2), and the stale run,
// fenced out, cannot overwrite the response the retry stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_lease_is_taken_over_and_the_stale_run_is_fenced() {
    let clock = idem_core::time::ManualClock::new();
    let store = MemoryStore::with_clock(clock.clone());
    let app = serve(layer(store).lease(Duration::from_secs(5))).await;
    let addr = app.addr;
    let stale =
        tokio::spawn(async move { common::send(addr, Req::post("/slow", "k", BODY)).await });
    app.wait_calls(1).await;
    assert_eq!(app.send(Req::post("/slow", "k", BODY)).await.status, 409);
    clock.advance(Duration::from_secs(6));
    let addr = app.addr;
    let taker =
        tokio::spawn(async move { common::send(addr, Req::post("/slow", "k", BODY)).await });
    app.wait_calls(2).await;
    // The taker finishes first and stores its response; then the stale run finishes.
    app.h.retry_gate.add_permits(1);
    let taker = taker.await.unwrap();
    app.h.gate.add_permits(1);
    let stale = stale.await.unwrap();
    assert!(taker.text().starts_with("slow attempt 2"), "{}", taker.text());
    assert_eq!((taker.status.as_u16(), stale.status.as_u16()), (200, 200));
    let replay = app.send(Req::post("/slow", "k", BODY)).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, taker.body, "the fenced-out run overwrote the stored response");
    assert_ne!(replay.body, stale.body);
    assert_eq!(app.calls(), 2);
}

/// A layer deciding through `engine`, configured as [`layer`] is.
fn layer_on<St: DedupStore>(engine: idem_core::Engine<St>) -> IdempotencyKeyLayer<St> {
    IdempotencyKeyLayer::with_engine(engine)
        .max_body(1024)
        .allow_anonymous()
        .principal_key(common::principal_key())
}

// The engine's store timeout reaches HTTP: a claim that never answers (a half-open connection)
// is a 503 once the timeout passes, and the handler does not run; a completion that never
// answers is given up after the timeout and tried again within the completion retry, so the
// response is stored and the retry is a replay. Without the timeout, the first request would
// wait for ever (and the test's WAIT would fail it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_store_call_is_bounded_by_the_store_timeout() {
    let store = FaultyStore::new(MemoryStore::new());
    let engine = idem_core::Engine::builder(store.clone())
        .scope("http")
        .store_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let app = serve(layer_on(engine)).await;
    store.hang_next(Op::Claim, 1);
    let send =
        |key| tokio::time::timeout(common::WAIT, app.send(Req::post("/payments", key, BODY)));
    let res = send("k").await.expect("the hung claim was not bounded");
    assert_eq!(res.status, 503, "{}", res.text());
    assert_eq!(res.problem()["title"], "Idempotency store is unavailable");
    assert_eq!(app.calls(), 0, "the handler ran without a claim");
    store.hang_next(Op::Complete, 1);
    let res = send("k").await.expect("the hung completion was not bounded");
    assert_eq!(res.status, 201, "{}", res.text());
    assert_eq!(app.calls(), 1);
    let retry = send("k").await.unwrap();
    assert!(retry.replayed(), "the completion was not retried: {}", retry.text());
    assert_eq!(retry.body, res.body);
    assert_eq!(app.calls(), 1, "the handler ran again");
}

// The engine's crash-loop limit reaches HTTP: once a request's earlier attempts ended with
// their lease running out (the server died or hung) more times than the limit, the next
// attempt is refused with a 500 instead of running the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_past_the_crash_loop_limit_is_refused() {
    let clock = idem_core::time::ManualClock::new();
    let engine = idem_core::Engine::builder(MemoryStore::with_clock(clock.clone()))
        .scope("http")
        .lease(Duration::from_secs(5))
        .crash_loop_limit(1)
        .build()
        .unwrap();
    let app = serve(layer_on(engine)).await;
    let addr = app.addr;
    let hung = tokio::spawn(async move { common::send(addr, Req::post("/slow", "k", BODY)).await });
    app.wait_calls(1).await;
    clock.advance(Duration::from_secs(6));
    let refused = app.send(Req::post("/slow", "k", BODY)).await;
    assert_eq!(refused.status, 500, "{}", refused.text());
    assert_eq!(refused.problem()["title"], "Request failed the server repeatedly");
    assert_eq!(app.calls(), 1, "the request ran again past the crash-loop limit");
    // The hung run ends; fenced out, it stores nothing over the failed key.
    app.h.gate.add_permits(1);
    assert_eq!(hung.await.unwrap().status, 200);
    // A later retry runs again (the key was failed, not kept).
    app.h.retry_gate.add_permits(1);
    let after = app.send(Req::post("/slow", "k", BODY)).await;
    assert!(!after.replayed(), "the fenced-out run stored its response");
    assert_eq!(app.calls(), 2);
}
