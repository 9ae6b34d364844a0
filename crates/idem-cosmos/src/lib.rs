//! Azure Cosmos DB for NoSQL for idem: a dedup store, the entity-as-marker check, and a
//! transactional-batch inbox.
//!
//! Three ways to make a consumer idempotent on Cosmos DB, from the simplest:
//!
//! - [`CosmosMarker`] — **the entity is the marker.** The order document itself (`id` = order
//!   id, container partitioned by `/orderId`) is created once; a 409 Conflict means it exists:
//!   the stored request fingerprint is compared, and the answer is a [`Claim`](idem_core::Claim)
//!   like every store's: completed (a duplicate) or a conflict.
//! - [`CosmosInbox`] — **marker and business documents in one transactional batch** (one
//!   partition key). A 409 on the batch is a duplicate; nothing of a failed handler is written.
//!   It is an [`idem_core::TxInbox`]: `Consumer::builder(source).inbox(inbox)` drives it like
//!   the SQL inboxes, and the handler writes through its `Tx<CosmosInbox>` ([`BatchDocs`]).
//! - [`CosmosStore`] — the two-phase [`DedupStore`](idem_core::DedupStore) (claim under a
//!   lease, run, complete), fenced by ETag-conditional replaces, retention as the per-item
//!   `ttl`. For handlers whose effects are not Cosmos DB documents.
//!
//! Errors are one [`Error`] enum, classified ([`Error::is_retryable`]); cosmos limits (id,
//! partition key, item size, batch size) are checked before a request ([`limits`]); throttling
//! (429) is retried as [`ThrottlePolicy`] says, honouring `x-ms-retry-after-ms`.
//!
//! # TLS
//! The crate builds the SDK without its `rustls` feature (which pulls in aws-lc-sys and a C
//! build): reqwest uses rustls with the `ring` provider. Call [`install_crypto_provider`] once
//! before building a `CosmosClient` for an `https://` endpoint.
//!
//! # What is tested where
//! The store (the whole conformance suite), the marker and the inbox run in every test run
//! against the SDK's in-memory emulator (409 on create, `If-Match`, atomic transactional
//! batches, no TTL: expiry is judged by the store's clock). 429s (with and without
//! `x-ms-retry-after-ms`, within and beyond [`ThrottlePolicy`]) and non-retryable answers are
//! injected there with the SDK's fault injection. The 409 path on the wire runs against
//! `@vercel/cosmosdb-server`; TTL deletion by the service only against an Azure account
//! (`IDEM_TEST_COSMOS_ENDPOINT`). No test provokes a real service-side 429.

mod error;
pub mod inbox;
pub mod limits;
mod marker;
mod store;
mod throttle;

/// The Cosmos DB SDK this crate is built on, re-exported so callers use the same version.
pub use azure_data_cosmos;
pub use error::Error;
pub use inbox::{BatchDocs, CosmosInbox};
pub use marker::{CosmosMarker, DEFAULT_FINGERPRINT_FIELD};
pub use store::{CosmosStore, MAX_RESULT_BYTES};
pub use throttle::ThrottlePolicy;

/// Installs rustls' `ring` crypto provider as the process default, unless one is installed
/// already. reqwest (under the SDK) needs one to open `https://` connections; this crate
/// builds it without a provider of its own to avoid aws-lc-sys. Idempotent; returns whether
/// this call installed it.
///
/// ```
/// idem_cosmos::install_crypto_provider();
/// assert!(!idem_cosmos::install_crypto_provider(), "second call is a no-op");
/// ```
pub fn install_crypto_provider() -> bool {
    rustls::crypto::CryptoProvider::get_default().is_none()
        && rustls::crypto::ring::default_provider().install_default().is_ok()
}
