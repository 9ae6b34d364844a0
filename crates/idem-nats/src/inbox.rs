//! Transactional-inbox mode: dedup markers commit with the handler's writes, then the ack.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::Context as JetStream;
use async_nats::jetstream::consumer::PullConsumer;
use idem_core::extract::{Envelope, KeyExtractor, MessageId};
use idem_core::{DedupKey, FingerprintSpec, RetentionWindow};
use idem_sqlx::{SqliteInbox, SqliteStore};
use serde::Serialize;
use sqlx::sqlite::{SqliteConnection, SqlitePool};

use crate::consumer::{Verdicts, settle};
use crate::source::{Source, Verdict};
use crate::{Delivery, Error, Report, Settings};

use crate::inbox_common::InboxWrites;
use idem_sqlx::batch::transact;

crate::inbox_common::inbox_consumer! {
    /// A JetStream pull consumer over the SQLite transactional inbox (R4): for each fetched batch,
    /// one `BEGIN IMMEDIATE` transaction marks every key and runs the handler's writes for the new
    /// ones (each message inside its own savepoint, so a failing message rolls back alone), commits,
    /// and only then acks. A crash before the commit leaves nothing; a crash after it leaves markers
    /// that make the redelivered copies duplicates.
    ///
    /// Outcomes map as in [`JetStreamConsumer`](crate::JetStreamConsumer). A permanent failure is
    /// dead-lettered and leaves no marker (a resubmitted copy runs again).
    ///
    /// SQLite has one writer: the batch transaction holds the database's write lock from its
    /// first mark to its commit, so a handler that stalls inside it stalls every other writer of
    /// that file (other consumers, other processes) until it returns or their `busy_timeout`
    /// runs out. Keep slow calls (HTTP, brokers) out of inbox handlers, bound them with a
    /// timeout, or use `PgInboxConsumer` (feature `postgres`), whose transactions lock
    /// rows, not the database.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use async_nats::jetstream;
    /// use idem_core::consumer::HandlerError;
    /// use idem_nats::{InboxConsumer, Settings};
    /// use idem_sqlx::SqliteStore;
    ///
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let js = jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
    /// let pull = js.get_stream("ORDERS").await?.get_consumer("order-writer").await?;
    /// let store = SqliteStore::open("shop.sqlite").await?;
    /// let inbox = InboxConsumer::new(js, pull, &store, "order-writer",
    ///     Duration::from_secs(7 * 86_400), Settings::new("orders.dlq")).await?;
    /// let batch = inbox.fetch().await?;
    /// let verdicts = inbox.process(&batch, |conn, msg| Box::pin(async move {
    ///     sqlx::query("INSERT INTO orders (body) VALUES (?)").bind(msg.payload_bytes().to_vec())
    ///         .execute(&mut *conn).await.map_err(HandlerError::Transient)?;
    ///     Ok(())
    /// })).await;
    /// let report = inbox.settle(batch, verdicts).await; // acks after the commit
    /// println!("{report}");
    /// # Ok(()) }
    /// ```
    InboxConsumer,
    inbox: SqliteInbox,
    store: SqliteStore,
    conn: SqliteConnection,
    pool: SqlitePool,
    begin: |pool| pool.begin_with("BEGIN IMMEDIATE"),
}
