//! Entity as marker: create the business document once; a 409 means it was done before.

use azure_data_cosmos::clients::ContainerClient;
use idem_core::Fingerprint;
use serde::Serialize;
use serde_json::Value;

use crate::limits::{MAX_ITEM_BYTES, check_id, check_partition, check_partition_key, check_size};
use crate::store::doc::fingerprint_field;
use crate::{Error, ThrottlePolicy};

/// Field of the document holding the request fingerprint (hex), unless configured otherwise.
pub const DEFAULT_FINGERPRINT_FIELD: &str = "idemFingerprint";

/// How often a create that met a 409, then found the document gone (deleted, TTL), is tried
/// again.
const ROUNDS: u32 = 4;

/// What became of [`CosmosMarker::create_once`].
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
#[must_use = "a duplicate must be acknowledged without effect and a conflict alerted on"]
pub enum MarkerOutcome {
    /// The document was created: this is the first delivery. Do the rest of the work, then
    /// acknowledge.
    Created,
    /// The document existed with the same fingerprint (or the same immutable fields): a
    /// duplicate. Acknowledge without doing anything. Carries the stored document.
    Duplicate(Value),
    /// The document existed with a different fingerprint (or different immutable fields):
    /// the id was reused for other content. Dead-letter and alert.
    Conflict {
        /// The stored document.
        stored: Value,
        /// Its stored fingerprint, if it has one.
        stored_fingerprint: Option<Fingerprint>,
        /// The fingerprint of this delivery.
        incoming: Option<Fingerprint>,
    },
}

/// The pattern's own example: the business document is the dedup marker. The container is
/// partitioned by the entity (e.g. `/orderId`), the document `id` is the entity id, and the
/// create that fails with **409 Conflict** means "already processed": the stored document is
/// read and compared, by the request fingerprint stored in it (the default) or by chosen
/// immutable fields ([`CosmosMarker::compare_fields`]).
///
/// A duplicate is only recognised while the document exists: a document deleted (or expired
/// by its `ttl`) is created again. Use [`CosmosInbox`](crate::CosmosInbox) when one message
/// writes several documents.
///
/// ```no_run
/// use idem_core::Fingerprint;
/// use idem_cosmos::{CosmosMarker, MarkerOutcome};
///
/// # async fn f(orders: azure_data_cosmos::clients::ContainerClient) -> Result<(), idem_cosmos::Error> {
/// let marker = CosmosMarker::new(orders, "/orderId")?;
/// let body = br#"{"orderId":"o-42","total":10}"#;
/// let order = serde_json::json!({"id": "o-42", "orderId": "o-42", "total": 10});
/// match marker.create_once("o-42", &order, Some(Fingerprint::of_bytes(body))).await? {
///     MarkerOutcome::Created => { /* first time: go on, then ack */ }
///     MarkerOutcome::Duplicate(_) => { /* ack, do nothing */ }
///     MarkerOutcome::Conflict { .. } => { /* dead-letter and alert */ }
///     _ => {}
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct CosmosMarker {
    container: ContainerClient,
    partition_path: String,
    fingerprint_field: String,
    compare: Vec<String>,
    throttle: ThrottlePolicy,
}

impl std::fmt::Debug for CosmosMarker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CosmosMarker")
            .field("partition_path", &self.partition_path)
            .field("fingerprint_field", &self.fingerprint_field)
            .field("compare", &self.compare)
            .finish_non_exhaustive()
    }
}

