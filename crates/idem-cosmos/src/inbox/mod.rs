//! `CosmosInbox`: the transactional inbox on Cosmos DB. Per delivery, the dedup marker and the
//! handler's documents commit in one transactional batch under one partition key.

mod commit;
mod docs;

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use azure_data_cosmos::clients::ContainerClient;
use idem_core::engine::{Cause, Conflict, FailureKind, HandlerError, Outcome, Prepared};
use idem_core::extract::Envelope;
use idem_core::time::{Clock, SystemClock};
use idem_core::{Engine, DedupKey, Fingerprint, RecordState, StoreError};
use serde::Serialize;
use serde::de::DeserializeOwned;

pub use docs::BatchDocs;

use crate::marker::check_path;
use crate::{Error, ThrottlePolicy};
use commit::Committed;

/// A transactional inbox on a Cosmos DB container: the consumer [`Backend`](idem_core::Backend)
/// for handlers whose effects are documents of one partition.
///
/// For each delivery the handler gets a [`BatchDocs`] and adds its documents to it. When it
/// returns `Ok`, one **transactional batch** creates the dedup marker (id `idem-<key hash>`,
/// holding the fingerprint and the handler's result) and writes the documents, under the
/// partition key the handler chose: all of it commits, or none of it.
///
/// - **409 on the batch = duplicate.** The marker exists: it is read and its fingerprint
///   compared: [`Outcome::Duplicate`] with the stored result, or [`Outcome::Conflict`]. A
///   409 on a business document while the marker is absent is an [`Error::Exists`]
///   failure (permanent): the entity was written by something else.
/// - **A failing handler writes nothing** (its documents are dropped).
/// - **No leases.** Two concurrent deliveries of one key may both run the handler; one batch
///   wins, the other answers duplicate. Handlers therefore must have no effect outside the
///   batch (use the two-phase [`CosmosStore`](crate::CosmosStore) for those).
/// - **Same partition every time.** The handler must choose the partition key from the
///   message deterministically (the entity id), or a redelivery would not meet its marker.
/// - **Retention.** Markers carry Cosmos DB's `ttl` ([`CosmosInbox::retention`], default 7
///   days; the container needs TTL switched on). A marker is a duplicate while it exists.
/// - Deliveries of a fetched batch are decided one after another, in order, so a key repeated
///   in the batch is a duplicate of its first copy.
/// - **Limits.** At most 99 documents besides the marker, 2 MB per batch and per item, checked
///   before the request (permanent failures: the batch can never commit).
///
/// ```no_run
/// use idem_core::engine::HandlerError;
/// use idem_core::{Engine, RetentionWindow};
/// use idem_cosmos::{BatchDocs, CosmosInbox};
///
/// # async fn f(orders: azure_data_cosmos::clients::ContainerClient,
/// #            msg: idem_core::extract::Message) -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = CosmosInbox::new(orders, "/orderId")?;
/// let consumer = Engine::builder(inbox).scope("orders").build()?;
/// let handler = |docs: BatchDocs, m: idem_core::extract::Message| async move {
///     let order: serde_json::Value =
///         serde_json::from_slice(&m.payload).map_err(|e| HandlerError::Permanent(e.to_string()))?;
///     let id = order["orderId"].as_str().unwrap_or_default().to_owned();
///     docs.set_partition_key(id.clone()).map_err(|e| HandlerError::Permanent(e.to_string()))?;
///     docs.create(&serde_json::json!({"id": id, "orderId": id, "total": order["total"]}))
///         .map_err(|e| HandlerError::Permanent(e.to_string()))?;
///     Ok::<_, HandlerError<String>>(())
/// };
/// let outcomes = consumer.decide_batch(&[msg], &handler).await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct CosmosInbox {
    container: ContainerClient,
    partition_path: String,
    retention: Duration,
    throttle: ThrottlePolicy,
    clock: std::sync::Arc<dyn Clock>,
}

impl std::fmt::Debug for CosmosInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CosmosInbox")
            .field("partition_path", &self.partition_path)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl CosmosInbox {
    /// An inbox writing to `container`, whose partition key path is `partition_path`
    /// (`/orderId`).
    ///
    /// # Errors
    /// [`Error::InvalidPath`] when the path does not look like `/field`.
    pub fn new(
        container: ContainerClient,
        partition_path: impl Into<String>,
    ) -> Result<Self, Error> {
        let partition_path = partition_path.into();
        check_path(&partition_path)?;
        Ok(Self {
            container,
            partition_path,
            retention: Duration::from_secs(7 * 24 * 3600),
            throttle: ThrottlePolicy::default(),
            clock: std::sync::Arc::new(SystemClock),
        })
    }

    /// Keeps markers this long (their `ttl`).
    #[must_use]
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How 429 answers are retried.
    #[must_use]
    pub fn throttle(mut self, policy: ThrottlePolicy) -> Self {
        self.throttle = policy;
        self
    }

    /// The clock stamping markers' creation times.
    #[must_use]
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = std::sync::Arc::new(clock);
        self
    }
}

impl idem_core::Backend for CosmosInbox {
    type Ctx = BatchDocs;

    fn retention(consumer: &Engine<Self>) -> Duration {
        consumer.store().retention
    }

    fn lease(_: &Engine<Self>) -> Option<Duration> {
        None
    }

