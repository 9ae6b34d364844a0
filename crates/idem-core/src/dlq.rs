//! Reading dead letters back, and deciding what to do with them: the operator's half of
//! dead-lettering.
//!
//! Every broker adapter dead-letters with the same [dead-letter headers](crate::consumer::headers)
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
//! use idem_core::dlq::{Letter, MemoryDeadLetters, OnConflict, Workbench};
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
//! # Ok::<_, idem_core::dlq::DlqError>(()) }).unwrap();
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use futures_util::future::BoxFuture;
use sha2::{Digest as _, Sha256};

use crate::consumer::headers;

/// The most dead letters one call reads, lists or acts on.
pub const MAX_LETTERS: usize = 10_000;

/// A dead letter as read back from the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Letter {
    /// The broker's handle for it, which [`DeadLetterQueue::remove`] takes: a stream sequence,
    /// an entry id, `partition:offset`, or (for queues without one) a digest of its content.
    pub id: String,
    /// Its message id (the producer's, restored where the adapter had to rename it).
    pub message_id: Option<String>,
    /// Its content type, where the broker carries one.
    pub content_type: Option<String>,
    /// Its content encoding (`gzip`, …), where the broker carries one as a property.
    pub content_encoding: Option<String>,
    /// Its correlation id, where the broker carries one as a property (elsewhere it is a
    /// header, carried with the others).
    pub correlation_id: Option<String>,
    /// When its producer sent it, where the broker carries that (AMQP's timestamp, a Kafka
    /// record's create time).
    pub timestamp: Option<SystemTime>,
    /// Its headers, as text, in the broker's order (idem's dead-letter headers included).
    pub headers: Vec<(String, String)>,
    /// Its payload.
    pub payload: Vec<u8>,
}

impl Letter {
    /// A letter with `id` and `payload`, no headers.
    pub fn new(id: impl Into<String>, payload: Vec<u8>) -> Self {
        Self {
            id: id.into(),
            message_id: None,
            content_type: None,
            content_encoding: None,
            correlation_id: None,
            timestamp: None,
            headers: Vec::new(),
            payload,
        }
    }

    /// The same, with a message id.
    #[must_use]
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// The same, with a content type.
    #[must_use]
    pub fn with_content_type(mut self, ct: impl Into<String>) -> Self {
        self.content_type = Some(ct.into());
        self
    }

    /// The same, with a content encoding.
    #[must_use]
    pub fn with_content_encoding(mut self, encoding: impl Into<String>) -> Self {
        self.content_encoding = Some(encoding.into());
        self
    }

    /// The same, with a correlation id.
    #[must_use]
    pub fn with_correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }

    /// The same, with the time its producer sent it.
    #[must_use]
    pub fn with_timestamp(mut self, at: SystemTime) -> Self {
        self.timestamp = Some(at);
        self
    }

    /// The same, with one more header.
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The first header called `name` (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Why it was dead-lettered.
    pub fn reason(&self) -> Option<&str> {
        self.header(headers::REASON)
    }

    /// The outcome that dead-lettered it (`conflict`, `failed_permanent`, …).
    pub fn outcome(&self) -> Option<&str> {
        self.header(headers::OUTCOME)
    }

    /// The consumer scope that dead-lettered it.
    pub fn scope(&self) -> Option<&str> {
        self.header(headers::SCOPE)
    }

    /// Its dedup key within that scope.
    pub fn key(&self) -> Option<&str> {
        self.header(headers::KEY)
    }

    /// Where it was consumed from, where a replay sends it.
    pub fn source(&self) -> Option<&str> {
        self.header(headers::SOURCE)
    }

    /// Whether it was dead-lettered as a conflict (same key, other payload).
    pub fn is_conflict(&self) -> bool {
        self.outcome() == Some("conflict")
    }

    /// Its group: scope, outcome and the shape of its reason (words with digits, quotes or
    /// long runs of hex stand for any value), so that one cause is one group.
    pub fn group(&self) -> GroupKey {
        GroupKey {
            scope: self.scope().unwrap_or("-").to_owned(),
            outcome: self.outcome().unwrap_or("unknown").to_owned(),
            reason: reason_shape(self.reason().unwrap_or("")),
        }
    }

    /// Whether this letter's group is `g` (compared as [`GroupKey::id`] strings).
    pub fn in_group(&self, g: &str) -> bool {
        self.group().id() == g
    }

    /// The headers a replay carries: the message's own, without idem's dead-letter headers
    /// nor any id the adapter renamed.
    pub fn original_headers(&self) -> Vec<(String, String)> {
        self.headers.iter().filter(|(k, _)| !is_dead_letter_header(k)).cloned().collect()
    }
}