impl CosmosMarker {
    /// Markers in `container`, whose partition key path is `partition_path` (`/orderId`).
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
            fingerprint_field: DEFAULT_FINGERPRINT_FIELD.to_owned(),
            compare: Vec::new(),
            throttle: ThrottlePolicy::default(),
        })
    }

    /// Stores the fingerprint in this top-level field instead of `idemFingerprint`.
    #[must_use]
    pub fn fingerprint_field(mut self, name: impl Into<String>) -> Self {
        self.fingerprint_field = name.into();
        self
    }

    /// Decides duplicate or conflict by comparing these fields (JSON pointers such as
    /// `/total` or `/customer/id`) of the stored and the new document, instead of the
    /// fingerprint: for documents whose immutable business fields identify the request.
    ///
    /// # Errors
    /// [`Error::InvalidPath`] when a pointer does not look like `/field`.
    pub fn compare_fields<I, S>(mut self, pointers: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.compare = pointers.into_iter().map(Into::into).collect();
        self.compare.iter().try_for_each(|p| check_path(p))?;
        Ok(self)
    }

    /// How 429 answers are retried.
    #[must_use]
    pub fn throttle(mut self, policy: ThrottlePolicy) -> Self {
        self.throttle = policy;
        self
    }

    /// Creates `doc` (its `id` field is the document id) under `partition_key` unless it
    /// exists; when it does, reads it and compares. `fingerprint` is stored in the document
    /// (hex, in the fingerprint field) for later deliveries to compare against.
    ///
    /// # Errors
    /// Validation before any request: [`Error::InvalidId`], [`Error::InvalidPartitionKey`],
    /// [`Error::WrongPartition`] (the document's partition key field differs from
    /// `partition_key`), [`Error::TooLarge`] (over the 2 MB item limit),
    /// [`Error::Json`]. Then [`Error::Throttled`] and [`Error::Cosmos`]; [`Error::Corrupt`]
    /// when the stored document's fingerprint field is not a fingerprint.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: the document was created or it was not; a later call decides.
    pub async fn create_once<T: Serialize>(
        &self,
        partition_key: &str,
        doc: &T,
        fingerprint: Option<Fingerprint>,
    ) -> Result<MarkerOutcome, Error> {
        let mut doc = serde_json::to_value(doc)
            .map_err(|source| Error::Json { what: "document does not serialize", source })?;
        let id = doc.get("id").and_then(Value::as_str).unwrap_or("").to_owned();
        check_id(&id)?;
        check_partition_key(partition_key)?;
        check_partition(&doc, &self.partition_path, partition_key)?;
        if let (Some(fp), Some(obj)) = (fingerprint, doc.as_object_mut()) {
            obj.insert(self.fingerprint_field.clone(), Value::String(hex::encode(fp.as_bytes())));
        }
        let len = serde_json::to_vec(&doc).map_or(0, |b| b.len());
        check_size("document", len, MAX_ITEM_BYTES)?;
        let pk = partition_key.to_owned();
        for _ in 0..ROUNDS {
            let created =
                self.throttle.run(|| self.container.create_item(pk.clone(), &id, &doc, None)).await;
            match created {
                Ok(_) => return Ok(MarkerOutcome::Created),
                Err(e) if e.status().is_conflict() => {}
                Err(e) => return Err(self.throttle.fail("create_item", e)),
            }
            let read = self.throttle.run(|| self.container.read_item(pk.clone(), &id, None)).await;
            let stored: Value = match read {
                Ok(r) => r.into_model().map_err(|e| self.throttle.fail("read_item", e))?,
                // Deleted between the 409 and the read: create again.
                Err(e) if e.status().is_not_found() => continue,
                Err(e) => return Err(self.throttle.fail("read_item", e)),
            };
            return self.compare(stored, &doc, fingerprint, &id);
        }
        Err(Error::Corrupt { what: format!("document {id} kept appearing and disappearing") })
    }

    fn compare(
        &self,
        stored: Value,
        incoming: &Value,
        fingerprint: Option<Fingerprint>,
        id: &str,
    ) -> Result<MarkerOutcome, Error> {
        let stored_fingerprint =
            fingerprint_field(&stored, &self.fingerprint_field).map_err(|()| Error::Corrupt {
                what: format!("field {} of document {id}", self.fingerprint_field),
            })?;
        let same = if self.compare.is_empty() {
            match (stored_fingerprint, fingerprint) {
                (Some(s), Some(i)) => s == i,
                // Nothing to compare: the id alone says duplicate.
                _ => true,
            }
        } else {
            self.compare.iter().all(|p| stored.pointer(p) == incoming.pointer(p))
        };
        Ok(if same {
            MarkerOutcome::Duplicate(stored)
        } else {
            MarkerOutcome::Conflict { stored, stored_fingerprint, incoming: fingerprint }
        })
    }
}

/// A partition key path: `/` then a field (nested fields as `/a/b`).
pub(crate) fn check_path(path: &str) -> Result<(), Error> {
    if path.len() > 1 && path.starts_with('/') && !path.ends_with('/') {
        Ok(())
    } else {
        Err(Error::InvalidPath { path: path.to_owned() })
    }
}
