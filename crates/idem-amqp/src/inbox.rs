//! Transactional-inbox mode on SQLite: the marker commits with the handler's writes.

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;

use idem_core::consumer::{Cause, Conflict, Failure, FailureKind, HandlerError};
use idem_core::{DedupStore, Outcome, StoreError};
use idem_sqlx::{MAX_RESULT_BYTES, Mark, SqliteInbox, Writes};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::sqlite::{SqliteConnection, SqlitePool};

use crate::{AmqpConsumer, AmqpMessage, Error, Stats};

impl<S: DedupStore> AmqpConsumer<S> {
    /// Consumes in **transactional-inbox mode** until `shutdown` completes. Each batch of
    /// deliveries is one `BEGIN IMMEDIATE` transaction on `pool`: for each delivery, under a
    /// savepoint, the key is marked in `inbox` and `writes` runs on the same connection only if
    /// the mark is first; then the transaction commits, and only then are the deliveries
    /// settled. A crash before the commit leaves nothing; a crash between commit and ack makes
    /// the redeliveries duplicates. One commit (one fsync) per batch instead of per message.
    ///
    /// The key and fingerprint come from the engine's configuration (its extractor and
    /// fingerprint spec); the engine's store is not used. A message without a key is
    /// dead-lettered whatever the engine's missing-key policy. A [`HandlerError::Permanent`]
    /// from `writes` rolls back that delivery's savepoint and dead-letters it; a transient one
    /// rolls it back and requeues it. If the transaction itself fails, every delivery of the
    /// batch is requeued. `writes` must not commit or roll back the transaction.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idem_amqp::AmqpConsumer;
    /// use idem_core::{Consumer, consumer::HandlerError};
    /// use idem_sqlx::SqliteStore;
    ///
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = SqliteStore::open("orders.sqlite").await?;
    /// sqlx::query("CREATE TABLE IF NOT EXISTS orders (id TEXT, body BLOB)").execute(store.pool()).await?;
    /// let inbox = store.inbox(Duration::from_secs(7 * 86_400));
    /// let conn = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
    /// let engine = Consumer::builder(store.clone()).scope("order-writer").build()?;
    /// let consumer = AmqpConsumer::builder(engine, "orders").connect(&conn).await?;
    /// consumer
    ///     .run_inbox(&inbox, store.pool(), |conn, msg| Box::pin(async move {
    ///         sqlx::query("INSERT INTO orders VALUES (?, ?)")
    ///             .bind(msg.properties().message_id().as_ref().map(|s| s.to_string()))
    ///             .bind(msg.payload())
    ///             .execute(&mut *conn)
    ///             .await
    ///             .map_err(HandlerError::Transient)?;
    ///         Ok(())
    ///     }), std::future::pending())
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error`] when the connection or channel fails; unacked messages are then redelivered.
    pub async fn run_inbox<W, T, E>(
        self,
        inbox: &SqliteInbox,
        pool: &SqlitePool,
        writes: W,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Stats, Error>
    where
        W: for<'c> Fn(&'c mut SqliteConnection, AmqpMessage) -> Writes<'c, T, HandlerError<E>>,
        T: Serialize + DeserializeOwned,
        E: Display,
    {
        let mut stream = self.consume().await?;
        let mut shutdown = std::pin::pin!(shutdown);
        let mut stats = Stats::default();
        while let Some(batch) = self.fetch(&mut stream, shutdown.as_mut(), &mut stats).await? {
            let outcomes = self.inbox_batch(inbox, pool, &writes, &batch).await;
            for (m, outcome) in batch.iter().zip(&outcomes) {
                self.observe_inbox(m, outcome);
                self.settle(m, outcome, &mut stats).await?;
            }
        }
        self.close(stream, &mut stats).await;
        Ok(stats)
    }

    /// One transaction for the batch, a savepoint per delivery: a failed write rolls back only
    /// its own delivery; the commit makes every processed delivery durable at once.
    async fn inbox_batch<W, T, E>(
        &self,
        inbox: &SqliteInbox,
        pool: &SqlitePool,
        writes: &W,
        batch: &[AmqpMessage],
    ) -> Vec<Outcome<T, E>>
    where
        W: for<'c> Fn(&'c mut SqliteConnection, AmqpMessage) -> Writes<'c, T, HandlerError<E>>,
        T: Serialize + DeserializeOwned,
        E: Display,
    {
        let backend = |op, e: sqlx::Error| StoreError::backend(op, true, e);
        let mut tx = match pool.begin_with("BEGIN IMMEDIATE").await {
            Ok(tx) => tx,
            Err(e) => {
                let e = Arc::new(backend("begin", e));
                return batch.iter().map(|_| transient_store(&e)).collect();
            }
        };
        let mut out = Vec::with_capacity(batch.len());
        for m in batch {
            match self.inbox_one(inbox, &mut tx, writes, m).await {
                Ok(o) => out.push(o),
                Err(e) => {
                    // The transaction is unusable: nothing of the batch is committed.
                    drop(tx);
                    let e = Arc::new(e);
                    return batch.iter().map(|_| transient_store(&e)).collect();
                }
            }
        }
        if let Err(e) = tx.commit().await {
            let e = Arc::new(backend("commit", e));
            return out
                .into_iter()
                .map(|o| match o {
                    Outcome::Processed(_) => transient_store(&e),
                    other => other,
                })
                .collect();
        }
        out
    }

    /// Marks and writes one delivery under a savepoint. `Err` when the transaction itself
    /// failed (the batch is then rolled back).
    async fn inbox_one<W, T, E>(
        &self,
        inbox: &SqliteInbox,
        conn: &mut SqliteConnection,
        writes: &W,
        m: &AmqpMessage,
    ) -> Result<Outcome<T, E>, StoreError>
    where
        W: for<'c> Fn(&'c mut SqliteConnection, AmqpMessage) -> Writes<'c, T, HandlerError<E>>,
        T: Serialize + DeserializeOwned,
        E: Display,
    {
        let failed = |kind, cause| Ok(Outcome::Failed(Failure { kind, cause }));
        let key = match self.engine.key_of(m) {
            Ok(k) => k,
            Err(e) => return failed(FailureKind::Permanent, e.into()),
        };
        let fp = match self.engine.fingerprint_of(m) {
            Ok(fp) => fp,
            Err(e) => return failed(FailureKind::Permanent, Cause::Payload(e)),
        };
        let sql = |q: &'static str| sqlx::query(q);
        let step = |op| move |e| StoreError::backend(op, true, e);
        sql("SAVEPOINT idem_delivery").execute(&mut *conn).await.map_err(step("savepoint"))?;
        let mark = inbox.mark(conn, &key, fp).await?;
        let outcome = match mark {
            Mark::First => match writes(conn, m.clone()).await {
                Ok(v) => {
                    if let Ok(bytes) = serde_json::to_vec(&v)
                        && bytes.len() <= MAX_RESULT_BYTES
                    {
                        inbox.set_result(conn, &key, &bytes).await?;
                    }
                    Outcome::Processed(v)
                }
                Err(e) => {
                    sql("ROLLBACK TO idem_delivery")
                        .execute(&mut *conn)
                        .await
                        .map_err(step("rollback to savepoint"))?;
                    let (kind, e) = match e {
                        HandlerError::Transient(e) => (FailureKind::Transient, e),
                        HandlerError::Permanent(e) => (FailureKind::Permanent, e),
                    };
                    Outcome::Failed(Failure { kind, cause: Cause::Handler(e) })
                }
            },
            Mark::Duplicate(rec) => {
                match rec.result.as_deref().map(serde_json::from_slice).transpose() {
                    Ok(v) => Outcome::Duplicate(v),
                    Err(e) => Outcome::Failed(Failure {
                        kind: FailureKind::Permanent,
                        cause: Cause::Decode(e),
                    }),
                }
            }
            Mark::Conflict(rec) => Outcome::Conflict(Box::new(Conflict {
                key,
                stored: rec.fingerprint,
                incoming: fp,
                stored_state: rec.state,
            })),
            // A two-phase consumer in the same scope holds a lease on the key.
            _ => Outcome::InProgressElsewhere { retry_after: self.min_delay },
        };
        sql("RELEASE idem_delivery")
            .execute(&mut *conn)
            .await
            .map_err(step("release savepoint"))?;
        Ok(outcome)
    }

    fn observe_inbox<T, E: Display>(&self, m: &AmqpMessage, outcome: &Outcome<T, E>) {
        let label = outcome.label();
        let scope = self.engine.scope().to_owned();
        metrics::counter!("idem_outcomes_total", "scope" => scope, "outcome" => label).increment(1);
        let key = m.properties().message_id().as_ref().map(|s| s.to_string()).unwrap_or_default();
        match outcome {
            Outcome::Failed(f) => tracing::warn!(target: "idem", scope = self.engine.scope(),
                %key, outcome = label, detail = %f.cause, "inbox delivery finished"),
            _ => tracing::debug!(target: "idem", scope = self.engine.scope(), %key,
                outcome = label, "inbox delivery finished"),
        }
    }
}

/// The failure shared by every delivery of a batch whose transaction failed.
#[derive(Debug, thiserror::Error)]
#[error("the inbox transaction of this delivery's batch failed")]
struct BatchFailed(#[source] Arc<StoreError>);

fn transient_store<T, E>(e: &Arc<StoreError>) -> Outcome<T, E> {
    Outcome::Failed(Failure {
        kind: FailureKind::Transient,
        cause: Cause::Store(StoreError::backend("inbox batch", true, BatchFailed(Arc::clone(e)))),
    })
}
