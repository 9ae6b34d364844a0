//! The rdkafka side of the driver: poll batches, commit the durable prefix, retry with the
//! partition paused, dead-letter to a topic, follow rebalances.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idem_core::consumer::{Action, DeadLetter, Opening, Source, SourceConfig, headers};
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
use crate::{Delivery, Error};

/// How long the retention check waits for the brokers.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

type Tp = (String, i32);

/// Runs `f` on a thread of its own; the receiver answers when it returned (an error when it
/// panicked or no thread could be started, which is logged). Not `spawn_blocking`: a runtime
/// waits for its blocking tasks when it shuts down, and librdkafka's consumer close loops until
/// the group coordinator answers, which some brokers never do (seen: a test process that never
/// exited). A call abandoned here holds no runtime thread and keeps no runtime alive.
fn detached<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> tokio::sync::oneshot::Receiver<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name(format!("idem-kafka: {what}"))
        .spawn(move || drop(tx.send(f())));
    if let Err(e) = spawned {
        tracing::warn!(target: "idem", error = %e, "could not start a thread to {what}");
    }
    rx
}

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
        if let Rebalance::Assign(tpl) = rebalance {
            let parts: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
            tracing::debug!(target: "idem", ?parts, "partitions assigned");
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
    /// Partitions whose group offset was found at or behind this member's since their last
    /// assignment: their commits need no check (see [`KafkaSource::commit`]).
    verified: HashSet<Tp>,
    /// Messages taken for a batch (due retries, then polled ones) that no `fetch` has returned
    /// yet. They live here, not in the fetch's locals, so that a fetch dropped at its await
    /// loses nothing: the next fetch returns them first.
    staged: Vec<Delivery>,
}

impl State {
    /// Whether `d` was polled under the current assignment of its partition (so its offset
    /// counts towards that partition's commit).
    fn owns(&self, d: &Delivery) -> bool {
        self.revoked_at.get(&d.tp()).is_none_or(|&at| d.epoch >= at)
    }
}

/// A Kafka consumer group's settings for the driver: what is specific to Kafka. Batch size,
/// idle wait and broker timeouts are the driver's ([`Builder`](idem_core::consumer::Builder)).
///
/// Defaults: gather a batch for at most 5 ms once a first message arrived; retry transient
/// failures after 1 s (a key in progress elsewhere after the other lease, at most that long);
/// wait up to 30 s for the broker to acknowledge a dead-letter produce; close within 10 s.
///
/// ```
/// use std::time::Duration;
/// use idem_kafka::{Kafka, rdkafka::ClientConfig};
///
/// let mut config = ClientConfig::new();
/// config.set("bootstrap.servers", "127.0.0.1:9092").set("group.id", "billing");
/// let kafka = Kafka::new(&config, &["orders"], "dlq.orders").retry_delay(Duration::from_secs(5));
/// ```
///
/// `Debug` shows the brokers, the group and the names of the other settings, never a value that
/// could be a credential (`sasl.password`, `ssl.key.pem`, `sasl.oauthbearer.config`…).
#[must_use]
pub struct Kafka {
    config: ClientConfig,
    topics: Vec<String>,
    dead_letter: String,
    batch_wait: Duration,
    retry_delay: Duration,
    produce_timeout: Duration,
    close_timeout: Duration,
    topic_retention: Option<Duration>,
}

impl std::fmt::Debug for Kafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // rdkafka's own Debug leaves out five password keys but shows `ssl.key.pem` (a private
        // key) and `sasl.oauthbearer.config` (which may hold a client secret): names only.
        let settings: Vec<&str> = self.config.config_map().into_keys().collect();
        f.debug_struct("Kafka")
            .field("bootstrap.servers", &self.config.get("bootstrap.servers"))
            .field("group.id", &self.config.get("group.id"))
            .field("settings", &settings)
            .field("topics", &self.topics)
            .field("dead_letter", &self.dead_letter)
            .field("batch_wait", &self.batch_wait)
            .field("retry_delay", &self.retry_delay)
            .field("produce_timeout", &self.produce_timeout)
            .field("close_timeout", &self.close_timeout)
            .field("topic_retention", &self.topic_retention)
            .finish()
    }
}

