//! HTTP `Idempotency-Key` for **idem**: a tower [`Layer`](tower_layer::Layer) that makes retried
//! `POST`/`PATCH` requests take effect once, over any [`DedupStore`](idem_core::DedupStore).
//!
//! - [`IdempotencyKeyLayer`]: the layer and its settings; its docs list the semantics.
//! - [`Principal`]: the caller, put in the request's extensions by your authentication, so one
//!   client never replays another's response. The authentication must run before the layer: a
//!   keyed request without a principal is refused with a plain `500` (the server's log says
//!   why) unless the layer [allows anonymous callers](IdempotencyKeyLayer::allow_anonymous).
//! - [`PrincipalKey`]: the secret the principal is hashed with (HMAC-SHA256) before it enters
//!   the store or a log; required once requests carry a principal.
//! - [`stored_by_default`]: which responses are stored and replayed — only what the endpoint
//!   produced, not the `401`, `403`, `408`, `425`, `429` or `5xx` of a layer inside this one
//!   ([change it](IdempotencyKeyLayer::store_response_if)).
//! - [`KeyFormat`]: an optional rule on the keys' form (a UUID, or your own predicate).
//! - [`IdempotentRequest`]: what the handler is told (attempt, a downstream idempotency key).
//! - [`Problem`]: the RFC 9457 `application/problem+json` error responses.
//! - [`ResponseBody`]: the body of the layer's responses; a response larger than
//!   [`max_body`](IdempotencyKeyLayer::max_body) is read only to the first frame past the limit,
//!   streamed to the client whole and not stored.
//!
//! With the `axum` feature, the scope uses axum's route template (`/payments/{id}`) when the layer
//! is added with `Router::layer`, and [`Problem`] implements `IntoResponse`.
//!
//! ```no_run
//! # #[cfg(feature = "axum")] mod m {
//! use axum::extract::Request;
//! use axum::middleware::{self, Next};
//! use axum::response::Response;
//! use axum::{Router, routing::post};
//! use idem_core::MemoryStore;
//! use idem_http::{IdempotencyKeyLayer, KeyFormat, Principal, PrincipalKey};
//!
//! async fn pay() -> &'static str { "paid" }
//!
//! // Your authentication: it puts the caller's stable id (not its token) in the request.
//! async fn authenticate(mut req: Request, next: Next) -> Response {
//!     req.extensions_mut().insert(Principal::new("customer-42"));
//!     next.run(req).await
//! }
//!
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! // The same secret on every instance, from your secret store.
//! let secret = std::env::var("IDEM_PRINCIPAL_KEY")?;
//! let idempotency = IdempotencyKeyLayer::new(MemoryStore::new())
//!     .principal_key(PrincipalKey::new(secret)?)
//!     .key_format(KeyFormat::Uuid)
//!     .required(true);
//! let app: Router = Router::new()
//!     .route("/payments", post(pay))
//!     // axum runs the layer added last first: authentication, then idempotency.
//!     .layer(idempotency)
//!     .layer(middleware::from_fn(authenticate));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! # Ok(()) } }
//! ```

mod body;
mod format;
mod guarded;
mod key;
mod layer;
mod principal;
mod principal_key;
mod problem;
mod scope;
mod service;
mod store_rule;
mod stored;

pub use body::ResponseBody;
pub use format::KeyFormat;
pub use key::KeyProblem;
pub use layer::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyKeyLayer};
pub use principal::{IdempotentRequest, Principal};
pub use principal_key::{PrincipalKey, PrincipalKeyError};
pub use problem::{Problem, ProblemKind};
pub use service::{IdempotencyKey, ResponseFuture};
pub use store_rule::stored_by_default;
