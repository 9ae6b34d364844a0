//! Idempotent jobs: at most once per period, overlapping runs wait or skip, a crashed run is
//! taken over after its lease. Time is tokio's paused clock, read by the store too.

// Helpers shared by the #[tokio::test]s are not themselves tests, so clippy's test exemption
// does not reach them.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_core::engine::{Context, HandlerError};
use idem_core::job::{Job, Overlap};
use idem_core::time::TokioClock;
use idem_core::{MemoryStore, Outcome};
use tokio::sync::{Notify, oneshot};

type Run = Outcome<String, String>;

fn store() -> MemoryStore {
    MemoryStore::with_clock(TokioClock::new())
}

#[tokio::test(start_paused = true)]
async fn overlapping_second_run_skips_and_the_period_runs_once() {
    let job = Job::builder(store(), "nightly-invoices").build().unwrap();
    let runs = AtomicU32::new(0);
    let entered = Notify::new();
    let (finish, finished) = oneshot::channel::<()>();
    let first = async {
        job.run("2026-12-02", |_ctx: Context| async {
            runs.fetch_add(1, Ordering::SeqCst);
            entered.notify_one();
            finished.await.unwrap();
            Ok::<_, HandlerError<String>>("120 invoices".to_owned())
        })
        .await
    };
    let second = async {
        entered.notified().await;
        let r: Run = job
            .run("2026-12-02", |_| async { panic!("an overlapping run must not run the job") })
            .await;
        finish.send(()).unwrap();
        r
    };
    let (first, second) = tokio::join!(first, second);
    assert!(matches!(first, Outcome::Processed(ref s) if s == "120 invoices"), "{first:?}");
    assert!(matches!(second, Outcome::InProgressElsewhere { .. }), "{second:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The scheduler fires again for the same period: the stored result, no run.
    let third: Run = job.run("2026-12-02", |_| async { panic!("period already done") }).await;
    assert!(matches!(third, Outcome::Duplicate(Some(ref s)) if s == "120 invoices"), "{third:?}");
    // The next period is a new run.
    let next: Run = job.run("2026-12-03", |_| async { Ok("7 invoices".to_owned()) }).await;
    assert!(matches!(next, Outcome::Processed(_)));
}

#[tokio::test(start_paused = true)]
async fn overlapping_second_run_waits_for_the_first_and_gets_its_result() {
    let overlap = Overlap::Wait { poll: Duration::from_secs(1), timeout: Duration::from_secs(600) };
    let job = Job::builder(store(), "etl").overlap(overlap).build().unwrap();
    let entered = Notify::new();
    let (finish, finished) = oneshot::channel::<()>();
    let first = async {
        job.run("batch-17", |_ctx: Context| async {
            entered.notify_one();
            finished.await.unwrap();
            Ok::<_, HandlerError<String>>("loaded".to_owned())
        })
        .await
    };
    let second = async {
        entered.notified().await;
        let waiting = job.run("batch-17", |_| async { panic!("the waiting run must not run") });
        let release = async {
            // Let the waiting run poll a few times, then finish the first.
            tokio::time::sleep(Duration::from_secs(5)).await;
            finish.send(()).unwrap();
        };
        let (r, ()): (Run, ()) = tokio::join!(waiting, release);
        r
    };
    let (first, second) = tokio::join!(first, second);
    assert!(matches!(first, Outcome::Processed(_)), "{first:?}");
    assert!(matches!(second, Outcome::Duplicate(Some(ref s)) if s == "loaded"), "{second:?}");
}

#[tokio::test(start_paused = true)]
async fn waiting_gives_up_after_its_timeout() {
    let overlap = Overlap::Wait { poll: Duration::from_secs(1), timeout: Duration::from_secs(10) };
    let job = Job::builder(store(), "report").overlap(overlap).build().unwrap();
    let hung = tokio::time::timeout(
        Duration::from_secs(1),
        job.run("q4", |_| std::future::pending::<Result<String, HandlerError<String>>>()),
    );
    assert!(hung.await.is_err());
    let started = tokio::time::Instant::now();
    let r: Run = job.run("q4", |_| async { panic!("held by the hung run") }).await;
    assert!(matches!(r, Outcome::InProgressElsewhere { .. }), "{r:?}");
    assert_eq!(started.elapsed(), Duration::from_secs(10));
}

#[tokio::test(start_paused = true)]
async fn crashed_run_is_taken_over_after_its_lease() {
    let job =
        Job::builder(store(), "nightly-invoices").lease(Duration::from_secs(60)).build().unwrap();
    // The first run crashes mid-job: its future is dropped with the lease held.
    let crashed = tokio::time::timeout(
        Duration::from_secs(5),
        job.run("2026-12-02", |_| std::future::pending::<Result<String, HandlerError<String>>>()),
    );
    assert!(crashed.await.is_err());
    // Within the lease, the next run skips.
    let early: Run = job.run("2026-12-02", |_| async { panic!("lease still live") }).await;
    assert!(matches!(early, Outcome::InProgressElsewhere { .. }), "{early:?}");
    tokio::time::advance(Duration::from_secs(56)).await;
    // After it, the next run takes over, told it may repeat the crashed run's effects.
    let seen = Arc::new(std::sync::Mutex::new(None));
    let s = Arc::clone(&seen);
    let taken: Run = job
        .run("2026-12-02", |ctx: Context| async move {
            let downstream = ctx.downstream_key().map(str::to_owned);
            *s.lock().unwrap() = Some((ctx.attempt(), ctx.took_over_expired(), downstream));
            Ok("sent on takeover".to_owned())
        })
        .await;
    assert!(matches!(taken, Outcome::Processed(_)), "{taken:?}");
    let (attempt, took_over, downstream) = seen.lock().unwrap().clone().unwrap();
    assert_eq!((attempt, took_over), (2, true));
    assert!(downstream.is_some_and(|k| k.starts_with("idem-")));
}

#[tokio::test(start_paused = true)]
async fn transient_failure_releases_the_period_for_the_next_run() {
    let job = Job::builder(store(), "sync").build().unwrap();
    let failed: Run = job
        .run("hour-09", |_| async { Err(HandlerError::Transient("upstream 503".to_owned())) })
        .await;
    assert!(matches!(failed, Outcome::Failed(_)), "{failed:?}");
    let retried: Run = job
        .run("hour-09", |ctx: Context| async move { Ok(format!("attempt {}", ctx.attempt())) })
        .await;
    assert!(matches!(retried, Outcome::Processed(ref s) if s == "attempt 2"), "{retried:?}");
}
