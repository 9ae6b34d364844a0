//! Publishing outbox messages to Redis streams: the outbox relay's broker.

use std::sync::Arc;
use std::time::Duration;

use idem_core::outbox::{OutboxMessage, PublishError, Publisher};
use redis::aio::ConnectionManager;
use redis::{RedisResult, Value};

use crate::Error;

/// Why the publisher did not take a message, or the server did not answer as asked (the
/// source of a [`PublishError`]). What Redis or the connection answers is an [`Error`]
/// instead (`XADD`, `WAIT`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// A header has the name of the id or payload field (case aside): the consumer would read
    /// it in their place. Not retryable.
    #[error("header `{name}` has the name of the entry's {role} field")]
    ShadowedField {
        /// The header's name.
        name: String,
        /// `"id"` or `"payload"`.
        role: &'static str,
    },
    /// Fewer replicas acknowledged the batch's writes than asked within the timeout
    /// ([`StreamPublisher::wait_for_replicas`]). Retryable.
    #[error("{acked} replica(s) acknowledged the write within the timeout, {wanted} wanted")]
    Replicas {
        /// How many did.
        acked: i64,
        /// How many were asked for.
        wanted: u32,
    },
}

/// Publishes outbox messages to Redis streams, one pipelined round trip per batch: the
/// [`Publisher`] an outbox [`Relay`](idem_core::outbox::Relay) needs.
///
/// Each message is an entry `XADD <destination> * message_id <id> payload <payload> <header>
/// <value>…`: the fields a [`StreamConsumer`](crate::StreamConsumer) reads by default (its
/// [`id_field`](crate::StreamConfig::id_field) and
/// [`payload_field`](crate::StreamConfig::payload_field); change both sides together), every
/// header a field of its own. A message counts as published once `XADD` answered with the
/// entry's id — in Redis' memory, on disk as its persistence settings say; ask for replicas with
/// [`wait_for_replicas`](Self::wait_for_replicas).
///
/// | answer | result |
/// | --- | --- |
/// | the entry id | `Ok` |
/// | `WRONGTYPE` (the destination key is not a stream) | not retryable |
/// | a header named like the id or payload field ([`Refused::ShadowedField`]) | not retryable |
/// | any other error, a lost connection, a timeout, too few replicas | retryable |
///
/// ```no_run
/// use idem_core::outbox::{MemoryOutbox, OutboxStore, Outgoing, Relay};
/// use idem_redis::StreamPublisher;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let client = redis::Client::open("redis://127.0.0.1/")?;
/// let publisher = StreamPublisher::new(client.get_connection_manager().await?).max_len(1_000_000);
/// let outbox = MemoryOutbox::new(); // or an idem-sqlx outbox, filled in your transactions
/// outbox.send(vec![Outgoing::new("orders", r#"{"order":"o-1"}"#)]).await?;
/// let report = Relay::builder(outbox, publisher).build()?.run_until_empty().await?;
/// assert_eq!(report.published, 1);
/// # Ok(()) }
/// ```
#[derive(Clone)]
#[must_use]
pub struct StreamPublisher {
    conn: ConnectionManager,
    max_len: Option<u64>,
    id_field: String,
    payload_field: String,
    replicas: Option<(u32, Duration)>,
}

impl std::fmt::Debug for StreamPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamPublisher")
            .field("max_len", &self.max_len)
            .field("id_field", &self.id_field)
            .field("payload_field", &self.payload_field)
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}

impl StreamPublisher {
    /// A publisher on `conn` (it reconnects by itself), with the default fields
    /// (`message_id`, `payload`), no trimming, no replica wait.
    pub fn new(conn: ConnectionManager) -> Self {
        Self {
            conn,
            max_len: None,
            id_field: "message_id".to_owned(),
            payload_field: "payload".to_owned(),
            replicas: None,
        }
    }

    /// Trims each stream it writes to about `n` entries (`XADD … MAXLEN ~ n`: whole
    /// macro-nodes only, so a few more stay). Trimmed entries are gone for consumers that had
    /// not read them yet: keep `n` well above the consumers' lag.
    pub fn max_len(mut self, n: u64) -> Self {
        self.max_len = Some(n);
        self
    }

    /// The field holding the message id (default `message_id`), as the consumer's
    /// [`id_field`](crate::StreamConfig::id_field).
    pub fn id_field(mut self, name: impl Into<String>) -> Self {
        self.id_field = name.into();
        self
    }

    /// The field holding the payload (default `payload`), as the consumer's
    /// [`payload_field`](crate::StreamConfig::payload_field).
    pub fn payload_field(mut self, name: impl Into<String>) -> Self {
        self.payload_field = name.into();
        self
    }

