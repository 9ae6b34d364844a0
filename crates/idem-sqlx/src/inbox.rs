//! The transactional inbox as a consumer backend: one database transaction per fetched batch,
//! for every broker adapter and every SQL database.
//!
//! Per batch ([`decide`]): begin; mark every distinct key in one statement, in key-hash order
//! (concurrent batches lock shared markers in one order, so they wait instead of deadlocking);
//! run the handlers of the keys marked first, in delivery order, each with the transaction;
//! store their results in one statement; commit. Nothing is acknowledged before that commit.
//!
//! A handler that fails leaves the transaction in doubt (PostgreSQL aborts it on any error), so
//! the batch is rolled back and the rest of it runs again, each message in its own savepoint
//! with its own mark: a failing message rolls back alone. An inbox handler may therefore run
//! twice for one delivery; only its writes through the transaction count, and they commit once.
//! Later copies of a key inside the batch are decided after the batch commits (duplicates of
//! what it wrote).

// Without a database feature only the public types are used.
#![cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "mysql")),
    allow(dead_code)
)]

use std::fmt::Display;
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idem_core::consumer::{Cause, Conflict, FailureKind, HandlerError, Outcome, Prepared};
use idem_core::extract::Envelope;
use idem_core::outbox::MessageId;
use idem_core::time::{Clock, SystemClock};
use idem_core::{Consumer, DedupKey, Fingerprint, StoreError};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{InboxError, InboxOutcome, Mark};

/// The batch transaction as an inbox handler holds it: use it as the connection
/// (`sqlx::query(…).execute(&mut *tx)`), like a `sqlx::Transaction`. Do not commit it or keep
/// it: the inbox commits the batch once every handler has returned.
///
/// ```no_run
/// # async fn f(mut tx: idem_sqlx::Tx<sqlx::Sqlite>) -> Result<(), sqlx::Error> {
/// sqlx::query("INSERT INTO orders (id) VALUES (?)").bind("o-1").execute(&mut *tx).await?;
/// # Ok(()) }
/// ```
pub struct Tx<DB: sqlx::Database> {
    tx: Option<sqlx::Transaction<'static, DB>>,
    home: Arc<Mutex<Option<sqlx::Transaction<'static, DB>>>>,
    key: Option<DedupKey>,
    /// Outbox messages produced so far by this run of the handler.
    produced: u32,
}

impl<DB: sqlx::Database> Tx<DB> {
    /// The key of the message being handled (`None` for a message without one, processed
    /// without dedup by the consumer's missing-key policy).
    pub fn key(&self) -> Option<&DedupKey> {
        self.key.as_ref()
    }

    /// The id of the next outbox message this handler enqueues: derived from the message's key
    /// and how many it enqueued before ([`MessageId::derived`]), so a handler that runs again
    /// (after a rollback) produces the same ids; random for a message without a key.
    pub(crate) fn next_message_id(&mut self) -> MessageId {
        let id = match &self.key {
            Some(key) => MessageId::derived(key, self.produced),
            None => MessageId::random(),
        };
        self.produced += 1;
        id
    }
}

impl<DB: sqlx::Database> std::fmt::Debug for Tx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx").field("key", &self.key).finish_non_exhaustive()
    }
}

impl<DB: sqlx::Database> Deref for Tx<DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        self.tx.as_deref().expect("a Tx holds its transaction until it is dropped")
    }
}

impl<DB: sqlx::Database> DerefMut for Tx<DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        self.tx.as_deref_mut().expect("a Tx holds its transaction until it is dropped")
    }
}

impl<DB: sqlx::Database> Drop for Tx<DB> {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            *self.home.lock().unwrap_or_else(PoisonError::into_inner) = Some(tx);
        }
    }
}

/// The batch transaction, lent to one handler at a time.
struct Lender<DB: sqlx::Database> {
    home: Arc<Mutex<Option<sqlx::Transaction<'static, DB>>>>,
}