impl Kafka {
    /// Consumes `topics` (names, or patterns starting with `^`) with `config` (needs
    /// `bootstrap.servers` and `group.id`; idem sets `enable.auto.commit` and
    /// `enable.auto.offset.store` to `false`, and `auto.offset.reset` to `earliest` unless
    /// given) and dead-letters to `dead_letter_topic` (produced with `acks=all` on the same
    /// brokers, with every security setting of `config`). The dead-letter topic must be one the
    /// subscription does not take, by name or by pattern (`^orders.*` takes `orders.dlq`; use
    /// `dlq.orders`): opening fails with [`Error::DeadLetterLoop`] otherwise, since each dead
    /// letter would come back as a new message and be processed.
    pub fn new(
        config: &ClientConfig,
        topics: &[&str],
        dead_letter_topic: impl Into<String>,
    ) -> Self {
        Self {
            config: config.clone(),
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            dead_letter: dead_letter_topic.into(),
            batch_wait: Duration::from_millis(5),
            retry_delay: Duration::from_secs(1),
            produce_timeout: Duration::from_secs(30),
            close_timeout: Duration::from_secs(10),
            topic_retention: None,
        }
    }

    /// How long to keep gathering a batch after its first message arrived.
    pub fn batch_wait(mut self, d: Duration) -> Self {
        self.batch_wait = d;
        self
    }

    /// The delay before a transiently failed message is tried again, and the longest wait for a
    /// key in progress elsewhere (its partition is paused meanwhile, and no offset is committed
    /// past it).
    pub fn retry_delay(mut self, d: Duration) -> Self {
        self.retry_delay = d;
        self
    }

    /// How long to wait for the broker to acknowledge a dead-letter produce before the message
    /// is retried instead.
    pub fn produce_timeout(mut self, d: Duration) -> Self {
        self.produce_timeout = d;
        self
    }

    /// States how long the consumed topics keep messages, instead of asking the brokers: for
    /// brokers that do not answer `DescribeConfigs` (Azure Event Hubs' Kafka endpoint did not
    /// for years) or whose answer does not hold. Opening then fails with [`Error::Retention`]
    /// when the dedup records are kept for less, and the brokers are not asked. Without it the
    /// brokers are asked and a shorter dedup retention is only logged (see
    /// [`KafkaSource::retention_gaps`]).
    pub fn topic_retention(mut self, d: Duration) -> Self {
        self.topic_retention = Some(d);
        self
    }

    /// How long leaving the group may take when the run ends (librdkafka's close was seen to
    /// hang; it is left to finish in the background after this).
    pub fn close_timeout(mut self, d: Duration) -> Self {
        self.close_timeout = d;
        self
    }
}

/// A Kafka consumer group member opened for the driver (see [`Kafka`]).
pub struct KafkaSource {
    consumer: Mutex<Option<Arc<StreamConsumer<Ctx>>>>,
    producer: FutureProducer,
    /// What a producer or admin client needs to reach the same brokers.
    conn: ClientConfig,
    topics: Vec<String>,
    dead_letter: String,
    batch_wait: Duration,
    retry_delay: Duration,
    produce_timeout: Duration,
    close_timeout: Duration,
    retention: Duration,
    state: Mutex<State>,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource").field("topics", &self.topics).finish_non_exhaustive()
    }
}

