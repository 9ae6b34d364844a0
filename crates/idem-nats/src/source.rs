//! The JetStream side of the consumer: fetching, progress, dead letters and the verbs.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{AckKind, Context};
use futures_util::StreamExt;
use idem_core::RedeliveryWindow;
use idem_core::consumer::{DeadLetter, Source, headers};
use idem_core::engine::Verb;
use idem_core::extract::Envelope;

use crate::delivery::{MSG_ID_HEADER, is_server_header};
use crate::{Delivery, Error};

/// A JetStream pull consumer, opened (see [`JetStreamConfig`](crate::JetStreamConfig)).
#[derive(Debug)]
pub struct JetStreamSource {
    pub(crate) js: Context,
    pub(crate) consumer: PullConsumer,
    pub(crate) dead_letter: String,
    pub(crate) retry_delay: Duration,
    pub(crate) batch_wait: Duration,
    pub(crate) max_deliver: i64,
    pub(crate) progress: Option<Duration>,
    pub(crate) window: RedeliveryWindow,
}

impl JetStreamSource {
    /// The redelivery window the retention was checked against.
    pub fn redelivery_window(&self) -> RedeliveryWindow {
        self.window
    }

    /// The dead-letter subject.
    pub fn dead_letter_subject(&self) -> &str {
        &self.dead_letter
    }

    /// What is pending right now, or the first message within `wait` with what is pending right
    /// after it, then more for up to the batch wait, up to `max`.
    async fn pull(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>, Error> {
        let mut out = self.pull_now(max).await?;
        if out.is_empty() {
            let one = self
                .consumer
                .batch()
                .max_messages(1)
                .expires(wait)
                .messages()
                .await
                .map_err(|e| Error::js("fetch", e))?;
            if let Some(e) = read_pull(one, &mut out, wait + PULL_GRACE).await
                && out.is_empty()
            {
                return Err(e);
            }
            if !out.is_empty() && max > 1 {
                out.extend(self.pull_now(max - 1).await?);
            }
        }
        let until = tokio::time::Instant::now() + self.batch_wait;
        while !out.is_empty() && out.len() < max {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            // JetStream refuses pull expiries under 1 ms.
            let expires = left.max(Duration::from_millis(1));
            let more = self
                .consumer
                .batch()
                .max_messages(max - out.len())
                .expires(expires)
                .messages()
                .await
                .map_err(|e| Error::js("fetch", e))?;
            if let Some(e) = read_pull(more, &mut out, expires + PULL_GRACE).await {
                tracing::warn!(target: "idem", error = %e, received = out.len(),
                    "pull ended early; handling what arrived");
                return Ok(out);
            }
        }
        Ok(out)
    }

    /// The messages available now (a no-wait pull).
    async fn pull_now(&self, n: usize) -> Result<Vec<Delivery>, Error> {
        let msgs = self
            .consumer
            .fetch()
            .max_messages(n)
            .messages()
            .await
            .map_err(|e| Error::js("fetch", e))?;
        let mut out = Vec::with_capacity(n);
        match read_pull(msgs, &mut out, PULL_GRACE).await {
            // Messages already received are ours until their ack_wait: handle them rather
            // than leave them to be redelivered.
            Some(e) if !out.is_empty() => {
                tracing::warn!(target: "idem", error = %e, received = out.len(),
                    "pull ended early; handling what arrived");
                Ok(out)
            }
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    async fn copy(&self, d: &Delivery, dl: &DeadLetter) -> Result<(), Error> {
        let mut h = HeaderMap::new();
        if let Some(orig) = d.headers() {
            for (k, vs) in orig.iter() {
                let name: &str = k.as_ref();
                // The message id goes on as idem-original-message-id, below.
                if is_server_header(name) {
                    continue;
                }
                for v in vs {
                    h.append(name, v.as_str());
                }
            }
        }
        if let Some(id) = d.message_id() {
            h.insert(headers::ORIGINAL_MESSAGE_ID, id);
        }
        for (name, value) in dl.headers() {
            h.insert(name, value.as_str());
        }
        h.insert(headers::SOURCE, d.subject());
        h.insert(headers::POSITION, format!("{}/{}", d.stream(), d.stream_sequence()).as_str());
        h.insert(headers::DELIVERED, d.delivered().to_string().as_str());
        // Dead-lettering the same delivery twice (a crash between publish and Term) is merged by
        // the dead-letter stream's duplicate window.
        h.insert(
            MSG_ID_HEADER,
            format!("idem-dlq:{}:{}", d.stream(), d.stream_sequence()).as_str(),
        );
        let ack = self
            .js
            .publish_with_headers(
                self.dead_letter.clone(),
                h,
                bytes::Bytes::copy_from_slice(d.payload()),
            )
            .await
            .map_err(|e| Error::js("dead-letter publish", e))?;
        ack.await.map_err(|e| Error::js("dead-letter publish ack", e))?;
        Ok(())
    }
}

fn delivery(
    m: Result<async_nats::jetstream::Message, impl Into<async_nats::Error>>,
) -> Result<Delivery, Error> {
    let m = m.map_err(|e| Error::js("fetch", e))?;
    Delivery::new(m).map_err(|e| Error::js("fetch", e))
}

/// How much longer than its expiry a pull may go unanswered: a server that restarted has
/// forgotten the request, and the client (which reconnects by itself) would wait for ever.
const PULL_GRACE: Duration = Duration::from_secs(2);

/// Reads a pull's messages into `out` until it ends; the error that ended it early (a bad
/// message, or no end within `limit`), if any. What arrived before stays in `out`.
async fn read_pull<S>(mut pull: S, out: &mut Vec<Delivery>, limit: Duration) -> Option<Error>
where
    S: futures_util::Stream<Item = Result<async_nats::jetstream::Message, async_nats::Error>>
        + Unpin,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, pull.next()).await {
            Ok(Some(m)) => match delivery(m) {
                Ok(d) => out.push(d),
                Err(e) => return Some(e),
            },
            Ok(None) => return None,
            Err(_) => return Some(Error::PullUnanswered(limit)),
        }
    }
}

