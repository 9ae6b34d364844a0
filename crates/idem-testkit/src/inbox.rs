//! The transactional-inbox contract ([`TxInbox`]), one case per promise, run against every SQL
//! inbox by [`tx_inbox_conformance!`](crate::tx_inbox_conformance).
//!
//! The cases go through the inbox's own calls (`begin`, `mark`, `mark_many`, `process`) and
//! through the engine a broker consumer drives (`Engine<Inbox<_>>::decide_batch`), and check the
//! results in the database: markers and business rows.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure is the test failing

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use idem_core::engine::{Cause, FailureKind, HandlerError, MissingKeyPolicy};
use idem_core::extract::Message;
use idem_core::inbox::{Inbox, Tx, TxInbox};
use idem_core::{
    Claim, ClaimRequest, DedupKey, DedupStore, Engine, InspectStore, Outcome, OutcomeKind,
    RecordState,
};

/// A boxed future, as harnesses return them.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The connection type of a harness's inbox.
pub type Conn<H> = <<H as InboxHarness>::Inbox as TxInbox>::Connection;

/// A database under test: its store and inbox, in a namespace of their own (a schema, a table
/// name, a file), with a business table `ledger` that has **no** unique constraint, so only
/// the inbox can keep it exact.
pub trait InboxHarness: Send + Sync + Sized + 'static {
    /// The store the inbox belongs to.
    type Store: DedupStore + InspectStore + Clone + 'static;
    /// The inbox.
    type Inbox: TxInbox + Clone;

    /// The store.
    fn store(&self) -> &Self::Store;

    /// Its inbox, keeping markers for a week.
    fn inbox(&self) -> Self::Inbox;

    /// Inserts one ledger row for `id` on `conn` (inside the caller's transaction).
    fn write<'c>(
        &'c self,
        conn: &'c mut Conn<Self>,
        id: &'c str,
    ) -> BoxFuture<'c, Result<(), sqlx::Error>>;

    /// How many ledger rows exist (committed).
    fn ledger_rows(&self) -> BoxFuture<'_, i64>;

    /// Returns once some statement of this harness's namespace waits on another transaction's
    /// lock (how the database shows it), or panics after 10 s.
    fn wait_until_blocked(&self) -> BoxFuture<'_, ()>;
}

const WEEK: Duration = Duration::from_secs(7 * 86_400);
const SCOPE: &str = "ledger-writer";

fn key(id: &str) -> DedupKey {
    DedupKey::new(SCOPE, id).unwrap()
}

