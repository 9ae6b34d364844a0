//! The operator's rules over a dead-letter destination: list, group, replay, discard.

use std::fmt;

use sha2::{Digest as _, Sha256};

use idem_core::consumer::headers;

use super::*;

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
/// use idem_dlq::accepted_id;
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