    /// After each batch's writes, waits up to `timeout` for `n` replicas to acknowledge them
    /// (`WAIT`, in the same round trip); with fewer, the batch fails (retryable), to be
    /// published again. Keep `timeout` below the connection's response timeout and the relay's
    /// publish timeout.
    pub fn wait_for_replicas(mut self, n: u32, timeout: Duration) -> Self {
        self.replicas = Some((n, timeout));
        self
    }

    /// The header that would shadow the id or payload field, if any.
    fn shadowed(&self, m: &OutboxMessage) -> Option<Refused> {
        m.headers().iter().find_map(|(name, _)| {
            let role = if name.eq_ignore_ascii_case(&self.id_field) {
                "id"
            } else if name.eq_ignore_ascii_case(&self.payload_field) {
                "payload"
            } else {
                return None;
            };
            Some(Refused::ShadowedField { name: name.clone(), role })
        })
    }
}

impl Publisher for StreamPublisher {
    /// One pipeline of `XADD`s (and the `WAIT`, if asked), answered per message.
    async fn publish(&self, batch: &[OutboxMessage]) -> Vec<Result<(), PublishError>> {
        let mut results: Vec<Option<Result<(), PublishError>>> = batch
            .iter()
            .map(|m| self.shadowed(m).map(|r| Err(PublishError::new(m.destination(), false, r))))
            .collect();
        let to_send: Vec<usize> = (0..batch.len()).filter(|&i| results[i].is_none()).collect();
        if to_send.is_empty() {
            return results.into_iter().flatten().collect();
        }
        let mut pipe = redis::pipe();
        // Each XADD answers for itself: one failing entry must not fail the others.
        pipe.ignore_errors();
        for &i in &to_send {
            let m = &batch[i];
            let c = pipe.cmd("XADD").arg(m.destination());
            if let Some(n) = self.max_len {
                c.arg("MAXLEN").arg("~").arg(n);
            }
            c.arg("*")
                .arg(&self.id_field)
                .arg(m.id().as_str())
                .arg(&self.payload_field)
                .arg(m.payload());
            for (name, value) in m.headers() {
                c.arg(name).arg(value);
            }
        }
        if let Some((n, timeout)) = self.replicas {
            pipe.cmd("WAIT")
                .arg(n)
                .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX).max(1));
        }
        let answered: RedisResult<Vec<RedisResult<Value>>> =
            pipe.query_async(&mut self.conn.clone()).await;
        let mut answers = match answered {
            Ok(each) => each.into_iter(),
            Err(e) => {
                let e = Arc::new(e);
                for &i in &to_send {
                    let source = Error::Shared { op: "XADD", source: Arc::clone(&e) };
                    results[i] = Some(Err(PublishError::new(batch[i].destination(), true, source)));
                }
                return results.into_iter().flatten().collect();
            }
        };
        for &i in &to_send {
            let dest = batch[i].destination();
            results[i] = Some(match answers.next() {
                Some(Ok(_)) => Ok(()),
                Some(Err(e)) => {
                    // A key holding another type is a destination no retry will fix.
                    let retryable = e.code() != Some("WRONGTYPE");
                    Err(PublishError::new(dest, retryable, Error::Redis { op: "XADD", source: e }))
                }
                None => {
                    let e = (redis::ErrorKind::Parse, "no reply for this XADD").into();
                    Err(PublishError::new(dest, true, Error::Redis { op: "XADD", source: e }))
                }
            });
        }
        if let Some((wanted, _)) = self.replicas {
            let short = match answers.next() {
                Some(Ok(Value::Int(acked))) if acked >= i64::from(wanted) => None,
                Some(Ok(Value::Int(acked))) => Some(Ok(Refused::Replicas { acked, wanted })),
                Some(Ok(_)) | None => Some(Ok(Refused::Replicas { acked: 0, wanted })),
                Some(Err(e)) => Some(Err(e)),
            };
            if let Some(short) = short {
                // Written, but not where it was asked to be: published again on the retry.
                for &i in &to_send {
                    if matches!(results[i], Some(Ok(()))) {
                        let dest = batch[i].destination();
                        results[i] = Some(Err(match &short {
                            Ok(r) => PublishError::new(dest, true, r.clone()),
                            Err(e) => {
                                let source = Error::Redis { op: "WAIT", source: e.clone() };
                                PublishError::new(dest, true, source)
                            }
                        }));
                    }
                }
            }
        }
        results.into_iter().flatten().collect()
    }
}
