//! The rdkafka side shared by both modes: poll batches, settle outcomes, commit the durable
//! prefix, retry with the partition paused, follow rebalances.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idem_core::consumer::Disposition;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::retention::RetentionGap;
use crate::tracker::Tracker;
use crate::{Delivery, Error, Report, Settings};

/// How long the retention check waits for the brokers.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

type Tp = (String, i32);

/// Header names on dead-lettered records.
pub mod headers {
    /// Why the message was dead-lettered (the outcome's reason).
    pub const REASON: &str = "idem-reason";
    /// The outcome label (`conflict`, `failed_permanent`).
    pub const OUTCOME: &str = "idem-outcome";
    /// The original topic.
    pub const TOPIC: &str = "idem-original-topic";
    /// The original partition (decimal).
    pub const PARTITION: &str = "idem-original-partition";
    /// The original offset (decimal).
    pub const OFFSET: &str = "idem-original-offset";
}

/// What became of one message, for the hook passed to `with_hook`.
#[derive(Debug)]
#[non_exhaustive]
pub struct Settled<'a> {
    /// The message.
    pub delivery: &'a Delivery,
    /// The outcome label (`processed`, `duplicate`, `conflict`, `in_progress_elsewhere`,
    /// `failed_transient`, `failed_permanent`).
    pub outcome: &'static str,
    /// What the adapter did about it.
    pub action: Action,
}

/// What the adapter did with a settled message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Its offset may be committed (after the messages before it in its partition).
    Commit,
    /// Produced to the dead-letter topic (acknowledged); its offset may be committed.
    DeadLettered,
    /// Kept for a retry; its partition is paused and nothing past it is committed.
    Retry,
}

pub(crate) type Hook = Arc<dyn Fn(&Settled<'_>) + Send + Sync>;

/// Records revocations as librdkafka reports them (inside a poll, so never while a batch is
/// being processed).
#[derive(Default)]
pub(crate) struct Ctx {
    revoked: Mutex<Vec<Tp>>,
}

impl ClientContext for Ctx {}

impl ConsumerContext for Ctx {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let mut r = self.revoked.lock().unwrap_or_else(PoisonError::into_inner);
            for e in tpl.elements() {
                r.push((e.topic().to_owned(), e.partition()));
            }
            tracing::info!(target: "idem", partitions = tpl.count(), "partitions revoked");
        }
    }
}

#[derive(Default)]
struct State {
    tracker: Tracker,
    retries: Vec<(Instant, Delivery)>,
    paused: HashSet<Tp>,
    /// Revocations seen so far; each polled message remembers the count at its poll.
    epoch: u64,
    /// The epoch at which each partition was last revoked.
    revoked_at: HashMap<Tp, u64>,
}

impl State {
    /// Whether `d` was polled under the current assignment of its partition (so its offset
    /// counts towards that partition's commit).
    fn owns(&self, d: &Delivery) -> bool {
        self.revoked_at.get(&d.tp()).is_none_or(|&at| d.epoch >= at)
    }
}

pub(crate) struct Source {
    consumer: Arc<StreamConsumer<Ctx>>,
    producer: FutureProducer,
    /// What a producer or admin client needs to reach the same brokers.
    conn: ClientConfig,
    topics: Vec<String>,
    pub(crate) settings: Settings,
    state: Mutex<State>,
    pub(crate) hook: Option<Hook>,
}

