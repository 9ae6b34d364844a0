//! Publishing outbox messages to JetStream, each awaited to its publish ack: the outbox
//! relay's broker.

use std::str::FromStr;

use async_nats::HeaderMap;
use async_nats::header::{HeaderName, HeaderValue};
use async_nats::jetstream::Context;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use idem_core::outbox::{OutboxMessage, PublishError, Publisher};

use crate::delivery::MSG_ID_HEADER;

/// Why the publisher refused a message before sending it (the source of a [`PublishError`],
/// never retryable). What the server or the connection answers is an
/// [`async_nats::jetstream::context::PublishError`] instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// Not a subject one can publish to: empty, with whitespace, an empty token (`a..b`, a
    /// leading or trailing dot) or a wildcard token (`*`, `>`).
    #[error("`{subject}` is not a subject one can publish to")]
    InvalidSubject {
        /// The subject.
        subject: String,
    },
    /// A header NATS cannot carry: a name with a colon or a character that is not printable
    /// ASCII, or a value with a line break.
    #[error(
        "header `{name}` cannot be sent over NATS (a name in printable ASCII without `:`, a value without line breaks)"
    )]
    InvalidHeader {
        /// The header's name.
        name: String,
    },
}

/// Publishes outbox messages to JetStream: the [`Publisher`] an outbox
/// [`Relay`](idem_core::outbox::Relay) needs.
///
/// Each message goes to its destination subject with its headers and its id as
/// [`Nats-Msg-Id`](MSG_ID_HEADER) — where [`JetStreamConsumer`](crate::JetStreamConsumer)'s default
/// key extractor reads it, and what JetStream's own duplicate window dedups on. A batch is sent
/// at once, then every publish ack awaited; a message counts as published once a stream has
/// stored it. An ack that says `duplicate` — the stream already stored this id within its
/// duplicate window, from an earlier attempt whose ack was lost — is success too.
///
/// | answer | result |
/// | --- | --- |
/// | publish ack (also `duplicate: true`) | `Ok` |
/// | no responders: no stream captures the subject (or JetStream is briefly unavailable) | retryable, `StreamNotFound` |
/// | ack timeout, broken connection, too many acks pending, any other server error | retryable |
/// | message larger than the server's `max_payload`, or the stream's `max_msg_size` | not retryable |
/// | invalid subject or header ([`Refused`]) | not retryable |
///
/// The ack timeout is the [`Context`]'s (5 s unless built otherwise).
///
/// ```no_run
/// use idem_core::outbox::{MemoryOutbox, OutboxStore, Outgoing, Relay};
/// use idem_nats::JetStreamPublisher;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let js = async_nats::jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
/// let outbox = MemoryOutbox::new(); // or an idem-sqlx outbox, filled in your transactions
/// outbox.send(vec![Outgoing::new("orders.accepted", r#"{"order":"o-1"}"#)]).await?;
/// let relay = Relay::builder(outbox, JetStreamPublisher::new(js)).build()?;
/// assert_eq!(relay.run_until_empty().await?.published, 1);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct JetStreamPublisher {
    js: Context,
}

impl JetStreamPublisher {
    /// A publisher over `js` (a clone shares its connection).
    pub fn new(js: Context) -> Self {
        Self { js }
    }

    fn headers(m: &OutboxMessage) -> Result<HeaderMap, Refused> {
        let mut h = HeaderMap::new();
        for (name, value) in m.headers() {
            let invalid = || Refused::InvalidHeader { name: name.clone() };
            // The id below is the outbox's; a header of that name would contradict it.
            if name.eq_ignore_ascii_case(MSG_ID_HEADER) {
                continue;
            }
            let n = HeaderName::from_str(name).map_err(|_| invalid())?;
            let v = HeaderValue::from_str(value).map_err(|_| invalid())?;
            h.append(n, v);
        }
        let id = HeaderValue::from_str(m.id().as_str())
            .map_err(|_| Refused::InvalidHeader { name: MSG_ID_HEADER.to_owned() })?;
        h.insert(MSG_ID_HEADER, id);
        Ok(h)
    }

    /// Sends one message; its ack is awaited later, with the others'.
    async fn send(&self, m: &OutboxMessage) -> Result<PublishAckFuture, PublishError> {
        let subject = m.destination();
        if !publishable(subject) {
            let e = Refused::InvalidSubject { subject: subject.to_owned() };
            return Err(PublishError::new(subject, false, e));
        }
        let headers = Self::headers(m).map_err(|e| PublishError::new(subject, false, e))?;
        let payload = bytes::Bytes::copy_from_slice(m.payload());
        self.js
            .publish_with_headers(subject.to_owned(), headers, payload)
            .await
            .map_err(|e| classify(subject, e))
    }
}

/// Whether NATS accepts `subject` for a publish: tokens separated by dots, none empty or a
/// wildcard, no whitespace.
fn publishable(subject: &str) -> bool {
    !subject.is_empty()
        && !subject.contains(char::is_whitespace)
        && subject.split('.').all(|t| !t.is_empty() && t != "*" && t != ">")
}

/// Retryable unless the message can never be stored as it is.
fn classify(subject: &str, e: async_nats::jetstream::context::PublishError) -> PublishError {
    let too_large = match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => true,
        PublishErrorKind::Other => std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<async_nats::jetstream::Error>())
            .is_some_and(|s| s.error_code() == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM),
        _ => false,
    };
    PublishError::new(subject, !too_large, e)
}

impl Publisher for JetStreamPublisher {
    /// Sends the whole batch, then awaits every publish ack together.
    async fn publish(&self, batch: &[OutboxMessage]) -> Vec<Result<(), PublishError>> {
        // Sending only queues the message on the connection; the acks come back meanwhile.
        let mut sent = Vec::with_capacity(batch.len());
        for m in batch {
            sent.push(self.send(m).await);
        }
        let acks = batch.iter().zip(sent).map(|(m, s)| async move {
            let ack = s?.await.map_err(|e| classify(m.destination(), e))?;
            if ack.duplicate {
                tracing::debug!(target: "idem", id = %m.id(), stream = %ack.stream,
                    "JetStream already stored this id (duplicate window); published");
            }
            Ok(())
        });
        futures_util::future::join_all(acks).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects() {
        assert!(publishable("orders.accepted"));
        assert!(publishable("a"));
        for bad in ["", "a..b", ".a", "a.", "a.*", "a.>", "a b", "a\tb"] {
            assert!(!publishable(bad), "{bad:?}");
        }
    }
}
