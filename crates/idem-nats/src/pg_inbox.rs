//! Transactional-inbox mode on PostgreSQL: dedup markers commit with the handler's writes,
//! then the ack.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::Context as JetStream;
use async_nats::jetstream::consumer::PullConsumer;
use idem_core::extract::{Envelope, KeyExtractor, MessageId};
use idem_core::{DedupKey, FingerprintSpec, RetentionWindow};
use idem_sqlx::{PostgresInbox, PostgresStore};
use serde::Serialize;
use sqlx::postgres::{PgConnection, PgPool};

use crate::consumer::{Verdicts, settle};
use crate::source::{Source, Verdict};
use crate::{Delivery, Error, Report, Settings};

use crate::inbox_common::InboxWrites;
use idem_sqlx::batch::transact;

crate::inbox_common::inbox_consumer! {
    /// A JetStream pull consumer over the PostgreSQL transactional inbox (R4), the twin of
    /// [`InboxConsumer`](crate::InboxConsumer): for each fetched batch, one transaction marks every
    /// key and runs the handler's writes for the new ones (each message inside its own savepoint, so
    /// a failing message rolls back alone), commits, and only then acks. A crash before the commit
    /// leaves nothing; a crash after it leaves markers that make the redelivered copies duplicates.
    ///
    /// Competing consumers that mark the same key wait for each other on its row lock; a deadlock
    /// between two batches (PostgreSQL aborts one statement) is a transient failure of that message
    /// only: its savepoint is rolled back and the message is `Nak`ed. Use the default
    /// `READ COMMITTED` isolation.
    ///
    /// Outcomes map as in [`JetStreamConsumer`](crate::JetStreamConsumer). A permanent failure is
    /// dead-lettered and leaves no marker (a resubmitted copy runs again).
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use async_nats::jetstream;
    /// use idem_core::consumer::HandlerError;
    /// use idem_nats::{PgInboxConsumer, Settings};
    /// use idem_sqlx::PostgresStore;
    ///
    /// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let js = jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
    /// let pull = js.get_stream("ORDERS").await?.get_consumer("order-writer").await?;
    /// let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
    /// let inbox = PgInboxConsumer::new(js, pull, &store, "order-writer",
    ///     Duration::from_secs(7 * 86_400), Settings::new("orders.dlq")).await?;
    /// let batch = inbox.fetch().await?;
    /// let verdicts = inbox.process(&batch, |conn, msg| Box::pin(async move {
    ///     sqlx::query("INSERT INTO orders (body) VALUES ($1)").bind(msg.payload_bytes().to_vec())
    ///         .execute(&mut *conn).await.map_err(HandlerError::Transient)?;
    ///     Ok(())
    /// })).await;
    /// let report = inbox.settle(batch, verdicts).await; // acks after the commit
    /// println!("{report}");
    /// # Ok(()) }
    /// ```
    PgInboxConsumer,
    inbox: PostgresInbox,
    store: PostgresStore,
    conn: PgConnection,
    pool: PgPool,
    begin: |pool| pool.begin(),
}