/// One message's decision: its outcome label and what the broker side should do.
pub(crate) type Decision = (&'static str, Disposition);

pub(crate) type Decide<'b> = Pin<Box<dyn Future<Output = Vec<Decision>> + Send + 'b>>;

/// What a mode does with a polled batch: decide every message's outcome (effects committed).
pub(crate) trait Decider {
    fn decide<'a>(&'a self, batch: &'a [Delivery]) -> Decide<'a>;
}

fn check_config(config: &ClientConfig) -> Result<(), Error> {
    if config.get("group.id").is_none_or(str::is_empty) {
        return Err(Error::MissingSetting {
            key: "group.id",
            why: "offsets are committed for a consumer group",
        });
    }
    if config.get("bootstrap.servers").is_none_or(str::is_empty) {
        return Err(Error::MissingSetting {
            key: "bootstrap.servers",
            why: "where the brokers are",
        });
    }
    for (key, why) in [
        (
            "enable.auto.commit",
            "idem commits each partition's offset itself, only up to the last message whose outcome is durable",
        ),
        ("enable.auto.offset.store", "idem stores offsets itself, only for settled messages"),
    ] {
        if let Some(v) = config.get(key)
            && v != "false"
        {
            return Err(Error::Setting { key, value: v.to_owned(), why });
        }
    }
    Ok(())
}

/// The settings a producer or admin client needs to reach the same brokers as `config`: the
/// addresses, the client id and every security, SASL and SSL setting (credentials included).
fn connection_config(config: &ClientConfig) -> ClientConfig {
    const EXACT: [&str; 3] = ["bootstrap.servers", "client.id", "broker.address.family"];
    const PREFIXES: [&str; 3] = ["security.", "sasl.", "ssl."];
    let mut out = ClientConfig::new();
    // `config_map` masks secrets in its values, so only its keys are used.
    for key in config.config_map().into_keys() {
        if (EXACT.contains(&key) || PREFIXES.iter().any(|p| key.starts_with(p)))
            && let Some(v) = config.get(key)
        {
            out.set(key, v);
        }
    }
    out
}

impl Source {
    /// The consumed topics' logs that outlive `retain` (topic patterns `^…` are not checked).
    pub(crate) async fn retention_gaps(
        &self,
        retain: Duration,
    ) -> Result<Vec<RetentionGap>, Error> {
        let admin: AdminClient<DefaultClientContext> =
            self.conn.create().map_err(|e| Error::kafka("create admin client", e))?;
        let names: Vec<&str> =
            self.topics.iter().map(String::as_str).filter(|t| !t.starts_with('^')).collect();
        let specs: Vec<ResourceSpecifier<'_>> =
            names.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
        let opts = AdminOptions::new().request_timeout(Some(ADMIN_TIMEOUT));
        let answer = tokio::time::timeout(ADMIN_TIMEOUT, admin.describe_configs(&specs, &opts))
            .await
            .unwrap_or(Err(KafkaError::AdminOpCreation("describe configs timed out".into())));
        // Destroying a client can block: not on the runtime's threads.
        tokio::task::spawn_blocking(move || drop(admin));
        let mut logs = Vec::with_capacity(names.len());
        for (name, r) in
            names.iter().zip(answer.map_err(|e| Error::kafka("describe topic configs", e))?)
        {
            let resource =
                r.map_err(|e| Error::kafka("describe topic configs", KafkaError::AdminOp(e)))?;
            let value = resource.get("retention.ms").and_then(|e| e.value.as_deref());
            let log = match value {
                Some(v) => crate::retention::parse_ms(name, v).map_err(Error::Broker)?,
                None => {
                    return Err(Error::Broker(format!(
                        "topic `{name}`: no retention.ms in its configs"
                    )));
                }
            };
            logs.push(((*name).to_owned(), log));
        }
        Ok(crate::retention::gaps(logs, retain))
    }

    /// Logs a warning for every gap [`retention_gaps`](Self::retention_gaps) finds (or that it
    /// could not check).
    pub(crate) async fn warn_retention(&self, retain: Duration) {
        match self.retention_gaps(retain).await {
            Ok(gaps) => {
                for g in gaps {
                    tracing::warn!(target: "idem", topic = %g.topic, "{g}");
                }
            }
            Err(e) => tracing::warn!(target: "idem", error = %e,
                "could not compare the topics' retention.ms with the dedup retention"),
        }
    }

    pub(crate) fn open(
        config: &ClientConfig,
        topics: &[&str],
        settings: Settings,
    ) -> Result<Self, Error> {
        check_config(config)?;
        if topics.is_empty() {
            return Err(Error::Topics("at least one topic is needed"));
        }
        if topics.iter().any(|t| t.is_empty()) || settings.dead_letter.is_empty() {
            return Err(Error::Topics("a topic name is empty"));
        }
        if topics.contains(&settings.dead_letter.as_str()) {
            return Err(Error::Topics("the dead-letter topic must not be a consumed topic"));
        }
        let mut cc = config.clone();
        cc.set("enable.auto.commit", "false").set("enable.auto.offset.store", "false");
        if cc.get("auto.offset.reset").is_none() {
            cc.set("auto.offset.reset", "earliest");
        }
        let consumer: StreamConsumer<Ctx> = cc
            .create_with_context(Ctx::default())
            .map_err(|e| Error::kafka("create consumer", e))?;
        consumer.subscribe(topics).map_err(|e| Error::kafka("subscribe", e))?;
        let conn = connection_config(config);
        let mut pc = conn.clone();
        pc.set("acks", "all")
            .set("message.timeout.ms", settings.produce_timeout.as_millis().to_string());
        let producer: FutureProducer =
            pc.create().map_err(|e| Error::kafka("create dead-letter producer", e))?;
        Ok(Self {
            consumer: Arc::new(consumer),
            producer,
            conn,
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            settings,
            state: Mutex::new(State::default()),
            hook: None,
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies the revocations librdkafka reported: forget the partitions' progress so nothing
    /// more is committed for them (the new owner resumes at the committed offset, which is never
    /// past a message this consumer has not settled). Messages of theirs already polled — in
    /// `batch` or waiting for a retry — are still processed: the store makes a second
    /// processing a duplicate, while dropping them would lose them if the client resumed past
    /// them (seen against tansu when a partition came back to the same member).
    fn revocations(&self) {
        let revoked: Vec<Tp> = std::mem::take(
            &mut *self.consumer.context().revoked.lock().unwrap_or_else(PoisonError::into_inner),
        );
        if revoked.is_empty() {
            return;
        }
        let mut st = self.state();
        st.epoch += 1;
        for tp in &revoked {
            st.tracker.forget(tp);
            st.paused.remove(tp);
            let e = st.epoch;
            st.revoked_at.insert(tp.clone(), e);
        }
    }

    /// Polls up to `batch` messages: the retries that are due first, then new messages.
    pub(crate) async fn fetch(&self) -> Result<Vec<Delivery>, Error> {
        let mut batch = Vec::new();
        self.revocations();
        let now = Instant::now();
        let next_retry = {
            let mut st = self.state();
            let mut i = 0;
            while i < st.retries.len() && batch.len() < self.settings.batch {
                if st.retries[i].0 <= now {
                    batch.push(st.retries.swap_remove(i).1);
                } else {
                    i += 1;
                }
            }
            st.retries.iter().map(|(at, _)| *at).min()
        };
        let mut wait = if batch.is_empty() {
            next_retry.map_or(self.settings.idle_wait, |at| {
                at.saturating_duration_since(now).min(self.settings.idle_wait)
            })
        } else {
            Duration::ZERO
        };
        while batch.len() < self.settings.batch {
            let polled = tokio::time::timeout(wait, self.consumer.recv()).await;
            let m = match polled {
                Err(_) => break,
                Ok(Err(e)) => {
                    self.revocations();
                    if batch.is_empty() {
                        return Err(Error::kafka("poll", e));
                    }
                    tracing::warn!(target: "idem", error = %e, "poll failed; settling the batch so far");
                    break;
                }
                Ok(Ok(m)) => Delivery::from_borrowed(&m),
            };
            // A rebalance runs inside the poll: stop tracking revoked partitions before `m`.
            self.revocations();
            let mut m = m;
            m.epoch = self.state().epoch;
            batch.push(m);
            wait = self.settings.batch_wait;
        }
        let mut st = self.state();
        for d in &batch {
            // A retry is already tracked; polling it again adds nothing. A message of a revoked
            // partition polled before its revocation is processed but not tracked.
            if st.owns(d) {
                st.tracker.polled(&d.tp(), d.offset());
            }
        }
        Ok(batch)
    }

    /// Dead-letters, schedules retries and commits the durable prefix of every partition.
    /// Nothing is committed past a message that has not settled.
    pub(crate) async fn settle(&self, batch: Vec<Delivery>, decided: Vec<Decision>) -> Report {
        let mut report = Report { fetched: batch.len() as u64, ..Report::default() };
        let mut decided = decided.into_iter();
        let mut items = Vec::with_capacity(batch.len());
        for d in batch {
            let (label, disp) =
                decided.next().unwrap_or(("failed_transient", Disposition::Retry { after: None }));
            report.count(label);
            metrics::counter!("idem_kafka_outcomes_total", "outcome" => label).increment(1);
            items.push((d, label, disp));
        }
        let produced =
            futures_util::future::join_all(items.iter().map(|(d, label, disp)| async move {
                match disp {
                    Disposition::DeadLetter { reason } => {
                        Some(self.dead_letter(d, label, reason).await)
                    }
                    _ => None,
                }
            }))
            .await;
        let mut to_resume = Vec::new();
        {
            let mut st = self.state();
            for ((mut d, label, disp), produced) in items.into_iter().zip(produced) {
                let action = match (&disp, produced) {
                    (Disposition::Ack, _) => Action::Commit,
                    (Disposition::DeadLetter { .. }, Some(Ok(()))) => {
                        report.dead_lettered += 1;
                        Action::DeadLettered
                    }
                    (Disposition::DeadLetter { .. }, _) => {
                        report.dead_letter_failures += 1;
                        Action::Retry
                    }
                    _ => Action::Retry,
                };
                if let Some(h) = &self.hook {
                    h(&Settled { delivery: &d, outcome: label, action });
                }
                let tp = d.tp();
                if action == Action::Retry {
                    report.retried += 1;
                    let after = match disp {
                        Disposition::Retry { after: Some(a) } => {
                            a.clamp(Duration::from_millis(10), self.settings.retry_delay)
                        }
                        _ => self.settings.retry_delay,
                    };
                    d.attempts += 1;
                    let owned = st.owns(&d);
                    st.retries.push((Instant::now() + after, d));
                    if owned && st.paused.insert(tp.clone()) {
                        self.pause(&tp, true);
                    }
                } else if st.owns(&d) {
                    st.tracker.settled(&tp, d.offset());
                }
            }
            let State { retries, paused, .. } = &mut *st;
            paused.retain(|tp| {
                let waiting =
                    retries.iter().any(|(_, d)| d.topic() == tp.0 && d.partition() == tp.1);
                if !waiting {
                    to_resume.push(tp.clone());
                }
                waiting
            });
        }
        for tp in to_resume {
            self.pause(&tp, false);
        }
        if !self.commit().await {
            report.commit_failures += 1;
        }
        report
    }

    fn pause(&self, tp: &Tp, pause: bool) {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&tp.0, tp.1);
        let r = if pause { self.consumer.pause(&tpl) } else { self.consumer.resume(&tpl) };
        if let Err(e) = r {
            tracing::warn!(target: "idem", topic = %tp.0, partition = tp.1, error = %e,
                "could not {} the partition", if pause { "pause" } else { "resume" });
        }
    }

    async fn dead_letter(&self, d: &Delivery, label: &str, reason: &str) -> Result<(), String> {
        let partition = d.partition().to_string();
        let offset = d.offset().to_string();
        let mut hs = OwnedHeaders::new();
        for (k, v) in d.headers() {
            hs = hs.insert(Header { key: k, value: Some(v) });
        }
        for (k, v) in [
            (headers::REASON, reason),
            (headers::OUTCOME, label),
            (headers::TOPIC, d.topic()),
            (headers::PARTITION, partition.as_str()),
            (headers::OFFSET, offset.as_str()),
        ] {
            hs = hs.insert(Header { key: k, value: Some(v.as_bytes()) });
        }
        let mut rec: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.settings.dead_letter).payload(d.payload_bytes()).headers(hs);
        if let Some(k) = d.record_key() {
            rec = rec.key(k);
        }
        match self.producer.send(rec, self.settings.produce_timeout).await {
            Ok(_) => Ok(()),
            Err((e, _)) => {
                tracing::warn!(target: "idem", topic = %d.topic(), partition = d.partition(),
                    offset = d.offset(), error = %e, "dead-letter produce failed; the message will be retried");
                Err(e.to_string())
            }
        }
    }

    /// Commits every partition's durable prefix (synchronously, on a blocking thread). `false`
    /// when the commit failed; the offsets stay pending for the next one.
    pub(crate) async fn commit(&self) -> bool {
        let due = self.state().tracker.committable();
        if due.is_empty() {
            return true;
        }
        let mut tpl = TopicPartitionList::new();
        for ((topic, p), off) in &due {
            if let Err(e) = tpl.add_partition_offset(topic, *p, Offset::Offset(*off)) {
                tracing::warn!(target: "idem", error = %e, "bad offset; not committed");
                return false;
            }
        }
        let c = Arc::clone(&self.consumer);
        let r = tokio::task::spawn_blocking(move || c.commit(&tpl, CommitMode::Sync)).await;
        match r {
            Ok(Ok(())) => {
                self.state().tracker.committed(&due);
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(target: "idem", error = %e, "offset commit failed; retried with the next batch");
                false
            }
            Err(e) => {
                tracing::warn!(target: "idem", error = %e, "offset commit task failed");
                false
            }
        }
    }

    /// Messages polled and not yet settled (including those waiting for a retry).
    pub(crate) fn open_count(&self) -> usize {
        self.state().tracker.open()
    }

    /// Poll, decide, settle until `shutdown` completes; a batch in flight is finished first.
    pub(crate) async fn run(
        &self,
        decider: &impl Decider,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Report, Error> {
        let mut total = Report::default();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut failures = 0u32;
        loop {
            let batch = tokio::select! {
                biased;
                () = &mut shutdown => break,
                b = self.fetch() => b,
            };
            let batch = match batch {
                Ok(b) => {
                    failures = 0;
                    b
                }
                Err(e) => {
                    failures += 1;
                    if failures >= 10 {
                        return Err(e);
                    }
                    tracing::warn!(target: "idem", error = %e, "poll failed; retrying");
                    tokio::select! {
                        () = &mut shutdown => break,
                        () = tokio::time::sleep(self.settings.retry_delay) => continue,
                    }
                }
            };
            if batch.is_empty() {
                continue;
            }
            let decided = decider.decide(&batch).await;
            total += self.settle(batch, decided).await;
        }
        self.commit().await;
        Ok(total)
    }

    /// Leaves the group and closes the client on a blocking thread, giving up after `timeout`
    /// (librdkafka's close was seen to hang). `true` when it closed in time.
    pub(crate) async fn close(self, timeout: Duration) -> bool {
        let Self { consumer, producer, .. } = self;
        let closing = tokio::task::spawn_blocking(move || {
            let _ = rdkafka::producer::Producer::flush(&producer, Duration::from_secs(5));
            consumer.unsubscribe();
            drop(consumer);
        });
        match tokio::time::timeout(timeout, closing).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                tracing::warn!(target: "idem", error = %e, "closing the Kafka consumer panicked");
                false
            }
            Err(_) => {
                tracing::warn!(target: "idem", ?timeout, "closing the Kafka consumer timed out; left to finish in the background");
                false
            }
        }
    }
}