impl<DB: sqlx::Database> Lender<DB> {
    fn new(tx: sqlx::Transaction<'static, DB>) -> Self {
        Self { home: Arc::new(Mutex::new(Some(tx))) }
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<sqlx::Transaction<'static, DB>>> {
        self.home.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The transaction as a handler's [`Tx`]; `None` if a handler kept it.
    fn lend(&self, key: Option<DedupKey>) -> Option<Tx<DB>> {
        let tx = self.slot().take()?;
        Some(Tx { tx: Some(tx), home: Arc::clone(&self.home), key, produced: 0 })
    }

    /// The transaction back, once the handler's future (and with it its `Tx`) is gone.
    fn take(&self) -> Result<sqlx::Transaction<'static, DB>, StoreError> {
        self.slot().take().ok_or_else(|| {
            StoreError::backend(
                "inbox",
                true,
                "an inbox handler kept its transaction beyond its future; the batch is rolled back",
            )
        })
    }
}

/// A transactional inbox on one sqlx driver: [`SqliteInbox`](crate::SqliteInbox),
/// [`PostgresInbox`](crate::PostgresInbox), [`MySqlInbox`](crate::MySqlInbox). Each is a
/// consumer [`Backend`](idem_core::Backend) through it.
pub trait TxInbox: Send + Sync + Sized + 'static {
    /// The driver.
    type Db: sqlx::Database;

    /// How long markers are kept.
    fn retention(&self) -> Duration;

    /// Begins a batch transaction (SQLite: `BEGIN IMMEDIATE`, so the write lock is taken
    /// up front).
    fn begin(
        &self,
    ) -> impl Future<Output = Result<sqlx::Transaction<'static, Self::Db>, sqlx::Error>> + Send;

    /// As the inbox's own `mark`.
    fn mark<'a>(
        &'a self,
        conn: &'a mut <Self::Db as sqlx::Database>::Connection,
        key: &'a DedupKey,
        fingerprint: Option<Fingerprint>,
    ) -> impl Future<Output = Result<Mark, StoreError>> + Send + 'a;

    /// Marks distinct keys inside the caller's transaction, taking their rows in key-hash
    /// order; answers in input order, each as [`mark`](Self::mark) would.
    fn mark_many<'a>(
        &'a self,
        conn: &'a mut <Self::Db as sqlx::Database>::Connection,
        items: &'a [(DedupKey, Option<Fingerprint>)],
    ) -> impl Future<Output = Result<Vec<Mark>, StoreError>> + Send + 'a;

    /// Stores results with their markers, inside the caller's transaction.
    fn set_results<'a>(
        &'a self,
        conn: &'a mut <Self::Db as sqlx::Database>::Connection,
        items: &'a [(DedupKey, Vec<u8>)],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// Runs savepoint statements (`sql` may hold two when the driver takes several statements
    /// in one round trip, [`MULTI_STATEMENT`](Self::MULTI_STATEMENT)).
    fn savepoint_sql<'a>(
        conn: &'a mut <Self::Db as sqlx::Database>::Connection,
        sql: &'static str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Whether [`savepoint_sql`](Self::savepoint_sql) takes two statements in one round trip.
    const MULTI_STATEMENT: bool;

    /// The driver's error as a store error, retryable when the database says so (a deadlock,
    /// a lost connection, a busy database).
    fn error(op: &'static str, e: sqlx::Error) -> StoreError;

    /// One message on its own transaction, as each inbox's inherent `process`: begin, mark,
    /// run `writes` with the transaction only if the mark is first, store the result, commit.
    ///
    /// # Errors
    /// [`InboxError::Writes`] when `writes` fails (everything rolled back, marker included),
    /// [`InboxError::Store`] otherwise.
    fn process<T, E, F, Fut>(
        &self,
        key: &DedupKey,
        fingerprint: Option<Fingerprint>,
        writes: F,
    ) -> impl Future<Output = Result<InboxOutcome<T>, InboxError<E>>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(Tx<Self::Db>) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        process_one(self, key, fingerprint, writes)
    }
}

