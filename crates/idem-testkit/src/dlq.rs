//! The dead-letter workbench on a real broker: every adapter's [`DeadLetterQueue`] runs
//! [`workbench`] over its [`SourceHarness`].
//!
//! The case dead-letters through the real consumer (two poison orders failing permanently, one
//! order id reused with another body), then reads the dead letters back (twice: a read changes
//! nothing), replays them by the rules (the poison ones under their key once the handler is
//! fixed; the conflict refused, then accepted as a new message), replays the same letters a
//! second time (the consumer finds them duplicates: at worst twice on the broker, never twice in
//! effect), and purges a third poison order. The effect is counted per message id, with no
//! unique constraint: twice is visible.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure is the test failing

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::consumer::{Consumer, headers};
use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_dlq::{DeadLetterQueue, Letter, OnConflict, Workbench, accepted_id, group};
use idem_sqlx::SqliteStore;

use crate::source::{MessageOf, SourceHarness};
use crate::wait_for;

const SCOPE: &str = "dlq";
const LIMIT: Duration = Duration::from_secs(60);

/// Effects by message id.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<HashMap<String, u32>>>);

impl Ledger {
    fn count(&self, id: &str) -> u32 {
        self.0.lock().unwrap().get(id).copied().unwrap_or(0)
    }
    fn snapshot(&self) -> HashMap<String, u32> {
        self.0.lock().unwrap().clone()
    }
}

/// Runs the workbench case on `h`, with `queue` its dead-letter destination.
///
/// # Cancel safety
/// Dropped midway, what the case published stays on the harness's destination, which the
/// harness deletes when it is dropped.
pub async fn workbench<H: SourceHarness, Q: DeadLetterQueue>(h: H, queue: Q) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
    let ledger = Ledger::default();
    let fixed = Arc::new(AtomicBool::new(false));
    let handler = |_ctx, m: MessageOf<H>| {
        let id = m.message_id().unwrap_or_default().to_owned();
        let poison = String::from_utf8_lossy(m.payload()).contains("poison");
        let (ledger, fixed) = (ledger.clone(), fixed.load(Ordering::SeqCst));
        async move {
            if poison && !fixed {
                return Err(HandlerError::Permanent(format!("order {id} refused: poison")));
            }
            *ledger.0.lock().unwrap().entry(id).or_default() += 1;
            Ok::<(), HandlerError<String>>(())
        }
    };
    let consumer = Consumer::builder(h.config())
        .store(store)
        .scope(SCOPE)
        .batch(8)
        .idle_wait(Duration::from_millis(100))
        .build()
        .await
        .expect("consumer");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = consumer.run(&handler, async {
        let _ = stopped.await;
    });
    let script = async {
        script(&h, &queue, &ledger, &fixed).await;
        stop.send(()).expect("stop");
    };
    let (report, ()) = tokio::join!(run, script);
    let report = report.expect("run");
    assert!(report.dead_lettered >= 4, "{report}");
    h.cleanup().await;
}

async fn letters<Q: DeadLetterQueue>(q: &Q) -> Vec<Letter> {
    q.read(100).await.expect("reading the dead letters")
}

async fn wait_letters<Q: DeadLetterQueue>(q: &Q, n: usize) -> Vec<Letter> {
    wait_for(&format!("{n} dead letters on {}", q.describe()), LIMIT, || async {
        letters(q).await.len() == n
    })
    .await;
    letters(q).await
}