impl Source for JetStreamSource {
    type Delivery = Delivery;
    type Error = Error;

    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>, Error> {
        self.pull(max, wait).await
    }

    /// The last delivery's `num_pending`: what the stream still holds for this consumer.
    fn lag(&self, batch: &[Delivery]) -> Option<u64> {
        batch.last().map(Delivery::pending)
    }

    /// `Progress` for every message of the batch on the progress beat: the heartbeat runs
    /// beside the handlers, never instead of them, so a slow publish (a reconnecting client)
    /// cannot stall them.
    async fn keep_alive(&self, batch: &[Delivery]) {
        let Some(every) = self.progress else { return std::future::pending().await };
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            let beats = batch.iter().map(|d| d.reply(AckKind::Progress));
            for (d, r) in batch.iter().zip(futures_util::future::join_all(beats).await) {
                if let Err(e) = r {
                    tracing::warn!(target: "idem", seq = d.stream_sequence(), error = %e,
                        "progress heartbeat failed; the message may be redelivered and then found in progress");
                }
            }
        }
    }

    /// At the consumer's last allowed delivery a retry would be the last: JetStream would stop
    /// delivering the message without a trace.
    fn give_up(&self, d: &Delivery) -> Option<String> {
        (self.max_deliver > 0 && d.delivered() >= self.max_deliver)
            .then(|| format!("gave up after {} deliveries (consumer max_deliver)", d.delivered()))
    }

    async fn dead_letter(&self, items: &[(&Delivery, DeadLetter)]) -> Vec<Result<(), Error>> {
        futures_util::future::join_all(items.iter().map(|(d, dl)| self.copy(d, dl))).await
    }

    /// Acks, `Term`s (dead-lettered), `Nak`s (retries, with their delay; releases at once),
    /// all sent together. A verb that cannot be sent is counted: JetStream redelivers that
    /// message after `ack_wait`, and the store makes the copy a duplicate.
    async fn settle(&self, items: Vec<(Delivery, Verb)>) -> Result<u64, Error> {
        let replies = items.iter().map(|(d, v)| {
            let kind = match v {
                Verb::Ack => AckKind::Ack,
                Verb::DeadLetter { .. } => AckKind::Term,
                Verb::Retry { after } => AckKind::Nak(Some(after.unwrap_or(self.retry_delay))),
                _ => AckKind::Nak(None),
            };
            d.reply(kind)
        });
        let mut failed = 0;
        for r in futures_util::future::join_all(replies).await {
            if let Err(e) = r {
                failed += 1;
                tracing::warn!(target: "idem", error = %e,
                    "ack/nak not sent; JetStream redelivers after ack_wait and the copy ends as a duplicate");
            }
        }
        Ok(failed)
    }
}
