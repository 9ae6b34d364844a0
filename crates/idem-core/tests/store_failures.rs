//! A store that cannot work is loud: the builder refuses one whose check fails, and a batch that
//! fails entirely on the store puts the first error in the report and logs a warning.
//!
//! A binary of its own: it captures the warning with a thread-local subscriber, and `tracing`
//! caches callsite interest process-wide (tests of other files on threads without one could
//! make it miss the event).
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::consumer::{BuildError, MemoryQueue};
use idem_core::engine::HandlerError;
use idem_core::{Claim, ClaimRequest, Consumer, DedupStore, FailKind, Lease, StoreError};

const MISSING: &str = "relation \"shop\".\"idem_records\" does not exist";

/// A store whose every call fails as a store without its table does; its check says so too
/// when `checked` is set.
struct Unmigrated {
    checked: bool,
}

fn missing(op: &'static str) -> StoreError {
    StoreError::backend(op, false, MISSING)
}

impl DedupStore for Unmigrated {
    async fn claim(&self, _: &ClaimRequest) -> Result<Claim, StoreError> {
        Err(missing("claim"))
    }
    async fn claim_many(&self, _: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        Err(missing("claim_many"))
    }
    async fn complete(&self, _: Lease, _: Option<&[u8]>, _: Duration) -> Result<(), StoreError> {
        Err(missing("complete"))
    }
    async fn fail(&self, _: Lease, _: FailKind, _: &str, _: Duration) -> Result<(), StoreError> {
        Err(missing("fail"))
    }
    async fn release(&self, _: Lease) -> Result<(), StoreError> {
        Err(missing("release"))
    }
    async fn extend(&self, _: &mut Lease, _: Duration) -> Result<(), StoreError> {
        Err(missing("extend"))
    }
    async fn purge(&self, _: usize) -> Result<u64, StoreError> {
        Err(missing("purge"))
    }
    async fn check(&self) -> Result<Vec<String>, StoreError> {
        if !self.checked {
            return Ok(Vec::new());
        }
        Err(StoreError::NotMigrated {
            table: "\"shop\".\"idem_records\"".into(),
            problem: "does not exist".into(),
            migrate: "PostgresStore::migrate()",
        })
    }
}

#[tokio::test]
async fn the_builder_refuses_a_store_whose_check_fails_and_names_the_migration() {
    let e = Consumer::builder(MemoryQueue::new())
        .store(Unmigrated { checked: true })
        .scope("billing")
        .build()
        .await
        .unwrap_err();
    assert!(matches!(e, BuildError::Store(StoreError::NotMigrated { .. })), "{e:?}");
    assert_eq!(
        e.to_string(),
        "the store is not ready: table \"shop\".\"idem_records\" does not exist: run \
         PostgresStore::migrate() once (or apply the DDL it runs) before starting a consumer"
    );
}

/// Log lines written by the `fmt` subscriber, for asserting on warnings.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_batch_failing_on_the_store_reports_the_first_error_and_warns() {
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let q = MemoryQueue::new();
    for id in ["o-1", "o-2", "o-3"] {
        q.push(id, "{}");
    }
    let c = Consumer::builder(q.clone())
        .store(Unmigrated { checked: false })
        .scope("billing")
        .idle_wait(Duration::from_millis(20))
        .build()
        .await
        .unwrap();
    let report = c.poll(|_, _| async { Ok::<_, HandlerError<String>>(()) }).await.unwrap();
    assert_eq!((report.failed_transient, report.retried), (3, 3), "{report}");
    let first = report.first_store_error.clone().unwrap();
    assert!(first.contains(MISSING), "{first}");
    assert!(report.to_string().contains(&format!("; first store error: {first}")), "{report}");

    let logged = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
    assert!(
        logged.contains("WARN")
            && logged.contains("every message of the batch failed on the store")
            && logged.contains(MISSING),
        "{logged}"
    );

    // Summed over a run, the first error stays.
    let mut total = idem_core::consumer::Report::default();
    total += report.clone();
    total += idem_core::consumer::Report::default();
    assert_eq!(total.first_store_error, report.first_store_error);
}
