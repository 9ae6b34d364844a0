//! Who is calling: part of the scope, so one client never replays another's response.

/// The authenticated caller, as your authentication middleware puts it in the request's
/// extensions. Requests with different principals never share a stored response, even with the
/// same key.
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
/// assert_eq!(req.extensions().get::<Principal>().map(Principal::as_str), Some("customer-42"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Principal(String);

impl Principal {
    /// A principal named `id` (a user id, an API client id, a tenant).
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The principal's id.
    pub fn as_str(&self) -> &str {
        &self.0
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
    /// The store key: the scope (route and principal) and the client's `Idempotency-Key`.
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