    // The trait's signature, spelled out: its `Send` bound is the contract.
    #[allow(clippy::manual_async_fn)]
    fn decide<'a, M, H, Fut, T, E>(
        consumer: &'a Engine<Self>,
        batch: &'a [M],
        handler: &'a H,
    ) -> impl Future<Output = Vec<Outcome<T, E>>> + Send + 'a
    where
        M: Envelope + Clone + Send + Sync + 'static,
        H: Fn(Self::Ctx, M) -> Fut + Sync,
        Fut: Future<Output = Result<T, HandlerError<E>>> + Send + 'a,
        T: Serialize + DeserializeOwned + Send + 'a,
        E: Display + Send + 'a,
    {
        async move {
            let mut out = Vec::with_capacity(batch.len());
            for m in batch {
                out.push(decide_one(consumer, m, handler).await);
            }
            out
        }
    }
}

async fn decide_one<M, H, Fut, T, E>(c: &Engine<CosmosInbox>, m: &M, handler: &H) -> Outcome<T, E>
where
    M: Envelope + Clone + Send + Sync + 'static,
    H: Fn(BatchDocs, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    T: Serialize + DeserializeOwned + Send,
    E: Display + Send,
{
    let correlation = m.correlation_id();
    let (key, fingerprint) = match c.prepare::<M, T, E>(m) {
        Prepared::Claim(req) => (req.key, req.fingerprint),
        Prepared::Unkeyed => return unkeyed(c, m, handler).await,
        Prepared::Done(o) => {
            c.observe(None, correlation, &o, 0);
            return o;
        }
        // Prepared is non-exhaustive: anything new fails this delivery alone, for a retry.
        _ => {
            return transient(StoreError::backend(
                "inbox",
                true,
                "a delivery could not be prepared",
            ));
        }
    };
    let (docs, pending) = BatchDocs::new(Some(key.clone()));
    let ran = handler(docs, m.clone()).await;
    let (partition, ops) = docs::close(&pending);
    let outcome = match ran {
        Err(e) => Outcome::from_handler_error(e),
        Ok(v) => {
            let result = c.encode_result(&key, &v).filter(|b| b != b"null");
            let partition = partition.unwrap_or_else(|| key.id().to_owned());
            let inbox = c.store();
            match inbox.commit(&key, fingerprint, &partition, ops, result.as_deref()).await {
                Ok(Committed::Done) => Outcome::Processed(v),
                Ok(Committed::Marked(marker)) => settled(&key, fingerprint, &marker),
                Err(e) => failure(e),
            }
        }
    };
    c.observe(Some(&key), correlation, &outcome, 1);
    outcome
}

/// A message without a key (processed without dedup): its documents commit without a marker.
async fn unkeyed<M, H, Fut, T, E>(c: &Engine<CosmosInbox>, m: &M, handler: &H) -> Outcome<T, E>
where
    M: Envelope + Clone + Send + Sync + 'static,
    H: Fn(BatchDocs, M) -> Fut + Sync,
    Fut: Future<Output = Result<T, HandlerError<E>>> + Send,
    E: Display,
{
    let (docs, pending) = BatchDocs::new(None);
    let outcome = c.run_unkeyed(docs, |d| handler(d, m.clone()), m.correlation_id()).await;
    let (partition, ops) = docs::close(&pending);
    match (outcome, partition) {
        (Outcome::Processed(v), _) if ops.is_empty() => Outcome::Processed(v),
        (Outcome::Processed(v), Some(pk)) => match c.store().commit_unmarked(&pk, ops).await {
            Ok(()) => Outcome::Processed(v),
            Err(e) => failure(e),
        },
        (Outcome::Processed(_), None) => failure(Error::InvalidPartitionKey {
            reason: "a message without a dedup key must set the batch's partition key",
        }),
        (other, _) => other,
    }
}

/// The outcome of a delivery whose marker exists.
fn settled<T: DeserializeOwned, E>(
    key: &DedupKey,
    incoming: Option<Fingerprint>,
    marker: &commit::Marker,
) -> Outcome<T, E> {
    if let (Some(stored), Some(asked)) = (marker.fingerprint, incoming)
        && stored != asked
    {
        return Outcome::Conflict(Box::new(Conflict {
            key: key.clone(),
            stored: marker.fingerprint,
            incoming,
            stored_state: RecordState::Completed,
        }));
    }
    match marker.result.as_deref().map(serde_json::from_slice).transpose() {
        Ok(v) => Outcome::Duplicate(v),
        Err(e) => Outcome::failed(FailureKind::Permanent, Cause::Decode(e)),
    }
}

/// A commit that failed: validation (the batch can never commit) is permanent, the rest
/// (throttling, outages, a 403 from a misconfigured key) transient.
fn failure<T, E>(e: Error) -> Outcome<T, E> {
    let permanent = matches!(
        e,
        Error::InvalidId { .. }
            | Error::InvalidPartitionKey { .. }
            | Error::InvalidPath { .. }
            | Error::TooLarge { .. }
            | Error::TooManyOperations { .. }
            | Error::WrongPartition { .. }
            | Error::Json { .. }
            | Error::Exists { .. }
    );
    let kind = if permanent { FailureKind::Permanent } else { FailureKind::Transient };
    Outcome::failed(kind, Cause::Store(e.into()))
}

fn transient<T, E>(e: StoreError) -> Outcome<T, E> {
    Outcome::failed(FailureKind::Transient, Cause::Store(e))
}
