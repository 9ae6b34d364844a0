//! The store timeout: a store call, or an inbox batch's transaction, that never answers (a
//! connection a network partition left half-open) is given up as a transient failure, never
//! waited on for ever, and nothing of it is left behind.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_core::engine::{FailureKind, HandlerError};
use idem_core::extract::{Envelope, LogPosition, Message};
use idem_core::inbox::{Inbox, OffsetInbox, Tx};
use idem_core::{Engine, MemoryStore, Outcome, OutcomeKind};
use idem_sqlx::{SqliteInbox, SqliteStore};
use idem_testkit::faults::{FaultyStore, Op};

type Out = Outcome<String, String>;
type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

fn order(id: &str) -> Message {
    Message::new(format!(r#"{{"order_id":"{id}"}}"#)).with_message_id(id)
}

#[tokio::test(start_paused = true)]
async fn a_claim_that_never_answers_is_given_up_after_the_store_timeout() {
    let store = FaultyStore::new(MemoryStore::new());
    let engine = Engine::builder(store.clone())
        .scope("orders")
        .store_timeout(Duration::from_secs(10))
        .build()
        .unwrap();
    store.hang_next(Op::Claim, 1);
    let runs = Arc::new(AtomicU32::new(0));
    let handler = |runs: Arc<AtomicU32>| {
        move |_ctx| {
            runs.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok::<_, HandlerError<String>>("charged".to_owned()))
        }
    };
    let started = tokio::time::Instant::now();
    let out: Out = engine.process(&order("o-1"), handler(Arc::clone(&runs))).await;
    assert_eq!(started.elapsed(), Duration::from_secs(10));
    let Outcome::Failed(f) = &out else { panic!("{out:?}") };
    assert_eq!(f.kind, FailureKind::Transient);
    assert!(
        f.cause.to_string().contains("no answer within the store timeout (10s)"),
        "{}",
        f.cause
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0, "the handler ran without a claim");
    // The redelivery finds the store answering again.
    let out: Out = engine.process(&order("o-1"), handler(Arc::clone(&runs))).await;
    assert!(matches!(out, Outcome::Processed(_)), "{out:?}");
}

/// An inbox batch whose handler's statement never answers: the whole transaction is given up
/// after the store timeout, its messages are transient failures, and neither the handler's
/// writes nor the markers are left (the redelivery processes them).
#[tokio::test]
async fn an_inbox_transaction_that_never_answers_is_given_up_and_leaves_nothing() {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let file = std::env::temp_dir().join(format!("idem-timeout-{}.sqlite", nanos.as_nanos()));
    let _gone = Remove(file.clone());
    let store = SqliteStore::open(&file).await.unwrap();
    sqlx::raw_sql("CREATE TABLE ledger (k TEXT NOT NULL)").execute(store.pool()).await.unwrap();
    let engine: Engine<Inbox<SqliteInbox>> =
        Engine::builder(Inbox::new(store.inbox(Duration::from_secs(86_400))))
            .scope("orders")
            .store_timeout(Duration::from_millis(300))
            .build()
            .unwrap();
    let msgs = [order("o-1"), order("o-2")];
    let handler = ledger_writer("o-2");
    let given_up =
        tokio::time::timeout(Duration::from_secs(30), engine.decide_batch(&msgs, &handler));
    let outs: Vec<Out> = given_up.await.expect("the transaction was waited on for ever");
    assert!(outs.iter().all(|o| o.kind() == OutcomeKind::FailedTransient), "{outs:?}");
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger").fetch_one(store.pool()).await.unwrap();
    assert_eq!(rows, 0, "the given-up transaction left writes behind");
    // The redelivery runs both, once.
    let outs: Vec<Out> = engine.decide_batch(&msgs, &handler).await;
    assert!(outs.iter().all(|o| o.kind() == OutcomeKind::Processed), "{outs:?}");
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger").fetch_one(store.pool()).await.unwrap();
    assert_eq!(rows, 2);
}

/// A message of partition 0 of log `orders` at `offset`, read right after the one before it
/// (the first, at 0, from an unknown position).
#[derive(Clone)]
struct Logged {
    msg: Message,
    offset: i64,
}

impl Envelope for Logged {
    fn payload(&self) -> &[u8] {
        self.msg.payload()
    }
    fn message_id(&self) -> Option<&str> {
        self.msg.message_id()
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.msg.header(name)
    }
    fn log_position(&self) -> Option<LogPosition<'_>> {
        let from = (self.offset > 0).then_some(self.offset);
        Some(LogPosition::new("orders", 0, self.offset).read_from(from))
    }
}