const SET: &str = "SAVEPOINT idem_msg";
const RELEASE: &str = "RELEASE SAVEPOINT idem_msg";
const ROLLBACK: &str = "ROLLBACK TO SAVEPOINT idem_msg";
const RELEASE_AND_SET: &str = "RELEASE SAVEPOINT idem_msg; SAVEPOINT idem_msg";

/// One message of a round: its index in the batch, and its key and fingerprint (`None`: no
/// key, processed without dedup).
type Item = (usize, Option<(DedupKey, Option<Fingerprint>)>);

/// Decides a batch in inbox mode; see the module docs. Outcomes are in message order.
pub(crate) async fn decide<I, M, H, Fut, T, E>(
    c: &Consumer<I>,
    batch: &[M],
    handler: &H,
) -> Vec<Outcome<T, E>>
where
    I: TxInbox,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Fn(Tx<I::Db>, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    let mut out: Vec<Option<Outcome<T, E>>> = batch.iter().map(|_| None).collect();
    let mut todo: Vec<Item> = Vec::with_capacity(batch.len());
    for (i, m) in batch.iter().enumerate() {
        match c.prepare::<M, T, E>(m) {
            Prepared::Claim(req) => todo.push((i, Some((req.key, req.fingerprint)))),
            Prepared::Unkeyed => todo.push((i, None)),
            Prepared::Done(o) => {
                c.observe(None, m.correlation_id(), &o, 0);
                out[i] = Some(o);
            }
            // Prepared is non-exhaustive: anything new is a failure of this message alone.
            _ => {
                let o = Outcome::failed(FailureKind::Transient, Cause::Store(unexpected()));
                out[i] = Some(o);
            }
        }
    }
    while !todo.is_empty() {
        // The first copy of each key goes in this round; the others once it has committed.
        let mut seen = std::collections::HashSet::new();
        let (round, later): (Vec<Item>, Vec<Item>) = todo
            .into_iter()
            .partition(|(_, k)| k.as_ref().is_none_or(|(key, _)| seen.insert(key.hash())));
        for (i, o) in run_round(c, &round, batch, handler).await {
            out[i] = Some(o);
        }
        todo = later;
    }
    out.into_iter().map(|o| o.expect("every message of the batch is decided")).collect()
}

fn unexpected() -> StoreError {
    StoreError::backend("inbox", true, "a delivery could not be prepared")
}

/// One transaction over `round` (distinct keys): the fast path, or after a handler failure,
/// the savepoint path for the rest.
async fn run_round<I, M, H, Fut, T, E>(
    c: &Consumer<I>,
    round: &[Item],
    batch: &[M],
    handler: &H,
) -> Vec<(usize, Outcome<T, E>)>
where
    I: TxInbox,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Fn(Tx<I::Db>, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    let decided = match fast(c, round, batch, handler).await {
        Fast::Done(decided) => decided,
        Fast::HandlerFailed { at, error } => {
            let rest: Vec<Item> = round.iter().filter(|(i, _)| *i != at).cloned().collect();
            let mut decided = one_by_one(c, &rest, batch, handler).await;
            decided.push((at, Outcome::from_handler_error(error)));
            decided
        }
    };
    for (i, o) in &decided {
        let key = round.iter().find(|(j, _)| j == i).and_then(|(_, k)| k.as_ref().map(|k| &k.0));
        c.observe(key, batch[*i].correlation_id(), o, 1);
    }
    decided
}

/// How many times a batch is marked before a retryable error fails it (its messages are then
/// retried by the broker).
const MARK_ATTEMPTS: u32 = 8;

/// A random pause that grows with the attempt (0.5–2.5 ms at first, at most 160 ms), so that
/// two batches that deadlocked do not meet again in step.
fn mark_backoff(attempt: u32) -> Duration {
    use std::hash::{BuildHasher, RandomState};
    let ceiling = 1u64 << (attempt.min(7) + 10); // microseconds
    let draw = RandomState::new().hash_one((attempt, Instant::now()));
    Duration::from_micros(ceiling / 4 + draw % ceiling)
}

enum Fast<T, E> {
    Done(Vec<(usize, Outcome<T, E>)>),
    HandlerFailed { at: usize, error: HandlerError<E> },
}

