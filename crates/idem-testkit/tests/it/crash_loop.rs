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

/// Inbox mode, over a SQLite inbox with a manual clock: the first deliveries write no note;
/// their redeliveries run one at a time, each under a crash note (a two-phase claim of a key
/// of its own in the markers' table). The batch whose poison handler "kills the process" (the
/// batch dropped while it runs) comes back until the poison has died 3 times, the limit — the
/// first death, in the batch's one transaction, counted by the redelivery itself — and is
/// then dead-lettered without running; every other message's effect commits exactly once.
mod inbox {
    use idem_core::extract::Redelivery;
    use idem_core::inbox::{Inbox, Tx};
    use idem_sqlx::{SqliteInbox, SqliteStore};

    use super::*;

    type Ledger = Arc<Mutex<Vec<String>>>;

    async fn engine(
        dir: &tempfile::TempDir,
        clock: &ManualClock,
        limit: u32,
    ) -> Engine<Inbox<SqliteInbox>> {
        let store = SqliteStore::open(dir.path().join("idem.sqlite"))
            .await
            .unwrap()
            .with_clock(clock.clone());
        sqlx::raw_sql("CREATE TABLE IF NOT EXISTS ledger (k TEXT NOT NULL)")
            .execute(store.pool())
            .await
            .unwrap();
        Engine::builder(Inbox::new(store.inbox(Duration::from_secs(86_400))))
            .scope("orders")
            .lease(LEASE)
            .crash_loop_limit(limit)
            .build()
            .unwrap()
    }

    /// One delivery of `msgs` as a batch: the poison's handler "kills the process". The
    /// ledger row is written on the batch's transaction; `runs` counts handler starts.
    async fn deliver(
        e: &Engine<Inbox<SqliteInbox>>,
        msgs: &[Message],
        runs: &Ledger,
    ) -> Option<Vec<Out>> {
        let crashed = tokio::sync::Notify::new();
        let handler = |mut tx: Tx<SqliteInbox>, m: Message| {
            let (runs, crashed) = (Arc::clone(runs), &crashed);
            let key = m.message_id.clone().unwrap_or_default();
            async move {
                runs.lock().unwrap().push(key.clone());
                if key == POISON {
                    crashed.notify_one();
                    std::future::pending::<()>().await;
                }
                sqlx::query("INSERT INTO ledger (k) VALUES (?)")
                    .bind(&key)
                    .execute(&mut *tx)
                    .await
                    .map_err(|e| HandlerError::Transient(e.to_string()))?;
                Ok::<_, HandlerError<String>>("done".to_owned())
            }
        };
        tokio::select! {
            outs = e.decide_batch(msgs, &handler) => Some(outs),
            () = crashed.notified() => None,
        }
    }

    async fn ledger(e: &Engine<Inbox<SqliteInbox>>) -> HashMap<String, i64> {
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT k, COUNT(*) FROM ledger GROUP BY k")
            .fetch_all(e.store().inner().pool())
            .await
            .unwrap();
        rows.into_iter().collect()
    }

    #[tokio::test]
    async fn a_poison_message_is_dead_lettered_at_the_limit_and_its_batch_is_not() {
        let (dir, clock) = (tempfile::tempdir().unwrap(), ManualClock::new());
        let e = engine(&dir, &clock, 3).await;
        let first: Vec<Message> = (0..6).map(|i| order(&format!("o-{i}"))).collect();
        let again: Vec<Message> =
            first.iter().cloned().map(|m| m.with_redelivery(Redelivery::Again)).collect();
        let runs: Ledger = Arc::default();
        let mut crashes = 0;
        let mut msgs = &first;
        let outs = loop {
            match deliver(&e, msgs, &runs).await {
                Some(outs) => break outs,
                None => crashes += 1,
            }
            assert!(crashes <= 10, "still crashing after {crashes} deliveries");
            msgs = &again;
            // The dead process's note runs out with its lease.
            clock.advance(LEASE + Duration::from_secs(1));
        };
        // The batch's one transaction died, then two runs under the note; the fourth
        // delivery's note claim found the limit reached.
        assert_eq!(crashes, 3);
        let poison_runs = runs.lock().unwrap().iter().filter(|k| *k == POISON).count();
        assert_eq!(poison_runs, 3, "{:?}", runs.lock().unwrap());
        for (m, out) in first.iter().zip(&outs) {
            let id = m.message_id.as_deref().unwrap();
            if id == POISON {
                let Outcome::Failed(f) = out else { panic!("{id}: {out:?}") };
                assert_eq!(f.kind, FailureKind::Permanent);
                assert!(
                    matches!(f.cause, Cause::CrashLoop { deaths: 3, limit: 3 }),
                    "{:?}",
                    f.cause
                );
            } else {
                assert!(
                    matches!(out, Outcome::Duplicate(_) | Outcome::Processed(_)),
                    "{id}: {out:?}"
                );
            }
        }
        // Every other message's effect exactly once; the poison's never.
        let effects = ledger(&e).await;
        assert_eq!(effects.len(), 5, "{effects:?}");
        assert!(effects.values().all(|n| *n == 1), "{effects:?}");
        assert!(!effects.contains_key(POISON));
        // No marker for the poison: a resubmission after the fix runs.
        let fixed = deliver(&e, &[order(POISON).with_message_id("o-2-fixed")], &runs).await;
        assert!(matches!(fixed.as_deref(), Some([Outcome::Processed(_)])), "{fixed:?}");
    }

