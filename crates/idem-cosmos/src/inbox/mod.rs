//! `CosmosInbox`: the transactional inbox on Cosmos DB. Per delivery, the dedup marker and the
//! handler's documents commit in one transactional batch under one partition key.

mod commit;
mod docs;
mod primitives;

use std::time::Duration;

use azure_data_cosmos::clients::ContainerClient;
use idem_core::time::{Clock, SystemClock};

pub use docs::BatchDocs;

use crate::marker::check_path;
use crate::{Error, ThrottlePolicy};

/// A transactional inbox on a Cosmos DB container, for handlers whose effects are documents of
/// one partition: an [`idem_core::TxInbox`] whose transaction is a transactional batch
/// ([`BatchDocs`]), with its marker written only at commit
/// ([`ANSWERS_AT_COMMIT`](idem_core::TxInbox::ANSWERS_AT_COMMIT)).
///
/// For each delivery the handler gets a `Tx<CosmosInbox>` and adds its documents through it
/// (it dereferences to [`BatchDocs`]). When it returns `Ok`, one **transactional batch** creates
/// the dedup marker (id `idem-<key hash>`, holding the fingerprint and the handler's result) and
/// writes the documents, under the partition key the handler chose: all of it commits, or none
/// of it.
///
/// - **409 on the batch = the key was done.** The marker exists: it is read and its fingerprint
///   compared: a duplicate with the stored result, or a conflict. A 409 on a business document
///   while the marker is absent is an [`Error::Exists`] failure (permanent): the entity was
///   written by something else.
/// - **A failing handler writes nothing** (its batch is dropped).
/// - **No leases.** Two concurrent deliveries of one key may both run the handler; one batch
///   wins, the other answers duplicate. Handlers therefore must have no effect outside the
///   batch (use the two-phase [`CosmosStore`](crate::CosmosStore) for those).
/// - **Same partition every time.** The handler must choose the partition key from the
///   message deterministically (the entity id), or a redelivery would not meet its marker.
/// - **Retention.** Markers carry Cosmos DB's `ttl` ([`CosmosInbox::retention`], default 7
///   days; the container needs TTL switched on). A marker is a duplicate while it exists.
/// - One message per batch, decided in delivery order, so a key repeated in a fetched batch
///   is a duplicate of its first copy.
/// - **Limits.** At most 99 documents besides the marker, 2 MB per batch and per item, checked
///   before the request (permanent failures: the batch can never commit).
///
/// ```no_run
/// use idem_core::engine::HandlerError;
/// use idem_core::{Engine, Inbox, Tx};
/// use idem_cosmos::CosmosInbox;
///
/// # async fn f(orders: azure_data_cosmos::clients::ContainerClient,
/// #            msg: idem_core::extract::Message) -> Result<(), Box<dyn std::error::Error>> {
/// let inbox = CosmosInbox::new(orders, "/orderId")?;
/// // A broker consumer: `Consumer::builder(source).inbox(inbox)`; here, the bare engine.
/// let engine = Engine::builder(Inbox::new(inbox)).scope("orders").build()?;
/// let handler = |mut tx: Tx<CosmosInbox>, m: idem_core::extract::Message| async move {
///     let order: serde_json::Value =
///         serde_json::from_slice(&m.payload).map_err(|e| HandlerError::Permanent(e.to_string()))?;
///     let id = order["orderId"].as_str().unwrap_or_default().to_owned();
///     tx.set_partition_key(id.clone()).map_err(|e| HandlerError::Permanent(e.to_string()))?;
///     tx.create(&serde_json::json!({"id": id, "orderId": id, "total": order["total"]}))
///         .map_err(|e| HandlerError::Permanent(e.to_string()))?;
///     Ok::<_, HandlerError<String>>(())
/// };
/// let outcomes = engine.decide_batch(&[msg], &handler).await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct CosmosInbox {
    container: ContainerClient,
    partition_path: String,
    retention: Duration,
    throttle: ThrottlePolicy,
    clock: std::sync::Arc<dyn Clock>,
    /// Where redelivered messages' crash notes are claimed ([`Self::crash_notes`]).
    notes: Option<crate::CosmosStore>,
}

impl std::fmt::Debug for CosmosInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CosmosInbox")
            .field("partition_path", &self.partition_path)
            .field("retention", &self.retention)
            .field("crash_notes", &self.notes.is_some())
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
            notes: None,
        })
    }

    /// Keeps crash notes in `store` (a container of its own, partitioned on `/pk`: see
    /// [`CosmosStore::container_properties`](crate::CosmosStore::container_properties)), so a
    /// message that kills the process is counted and dead-lettered as a crash loop, as on the
    /// SQL inboxes: a redelivered message runs under a two-phase claim of a note there, outside
    /// its batch. Without it a crash loop is not detected. One difference: a mark is answered
    /// only at commit, so a message at the limit is dead-lettered even when an earlier delivery
    /// had committed it (its effect happened once; the dead letter is a copy).
    #[must_use]
    pub fn crash_notes(mut self, store: crate::CosmosStore) -> Self {
        self.notes = Some(store);
        self
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
