//! What a handler is: named once, for every mode and every broker.

use std::fmt::Display;
use std::future::Future;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::HandlerError;

/// A message handler: an async function of the handler's context (a [`Context`](super::Context)
/// in two-phase mode, the batch's transaction in inbox mode) and the delivery, returning a
/// value (stored for duplicates) or a [`HandlerError`] saying whether to retry.
///
/// Implemented for every closure of that shape, so a closure is written as usual and its
/// argument types are inferred from the consumer:
///
/// ```
/// use idem_core::engine::{Context, Handler, HandlerError};
/// use idem_core::extract::Message;
///
/// fn takes<H: Handler<Context, Message>>(h: H) -> H { h }
/// let charge = takes(|ctx, msg| async move {
///     let _ = (ctx.downstream_key(), msg.payload.len()); // types inferred
///     Ok::<_, HandlerError<String>>("charged".to_owned())
/// });
/// ```
pub trait Handler<C, M>: Fn(C, M) -> Self::Fut + Sync {
    /// The future the handler returns.
    type Fut: Future<Output = Result<Self::Value, HandlerError<Self::Error>>> + Send;
    /// What a successful run returns: stored (as JSON) and handed to duplicates.
    type Value: Serialize + DeserializeOwned + Send;
    /// The handler's own error, kept in the outcome.
    type Error: Display + Send;
}

impl<F, C, M, Fut, T, E> Handler<C, M> for F
where
    F: Fn(C, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    type Fut = Fut;
    type Value = T;
    type Error = E;
}