/// The offset inbox under the same bound: a batch whose handler's statement never answers is
/// given up after the store timeout, its messages are transient failures, and neither the
/// handler's writes nor a moved position are left (the redelivery processes them).
#[tokio::test]
async fn an_offset_inbox_transaction_that_never_answers_is_given_up_and_leaves_nothing() {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
    let file =
        std::env::temp_dir().join(format!("idem-offset-timeout-{}.sqlite", nanos.as_nanos()));
    let _gone = Remove(file.clone());
    let store = SqliteStore::open(&file).await.unwrap();
    sqlx::raw_sql("CREATE TABLE ledger (k TEXT NOT NULL)").execute(store.pool()).await.unwrap();
    let engine: Engine<OffsetInbox<SqliteInbox>> =
        Engine::builder(OffsetInbox::new(store.inbox(Duration::from_secs(86_400))))
            .scope("orders")
            .store_timeout(Duration::from_millis(300))
            .build()
            .unwrap();
    let msgs = [Logged { msg: order("o-0"), offset: 0 }, Logged { msg: order("o-1"), offset: 1 }];
    let handler = ledger_writer("o-1");
    let given_up =
        tokio::time::timeout(Duration::from_secs(30), engine.decide_batch(&msgs, &handler));
    let outs: Vec<Out> = given_up.await.expect("the transaction was waited on for ever");
    assert!(outs.iter().all(|o| o.kind() == OutcomeKind::FailedTransient), "{outs:?}");
    let Outcome::Failed(f) = &outs[0] else { unreachable!() };
    assert!(
        f.cause.to_string().contains("no answer within the store timeout (300ms)"),
        "{}",
        f.cause
    );
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger").fetch_one(store.pool()).await.unwrap();
    assert_eq!(rows, 0, "the given-up transaction left writes behind");
    let positions: Vec<Option<i64>> =
        idem_core::inbox::PositionReader::read(engine.store(), "orders", &[("orders".into(), 0)])
            .await
            .unwrap();
    assert_eq!(positions, [None], "the given-up transaction moved the position");
    // The redelivery runs both, once, and moves the position past them.
    let outs: Vec<Out> = engine.decide_batch(&msgs, &handler).await;
    assert!(outs.iter().all(|o| o.kind() == OutcomeKind::Processed), "{outs:?}");
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger").fetch_one(store.pool()).await.unwrap();
    assert_eq!(rows, 2);
}

/// The inbox handler of both transaction tests: writes a ledger row for the message's id;
/// the first time it sees `hangs`, its statement "never answers" (a half-open connection).
fn ledger_writer<M: Envelope + Send + 'static>(
    hangs: &'static str,
) -> impl Fn(Tx<SqliteInbox>, M) -> BoxFuture<'static, Result<String, HandlerError<String>>> + Sync
{
    let hang = Arc::new(AtomicU32::new(1));
    move |mut tx, m| {
        let hang = Arc::clone(&hang);
        Box::pin(async move {
            let k = m.message_id().unwrap_or_default().to_owned();
            sqlx::query("INSERT INTO ledger (k) VALUES (?)")
                .bind(&k)
                .execute(&mut *tx)
                .await
                .map_err(|e| HandlerError::Transient(e.to_string()))?;
            if k == hangs
                && hang
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
            {
                std::future::pending::<()>().await;
            }
            Ok(k)
        })
    }
}

/// Removes the test's SQLite file (and its journal files) when dropped.
struct Remove(std::path::PathBuf);

impl Drop for Remove {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let mut p = self.0.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}
