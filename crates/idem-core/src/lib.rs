//! Core of **idem**: at-least-once delivery in, exactly-once effects out.
//!
//! - [`DedupKey`] and [`extract`]: the stable identity of a message within a consumer's scope.
//! - [`Fingerprint`]: same key with different content is a conflict, never a duplicate.
//! - [`DedupStore`]: the store contract (atomic claims, fenced leases, store clock, retention),
//!   with [`MemoryStore`] as its reference implementation.
//! - [`Engine`]: every decision about a delivery, written once: it turns each delivery into
//!   exactly one [`Outcome`], over a [`DedupStore`] (two-phase) or a transactional
//!   [`inbox`] whose marker commits with the handler's writes.
//! - [`Consumer`]: a broker consumer made idempotent, the loop written once for every broker
//!   ([`consumer::Source`] is what an adapter implements).
//! - [`RedeliveryWindow`] and [`VersionGuard`]: retention arithmetic and natural idempotency.
//! - [`job::Job`]: a scheduled or retried job that runs at most once per period.
//! - [`outbox`]: the transactional outbox and its relay, the producing half.
//! - [`redact`]: addresses and connection strings shown without their secrets.
//! - [`telemetry`]: the metrics every consumer emits, and [`describe_metrics`] for exporters.
//!
//! This crate does no I/O of its own; stores and broker adapters live in sibling crates.

mod answer;
mod batched;
mod chain;
pub mod claim;
pub mod claim_rule;
pub mod consumer;
pub mod engine;
pub mod extract;
pub mod fingerprint;
mod ident;
pub mod inbox;
pub mod job;
mod key;
pub mod memory;
pub mod outbox;
mod outcome;
mod record;
pub mod redact;
pub mod retention;
mod store;
pub mod telemetry;
pub mod time;
mod version;

pub use batched::{BatchConfig, Batched};
pub use chain::ErrorChain;
pub use claim::{Claim, ClaimRequest, FailKind, Lease};
pub use consumer::Consumer;
pub use engine::{Backend, Engine, Handler, HandlerError, Outcome, OutcomeKind};
pub use fingerprint::{Fingerprint, FingerprintSpec};
pub use ident::{Identifier, IdentifierError};
pub use inbox::{Inbox, OffsetInbox, Tx, TxInbox};
pub use key::{DEFAULT_MAX_KEY_BYTES, DedupKey, KeyError, KeyHash};
pub use memory::MemoryStore;
pub use record::{Record, RecordState};
pub use retention::RedeliveryWindow;
pub use store::{
    CompleteAndClaim, Completion, Counts, DedupStore, InspectStore, ListFilter, StoreError,
};
pub use telemetry::describe_metrics;
pub use time::Timestamp;
pub use version::{Advance, VersionGuard};