fn order(id: &str, cents: u32) -> Message {
    Message::new(format!(r#"{{"order_id":"{id}","cents":{cents}}}"#)).with_message_id(id)
}

/// The engine of a broker consumer in inbox mode, over the harness's inbox.
fn engine<H: InboxHarness>(h: &H) -> Engine<Inbox<H::Inbox>> {
    Engine::builder(Inbox::new(h.inbox())).scope(SCOPE).build().unwrap()
}

/// The connection inside one of the harness inbox's transactions.
fn conn<H: InboxHarness>(tx: &mut <H::Inbox as TxInbox>::Transaction) -> &mut Conn<H> {
    <H::Inbox as TxInbox>::connection(tx)
}

type Out = Outcome<String, String>;

/// Decides `batch` through the engine; each first delivery writes one ledger row and answers
/// `"<id>:<cents>"`; an id starting with `fail-t`/`fail-p` fails transiently/permanently
/// after writing.
async fn decide<H: InboxHarness>(
    h: &Arc<H>,
    c: &Engine<Inbox<H::Inbox>>,
    batch: &[Message],
) -> Vec<Out> {
    let handler = |mut tx: Tx<H::Inbox>, m: Message| {
        let h = Arc::clone(h);
        async move {
            let id = m.message_id.clone().unwrap_or_default();
            h.write(&mut tx, &id).await.map_err(|e| HandlerError::Transient(e.to_string()))?;
            if id.starts_with("fail-t") {
                return Err(HandlerError::Transient(format!("{id} failed")));
            }
            if id.starts_with("fail-p") {
                return Err(HandlerError::Permanent(format!("{id} failed")));
            }
            Ok(format!("{id}:{}", String::from_utf8_lossy(&m.payload).len()))
        }
    };
    c.decide_batch(batch, &handler).await
}

fn kinds(outs: &[Out]) -> Vec<OutcomeKind> {
    outs.iter().map(Outcome::kind).collect()
}

/// A rolled back transaction leaves no marker and no writes; the redelivery is first again.
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn rollback_leaves_no_marker<H: InboxHarness>(h: H) {
    let inbox = h.inbox();
    let k = key("o-1");
    let mut tx = inbox.begin().await.unwrap();
    assert!(matches!(inbox.mark(conn::<H>(&mut tx), &k, None).await.unwrap(), Claim::Acquired(_)));
    h.write(conn::<H>(&mut tx), "o-1").await.unwrap();
    inbox.rollback(tx).await.unwrap();
    assert!(h.store().get(&k).await.unwrap().is_none(), "a rolled back marker must not exist");
    assert_eq!(h.ledger_rows().await, 0);
    let mut tx = inbox.begin().await.unwrap();
    assert!(matches!(inbox.mark(conn::<H>(&mut tx), &k, None).await.unwrap(), Claim::Acquired(_)));
    inbox.commit(tx).await.unwrap();
    assert_eq!(h.store().get(&k).await.unwrap().unwrap().state, RecordState::Completed);
    let mut tx = inbox.begin().await.unwrap();
    assert!(matches!(inbox.mark(conn::<H>(&mut tx), &k, None).await.unwrap(), Claim::Completed(_)));
    // A duplicate leaves the caller's transaction usable (no error was raised inside it).
    h.write(conn::<H>(&mut tx), "after-duplicate").await.unwrap();
    inbox.rollback(tx).await.unwrap();
}

/// A second transaction marking a key an open one holds waits for it, then sees a duplicate
/// (the first committed) or is first (it rolled back).
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn concurrent_mark_waits_then_sees_the_outcome<H: InboxHarness>(h: H) {
    let h = Arc::new(h);
    for commit in [true, false] {
        let inbox = h.inbox();
        let k = key(if commit { "race-commit" } else { "race-rollback" });
        let mut tx1 = inbox.begin().await.unwrap();
        assert!(matches!(
            inbox.mark(conn::<H>(&mut tx1), &k, None).await.unwrap(),
            Claim::Acquired(_)
        ));
        let first_ended = Arc::new(AtomicBool::new(false));
        let second = {
            let (inbox, k, ended) = (inbox.clone(), k.clone(), Arc::clone(&first_ended));
            tokio::spawn(async move {
                let mut tx2 = inbox.begin().await.unwrap();
                let mark = inbox.mark(conn::<H>(&mut tx2), &k, None).await.unwrap();
                let waited = ended.load(Ordering::SeqCst);
                inbox.commit(tx2).await.unwrap();
                (mark, waited)
            })
        };
        h.wait_until_blocked().await;
        assert!(!second.is_finished(), "the second mark must wait for the first transaction");
        first_ended.store(true, Ordering::SeqCst);
        if commit {
            inbox.commit(tx1).await.unwrap();
        } else {
            inbox.rollback(tx1).await.unwrap();
        }
        let (mark, waited) =
            tokio::time::timeout(Duration::from_secs(20), second).await.unwrap().unwrap();
        assert!(waited, "the second mark returned before the first transaction ended");
        if commit {
            assert!(matches!(mark, Claim::Completed(_)), "after a commit: {mark:?}");
        } else {
            assert!(matches!(mark, Claim::Acquired(_)), "after a rollback the second is first");
        }
    }
}

/// `mark_many` answers in input order, as one `mark` per key would, over fresh, committed,
/// conflicting and leased keys.
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn mark_many_matches_single_marks<H: InboxHarness>(h: H) {
    let inbox = h.inbox();
    let fp = |s: &str| Some(idem_core::Fingerprint::of_bytes(s.as_bytes()));
    for id in ["done", "conflict"] {
        let mut tx = inbox.begin().await.unwrap();
        assert!(matches!(
            inbox.mark(conn::<H>(&mut tx), &key(id), fp("a")).await.unwrap(),
            Claim::Acquired(_)
        ));
        inbox.commit(tx).await.unwrap();
    }
    let req = ClaimRequest::new(key("leased"), None, Duration::from_secs(60), WEEK);
    let Claim::Acquired(_lease) = h.store().claim(&req).await.unwrap() else {
        panic!("a fresh key is acquired")
    };
    let items: Vec<_> =
        [("fresh-1", "a"), ("done", "a"), ("leased", "a"), ("fresh-2", "a"), ("conflict", "b")]
            .iter()
            .map(|(id, f)| (key(id), fp(f)))
            .collect();
    let mut tx = inbox.begin().await.unwrap();
    let marks = inbox.mark_many(conn::<H>(&mut tx), &items).await.unwrap();
    inbox.commit(tx).await.unwrap();
    assert_eq!(marks.len(), items.len());
    assert!(matches!(marks[0], Claim::Acquired(_)), "fresh: {:?}", marks[0]);
    assert!(matches!(marks[1], Claim::Completed(_)), "committed: {:?}", marks[1]);
    assert!(matches!(marks[2], Claim::InProgress { .. }), "leased: {:?}", marks[2]);
    assert!(matches!(marks[3], Claim::Acquired(_)), "fresh: {:?}", marks[3]);
    assert!(matches!(marks[4], Claim::Conflict(_)), "other payload: {:?}", marks[4]);
    let rec = h.store().get(&key("fresh-2")).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Completed);
}

/// `process` (one message, its own transaction) runs the writes once, replays their result, and
/// rolls the marker back with writes that fail.
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn process_writes_once_and_replays_the_result<H: InboxHarness>(h: H) {
    let inbox = h.inbox();
    let k = key("o-1");
    for round in 0..3 {
        let out = inbox
            .process(&k, None, |mut tx| {
                let h = &h;
                async move {
                    h.write(&mut tx, "o-1").await.map_err(HandlerError::transient)?;
                    Ok::<_, HandlerError<sqlx::Error>>(format!("receipt-{round}"))
                }
            })
            .await;
        match (round, out) {
            (0, Outcome::Processed(r)) => assert_eq!(r, "receipt-0"),
            (_, Outcome::Duplicate(Some(r))) => assert_eq!(r, "receipt-0"),
            (r, other) => panic!("round {r}: {other:?}"),
        }
    }
    assert_eq!(h.ledger_rows().await, 1);
    let k2 = key("o-2");
    let out = inbox
        .process(&k2, None, |mut tx| {
            let h = &h;
            async move {
                h.write(&mut tx, "o-2").await.map_err(HandlerError::transient)?;
                Err::<(), HandlerError<sqlx::Error>>(HandlerError::transient(
                    sqlx::Error::Protocol("the writes failed".into()),
                ))
            }
        })
        .await;
    match &out {
        Outcome::Failed(f) => {
            assert_eq!(f.kind, FailureKind::Transient, "{out:?}");
            assert!(matches!(f.cause, Cause::Handler(_)), "{out:?}");
        }
        other => panic!("failed writes: {other:?}"),
    }
    assert!(h.store().get(&k2).await.unwrap().is_none(), "failed writes left a marker");
    assert_eq!(h.ledger_rows().await, 1);
}

/// A handler's result is stored with its marker and replayed to duplicates; a batch's copies of
/// one key run once.
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn result_is_replayed_and_repeats_run_once<H: InboxHarness>(h: H) {
    let h = Arc::new(h);
    let c = engine(&*h);
    let batch = [order("o-1", 5), order("o-2", 7), order("o-1", 5)];
    let outs = decide(&h, &c, &batch).await;
    assert_eq!(
        kinds(&outs),
        [OutcomeKind::Processed, OutcomeKind::Processed, OutcomeKind::Duplicate]
    );
    let Outcome::Processed(first) = &outs[0] else { unreachable!() };
    assert!(matches!(&outs[2], Outcome::Duplicate(Some(r)) if r == first), "{:?}", outs[2]);
    assert_eq!(h.ledger_rows().await, 2);
    let again = decide(&h, &c, &[order("o-2", 7)]).await;
    assert!(matches!(&again[0], Outcome::Duplicate(Some(r)) if r.starts_with("o-2:")), "{again:?}");
    assert_eq!(h.ledger_rows().await, 2);
}

/// A message whose handler fails rolls back alone: the rest of the batch commits, the failed
/// one leaves no marker and no row (transient: retried; permanent: dead-lettered).
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn a_failing_message_rolls_back_alone<H: InboxHarness>(h: H) {
    let h = Arc::new(h);
    let c = engine(&*h);
    let batch = [
        order("ok-1", 1),
        order("fail-t-1", 2),
        order("ok-2", 3),
        order("fail-p-1", 4),
        order("ok-3", 5),
    ];
    let outs = decide(&h, &c, &batch).await;
    assert_eq!(
        kinds(&outs),
        [
            OutcomeKind::Processed,
            OutcomeKind::FailedTransient,
            OutcomeKind::Processed,
            OutcomeKind::FailedPermanent,
            OutcomeKind::Processed,
        ]
    );
    assert_eq!(h.ledger_rows().await, 3, "only the three successes wrote");
    for id in ["fail-t-1", "fail-p-1"] {
        assert!(h.store().get(&key(id)).await.unwrap().is_none(), "{id} left a marker");
    }
    for id in ["ok-1", "ok-2", "ok-3"] {
        let rec = h.store().get(&key(id)).await.unwrap().unwrap();
        assert_eq!(rec.state, RecordState::Completed, "{id}");
    }
    // The redeliveries: the successes are duplicates, the failures run again.
    let outs = decide(&h, &c, &[order("ok-2", 3), order("fail-t-1", 2)]).await;
    assert_eq!(kinds(&outs), [OutcomeKind::Duplicate, OutcomeKind::FailedTransient]);
}

/// Same key, another payload: a conflict, and nothing is written.
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn reused_key_with_other_content_is_a_conflict<H: InboxHarness>(h: H) {
    let h = Arc::new(h);
    let c = engine(&*h);
    decide(&h, &c, &[order("o-9", 1)]).await;
    let outs = decide(&h, &c, &[order("o-9", 2)]).await;
    let Outcome::Conflict(conflict) = &outs[0] else { panic!("{outs:?}") };
    assert_eq!(conflict.key, key("o-9"));
    assert_eq!(h.ledger_rows().await, 1);
}

/// A key a two-phase consumer of the same scope holds under a live lease is in progress
/// elsewhere for the inbox, and nothing is written.
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn a_leased_key_is_in_progress_elsewhere<H: InboxHarness>(h: H) {
    let h = Arc::new(h);
    let c = engine(&*h);
    let req = ClaimRequest::new(key("held"), None, Duration::from_secs(60), WEEK);
    let Claim::Acquired(_lease) = h.store().claim(&req).await.unwrap() else {
        panic!("a fresh key is acquired")
    };
    let outs = decide(&h, &c, &[order("held", 1)]).await;
    assert_eq!(kinds(&outs), [OutcomeKind::InProgressElsewhere]);
    assert_eq!(h.ledger_rows().await, 0);
}

/// Without a key: rejected (dead-lettered) by default; processed without a marker under
/// `ProcessWithoutDedup`.
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn missing_keys_follow_the_policy<H: InboxHarness>(h: H) {
    let h = Arc::new(h);
    let c = engine(&*h);
    let keyless = Message::new(r#"{"cents":1}"#);
    let outs = decide(&h, &c, &[keyless.clone(), order("o-1", 1)]).await;
    assert_eq!(kinds(&outs), [OutcomeKind::FailedPermanent, OutcomeKind::Processed]);
    let lax = Engine::builder(Inbox::new(h.inbox()))
        .scope(SCOPE)
        .missing_key(MissingKeyPolicy::ProcessWithoutDedup)
        .build()
        .unwrap();
    let outs = decide(&h, &lax, &[keyless.clone(), keyless]).await;
    assert_eq!(kinds(&outs), [OutcomeKind::Processed, OutcomeKind::Processed]);
    assert_eq!(h.ledger_rows().await, 3, "keyless messages run every time");
}

/// A result above the consumer's limit is not stored (the duplicate carries none, the delivery
/// still counts); the inbox's own limit refuses a result above 1 MiB with `TooLarge`.
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn result_limit<H: InboxHarness>(h: H) {
    let h = Arc::new(h);
    let c =
        Engine::builder(Inbox::new(h.inbox())).scope(SCOPE).max_result_bytes(8).build().unwrap();
    let outs = decide(&h, &c, &[order("long-result", 1)]).await;
    assert_eq!(kinds(&outs), [OutcomeKind::Processed]);
    let again = decide(&h, &c, &[order("long-result", 1)]).await;
    assert!(matches!(again[0], Outcome::Duplicate(None)), "{again:?}");
    let inbox = h.inbox();
    let mut tx = inbox.begin().await.unwrap();
    assert!(matches!(
        inbox.mark(conn::<H>(&mut tx), &key("huge"), None).await.unwrap(),
        Claim::Acquired(_)
    ));
    let huge = vec![b'x'; (1 << 20) + 1];
    let err = inbox.set_results(conn::<H>(&mut tx), &[(key("huge"), huge)]).await.unwrap_err();
    assert!(matches!(err, idem_core::StoreError::TooLarge { field: "result", .. }), "{err}");
    inbox.rollback(tx).await.unwrap();
}

/// 32 processors over 1,000 keys with 30 % duplicate deliveries, in batches of 8, write each
/// business row exactly once.
///
/// # Cancel safety
/// Dropped midway, its open transactions roll back; what committed stays in the harness's
/// namespace, which the harness drops.
pub async fn concurrent_processors_write_each_key_once<H: InboxHarness>(h: H) {
    let h = Arc::new(h);
    let mut deliveries: Vec<usize> = (0..1000).collect();
    deliveries.extend((0..300).map(|i| (i * 7) % 1000));
    // Interleave duplicates with originals, deterministically.
    deliveries.sort_by_key(|i| (i * 7919) % 1300);
    let queue = Arc::new(std::sync::Mutex::new(deliveries));
    let processed = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (h, queue, processed) = (Arc::clone(&h), Arc::clone(&queue), Arc::clone(&processed));
        tasks.push(tokio::spawn(async move {
            let c = engine(&*h);
            loop {
                let batch: Vec<Message> = {
                    let mut q = queue.lock().unwrap();
                    let n = q.len().min(8);
                    q.drain(..n).map(|i| order(&format!("k-{i}"), 1)).collect()
                };
                if batch.is_empty() {
                    return;
                }
                let mut batch = batch;
                // Transient failures (a lock timeout, a busy database) come back, as a broker
                // would redeliver them.
                while !batch.is_empty() {
                    let outs = decide(&h, &c, &batch).await;
                    let mut retry = Vec::new();
                    for (m, o) in batch.into_iter().zip(outs) {
                        match o.kind() {
                            OutcomeKind::Processed => {
                                processed.fetch_add(1, Ordering::SeqCst);
                            }
                            OutcomeKind::Duplicate => {}
                            OutcomeKind::FailedTransient | OutcomeKind::InProgressElsewhere => {
                                retry.push(m)
                            }
                            other => panic!("unexpected outcome {other}: {o:?}"),
                        }
                    }
                    batch = retry;
                }
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t).await.unwrap().unwrap();
    }
    assert_eq!(processed.load(Ordering::SeqCst), 1000);
    assert_eq!(h.ledger_rows().await, 1000);
}

/// Runs every inbox conformance case. The argument is a closure returning a future of
/// `Option<harness>` (`None`: the server is unreachable, and [`service::require`](crate::service::require)
/// has printed `skipped: …`, or panicked under `CI=true`), one fresh namespace per case.
///
/// ```no_run
/// # struct MyHarness;
/// # async fn my_harness() -> Option<MyHarness> { None }
/// // idem_testkit::tx_inbox_conformance!(|| my_harness());
/// ```
#[macro_export]
macro_rules! tx_inbox_conformance {
    ($make:expr) => {
        $crate::__inbox_cases!($make;
            rollback_leaves_no_marker,
            concurrent_mark_waits_then_sees_the_outcome,
            mark_many_matches_single_marks,
            process_writes_once_and_replays_the_result,
            result_is_replayed_and_repeats_run_once,
            a_failing_message_rolls_back_alone,
            reused_key_with_other_content_is_a_conflict,
            a_leased_key_is_in_progress_elsewhere,
            missing_keys_follow_the_policy,
            result_limit,
            concurrent_processors_write_each_key_once,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __inbox_cases {
    ($make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some(harness) = ($make)().await else { return };
                $crate::inbox::$name(harness).await;
            }
        )+
    };
}
