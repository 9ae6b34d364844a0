//! Dead letters read back from their JetStream stream, replayed and removed: the
//! [`DeadLetterQueue`] of `idem dlq` and the console.

use std::str::FromStr;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue};
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{
    DeleteMessageError, DeleteMessageErrorKind, LastRawMessageErrorKind, Stream,
};
use async_nats::jetstream::{Context, ErrorCode};
use futures_util::future::BoxFuture;
use idem_core::consumer::headers;
use idem_dlq::{DeadLetterQueue, DlqError, Letter, REPLAYED_FROM, Republish};

use crate::delivery::{MSG_ID_HEADER, is_server_header};
use crate::publish::Refused;

/// How many removals are in flight at once.
const REMOVALS_IN_FLIGHT: usize = 16;

/// The dead letters a [`JetStreamConsumer`](crate::JetStreamConsumer) published to a subject,
/// as stored by the stream that captures it: a [`DeadLetterQueue`].
///
/// - **Id**: the stream sequence of the dead-letter copy.
/// - **Read**: message gets (`STREAM.MSG.GET` with `next_by_subj`), one per letter, oldest
///   first: no consumer is created, so nothing is delivered, acknowledged or removed, on any
///   retention policy (a work-queue or interest stream included).
/// - **Message id**: the copy's `idem-original-message-id` header (the copy's own `Nats-Msg-Id`,
///   `idem-dlq:<stream>:<seq>`, is not the message's and is left out of the headers).
/// - **Remove**: `STREAM.MSG.DELETE` of each sequence, after checking that the message there
///   is on this subject (a stream may hold other subjects: no id deletes one of them).
/// - **Republish**: a publish to the destination subject with `Nats-Msg-Id` = the message id,
///   confirmed by its publish ack. Headers starting with `Nats-` are not sent again: they are
///   instructions to the server (`Nats-Rollup` would purge the destination subject,
///   `Nats-Expected-*` would make the publish fail), not the message's.
///
/// # The destination's duplicate window
/// JetStream drops a publish whose `Nats-Msg-Id` the destination stream stored within its
/// `duplicate_window` (2 minutes by default): the ack says `duplicate` and nothing is stored.
/// A dead letter replayed soon after its message was first published would be dropped this
/// way, and removing it then would lose it. So a `duplicate` ack fails the replay with
/// [`DlqError::NotPublished`] (replay again once the window has passed), unless the message the
/// stream holds under that id is this same replay (same `idem-replayed-from` and payload), sent
/// by an earlier replay of this letter: then the message is on the stream, which is all a
/// replay must achieve.
///
/// ```no_run
/// use idem_dlq::{OnConflict, Workbench};
/// use idem_nats::JetStreamDeadLetters;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let js = async_nats::jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
/// let bench = Workbench::new(JetStreamDeadLetters::new(js, "ORDERS_DLQ", "dlq.orders"));
/// let letters = bench.list(100).await?;
/// let report = bench.replay(&letters, OnConflict::Refuse).await?;
/// println!("{report}");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct JetStreamDeadLetters {
    js: Context,
    stream: String,
    subject: String,
}

impl JetStreamDeadLetters {
    /// The dead letters on `subject` in `stream` (a subject pattern reads every matching one).
    pub fn new(js: Context, stream: impl Into<String>, subject: impl Into<String>) -> Self {
        Self { js, stream: stream.into(), subject: subject.into() }
    }

    /// The dead letters on `subject`, in the stream that captures it.
    ///
    /// # Errors
    /// [`DlqError::Broker`] when no stream captures `subject` (or the server does not answer).
    pub async fn on_subject(js: Context, subject: impl Into<String>) -> Result<Self, DlqError> {
        let subject = subject.into();
        let stream = js.stream_by_subject(subject.clone()).await.map_err(|e| {
            DlqError::broker(format!("finding the stream that captures `{subject}`"), e)
        })?;
        Ok(Self::new(js, stream, subject))
    }

    /// The dead letters of consumers of `consumed`, at the conventional dead-letter subject
    /// [`subject_for(consumed)`](Self::subject_for), in the stream that captures it.
    ///
    /// # Errors
    /// As [`on_subject`](Self::on_subject).
    pub async fn for_source(js: Context, consumed: &str) -> Result<Self, DlqError> {
        Self::on_subject(js, Self::subject_for(consumed)).await
    }

    /// The conventional dead-letter subject of consumers of `consumed` (a subject or a
    /// stream's subject pattern): `dlq.` and its tokens without wildcards, outside the
    /// consumed subjects (see [the dead-letter subject](crate::JetStreamConfig#the-dead-letter-subject)).
    /// [`JetStreamConfig`](crate::JetStreamConfig) has no default: this is the layout its docs
    /// recommend, for consumers set up that way.
    ///
    /// ```
    /// use idem_nats::JetStreamDeadLetters;
    ///
    /// assert_eq!(JetStreamDeadLetters::subject_for("orders.>"), "dlq.orders");
    /// assert_eq!(JetStreamDeadLetters::subject_for("orders.placed"), "dlq.orders.placed");
    /// assert_eq!(JetStreamDeadLetters::subject_for("orders.*.eu"), "dlq.orders.eu");
    /// ```
    pub fn subject_for(consumed: &str) -> String {
        let tokens: Vec<&str> =
            consumed.split('.').filter(|t| !t.is_empty() && *t != "*" && *t != ">").collect();
        if tokens.is_empty() { "dlq".to_owned() } else { format!("dlq.{}", tokens.join(".")) }
    }

