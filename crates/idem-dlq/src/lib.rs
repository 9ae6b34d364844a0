//! Reading dead letters back, and deciding what to do with them: the operator's half of
//! dead-lettering.
//!
//! Every broker adapter dead-letters with the same [dead-letter headers](idem_core::consumer::headers)
//! (`idem-reason`, `idem-outcome`, `idem-scope`, `idem-key`, `idem-source`, …). A broker supplies
//! three primitives as a [`DeadLetterQueue`]: read without removing, republish with the
//! broker's confirmation, remove. The rules live here, once, in [`Workbench`]:
//!
//! - a **failed** or **released** message is replayed to its original destination under the
//!   same key, so the consumer runs it again (a failed record is re-claimable);
//! - a **conflict** (its key was already used by another payload) is never replayed under its
//!   key, where it would only conflict again: the operator chooses [`OnConflict::Discard`] or
//!   [`OnConflict::AcceptAsNew`] (a new message id derived from the old one and the payload, so
//!   a second replay of the same conflict is a duplicate of the first, not a third message);
//! - a dead letter is removed only after its replay is confirmed by the broker: never lost, at
//!   worst present twice, and then deduplicated by the consumer.
//!
//! ```
//! use idem_dlq::{Letter, MemoryDeadLetters, OnConflict, Workbench};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let queue = MemoryDeadLetters::new();
//! queue.push(Letter::new("1", b"{}".to_vec())
//!     .with_message_id("o-1")
//!     .with_header("idem-outcome", "failed_permanent")
//!     .with_header("idem-reason", "card declined")
//!     .with_header("idem-key", "o-1")
//!     .with_header("idem-source", "orders"));
//! queue.push(Letter::new("2", b"{\"total\":5}".to_vec())
//!     .with_message_id("o-2")
//!     .with_header("idem-outcome", "conflict")
//!     .with_header("idem-key", "o-2")
//!     .with_header("idem-source", "orders"));
//! let bench = Workbench::new(queue.clone());
//! let letters = bench.list(100).await?;
//! let report = bench.replay(&letters, OnConflict::Refuse).await?;
//! assert_eq!(report.replayed, ["1"]);
//! assert_eq!(report.refused.len(), 1); // the conflict stays where it is
//! assert_eq!(queue.published()[0].destination, "orders");
//! assert_eq!(queue.len(), 1);
//! # Ok::<_, idem_dlq::DlqError>(()) }).unwrap();
//! ```

mod letter;
mod memory;
mod workbench;

use std::sync::Arc;
use std::time::SystemTime;

use futures_util::future::BoxFuture;

pub use letter::*;
pub use memory::MemoryDeadLetters;
pub use workbench::*;

/// A message to send again, as the broker must publish it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Republish {
    /// The dead letter it replaces.
    pub letter: String,
    /// Where to: the queue, subject, topic or stream it was consumed from.
    pub destination: String,
    /// Its message id (the same as before, or a derived one for a conflict accepted as new).
    pub message_id: Option<String>,
    /// Its content type.
    pub content_type: Option<String>,
    /// Its content encoding, as the dead letter had it.
    pub content_encoding: Option<String>,
    /// Its correlation id, as the dead letter had it.
    pub correlation_id: Option<String>,
    /// When its producer first sent it (a replay keeps the original time where the broker
    /// lets a publisher set it).
    pub timestamp: Option<SystemTime>,
    /// Its headers: the original ones and [`REPLAYED_FROM`].
    pub headers: Vec<(String, String)>,
    /// Its payload, unchanged.
    pub payload: Vec<u8>,
}

/// What a broker's dead-letter destination must do for the [`Workbench`].
///
/// # Contract
/// - `read` removes nothing and changes nothing a consumer could see (a queue read by taking
///   messages puts them back before it returns); two reads with nothing in between return the
///   same ids.
/// - `republish` returns `Ok` only once the broker has confirmed every message.
/// - `remove` removes the letters with these ids that are still there and returns how many.
pub trait DeadLetterQueue: Send + Sync {
    /// What it is, for people: `rabbitmq queue orders.dead-letter`, `nats stream ORDERS subject
    /// orders.dlq`, …
    fn describe(&self) -> String;