/// Begin, mark all, run the handlers of the firsts in delivery order, store results, commit.
async fn fast<I, M, H, Fut, T, E>(
    c: &Consumer<I>,
    round: &[Item],
    batch: &[M],
    handler: &H,
) -> Fast<T, E>
where
    I: TxInbox,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Fn(Tx<I::Db>, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    let inbox = c.store();
    let all_failed = |e: StoreError| Fast::Done(failed_round(round, e));
    let keyed: Vec<(DedupKey, Option<Fingerprint>)> =
        round.iter().filter_map(|(_, k)| k.clone()).collect();
    let mut attempt = 0;
    let (tx, marks) = loop {
        attempt += 1;
        let mut tx = match inbox.begin().await {
            Ok(tx) => tx,
            Err(e) => return all_failed(I::error("begin", e)),
        };
        let started = Instant::now();
        match inbox.mark_many(&mut tx, &keyed).await {
            Ok(m) if m.len() == keyed.len() => {
                c.observe_claim(started);
                break (tx, m);
            }
            Ok(_) => {
                return all_failed(StoreError::backend("mark_many", true, "wrong number of marks"));
            }
            // No handler has run yet, so marking again is free: concurrent batches on InnoDB
            // deadlock on the index gaps their new markers share whatever the key order, and a
            // busy SQLite or a serialization failure clears the same way.
            Err(e) if e.is_retryable() && attempt < MARK_ATTEMPTS => {
                c.observe_store_error("mark_many", &e);
                tracing::debug!(target: "idem", error = %e, attempt,
                    "marking the batch failed with a retryable error; marking again");
                if let Err(e) = tx.rollback().await {
                    tracing::debug!(target: "idem", error = %e, "rollback after a failed mark");
                }
                tokio::time::sleep(mark_backoff(attempt)).await;
            }
            Err(e) => {
                c.observe_store_error("mark_many", &e);
                return all_failed(e);
            }
        }
    };
    let lender = Lender::new(tx);
    let mut marks = marks.into_iter();
    let mut decided = Vec::with_capacity(round.len());
    let mut results = Vec::new();
    for (i, k) in round {
        let mark = match k {
            Some(_) => marks.next(),
            None => None,
        };
        let key = match (k, mark) {
            (Some((key, _)), Some(Mark::First)) => Some(key.clone()),
            (None, _) => None,
            (Some((key, fp)), Some(other)) => {
                decided.push((*i, settled_mark(other, key, *fp)));
                continue;
            }
            (Some(_), None) => {
                decided.push((*i, transient(unexpected())));
                continue;
            }
        };
        let Some(tx) = lender.lend(key.clone()) else {
            return all_failed(lender.take().err().unwrap_or_else(unexpected));
        };
        match handler(tx, batch[*i].clone()).await {
            Ok(v) => {
                if let Some(key) = &key
                    && let Some(bytes) = c.encode_result(key, &v).filter(|b| b != b"null")
                {
                    results.push((key.clone(), bytes));
                }
                decided.push((*i, Outcome::Processed(v)));
            }
            Err(error) => {
                // Roll back now rather than on drop: the next transaction (a SQLite writer above
                // all) must not wait for it.
                if let Ok(tx) = lender.take()
                    && let Err(e) = tx.rollback().await
                {
                    tracing::warn!(target: "idem", error = %e, "rolling back the inbox batch failed");
                }
                return Fast::HandlerFailed { at: *i, error };
            }
        }
    }
    let mut tx = match lender.take() {
        Ok(tx) => tx,
        Err(e) => return all_failed(e),
    };
    if !results.is_empty()
        && let Err(e) = inbox.set_results(&mut tx, &results).await
    {
        return all_failed(e);
    }
    let started = Instant::now();
    let committed = tx.commit().await;
    c.observe_complete(started);
    if let Err(e) = committed {
        return Fast::Done(commit_failed(c, decided, I::error("commit", e)));
    }
    Fast::Done(decided)
}

