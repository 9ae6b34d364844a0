//! Which of the handler's responses are stored and replayed.

use std::fmt;
use std::sync::Arc;

use http::{HeaderMap, StatusCode};

/// The layer's default rule: store the response unless its status says the endpoint did not
/// run, or did not finish: `401`, `403`, `408`, `425`, `429` and every `5xx`.
///
/// Those statuses typically come from a layer *inside* this one (authorisation, rate limiting,
/// a concurrency limit, a timeout) before the endpoint ran, or from a failure that a retry may
/// cure. Pinning them would replay "too many requests" for a day to a client who waited as told,
/// so the key is released instead and a retry runs again. Every other status, `4xx` included
/// (`400`, `404`, `409`, `422`), is the endpoint's answer and is replayed. The rule follows
/// Stripe's: a result is saved only when the endpoint ran.
///
/// Compose it in your own rule with
/// [`IdempotencyKeyLayer::store_response_if`](crate::IdempotencyKeyLayer::store_response_if):
///
/// ```
/// use http::{HeaderMap, StatusCode};
/// use idem_http::stored_by_default;
///
/// let h = HeaderMap::new();
/// assert!(stored_by_default(StatusCode::CREATED, &h));
/// assert!(stored_by_default(StatusCode::UNPROCESSABLE_ENTITY, &h));
/// assert!(!stored_by_default(StatusCode::TOO_MANY_REQUESTS, &h));
/// assert!(!stored_by_default(StatusCode::SERVICE_UNAVAILABLE, &h));
/// ```
pub fn stored_by_default(status: StatusCode, _headers: &HeaderMap) -> bool {
    !(status.is_server_error() || matches!(status.as_u16(), 401 | 403 | 408 | 425 | 429))
}

type Rule = dyn Fn(StatusCode, &HeaderMap) -> bool + Send + Sync;

/// The rule in force.
#[derive(Clone)]
pub(crate) struct StoreRule(Arc<Rule>);

impl StoreRule {
    pub(crate) fn new(
        rule: impl Fn(StatusCode, &HeaderMap) -> bool + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(rule))
    }

    pub(crate) fn stores(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        (self.0)(status, headers)
    }
}

impl Default for StoreRule {
    fn default() -> Self {
        Self::new(stored_by_default)
    }
}

impl fmt::Debug for StoreRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StoreRule(..)")
    }
}