/// Whether `name` is one of the headers idem puts on a dead-letter copy.
pub fn is_dead_letter_header(name: &str) -> bool {
    [
        headers::REASON,
        headers::OUTCOME,
        headers::SCOPE,
        headers::KEY,
        headers::SOURCE,
        headers::POSITION,
        headers::DELIVERED,
        headers::ORIGINAL_MESSAGE_ID,
        REPLAYED_FROM,
    ]
    .iter()
    .any(|h| h.eq_ignore_ascii_case(name))
}

/// The header a replayed message carries: the dead letter it came from.
pub const REPLAYED_FROM: &str = "idem-replayed-from";

fn reason_shape(reason: &str) -> String {
    reason
        .split_whitespace()
        .map(|w| {
            let hexy = w.len() >= 8 && w.chars().all(|c| c.is_ascii_hexdigit() || c == '-');
            if w.chars().any(|c| c.is_ascii_digit() || matches!(c, '"' | '\'' | '`')) || hexy {
                "…"
            } else {
                w
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// What dead letters are grouped by.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GroupKey {
    /// The consumer scope.
    pub scope: String,
    /// The outcome.
    pub outcome: String,
    /// The reason, values elided.
    pub reason: String,
}

impl GroupKey {
    /// A short stable name for the group (12 hex digits), for command lines and URLs.
    pub fn id(&self) -> String {
        let mut h = Sha256::new();
        for part in [&self.scope, &self.outcome, &self.reason] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        hex::encode(&h.finalize()[..6])
    }
}

impl fmt::Display for GroupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} · {} · {}", self.scope, self.outcome, self.reason)
    }
}

/// Dead letters of one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// What they share.
    pub key: GroupKey,
    /// The letters' ids, in the order read.
    pub ids: Vec<String>,
}

/// Groups `letters` by [`Letter::group`], largest group first.
pub fn group(letters: &[Letter]) -> Vec<Group> {
    let mut by: BTreeMap<GroupKey, Vec<String>> = BTreeMap::new();
    for l in letters {
        by.entry(l.group()).or_default().push(l.id.clone());
    }
    let mut out: Vec<Group> = by.into_iter().map(|(key, ids)| Group { key, ids }).collect();
    out.sort_by(|a, b| b.ids.len().cmp(&a.ids.len()).then_with(|| a.key.cmp(&b.key)));
    out
}

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

/// What to do with conflicts selected for a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnConflict {
    /// Leave them dead-lettered and say so (the default: a conflict needs a decision).
    #[default]
    Refuse,
    /// Remove them without sending them again.
    Discard,
    /// Send them again as new messages, under a new message id derived from the old one and
    /// the payload (`<id>.accepted.<12 hex>`). Only when the key is the message id: a key read
    /// from the payload would be the same key, and conflict again.
    AcceptAsNew,
}

/// What a replay did, letter by letter.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplayReport {
    /// Sent again under their key, then removed.
    pub replayed: Vec<String>,
    /// Conflicts sent again as new messages: (letter, new message id), then removed.
    pub accepted_as_new: Vec<(String, String)>,
    /// Conflicts removed without being sent.
    pub discarded: Vec<String>,
    /// Left dead-lettered: (letter, why).
    pub refused: Vec<(String, String)>,
    /// How many of the confirmed replays' dead letters were removed (fewer when another
    /// operator removed some meanwhile).
    pub removed: u64,
}

