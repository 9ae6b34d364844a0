//! The broker-source contract, run against every adapter by
//! [`source_conformance!`](crate::source_conformance): the same builder calls in every mode —
//! two-phase over a store, and the transactional inbox on SQLite, PostgreSQL and MySQL/MariaDB —
//! on the real broker.
//!
//! Each case publishes one workload to a destination of its own: 20 orders, 5 producer retries of
//! them, one order id reused with another body, and one order whose first attempt fails
//! transiently. It runs a consumer until every order has its effect and the broker has nothing
//! left, then checks: each order's effect exactly once (in a ledger with no unique constraint),
//! the retries found duplicate, the failed attempt retried and then processed, the reused id
//! dead-lettered with the shared headers, nothing left unsettled.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure is the test failing

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem_core::consumer::{Builder, Consumer, Report, Source, SourceConfig, headers};
use idem_core::engine::HandlerError;
use idem_core::extract::Envelope;
use idem_core::inbox::{Tx, TxInbox};
use idem_core::{Backend, DedupStore};
use idem_sqlx::{MySqlStore, PostgresStore, SqliteStore};
use sqlx::AssertSqlSafe;

pub use crate::inbox::BoxFuture;

/// The delivery type of a harness's source.
pub type MessageOf<H> = <<H as SourceHarness>::Source as Source>::Delivery;

/// A broker under test, with a destination of its own (a queue, stream, subject or topic, and its
/// dead-letter destination), deleted when the harness is dropped or cleaned up.
pub trait SourceHarness: Send + Sync + Sized {
    /// The adapter's source.
    type Source: Source;
    /// The adapter's settings type (it may borrow the harness's connection).
    type Config<'a>: SourceConfig<Source = Self::Source>
    where
        Self: 'a;

    /// Publishes a message whose producer message id is `id`. Publishing an id again is a
    /// producer retry: the broker must store and deliver it again (a broker with a duplicate
    /// window waits it out).
    fn publish<'a>(&'a self, id: &'a str, body: &'a [u8]) -> BoxFuture<'a, ()>;

    /// Settings for a consumer of the destination, retrying failed messages within a second or
    /// two (a short redelivery delay or idle time).
    fn config(&self) -> Self::Config<'_>;

    /// Whether every message published so far has been settled: acknowledged or dead-lettered,
    /// none ready, none delivered and unacknowledged.
    fn settled(&self) -> BoxFuture<'_, bool>;

    /// The dead-letter copies so far, in order.
    fn dead_letters(&self) -> BoxFuture<'_, Vec<DeadCopy>>;

    /// What the broker holds for the destination, on one line, for a failing test's message
    /// (a queue's ready and unacknowledged counts, a group's offsets against the partitions'
    /// ends). Empty by default.
    fn describe(&self) -> BoxFuture<'_, String> {
        Box::pin(async { String::new() })
    }

    /// Deletes what the harness created.
    fn cleanup(self) -> BoxFuture<'static, ()>;
}

/// A dead-letter copy as the broker stores it.
#[derive(Debug, Clone, Default)]
pub struct DeadCopy {
    /// The original producer message id (the broker's own property, or
    /// [`headers::ORIGINAL_MESSAGE_ID`] where the adapter must rename it).
    pub message_id: Option<String>,
    /// Its string headers (or stream fields) by name.
    pub headers: HashMap<String, String>,
}

const ORDERS: usize = 20;
const RETRIES: usize = 5;
const REUSED: &str = "o-7";
const FLAKY: &str = "o-11";
const WEEK: Duration = Duration::from_secs(7 * 86_400);
const LIMIT: Duration = Duration::from_secs(60);

