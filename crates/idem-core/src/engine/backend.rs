//! What an [`Engine`] decides with: any [`DedupStore`] (two-phase) or an [`Inbox`] over a
//! [`TxInbox`] (transactional). Implemented here, for those two, and nowhere else: a store or
//! an inbox supplies primitives, the engine owns every decision.

use std::future::Future;
use std::time::Duration;

use std::fmt::Display;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::ahead::Ahead;
use super::inbox::InboxRound;
use super::offset::OffsetRound;
use super::ride::{Driver, Ticket, TicketId};
use super::two_phase::TwoPhase;
use super::{Context, Engine, HandlerError, Outcome};
use crate::extract::Envelope;
use crate::inbox::{Inbox, OffsetInbox, Tx, TxInbox, TxPositions};
use crate::{DedupStore, StoreError};

/// How an [`Engine`] turns a fetched batch into outcomes. Sealed: implemented by every
/// [`DedupStore`] (**two-phase**: claim the batch with one `claim_many`, run the acquired
/// handlers under their leases, record their completions with one `complete_many`; the handler
/// gets a [`Context`]), by [`Inbox`] (**transactional inbox**: mark the batch's keys inside one
/// transaction, run the handlers on it, commit once; the handler gets the transaction, [`Tx`])
/// and by [`OffsetInbox`] (**offset inbox**, for ordered logs: the partitions' positions commit
/// with the handlers' writes, so a redelivery is known by its offset).
///
/// # Contract
/// - A batch gets one [`Outcome`] per message, in message order.
/// - Every outcome that asks for an ack ([`Outcome::verb`]) is durable when the batch's
///   decision returns: a completion recorded, a transaction committed. Nothing else is.
/// - A key repeated inside the batch has its effect at most once; its later copies are
///   duplicates once the first is durable.
/// - Failures to reach a decision are outcomes ([`Outcome::Failed`]), never panics.
///
/// The handler receives `B::Ctx` beside the message: a [`Context`] in two-phase mode, the
/// transaction ([`Tx`]) in both inbox modes.
pub trait Backend: mode::Mode + Send + Sync + Sized + 'static {}

/// The engine's side of a backend, private to the crate: what differs between the modes.
pub(crate) mod mode {
    use super::*;

    /// How each mode decides (see [`Backend`]); implemented here for the three backends and
    /// nowhere else, so no user type can be a backend.
    pub trait Mode: Sized + 'static {
        /// What the handler receives beside the message.
        type Ctx: Send + 'static;

        /// How long what a decision records is kept: the retention a broker's redelivery
        /// window is checked against.
        fn retention(engine: &Engine<Self>) -> Duration;

        /// The longest a key stays in progress under a lease (`None`: none is held).
        fn lease(engine: &Engine<Self>) -> Option<Duration>;

        /// The store's startup check ([`DedupStore::check`], [`TxInbox::check`]).
        ///
        /// # Cancel safety
        /// Cancel safe: it only reads.
        fn check(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

        /// Claims ahead the keys of a batch that will be decided later (two-phase only; by
        /// default, as for the inboxes, nothing is claimed): see [`Ahead`].
        ///
        /// # Cancel safety
        /// Not cancel safe: dropped midway, leases taken stay until they run out.
        fn claim_ahead<'a, M: Envelope + Sync>(
            engine: &'a Engine<Self>,
            batch: &'a [M],
            ticket: Ticket,
        ) -> impl Future<Output = Option<Ahead>> + Send + 'a {
            let _ = (engine, batch, ticket);
            async { None }
        }

        /// A seat for the claims of later batches to ride on the completion of the batch whose
        /// turn comes now (two-phase, on a store that combines writes): see
        /// [`ride`](super::super::ride). Taken by the lane before it fetches the next batch.
        fn seat(engine: &Engine<Self>, ticket: TicketId) -> Option<Driver> {
            let _ = (engine, ticket);
            None
        }

        /// A ticket for a batch just fetched (see [`ride`](super::super::ride)), handed to
        /// [`claim_ahead`](Self::claim_ahead).
        fn ticket(engine: &Engine<Self>) -> Ticket {
            let _ = engine;
            Ticket::new()
        }

        /// Gives back what [`claim_ahead`](Self::claim_ahead) took and no decision used.
        fn drop_ahead(engine: &Engine<Self>, ahead: Ahead) -> impl Future<Output = ()> + Send + '_ {
            let _ = (engine, ahead);
            async {}
        }

        /// Decides `batch` (with the claims taken ahead for it, if any, and its seat for claims
        /// riding on its completion); see the contract of [`Backend`].
        ///
        /// # Cancel safety
        /// As [`Engine::decide_batch`].
        fn decide<'a, M, H, Fut, T, E>(
            engine: &'a Engine<Self>,
            batch: &'a [M],
            handler: &'a H,
            ahead: Option<Ahead>,
            seat: Option<Driver>,
        ) -> impl Future<Output = Vec<Outcome<T, E>>> + Send + 'a
        where
            M: Envelope + Clone + Send + Sync + 'static,
            H: Fn(Self::Ctx, M) -> Fut + Sync,
            Fut: Future<Output = Result<T, HandlerError<E>>> + Send + 'a,
            T: Serialize + DeserializeOwned + Send + 'a,
            E: Display + Send + 'a;
    }
}