/// The savepoint path: each message marked and handled inside its own savepoint, in key-hash
/// order (so its row locks are taken in the one global order too), one commit.
async fn one_by_one<I, M, H, Fut, T, E>(
    c: &Consumer<I>,
    round: &[Item],
    batch: &[M],
    handler: &H,
) -> Vec<(usize, Outcome<T, E>)>
where
    I: TxInbox,
    M: Envelope + Clone + Send + Sync + 'static,
    H: Fn(Tx<I::Db>, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    let inbox = c.store();
    let tx = match inbox.begin().await {
        Ok(tx) => tx,
        Err(e) => return failed_round(round, I::error("begin", e)),
    };
    let mut order: Vec<&Item> = round.iter().collect();
    order.sort_by_key(|(i, k)| (k.as_ref().map(|(key, _)| key.hash().0), *i));
    let lender = Lender::new(tx);
    let mut decided = Vec::with_capacity(round.len());
    let mut open = false;
    for (i, k) in order {
        let step = async {
            let mut tx = lender.take()?;
            // The previous savepoint is released only now: a message that kept its writes
            // needs no statement of its own after them.
            let set = match (open, I::MULTI_STATEMENT) {
                (false, _) => I::savepoint_sql(&mut tx, SET).await,
                (true, true) => I::savepoint_sql(&mut tx, RELEASE_AND_SET).await,
                (true, false) => match I::savepoint_sql(&mut tx, RELEASE).await {
                    Ok(()) => I::savepoint_sql(&mut tx, SET).await,
                    Err(e) => Err(e),
                },
            };
            set.map_err(|e| I::error("savepoint", e))?;
            let mark = match k {
                Some((key, fp)) => Some(inbox.mark(&mut tx, key, *fp).await),
                None => None,
            };
            *lender.slot() = Some(tx);
            Ok::<_, StoreError>(mark)
        };
        let mark = match step.await {
            Ok(m) => m,
            // The transaction can no longer be trusted: nothing of the round is committed.
            Err(e) => return failed_round(round, e),
        };
        open = true;
        let key = k.as_ref().map(|(key, _)| key.clone());
        let outcome = match (mark, k) {
            (Some(Ok(Mark::First)), _) | (None, _) => {
                let Some(tx) = lender.lend(key.clone()) else {
                    return failed_round(round, unexpected());
                };
                match handler(tx, batch[*i].clone()).await {
                    Ok(v) => {
                        let stored = key
                            .as_ref()
                            .and_then(|key| c.encode_result(key, &v).map(|b| (key.clone(), b)))
                            .filter(|(_, b)| b != b"null");
                        let kept = match (stored, lender.take()) {
                            (_, Err(e)) => return failed_round(round, e),
                            (None, Ok(tx)) => Ok(tx),
                            (Some(item), Ok(mut tx)) => {
                                match inbox.set_results(&mut tx, std::slice::from_ref(&item)).await
                                {
                                    Ok(()) => Ok(tx),
                                    Err(e) => Err((tx, e)),
                                }
                            }
                        };
                        match kept {
                            Ok(tx) => {
                                *lender.slot() = Some(tx);
                                Ok(Outcome::Processed(v))
                            }
                            Err((tx, e)) => {
                                *lender.slot() = Some(tx);
                                Err(transient(e))
                            }
                        }
                    }
                    Err(e) => Err(Outcome::from_handler_error(e)),
                }
            }
            (Some(Ok(other)), Some((key, fp))) => Ok(settled_mark(other, key, *fp)),
            (Some(Err(e)), _) => Err(transient(e)),
            (Some(Ok(_)), None) => Err(transient(unexpected())),
        };
        let outcome = match outcome {
            Ok(o) => o,
            Err(o) => {
                // Roll back this message's marker and writes alone.
                let undo = async {
                    let mut tx = lender.take()?;
                    let r = I::savepoint_sql(&mut tx, ROLLBACK).await;
                    *lender.slot() = Some(tx);
                    r.map_err(|e| I::error("rollback to savepoint", e))
                };
                if let Err(e) = undo.await {
                    return failed_round(round, e);
                }
                o
            }
        };
        decided.push((*i, outcome));
    }
    let tx = match lender.take() {
        Ok(tx) => tx,
        Err(e) => return failed_round(round, e),
    };
    let started = Instant::now();
    let committed = tx.commit().await;
    c.observe_complete(started);
    match committed {
        Ok(()) => decided,
        Err(e) => commit_failed(c, decided, I::error("commit", e)),
    }
}

