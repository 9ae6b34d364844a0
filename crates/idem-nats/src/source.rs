//! The JetStream side of the driver: startup checks, fetching, progress, and the verbs.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::{AckKind, Context};
use futures_util::StreamExt;
use idem_core::RetentionWindow;
use idem_core::consumer::{Action, DeadLetter, Opening, Source, SourceConfig, headers};
use idem_core::extract::Envelope;

use crate::delivery::MSG_ID_HEADER;
use crate::{Delivery, Error};

/// A JetStream pull consumer's settings for the driver: what is specific to JetStream. Only the
/// dead-letter subject is required; batch size, idle wait and broker timeouts are the driver's
/// ([`Builder`](idem_core::consumer::Builder)).
///
/// Defaults: retry transient failures after 1 s, send `Progress` on the engine's lease
/// heartbeat (none without one), no extra gathering after the first message, no dead-letter
/// allowance in the retention check, no assumed `max_age` (a stream without one is refused).
///
/// ```
/// # async fn f(js: async_nats::jetstream::Context, pull: async_nats::jetstream::consumer::PullConsumer) {
/// use std::time::Duration;
/// use idem_nats::JetStream;
///
/// // Consuming a stream on `orders.>`: the dead letters go to a subject outside it.
/// let config = JetStream::new(js, pull, "dlq.orders")
///     .retry_delay(Duration::from_secs(5))
///     .batch_wait(Duration::from_millis(2));
/// # }
/// ```
///
/// # The dead-letter subject
/// It must be captured by a stream (so a dead letter is stored, not dropped) and must not come
/// back to this consumer: opening fails with [`Error::DeadLetterLoop`] when the consumed stream
/// captures it — one of its subjects matches it (`orders.>` matches `orders.dlq`), or it sources
/// or mirrors the stream that captures it — and the consumer's filter subject matches it too
/// (or the consumer has none). Each dead letter would otherwise be fetched again as a new
/// message under a new `Nats-Msg-Id` and processed: a conflict dead-lettered this way ends up
/// applied. A subject the consumed stream captures but the consumer's filter excludes (stream
/// `orders.>`, filter `orders.placed`, dead letters to `orders.dlq`) is accepted: this consumer
/// never receives it, though another consumer of the stream without a filter would. Not seen by
/// the check: a consumer with several filter subjects (NATS 2.10 `filter_subjects`, which this
/// build does not read) counts as unfiltered, so it is refused when its stream captures the
/// subject; subject transforms and cross-account or cross-domain sources are not followed.
#[derive(Debug)]
#[must_use]
pub struct JetStream {
    js: Context,
    consumer: PullConsumer,
    dead_letter: String,
    retry_delay: Duration,
    batch_wait: Duration,
    progress: Option<Duration>,
    dead_letter_allowance: Duration,
    assumed_max_age: Option<Duration>,
}

impl JetStream {
    /// Consumes `consumer` (a pull consumer with explicit acks and a `max_deliver`) and
    /// dead-letters to `dead_letter_subject`: a plain subject that a stream other than the
    /// consumed one captures, or that the consumer's filter excludes (checked at startup; see
    /// [the dead-letter subject](JetStream#the-dead-letter-subject)).
    pub fn new(
        js: Context,
        consumer: PullConsumer,
        dead_letter_subject: impl Into<String>,
    ) -> Self {
        Self {
            js,
            consumer,
            dead_letter: dead_letter_subject.into(),
            retry_delay: Duration::from_secs(1),
            batch_wait: Duration::ZERO,
            progress: None,
            dead_letter_allowance: Duration::ZERO,
            assumed_max_age: None,
        }
    }

    /// The `Nak` delay after a transient failure (a key in progress elsewhere waits for the
    /// other lease instead).
    pub fn retry_delay(mut self, d: Duration) -> Self {
        self.retry_delay = d;
        self
    }

    /// After the first message of a fetch, keep pulling for up to `d` until the batch is full:
    /// bigger batches (fewer commits) when messages trickle in, at the cost of that latency.
    pub fn batch_wait(mut self, d: Duration) -> Self {
        self.batch_wait = d;
        self
    }

    /// Sends `Progress` (`+WPI`) for every message of a batch every `interval` while its
    /// handlers run, so JetStream restarts their `ack_wait` instead of redelivering them. Must be
    /// shorter than `ack_wait`. Default: the engine's lease heartbeat, if it has one.
    pub fn progress(mut self, interval: Duration) -> Self {
        self.progress = Some(interval);
        self
    }

    /// How long a dead-lettered message may wait before an operator resubmits it; added to the
    /// redelivery window the retention must cover.
    pub fn dead_letter_allowance(mut self, d: Duration) -> Self {
        self.dead_letter_allowance = d;
        self
    }

