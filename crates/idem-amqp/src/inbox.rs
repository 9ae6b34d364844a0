//! Transactional-inbox mode on SQLite: the marker commits with the handler's writes.

use std::fmt::Display;
use std::future::Future;

use idem_core::consumer::{Cause, Conflict, Failure, FailureKind, HandlerError};
use idem_core::{DedupStore, Outcome, StoreError};
use idem_sqlx::{InboxError, InboxOutcome, SqliteInbox, Writes};
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::sqlite::{SqliteConnection, SqlitePool};

use crate::{AmqpConsumer, AmqpMessage, Error, Stats};

impl<S: DedupStore> AmqpConsumer<S> {
    /// Consumes in **transactional-inbox mode** until `shutdown` completes: for each delivery,
    /// one `BEGIN IMMEDIATE` transaction on `pool` marks the key in `inbox`, runs `writes` on
    /// the same connection only if the mark is first, and commits; the ack follows the commit.
    /// A crash before the commit leaves nothing; a crash between commit and ack makes the
    /// redelivery a duplicate.
    ///
    /// The key and fingerprint come from the engine's configuration (its extractor and
    /// fingerprint spec); the engine's store is not used. SQLite has one writer, so deliveries
    /// of a batch commit one after another, each in its own transaction; a message without a
    /// key is dead-lettered whatever the engine's missing-key policy. A
    /// [`HandlerError::Permanent`] from `writes` rolls back and dead-letters; a transient one
    /// rolls back and requeues.
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
            for m in &batch {
                let outcome = self.inbox_one(inbox, pool, &writes, m).await;
                self.observe_inbox(m, &outcome);
                self.settle(m, &outcome, &mut stats).await?;
            }
        }
        self.close(stream, &mut stats).await;
        Ok(stats)
    }

    async fn inbox_one<W, T, E>(
        &self,
        inbox: &SqliteInbox,
        pool: &SqlitePool,
        writes: &W,
        m: &AmqpMessage,
    ) -> Outcome<T, E>
    where
        W: for<'c> Fn(&'c mut SqliteConnection, AmqpMessage) -> Writes<'c, T, HandlerError<E>>,
        T: Serialize + DeserializeOwned,
        E: Display,
    {
        let failed = |kind, cause| Outcome::Failed(Failure { kind, cause });
        let key = match self.engine.key_of(m) {
            Ok(k) => k,
            Err(e) => return failed(FailureKind::Permanent, e.into()),
        };
        let fp = match self.engine.fingerprint_of(m) {
            Ok(fp) => fp,
            Err(e) => return failed(FailureKind::Permanent, Cause::Payload(e)),
        };
        let msg = m.clone();
        match inbox.process(pool, &key, fp, move |conn| writes(conn, msg)).await {
            Ok(InboxOutcome::Processed(v)) => Outcome::Processed(v),
            Ok(InboxOutcome::Duplicate(v)) => Outcome::Duplicate(v),
            Ok(InboxOutcome::Conflict(rec)) => Outcome::Conflict(Box::new(Conflict {
                key,
                stored: rec.fingerprint,
                incoming: fp,
                stored_state: rec.state,
            })),
            // A two-phase consumer in the same scope holds a lease on the key.
            Ok(InboxOutcome::InProgress(_)) => {
                Outcome::InProgressElsewhere { retry_after: self.min_delay }
            }
            Err(InboxError::Writes(HandlerError::Permanent(e))) => {
                failed(FailureKind::Permanent, Cause::Handler(e))
            }
            Err(InboxError::Writes(HandlerError::Transient(e))) => {
                failed(FailureKind::Transient, Cause::Handler(e))
            }
            Err(InboxError::Store(e)) => failed(FailureKind::Transient, Cause::Store(e)),
            Ok(_) | Err(_) => failed(
                FailureKind::Transient,
                Cause::Store(StoreError::backend("inbox", true, "unknown inbox error")),
            ),
        }
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