/// One message in its own transaction: begin, mark, run `writes` with the transaction if first,
/// store the result, commit. What each inbox's `process` does.
pub(crate) async fn process_one<I, T, E, F, Fut>(
    inbox: &I,
    key: &DedupKey,
    fingerprint: Option<Fingerprint>,
    writes: F,
) -> Result<InboxOutcome<T>, InboxError<E>>
where
    I: TxInbox,
    T: Serialize + DeserializeOwned,
    F: FnOnce(Tx<I::Db>) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut tx = inbox.begin().await.map_err(|e| I::error("process", e))?;
    if let Some(done) = crate::row::settled(inbox.mark(&mut tx, key, fingerprint).await?)? {
        return Ok(done);
    }
    let lender = Lender::new(tx);
    let lent = lender.lend(Some(key.clone())).ok_or_else(unexpected)?;
    let value = writes(lent).await.map_err(InboxError::Writes)?;
    let mut tx = lender.take()?;
    if let Ok(bytes) = serde_json::to_vec(&value)
        && bytes.len() <= crate::MAX_RESULT_BYTES
        && bytes != b"null"
    {
        inbox.set_results(&mut tx, &[(key.clone(), bytes)]).await?;
    }
    tx.commit().await.map_err(|e| I::error("commit", e))?;
    Ok(InboxOutcome::Processed(value))
}

/// The outcome of a mark that was not first: no writes ran.
fn settled_mark<T: DeserializeOwned, E>(
    mark: Mark,
    key: &DedupKey,
    fingerprint: Option<Fingerprint>,
) -> Outcome<T, E> {
    match mark {
        Mark::Duplicate(rec) => match rec.result.as_deref().map(serde_json::from_slice).transpose()
        {
            Ok(v) => Outcome::Duplicate(v),
            Err(e) => Outcome::failed(FailureKind::Permanent, Cause::Decode(e)),
        },
        Mark::Conflict(rec) => Outcome::Conflict(Box::new(Conflict {
            key: key.clone(),
            stored: rec.fingerprint,
            incoming: fingerprint,
            stored_state: rec.state,
        })),
        // A two-phase consumer in the same scope holds a lease on the key.
        Mark::InProgress(rec) => Outcome::InProgressElsewhere {
            retry_after: rec
                .lease_until
                .map_or(Duration::from_secs(1), |until| until.since(SystemClock.now())),
        },
        Mark::First => transient(unexpected()),
    }
}

fn transient<T, E>(e: StoreError) -> Outcome<T, E> {
    Outcome::failed(FailureKind::Transient, Cause::Store(e))
}

/// Every message of a round whose transaction failed before any outcome was durable.
fn failed_round<T, E>(round: &[Item], e: StoreError) -> Vec<(usize, Outcome<T, E>)> {
    tracing::warn!(target: "idem", error = %e, "inbox batch transaction failed; retrying its messages");
    let shared = Arc::new(e);
    round.iter().map(|(i, _)| (*i, transient(shared_error(&shared)))).collect()
}

/// After a failed commit nothing processed is durable: those become transient failures.
/// Duplicates and conflicts were read from committed markers and stand.
fn commit_failed<B, T, E>(
    c: &Consumer<B>,
    decided: Vec<(usize, Outcome<T, E>)>,
    e: StoreError,
) -> Vec<(usize, Outcome<T, E>)> {
    c.observe_store_error("commit", &e);
    tracing::warn!(target: "idem", error = %e, "inbox commit failed; nothing of the batch is committed");
    let shared = Arc::new(e);
    decided
        .into_iter()
        .map(|(i, o)| match o {
            Outcome::Processed(_) => (i, transient(shared_error(&shared))),
            other => (i, other),
        })
        .collect()
}

