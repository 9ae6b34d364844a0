//! The WAL outbox on the real PostgreSQL (needs `wal_level = logical`; `.ci/services.sh` sets
//! it): commit order, rollbacks, broker refusals, one relay per slot, the slot's lag.
#![cfg(feature = "postgres")]
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use crate::common;

use std::time::Duration;

use idem_core::outbox::{Outgoing, RecordingPublisher};
use idem_sqlx::postgres::{PostgresWalOutbox, WalRelay, WalRelayError};
use sqlx::postgres::PgPool;

/// A WAL outbox with its own slot and prefix, dropped when the guard goes; `None` (skipped)
/// when PostgreSQL is unreachable or not logical — a failure instead under `CI=true`.
async fn wal_outbox() -> Option<(PostgresWalOutbox, common::DropSql)> {
    let url = common::pg_url()?;
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(4).connect(&url).await.unwrap();
    let level: String = sqlx::query_scalar("SHOW wal_level").fetch_one(&pool).await.unwrap();
    if level != "logical" {
        assert!(
            !idem_testkit::service::in_ci(),
            "wal_level is {level} and CI=true: run .ci/services.sh up (it sets wal_level = logical)"
        );
        eprintln!("skipped: PostgreSQL wal_level is {level}, the WAL outbox needs logical");
        return None;
    }
    let slot = common::unique("idem_wal");
    let outbox = PostgresWalOutbox::new(pool)
        .with_slot_name(&slot)
        .unwrap()
        .with_prefix(&format!("p_{slot}"))
        .unwrap();
    outbox.create_slot().await.unwrap();
    outbox.create_slot().await.unwrap(); // idempotent
    let guard = common::DropSql {
        url,
        sql: format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = '{slot}'; DROP PUBLICATION IF EXISTS \"{slot}\""
        ),
    };
    Some((outbox, guard))
}

fn payloads(broker: &RecordingPublisher) -> Vec<String> {
    broker.published().iter().map(|m| String::from_utf8_lossy(m.payload()).into_owned()).collect()
}

fn relay(outbox: &PostgresWalOutbox, broker: &RecordingPublisher) -> WalRelay<RecordingPublisher> {
    WalRelay::builder(outbox.clone(), broker.clone())
        .batch(16) // several peeks for the tests' handful of transactions
        .backoff(Duration::ZERO, Duration::ZERO)
        .build()
        .unwrap()
}