fn body(i: usize) -> Vec<u8> {
    format!(r#"{{"order":{i}}}"#).into_bytes()
}

fn transient(e: sqlx::Error) -> HandlerError<String> {
    HandlerError::Transient(e.to_string())
}

/// The message's producer id, as the ledger records it.
fn id_of(m: &impl Envelope) -> String {
    m.message_id().unwrap_or_default().to_owned()
}

/// The first attempt at [`FLAKY`] fails transiently, before any write.
struct Flaky(AtomicBool);

impl Flaky {
    fn new() -> Self {
        Self(AtomicBool::new(false))
    }

    fn check(&self, id: &str) -> Result<(), HandlerError<String>> {
        if id == FLAKY && !self.0.swap(true, Ordering::SeqCst) {
            return Err(HandlerError::Transient("upstream busy (first attempt)".to_owned()));
        }
        Ok(())
    }
}

/// Publishes the workload, runs a consumer in the `mode` the builder is given (`.store(s)` or
/// `.inbox(i)`) with `handler` until every order has its effect (`effects()`: distinct ids,
/// rows) and the broker has nothing unsettled, then checks the report, the effects and the dead
/// letter.
async fn exercise<'h, H, B, M, F, Fut, C, CFut>(
    h: &'h H,
    name: &str,
    mode: M,
    handler: F,
    effects: C,
) where
    H: SourceHarness,
    B: Backend,
    M: FnOnce(Builder<H::Config<'h>>) -> Builder<H::Config<'h>, B>,
    F: Fn(B::Ctx, MessageOf<H>) -> Fut + Sync,
    Fut: Future<Output = Result<(), HandlerError<String>>> + Send,
    C: Fn() -> CFut,
    CFut: Future<Output = (i64, i64)>,
{
    for i in 0..ORDERS {
        h.publish(&format!("o-{i}"), &body(i)).await;
    }
    for i in 0..RETRIES {
        h.publish(&format!("o-{i}"), &body(i)).await;
    }
    h.publish(REUSED, br#"{"order":"other"}"#).await;
    // The same calls whatever the broker and the backend.
    let consumer = mode(Consumer::builder(h.config()))
        .scope(name)
        .batch(8)
        .idle_wait(Duration::from_millis(100))
        .build()
        .await
        .expect("consumer");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = consumer.run(&handler, async {
        let _ = stopped.await;
    });
    let watch = async {
        let deadline = tokio::time::Instant::now() + LIMIT;
        while effects().await != (ORDERS as i64, ORDERS as i64) || !h.settled().await {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name}: not done within {LIMIT:?}: effects {:?}",
                effects().await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.send(()).expect("stop");
    };
    let (report, ()) = tokio::join!(run, watch);
    let report: Report = report.expect("run");
    assert_eq!(effects().await, (ORDERS as i64, ORDERS as i64), "{name}: an effect ran twice");
    assert_eq!(report.processed, ORDERS as u64, "{name}: {report}");
    assert!(report.duplicates >= RETRIES as u64, "{name}: {report}");
    assert!(report.conflicts >= 1 && report.dead_lettered >= 1, "{name}: {report}");
    assert!(report.failed_transient >= 1 && report.retried >= 1, "{name}: {report}");
    assert!(h.settled().await, "{name}: something was left unsettled after the run");
    let dead = h.dead_letters().await;
    // At least once: a crash between the copy and the ack may repeat it, never lose it.
    assert!(!dead.is_empty(), "{name}: no dead letter");
    assert!(dead.iter().all(|d| d.message_id.as_deref() == Some(REUSED)), "{name}: {dead:?}");
    let header = |n: &str| dead[0].headers.get(n).map(String::as_str);
    assert_eq!(header(headers::OUTCOME), Some("conflict"), "{name}: {dead:?}");
    assert_eq!(header(headers::SCOPE), Some(name), "{name}: {dead:?}");
    assert!(
        header(headers::REASON).is_some_and(|r| r.starts_with(&format!("conflict: key {name}/"))),
        "{name}: {dead:?}"
    );
    assert!(header(headers::SOURCE).is_some_and(|s| !s.is_empty()), "{name}: {dead:?}");
}

/// Two-phase mode over `SqliteStore`; the effect is a row in a ledger of its own (another
/// SQLite file), outside the store.
///
/// # Cancel safety
/// Dropped midway, what the case published stays on the harness's destination, which the
/// harness deletes when it is dropped (a database case drops its schema or tables too).
pub async fn two_phase<H: SourceHarness>(h: H) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("idem.sqlite")).await.unwrap();
    two_phase_on(h, store).await;
}