    /// States the longest a message may wait in the consumed stream before its first delivery,
    /// for a stream without `max_age` (0: it keeps messages until a limit or an ack removes
    /// them). The redelivery window then counts `d` in place of `max_age`; opening refuses such
    /// a stream without it ([`Error::UnboundedMaxAge`]), since a copy of a message (a
    /// producer's late retry) could then wait there longer than any dedup retention. On a
    /// stream with a `max_age`, the longer of the two is counted.
    pub fn assume_max_age(mut self, d: Duration) -> Self {
        self.assumed_max_age = Some(d);
        self
    }
}

/// A JetStream pull consumer opened for the driver (see [`JetStream`]).
#[derive(Debug)]
pub struct JetStreamSource {
    js: Context,
    consumer: PullConsumer,
    dead_letter: String,
    retry_delay: Duration,
    batch_wait: Duration,
    max_deliver: i64,
    progress: Option<Duration>,
    window: RetentionWindow,
}

impl JetStreamSource {
    /// The redelivery window the retention was checked against.
    pub fn redelivery_window(&self) -> RetentionWindow {
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
                if name.eq_ignore_ascii_case(MSG_ID_HEADER) {
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

impl SourceConfig for JetStream {
    type Source = JetStreamSource;

    /// Reads the consumer's and stream's configuration and checks everything that would make
    /// the adapter lose or repeat messages: explicit acks, a bounded redelivery window covered by
    /// the retention, a progress beat shorter than `ack_wait`, a stream for the dead-letter
    /// subject other than the one this consumer reads from.
    async fn open(self, opening: Opening<'_>) -> Result<JetStreamSource, Error> {
        crate::compat::check_server(&self.js.client().server_info().version)?;
        if let Some(problem) = crate::subject::publish_problem(&self.dead_letter) {
            return Err(Error::DeadLetterSubject { subject: self.dead_letter, problem });
        }
        let info = self.consumer.cached_info().clone();
        let cfg = &info.config;
        let name = info.name.clone();
        if cfg.ack_policy != AckPolicy::Explicit {
            return Err(Error::AckPolicy {
                consumer: name,
                policy: format!("{:?}", cfg.ack_policy),
            });
        }
        let Ok(max_deliver) = u32::try_from(cfg.max_deliver) else {
            return Err(Error::UnboundedRedelivery { consumer: name });
        };
        if max_deliver == 0 {
            return Err(Error::UnboundedRedelivery { consumer: name });
        }
        let stream =
            self.js.get_stream(&info.stream_name).await.map_err(|e| Error::js("stream info", e))?;
        let stream_cfg = &stream.cached_info().config;
        let max_age = match (stream_cfg.max_age, self.assumed_max_age) {
            (age, None) if age.is_zero() => {
                return Err(Error::UnboundedMaxAge { stream: info.stream_name.clone() });
            }
            (age, assumed) => age.max(assumed.unwrap_or_default()),
        };
        // The longest Nak the adapter sends: the retry delay, or another consumer's lease.
        let longest_nak = opening.lease.unwrap_or_default().max(self.retry_delay);
        let window = crate::compat::redelivery_window(cfg, max_age, longest_nak)
            .dead_letter_allowance(self.dead_letter_allowance);
        window.check(opening.retention)?;
        let progress = self.progress.or(opening.heartbeat);
        if let Some(p) = progress
            && p >= cfg.ack_wait
        {
            return Err(Error::Heartbeat { heartbeat: p, ack_wait: cfg.ack_wait });
        }
        let dead_letter_stream =
            self.js.stream_by_subject(self.dead_letter.clone()).await.map_err(|e| {
                Error::NoDeadLetterStream { subject: self.dead_letter.clone(), source: e.into() }
            })?;
        if let Some(how) = crate::subject::loop_through(
            stream_cfg,
            &dead_letter_stream,
            &cfg.filter_subject,
            &self.dead_letter,
        ) {
            return Err(Error::DeadLetterLoop {
                subject: self.dead_letter,
                stream: info.stream_name.clone(),
                consumer: name,
                how,
            });
        }
        Ok(JetStreamSource {
            js: self.js,
            consumer: self.consumer,
            dead_letter: self.dead_letter,
            retry_delay: self.retry_delay,
            batch_wait: self.batch_wait,
            max_deliver: cfg.max_deliver,
            progress,
            window,
        })
    }
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
    type Message = Delivery;
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
    async fn settle(&self, items: Vec<(Delivery, Action)>) -> Result<u64, Error> {
        let replies = items.iter().map(|(d, a)| {
            let kind = match a {
                Action::Ack => AckKind::Ack,
                Verb::DeadLetter { .. } => AckKind::Term,
                Action::Retry { after } => AckKind::Nak(Some(after.unwrap_or(self.retry_delay))),
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