    /// A Kafka record read first after an assignment is `Possible`: it runs under a note from
    /// its first read, so only the notes count, and the poison dies exactly the limit's times
    /// (with the `Again` rule's extra death it would be dead-lettered after two).
    #[tokio::test]
    async fn possible_redeliveries_count_only_what_their_notes_saw() {
        let (dir, clock) = (tempfile::tempdir().unwrap(), ManualClock::new());
        let e = engine(&dir, &clock, 3).await;
        let msgs: Vec<Message> = (0..4)
            .map(|i| order(&format!("o-{i}")).with_redelivery(Redelivery::Possible))
            .collect();
        let runs: Ledger = Arc::default();
        let mut crashes = 0;
        let outs = loop {
            match deliver(&e, &msgs, &runs).await {
                Some(outs) => break outs,
                None => crashes += 1,
            }
            assert!(crashes <= 10, "still crashing after {crashes} deliveries");
            clock.advance(LEASE + Duration::from_secs(1));
        };
        assert_eq!(crashes, 3);
        assert!(
            matches!(&outs[2], Outcome::Failed(f) if matches!(f.cause, Cause::CrashLoop { deaths: 3, limit: 3 })),
            "{outs:?}"
        );
        let effects = ledger(&e).await;
        assert_eq!(effects.len(), 3, "{effects:?}");
        assert!(effects.values().all(|n| *n == 1), "{effects:?}");
    }

    /// A redelivery given back alive is not a death: a message that fails transiently ten
    /// times, each time redelivered, runs again every time (its note is given back each time),
    /// at limit 2. A note that was not given back would be taken over after its lease and
    /// dead-letter it.
    #[tokio::test]
    async fn redeliveries_given_back_are_not_deaths() {
        let (dir, clock) = (tempfile::tempdir().unwrap(), ManualClock::new());
        let e = engine(&dir, &clock, 2).await;
        let msg = order("o-9").with_redelivery(Redelivery::Again);
        let failing = |_tx: Tx<SqliteInbox>, _m: Message| async {
            Err::<String, _>(HandlerError::Transient("503".to_owned()))
        };
        for _ in 0..10 {
            let out = e.decide_batch(std::slice::from_ref(&msg), &failing).await;
            assert!(
                matches!(&out[..], [Outcome::Failed(f)] if f.kind == FailureKind::Transient),
                "{out:?}"
            );
            clock.advance(LEASE + Duration::from_secs(1));
        }
        let runs: Ledger = Arc::default();
        let out = deliver(&e, std::slice::from_ref(&msg), &runs).await;
        assert!(matches!(out.as_deref(), Some([Outcome::Processed(_)])), "{out:?}");
        assert_eq!(ledger(&e).await.get("o-9"), Some(&1));
    }

    /// A note still held (the last process died less than a lease ago, or another consumer
    /// runs the message) answers "in progress elsewhere" with the time left, and runs nothing.
    #[tokio::test]
    async fn a_held_note_waits_for_its_lease() {
        let (dir, clock) = (tempfile::tempdir().unwrap(), ManualClock::new());
        let e = engine(&dir, &clock, 3).await;
        let runs: Ledger = Arc::default();
        let poison = [order(POISON).with_redelivery(Redelivery::Again)];
        assert!(deliver(&e, &poison, &runs).await.is_none());
        clock.advance(Duration::from_secs(10));
        let out = deliver(&e, &poison, &runs).await.unwrap();
        let [Outcome::InProgressElsewhere { retry_after }] = &out[..] else { panic!("{out:?}") };
        assert!(*retry_after <= LEASE - Duration::from_secs(10), "{retry_after:?}");
        assert_eq!(runs.lock().unwrap().len(), 1);
    }
}
