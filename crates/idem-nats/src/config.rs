//! What is specific to JetStream in a consumer's settings, and the startup checks that open
//! the source.

use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use idem_core::consumer::{Opening, SourceConfig};

use crate::Error;
use crate::source::JetStreamSource;

/// A JetStream pull consumer's settings for the consumer: what is specific to JetStream. Only the
/// dead-letter subject is required; batch size, idle wait and broker timeouts are the consumer's
/// ([`Builder`](idem_core::consumer::Builder)).
///
/// Defaults: retry transient failures after 1 s, send `Progress` on the engine's lease
/// heartbeat (none without one), no extra gathering after the first message, no dead-letter
/// allowance in the retention check, no assumed `max_age` (a stream without one is refused).
///
/// ```
/// # async fn f(js: async_nats::jetstream::Context, pull: async_nats::jetstream::consumer::PullConsumer) {
/// use std::time::Duration;
/// use idem_nats::JetStreamConfig;
///
/// // Consuming a stream on `orders.>`: the dead letters go to a subject outside it.
/// let config = JetStreamConfig::new(js, pull, "dlq.orders")
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
pub struct JetStreamConfig {
    js: Context,
    consumer: PullConsumer,
    dead_letter: String,
    retry_delay: Duration,
    batch_wait: Duration,
    progress: Option<Duration>,
    dead_letter_allowance: Duration,
    assumed_max_age: Option<Duration>,
}

impl JetStreamConfig {
    /// Consumes `consumer` (a pull consumer with explicit acks and a `max_deliver`) and
    /// dead-letters to `dead_letter_subject`: a plain subject that a stream other than the
    /// consumed one captures, or that the consumer's filter excludes (checked at startup; see
    /// [the dead-letter subject](JetStreamConfig#the-dead-letter-subject)).
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

impl SourceConfig for JetStreamConfig {
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
