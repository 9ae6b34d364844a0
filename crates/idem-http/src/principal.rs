//! Who is calling: part of the scope, so one client never replays another's response.

/// The authenticated caller, as your authentication middleware puts it in the request's
/// extensions (before the idempotency layer runs). Requests with different principals never
/// share a stored response, even with the same key; requests without one share the route's
/// scope.
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
