//! The rdkafka side of the consumer: poll batches, retry with the partition paused,
//! dead-letter to a topic, commit the durable prefix (see [`rebalance`](crate::rebalance) for
//! how commits follow rebalances).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use idem_core::consumer::{DeadLetter, Source, headers};
use idem_core::engine::Verb;
use rdkafka::TopicPartitionList;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::rebalance::Ctx;
use crate::retention::RetentionGap;
use crate::tracker::Tracker;
use crate::{Delivery, Error};

/// How long the retention check waits for the brokers.
pub(crate) const ADMIN_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) type Tp = (String, i32);

/// Runs `f` on a thread of its own; the receiver answers when it returned (an error when it
/// panicked or no thread could be started, which is logged). Not `spawn_blocking`: a runtime
/// waits for its blocking tasks when it shuts down, and librdkafka's consumer close loops until
/// the group coordinator answers, which some brokers never do (seen: a test process that never
/// exited). A call abandoned here holds no runtime thread and keeps no runtime alive.
pub(crate) fn detached<T: Send + 'static>(
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

/// What the source keeps between calls, under one lock.
#[derive(Default)]
pub(crate) struct State {
    pub(crate) tracker: Tracker,
    pub(crate) retries: Vec<(Instant, Delivery)>,
    pub(crate) paused: HashSet<Tp>,
    /// Revocations seen so far; each polled message remembers the count at its poll.
    pub(crate) epoch: u64,
    /// The epoch at which each partition was last revoked.
    pub(crate) revoked_at: HashMap<Tp, u64>,
    /// Partitions whose group offset was found at or behind this member's since their last
    /// assignment: their commits need no check (see [`KafkaSource::commit`]).
    pub(crate) verified: HashSet<Tp>,
    /// Messages taken for a batch (due retries, then polled ones) that no `fetch` has returned
    /// yet. They live here, not in the fetch's locals, so that a fetch dropped at its await
    /// loses nothing: the next fetch returns them first.
    pub(crate) staged: Vec<Delivery>,
    /// Per partition, the `from` of the next message polled (see [`positions`](crate::positions)).
    pub(crate) next_from: HashMap<Tp, i64>,
    /// Per partition, dead-lettered messages: the offset after each → its `from`.
    pub(crate) bridges: HashMap<Tp, HashMap<i64, Option<i64>>>,
    /// Per partition, the offset below which records count as read again (see
    /// [`Envelope::redelivery`](idem_core::extract::Envelope::redelivery)): set by the first
    /// record read after its assignment.
    pub(crate) reread_below: HashMap<Tp, i64>,
}

impl State {
    /// Whether `d` was polled under the current assignment of its partition (so its offset
    /// counts towards that partition's commit).
    pub(crate) fn owns(&self, d: &Delivery) -> bool {
        self.revoked_at.get(&d.tp()).is_none_or(|&at| d.epoch >= at)
    }
}

/// A Kafka consumer group member, opened (see [`KafkaConfig`](crate::KafkaConfig)).
pub struct KafkaSource {
    pub(crate) consumer: Mutex<Option<Arc<StreamConsumer<Ctx>>>>,
    pub(crate) producer: FutureProducer,
    /// What a producer or admin client needs to reach the same brokers.
    pub(crate) conn: ClientConfig,
    pub(crate) topics: Vec<String>,
    pub(crate) dead_letter: String,
    pub(crate) batch_wait: Duration,
    pub(crate) retry_delay: Duration,
    pub(crate) produce_timeout: Duration,
    pub(crate) close_timeout: Duration,
    pub(crate) retention: Duration,
    /// Shared with the consumer's rebalance callbacks ([`Ctx`]).
    pub(crate) state: Arc<Mutex<State>>,
    /// Where an offset inbox keeps positions, to seek to after an assignment.
    pub(crate) positions: Option<Arc<dyn idem_core::inbox::PositionReader>>,
    /// The consumer's scope (the positions' owner).
    pub(crate) scope: String,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource").field("topics", &self.topics).finish_non_exhaustive()
    }
}