async fn script<H: SourceHarness, Q: DeadLetterQueue>(
    h: &H,
    queue: &Q,
    ledger: &Ledger,
    fixed: &AtomicBool,
) {
    h.publish("p-1", br#"{"order":1,"poison":true}"#).await;
    h.publish("p-2", br#"{"order":2,"poison":true}"#).await;
    h.publish("c-3", br#"{"order":3}"#).await;
    wait_for("c-3 processed", LIMIT, || async { ledger.count("c-3") == 1 }).await;
    h.publish("c-3", br#"{"order":3,"other":true}"#).await;

    // Read back: the idem headers, and a read changes nothing.
    let first = wait_letters(queue, 3).await;
    wait_for("everything settled", LIMIT, || h.settled()).await;
    let again = letters(queue).await;
    let ids = |ls: &[Letter]| ls.iter().map(|l| l.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&first), ids(&again), "a read changed the dead letters");
    for l in &first {
        assert_eq!(l.scope(), Some(SCOPE), "{l:?}");
        assert!(l.source().is_some_and(|s| !s.is_empty()), "no source: {l:?}");
        assert_eq!(l.key(), l.message_id.as_deref(), "{l:?}");
        assert!(l.reason().is_some(), "{l:?}");
    }
    let poison: Vec<Letter> =
        first.iter().filter(|l| l.outcome() == Some("failed_permanent")).cloned().collect();
    let mut poison_ids: Vec<_> = poison.iter().filter_map(|l| l.message_id.clone()).collect();
    poison_ids.sort();
    assert_eq!(poison_ids, ["p-1", "p-2"], "{first:?}");
    let conflict: Vec<Letter> = first.iter().filter(|l| l.is_conflict()).cloned().collect();
    assert_eq!(conflict.len(), 1, "{first:?}");
    assert_eq!(conflict[0].payload, br#"{"order":3,"other":true}"#);
    let groups = group(&first);
    assert_eq!(groups.len(), 2, "{groups:?}");
    assert_eq!(groups[0].ids.len(), 2, "the poison orders are one group: {groups:?}");

    // Replay everything, conflicts refused: the poison orders run once the handler is fixed.
    fixed.store(true, Ordering::SeqCst);
    let bench = Workbench::new(queue);
    let r = bench.replay(&first, OnConflict::Refuse).await.expect("replay");
    assert_eq!(r.replayed.len(), 2, "{r:?}");
    assert_eq!(r.refused.len(), 1, "{r:?}");
    assert_eq!(r.refused[0].0, conflict[0].id, "{r:?}");
    assert_eq!(r.removed, 2, "{r:?}");
    wait_for("p-1 and p-2 processed", LIMIT, || async {
        ledger.count("p-1") == 1 && ledger.count("p-2") == 1
    })
    .await;
    let left = letters(queue).await;
    assert_eq!(ids(&left), ids(&conflict), "only the conflict is left");
    assert_eq!(ledger.count("c-3"), 1, "a refused conflict was processed");

    // The conflict accepted as a new message: processed once, under a new id.
    let r = bench.replay(&conflict, OnConflict::AcceptAsNew).await.expect("accept");
    let new_id = accepted_id("c-3", &conflict[0].payload);
    assert_eq!(r.accepted_as_new, [(conflict[0].id.clone(), new_id.clone())], "{r:?}");
    wait_for("the accepted conflict processed", LIMIT, || async { ledger.count(&new_id) == 1 })
        .await;
    wait_letters(queue, 0).await;

    // The same letters replayed again (an operator's second click): on the broker twice,
    // deduplicated by the consumer.
    bench.replay(&first, OnConflict::AcceptAsNew).await.expect("second replay");
    wait_for("the second replay settled", LIMIT, || h.settled()).await;
    let effects = ledger.snapshot();
    for id in ["p-1", "p-2", "c-3", new_id.as_str()] {
        assert_eq!(effects.get(id), Some(&1), "{id} ran twice or never: {effects:?}");
    }
    assert_eq!(effects.len(), 4, "{effects:?}");

    // Purge: gone without an effect.
    fixed.store(false, Ordering::SeqCst);
    h.publish("p-4", br#"{"order":4,"poison":true}"#).await;
    let dead = wait_letters(queue, 1).await;
    assert_eq!(dead[0].message_id.as_deref(), Some("p-4"));
    assert_eq!(dead[0].header(headers::OUTCOME), Some("failed_permanent"));
    assert_eq!(bench.purge(&dead).await.expect("purge"), 1);
    wait_letters(queue, 0).await;
    assert_eq!(ledger.count("p-4"), 0);
}
