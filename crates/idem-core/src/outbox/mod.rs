//! The transactional outbox: the producing half of exactly-once effects.
//!
//! A handler that must publish (an `OrderAccepted` after storing an order) cannot do it
//! exactly once by itself: publishing before its commit publishes again when it runs again,
//! publishing after it can be lost in a crash. Instead it *enqueues* the message into an outbox
//! table, in the same database transaction as its inbox marker and business rows
//! (`idem-sqlx`'s outboxes on SQLite, PostgreSQL and MySQL/MariaDB). A [`Relay`] then publishes
//! the committed rows, at least once, each under a stable [`OutboxId`]; the idem consumer
//! downstream deduplicates the copies.
//!
//! - [`Outgoing`] / [`OutboxMessage`]: a message, its limits and its id ([`OutboxId::derived`]
//!   from the inbound key and a per-handler sequence, so a handler that runs again produces
//!   the same ids).
//! - [`OutboxStore`]: what an outbox table offers a relay (leases, fenced marks, ordering keys,
//!   retries and parking, purge), with [`MemoryOutbox`] as the reference implementation.
//! - [`Publisher`]: what a broker offers (publish with confirmation); each broker crate has one.
//! - [`Relay`]: the loop between them.
//!
//! What is promised: every committed message is published at least once, with the same id
//! each time; messages sharing a destination and an ordering key are published in enqueue
//! order. What is not: exactly-once *delivery* (a relay that dies after the broker confirmed
//! publishes again; consumers deduplicate), or any order across destinations or without an
//! ordering key.

mod memory;
mod message;
mod publish;
mod relay;
mod store;

pub use memory::{MemoryOutbox, RecordingPublisher};
pub use message::{
    MAX_PAYLOAD_BYTES, OutboxError, OutboxId, OutboxMessage, Outgoing, decode_headers,
    encode_headers,
};
pub use publish::{PublishError, Publisher};
pub use relay::{Builder, Feed, FeedKind, Read, Relay, RelayError, RelayReport, Settled, Tickets};
pub use store::{OutboxCounts, OutboxStore, Pending, PublishFailure, Ticket, UnsentRow};
