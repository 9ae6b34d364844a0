//! Throttling (429) and non-retryable failures, injected with the SDK's fault injection into the
//! in-memory emulator.
//!
//! # What the SDK does on a 429 by itself (`azure_data_cosmos` 1.1.0-beta.1)
//! Faults are injected at the transport layer, *below* the driver's retry loops, so every
//! injected 429 goes through the SDK's own throttle retries first:
//!
//! - A data-plane request (item read/create/replace/delete, batch, query page) that answers 429
//!   is retried by the driver up to **18 times** (19 requests on the wire), each retry waiting
//!   the `x-ms-retry-after-ms` the service sent (5 ms × 2ⁿ with jitter when it sent none),
//!   capped at 15 s per wait and 270 s in all. Only then does the 429 reach idem's
//!   [`ThrottlePolicy`], which starts its own round: with the defaults one idem call can make
//!   3 × 19 = 57 requests. (Metadata requests use 9 retries, 5 s, 30 s. The SDK's
//!   `ThrottlingRetryOptions::max_retry_count` docs say "default 9": that is the metadata
//!   budget; data-plane requests get 18.) A 429 with sub-status 3092 is also a cross-region
//!   failover retry.
//! - `ThrottlingRetryOptions::max_retry_count = 0` switches the SDK's throttle retries off (the
//!   first 429 is returned), honoured exactly: its one "forced final" extra try only happens
//!   when the wait budget, not the count, runs out. Set it per client with
//!   `CosmosClientBuilder::with_default_operation_options`, per request through the item
//!   options, or with `AZURE_COSMOS_MAX_THROTTLE_RETRY_COUNT` (lowest priority; the two
//!   `Sdk::Defaults` tests below assume it is unset).
//! - The SDK's waits are `azure_core::sleep`, which is `tokio::time::sleep` (typespec's tokio
//!   runtime); idem's are `tokio::time::sleep` too. So these tests run on tokio's paused clock
//!   and assert the waits exactly, in virtual time, without wall-clock sleeps.
//!
//! Most tests turn the SDK's throttle retries off, so that each injected 429 is one try of
//! idem's policy and the rule's hit count is the number of tries; two tests keep the SDK's
//! defaults to pin down how the two layers compose.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use azure_core::http::StatusCode;
use azure_data_cosmos::fault_injection::{
    CustomResponseBuilder, FaultInjectionConditionBuilder, FaultInjectionErrorType,
    FaultInjectionResult, FaultInjectionResultBuilder, FaultInjectionRule,
    FaultInjectionRuleBuilder, FaultOperationType,
};
use azure_data_cosmos::options::{OperationOptionsBuilder, ThrottlingRetryOptionsBuilder};
use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, StoreError};
use idem_cosmos::{CosmosMarker, CosmosStore, Error, ThrottlePolicy};
use serde_json::json;
use tokio::time::Instant;

fn key(id: &str) -> DedupKey {
    DedupKey::new("order-writer", id).expect("key")
}

/// Requests the SDK makes for one call on a 429 that does not stop, with its default options:
/// the first and 18 throttle retries.
const SDK_DEFAULT_REQUESTS_PER_CALL: u32 = 19;

/// Whether the client keeps the SDK's own 429 retries.
#[derive(Clone, Copy)]
enum Sdk {
    /// The SDK's defaults (18 throttle retries per data-plane request).
    Defaults,
    /// `max_retry_count = 0`: every 429 reaches idem's policy.
    NoThrottleRetries,
}

