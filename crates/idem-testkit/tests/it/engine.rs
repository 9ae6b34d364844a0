//! The engine through its public API, on `MemoryStore` with deterministic time.
//! Each test injects the fault it is about (a crash, a store failure, a reused key).
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_core::engine::{
    Cause, ConfigError, Context, ExpiredLeasePolicy, FailureKind, HandlerError, MissingKeyPolicy,
    Verb,
};
use idem_core::extract::{JsonPointer, Message};
use idem_core::time::{ManualClock, TokioClock};
use idem_core::{
    DedupKey, Engine, InspectStore, MemoryStore, Outcome, RecordState, RedeliveryWindow,
};
use idem_testkit::faults::{FaultyStore, Op};

type Out = Outcome<String, String>;

fn order(id: &str, cents: u32) -> Message {
    Message::new(format!(r#"{{"order_id":"{id}","cents":{cents}}}"#)).with_message_id(id)
}

fn consumer(store: MemoryStore) -> Engine<MemoryStore> {
    Engine::builder(store)
        .scope("orders")
        .lease(Duration::from_secs(30))
        .retain(Duration::from_secs(86_400))
        .build()
        .unwrap()
}

/// A handler that counts its runs and returns "charged".
fn counting(
    runs: &Arc<AtomicU32>,
) -> impl Fn(Context) -> std::future::Ready<Result<String, HandlerError<String>>> {
    let runs = Arc::clone(runs);
    move |ctx: Context| {
        runs.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Ok(format!("charged#{}", ctx.attempt())))
    }
}

#[tokio::test]
async fn processed_then_duplicate_with_stored_result() {
    let c = consumer(MemoryStore::new());
    let runs = Arc::new(AtomicU32::new(0));
    let first: Out = c.process(&order("o-1", 100), counting(&runs)).await;
    assert!(matches!(&first, Outcome::Processed(r) if r == "charged#1"), "{first:?}");
    assert_eq!(first.verb(), Verb::Ack);
    let again: Out = c.process(&order("o-1", 100), counting(&runs)).await;
    assert!(matches!(&again, Outcome::Duplicate(Some(r)) if r == "charged#1"), "{again:?}");
    assert_eq!(again.verb(), Verb::Ack);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn reused_key_with_other_content_is_a_conflict_dead_lettered() {
    let c = consumer(MemoryStore::new());
    let runs = Arc::new(AtomicU32::new(0));
    let _: Out = c.process(&order("o-1", 100), counting(&runs)).await;
    let reused: Out = c.process(&order("o-1", 999), counting(&runs)).await;
    let Outcome::Conflict(conflict) = &reused else { panic!("{reused:?}") };
    assert_eq!(conflict.key.id(), "o-1");
    assert_ne!(conflict.stored, conflict.incoming);
    match reused.verb() {
        Verb::DeadLetter { reason } => {
            assert!(reason.contains("reused with a different payload"), "{reason}")
        }
        other => panic!("conflict must be dead-lettered, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the conflicting copy must not run");
    // Key order and whitespace are not content changes.
    let same: Out = c
        .process(
            &Message::new(r#"{ "cents": 100, "order_id": "o-1" }"#).with_message_id("o-1"),
            counting(&runs),
        )
        .await;
    assert!(matches!(same, Outcome::Duplicate(_)), "{same:?}");
}

#[tokio::test]
async fn a_live_lease_elsewhere_means_retry_later() {
    let store = MemoryStore::new();
    let c = consumer(store.clone());
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let c2 = c.clone();
    let first = tokio::spawn(async move {
        let out: Out = c2
            .process(&order("o-1", 1), |_ctx| async move {
                let _ = entered_tx.send(());
                let _ = release_rx.await;
                Ok("done".to_owned())
            })
            .await;
        out
    });
    entered_rx.await.unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let second: Out = c.process(&order("o-1", 1), counting(&runs)).await;
    match &second {
        Outcome::InProgressElsewhere { retry_after } => {
            assert!(*retry_after > Duration::ZERO && *retry_after <= Duration::from_secs(30))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(second.verb(), Verb::Retry { after: Some(_) }));
    release_tx.send(()).unwrap();
    assert!(matches!(first.await.unwrap(), Outcome::Processed(_)));
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn transient_failure_releases_the_claim_for_a_retry() {
    let c = consumer(MemoryStore::new());
    let failed: Out = c
        .process(&order("o-1", 1), |_ctx| async { Err(HandlerError::Transient("503".to_owned())) })
        .await;
    let Outcome::Failed(f) = &failed else { panic!("{failed:?}") };
    assert_eq!(f.kind, FailureKind::Transient);
    assert!(matches!(&f.cause, Cause::Handler(e) if e == "503"));
    assert_eq!(failed.verb(), Verb::Retry { after: None });
    // Released: the redelivery runs at once, as attempt 2, with the same downstream key.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = Arc::clone(&seen);
    let retried: Out = c
        .process(&order("o-1", 1), move |ctx| async move {
            s.lock().unwrap().push((ctx.attempt(), ctx.downstream_key().map(str::to_owned)));
            Ok("ok".to_owned())
        })
        .await;
    assert!(matches!(retried, Outcome::Processed(_)));
    let seen = seen.lock().unwrap();
    assert_eq!(seen[0].0, 2);
    assert_eq!(
        seen[0].1.as_deref(),
        Some(DedupKey::new("orders", "o-1").unwrap().downstream_key().as_str())
    );
}

#[tokio::test]
async fn permanent_failure_is_recorded_and_dead_lettered() {
    let store = MemoryStore::new();
    let c = consumer(store.clone());
    let out: Out = c
        .process(&order("o-1", 1), |_ctx| async {
            Err(HandlerError::Permanent("card declined".to_owned()))
        })
        .await;
    assert!(matches!(&out, Outcome::Failed(f) if f.kind == FailureKind::Permanent));
    assert!(matches!(out.verb(), Verb::DeadLetter { reason } if reason.contains("card declined")));
    let rec = store.get(&DedupKey::new("orders", "o-1").unwrap()).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Failed);
    assert_eq!(rec.result.as_deref(), Some(&b"card declined"[..]));
    // Resubmitted from the dead-letter queue later, it runs again.
    let runs = Arc::new(AtomicU32::new(0));
    let again: Out = c.process(&order("o-1", 1), counting(&runs)).await;
    assert!(matches!(again, Outcome::Processed(ref r) if r == "charged#2"), "{again:?}");
}

#[test]
fn missing_key_policy_is_explicit() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(missing_key_reject());
    missing_key_lenient();
}

async fn missing_key_reject() {
    let no_key = Message::new(r#"{"cents":1}"#);
    let runs = Arc::new(AtomicU32::new(0));
    let reject = consumer(MemoryStore::new());
    let out: Out = reject.process(&no_key, counting(&runs)).await;
    let Outcome::Failed(f) = &out else { panic!("{out:?}") };
    assert!(matches!(f.cause, Cause::MissingKey(_)));
    assert!(
        matches!(out.verb(), Verb::DeadLetter { reason } if reason.contains("message id is missing"))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

fn missing_key_lenient() {
    let no_key = Message::new(r#"{"cents":1}"#);
    let runs = Arc::new(AtomicU32::new(0));
    let lenient = Engine::builder(MemoryStore::new())
        .scope("orders")
        .missing_key(MissingKeyPolicy::ProcessWithoutDedup)
        .build()
        .unwrap();
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let out: Out = lenient.process(&no_key, counting(&runs)).await;
            assert!(matches!(out, Outcome::Processed(_)));
        });
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let counted = snapshotter.snapshot().into_vec().into_iter().any(|(k, _, _, v)| {
        k.key().name() == "idem_missing_key_total"
            && v == metrics_util::debugging::DebugValue::Counter(1)
    });
    assert!(counted, "unkeyed message must be counted");
}

#[tokio::test]
async fn oversized_or_extracted_keys_fail_with_a_clear_cause() {
    let c = Engine::builder(MemoryStore::new()).scope("orders").max_key_bytes(8).build().unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let out: Out = c.process(&order("much-too-long-id", 1), counting(&runs)).await;
    match out.verb() {
        Verb::DeadLetter { reason } => {
            assert!(reason.contains("id is 16 bytes, longer than the limit of 8 bytes"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    let by_field = Engine::builder(MemoryStore::new())
        .scope("orders")
        .key(JsonPointer::new("/order_id"))
        .build()
        .unwrap();
    let out: Out = by_field.process(&Message::new(r#"{"order_id":"b-7"}"#), counting(&runs)).await;
    assert!(matches!(out, Outcome::Processed(_)));
    let key = by_field.key_of(&Message::new(r#"{"order_id":"b-7"}"#)).unwrap();
    assert_eq!(key.id(), "b-7");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A consumer crashes mid-effect (its future is dropped while the handler runs). After the lease
/// runs out, the redelivery runs again as attempt 2 with the same downstream key.
#[tokio::test]
async fn crash_mid_handler_is_taken_over_after_the_lease() {
    let clock = ManualClock::new();
    let c = consumer(MemoryStore::with_clock(clock.clone()));
    let msg = order("o-1", 1);
    let crashed = c.process(&msg, |_ctx| async {
        std::future::pending::<()>().await;
        Ok::<String, HandlerError<String>>("never".to_owned())
    });
    // Poll once so the claim is taken and the handler started, then drop it: a crash.
    let crashed = tokio::time::timeout(Duration::from_millis(1), crashed).await;
    assert!(crashed.is_err());

    let runs = Arc::new(AtomicU32::new(0));
    let early: Out = c.process(&msg, counting(&runs)).await;
    assert!(matches!(early, Outcome::InProgressElsewhere { .. }), "{early:?}");
    clock.advance(Duration::from_secs(31));
    let seen = Arc::new(std::sync::Mutex::new(None));
    let s = Arc::clone(&seen);
    let retried: Out = c
        .process(&msg, move |ctx| async move {
            *s.lock().unwrap() = Some((
                ctx.attempt(),
                ctx.took_over_expired(),
                ctx.downstream_key().map(str::to_owned),
            ));
            Ok("charged".to_owned())
        })
        .await;
    assert!(matches!(retried, Outcome::Processed(_)));
    let (attempt, took_over, downstream) = seen.lock().unwrap().clone().unwrap();
    assert_eq!((attempt, took_over), (2, true));
    assert_eq!(downstream.unwrap(), DedupKey::new("orders", "o-1").unwrap().downstream_key());
}

#[tokio::test]
async fn park_policy_holds_an_expired_lease_in_doubt_until_released() {
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(clock.clone());
    let c = Engine::builder(store.clone())
        .scope("orders")
        .lease(Duration::from_secs(30))
        .on_expired_lease(ExpiredLeasePolicy::Park)
        .build()
        .unwrap();
    let msg = order("o-1", 1);
    let crashed = c.process(&msg, |_ctx| async {
        std::future::pending::<()>().await;
        Ok::<String, HandlerError<String>>("never".to_owned())
    });
    assert!(tokio::time::timeout(Duration::from_millis(1), crashed).await.is_err());
    clock.advance(Duration::from_secs(31));
    let runs = Arc::new(AtomicU32::new(0));
    for _ in 0..2 {
        let out: Out = c.process(&msg, counting(&runs)).await;
        let Outcome::Failed(f) = &out else { panic!("{out:?}") };
        assert!(matches!(f.cause, Cause::InDoubt { .. }), "{:?}", f.cause);
        assert!(matches!(out.verb(), Verb::DeadLetter { reason } if reason.contains("in doubt")));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "a parked message must not run");
    let key = DedupKey::new("orders", "o-1").unwrap();
    assert_eq!(store.get(&key).await.unwrap().unwrap().state, RecordState::InDoubt);
    assert!(store.force_release(&key).await.unwrap());
    let out: Out = c.process(&msg, counting(&runs)).await;
    assert!(matches!(out, Outcome::Processed(_)), "{out:?}");
}

/// The effect ran but its completion could not be recorded (retries off): the outcome must not
/// say "processed" (which would ack), and the redelivery reruns with the same downstream key.
#[tokio::test]
async fn failed_completion_is_never_reported_as_processed() {
    let clock = ManualClock::new();
    let store = FaultyStore::new(MemoryStore::with_clock(clock.clone()));
    let c = Engine::builder(store.clone())
        .scope("orders")
        .lease(Duration::from_secs(30))
        .complete_retry(Duration::ZERO)
        .build()
        .unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    store.fail_next(Op::Complete, 1);
    let out: Out = c.process(&order("o-1", 1), counting(&runs)).await;
    let Outcome::Failed(f) = &out else { panic!("{out:?}") };
    assert_eq!(f.kind, FailureKind::Transient);
    assert!(matches!(f.cause, Cause::Store(_)));
    assert!(matches!(out.verb(), Verb::Retry { .. }));
    clock.advance(Duration::from_secs(31));
    let again: Out = c.process(&order("o-1", 1), counting(&runs)).await;
    assert!(matches!(again, Outcome::Processed(ref r) if r == "charged#2"), "{again:?}");
}

/// A store that fails for a moment after the effect (a restart, a cut connection): the
/// completion is tried again, so the delivery is processed once and not run again after the
/// lease. A failure that outlasts the retry limit is a transient failure, as without retries.
#[tokio::test(start_paused = true)]
async fn a_completion_that_fails_for_a_moment_is_tried_again() {
    let store = FaultyStore::new(MemoryStore::new());
    let c = Engine::builder(store.clone())
        .scope("orders")
        .complete_retry(Duration::from_secs(2))
        .build()
        .unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    store.fail_next(Op::Complete, 4); // 25 + 50 + 100 + 200 ms of pauses
    let out: Out = c.process(&order("o-1", 1), counting(&runs)).await;
    assert!(matches!(&out, Outcome::Processed(r) if r == "charged#1"), "{out:?}");
    assert_eq!(store.completes(), 1);

    store.fail_next(Op::Complete, 1_000);
    let started = tokio::time::Instant::now();
    let out: Out = c.process(&order("o-2", 1), counting(&runs)).await;
    assert!(
        matches!(&out, Outcome::Failed(f) if f.kind == FailureKind::Transient && matches!(f.cause, Cause::Store(_))),
        "{out:?}"
    );
    let waited = started.elapsed();
    assert!(waited <= Duration::from_secs(2), "retried past the limit: {waited:?}");
    assert!(waited >= Duration::from_millis(1_000), "gave up early: {waited:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "each handler ran once");

    // A batch: the completions that failed are tried again, the others are not repeated.
    store.fail_next(Op::Complete, 2);
    let batch = [order("o-3", 1), order("o-4", 1), order("o-5", 1)];
    let outs: Vec<Out> = c.process_batch(&batch, |ctx, _| counting(&runs)(ctx)).await;
    assert!(outs.iter().all(|o| matches!(o, Outcome::Processed(_))), "{outs:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 5);
    assert_eq!(store.completes(), 4);
}

#[tokio::test]
async fn failed_claim_runs_nothing_and_retries() {
    let store = FaultyStore::new(MemoryStore::new());
    let c = Engine::builder(store.clone()).scope("orders").build().unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    store.fail_next(Op::Claim, 1);
    let out: Out = c.process(&order("o-1", 1), counting(&runs)).await;
    assert!(
        matches!(&out, Outcome::Failed(f) if f.kind == FailureKind::Transient && matches!(f.cause, Cause::Store(_)))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn batch_claims_in_one_round_trip_and_runs_repeats_once() {
    let store = FaultyStore::new(MemoryStore::new());
    let c = Engine::builder(store.clone()).scope("orders").build().unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let msgs = vec![order("a", 1), order("b", 2), order("a", 1), order("a", 5), Message::new("{}")];
    let r = Arc::clone(&runs);
    let outs: Vec<Out> = c
        .process_batch(&msgs, move |ctx, m| {
            r.fetch_add(1, Ordering::SeqCst);
            let body = String::from_utf8_lossy(&m.payload).into_owned();
            async move { Ok(format!("{}:{body}", ctx.attempt())) }
        })
        .await;
    let labels: Vec<&str> = outs.iter().map(|o| o.kind().as_str()).collect();
    assert_eq!(labels, ["processed", "processed", "duplicate", "conflict", "failed_permanent"]);
    assert!(matches!(&outs[2], Outcome::Duplicate(Some(r)) if r.starts_with("1:")));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // Round 1 claims the batch's distinct keys (a, b) at once; each later copy of `a` is
    // claimed in a round of its own, once the copy before it is durable.
    assert_eq!(store.claim_many_calls(), 3);
    assert_eq!(store.claims(), 4);
}

#[tokio::test]
async fn batch_falls_back_to_single_claims_when_the_batch_fails() {
    let store = FaultyStore::new(MemoryStore::new());
    let c = Engine::builder(store.clone()).scope("orders").build().unwrap();
    store.fail_next(Op::Claim, 1);
    let runs = Arc::new(AtomicU32::new(0));
    let r = Arc::clone(&runs);
    let msgs = vec![order("a", 1), order("b", 2)];
    let outs: Vec<Out> = c
        .process_batch(&msgs, move |_ctx, _m| {
            r.fetch_add(1, Ordering::SeqCst);
            async { Ok("x".to_owned()) }
        })
        .await;
    assert!(outs.iter().all(|o| matches!(o, Outcome::Processed(_))), "{outs:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Heartbeats extend the lease while a slow handler runs, so no other consumer takes it over.
/// Paused tokio time: the "slow" handler advances virtual time only.
#[tokio::test(start_paused = true)]
async fn heartbeat_keeps_a_slow_handler_lease() {
    let store = MemoryStore::with_clock(TokioClock::new());
    let c = Engine::builder(store.clone())
        .scope("orders")
        .lease(Duration::from_secs(10))
        .heartbeat(Duration::from_secs(3))
        .build()
        .unwrap();
    let (at_35s_tx, at_35s_rx) = tokio::sync::oneshot::channel();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let c2 = c.clone();
    let slow = tokio::spawn(async move {
        let out: Out = c2
            .process(&order("o-1", 1), |_ctx| async move {
                tokio::time::sleep(Duration::from_secs(35)).await; // simulated work, virtual time
                let _ = at_35s_tx.send(());
                let _ = done_rx.await;
                Ok("slow".to_owned())
            })
            .await;
        out
    });
    at_35s_rx.await.unwrap();
    let runs = Arc::new(AtomicU32::new(0));
    let other: Out = c.process(&order("o-1", 1), counting(&runs)).await;
    assert!(matches!(other, Outcome::InProgressElsewhere { .. }), "lease was not kept: {other:?}");
    done_tx.send(()).unwrap();
    assert!(matches!(slow.await.unwrap(), Outcome::Processed(_)));
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

/// The message a person reads (`to_string()` of the top-level error, with no source chain)
/// names the field and the limit.
#[test]
fn an_oversized_scope_is_refused_naming_the_field_and_the_limit() {
    let err = Engine::builder(MemoryStore::new()).scope("s".repeat(513)).build().unwrap_err();
    assert!(matches!(err, ConfigError::InvalidScope(_)));
    let text = err.to_string();
    assert!(text.contains("scope") && text.contains("513") && text.contains("512"), "{text}");
    let nul = Engine::builder(MemoryStore::new()).scope("a\0b").build().unwrap_err().to_string();
    assert!(nul.contains("scope") && nul.contains("NUL"), "{nul}");
}

#[test]
fn retention_shorter_than_the_redelivery_window_is_rejected() {
    let err = Engine::builder(MemoryStore::new())
        .scope("orders")
        .retain(Duration::from_secs(600))
        .redelivery_window(RedeliveryWindow::new(10, Duration::from_secs(300)))
        .build()
        .unwrap_err();
    assert!(matches!(err, ConfigError::Retention(_)));
    assert!(err.to_string().contains("10 deliveries × 5m"), "{err}");
    assert!(matches!(
        Engine::builder(MemoryStore::new()).build().unwrap_err(),
        ConfigError::MissingScope
    ));
    assert!(matches!(
        Engine::builder(MemoryStore::new()).scope("").build().unwrap_err(),
        ConfigError::InvalidScope(_)
    ));
}
