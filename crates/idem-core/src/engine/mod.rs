//! The engine: every decision about a delivery, written once. Claim (or mark) its key, run the
//! handler only if this delivery owns the key, make the effect durable, and answer exactly one
//! [`Outcome`].
//!
//! An [`Engine`] decides over a [`Backend`]: any [`DedupStore`](crate::DedupStore) (two-phase,
//! with leases) or an [`Inbox`](crate::inbox::Inbox) (the marker commits with the handler's
//! writes). Broker consumers ([`Consumer`](crate::consumer::Consumer)) drive one engine; it
//! also serves on its own ([`Engine::process`]).

mod ahead;
mod backend;
pub(crate) mod batch;
mod builder;
mod complete;
mod context;
mod guard;
mod handler;
pub(crate) mod inbox;
mod observe;
mod offset;
pub(crate) mod prepare;
mod ride;
mod two_phase;
mod txn;

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

pub use crate::outcome::{
    Cause, Conflict, Failure, FailureKind, HandlerError, Outcome, OutcomeKind, Verb,
};
pub(crate) use ahead::Ahead;
pub use backend::Backend;
pub(crate) use backend::mode::Mode;
pub use builder::{
    ConfigError, DEFAULT_CRASH_LOOP_LIMIT, EngineBuilder, ExpiredLeasePolicy, MissingKeyPolicy,
};
pub(crate) use builder::{Settings, engine_setters};
pub use context::Context;
pub use guard::{Finish, Guarded};
pub use handler::Handler;
pub use prepare::KeyFailure;
pub(crate) use ride::{Driver, Ticket, TicketId};

use crate::extract::Envelope;
use builder::Config;

type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Makes a handler idempotent over a [`Backend`]: a [`DedupStore`](crate::DedupStore)
/// (two-phase) or an [`Inbox`](crate::inbox::Inbox) (transactional).
///
/// For each delivery: extract the key, fingerprint the payload, claim `(scope, key)` in the
/// store, then run the handler only if the claim was acquired, and record its completion before
/// returning. The returned [`Outcome`] says what to tell the broker ([`Outcome::verb`]); ack
/// only after `process` returns.
///
/// ```
/// use idem_core::{Engine, MemoryStore, Outcome, extract::Message, engine::HandlerError};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let engine = Engine::builder(MemoryStore::new()).scope("billing").build()?;
/// let msg = Message::new(br#"{"order":"o-1","cents":1200}"#.to_vec()).with_message_id("o-1");
///
/// let charge = |ctx: idem_core::engine::Context| async move {
///     // Pass ctx.downstream_key() to the payment API as its idempotency key.
///     Ok::<_, HandlerError<std::io::Error>>(format!("charged at attempt {}", ctx.attempt()))
/// };
/// assert!(matches!(engine.process(&msg, charge).await, Outcome::Processed(_)));
/// // The redelivery is a duplicate and gets the stored result back.
/// match engine.process(&msg, charge).await {
///     Outcome::Duplicate(Some(r)) => assert_eq!(r, "charged at attempt 1"),
///     other => panic!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
pub struct Engine<B> {
    store: B,
    cfg: Arc<Config>,
    /// Rounds of this engine (and its clones) with takeovers still to run alone: while one
    /// is, no claims are taken ahead, so a takeover that kills the process again holds no
    /// other key.
    solo: Arc<AtomicUsize>,
    /// Claims ahead waiting for a completion to carry them (see [`ride`]).
    rides: Arc<ride::Rides>,
}

impl<B: Clone> Clone for Engine<B> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            cfg: Arc::clone(&self.cfg),
            solo: Arc::clone(&self.solo),
            rides: Arc::clone(&self.rides),
        }
    }
}

impl<B> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("scope", &self.cfg.scope)
            .field("lease", &self.cfg.lease)
            .field("retain", &self.cfg.retain)
            .finish_non_exhaustive()
    }
}

impl<B> Engine<B> {
    /// Starts a builder over `store`: a [`DedupStore`](crate::DedupStore) (two-phase) or an
    /// [`Inbox`](crate::inbox::Inbox).
    pub fn builder(store: B) -> EngineBuilder<B> {
        EngineBuilder::new(store)
    }

    /// The store (or inbox).
    pub fn store(&self) -> &B {
        &self.store
    }

    /// The engine's scope.
    pub fn scope(&self) -> &str {
        &self.cfg.scope
    }

    /// How long a claim holds a key.
    pub fn lease(&self) -> Duration {
        self.cfg.lease
    }

    /// How long completed records are kept (adapters check it against their broker's
    /// redelivery window at startup). An inbox keeps its markers for its own retention.
    pub fn retain(&self) -> Duration {
        self.cfg.retain
    }

    /// The lease heartbeat interval, if one is set. Broker adapters extend the broker's own ack
    /// deadline on the same beat.
    pub fn heartbeat(&self) -> Option<Duration> {
        self.cfg.heartbeat
    }
}

impl<B: Backend> Engine<B> {
    /// Decides a batch of owned messages with whatever this engine's backend is: claims, runs
    /// and records in two-phase mode, one transaction per round in inbox mode. What broker
    /// consumers call; outcomes are in message order, and every effect they acknowledge is
    /// durable.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped midway, claims stay in progress until their leases run out
    /// (two-phase) or the transaction is rolled back (inbox). Nothing is lost either way; the
    /// broker redelivers what was not acknowledged.
    pub async fn decide_batch<M, H>(
        &self,
        batch: &[M],
        handler: &H,
    ) -> Vec<Outcome<H::Value, H::Error>>
    where
        M: Envelope + Clone + Send + Sync + 'static,
        H: Handler<B::Ctx, M>,
    {
        self.decide_batch_ahead(batch, handler, None, None).await
    }

    /// [`decide_batch`](Self::decide_batch) with the claims [`claim_ahead`](Backend::claim_ahead)
    /// took for this batch.
    pub(crate) async fn decide_batch_ahead<M, H>(
        &self,
        batch: &[M],
        handler: &H,
        ahead: Option<Ahead>,
        seat: Option<Driver>,
    ) -> Vec<Outcome<H::Value, H::Error>>
    where
        M: Envelope + Clone + Send + Sync + 'static,
        H: Handler<B::Ctx, M>,
    {
        // Boxed as `dyn Future + Send`: the Send proof is made here, with the lifetimes known.
        // Left to the caller, rustc must prove it for every lifetime of the backend's future
        // and fails ("implementation of `Send` is not general enough") for a spawned run.
        let fut: BoxFuture<'_, Vec<Outcome<H::Value, H::Error>>> =
            Box::pin(B::decide::<M, H, H::Fut, H::Value, H::Error>(
                self, batch, handler, ahead, seat,
            ));
        fut.await
    }
}