/// A 429 answer, with `x-ms-retry-after-ms` when `retry_after_ms` is given.
fn throttled(retry_after_ms: Option<u64>) -> FaultInjectionResult {
    match retry_after_ms {
        // The built-in `TooManyRequests` fault sends no retry-after; a custom response does.
        Some(ms) => FaultInjectionResultBuilder::new()
            .with_custom_response(
                CustomResponseBuilder::new(StatusCode::TooManyRequests)
                    .with_header("x-ms-retry-after-ms", ms.to_string())
                    .with_body(br#"{"code":"TooManyRequests","message":"injected"}"#.to_vec())
                    .build(),
            )
            .build(),
        None => FaultInjectionResultBuilder::new()
            .with_error(FaultInjectionErrorType::TooManyRequests)
            .build(),
    }
}

/// An answer with `status` (no sub-status), as a service error.
fn failing(status: StatusCode) -> FaultInjectionResult {
    FaultInjectionResultBuilder::new()
        .with_custom_response(
            CustomResponseBuilder::new(status)
                .with_body(br#"{"code":"Injected","message":"injected"}"#.to_vec())
                .build(),
        )
        .build()
}

/// `result` on every item create, at most `hits` times when given. Its hit count is the
/// number of creates that got the fault.
fn on_create(result: FaultInjectionResult, hits: Option<u32>) -> Arc<FaultInjectionRule> {
    let condition =
        FaultInjectionConditionBuilder::new().with_operation_type(FaultOperationType::CreateItem);
    let rule = FaultInjectionRuleBuilder::new(common::unique("create"), result)
        .with_condition(condition.build());
    Arc::new(match hits {
        Some(n) => rule.with_hit_limit(n).build(),
        None => rule.build(),
    })
}

async fn emulator(rule: &Arc<FaultInjectionRule>, sdk: Sdk) -> common::Emulator {
    let rule = Arc::clone(rule);
    common::Emulator::start_with(move |builder| {
        let builder = builder.with_fault_injection_rules(vec![rule]).expect("fault rules");
        match sdk {
            Sdk::Defaults => builder,
            Sdk::NoThrottleRetries => builder.with_default_operation_options(
                OperationOptionsBuilder::new()
                    .with_throttling_retry_options(
                        ThrottlingRetryOptionsBuilder::new().with_max_retry_count(0).build(),
                    )
                    .build(),
            ),
        }
    })
    .await
}

async fn marker(emu: &common::Emulator, policy: ThrottlePolicy) -> CosmosMarker {
    let orders = emu.container("/orderId").await;
    CosmosMarker::new(orders, "/orderId").expect("marker").throttle(policy)
}

async fn store(emu: &common::Emulator, policy: ThrottlePolicy) -> CosmosStore {
    CosmosStore::new(emu.container("/pk").await).throttle(policy)
}

fn request(id: &str) -> ClaimRequest {
    ClaimRequest::new(
        DedupKey::new("billing", id).expect("key"),
        None,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
}

fn order(id: &str) -> serde_json::Value {
    json!({"id": id, "orderId": id, "total": 10})
}

/// `elapsed` (on tokio's paused clock) is `expected`: no less, and less than 50 ms (half the
/// policy's fallback wait) more.
#[track_caller]
fn assert_waited(elapsed: Duration, expected: Duration) {
    assert!(
        elapsed >= expected && elapsed < expected + Duration::from_millis(50),
        "waited {elapsed:?}, expected {expected:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn store_claim_waits_the_retry_after_then_succeeds() {
    let rule = on_create(throttled(Some(1500)), Some(2));
    let emu = emulator(&rule, Sdk::NoThrottleRetries).await;
    let store = store(&emu, ThrottlePolicy::new(3)).await;

    let start = Instant::now();
    let claim = store.claim(&request("o-1")).await.expect("claim after two 429s");
    let Claim::Acquired(lease) = claim else { panic!("expected Acquired, got {claim:?}") };
    assert_eq!(lease.attempt(), 1);
    assert_eq!(rule.hit_count(), 2, "two throttled creates, the third went through");
    // Twice the 1.5 s the service asked for (not the 100 ms fallback, not the SDK's waits).
    assert_waited(start.elapsed(), Duration::from_millis(3000));

    // The record was written once, by the third try: the key is now held.
    let again = store.claim(&request("o-1")).await.expect("second claim");
    assert!(matches!(again, Claim::InProgress { attempt: 1, .. }), "got {again:?}");
    store.release(lease).await.expect("release");
}

#[tokio::test(start_paused = true)]
async fn marker_create_waits_the_retry_after_then_succeeds() {
    let rule = on_create(throttled(Some(250)), Some(1));
    let emu = emulator(&rule, Sdk::NoThrottleRetries).await;
    let m = marker(&emu, ThrottlePolicy::new(2)).await;

    let start = Instant::now();
    let created =
        m.create_once(&key("o-1"), "o-1", &order("o-1"), None).await.expect("create after a 429");
    assert!(matches!(created, Claim::Acquired(_)), "{created:?}");
    assert_eq!(rule.hit_count(), 1);
    assert_waited(start.elapsed(), Duration::from_millis(250));

    // Created exactly once: the next delivery is a duplicate, and no wait.
    let start = Instant::now();
    let again = m.create_once(&key("o-1"), "o-1", &order("o-1"), None).await.expect("again");
    assert!(matches!(again, Claim::Completed(_)), "got {again:?}");
    assert_waited(start.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn throttling_that_outlasts_the_policy_is_a_retryable_error() {
    let rule = on_create(throttled(Some(10)), None);
    let emu = emulator(&rule, Sdk::NoThrottleRetries).await;
    let m = marker(&emu, ThrottlePolicy::new(4)).await;

    let start = Instant::now();
    let err =
        m.create_once(&key("o-1"), "o-1", &order("o-1"), None).await.expect_err("always throttled");
    assert_eq!(rule.hit_count(), 4, "four tries, no more");
    assert_waited(start.elapsed(), Duration::from_millis(30));
    match &err {
        Error::Throttled { op, attempts, retry_after, .. } => {
            assert_eq!(*op, "create_item");
            assert_eq!(*attempts, 4);
            assert_eq!(*retry_after, Some(Duration::from_millis(10)));
        }
        other => panic!("expected Throttled, got {other:?}"),
    }
    assert!(err.is_retryable());
    assert_eq!(err.status(), Some(429));
    let msg = err.to_string();
    assert!(msg.contains("create_item") && msg.contains("429"), "{msg}");

    let store_err = StoreError::from(err);
    assert!(store_err.is_retryable());
    assert!(matches!(store_err, StoreError::Backend { op: "create_item", .. }), "{store_err:?}");
    assert!(store_err.to_string().contains("create_item"), "{store_err}");
}

#[tokio::test(start_paused = true)]
async fn store_claim_throttled_past_max_wait_is_capped_and_retryable() {
    // The service asks for a minute; the policy waits at most 200 ms each time.
    let rule = on_create(throttled(Some(60_000)), None);
    let emu = emulator(&rule, Sdk::NoThrottleRetries).await;
    let store = store(&emu, ThrottlePolicy::new(3).max_wait(Duration::from_millis(200))).await;

    let start = Instant::now();
    let err = store.claim(&request("o-1")).await.expect_err("always throttled");
    assert_eq!(rule.hit_count(), 3);
    assert_waited(start.elapsed(), Duration::from_millis(400));
    assert!(err.is_retryable(), "{err:?}");
    assert!(matches!(err, StoreError::Backend { op: "create_item", .. }), "{err:?}");
    assert!(err.to_string().contains("create_item"), "{err}");
    let source = std::error::Error::source(&err).expect("source").to_string();
    assert!(source.contains("create_item") && source.contains("3 tries"), "{source}");
}

#[tokio::test(start_paused = true)]
async fn a_429_without_retry_after_waits_the_fallback() {
    let rule = on_create(throttled(None), Some(2));
    let emu = emulator(&rule, Sdk::NoThrottleRetries).await;
    let m = marker(&emu, ThrottlePolicy::new(2)).await;

    let start = Instant::now();
    let err = m
        .create_once(&key("o-1"), "o-1", &order("o-1"), None)
        .await
        .expect_err("two 429s, two tries");
    assert_waited(start.elapsed(), Duration::from_millis(100));
    assert!(matches!(err, Error::Throttled { retry_after: None, attempts: 2, .. }), "{err:?}");
    assert!(err.is_retryable());
    // The rule is spent: the next call goes through.
    assert_eq!(rule.hit_count(), 2);
    let created = m.create_once(&key("o-1"), "o-1", &order("o-1"), None).await.expect("create");
    assert!(matches!(created, Claim::Acquired(_)), "{created:?}");
}

#[tokio::test(start_paused = true)]
async fn sdk_defaults_absorb_429s_before_the_policy_sees_one() {
    let rule = on_create(throttled(Some(1500)), Some(5));
    let emu = emulator(&rule, Sdk::Defaults).await;
    // One try of our own: any retry here is the SDK's.
    let m = marker(&emu, ThrottlePolicy::new(1)).await;

    let start = Instant::now();
    let created =
        m.create_once(&key("o-1"), "o-1", &order("o-1"), None).await.expect("SDK retried");
    assert!(matches!(created, Claim::Acquired(_)), "{created:?}");
    assert_eq!(rule.hit_count(), 5);
    // The SDK honours the retry-after as well, on tokio's clock.
    assert_waited(start.elapsed(), Duration::from_millis(5 * 1500));
}

#[tokio::test(start_paused = true)]
async fn sdk_defaults_multiply_the_policys_tries() {
    let rule = on_create(throttled(Some(10)), None);
    let emu = emulator(&rule, Sdk::Defaults).await;
    let m = marker(&emu, ThrottlePolicy::new(2)).await;

    let start = Instant::now();
    let err =
        m.create_once(&key("o-1"), "o-1", &order("o-1"), None).await.expect_err("always throttled");
    assert!(matches!(err, Error::Throttled { attempts: 2, .. }), "{err:?}");
    assert!(err.is_retryable());
    // Each of our 2 tries is 19 requests: the SDK's first and its 18 retries.
    assert_eq!(rule.hit_count(), 2 * SDK_DEFAULT_REQUESTS_PER_CALL);
    // 2 × 18 SDK waits and 1 of ours, 10 ms each.
    assert_waited(start.elapsed(), Duration::from_millis((2 * 18 + 1) * 10));
}

#[tokio::test(start_paused = true)]
async fn non_retryable_failures_are_not_retried() {
    for status in [StatusCode::BadRequest, StatusCode::Forbidden] {
        let code = u16::from(status);
        // The SDK's defaults: it does not retry these either.
        let rule = on_create(failing(status), None);
        let emu = emulator(&rule, Sdk::Defaults).await;
        let m = marker(&emu, ThrottlePolicy::new(5)).await;

        let start = Instant::now();
        let err = m
            .create_once(&key("o-1"), "o-1", &order("o-1"), None)
            .await
            .expect_err("injected failure");
        assert_eq!(rule.hit_count(), 1, "{code}: tried once");
        assert_waited(start.elapsed(), Duration::ZERO);
        assert!(matches!(err, Error::Cosmos { op: "create_item", .. }), "{code}: {err:?}");
        assert_eq!(err.status(), Some(code));
        assert!(!err.is_retryable(), "{code} must not be retryable");
        let store_err = StoreError::from(err);
        assert!(!store_err.is_retryable(), "{code}: {store_err:?}");

        let store = store(&emu, ThrottlePolicy::new(5)).await;
        let err = store.claim(&request("o-1")).await.expect_err("injected failure");
        assert_eq!(rule.hit_count(), 2, "{code}: the claim tried once");
        assert!(!err.is_retryable(), "{code}: {err:?}");
        assert!(matches!(err, StoreError::Backend { op: "create_item", .. }), "{code}: {err:?}");
    }
}
