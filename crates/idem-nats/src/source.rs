//! The broker side shared by both modes: startup checks, fetching, progress, and the verbs.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::{AckKind, Context};
use futures_util::StreamExt;
use idem_core::RetentionWindow;
use idem_core::extract::Envelope;

use crate::delivery::MSG_ID_HEADER;
use crate::{Delivery, Error, Report, Settings};

/// Headers a dead-lettered copy carries.
pub mod headers {
    /// Why it was dead-lettered (the outcome's reason, one line, at most 1 KiB).
    pub const REASON: &str = "Idem-Reason";
    /// The outcome label (`conflict`, `failed_permanent`, `gave_up`, …).
    pub const OUTCOME: &str = "Idem-Outcome";
    /// The original `Nats-Msg-Id` (renamed, so a dead-letter stream's own duplicate window
    /// does not merge two different messages that reused one id).
    pub const ORIGINAL_MSG_ID: &str = "Idem-Original-Msg-Id";
    /// The subject it was published to.
    pub const SUBJECT: &str = "Idem-Source-Subject";
    /// The stream it came from.
    pub const STREAM: &str = "Idem-Source-Stream";
    /// Its sequence in that stream.
    pub const STREAM_SEQ: &str = "Idem-Source-Seq";
    /// The consumer that dead-lettered it.
    pub const CONSUMER: &str = "Idem-Source-Consumer";
    /// How many times it had been delivered.
    pub const DELIVERED: &str = "Idem-Delivered";
}

/// What to tell JetStream about one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    Ack,
    Nak(Option<Duration>),
    DeadLetter { outcome: &'static str, reason: String },
}

pub(crate) struct Source {
    js: Context,
    consumer: PullConsumer,
    pub(crate) settings: Settings,
    pub(crate) max_deliver: i64,
    pub(crate) progress: Option<Duration>,
    pub(crate) window: RetentionWindow,
}

impl Source {
    /// Reads the consumer's and stream's configuration and checks everything that would make
    /// the adapter lose or repeat messages: explicit acks, a bounded redelivery window covered by
    /// `retain`, a heartbeat shorter than `ack_wait`, a stream for the dead-letter subject.
    pub(crate) async fn open(
        js: Context,
        consumer: PullConsumer,
        settings: Settings,
        longest_nak: Duration,
        retain: Duration,
        heartbeat: Option<Duration>,
    ) -> Result<Self, Error> {
        crate::compat::check_server(&js.client().server_info().version)?;
        let info = consumer.cached_info();
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
            js.get_stream(&info.stream_name).await.map_err(|e| Error::js("stream info", e))?;
        let max_age = stream.cached_info().config.max_age;
        let window =
            crate::compat::redelivery_window(cfg, max_age, longest_nak.max(settings.retry_delay))
                .dead_letter_allowance(settings.dead_letter_allowance);
        window.check(retain)?;
        let progress = settings.progress.or(heartbeat);
        if let Some(p) = progress
            && p >= cfg.ack_wait
        {
            return Err(Error::Heartbeat { heartbeat: p, ack_wait: cfg.ack_wait });
        }
        js.stream_by_subject(settings.dead_letter.clone()).await.map_err(|e| {
            Error::NoDeadLetterStream { subject: settings.dead_letter.clone(), source: e.into() }
        })?;
        Ok(Self { max_deliver: cfg.max_deliver, js, consumer, settings, progress, window })
    }

    /// Up to `batch` messages: whatever is pending now, or else the first to arrive within
    /// `idle_wait` together with whatever is pending right after it.
    pub(crate) async fn fetch(&self) -> Result<Vec<Delivery>, Error> {
        let n = self.settings.batch;
        let mut out = self.pull_now(n).await?;
        if out.is_empty() {
            let mut one = self
                .consumer
                .batch()
                .max_messages(1)
                .expires(self.settings.idle_wait)
                .messages()
                .await
                .map_err(|e| Error::js("fetch", e))?;
            while let Some(m) = one.next().await {
                out.push(
                    Delivery::new(m.map_err(|e| Error::js("fetch", e))?)
                        .map_err(|e| Error::js("fetch", e))?,
                );
            }
            if !out.is_empty() && n > 1 {
                out.extend(self.pull_now(n - 1).await?);
            }
        }
        Ok(out)
    }

    async fn pull_now(&self, n: usize) -> Result<Vec<Delivery>, Error> {
        let mut msgs = self
            .consumer
            .fetch()
            .max_messages(n)
            .messages()
            .await
            .map_err(|e| Error::js("fetch", e))?;
        let mut out = Vec::with_capacity(n);
        while let Some(m) = msgs.next().await {
            let m = match m
                .map_err(|e| Error::js("fetch", e))
                .and_then(|m| Delivery::new(m).map_err(|e| Error::js("fetch", e)))
            {
                Ok(d) => d,
                // Messages already received are ours until their ack_wait: handle them rather
                // than leave them to be redelivered.
                Err(e) if !out.is_empty() => {
                    tracing::warn!(target: "idem", error = %e, received = out.len(),
                        "pull ended early; handling what arrived");
                    break;
                }
                Err(e) => return Err(e),
            };
            out.push(m);
        }
        Ok(out)
    }

