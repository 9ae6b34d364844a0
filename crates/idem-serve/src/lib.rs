//! idem over the network: the claim API for services in any language.
//!
//! An `idem serve` process (the `idem` CLI) puts a store — SQLite, PostgreSQL, MySQL/MariaDB or
//! Redis — behind an HTTP/JSON API with the store contract's semantics: claim a key before an
//! effect, complete it after; duplicates, conflicts, takeovers and fencing are decided by the
//! store, as in process. This crate is that server and its client:
//!
//! - [`router`]: the API's routes over any [`DedupStore`](idem_core::DedupStore) +
//!   [`InspectStore`](idem_core::InspectStore), with [`Tokens`] limiting each caller to its
//!   scopes; [`serve`] runs it (TLS optional) with graceful shutdown.
//! - [`RemoteStore`]: a `DedupStore` over the API, so Rust consumers (and the conformance suite)
//!   use a remote store as a local one.
//! - [`Pusher`]: push mode's delivery of each new message to an application's HTTP endpoint.
//! - [`grpc`]: the same API over gRPC (`proto/idem/v1/claims.proto`, generated code in
//!   [`grpc::pb`], a client included), served on the same port.
//! - [`wire`]: the JSON bodies; [`openapi::ApiDoc`]: the OpenAPI 3.1 document derived from them
//!   (served at `/openapi.json`).
//! - [`config`]: `idem serve`'s TOML configuration.
//! - [`console`]: the operator console (store, dead letters, outbox, live charts) at
//!   `/console`, mounted by [`router_with_console`].
//!
//! ```no_run
//! use idem_serve::{Scopes, Token, Tokens};
//!
//! # async fn f() -> Result<(), Box<dyn std::error::Error>> {
//! let tokens = Tokens::new(vec![Token::new("orders", "a-long-random-secret", Scopes::from_list(["orders"]))?])?;
//! let app = idem_serve::router(idem_core::MemoryStore::new(), tokens, None);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:7700").await?;
//! let limits = idem_serve::Limits::default();
//! idem_serve::serve(app, listener, None, limits, std::future::pending()).await?; // or a shutdown signal
//! # Ok(()) }
//! ```

mod auth;
pub mod config;
pub mod console;
mod dynstore;
mod error;
pub mod grpc;
mod http;
pub mod openapi;
mod ops;
mod push;
mod remote;
mod server;
mod tls;
pub mod wire;

pub use auth::{Caller, MIN_SECRET_LEN, Scopes, Token, TokenError, Tokens};
pub use console::router_with_console;
pub use error::ApiError;
pub use ops::{METRICS, MetricsRender};
pub use push::{DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_MAX_RETRY_AFTER, PushError, Pusher};
pub use remote::{DEFAULT_TIMEOUT, RemoteError, RemoteStore, RemoteStoreBuilder};
pub use server::{DRAIN_TIMEOUT, Limits, TlsError, router, serve, tls_acceptor};
/// The TLS crate of [`tls_acceptor`]'s answer.
pub use tokio_rustls;