async fn enqueue(outbox: &PostgresWalOutbox, pool: &PgPool, names: &[&str]) {
    let mut tx = pool.begin().await.unwrap();
    for n in names {
        outbox.enqueue(&mut tx, Outgoing::new("q", *n).header("k", "v")).await.unwrap();
    }
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_are_relayed_in_commit_order() {
    let Some((outbox, _guard)) = wal_outbox().await else { return };
    let pool = outbox.pool().clone();
    // `late` starts first and commits last: commit order, not enqueue order, is what counts.
    let mut late = pool.begin().await.unwrap();
    outbox.enqueue(&mut late, Outgoing::new("q", "late-1")).await.unwrap();
    enqueue(&outbox, &pool, &["a-1", "a-2", "a-3"]).await;
    outbox.enqueue(&mut late, Outgoing::new("q", "late-2")).await.unwrap();
    for i in 0..10 {
        enqueue(&outbox, &pool, &[&format!("b-{i}")]).await;
    }
    late.commit().await.unwrap();
    let broker = RecordingPublisher::new();
    let report = relay(&outbox, &broker).run_until_empty().await.unwrap();
    let mut want = vec!["a-1".to_owned(), "a-2".into(), "a-3".into()];
    want.extend((0..10).map(|i| format!("b-{i}")));
    want.extend(["late-1".to_owned(), "late-2".into()]);
    assert_eq!(payloads(&broker), want);
    assert_eq!(report.published, 15, "{report}");
    assert!(report.batches >= 2, "several peeks: {report}");
    let m = &broker.published()[0];
    assert_eq!((m.destination(), m.headers()), ("q", &[("k".to_owned(), "v".to_owned())][..]));
    // Advanced: a second run finds nothing.
    let again = RecordingPublisher::new();
    assert_eq!(relay(&outbox, &again).run_until_empty().await.unwrap().published, 0);
    assert!(again.published().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_transaction_emits_nothing() {
    let Some((outbox, _guard)) = wal_outbox().await else { return };
    let pool = outbox.pool().clone();
    let mut tx = pool.begin().await.unwrap();
    outbox.enqueue(&mut tx, Outgoing::new("q", "never")).await.unwrap();
    tx.rollback().await.unwrap();
    enqueue(&outbox, &pool, &["kept"]).await;
    let broker = RecordingPublisher::new();
    relay(&outbox, &broker).run_until_empty().await.unwrap();
    assert_eq!(payloads(&broker), ["kept"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_publish_does_not_advance_the_slot() {
    let Some((outbox, _guard)) = wal_outbox().await else { return };
    let pool = outbox.pool().clone();
    enqueue(&outbox, &pool, &["m-1", "m-2"]).await;
    enqueue(&outbox, &pool, &["m-3"]).await;
    let broker = RecordingPublisher::new();
    broker.fail_next(1, true);
    let stuck = WalRelay::builder(outbox.clone(), broker.clone())
        .max_attempts(1)
        .build()
        .unwrap()
        .run_until_empty()
        .await;
    assert!(matches!(stuck, Err(WalRelayError::Stuck { attempts: 1, .. })), "{stuck:?}");
    // Retried: the first transaction whole, again, then the second.
    let report = relay(&outbox, &broker).run_until_empty().await.unwrap();
    assert_eq!(report.published, 3, "{report}");
    let got = payloads(&broker);
    assert_eq!(&got[got.len() - 3..], ["m-1", "m-2", "m-3"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_per_slot() {
    let Some((outbox, _guard)) = wal_outbox().await else { return };
    let pool = outbox.pool().clone();
    enqueue(&outbox, &pool, &["x"]).await;
    let broker = RecordingPublisher::new();
    // A first relay runs (and holds the slot) until told to stop.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let first = relay(&outbox, &broker);
    let running = tokio::spawn(async move {
        first
            .run(async move {
                let _ = stopped.await;
            })
            .await
    });
    idem_testkit::wait_for("the first relay published", Duration::from_secs(10), || async {
        !broker.published().is_empty()
    })
    .await;
    let second = relay(&outbox, &RecordingPublisher::new()).run_until_empty().await;
    assert!(matches!(second, Err(WalRelayError::Busy { .. })), "{second:?}");
    stop.send(()).unwrap();
    assert_eq!(running.await.unwrap().unwrap().published, 1);
    // Released with its connection: the slot is free again.
    assert!(relay(&outbox, &RecordingPublisher::new()).run_until_empty().await.is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lag_grows_with_unrelayed_messages_and_falls_when_relayed() {
    let Some((outbox, _guard)) = wal_outbox().await else { return };
    let pool = outbox.pool().clone();
    let before = outbox.lag_bytes().await.unwrap().unwrap();
    let big = "x".repeat(10_000);
    enqueue(&outbox, &pool, &[&big, &big, &big]).await;
    let held = outbox.lag_bytes().await.unwrap().unwrap();
    assert!(held >= before + 30_000, "{before} → {held}");
    relay(&outbox, &RecordingPublisher::new()).run_until_empty().await.unwrap();
    let after = outbox.lag_bytes().await.unwrap().unwrap();
    assert!(after < 30_000, "relayed, yet the slot holds {after} bytes");
    let gone = outbox.clone().with_slot_name("idem_wal_no_such_slot").unwrap();
    assert_eq!(gone.lag_bytes().await.unwrap(), None);
    let e = relay(&gone, &RecordingPublisher::new()).run_until_empty().await.unwrap_err();
    assert!(idem_core::ErrorChain(&e).to_string().contains("does not exist"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_slot_is_idempotent() {
    let Some((outbox, _guard)) = wal_outbox().await else { return };
    outbox.drop_slot().await.unwrap();
    outbox.drop_slot().await.unwrap();
    assert_eq!(outbox.lag_bytes().await.unwrap(), None);
}