    /// Runs `work` while telling JetStream every `progress` interval that the batch is still
    /// being handled, which restarts each message's `ack_wait`. The heartbeat runs beside the
    /// work, never instead of it, so a slow publish (a reconnecting client) cannot stall handlers.
    pub(crate) async fn with_progress<F: Future>(&self, batch: &[Delivery], work: F) -> F::Output {
        let Some(every) = self.progress else { return work.await };
        let beat = async {
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
        };
        tokio::select! {
            biased;
            out = work => out,
            _ = beat => unreachable!("the progress loop never ends"),
        }
    }

    /// The verdict for an outcome's disposition. A retry at the last allowed delivery becomes a
    /// dead letter: JetStream would otherwise stop delivering it silently.
    pub(crate) fn verdict(
        &self,
        d: &Delivery,
        disposition: idem_core::consumer::Disposition,
        label: &'static str,
    ) -> Verdict {
        use idem_core::consumer::Disposition;
        match disposition {
            Disposition::Ack => Verdict::Ack,
            Disposition::DeadLetter { reason } => Verdict::DeadLetter { outcome: label, reason },
            Disposition::Retry { after } => {
                if self.max_deliver > 0 && d.delivered() >= self.max_deliver {
                    Verdict::DeadLetter {
                        outcome: "gave_up",
                        reason: format!(
                            "gave up after {} deliveries (consumer max_deliver): last outcome {label}",
                            d.delivered()
                        ),
                    }
                } else {
                    Verdict::Nak(Some(after.unwrap_or(self.settings.retry_delay)))
                }
            }
            _ => Verdict::Nak(Some(self.settings.retry_delay)),
        }
    }

    /// Applies the verdicts: dead letters first (published and confirmed by JetStream, then
    /// `Term`), then acks and naks. The ack is the last step for every message.
    pub(crate) async fn apply(&self, items: Vec<(Delivery, Verdict)>, report: &mut Report) {
        let replies = items.iter().map(|(d, v)| async move {
            match v {
                Verdict::Ack => (d.reply(AckKind::Ack).await, 0),
                Verdict::Nak(delay) => (d.nak(*delay).await, 1),
                Verdict::DeadLetter { outcome, reason } => match self.dead_letter(d, outcome, reason).await {
                    Ok(()) => (d.reply(AckKind::Term).await, 2),
                    Err(e) => {
                        tracing::warn!(target: "idem", seq = d.stream_sequence(), error = %e,
                            "dead-letter publish failed; retrying the message instead of terminating it");
                        (d.nak(Some(self.settings.retry_delay)).await, 3)
                    }
                },
            }
        });
        for (res, kind) in futures_util::future::join_all(replies).await {
            match kind {
                0 => report.acked += 1,
                1 => report.retried += 1,
                2 => report.dead_lettered += 1,
                _ => {
                    report.dead_letter_failures += 1;
                    report.retried += 1;
                }
            }
            if let Err(e) = res {
                report.reply_failures += 1;
                tracing::warn!(target: "idem", error = %e,
                    "ack/nak not sent; JetStream redelivers after ack_wait and the copy ends as a duplicate");
            }
        }
    }

    async fn dead_letter(
        &self,
        d: &Delivery,
        outcome: &str,
        reason: &str,
    ) -> Result<(), async_nats::Error> {
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
            h.insert(headers::ORIGINAL_MSG_ID, id);
        }
        h.insert(headers::REASON, header_safe(reason).as_str());
        h.insert(headers::OUTCOME, outcome);
        h.insert(headers::SUBJECT, d.subject());
        h.insert(headers::STREAM, d.stream());
        h.insert(headers::STREAM_SEQ, d.stream_sequence().to_string().as_str());
        h.insert(headers::CONSUMER, d.consumer());
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
                self.settings.dead_letter.clone(),
                h,
                bytes::Bytes::copy_from_slice(d.payload()),
            )
            .await?;
        ack.await?;
        Ok(())
    }
}

/// Header values are one line: newlines become spaces, and the value is cut at 1 KiB.
fn header_safe(s: &str) -> String {
    let mut out: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if out.len() > 1024 {
        let mut cut = 1024;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::header_safe;

    #[test]
    fn header_values_are_one_bounded_line() {
        assert_eq!(header_safe("a\r\nb"), "a  b");
        assert_eq!(header_safe(&"é".repeat(1000)).len(), 1024);
    }
}
