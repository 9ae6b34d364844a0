//! The broker adapters' inbox mode (`idem-nats`, `idem-kafka`): one transaction per polled
//! batch ([`transact`]), each message in a savepoint ([`mark_batch`]) that is rolled back when
//! its step does not keep its writes ([`Step::keep`]): mark its key, run the handler's writes
//! the first time, and decide what the broker does with it ([`mark_and_write`]).

use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;

use idem_core::consumer::{Conflict, Disposition, HandlerError};
use idem_core::extract::{Envelope, KeyExtractor};
use idem_core::{DEFAULT_MAX_KEY_BYTES, DedupKey, Fingerprint, FingerprintSpec, StoreError};
use serde::Serialize;

use crate::Mark;

/// The handler's writes in a batch transaction: a boxed future borrowing the transaction's
/// connection and the message.
pub type BatchWrites<'c, T, E> =
    Pin<Box<dyn Future<Output = Result<T, HandlerError<E>>> + Send + 'c>>;

/// Largest handler result stored with a marker; larger ones (and `null`) are not stored.
pub const MAX_STORED_RESULT: usize = 64 * 1024;

/// A transactional inbox on one driver's connection: [`SqliteInbox`](crate::SqliteInbox),
/// [`PostgresInbox`](crate::PostgresInbox), [`MySqlInbox`](crate::MySqlInbox).
pub trait TxInbox: Sync {
    /// The driver.
    type Db: sqlx::Database<Connection = Self::Conn>;
    /// The driver's connection (a transaction derefs to it).
    type Conn: sqlx::Connection<Database = Self::Db> + Send + 'static;

    /// As the inbox's own `mark`.
    fn mark<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        key: &'a DedupKey,
        fingerprint: Option<Fingerprint>,
    ) -> impl Future<Output = Result<Mark, StoreError>> + Send + 'a;

    /// As the inbox's own `set_result`.
    fn set_result<'a>(
        &'a self,
        conn: &'a mut Self::Conn,
        key: &'a DedupKey,
        result: &'a [u8],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// Whether [`savepoint_sql`](Self::savepoint_sql) takes two statements in one round trip.
    const MULTI_STATEMENT: bool;

    /// Runs `sql` (savepoint statements) on `conn`.
    fn savepoint_sql<'a>(
        conn: &'a mut Self::Conn,
        sql: &'static str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;
}

/// A message's key and fingerprint, or why it can only be dead-lettered.
pub type Prepared = Result<(DedupKey, Option<Fingerprint>), String>;

/// The key (`extractor` under `scope`, at most [`DEFAULT_MAX_KEY_BYTES`]) and the payload
/// fingerprint (`spec`) of `msg`, or why it can only be dead-lettered (no key, an invalid key,
/// a payload that is not JSON when `spec` needs JSON).
pub fn prepare(
    extractor: &dyn KeyExtractor,
    scope: &str,
    spec: &FingerprintSpec,
    msg: &dyn Envelope,
) -> Prepared {
    let id = extractor.extract(msg).map_err(|e| e.to_string())?;
    let key = DedupKey::with_limit(scope, id, DEFAULT_MAX_KEY_BYTES)
        .map_err(|e| format!("invalid dedup key: {e}"))?;
    let fp = spec.fingerprint(msg.payload()).map_err(|e| format!("payload is not JSON: {e}"))?;
    Ok((key, fp))
}

/// The savepoint each message of a batch runs in.
const SET: &str = "SAVEPOINT idem_msg";
const RELEASE: &str = "RELEASE SAVEPOINT idem_msg";
const ROLLBACK: &str = "ROLLBACK TO SAVEPOINT idem_msg";
const RELEASE_AND_SET: &str = "RELEASE SAVEPOINT idem_msg; SAVEPOINT idem_msg";