    /// The stream holding the dead letters.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The dead-letter subject.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    async fn handle(&self) -> Result<Stream<()>, DlqError> {
        self.js
            .get_stream_no_info(&self.stream)
            .await
            .map_err(|e| DlqError::broker(format!("opening stream {}", self.stream), e))
    }

    async fn read_letters(&self, limit: usize) -> Result<Vec<Letter>, DlqError> {
        let stream = self.handle().await?;
        let mut out = Vec::new();
        let mut next = 1;
        while out.len() < limit {
            match stream.get_first_raw_message_by_subject(&self.subject, next).await {
                Ok(m) => {
                    next = m.sequence + 1;
                    out.push(letter(&m));
                }
                Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => break,
                Err(e) => {
                    let what = format!("reading {} from sequence {next}", self.describe());
                    return Err(DlqError::broker(what, e));
                }
            }
        }
        Ok(out)
    }

    async fn remove_ids(&self, ids: &[String]) -> Result<u64, DlqError> {
        let stream = self.handle().await?;
        // An id that is not a sequence names no message of the stream.
        let seqs: Vec<u64> = ids.iter().filter_map(|id| id.parse().ok()).collect();
        let mut removed = 0;
        for chunk in seqs.chunks(REMOVALS_IN_FLIGHT) {
            let each = chunk.iter().map(|&seq| self.remove_one(&stream, seq));
            for r in futures_util::future::join_all(each).await {
                removed += u64::from(r?);
            }
        }
        Ok(removed)
    }

    /// Deletes `seq` if it is a message on this subject; whether it did.
    async fn remove_one(&self, stream: &Stream<()>, seq: u64) -> Result<bool, DlqError> {
        let what = || format!("removing dead letter {seq} from {}", self.describe());
        let m = match stream.get_raw_message(seq).await {
            Ok(m) => m,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(false),
            Err(e) => return Err(DlqError::broker(what(), e)),
        };
        if !crate::subject::matches(&self.subject, &m.subject) {
            return Ok(false);
        }
        match stream.delete_message(seq).await {
            Ok(deleted) => Ok(deleted),
            Err(e) if no_message(&e) => Ok(false),
            Err(e) => Err(DlqError::broker(what(), e)),
        }
    }

    /// Sends one message; its ack is awaited later, with the others'.
    async fn send(&self, r: &Republish) -> Result<PublishAckFuture, DlqError> {
        if let Some(problem) = crate::subject::publish_problem(&r.destination) {
            return Err(DlqError::NotPublished {
                letter: r.letter.clone(),
                why: format!("its destination `{}` {problem}", r.destination),
            });
        }
        let h = republish_headers(&r.headers, r.message_id.as_deref()).map_err(|e| {
            DlqError::broker(format!("republishing {} to {}", r.letter, r.destination), e)
        })?;
        self.js
            .publish_with_headers(
                r.destination.clone(),
                h,
                bytes::Bytes::copy_from_slice(&r.payload),
            )
            .await
            .map_err(|e| {
                DlqError::broker(format!("republishing {} to {}", r.letter, r.destination), e)
            })
    }

    /// `Ok` once the stream stored `r`: its ack, or a `duplicate` ack for a copy of this same
    /// replay.
    async fn confirm(&self, r: &Republish, ack: PublishAckFuture) -> Result<(), DlqError> {
        let ack = ack.await.map_err(|e| {
            DlqError::broker(format!("publish ack of {} on {}", r.letter, r.destination), e)
        })?;
        if !ack.duplicate {
            return Ok(());
        }
        let stream = self.js.get_stream_no_info(&ack.stream).await.ok();
        let held = match &stream {
            Some(s) => s.get_raw_message(ack.sequence).await.ok(),
            None => None,
        };
        if held.as_ref().is_some_and(|m| is_this_replay(m, r)) {
            tracing::debug!(target: "idem::dlq", letter = %r.letter, stream = %ack.stream,
                seq = ack.sequence, "an earlier replay of this dead letter is on the stream");
            return Ok(());
        }
        let window = match self.js.get_stream(&ack.stream).await {
            Ok(s) => format!(" ({:?})", s.cached_info().config.duplicate_window),
            Err(_) => String::new(),
        };
        Err(DlqError::NotPublished {
            letter: r.letter.clone(),
            why: format!(
                "stream {} still holds message id `{}` in its duplicate window{window} (as \
                 sequence {}), so JetStream dropped the replay; replay it again once the window \
                 has passed",
                ack.stream,
                r.message_id.as_deref().unwrap_or_default(),
                ack.sequence
            ),
        })
    }
}