use mode::Mode;

impl<S: DedupStore> Backend for S {}

impl<S: DedupStore> Mode for S {
    type Ctx = Context;

    fn retention(engine: &Engine<Self>) -> Duration {
        engine.retain()
    }

    fn lease(engine: &Engine<Self>) -> Option<Duration> {
        Some(engine.lease())
    }

    fn check(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        let checked = DedupStore::check(self);
        async move { checked.await.map(drop) }
    }

    fn claim_ahead<'a, M: Envelope + Sync>(
        engine: &'a Engine<Self>,
        batch: &'a [M],
        ticket: Ticket,
    ) -> impl Future<Output = Option<Ahead>> + Send + 'a {
        engine.claim_ahead(batch, ticket)
    }

    fn drop_ahead(engine: &Engine<Self>, ahead: Ahead) -> impl Future<Output = ()> + Send + '_ {
        engine.drop_ahead(ahead)
    }

    fn seat(engine: &Engine<Self>, ticket: TicketId) -> Option<Driver> {
        engine.carpool_seat(ticket)
    }

    fn ticket(engine: &Engine<Self>) -> Ticket {
        engine.ticket()
    }

    fn decide<'a, M, H, Fut, T, E>(
        engine: &'a Engine<Self>,
        batch: &'a [M],
        handler: &'a H,
        ahead: Option<Ahead>,
        seat: Option<Driver>,
    ) -> impl Future<Output = Vec<Outcome<T, E>>> + Send + 'a
    where
        M: Envelope + Clone + Send + Sync + 'static,
        H: Fn(Self::Ctx, M) -> Fut + Sync,
        Fut: Future<Output = Result<T, HandlerError<E>>> + Send + 'a,
        T: Serialize + DeserializeOwned + Send + 'a,
        E: Display + Send + 'a,
    {
        let by_index = move |ctx: Context, i: usize| handler(ctx, batch[i].clone());
        async move {
            let mut ahead = ahead;
            let prepared = ahead.as_mut().map(Ahead::take_prepared).unwrap_or_default();
            // Only a lane's decisions drive (a seat comes with their turn): other callers carry
            // nothing and wait for nothing.
            let mode = TwoPhase::new(engine, &by_index, batch).carrying(seat.as_ref());
            engine.decide_in_rounds(batch, &mode, prepared, ahead).await
        }
    }
}

impl<I: TxInbox> Backend for Inbox<I> {}

impl<I: TxInbox> Mode for Inbox<I> {
    type Ctx = Tx<I>;

    fn retention(engine: &Engine<Self>) -> Duration {
        engine.store().retention()
    }

    fn lease(_: &Engine<Self>) -> Option<Duration> {
        None
    }

    fn check(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        let checked = self.inner().check();
        async move { checked.await.map(drop) }
    }

    async fn decide<'a, M, H, Fut, T, E>(
        engine: &'a Engine<Self>,
        batch: &'a [M],
        handler: &'a H,
        _: Option<Ahead>,
        _: Option<Driver>,
    ) -> Vec<Outcome<T, E>>
    where
        M: Envelope + Clone + Send + Sync + 'static,
        H: Fn(Self::Ctx, M) -> Fut + Sync,
        Fut: Future<Output = Result<T, HandlerError<E>>> + Send + 'a,
        T: Serialize + DeserializeOwned + Send + 'a,
        E: Display + Send + 'a,
    {
        let mode = InboxRound { engine, handler, msgs: batch };
        engine.decide_in_rounds(batch, &mode, Vec::new(), None).await
    }
}

impl<I: TxPositions> Backend for OffsetInbox<I> {}

impl<I: TxPositions> Mode for OffsetInbox<I> {
    type Ctx = Tx<I>;

    /// Redeliveries are recognised by their offsets however old they are; only producer
    /// duplicates depend on the markers' window, which no broker setting bounds.
    fn retention(_: &Engine<Self>) -> Duration {
        Duration::MAX
    }

    fn lease(_: &Engine<Self>) -> Option<Duration> {
        None
    }

    fn check(&self) -> impl Future<Output = Result<(), StoreError>> + Send {
        OffsetInbox::check(self)
    }

    async fn decide<'a, M, H, Fut, T, E>(
        engine: &'a Engine<Self>,
        batch: &'a [M],
        handler: &'a H,
        _: Option<Ahead>,
        _: Option<Driver>,
    ) -> Vec<Outcome<T, E>>
    where
        M: Envelope + Clone + Send + Sync + 'static,
        H: Fn(Self::Ctx, M) -> Fut + Sync,
        Fut: Future<Output = Result<T, HandlerError<E>>> + Send + 'a,
        T: Serialize + DeserializeOwned + Send + 'a,
        E: Display + Send + 'a,
    {
        let mode = OffsetRound { engine, handler, msgs: batch };
        engine.decide_in_rounds(batch, &mode, Vec::new(), None).await
    }
}
