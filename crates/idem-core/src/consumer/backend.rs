//! What a [`Consumer`] decides with: a [`DedupStore`] (two-phase) or a transactional inbox.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Consumer, Context, HandlerError, Outcome};
use crate::extract::Envelope;
use crate::{DedupStore, StoreError};

/// How a [`Consumer`] turns a fetched batch into outcomes. Two kinds exist:
///
/// - every [`DedupStore`] (**two-phase**): claim the batch with one `claim_many`, run the acquired
///   handlers under their leases, record their completions with one `complete_many`. The
///   handler gets a [`Context`] (attempt, downstream idempotency key).
/// - a **transactional inbox** (the SQL inboxes of `idem-sqlx`): mark the batch's keys inside
///   one database transaction, run the handlers on that transaction, commit once. The handler
///   gets the transaction.
///
/// Broker adapters are written against this trait only, so every adapter has every mode.
///
/// # Contract
/// - `decide` answers one [`Outcome`] per message, in message order.
/// - Every outcome that asks for an ack ([`Outcome::disposition`]) is durable when `decide`
///   returns: a completion recorded, a transaction committed. Nothing else is.
/// - A key repeated inside the batch has its effect at most once; its later copies are
///   duplicates once the first is durable.
/// - Failures to reach a decision are outcomes ([`Outcome::Failed`]), never panics.
pub trait Backend: Send + Sync + Sized {
    /// What the handler receives beside the message.
    type Ctx: Send + 'static;

    /// How long what `decide` records is kept: the retention a broker's redelivery window is
    /// checked against.
    fn retention(consumer: &Consumer<Self>) -> Duration;

    /// The longest a key stays in progress under this backend's leases (`None`: it holds no
    /// leases, as an inbox whose marks live inside a transaction).
    fn lease(consumer: &Consumer<Self>) -> Option<Duration>;

    /// Checks, before the first batch, that what `decide` writes to exists and works as
    /// configured (a store's [`check`](DedupStore::check): its table, its settings); the
    /// warnings it returns are logged by the store. Default: nothing to check.
    ///
    /// # Errors
    /// The store's error ([`StoreError::NotMigrated`] for a missing table).
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    fn check(
        consumer: &Consumer<Self>,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send {
        let _ = consumer;
        async { Ok(Vec::new()) }
    }

    /// Decides `batch`; see the contract above.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped midway, claims may stay in progress until their leases run out
    /// (two-phase) or the transaction is rolled back (inbox). Nothing is lost either way; the
    /// broker redelivers what was not acknowledged.
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
        E: Display + Send + 'a;
}

impl<S: DedupStore> Backend for S {
    type Ctx = Context;

    fn retention(consumer: &Consumer<Self>) -> Duration {
        consumer.retain()
    }

    fn lease(consumer: &Consumer<Self>) -> Option<Duration> {
        Some(consumer.lease())
    }

    fn check(
        consumer: &Consumer<Self>,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send {
        consumer.store().check()
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
        consumer.process_batch(batch, move |ctx, m| handler(ctx, m.clone()))
    }
}