impl KafkaSource {
    /// The consumed topics whose logs keep messages longer than the dedup records are kept: a
    /// replay of their older messages would run effects again. The source logs these as
    /// warnings when it opens; topic patterns (`^…`) are not checked.
    ///
    /// # Errors
    /// [`Error::Kafka`] when the brokers cannot be asked (10 s limit), [`Error::Broker`] when a
    /// topic's configs carry no usable `retention.ms`.
    ///
    /// # Cancel safety
    /// Cancel safe: it only reads. Dropped while it waits for the brokers, it destroys its
    /// admin client on the dropping thread, which librdkafka may block for a moment.
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
    pub(crate) async fn warn_retention(&self) {
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

    pub(crate) fn state(&self) -> std::sync::MutexGuard<'_, State> {
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

    pub(crate) fn pause(consumer: &StreamConsumer<Ctx>, tp: &Tp, pause: bool) {
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition(&tp.0, tp.1);
        let r = if pause { consumer.pause(&tpl) } else { consumer.resume(&tpl) };
        tracing::debug!(target: "idem", topic = %tp.0, partition = tp.1,
            "partition {}", if pause { "paused for a retry" } else { "resumed" });
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
        let idem = dl.headers();
        for (k, v) in idem
            .iter()
            .map(|(k, v)| (*k, v.as_str()))
            .chain([(headers::SOURCE, d.topic()), (headers::POSITION, position.as_str())])
        {
            hs = hs.insert(Header { key: k, value: Some(v.as_bytes()) });
        }
        let mut rec: FutureRecord<'_, [u8], [u8]> =
            FutureRecord::to(&self.dead_letter).payload(d.payload_bytes()).headers(hs);
        if let Some(k) = d.record_key() {
            rec = rec.key(k);
        }
        // The original time, so a replay can send it on (`idem dlq`).
        if let Some(ms) = d.timestamp_ms() {
            rec = rec.timestamp(ms);
        }
        match self.producer.send(rec, self.produce_timeout).await {
            Ok(_) => Ok(()),
            Err((e, _)) => Err(Error::kafka("dead-letter produce", e)),
        }
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
    type Delivery = Delivery;
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
        self.seek_assigned(&consumer).await;
        let now = Instant::now();
        let (mut staged, next_retry) = {
            let mut st = self.state();
            let st = &mut *st;
            let mut i = 0;
            while i < st.retries.len() && st.staged.len() < max {
                if st.retries[i].0 <= now {
                    let mut d = st.retries.swap_remove(i).1;
                    st.bridge(&mut d);
                    st.staged.push(d);
                } else {
                    i += 1;
                }
            }
            (st.staged.len(), st.retries.iter().map(|(at, _)| *at).min())
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
                    if staged == 0 {
                        return Err(Error::kafka("poll", e));
                    }
                    tracing::warn!(target: "idem", error = %e, "poll failed; settling the batch so far");
                    break;
                }
                Ok(Ok(m)) => Delivery::from_borrowed(&m),
            };
            // A rebalance inside the poll was applied by its callback, before `m` is tracked.
            let mut m = m;
            // Partitions assigned inside this poll are sought before any more is read.
            let assigned = Self::assigned_since(&consumer);
            let mut st = self.state();
            m.epoch = st.epoch;
            st.read_from(&mut m);
            let window = i64::try_from(max.saturating_mul(2)).unwrap_or(i64::MAX);
            let below = *st.reread_below.entry(m.tp()).or_insert(m.offset().saturating_add(window));
            m.reread = m.offset() < below;
            // A message of a revoked partition polled before its revocation is processed but
            // not tracked.
            if st.owns(&m) {
                st.tracker.polled(&m.tp(), m.offset());
            }
            st.staged.push(m);
            staged = st.staged.len();
            wait = self.batch_wait;
            if assigned && self.positions.is_some() {
                break;
            }
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
    async fn settle(&self, items: Vec<(Delivery, Verb)>) -> Result<u64, Error> {
        let consumer = self.consumer()?;
        {
            // Pauses and resumes happen under the lock the rebalance callbacks take, so the
            // source's record of its pauses never lags behind librdkafka's.
            let mut st = self.state();
            for (mut d, verb) in items {
                let tp = d.tp();
                match verb {
                    Verb::DeadLetter { .. } if st.owns(&d) => {
                        st.tracker.settled(&tp, d.offset());
                        st.dead_lettered(&d);
                    }
                    Verb::Ack if st.owns(&d) => {
                        st.tracker.settled(&tp, d.offset());
                    }
                    // Settled, but of a partition revoked since it was polled: not ours to
                    // commit.
                    Verb::Ack | Verb::DeadLetter { .. } => {}
                    Verb::Retry { after } => {
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
                    Self::pause(&consumer, tp, false);
                }
                waiting
            });
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