    /// Up to `limit` dead letters, oldest first, without removing them.
    fn read(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Letter>, DlqError>>;

    /// Publishes each message to its destination, confirmed.
    fn republish<'a>(&'a self, messages: &'a [Republish]) -> BoxFuture<'a, Result<(), DlqError>>;

    /// Removes the dead letters with these ids; returns how many were removed.
    fn remove<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<u64, DlqError>>;
}

macro_rules! forward {
    ($($ptr:ty),*) => {$(
        impl<Q: DeadLetterQueue + ?Sized> DeadLetterQueue for $ptr {
            fn describe(&self) -> String {
                (**self).describe()
            }
            fn read(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Letter>, DlqError>> {
                (**self).read(limit)
            }
            fn republish<'a>(
                &'a self,
                messages: &'a [Republish],
            ) -> BoxFuture<'a, Result<(), DlqError>> {
                (**self).republish(messages)
            }
            fn remove<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<u64, DlqError>> {
                (**self).remove(ids)
            }
        }
    )*};
}
forward!(&Q, Arc<Q>, Box<Q>);

/// What went wrong with a dead-letter destination.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DlqError {
    /// The broker failed or refused; nothing after the failing step was done.
    #[error("{what}: {source}")]
    Broker {
        /// The step that failed.
        what: String,
        /// The broker's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A request beyond a limit.
    #[error("{field}: {value} is over the limit of {limit}")]
    TooMany {
        /// The field.
        field: &'static str,
        /// What was asked.
        value: usize,
        /// The limit.
        limit: usize,
    },
    /// The broker did not publish a message and said why (for example a duplicate window that
    /// still holds its id).
    #[error("republishing {letter}: {why}")]
    NotPublished {
        /// The dead letter.
        letter: String,
        /// The broker's reason.
        why: String,
    },
}

