//! What both inbox modes share.

use std::future::Future;
use std::pin::Pin;

use idem_core::consumer::HandlerError;

/// The handler's writes in inbox mode: a boxed future borrowing the batch transaction's
/// connection and the delivery.
pub type InboxWrites<'c, T, E> =
    Pin<Box<dyn Future<Output = Result<T, HandlerError<E>>> + Send + 'c>>;

/// Largest handler result stored with a marker.
pub(crate) const MAX_STORED_RESULT: usize = 64 * 1024;