impl fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} replayed under their key, {} conflicts accepted as new messages, {} conflicts \
             discarded, {} left dead-lettered",
            self.replayed.len(),
            self.accepted_as_new.len(),
            self.discarded.len(),
            self.refused.len()
        )
    }
}

/// The message id a conflict accepted as new is sent under: derived from its old id and its
/// payload, so the same conflict accepted twice is one new message.
///
/// ```
/// use idem_core::dlq::accepted_id;
///
/// assert_eq!(accepted_id("o-7", b"{}"), accepted_id("o-7", b"{}"));
/// assert_ne!(accepted_id("o-7", b"{}"), accepted_id("o-7", b"[]"));
/// assert!(accepted_id("o-7", b"{}").starts_with("o-7.accepted."));
/// ```
pub fn accepted_id(old: &str, payload: &[u8]) -> String {
    let digest = Sha256::digest(payload);
    format!("{old}.accepted.{}", hex::encode(&digest[..6]))
}

/// The rules of replay, discard and purge over one [`DeadLetterQueue`].
pub struct Workbench<Q> {
    queue: Q,
}

impl<Q: DeadLetterQueue> Workbench<Q> {
    /// A workbench over `queue`.
    pub fn new(queue: Q) -> Self {
        Self { queue }
    }

    /// The queue.
    pub fn queue(&self) -> &Q {
        &self.queue
    }

    /// Up to `limit` dead letters, oldest first.
    ///
    /// # Errors
    /// [`DlqError::TooMany`] over [`MAX_LETTERS`]; the broker's errors.
    pub async fn list(&self, limit: usize) -> Result<Vec<Letter>, DlqError> {
        check_limit("limit", limit)?;
        self.queue.read(limit).await
    }

    /// Replays `letters` by the rules of this module: each is sent again (confirmed), then
    /// removed; conflicts as `on_conflict` says.
    ///
    /// # Errors
    /// The broker's errors. A failed republish removes nothing: the letters stay, and a second
    /// replay may send some of them twice, which the consumer deduplicates.
    pub async fn replay(
        &self,
        letters: &[Letter],
        on_conflict: OnConflict,
    ) -> Result<ReplayReport, DlqError> {
        check_limit("letters", letters.len())?;
        let mut report = ReplayReport::default();
        let mut sends = Vec::new();
        for l in letters {
            match plan(l, on_conflict) {
                Plan::Send(r) => {
                    if l.is_conflict() {
                        let id = r.message_id.clone().unwrap_or_default();
                        report.accepted_as_new.push((l.id.clone(), id));
                    } else {
                        report.replayed.push(l.id.clone());
                    }
                    sends.push(r);
                }
                Plan::Discard => report.discarded.push(l.id.clone()),
                Plan::Refuse(why) => report.refused.push((l.id.clone(), why)),
            }
        }
        if !sends.is_empty() {
            self.queue.republish(&sends).await?;
        }
        let done: Vec<String> = sends
            .iter()
            .map(|r| r.letter.clone())
            .chain(report.discarded.iter().cloned())
            .collect();
        if !done.is_empty() {
            report.removed = self.queue.remove(&done).await?;
        }
        for r in &sends {
            tracing::info!(target: "idem::dlq", letter = %r.letter, destination = %r.destination,
                message_id = r.message_id.as_deref().unwrap_or(""), "dead letter replayed");
        }
        Ok(report)
    }

    /// Removes `letters` without sending them again; returns how many were removed.
    ///
    /// # Errors
    /// The broker's errors.
    pub async fn purge(&self, letters: &[Letter]) -> Result<u64, DlqError> {
        check_limit("letters", letters.len())?;
        let ids: Vec<String> = letters.iter().map(|l| l.id.clone()).collect();
        if ids.is_empty() {
            return Ok(0);
        }
        let n = self.queue.remove(&ids).await?;
        tracing::info!(target: "idem::dlq", removed = n, "dead letters purged");
        Ok(n)
    }
}