/// Two-phase mode over `store` (an adapter's own store, say); the effect is a row in a SQLite
/// ledger outside it.
///
/// # Cancel safety
/// Dropped midway, what the case published stays on the harness's destination, which the
/// harness deletes when it is dropped (a database case drops its schema or tables too).
pub async fn two_phase_on<H: SourceHarness, S: DedupStore>(h: H, store: S) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("ledger.sqlite").display());
    let ledger = sqlx::SqlitePool::connect(&url).await.unwrap();
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL)").execute(&ledger).await.unwrap();
    let flaky = Flaky::new();
    let handler = |_ctx, m: MessageOf<H>| {
        let (ledger, id) = (ledger.clone(), id_of(&m));
        let checked = flaky.check(&id);
        async move {
            checked?;
            sqlx::query("INSERT INTO ledger VALUES (?)")
                .bind(id)
                .execute(&ledger)
                .await
                .map_err(transient)?;
            Ok(())
        }
    };
    let effects = || async {
        sqlx::query_as("SELECT COUNT(DISTINCT k), COUNT(*) FROM ledger")
            .fetch_one(&ledger)
            .await
            .unwrap()
    };
    exercise(&h, "two-phase", |b| b.store(store), handler, effects).await;
    h.cleanup().await;
}

/// Inbox mode on SQLite: the ledger row commits with the marker.
///
/// # Cancel safety
/// Dropped midway, what the case published stays on the harness's destination, which the
/// harness deletes when it is dropped (a database case drops its schema or tables too).
pub async fn sqlite_inbox<H: SourceHarness>(h: H) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("shop.sqlite")).await.unwrap();
    sqlx::query("CREATE TABLE ledger (k TEXT NOT NULL)").execute(store.pool()).await.unwrap();
    let inbox = store.inbox(WEEK);
    inbox_case(h, "inbox-sqlite", inbox, store.pool().clone(), "ledger", "?").await;
}

/// Inbox mode on PostgreSQL (`IDEM_TEST_POSTGRES_URL`), store and ledger in a schema of their
/// own, dropped afterwards (also when the case fails).
///
/// # Cancel safety
/// Dropped midway, what the case published stays on the harness's destination, which the
/// harness deletes when it is dropped (a database case drops its schema or tables too).
pub async fn postgres_inbox<H: SourceHarness>(h: H) {
    let Some(url) = crate::service::require(
        "PostgreSQL",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    ) else {
        return;
    };
    let schema = format!("idem_source_{:016x}", rand_u64());
    let store = PostgresStore::connect(&url).await.unwrap().with_schema(&schema).unwrap();
    let _drop =
        DropSql { url: url.clone(), sql: format!("DROP SCHEMA IF EXISTS {schema} CASCADE") };
    store.migrate().await.unwrap();
    let ledger = format!("{schema}.ledger");
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE {ledger} (k TEXT NOT NULL)")))
        .execute(store.pool())
        .await
        .unwrap();
    let inbox = store.inbox(WEEK);
    inbox_case(h, "inbox-postgres", inbox, store.pool().clone(), &ledger, "$1").await;
}