/// Runs [`mark_and_write`] for each message of a batch inside `conn`'s open transaction, each
/// in a savepoint that is rolled back when the step does not keep its writes. `items` pairs each
/// message with its key and fingerprint, or with the reason it can only be dead-lettered
/// (`failed_permanent`, the database untouched). The caller commits.
///
/// # Errors
/// When a savepoint statement fails: the transaction can no longer be trusted, roll it back
/// (the steps decided so far are lost with it).
pub async fn mark_batch<I, D, T, E, F>(
    inbox: &I,
    conn: &mut I::Conn,
    items: &[(&D, Prepared)],
    writes: &F,
) -> Result<Vec<Step>, sqlx::Error>
where
    I: TxInbox,
    D: Sync,
    T: Serialize,
    E: Display,
    F: for<'c> Fn(&'c mut I::Conn, &'c D) -> BatchWrites<'c, T, E>,
{
    let mut steps = Vec::with_capacity(items.len());
    let mut open = false;
    for (item, prepared) in items {
        let (key, fp) = match prepared {
            Err(reason) => {
                let reason = reason.clone();
                steps.push(Step::new(
                    false,
                    "failed_permanent",
                    Disposition::DeadLetter { reason },
                ));
                continue;
            }
            Ok(x) => x,
        };
        // The previous savepoint is released only now: a step that kept its writes needs no
        // statement of its own after it.
        match (open, I::MULTI_STATEMENT) {
            (false, _) => I::savepoint_sql(conn, SET).await?,
            (true, true) => I::savepoint_sql(conn, RELEASE_AND_SET).await?,
            (true, false) => {
                I::savepoint_sql(conn, RELEASE).await?;
                I::savepoint_sql(conn, SET).await?;
            }
        }
        open = true;
        let step = mark_and_write(inbox, conn, key, *fp, *item, writes).await;
        if !step.keep {
            I::savepoint_sql(conn, ROLLBACK).await?;
        }
        steps.push(step);
    }
    Ok(steps)
}

/// What one message's step decided.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Step {
    /// Whether what the step wrote stands (`false`: roll back to the savepoint, marker and
    /// writes included).
    pub keep: bool,
    /// The outcome, as the adapters' metrics and reports name it.
    pub label: &'static str,
    /// What the broker should do with the message.
    pub disposition: Disposition,
}

impl Step {
    fn new(keep: bool, label: &'static str, disposition: Disposition) -> Self {
        Self { keep, label, disposition }
    }
}