impl DlqError {
    /// A broker error during `what`.
    pub fn broker(
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        Self::Broker { what: what.into(), source: source.into() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::consumer::headers;

    fn letter(id: &str, outcome: &str, reason: &str) -> Letter {
        Letter::new(id, format!("{{\"n\":{id}}}").into_bytes())
            .with_message_id(format!("m-{id}"))
            .with_header("traceparent", "00-abc-def-01")
            .with_header(headers::OUTCOME, outcome)
            .with_header(headers::REASON, reason)
            .with_header(headers::SCOPE, "billing")
            .with_header(headers::KEY, format!("m-{id}"))
            .with_header(headers::SOURCE, "orders")
            .with_header(headers::POSITION, id)
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().build().expect("runtime")
    }

    #[test]
    fn a_replay_keeps_correlation_id_timestamp_and_content_encoding() {
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_765_000_000);
        let q = MemoryDeadLetters::new();
        q.push(
            letter("1", "failed_permanent", "declined")
                .with_content_type("application/json")
                .with_content_encoding("gzip")
                .with_correlation_id("c-7")
                .with_timestamp(at),
        );
        rt().block_on(async {
            let bench = Workbench::new(q.clone());
            let ls = bench.list(10).await.expect("list");
            bench.replay(&ls, OnConflict::Refuse).await.expect("replay");
        });
        let r = q.published().remove(0);
        assert_eq!(
            (r.content_type.as_deref(), r.content_encoding.as_deref(), r.correlation_id.as_deref()),
            (Some("application/json"), Some("gzip"), Some("c-7"))
        );
        assert_eq!(r.timestamp, Some(at));
    }

    #[test]
    fn groups_one_cause_together() {
        let ls = [
            letter("1", "failed_permanent", "card 4242 declined for order 17"),
            letter("2", "failed_permanent", "card 1111 declined for order 18"),
            letter("3", "conflict", "key \"m-3\" reused with other content"),
        ];
        let g = group(&ls);
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].ids, ["1", "2"]);
        assert_eq!(g[0].key.reason, "card … declined for order …");
        assert!(ls[0].in_group(&g[0].key.id()));
        assert!(!ls[2].in_group(&g[0].key.id()));
    }

    #[test]
    fn a_conflict_is_never_replayed_under_its_key() {
        rt().block_on(async {
            let q = MemoryDeadLetters::new();
            q.push(letter("1", "conflict", "reused"));
            let bench = Workbench::new(q.clone());
            let ls = bench.list(10).await.expect("list");
            let r = bench.replay(&ls, OnConflict::Refuse).await.expect("replay");
            assert_eq!(r.refused.len(), 1);
            assert!(q.published().is_empty());
            assert_eq!(q.len(), 1);

            let r = bench.replay(&ls, OnConflict::AcceptAsNew).await.expect("accept");
            let new_id = &r.accepted_as_new[0].1;
            assert_ne!(new_id, "m-1");
            assert_eq!(q.published()[0].message_id.as_deref(), Some(new_id.as_str()));
            assert_eq!(q.len(), 0);
        });
    }

    #[test]
    fn discard_removes_without_sending() {
        rt().block_on(async {
            let q = MemoryDeadLetters::new();
            q.push(letter("1", "conflict", "reused"));
            let bench = Workbench::new(q.clone());
            let ls = bench.list(10).await.expect("list");
            let r = bench.replay(&ls, OnConflict::Discard).await.expect("discard");
            assert_eq!(r.discarded, ["1"]);
            assert!(q.published().is_empty());
            assert!(q.is_empty());
        });
    }

    #[test]
    fn accept_as_new_refuses_a_key_that_is_not_the_message_id() {
        rt().block_on(async {
            let q = MemoryDeadLetters::new();
            let mut l = letter("1", "conflict", "reused");
            l.headers.retain(|(k, _)| k != headers::KEY);
            q.push(l.with_header(headers::KEY, "order-77"));
            let bench = Workbench::new(q.clone());
            let ls = bench.list(10).await.expect("list");
            let r = bench.replay(&ls, OnConflict::AcceptAsNew).await.expect("replay");
            assert!(r.refused[0].1.contains("is not its message id"), "{:?}", r.refused);
            assert_eq!(q.len(), 1);
        });
    }

    #[test]
    fn a_failed_republish_removes_nothing() {
        rt().block_on(async {
            let q = MemoryDeadLetters::new();
            q.push(letter("1", "failed_permanent", "declined"));
            q.fail_republish(true);
            let bench = Workbench::new(q.clone());
            let ls = bench.list(10).await.expect("list");
            assert!(bench.replay(&ls, OnConflict::Refuse).await.is_err());
            assert_eq!(q.len(), 1);
        });
    }

    #[test]
    fn a_replay_keeps_the_message_and_drops_idem_headers() {
        rt().block_on(async {
            let q = MemoryDeadLetters::new();
            q.push(letter("1", "failed_permanent", "declined"));
            let bench = Workbench::new(q.clone());
            let ls = bench.list(10).await.expect("list");
            let r = bench.replay(&ls, OnConflict::Refuse).await.expect("replay");
            assert_eq!(r.replayed, ["1"]);
            let p = &q.published()[0];
            assert_eq!(p.destination, "orders");
            assert_eq!(p.message_id.as_deref(), Some("m-1"));
            assert_eq!(p.payload, br#"{"n":1}"#);
            let names: Vec<&str> = p.headers.iter().map(|(k, _)| k.as_str()).collect();
            assert_eq!(names, ["traceparent", REPLAYED_FROM]);
        });
    }

    #[test]
    fn a_letter_without_a_source_is_not_replayed() {
        rt().block_on(async {
            let q = MemoryDeadLetters::new();
            q.push(Letter::new("x", Vec::new()).with_header(headers::OUTCOME, "failed_permanent"));
            let bench = Workbench::new(q.clone());
            let ls = bench.list(10).await.expect("list");
            let r = bench.replay(&ls, OnConflict::Refuse).await.expect("replay");
            assert!(r.refused[0].1.contains("idem-source"));
            assert!(bench.list(MAX_LETTERS + 1).await.is_err());
        });
    }
}
