//! Transactional-inbox mode on SQLite: the marker commits with the handler's writes.

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;

use idem_core::consumer::HandlerError;
use idem_core::{DedupStore, Outcome, StoreError};
use idem_sqlx::{MAX_RESULT_BYTES, Mark, SqliteInbox, Writes};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::sqlite::{SqliteConnection, SqlitePool};

use super::{commit_failed, failed_writes, transient_store};
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
            return commit_failed(out, &Arc::new(backend("commit", e)));
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
        let (key, fp) = match self.inbox_key(m) {
            Ok(k) => k,
            Err(o) => return Ok(o),
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
                    failed_writes(e)
                }
            },
            other => self.not_first(other, key, fp),
        };
        sql("RELEASE idem_delivery")
            .execute(&mut *conn)
            .await
            .map_err(step("release savepoint"))?;
        Ok(outcome)
    }
}