/// Whether the DELETE failed because the message is gone already.
fn no_message(e: &DeleteMessageError) -> bool {
    matches!(e.kind(), DeleteMessageErrorKind::JetStream(j)
        if j.error_code() == ErrorCode::NO_MESSAGE_FOUND)
}

/// Whether the stored message `m` is `r` sent by an earlier replay of the same letter.
fn is_this_replay(m: &StreamMessage, r: &Republish) -> bool {
    let replayed_from = m.headers.get(REPLAYED_FROM).map(HeaderValue::as_str);
    replayed_from == Some(r.letter.as_str()) && m.payload.as_ref() == r.payload.as_slice()
}

/// A dead-letter copy as a [`Letter`].
fn letter(m: &StreamMessage) -> Letter {
    let mut hs: Vec<(String, String)> = m
        .headers
        .iter()
        .filter(|(k, _)| !AsRef::<str>::as_ref(*k).eq_ignore_ascii_case(MSG_ID_HEADER))
        .flat_map(|(k, vs)| {
            let k: &str = k.as_ref();
            vs.iter().map(move |v| (k.to_owned(), v.as_str().to_owned()))
        })
        .collect();
    // A header map has no order of its own: sorted, so two reads list a letter alike.
    hs.sort();
    let own_id = m.headers.get(MSG_ID_HEADER).map(HeaderValue::as_str);
    let message_id = m
        .headers
        .get(headers::ORIGINAL_MESSAGE_ID)
        .map(HeaderValue::as_str)
        // A message put there by hand, not by idem: its own id is the message's.
        .or(own_id.filter(|id| !id.starts_with("idem-dlq:")));
    let mut l = Letter::new(m.sequence.to_string(), m.payload.to_vec());
    if let Some(id) = message_id {
        l = l.with_message_id(id);
    }
    for (k, v) in hs {
        l = l.with_header(k, v);
    }
    l
}

/// The headers of a replay: `headers` without the server's `Nats-*` instructions, and
/// `message_id` as `Nats-Msg-Id`.
fn republish_headers(
    headers: &[(String, String)],
    message_id: Option<&str>,
) -> Result<HeaderMap, Refused> {
    let mut h = HeaderMap::new();
    for (name, value) in headers {
        if is_server_header(name) {
            continue;
        }
        let invalid = || Refused::InvalidHeader { name: name.clone() };
        let n = HeaderName::from_str(name).map_err(|_| invalid())?;
        let v = HeaderValue::from_str(value).map_err(|_| invalid())?;
        h.append(n, v);
    }
    if let Some(id) = message_id {
        let v = HeaderValue::from_str(id)
            .map_err(|_| Refused::InvalidHeader { name: MSG_ID_HEADER.to_owned() })?;
        h.insert(MSG_ID_HEADER, v);
    }
    Ok(h)
}

impl DeadLetterQueue for JetStreamDeadLetters {
    fn describe(&self) -> String {
        format!("nats stream {} subject {}", self.stream, self.subject)
    }

    fn read(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Letter>, DlqError>> {
        Box::pin(self.read_letters(limit))
    }

    /// Publishes every message, then awaits every ack; the first failure is returned (the
    /// others may have been stored: a replay is at worst twice on the stream).
    fn republish<'a>(&'a self, messages: &'a [Republish]) -> BoxFuture<'a, Result<(), DlqError>> {
        Box::pin(async move {
            // Sending only queues the message on the connection; the acks come back meanwhile.
            let mut sent = Vec::with_capacity(messages.len());
            for r in messages {
                sent.push((r, self.send(r).await?));
            }
            let confirms = sent.into_iter().map(|(r, ack)| self.confirm(r, ack));
            futures_util::future::join_all(confirms).await.into_iter().collect()
        })
    }

    fn remove<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<u64, DlqError>> {
        Box::pin(self.remove_ids(ids))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replays_carry_no_server_instruction() {
        let headers = [
            ("traceparent", "00-ab-cd-01"),
            ("Nats-Rollup", "sub"),
            ("nats-msg-id", "stale"),
            (REPLAYED_FROM, "7"),
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()));
        let h = republish_headers(&headers, Some("o-1")).expect("headers");
        assert_eq!(h.get(MSG_ID_HEADER).map(HeaderValue::as_str), Some("o-1"));
        assert!(h.get("Nats-Rollup").is_none());
        assert_eq!(h.get("traceparent").map(HeaderValue::as_str), Some("00-ab-cd-01"));
        assert_eq!(h.get(REPLAYED_FROM).map(HeaderValue::as_str), Some("7"));
        let bad = [("a:b".to_owned(), "x".to_owned())];
        assert!(republish_headers(&bad, None).is_err());
    }

    #[test]
    fn dead_letter_subjects_leave_the_consumed_ones() {
        assert_eq!(JetStreamDeadLetters::subject_for(">"), "dlq");
        assert_eq!(JetStreamDeadLetters::subject_for("orders"), "dlq.orders");
    }
}