/// A whole batch: begins a transaction with `begin`, runs [`mark_batch`] and commits, then
/// answers each message's outcome label and disposition in order. If the transaction cannot
/// begin, a savepoint fails or the commit fails, nothing of the batch was written: every
/// message is retried except those that dead-letter whatever the database says (their
/// [`Prepared`] is an `Err`). Failures are logged at `warn`.
pub async fn transact<'p, I, D, T, E, F>(
    inbox: &I,
    begin: impl Future<Output = Result<sqlx::Transaction<'p, I::Db>, sqlx::Error>>,
    items: Vec<(&D, Prepared)>,
    writes: &F,
) -> Vec<(&'static str, Disposition)>
where
    I: TxInbox,
    D: Sync,
    T: Serialize,
    E: Display,
    F: for<'c> Fn(&'c mut I::Conn, &'c D) -> BatchWrites<'c, T, E>,
{
    let steps = match begin.await {
        Err(e) => {
            tracing::warn!(target: "idem", error = %e, "could not begin the inbox transaction");
            None
        }
        Ok(mut tx) => match mark_batch(inbox, &mut *tx, &items, writes).await {
            Err(e) => {
                tracing::warn!(target: "idem", error = %e,
                    "inbox savepoint failed; rolling the whole batch back");
                None
            }
            Ok(steps) => match tx.commit().await {
                Ok(()) => Some(steps),
                Err(e) => {
                    tracing::warn!(target: "idem", error = %e,
                        "inbox commit failed; nothing of the batch is committed");
                    None
                }
            },
        },
    };
    match steps {
        Some(steps) => steps.into_iter().map(|s| (s.label, s.disposition)).collect(),
        None => items
            .into_iter()
            .map(|(_, p)| match p {
                Err(reason) => ("failed_permanent", Disposition::DeadLetter { reason }),
                Ok(_) => ("failed_transient", Disposition::Retry { after: None }),
            })
            .collect(),
    }
}

/// Marks `key` on `conn`; the first time, runs `writes` for `item` and stores its result.
/// Processed, duplicate and conflict keep what was written (a conflict is dead-lettered with
/// its reason); a failed mark, a transient failure or a failed result store is retried; a
/// permanent failure is dead-lettered and leaves no marker. Failures are logged at `warn`.
pub async fn mark_and_write<I, D, T, E, F>(
    inbox: &I,
    conn: &mut I::Conn,
    key: &DedupKey,
    fingerprint: Option<Fingerprint>,
    item: &D,
    writes: &F,
) -> Step
where
    I: TxInbox,
    D: Sync,
    T: Serialize,
    E: Display,
    F: for<'c> Fn(&'c mut I::Conn, &'c D) -> BatchWrites<'c, T, E>,
{
    let retry = || Disposition::Retry { after: None };
    match inbox.mark(conn, key, fingerprint).await {
        Err(e) => {
            tracing::warn!(target: "idem", %key, error = %e, "inbox mark failed; retrying");
            Step::new(false, "failed_transient", retry())
        }
        Ok(Mark::First) => match writes(conn, item).await {
            Ok(v) => {
                let stored = serde_json::to_vec(&v)
                    .ok()
                    .filter(|b| b.len() <= MAX_STORED_RESULT && b.as_slice() != b"null");
                match stored {
                    Some(b) => match inbox.set_result(conn, key, &b).await {
                        Ok(()) => Step::new(true, "processed", Disposition::Ack),
                        Err(e) => {
                            tracing::warn!(target: "idem", %key, error = %e,
                                "storing the result failed; retrying");
                            Step::new(false, "failed_transient", retry())
                        }
                    },
                    None => Step::new(true, "processed", Disposition::Ack),
                }
            }
            Err(HandlerError::Transient(e)) => {
                tracing::warn!(target: "idem", %key, error = %e, "handler failed (transient); retrying");
                Step::new(false, "failed_transient", retry())
            }
            Err(HandlerError::Permanent(e)) => Step::new(
                false,
                "failed_permanent",
                Disposition::DeadLetter { reason: format!("handler failed: {e}") },
            ),
        },
        Ok(Mark::Duplicate(_)) => Step::new(true, "duplicate", Disposition::Ack),
        Ok(Mark::Conflict(rec)) => {
            let c = Conflict {
                key: key.clone(),
                stored: rec.fingerprint,
                incoming: fingerprint,
                stored_state: rec.state,
            };
            Step::new(
                true,
                "conflict",
                Disposition::DeadLetter { reason: format!("conflict: {c}") },
            )
        }
        Ok(Mark::InProgress(_)) => Step::new(true, "in_progress_elsewhere", retry()),
    }
}

macro_rules! tx_inbox {
    ($feature:literal, $inbox:ty, $conn:ty, $multi:literal) => {
        #[cfg(feature = $feature)]
        impl TxInbox for $inbox {
            type Db = <$conn as sqlx::Connection>::Database;
            type Conn = $conn;
            const MULTI_STATEMENT: bool = $multi;

            fn mark<'a>(
                &'a self,
                conn: &'a mut $conn,
                key: &'a DedupKey,
                fingerprint: Option<Fingerprint>,
            ) -> impl Future<Output = Result<Mark, StoreError>> + Send + 'a {
                <$inbox>::mark(self, conn, key, fingerprint)
            }

            fn set_result<'a>(
                &'a self,
                conn: &'a mut $conn,
                key: &'a DedupKey,
                result: &'a [u8],
            ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
                <$inbox>::set_result(self, conn, key, result)
            }

            fn savepoint_sql<'a>(
                conn: &'a mut $conn,
                sql: &'static str,
            ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
                async move { sqlx::raw_sql(sql).execute(conn).await.map(|_| ()) }
            }
        }
    };
}

tx_inbox!("sqlite", crate::SqliteInbox, sqlx::sqlite::SqliteConnection, true);
tx_inbox!("postgres", crate::PostgresInbox, sqlx::postgres::PgConnection, true);
tx_inbox!("mysql", crate::MySqlInbox, sqlx::mysql::MySqlConnection, false);
