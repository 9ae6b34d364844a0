//! Crash-loop detection in the engine, on `MemoryStore` with a manual clock: a message whose
//! handler kills the process (here: the batch future is dropped while that handler runs, as a
//! process abort drops everything) is dead-lettered once its deaths reach the limit, without
//! running again, and the messages fetched with it are not dead-lettered with it. Only deaths
//! count: a key given back (a transient failure, a failed push, a claim taken ahead and
//! dropped) any number of times is run again after one death.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::engine::{Cause, ConfigError, FailureKind, HandlerError};
use idem_core::extract::Message;
use idem_core::time::ManualClock;
use idem_core::{DedupKey, Engine, InspectStore, MemoryStore, Outcome, RecordState};

type Out = Outcome<String, String>;

const LEASE: Duration = Duration::from_secs(30);
const POISON: &str = "o-2";

fn order(id: &str) -> Message {
    Message::new(format!(r#"{{"order_id":"{id}"}}"#)).with_message_id(id)
}

fn engine(store: MemoryStore, limit: u32) -> Engine<MemoryStore> {
    Engine::builder(store)
        .scope("orders")
        .lease(LEASE)
        .retain(Duration::from_secs(86_400))
        .crash_loop_limit(limit)
        .build()
        .unwrap()
}

/// Runs `msgs` as one batch; the poison handler "kills the process": the batch is dropped
/// while it runs. Returns the outcomes when the batch finished, `None` when it "crashed".
async fn deliver(
    e: &Engine<MemoryStore>,
    msgs: &[Message],
    effects: &Arc<Mutex<Vec<(String, u32)>>>,
) -> Option<Vec<Out>> {
    let crashed = tokio::sync::Notify::new();
    let batch = e.process_batch(msgs, |ctx, m| {
        let (effects, crashed) = (Arc::clone(effects), &crashed);
        let key = m.message_id.clone().unwrap_or_default();
        async move {
            if key == POISON {
                crashed.notify_one();
                std::future::pending::<()>().await;
            }
            effects.lock().unwrap().push((key, ctx.attempt()));
            Ok::<_, HandlerError<String>>("done".to_owned())
        }
    });
    tokio::select! {
        outs = batch => Some(outs),
        () = crashed.notified() => None,
    }
}

#[tokio::test]
async fn a_poison_message_is_dead_lettered_at_the_limit_and_its_batch_is_not() {
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(clock.clone());
    let e = engine(store.clone(), 3);
    let msgs: Vec<Message> = (0..6).map(|i| order(&format!("o-{i}"))).collect();
    let effects = Arc::new(Mutex::new(Vec::new()));

    // Every delivery of the batch until one finishes: the broker redelivers it after each crash.
    let mut crashes = 0;
    let outs = loop {
        match deliver(&e, &msgs, &effects).await {
            Some(outs) => break outs,
            None => crashes += 1,
        }
        assert!(crashes <= 10, "still crashing after {crashes} deliveries");
        clock.advance(LEASE + Duration::from_secs(1));
    };
    // Attempts 1, 2 and 3 died; the claim of attempt 4 found the limit reached.
    assert_eq!(crashes, 3);
    for (m, out) in msgs.iter().zip(&outs) {
        let id = m.message_id.as_deref().unwrap();
        if id == POISON {
            let Outcome::Failed(f) = out else { panic!("{id}: {out:?}") };
            assert_eq!(f.kind, FailureKind::Permanent);
            assert!(matches!(f.cause, Cause::CrashLoop { deaths: 3, limit: 3 }), "{:?}", f.cause);
            assert!(f.cause.to_string().starts_with("crash loop: 3 deaths"), "{}", f.cause);
        } else {
            // Processed in an earlier (crashed) delivery's solo run, so a duplicate now, or
            // processed now: never failed.
            assert!(matches!(out, Outcome::Duplicate(_) | Outcome::Processed(_)), "{id}: {out:?}");
        }
    }
    // Every other message's effect happened, and each repeat is a rerun under a later attempt
    // after a takeover (an effect whose completion died with the process), never the same
    // attempt twice; none of them came near the limit.
    let effects = effects.lock().unwrap().clone();
    let mut by_key: HashMap<&str, Vec<u32>> = HashMap::new();
    for (k, a) in &effects {
        by_key.entry(k.as_str()).or_default().push(*a);
    }
    assert!(!by_key.contains_key(POISON));
    assert_eq!(by_key.len(), 5, "{effects:?}");
    for (k, attempts) in &by_key {
        let mut distinct = attempts.clone();
        distinct.dedup();
        assert_eq!(&distinct, attempts, "{k} ran twice under one attempt: {attempts:?}");
        assert!(attempts.iter().all(|a| *a <= 3), "{k}: {attempts:?}");
    }
    // The record says why, and a resubmission after the fix runs again.
    // Nor does any count attempts it did not run: a key the first crash held is taken over
    // once, alone, when its turn comes, never held while the poison runs (attempt 2 at most).
    for m in msgs.iter().filter(|m| m.message_id.as_deref() != Some(POISON)) {
        let key = DedupKey::new("orders", m.message_id.as_deref().unwrap()).unwrap();
        let rec = store.get(&key).await.unwrap().unwrap();
        assert!(rec.attempt <= 2, "{:?} reached attempt {}", m.message_id, rec.attempt);
    }
    let key = DedupKey::new("orders", POISON).unwrap();
    let rec = store.get(&key).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Failed);
    let reason = String::from_utf8(rec.result.unwrap()).unwrap();
    assert!(reason.starts_with("crash loop"), "{reason}");
    let again: Out = e.process(&msgs[2], |_| async { Ok("fixed".to_owned()) }).await;
    assert!(matches!(again, Outcome::Processed(_)), "{again:?}");
}

#[tokio::test]
async fn a_lone_message_that_keeps_dying_is_not_run_after_the_limit() {
    let clock = ManualClock::new();
    let e = engine(MemoryStore::with_clock(clock.clone()), 2);
    let msg = order(POISON);
    let effects = Arc::new(Mutex::new(Vec::new()));
    for _ in 0..2 {
        assert!(deliver(&e, std::slice::from_ref(&msg), &effects).await.is_none());
        clock.advance(LEASE + Duration::from_secs(1));
    }
    let outs = deliver(&e, std::slice::from_ref(&msg), &effects).await.unwrap();
    assert!(
        matches!(&outs[0], Outcome::Failed(f) if matches!(f.cause, Cause::CrashLoop { deaths: 2, limit: 2 })),
        "{outs:?}"
    );
    // A takeover under the limit runs: limit 2 let attempt 2 run (and die).
    assert!(effects.lock().unwrap().is_empty());
}

/// Attempts that gave the key back are not deaths: a message whose handler failed transiently
/// ten times (as a push to an application that is restarting does, or a claim taken ahead and
/// released at a rebalance) and then died once is run again, at limit 2. Counting attempts, as
/// the engine once did, dead-lettered it at the first takeover (attempt 12 > 2).
#[tokio::test]
async fn keys_given_back_are_not_deaths() {
    let clock = ManualClock::new();
    let store = MemoryStore::with_clock(clock.clone());
    let e = engine(store.clone(), 2);
    let msg = order("o-9");
    for _ in 0..10 {
        let out: Out =
            e.process(&msg, |_| async { Err(HandlerError::Transient("503".to_owned())) }).await;
        assert!(matches!(&out, Outcome::Failed(f) if f.kind == FailureKind::Transient), "{out:?}");
    }
    // One death: the process dies holding the key (the lease is dropped, never given back).
    let key = DedupKey::new("orders", "o-9").unwrap();
    let req = idem_core::ClaimRequest::new(key.clone(), None, LEASE, Duration::from_secs(60));
    let idem_core::Claim::Acquired(lease) =
        idem_core::DedupStore::claim(&store, &req).await.unwrap()
    else {
        panic!("not acquired")
    };
    assert_eq!((lease.attempt(), lease.deaths()), (11, 0));
    drop(lease);
    clock.advance(LEASE + Duration::from_secs(1));
    let runs = Arc::new(Mutex::new(Vec::new()));
    let out: Out = e
        .process(&msg, |ctx| {
            let runs = Arc::clone(&runs);
            async move {
                runs.lock().unwrap().push((ctx.attempt(), ctx.took_over_expired()));
                Ok("done".to_owned())
            }
        })
        .await;
    assert!(matches!(out, Outcome::Processed(_)), "{out:?}");
    assert_eq!(*runs.lock().unwrap(), [(12, true)]);
    let rec = store.get(&key).await.unwrap().unwrap();
    assert_eq!((rec.attempt, rec.deaths, rec.state), (12, 1, RecordState::Completed));
}

#[test]
fn a_zero_limit_is_refused_naming_the_setting() {
    let err = Engine::builder(MemoryStore::new())
        .scope("orders")
        .crash_loop_limit(0)
        .build()
        .err()
        .unwrap();
    assert!(matches!(err, ConfigError::ZeroLimit { field: "crash_loop_limit" }));
    assert!(err.to_string().contains("crash_loop_limit must be at least 1"), "{err}");
}