fn shared_error(e: &Arc<StoreError>) -> StoreError {
    StoreError::backend("inbox batch", e.is_retryable(), BatchFailed(Arc::clone(e)))
}

/// The failure shared by every delivery of a batch whose transaction failed.
#[derive(Debug, thiserror::Error)]
#[error("the inbox transaction of this delivery's batch failed")]
struct BatchFailed(#[source] Arc<StoreError>);

/// Implements [`TxInbox`] and the consumer backend for one inbox type.
macro_rules! tx_inbox {
    ($feature:literal, $inbox:ty, $db:ty, multi: $multi:literal, error: $error:path,
     begin: |$s:ident| $begin:expr) => {
        #[cfg(feature = $feature)]
        impl TxInbox for $inbox {
            type Db = $db;
            const MULTI_STATEMENT: bool = $multi;

            fn retention(&self) -> Duration {
                <$inbox>::retention(self)
            }

            fn error(op: &'static str, e: sqlx::Error) -> StoreError {
                $error(op, e)
            }

            fn begin(
                &self,
            ) -> impl Future<Output = Result<sqlx::Transaction<'static, $db>, sqlx::Error>> + Send
            {
                let $s = self;
                $begin
            }

            fn mark<'a>(
                &'a self,
                conn: &'a mut <$db as sqlx::Database>::Connection,
                key: &'a DedupKey,
                fingerprint: Option<Fingerprint>,
            ) -> impl Future<Output = Result<Mark, StoreError>> + Send + 'a {
                <$inbox>::mark(self, conn, key, fingerprint)
            }

            fn mark_many<'a>(
                &'a self,
                conn: &'a mut <$db as sqlx::Database>::Connection,
                items: &'a [(DedupKey, Option<Fingerprint>)],
            ) -> impl Future<Output = Result<Vec<Mark>, StoreError>> + Send + 'a {
                <$inbox>::mark_many(self, conn, items)
            }

            fn set_results<'a>(
                &'a self,
                conn: &'a mut <$db as sqlx::Database>::Connection,
                items: &'a [(DedupKey, Vec<u8>)],
            ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
                <$inbox>::set_results(self, conn, items)
            }

            fn savepoint_sql<'a>(
                conn: &'a mut <$db as sqlx::Database>::Connection,
                sql: &'static str,
            ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
                async move { sqlx::raw_sql(sql).execute(conn).await.map(|_| ()) }
            }
        }

        #[cfg(feature = $feature)]
        impl idem_core::Backend for $inbox {
            type Ctx = Tx<$db>;

            fn retention(consumer: &Consumer<Self>) -> Duration {
                TxInbox::retention(consumer.store())
            }

            fn lease(_: &Consumer<Self>) -> Option<Duration> {
                None
            }

            fn check(
                consumer: &Consumer<Self>,
            ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send {
                <$inbox>::check(consumer.store())
            }

            fn decide<'a, M, H, Fut, T, E>(
                consumer: &'a Consumer<Self>,
                batch: &'a [M],
                handler: &'a H,
            ) -> impl Future<Output = Vec<Outcome<T, E>>> + Send + 'a
            where
                M: Envelope + Clone + Send + Sync + 'static,
                H: Fn(Self::Ctx, M) -> Fut + Sync,
                Fut: Future<Output = Result<T, HandlerError<E>>> + Send + 'a,
                T: Serialize + DeserializeOwned + Send + 'a,
                E: Display + Send + 'a,
            {
                decide(consumer, batch, handler)
            }
        }
    };
}

tx_inbox!("sqlite", crate::SqliteInbox, sqlx::Sqlite, multi: true,
    error: crate::sqlite::backend, begin: |s| s.pool().begin_with("BEGIN IMMEDIATE"));
tx_inbox!("postgres", crate::PostgresInbox, sqlx::Postgres, multi: true,
    error: crate::postgres::backend, begin: |s| s.pool().begin());
tx_inbox!("mysql", crate::MySqlInbox, sqlx::MySql, multi: false,
    error: crate::mysql::backend, begin: |s| s.pool().begin());
