//! Who is calling: part of the scope, so one client never replays another's response.

use std::fmt;

/// The authenticated caller, as your authentication middleware puts it in the request's
/// extensions. Requests with different principals never share a stored response, even with the
/// same key.
///
/// Use a stable id of the caller (a user id, an API client id, a tenant), never a credential:
/// a bearer token changes when it is renewed, and the retry of a request made with the old token
/// would then run again. The layer keeps only a keyed hash of it (see
/// [`PrincipalKey`](crate::PrincipalKey)): the store's records, spans and logs never hold the id
/// itself, and `Debug` does not print it.
///
/// The authentication must run *before* the idempotency layer (in axum, add it with `.layer`
/// *after* the [`IdempotencyKeyLayer`](crate::IdempotencyKeyLayer)). A keyed request that
/// reaches the layer without a principal is refused with `500`
/// ([`ProblemKind::NoPrincipal`](crate::ProblemKind::NoPrincipal)), unless the layer was
/// configured with [`allow_anonymous`](crate::IdempotencyKeyLayer::allow_anonymous); then such
/// requests share the route's scope.
///
/// ```
/// use idem_http::Principal;
///
/// let mut req = http::Request::new(());
/// req.extensions_mut().insert(Principal::new("customer-42"));
/// let p = req.extensions().get::<Principal>().unwrap();
/// assert_eq!(p.as_str(), "customer-42");
/// assert_eq!(format!("{p:?}"), "Principal(<redacted>)");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Principal(String);

impl Principal {
    /// A principal named `id` (a user id, an API client id, a tenant).
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The principal's id, for the application's own use; the layer stores and logs only its
    /// keyed hash.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Prints no part of the id: principals end up in `Debug` output of requests and extensions.
impl fmt::Debug for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Principal(<redacted>)")
    }
}

/// What the layer tells the handler about the request it runs, in the request's extensions
/// (`Extension<IdempotentRequest>` in axum). Present only when the layer claimed a key.
///
/// ```
/// # fn f(req: &http::Request<()>) {
/// if let Some(idem) = req.extensions().get::<idem_http::IdempotentRequest>() {
///     // Give the payment provider a key derived from ours: the same on every retry.
///     let _ = idem.downstream_key();
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct IdempotentRequest {
    pub(crate) key: idem_core::DedupKey,
    pub(crate) attempt: u32,
    pub(crate) took_over: bool,
}

impl IdempotentRequest {
    /// The store key: the scope (route, and the principal's keyed hash) and the client's
    /// `Idempotency-Key`.
    pub fn key(&self) -> &idem_core::DedupKey {
        &self.key
    }

    /// 1 for the first run; more when an earlier run answered `5xx` or its lease ran out.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Whether an earlier run's lease ran out mid-request (a crashed server): its effects may
    /// have happened, so external calls must carry [`IdempotentRequest::downstream_key`].
    pub fn took_over_expired(&self) -> bool {
        self.took_over
    }

    /// An idempotency key for calls to other services, derived from [`IdempotentRequest::key`]:
    /// the same on every attempt.
    pub fn downstream_key(&self) -> String {
        self.key.downstream_key()
    }
}
