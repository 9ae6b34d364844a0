//! Transactional-inbox mode on PostgreSQL: the marker commits with the handler's writes.

use std::fmt::Display;
use std::future::Future;
use std::sync::Arc;

use idem_core::consumer::HandlerError;
use idem_core::{DedupKey, DedupStore, Fingerprint, Outcome, StoreError};
use idem_sqlx::postgres::PgWrites;
use idem_sqlx::{MAX_RESULT_BYTES, Mark, PostgresInbox};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::postgres::{PgConnection, PgPool};

use super::{commit_failed, failed_writes, transient_store};
use crate::{AmqpConsumer, AmqpMessage, Error, Stats};

impl<S: DedupStore> AmqpConsumer<S> {
    /// Consumes in **transactional-inbox mode** on PostgreSQL until `shutdown` completes: the
    /// twin of [`AmqpConsumer::run_inbox`]. Each batch of deliveries is one transaction on
    /// `pool` (`READ COMMITTED`, as [`PostgresInbox`] requires): for each delivery, under a
    /// savepoint, the key is marked in `inbox` and `writes` runs on the same connection only if
    /// the mark is first; then the transaction commits, and only then are the deliveries
    /// settled. A crash before the commit leaves nothing; a crash between commit and ack makes
    /// the redeliveries duplicates. One commit per batch.
    ///
    /// Within a batch the deliveries are marked in the order of their key hashes (copies of one
    /// key keep their order), so two consumers whose batches share keys wait on each other's
    /// row locks instead of deadlocking; `writes` therefore sees a batch's deliveries in that
    /// order, not in delivery order. A second consumer marking a key that an uncommitted batch
    /// holds waits for that commit, then sees a duplicate.
    ///
    /// The key and fingerprint come from the engine's configuration; the engine's store is not
    /// used. A message without a key is dead-lettered whatever the engine's missing-key policy.
    /// A [`HandlerError::Permanent`] from `writes` rolls back that delivery's savepoint (which
    /// also recovers the transaction after a failed statement) and dead-letters it; a transient
    /// one rolls it back and requeues it. If the transaction itself fails, every delivery of
    /// the batch is requeued. `writes` must not commit or roll back the transaction.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use idem_amqp::AmqpConsumer;
    /// use idem_core::{Consumer, consumer::HandlerError};
    /// use idem_sqlx::PostgresStore;
    ///
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
    /// sqlx::query("CREATE TABLE IF NOT EXISTS orders (id TEXT, body BYTEA)").execute(store.pool()).await?;
    /// let inbox = store.inbox(Duration::from_secs(7 * 86_400));
    /// let conn = lapin::Connection::connect("amqp://127.0.0.1:5672/%2f", Default::default()).await?;
    /// let engine = Consumer::builder(store.clone()).scope("order-writer").build()?;
    /// let consumer = AmqpConsumer::builder(engine, "orders").connect(&conn).await?;
    /// consumer
    ///     .run_postgres_inbox(&inbox, store.pool(), |conn, msg| Box::pin(async move {
    ///         sqlx::query("INSERT INTO orders VALUES ($1, $2)")
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
    pub async fn run_postgres_inbox<W, T, E>(
        self,
        inbox: &PostgresInbox,
        pool: &PgPool,
        writes: W,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<Stats, Error>
    where
        W: for<'c> Fn(&'c mut PgConnection, AmqpMessage) -> PgWrites<'c, T, HandlerError<E>>,
        T: Serialize + DeserializeOwned,
        E: Display,
    {
        let mut stream = self.consume().await?;
        let mut shutdown = std::pin::pin!(shutdown);
        let mut stats = Stats::default();
        while let Some(batch) = self.fetch(&mut stream, shutdown.as_mut(), &mut stats).await? {
            let outcomes = self.pg_batch(inbox, pool, &writes, &batch).await;
            for (m, outcome) in batch.iter().zip(&outcomes) {
                self.observe_inbox(m, outcome);
                self.settle(m, outcome, &mut stats).await?;
            }
        }
        self.close(stream, &mut stats).await;
        Ok(stats)
    }

    /// One transaction for the batch, a savepoint per delivery, marks in key-hash order.
    async fn pg_batch<W, T, E>(
        &self,
        inbox: &PostgresInbox,
        pool: &PgPool,
        writes: &W,
        batch: &[AmqpMessage],
    ) -> Vec<Outcome<T, E>>
    where
        W: for<'c> Fn(&'c mut PgConnection, AmqpMessage) -> PgWrites<'c, T, HandlerError<E>>,
        T: Serialize + DeserializeOwned,
        E: Display,
    {
        let mut out: Vec<Option<Outcome<T, E>>> = batch.iter().map(|_| None).collect();
        let mut keyed = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            match self.inbox_key(m) {
                Ok((key, fp)) => keyed.push((i, key, fp)),
                Err(o) => out[i] = Some(o),
            }
        }
        // Row locks taken in one global order: batches sharing keys cannot deadlock. The sort
        // is stable, so copies of one key keep their delivery order.
        keyed.sort_by_key(|k| k.1.hash().0);
        let backend = |op, e: sqlx::Error| StoreError::backend(op, true, e);
        let all_failed = |e: StoreError| {
            let e = Arc::new(e);
            batch.iter().map(|_| transient_store(&e)).collect()
        };
        if !keyed.is_empty() {
            let mut tx = match pool.begin().await {
                Ok(tx) => tx,
                Err(e) => return all_failed(backend("begin", e)),
            };
            for (i, key, fp) in keyed {
                match self.pg_one(inbox, &mut tx, writes, &batch[i], key, fp).await {
                    Ok(o) => out[i] = Some(o),
                    // The transaction is unusable: nothing of the batch is committed.
                    Err(e) => return all_failed(e),
                }
            }
            if let Err(e) = tx.commit().await {
                let out = out.into_iter().map(|o| o.expect("decided")).collect();
                return commit_failed(out, &Arc::new(backend("commit", e)));
            }
        }
        out.into_iter().map(|o| o.expect("every delivery of the batch is decided")).collect()
    }

    /// Marks and writes one delivery under a savepoint. `Err` when the transaction itself
    /// failed (the batch is then rolled back).
    async fn pg_one<W, T, E>(
        &self,
        inbox: &PostgresInbox,
        conn: &mut PgConnection,
        writes: &W,
        m: &AmqpMessage,
        key: DedupKey,
        fp: Option<Fingerprint>,
    ) -> Result<Outcome<T, E>, StoreError>
    where
        W: for<'c> Fn(&'c mut PgConnection, AmqpMessage) -> PgWrites<'c, T, HandlerError<E>>,
        T: Serialize + DeserializeOwned,
        E: Display,
    {
        let sql = |q: &'static str| sqlx::query(q);
        let step = |op| move |e| StoreError::backend(op, true, e);
        sql("SAVEPOINT idem_delivery").execute(&mut *conn).await.map_err(step("savepoint"))?;
        let outcome = match inbox.mark(conn, &key, fp).await? {
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
                    sql("ROLLBACK TO SAVEPOINT idem_delivery")
                        .execute(&mut *conn)
                        .await
                        .map_err(step("rollback to savepoint"))?;
                    failed_writes(e)
                }
            },
            other => self.not_first(other, key, fp),
        };
        sql("RELEASE SAVEPOINT idem_delivery")
            .execute(&mut *conn)
            .await
            .map_err(step("release savepoint"))?;
        Ok(outcome)
    }
}
