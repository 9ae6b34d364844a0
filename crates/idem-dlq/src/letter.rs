//! A dead letter as read back, and how letters group by cause.

#[cfg(doc)]
use super::DeadLetterQueue;
use std::collections::BTreeMap;
use std::fmt;
use std::time::SystemTime;

use sha2::{Digest as _, Sha256};

use idem_core::consumer::headers;

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