fn check_config(config: &ClientConfig) -> Result<(), Error> {
    crate::security::check(config)?;
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
/// addresses, the client id, every security, SASL and SSL setting (credentials included), and
/// the socket and connection-lifetime settings (a load balancer that drops idle connections,
/// as Azure's does after 240 s, drops the producer's too).
fn connection_config(config: &ClientConfig) -> ClientConfig {
    const EXACT: [&str; 5] = [
        "bootstrap.servers",
        "client.id",
        "broker.address.family",
        "metadata.max.age.ms",
        "connections.max.idle.ms",
    ];
    const PREFIXES: [&str; 4] = ["security.", "sasl.", "ssl.", "socket."];
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

impl KafkaSource {
    /// The consumed topics whose logs keep messages longer than the dedup records are kept: a
    /// replay of their older messages would run effects again. The source logs these as
    /// warnings when it opens; topic patterns (`^…`) are not checked.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the brokers cannot be asked (10 s limit), [`Error::Broker`] when a
    /// topic's configs carry no usable `retention.ms`.
    pub async fn retention_gaps(&self) -> Result<Vec<RetentionGap>, Error> {
        let retain = self.retention;
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
        drop(detached("drop the admin client", move || drop(admin)));
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
    async fn warn_retention(&self) {
        match self.retention_gaps().await {
            Ok(gaps) => {
                for g in gaps {
                    tracing::warn!(target: "idem", topic = %g.topic, "{g}");
                }
            }
            Err(e) => tracing::warn!(target: "idem", error = %e,
                "could not compare the topics' retention.ms with the dedup retention"),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The consumer, or an error once the source is closed.
    fn consumer(&self) -> Result<Arc<StreamConsumer<Ctx>>, Error> {
        self.consumer.lock().unwrap_or_else(PoisonError::into_inner).clone().ok_or(Error::Closed)
    }

    /// Messages polled and not yet settled (in flight or waiting for a retry).
    pub fn open_messages(&self) -> usize {
        self.state().tracker.open()
    }

    /// Applies the revocations librdkafka reported: forget the partitions' progress so nothing
    /// more is committed for them (the new owner resumes at the committed offset, which is never
    /// past a message this consumer has not settled). Messages of theirs already polled — in
    /// `batch` or waiting for a retry — are still processed: the store makes a second
    /// processing a duplicate, while dropping them would lose them if the client resumed past
    /// them (seen against tansu when a partition came back to the same member).
    fn revocations(&self, consumer: &StreamConsumer<Ctx>) {
        let revoked: Vec<Tp> = std::mem::take(
            &mut *consumer.context().revoked.lock().unwrap_or_else(PoisonError::into_inner),
        );
        if revoked.is_empty() {
            return;
        }
        let mut st = self.state();
        st.epoch += 1;
        for tp in &revoked {
            st.tracker.forget(tp);
            st.paused.remove(tp);
            st.verified.remove(tp);
            let e = st.epoch;
            st.revoked_at.insert(tp.clone(), e);
        }
    }

    fn pause(consumer: &StreamConsumer<Ctx>, tp: &Tp, pause: bool) {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&tp.0, tp.1);
        let r = if pause { consumer.pause(&tpl) } else { consumer.resume(&tpl) };
        if let Err(e) = r {
            tracing::warn!(target: "idem", topic = %tp.0, partition = tp.1, error = %e,
                "could not {} the partition", if pause { "pause" } else { "resume" });
        }
    }

    async fn copy(&self, d: &Delivery, dl: &DeadLetter) -> Result<(), Error> {
        let position = format!("{}:{}", d.partition(), d.offset());
        let mut hs = OwnedHeaders::new();
        for (k, v) in d.headers() {
            hs = hs.insert(Header { key: k, value: Some(v) });
        }
        let [reason, outcome, scope] = dl.headers();
        for (k, v) in [
            (reason.0, reason.1.as_str()),
            (outcome.0, outcome.1.as_str()),
            (scope.0, scope.1.as_str()),
            (headers::SOURCE, d.topic()),
            (headers::POSITION, position.as_str()),
        ] {
            hs = hs.insert(Header { key: k, value: Some(v.as_bytes()) });
        }
        let mut rec: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.dead_letter).payload(d.payload_bytes()).headers(hs);
        if let Some(k) = d.record_key() {
            rec = rec.key(k);
        }
        match self.producer.send(rec, self.produce_timeout).await {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(Error::kafka("dead-letter produce", e)),
        }
    }

    /// Commits every partition's durable prefix (synchronously, on a blocking thread). `false`
    /// when the commit failed; the offsets stay pending for the next one.
    ///
    /// Revocations librdkafka reported since the last poll are applied first. A commit never
    /// moves a group's offset backwards as far as this member can see: the first commit of a
    /// partition after its assignment, and every commit at close, reads the group's committed
    /// offsets first (one round trip) and leaves out a partition whose group offset is past
    /// this member's. That happens only when another member consumed the partition meanwhile,
    /// which a broker that fences stale members' commits (Kafka) never allows, and one that does
    /// not (tansu 0.6.0 after a restart) does: without the check the stale member's commit
    /// hands the partition's messages back.
    async fn commit(&self, consumer: &Arc<StreamConsumer<Ctx>>, closing: bool) -> bool {
        self.revocations(consumer);
        let (due, check) = {
            let st = self.state();
            let due = st.tracker.committable();
            let check: Vec<Tp> = due
                .iter()
                .filter(|(tp, _)| closing || !st.verified.contains(tp))
                .map(|(tp, _)| tp.clone())
                .collect();
            (due, check)
        };
        if due.is_empty() {
            return true;
        }
        let c = Arc::clone(consumer);
        let r = tokio::task::spawn_blocking(move || {
            let group = if check.is_empty() {
                None
            } else {
                let mut tpl = TopicPartitionList::new();
                for tp in &check {
                    tpl.add_partition(&tp.0, tp.1);
                }
                match c.committed_offsets(tpl, ADMIN_TIMEOUT) {
                    Ok(got) => Some(
                        got.elements()
                            .iter()
                            .filter_map(|e| match e.offset() {
                                Offset::Offset(o) => {
                                    Some(((e.topic().to_owned(), e.partition()), o))
                                }
                                _ => None,
                            })
                            .collect::<HashMap<Tp, i64>>(),
                    ),
                    Err(e) => {
                        // Not knowing is no reason to hold every offset back: commit as a
                        // broker that fences would want.
                        tracing::debug!(target: "idem", error = %e,
                            "could not read the group's committed offsets; committing unchecked");
                        None
                    }
                }
            };
            let (commit, ahead) = match &group {
                Some(group) => not_behind(&due, group),
                None => (due, Vec::new()),
            };
            let mut tpl = TopicPartitionList::new();
            for ((topic, p), off) in &commit {
                tpl.add_partition_offset(topic, *p, Offset::Offset(*off))?;
            }
            if !commit.is_empty() {
                c.commit(&tpl, CommitMode::Sync)?;
            }
            let checked: Vec<Tp> = if group.is_some() { check } else { Vec::new() };
            Ok::<_, KafkaError>((commit, ahead, checked))
        })
        .await;
        match r {
            Ok(Ok((done, ahead, checked))) => {
                for ((topic, p), ours, theirs) in &ahead {
                    tracing::warn!(target: "idem", %topic, partition = p, ours, theirs,
                        "the group's committed offset is past this member's: another member \
                         consumed the partition (a broker that does not fence stale members); \
                         not committed");
                }
                if !done.is_empty() {
                    tracing::debug!(target: "idem", offsets = ?done, "offsets committed");
                }
                let mut st = self.state();
                st.tracker.committed(&done);
                for tp in checked {
                    if !ahead.iter().any(|(a, _, _)| *a == tp) {
                        st.verified.insert(tp);
                    }
                }
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
}

/// A partition left out of a commit: (partition, this member's offset, the group's).
type Ahead = (Tp, i64, i64);

/// Splits `due` into the offsets to commit and the partitions whose group offset (`group`) is
/// already past ours, as (partition, ours, theirs). A partition the group has no offset for is
/// committed.
fn not_behind(due: &[(Tp, i64)], group: &HashMap<Tp, i64>) -> (Vec<(Tp, i64)>, Vec<Ahead>) {
    let mut commit = Vec::with_capacity(due.len());
    let mut ahead = Vec::new();
    for (tp, ours) in due {
        match group.get(tp) {
            Some(&theirs) if theirs > *ours => ahead.push((tp.clone(), *ours, theirs)),
            _ => commit.push((tp.clone(), *ours)),
        }
    }
    (commit, ahead)
}

impl SourceConfig for Kafka {
    type Source = KafkaSource;

    /// Checks the settings, creates the consumer (subscribed) and the dead-letter producer, and
    /// logs a warning for every consumed topic whose log outlives the dedup records (or, with a
    /// [stated topic retention](Kafka::topic_retention), fails when it is longer than theirs).
    async fn open(self, opening: Opening<'_>) -> Result<KafkaSource, Error> {
        check_config(&self.config)?;
        if let Some(topic_retention) = self.topic_retention
            && topic_retention > opening.retention
        {
            return Err(Error::Retention { topic_retention, dedup_retention: opening.retention });
        }
        if self.topics.is_empty() {
            return Err(Error::Topics("at least one topic is needed"));
        }
        if self.topics.iter().any(String::is_empty) || self.dead_letter.is_empty() {
            return Err(Error::Topics("a topic name is empty"));
        }
        crate::subscription::check(&self.topics, &self.dead_letter)?;
        let mut cc = self.config.clone();
        cc.set("enable.auto.commit", "false").set("enable.auto.offset.store", "false");
        if cc.get("auto.offset.reset").is_none() {
            cc.set("auto.offset.reset", "earliest");
        }
        let consumer: StreamConsumer<Ctx> = cc
            .create_with_context(Ctx::default())
            .map_err(|e| Error::kafka("create consumer", e))?;
        let topics: Vec<&str> = self.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics).map_err(|e| Error::kafka("subscribe", e))?;
        let conn = connection_config(&self.config);
        let mut pc = conn.clone();
        pc.set("acks", "all")
            .set("message.timeout.ms", self.produce_timeout.as_millis().to_string());
        let producer: FutureProducer =
            pc.create().map_err(|e| Error::kafka("create dead-letter producer", e))?;
        let source = KafkaSource {
            consumer: Mutex::new(Some(Arc::new(consumer))),
            producer,
            conn,
            topics: self.topics,
            dead_letter: self.dead_letter,
            batch_wait: self.batch_wait,
            retry_delay: self.retry_delay,
            produce_timeout: self.produce_timeout,
            close_timeout: self.close_timeout,
            retention: opening.retention,
            state: Mutex::new(State::default()),
        };
        if self.topic_retention.is_none() {
            source.warn_retention().await;
        }
        Ok(source)
    }
}

/// A source dropped without `close` leaves the group on a thread of its own: librdkafka's
/// consumer drop can block for as long as `close` can.
impl Drop for KafkaSource {
    fn drop(&mut self) {
        if let Some(consumer) =
            self.consumer.get_mut().unwrap_or_else(PoisonError::into_inner).take()
        {
            drop(detached("drop the Kafka consumer", move || drop(consumer)));
        }
    }
}

impl Source for KafkaSource {
    type Message = Delivery;
    type Error = Error;

    /// Up to `max` messages: the retries that are due first, then new ones (waiting up to
    /// `wait` for a first one, then the batch wait for more).
    ///
    /// # Cancel safety
    /// Cancel safe: a message is moved out of the retry list, or received from the broker, only
    /// into the source's own staging list, which the next `fetch` returns first. Dropping the
    /// future at its await loses no message and leaves no offset open without its message.
    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>, Error> {
        let consumer = self.consumer()?;
        self.revocations(&consumer);
        let now = Instant::now();
        let (mut staged, next_retry) = {
            let mut st = self.state();
            let State { retries, staged, .. } = &mut *st;
            let mut i = 0;
            while i < retries.len() && staged.len() < max {
                if retries[i].0 <= now {
                    staged.push(retries.swap_remove(i).1);
                } else {
                    i += 1;
                }
            }
            (staged.len(), retries.iter().map(|(at, _)| *at).min())
        };
        let mut wait = if staged == 0 {
            next_retry.map_or(wait, |at| at.saturating_duration_since(now).min(wait))
        } else {
            Duration::ZERO
        };
        while staged < max {
            // The one await: `recv` is cancel safe, and what came before it is staged.
            let polled = tokio::time::timeout(wait, consumer.recv()).await;
            let m = match polled {
                Err(_) => break,
                Ok(Err(e)) => {
                    self.revocations(&consumer);
                    if staged == 0 {
                        return Err(Error::kafka("poll", e));
                    }
                    tracing::warn!(target: "idem", error = %e, "poll failed; settling the batch so far");
                    break;
                }
                Ok(Ok(m)) => Delivery::from_borrowed(&m),
            };
            // A rebalance runs inside the poll: stop tracking revoked partitions before `m`.
            self.revocations(&consumer);
            let mut m = m;
            let mut st = self.state();
            m.epoch = st.epoch;
            // A message of a revoked partition polled before its revocation is processed but
            // not tracked.
            if st.owns(&m) {
                st.tracker.polled(&m.tp(), m.offset());
            }
            st.staged.push(m);
            staged = st.staged.len();
            wait = self.batch_wait;
        }
        let mut st = self.state();
        let n = st.staged.len().min(max);
        Ok(st.staged.drain(..n).collect())
    }

    async fn dead_letter(&self, items: &[(&Delivery, DeadLetter)]) -> Vec<Result<(), Error>> {
        futures_util::future::join_all(items.iter().map(|(d, dl)| async move {
            let r = self.copy(d, dl).await;
            if let Err(e) = &r {
                tracing::warn!(target: "idem", topic = %d.topic(), partition = d.partition(),
                    offset = d.offset(), error = %e, "dead-letter produce failed; the message will be retried");
            }
            r
        }))
        .await
    }

    /// Marks settled messages, schedules retries (pausing their partitions), then commits every
    /// partition's durable prefix; nothing is committed past a message that has not settled.
    /// A failed commit is counted (the offsets go with the next one).
    async fn settle(&self, items: Vec<(Delivery, Action)>) -> Result<u64, Error> {
        let consumer = self.consumer()?;
        let mut to_resume = Vec::new();
        {
            let mut st = self.state();
            for (mut d, action) in items {
                let tp = d.tp();
                match action {
                    Action::Ack | Verb::DeadLetter { .. } if st.owns(&d) => {
                        st.tracker.settled(&tp, d.offset());
                    }
                    // Settled, but of a partition revoked since it was polled: not ours to
                    // commit.
                    Action::Ack | Verb::DeadLetter { .. } => {}
                    Action::Retry { after } => {
                        let after = idem_core::consumer::retry_delay(
                            after,
                            self.retry_delay,
                            Duration::from_millis(10),
                            self.retry_delay,
                        );
                        d.attempts += 1;
                        let owned = st.owns(&d);
                        st.retries.push((Instant::now() + after, d));
                        if owned && st.paused.insert(tp.clone()) {
                            Self::pause(&consumer, &tp, true);
                        }
                    }
                    // Released at shutdown: left unsettled, so no commit passes it and the
                    // group's next owner of the partition reads it again.
                    _ => {}
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
            Self::pause(&consumer, &tp, false);
        }
        Ok(u64::from(!self.commit(&consumer, false).await))
    }

    /// Commits what settled, then leaves the group and closes the client on a blocking thread,
    /// giving up after the close timeout (librdkafka's close was seen to hang). Messages waiting
    /// for a retry are left to the partition's next owner.
    async fn close(&self) -> Result<u64, Error> {
        let Some(consumer) = self.consumer.lock().unwrap_or_else(PoisonError::into_inner).take()
        else {
            return Ok(0);
        };
        self.commit(&consumer, true).await;
        let left = {
            let mut st = self.state();
            let n = st.retries.len() + st.staged.len();
            st.retries.clear();
            st.staged.clear();
            n
        };
        let producer = self.producer.clone();
        let closing = detached("close the Kafka consumer", move || {
            let _ = rdkafka::producer::Producer::flush(&producer, Duration::from_secs(5));
            consumer.unsubscribe();
            drop(consumer);
        });
        match tokio::time::timeout(self.close_timeout, closing).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                tracing::warn!(target: "idem", "closing the Kafka consumer panicked");
            }
            Err(_) => {
                tracing::warn!(target: "idem", timeout = ?self.close_timeout,
                    "closing the Kafka consumer timed out; left to finish on its own thread");
            }
        }
        Ok(u64::try_from(left).unwrap_or(u64::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(p: i32) -> Tp {
        ("t".to_owned(), p)
    }

    #[test]
    fn a_partition_whose_group_offset_is_ahead_is_left_out() {
        let due = vec![(tp(0), 32), (tp(1), 100), (tp(2), 7)];
        let group: HashMap<Tp, i64> = [(tp(0), 2000), (tp(1), 100)].into_iter().collect();
        let (commit, ahead) = not_behind(&due, &group);
        assert_eq!(commit, vec![(tp(1), 100), (tp(2), 7)], "level, or no group offset: committed");
        assert_eq!(ahead, vec![(tp(0), 32, 2000)]);
    }

    #[test]
    fn debug_shows_no_credential() {
        const SECRET: &str = "PlantedSecret42";
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", "b1:9093").set("group.id", "g");
        c.set("sasl.username", "app").set("sasl.password", SECRET);
        c.set("ssl.key.pem", format!("-----BEGIN PRIVATE KEY-----{SECRET}"));
        c.set("sasl.oauthbearer.config", format!("clientSecret={SECRET}"));
        let d = format!("{:?}", Kafka::new(&c, &["orders"], "dlq"));
        assert!(!d.contains(SECRET), "{d}");
        assert!(d.contains("b1:9093") && d.contains("ssl.key.pem") && d.contains("orders"), "{d}");
        let p = crate::KafkaPublisher::with_config(&c).unwrap();
        assert!(!format!("{p:?}").contains(SECRET), "{p:?}");
    }
}
