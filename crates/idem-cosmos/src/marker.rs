//! Entity as marker: create the business document once; a 409 means it was done before.

use azure_data_cosmos::clients::ContainerClient;
use idem_core::{Claim, DedupKey, Fingerprint, Lease, Record, Timestamp};
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

/// The proof of a key whose marker this delivery wrote: no lease is held (an entity, or an
/// inbox marker, is written once and never taken over), so it carries no time and no token.
pub(crate) fn entity_lease(key: &DedupKey, fingerprint: Option<Fingerprint>) -> Lease {
    Lease::new(key.clone(), fingerprint, 0, 1, Timestamp::from_micros(0), None)
}

/// The pattern's own example: the business document is the dedup marker. The container is
/// partitioned by the entity (e.g. `/orderId`), the document `id` is the entity id, and the
/// create that fails with **409 Conflict** means "already processed": the stored document is
/// read and compared, by the request fingerprint stored in it (the default) or by chosen
/// immutable fields ([`CosmosMarker::compare_fields`]). The answer is a [`Claim`], as every
/// store's and inbox's: acquired, completed (a duplicate) or a conflict.
///
/// A duplicate is only recognised while the document exists: a document deleted (or expired
/// by its `ttl`) is created again. Use [`CosmosInbox`](crate::CosmosInbox) when one message
/// writes several documents.
///
/// ```no_run
/// use idem_core::{Claim, DedupKey, Fingerprint};
/// use idem_cosmos::CosmosMarker;
///
/// # async fn f(orders: azure_data_cosmos::clients::ContainerClient) -> Result<(), Box<dyn std::error::Error>> {
/// let marker = CosmosMarker::new(orders, "/orderId")?;
/// let key = DedupKey::new("order-writer", "o-42")?;
/// let body = br#"{"orderId":"o-42","total":10}"#;
/// let order = serde_json::json!({"id": "o-42", "orderId": "o-42", "total": 10});
/// match marker.create_once(&key, "o-42", &order, Some(Fingerprint::of_bytes(body))).await? {
///     Claim::Acquired(_) => { /* first time: go on, then ack */ }
///     Claim::Completed(_) => { /* a duplicate: ack, do nothing */ }
///     Claim::Conflict(_) => { /* dead-letter and alert */ }
///     Claim::InProgress { .. } => unreachable!("an entity is never leased"),
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

    /// Creates `doc`, the entity of `key` (its `id` is `key.id()`), under `partition_key`
    /// unless it exists; when it does, reads it and compares. `fingerprint` is stored in the
    /// document (hex, in the fingerprint field) for later deliveries to compare against.
    ///
    /// The answer: [`Claim::Acquired`] when this call created the document;
    /// [`Claim::Completed`] (a duplicate) or [`Claim::Conflict`] (the id reused for other
    /// content) when it existed, each with the stored document as a [`Record::entity`] whose
    /// `result` is that document's JSON. Never [`Claim::InProgress`]: an entity holds no lease.
    ///
    /// # Errors
    /// Validation before any request: [`Error::InvalidId`] (also when the document's `id`
    /// is not `key.id()`), [`Error::InvalidPartitionKey`], [`Error::WrongPartition`] (the
    /// document's partition key field differs from `partition_key`), [`Error::TooLarge`] (over
    /// the 2 MB item limit), [`Error::Json`]. Then [`Error::Throttled`] and [`Error::Cosmos`];
    /// [`Error::Corrupt`] when the stored document's fingerprint field is not a fingerprint.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: the document was created or it was not; a later call decides.
    pub async fn create_once<T: Serialize>(
        &self,
        key: &DedupKey,
        partition_key: &str,
        doc: &T,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Claim, Error> {
        let mut doc = serde_json::to_value(doc)
            .map_err(|source| Error::Json { what: "document does not serialize", source })?;
        let id = key.id();
        check_id(id)?;
        match doc.get("id") {
            None => {
                if let Some(obj) = doc.as_object_mut() {
                    obj.insert("id".to_owned(), Value::String(id.to_owned()));
                }
            }
            Some(Value::String(given)) if given == id => {}
            Some(other) => {
                let given = other.as_str().map_or_else(|| other.to_string(), str::to_owned);
                return Err(Error::InvalidId { id: given, reason: "it is not the dedup key's id" });
            }
        }
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
                self.throttle.run(|| self.container.create_item(pk.clone(), id, &doc, None)).await;
            match created {
                Ok(_) => return Ok(Claim::Acquired(entity_lease(key, fingerprint))),
                Err(e) if e.status().is_conflict() => {}
                Err(e) => return Err(self.throttle.fail("create_item", e)),
            }
            let read = self.throttle.run(|| self.container.read_item(pk.clone(), id, None)).await;
            let stored: Value = match read {
                Ok(r) => r.into_model().map_err(|e| self.throttle.fail("read_item", e))?,
                // Deleted between the 409 and the read: create again.
                Err(e) if e.status().is_not_found() => continue,
                Err(e) => return Err(self.throttle.fail("read_item", e)),
            };
            return self.compare(key, stored, &doc, fingerprint);
        }
        Err(Error::Corrupt { what: format!("document {id} kept appearing and disappearing") })
    }

    fn compare(
        &self,
        key: &DedupKey,
        stored: Value,
        incoming: &Value,
        fingerprint: Option<Fingerprint>,
    ) -> Result<Claim, Error> {
        let stored_fingerprint =
            fingerprint_field(&stored, &self.fingerprint_field).map_err(|()| Error::Corrupt {
                what: format!("field {} of document {}", self.fingerprint_field, key.id()),
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
        let mut rec = Record::entity(key, stored_fingerprint);
        rec.result = Some(serde_json::to_vec(&stored).map_err(|source| Error::Json {
            what: "stored document does not serialize",
            source,
        })?);
        Ok(if same { Claim::Completed(rec) } else { Claim::Conflict(rec) })
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