fn check_limit(field: &'static str, value: usize) -> Result<(), DlqError> {
    if value > MAX_LETTERS {
        return Err(DlqError::TooMany { field, value, limit: MAX_LETTERS });
    }
    Ok(())
}

enum Plan {
    Send(Republish),
    Discard,
    Refuse(String),
}

fn plan(l: &Letter, on_conflict: OnConflict) -> Plan {
    let Some(destination) = l.source().filter(|s| !s.is_empty()) else {
        return Plan::Refuse(format!(
            "no {} header: idem did not dead-letter it, so where it came from is unknown",
            headers::SOURCE
        ));
    };
    let mut message_id = l.message_id.clone();
    if l.is_conflict() {
        match on_conflict {
            OnConflict::Refuse => {
                return Plan::Refuse(
                    "a conflict (its key was used by another payload) is never replayed under \
                     its key: discard it, or accept it as a new message"
                        .into(),
                );
            }
            OnConflict::Discard => return Plan::Discard,
            OnConflict::AcceptAsNew => {
                let Some(old) = l.message_id.as_deref() else {
                    return Plan::Refuse("no message id to derive a new one from".into());
                };
                if l.key().is_some_and(|k| k != old) {
                    return Plan::Refuse(format!(
                        "its key `{}` is not its message id, so a new message id would not \
                         give it a new key: discard it, or publish it with a new key yourself",
                        l.key().unwrap_or_default()
                    ));
                }
                message_id = Some(accepted_id(old, &l.payload));
            }
        }
    }
    let mut headers = l.original_headers();
    headers.push((REPLAYED_FROM.to_owned(), l.id.clone()));
    Plan::Send(Republish {
        letter: l.id.clone(),
        destination: destination.to_owned(),
        message_id,
        content_type: l.content_type.clone(),
        content_encoding: l.content_encoding.clone(),
        correlation_id: l.correlation_id.clone(),
        timestamp: l.timestamp,
        headers,
        payload: l.payload.clone(),
    })
}

/// An in-memory [`DeadLetterQueue`], for tests and examples: it keeps the letters and the
/// messages republished.
#[derive(Debug, Clone, Default)]
pub struct MemoryDeadLetters {
    state: Arc<Mutex<MemoryState>>,
}

#[derive(Debug, Default)]
struct MemoryState {
    letters: Vec<Letter>,
    published: Vec<Republish>,
    fail_republish: bool,
}

impl MemoryDeadLetters {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, MemoryState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds a dead letter.
    pub fn push(&self, letter: Letter) {
        self.state().letters.push(letter);
    }

    /// How many dead letters it holds.
    pub fn len(&self) -> usize {
        self.state().letters.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every message republished so far.
    pub fn published(&self) -> Vec<Republish> {
        self.state().published.clone()
    }

    /// Makes the next republishes fail (a broker that refuses), or succeed again.
    pub fn fail_republish(&self, fail: bool) {
        self.state().fail_republish = fail;
    }
}

impl DeadLetterQueue for MemoryDeadLetters {
    fn describe(&self) -> String {
        "memory".into()
    }

    fn read(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Letter>, DlqError>> {
        let out = self.state().letters.iter().take(limit).cloned().collect();
        Box::pin(async move { Ok(out) })
    }

    fn republish<'a>(&'a self, messages: &'a [Republish]) -> BoxFuture<'a, Result<(), DlqError>> {
        let mut st = self.state();
        let res = if st.fail_republish {
            Err(DlqError::broker("republishing", "the broker refused"))
        } else {
            st.published.extend(messages.iter().cloned());
            Ok(())
        };
        Box::pin(async move { res })
    }

    fn remove<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<u64, DlqError>> {
        let mut st = self.state();
        let before = st.letters.len();
        st.letters.retain(|l| !ids.contains(&l.id));
        let n = (before - st.letters.len()) as u64;
        Box::pin(async move { Ok(n) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