/// Inbox mode on MySQL/MariaDB (`IDEM_TEST_MYSQL_URL`), store and ledger in tables of their
/// own, dropped afterwards (also when the case fails).
///
/// # Cancel safety
/// Dropped midway, what the case published stays on the harness's destination, which the
/// harness deletes when it is dropped (a database case drops its schema or tables too).
pub async fn mysql_inbox<H: SourceHarness>(h: H) {
    let Some(url) =
        crate::service::require("MySQL", "IDEM_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
    else {
        return;
    };
    let table = format!("idem_source_{:016x}", rand_u64());
    let store = MySqlStore::connect(&url).await.unwrap().with_table_name(&table).unwrap();
    let _drop = DropSql {
        url: url.clone(),
        sql: format!("DROP TABLE IF EXISTS `{table}`, `{table}_ledger`, `{table}_positions`"),
    };
    store.migrate().await.unwrap();
    let ledger = format!("`{table}_ledger`");
    sqlx::raw_sql(AssertSqlSafe(format!("CREATE TABLE {ledger} (k VARCHAR(64) NOT NULL)")))
        .execute(store.pool())
        .await
        .unwrap();
    let inbox = store.inbox(WEEK);
    inbox_case(h, "inbox-mysql", inbox, store.pool().clone(), &ledger, "?").await;
}

/// Inbox mode over `inbox`: each first delivery inserts one row into `ledger` (with the
/// database's parameter `placeholder`) on the batch's transaction; `pool` counts the rows.
async fn inbox_case<H, I, DB>(
    h: H,
    name: &str,
    inbox: I,
    pool: sqlx::Pool<DB>,
    ledger: &str,
    placeholder: &str,
) where
    H: SourceHarness,
    DB: sqlx::Database,
    I: TxInbox<Connection = DB::Connection>,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    for<'c> &'c sqlx::Pool<DB>: sqlx::Executor<'c, Database = DB>,
    DB::Arguments: sqlx::IntoArguments<DB>,
    for<'q> String: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
    for<'r> (i64, i64): sqlx::FromRow<'r, DB::Row>,
{
    let insert = format!("INSERT INTO {ledger} VALUES ({placeholder})");
    let flaky = Flaky::new();
    let handler = |mut tx: Tx<I>, m: MessageOf<H>| {
        let (insert, id) = (insert.clone(), id_of(&m));
        let checked = flaky.check(&id);
        async move {
            checked?;
            sqlx::query(AssertSqlSafe(insert))
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(transient)?;
            Ok(())
        }
    };
    let count = format!("SELECT COUNT(DISTINCT k), COUNT(*) FROM {ledger}");
    let effects = || {
        let (pool, count) = (pool.clone(), count.clone());
        async move { sqlx::query_as(AssertSqlSafe(count)).fetch_one(&pool).await.unwrap() }
    };
    exercise(&h, name, |b| b.inbox(inbox), handler, effects).await;
    h.cleanup().await;
}

/// A random suffix for the case's schema or tables.
pub(crate) fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

/// Runs one statement on its own connection when dropped (from a thread with a runtime of its
/// own: the test's runtime may be unwinding), to drop what a case created.
pub(crate) struct DropSql {
    pub(crate) url: String,
    pub(crate) sql: String,
}

impl Drop for DropSql {
    fn drop(&mut self) {
        let (url, sql) = (self.url.clone(), self.sql.clone());
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            rt.block_on(async move {
                use sqlx::Connection as _;
                if url.starts_with("mysql") {
                    if let Ok(mut c) = sqlx::MySqlConnection::connect(&url).await {
                        let _ = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut c).await;
                    }
                } else if let Ok(mut c) = sqlx::PgConnection::connect(&url).await {
                    let _ = sqlx::raw_sql(AssertSqlSafe(sql)).execute(&mut c).await;
                }
            });
        })
        .join();
    }
}

/// Defines the broker-source conformance tests in the calling test file: one test per mode,
/// each on a fresh harness from `$make`, an async closure taking the case's name and returning
/// `Option<harness>` (`None`: the broker is unreachable and the test is skipped — under
/// `CI=true` the harness should panic instead, as [`service::require`](crate::service::require)
/// does).
///
/// ```ignore
/// idem_testkit::source_conformance!(|name: &'static str| async move { MyBroker::new(name).await });
/// ```
#[macro_export]
macro_rules! source_conformance {
    ($make:expr) => {
        $crate::__source_cases!($make; two_phase, sqlite_inbox, postgres_inbox, mysql_inbox);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __source_cases {
    ($make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some(harness) = ($make)(stringify!($name)).await else { return };
                $crate::source::$name(harness).await;
            }
        )+
    };
}
