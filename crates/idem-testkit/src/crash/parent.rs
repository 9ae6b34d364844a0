//! The crash suite's parent: starts and kills the children, drains the rest, checks the
//! ledger.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure is the test failing

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::OutcomeKind;
use idem_core::consumer::{Report, headers};
use idem_core::extract::Envelope;
use tokio::io::AsyncBufReadExt;

use super::*;

pub(super) type Outcomes = Arc<Mutex<Vec<(String, OutcomeKind)>>>;

/// Runs `consumers` survivors until every order has its effect and the broker is settled;
/// their hooks record every outcome.
pub(super) async fn drain<H: CrashHarness>(
    h: &H,
    files: &Files,
    ledger: &Ledger,
    outcomes: &Outcomes,
    consumers: usize,
) -> Report {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let survivors = (0..consumers).map(|_| {
        let (outcomes, mut stopped) = (Arc::clone(outcomes), stopped.clone());
        let hook: Hook<DeliveryOf<H>> = Box::new(move |s| {
            let key = s.message.message_id().unwrap_or_default().to_owned();
            outcomes.lock().unwrap().push((key, s.outcome));
        });
        let shutdown = async move {
            let _ = stopped.wait_for(|s| *s).await;
        };
        consume(h, files, Role::Survivor, hook, Arc::new(|_, _| false), shutdown)
    });
    let watch = async {
        let mut watchdog = Watchdog::default();
        loop {
            let effects = ledger.effects().await;
            let (distinct, rows) = (effects.len(), effects.values().sum::<i64>());
            let settled = h.settled().await;
            if distinct == ORDERS && settled {
                break;
            }
            if watchdog.stalled((distinct, rows, finished(outcomes), settled)) {
                let missing: Vec<String> = (0..ORDERS)
                    .map(|i| format!("o-{i}"))
                    .filter(|k| !effects.contains_key(k))
                    .take(12)
                    .collect();
                panic!(
                    "no progress for {STALL:?}: {distinct} orders, {rows} rows, settled: {settled}; \
                     outcomes {}; missing e.g. {missing:?}; broker: {}",
                    tally(outcomes),
                    h.describe().await
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        stop.send(true).unwrap();
    };
    let (reports, ()) = tokio::join!(futures_util::future::join_all(survivors), watch);
    let mut all = Report::default();
    reports.into_iter().for_each(|r| all += r);
    all
}

/// Tells a wait that still makes progress from one that stopped: fed the state it watches on
/// every poll, it answers `true` once that state has not changed for [`STALL`].
pub(super) struct Watchdog<T> {
    last: Option<T>,
    since: tokio::time::Instant,
}

impl<T> Default for Watchdog<T> {
    fn default() -> Self {
        Self { last: None, since: tokio::time::Instant::now() }
    }
}

impl<T: PartialEq> Watchdog<T> {
    fn stalled(&mut self, now: T) -> bool {
        if self.last.as_ref() != Some(&now) {
            (self.last, self.since) = (Some(now), tokio::time::Instant::now());
        }
        self.since.elapsed() > STALL
    }
}

/// How many outcomes settled a message for good (processed, duplicate, dead-lettered).
pub(super) fn finished(outcomes: &Outcomes) -> usize {
    let done = |k: &OutcomeKind| {
        !matches!(k, OutcomeKind::InProgressElsewhere | OutcomeKind::FailedTransient)
    };
    outcomes.lock().unwrap().iter().filter(|(_, k)| done(k)).count()
}

/// The outcomes so far, counted by kind.
pub(super) fn tally(outcomes: &Outcomes) -> String {
    let all = outcomes.lock().unwrap();
    OutcomeKind::ALL
        .iter()
        .map(|k| format!("{} {}", k.as_str(), all.iter().filter(|(_, o)| o == k).count()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The name of the child entry [`crash_conformance!`](crate::crash_conformance) defines in the
/// module `module_path` (as `module_path!()` gives it: the test binary's name first).
#[must_use]
pub fn entry(module_path: &str) -> String {
    crate::process::child_entry(module_path, "crash_child")
}

/// The scenario (see the module docs) on a fresh destination of `h`, the store's records in
/// `records`; `entry` is the name of the test that runs [`child`] in this binary.
///
/// # Panics
/// When a promise does not hold (the test failing), or when PostgreSQL is unreachable under
/// `CI=true` (locally the case is skipped).
///
/// # Cancel safety
/// Dropped midway, the children are killed with their handles and the PostgreSQL schema is
/// dropped; what was published stays on the harness's destination until the harness is dropped.
pub async fn scenario<H: CrashHarness>(h: H, mode: Mode, records: Records, entry: &str) {
    crate::process::log_from_env();
    let dir = tempfile::tempdir().unwrap();
    let Some((files, _drop)) = Files::create(mode, records, dir.path(), "idem_crash").await else {
        return;
    };
    let ledger = files.ledger().await;
    ledger.create().await;
    for i in 0..ORDERS {
        h.publish(&format!("o-{i}"), format!(r#"{{"order":{i}}}"#).as_bytes()).await;
    }
    for i in (0..ORDERS).step_by(ORDERS / RETRIES) {
        h.publish(&format!("o-{i}"), format!(r#"{{"order":{i}}}"#).as_bytes()).await;
    }
    h.publish(REUSED, br#"{"order":"other"}"#).await;

    // 1. Abort between commit and ack.
    let aborted = run_child(entry, &h, "abort", &files, None).await;
    let committed: HashSet<String> =
        aborted.iter().filter_map(|l| l.strip_prefix("COMMITTED ")).map(str::to_owned).collect();
    assert_eq!(committed.len(), ABORT_AFTER, "{aborted:?}");
    // 2. SIGKILL mid-handler.
    let hung = run_child(entry, &h, "hang", &files, Some("HUNG ")).await;
    let hung_key = hung.last().and_then(|l| l.strip_prefix("HUNG ")).expect("hung key").to_owned();
    // 3. A connection cut mid-handler: the consumer is dropped while a handler is inside it,
    //    before its effect (a cut after the effect would be the two-phase rerun case).
    let (cut_tx, cut_rx) = tokio::sync::oneshot::channel::<String>();
    let cut_tx = Mutex::new(Some(cut_tx));
    let started: Started = Arc::new(move |key, run| {
        let cut = run == CUT_AT;
        if cut && let Some(tx) = cut_tx.lock().unwrap().take() {
            let _ = tx.send(key.to_owned());
        }
        cut
    });
    let cut = consume(&h, &files, Role::Cut, Box::new(|_| {}), started, std::future::pending());
    let cut_key = tokio::select! {
        _ = cut => panic!("the cut consumer stopped on its own"),
        key = cut_rx => key.expect("cut key"),
    };

    // 4. Two survivors drain; their hooks record every outcome. A consumer that stops gives
    //    back what it had fetched ahead (a broker that counts only ready messages saw none),
    //    so until the broker is settled after they stop, another one drains again.
    let outcomes: Outcomes = Arc::default();
    let mut report = drain(&h, &files, &ledger, &outcomes, 2).await;
    while !h.settled().await {
        report += drain(&h, &files, &ledger, &outcomes, 1).await;
    }

    // Exactly once: one effect per order, the hung and the cut orders included.
    let effects = ledger.effects().await;
    assert_eq!(effects.len(), ORDERS, "{report}");
    let twice: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "effects not exactly once: {twice:?}; {report}");

    // The aborted deliveries came back and were found done.
    let outcomes = std::mem::take(&mut *outcomes.lock().unwrap());
    for key in &committed {
        let kinds: Vec<_> = outcomes.iter().filter(|(k, _)| k == key).map(|o| o.1).collect();
        assert!(!kinds.contains(&OutcomeKind::Processed), "{key} processed twice: {kinds:?}");
    }
    // Found done by the survivors or by the hanging child (which a broker that keeps order per
    // partition hands them first).
    let found_done: HashSet<&str> = outcomes
        .iter()
        .filter(|(_, o)| *o == OutcomeKind::Duplicate)
        .map(|(k, _)| k.as_str())
        .chain(hung.iter().filter_map(|l| l.strip_prefix("DUPLICATE ")))
        .collect();
    assert!(
        committed.iter().any(|k| found_done.contains(k.as_str())),
        "no aborted delivery came back as a duplicate"
    );
    // The hung and the cut keys were processed afterwards: in two-phase mode as takeovers of
    // the dead consumers' leases.
    for key in [&hung_key, &cut_key] {
        assert_eq!(effects.get(key), Some(&1), "{key}");
        if mode == Mode::TwoPhase {
            assert!(ledger.took_over(key).await, "{key} was not taken over after its lease");
        }
    }

    // The reused id is dead-lettered, once or twice, with the shared headers.
    let dead = h.dead_letters().await;
    assert!((1..=2).contains(&dead.len()), "{} dead letters: {dead:?}", dead.len());
    assert!(dead.iter().all(|d| d.message_id.as_deref() == Some(REUSED)), "{dead:?}");
    assert_eq!(dead[0].headers.get(headers::OUTCOME).map(String::as_str), Some("conflict"));
    assert!(h.settled().await, "something was left unsettled");
    h.cleanup().await;
}

/// The crash-loop scenario on a fresh destination of `h`, in `mode` with the records in
/// `records`: 200 orders with one poison message among them, whose handler calls
/// `std::process::abort()`. A supervisor starts a consumer process again each time one dies, as
/// a service manager would. Passes when the processes died exactly three times (the crash-loop
/// limit these consumers run with), the poison message was dead-lettered with a `crash loop`
/// reason naming the deaths, every other order's effect happened (two-phase: repeats only as
/// reruns under a later attempt after a takeover, never twice under one attempt; inbox: exactly
/// once), nothing else was dead-lettered and nothing is left unsettled.
///
/// In inbox mode the first death leaves no trace (first deliveries write no note): the
/// redeliveries run one at a time under crash notes, and the note's first run counts it.
///
/// # Panics
/// When a promise does not hold (the test failing), or when PostgreSQL is unreachable under
/// `CI=true` (locally the case is skipped).
///
/// # Cancel safety
/// Dropped midway, the running child is killed with its handle and the PostgreSQL schema is
/// dropped.
pub async fn poison<H: CrashHarness>(h: H, mode: Mode, records: Records, entry: &str) {
    crate::process::log_from_env();
    let dir = tempfile::tempdir().unwrap();
    let Some((files, _drop)) = Files::create(mode, records, dir.path(), "idem_poison").await else {
        return;
    };
    let ledger = files.ledger().await;
    ledger.create().await;
    for i in 0..POISON_ORDERS {
        if i == POISON_ORDERS / 10 {
            h.publish(POISON, br#"{"order":"poison"}"#).await;
        }
        h.publish(&format!("o-{i}"), format!(r#"{{"order":{i}}}"#).as_bytes()).await;
    }
    let spec = files.child_spec("poison", &h.spec());
    let mut watchdog = Watchdog::default();
    let mut crashes = 0;
    let mut printed = Vec::new();
    // Some harnesses take the dead letters they read: keep every copy seen.
    let dead = Mutex::new(Vec::new());
    loop {
        let mut child = crate::process::spawn_child(entry, &[(CHILD_ENV, &spec)]);
        let out = child.stdout.take().expect("stdout");
        let lines = tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(out).lines();
            let mut seen = Vec::new();
            while let Ok(Some(l)) = lines.next_line().await {
                seen.push(l.rsplit("... ").next().unwrap_or(&l).to_owned());
            }
            seen
        });
        // Until the child dies, or everything is settled with the poison dead-lettered.
        let (watchdog, crashes_so_far) = (&mut watchdog, crashes);
        let drained = async {
            let crashes = crashes_so_far;
            loop {
                let effects = ledger.effects().await.len();
                let (mut seen, mut settled) = (false, false);
                if effects == POISON_ORDERS {
                    let copies = h.dead_letters().await;
                    seen = {
                        let mut dead = dead.lock().unwrap();
                        dead.extend(copies);
                        !dead.is_empty()
                    };
                    settled = h.settled().await;
                    if seen && settled {
                        return;
                    }
                }
                if watchdog.stalled((effects, crashes, seen, settled)) {
                    panic!(
                        "no progress for {STALL:?}: {effects} of {POISON_ORDERS} orders, \
                         {crashes} crashes, dead letter seen: {seen}, settled: {settled}; \
                         broker: {}",
                        h.describe().await
                    );
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::select! {
            status = child.wait() => {
                assert!(!status.unwrap().success(), "a consumer ended by itself");
                crashes += 1;
                printed.extend(lines.await.unwrap());
                assert!(crashes <= POISON_LIMIT + 2, "{crashes} crashes: {printed:?}");
            }
            () = drained => {
                child.kill().await.unwrap();
                printed.extend(lines.await.unwrap());
                break;
            }
        }
    }
    let aborts = printed.iter().filter(|l| l.starts_with("ABORT ")).count();
    assert_eq!(
        (crashes, aborts),
        (POISON_LIMIT, POISON_LIMIT as usize),
        "the processes died once per attempt up to the limit: {printed:?}"
    );
    assert!(printed.iter().any(|l| l == &format!("DEAD {POISON}")), "{printed:?}");
    // Only the poison message was dead-lettered, with the crash loop and its attempts as the
    // reason.
    let dead = dead.into_inner().unwrap();
    assert!(!dead.is_empty());
    for d in &dead {
        assert_eq!(d.message_id.as_deref(), Some(POISON), "{dead:?}");
        let reason = d.headers.get(headers::REASON).map(String::as_str).unwrap_or_default();
        let want = format!("crash loop: {POISON_LIMIT} deaths");
        assert!(reason.contains(&want), "reason {reason:?} lacks {want:?}");
    }
    // Every other order's effect happened; a repeat is a rerun after a takeover (the process
    // died between an effect and its completion), never the same attempt twice.
    let effects = ledger.effects().await;
    assert!(!effects.contains_key(POISON), "the poison handler made its effect");
    assert_eq!(effects.len(), POISON_ORDERS);
    let twice: Vec<_> = ledger.attempts().await.into_iter().filter(|(_, n)| *n > 1).collect();
    assert!(twice.is_empty(), "effects repeated under one attempt: {twice:?}");
    if mode == Mode::Inbox {
        let twice: Vec<_> = effects.iter().filter(|(_, n)| **n != 1).collect();
        assert!(twice.is_empty(), "effects not exactly once: {twice:?}");
    }
    assert!(h.settled().await, "something was left unsettled");
    h.cleanup().await;
}
