//! `CosmosStore`: the dedup contract on Cosmos DB, one ETag-conditional write per decision.

pub(crate) mod doc;
mod inspect;

use std::sync::Arc;
use std::time::Duration;

use azure_data_cosmos::clients::ContainerClient;
use azure_data_cosmos::models::{ContainerProperties, TimeToLive};
use azure_data_cosmos::options::{ItemWriteOptions, Precondition};
use futures_util::StreamExt as _;
use futures_util::stream;
use idem_core::claim_rule;
use idem_core::time::{Clock, SystemClock};
use idem_core::{
    Claim, ClaimRequest, DedupStore, FailKind, Lease, Record, RecordState, StoreError, Timestamp,
};

use crate::limits::{MAX_ITEM_BYTES, check_size};
use crate::{Error, ThrottlePolicy};
use doc::{PK_PATH, RecordDoc, doc_id};

/// Largest stored result or reason, in bytes. Stored base64 in the record's document, it stays
/// well under Cosmos DB's 2 MB item limit.
pub const MAX_RESULT_BYTES: usize = 1 << 20;

/// How many times one operation re-reads and decides again after losing an ETag race before
/// it reports a retryable error.
const MAX_ROUNDS: u32 = 32;

/// Claims of one `claim_many` in flight at once.
const BATCH_CONCURRENCY: usize = 32;

/// A dedup store on an Azure Cosmos DB for NoSQL container.
///
/// - **Atomic per key.** Each record is one document (`id` = partition key = the key's hash in
///   hex). A claim creates it (a 409 means it exists) or replaces it with `If-Match` on the
///   ETag it decided from; when another writer got there first (412), it reads and decides
///   again. Of concurrent claims exactly one write wins.
/// - **Fenced.** The document keeps the fencing token; `complete`, `fail`, `release` and
///   `extend` read it, refuse a stale token with [`StoreError::LeaseLost`], and write with
///   `If-Match`, so a takeover between the read and the write also fails the write.
/// - **Whose clock.** Cosmos DB exposes no clock to read before a write, so lease ends and
///   expiries are judged by this store's [`Clock`] (the system clock of the consumer host by
///   default), like the embedded stores: keep consumer hosts NTP-synchronised and leases far
///   longer than their skew.
/// - **Retention is Cosmos DB's per-item `ttl`.** Every write sets `ttl` to the time left to the
///   record's expiry plus a grace (default 5 minutes, [`CosmosStore::ttl_grace`]) so the service
///   never deletes a record before this store's clock says it expired. The store never relies
///   on the deletion: an expired record still present (TTL not yet run, or an emulator without
///   TTL) is treated as absent by `claim`, and [`DedupStore::purge`] deletes what expired by
///   this store's clock. The container needs TTL switched on without a default
///   ([`CosmosStore::container_properties`]).
/// - **Batches are atomic per key.** Cosmos DB has no transaction across partitions, so
///   `claim_many` claims its keys concurrently, one conditional write per key (a key's
///   repeats decided together in that write); if it fails midway, the claims already made stay
///   until their leases run out.
/// - **Throttling.** A 429 is retried as [`ThrottlePolicy`] says, then reported as a
///   retryable [`StoreError::Backend`].
///
/// ```no_run
/// use std::time::Duration;
/// use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore};
/// use idem_cosmos::CosmosStore;
///
/// # async fn f(client: azure_data_cosmos::CosmosClient) -> Result<(), Box<dyn std::error::Error>> {
/// // A container created from `CosmosStore::container_properties("idem")`.
/// let container = client.database_client("app").container_client("idem", None).await?;
/// let store = CosmosStore::new(container);
/// let req = ClaimRequest::new(DedupKey::new("billing", "o-1")?, None,
///                             Duration::from_secs(30), Duration::from_secs(86_400));
/// let Claim::Acquired(lease) = store.claim(&req).await? else { unreachable!() };
/// store.complete(lease, Some(b"ok"), Duration::from_secs(86_400)).await?;
/// assert!(matches!(store.claim(&req).await?, Claim::Completed(_)));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct CosmosStore {
    container: ContainerClient,
    clock: Arc<dyn Clock>,
    throttle: ThrottlePolicy,
    ttl_grace: Duration,
}

impl std::fmt::Debug for CosmosStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CosmosStore")
            .field("clock", &self.clock)
            .field("throttle", &self.throttle)
            .field("ttl_grace", &self.ttl_grace)
            .finish_non_exhaustive()
    }
}

/// How a conditional write ended.
enum Write {
    Done,
    /// Another writer changed or removed the document first (409, 412 or 404).
    Lost,
}

impl CosmosStore {
    /// A store on `container` (partitioned on `/pk`, TTL on; see
    /// [`CosmosStore::container_properties`]), on the system clock.
    pub fn new(container: ContainerClient) -> Self {
        Self {
            container,
            clock: Arc::new(SystemClock),
            throttle: ThrottlePolicy::default(),
            ttl_grace: Duration::from_secs(300),
        }
    }

    /// Judges leases and expiries by `clock` (a `ManualClock` in tests).
    #[must_use]
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// How 429 answers are retried.
    #[must_use]
    pub fn throttle(mut self, policy: ThrottlePolicy) -> Self {
        self.throttle = policy;
        self
    }

    /// How long after its expiry (by this store's clock) Cosmos DB's TTL may delete a record:
    /// a margin for the skew between this clock and the service's.
    #[must_use]
    pub fn ttl_grace(mut self, grace: Duration) -> Self {
        self.ttl_grace = grace;
        self
    }

    /// The properties of a container this store can use: partitioned on `/pk`, TTL switched
    /// on with no default (each record sets its own `ttl`). Create it with the SDK's
    /// `DatabaseClient::create_container` (feature `control_plane`), or the same settings in
    /// the portal, Bicep or Terraform.
    ///
    /// ```
    /// let props = idem_cosmos::CosmosStore::container_properties("idem");
    /// assert_eq!(props.id, "idem");
    /// ```
    pub fn container_properties(name: impl Into<String>) -> ContainerProperties {
        ContainerProperties::new(name.into(), PK_PATH.into())
            .with_default_ttl(TimeToLive::NoDefault)
    }

    fn now(&self) -> Timestamp {
        self.clock.now()
    }

    /// The stored document of `id`, if any.
    async fn read(&self, id: &str) -> Result<Option<RecordDoc>, Error> {
        let res = self.throttle.run(|| self.container.read_item(id.to_owned(), id, None)).await;
        match res {
            Ok(r) => {
                let doc = r.into_model().map_err(|e| self.throttle.fail("read_item", e))?;
                RecordDoc::from_json(doc).map(Some)
            }
            Err(e) if e.status().is_not_found() => Ok(None),
            Err(e) => Err(self.throttle.fail("read_item", e)),
        }
    }

    /// Creates `rec`'s document, or replaces it if its ETag is still `etag`.
    async fn write(
        &self,
        rec: &Record,
        etag: Option<&str>,
        now: Timestamp,
    ) -> Result<Write, Error> {
        let doc = RecordDoc::from_record(rec, now, self.ttl_grace);
        let bytes = serde_json::to_vec(&doc)
            .map_err(|source| Error::Json { what: "record does not serialize", source })?;
        check_size("document", bytes.len(), MAX_ITEM_BYTES)?;
        let (op, res) = match etag {
            None => {
                let res = self
                    .throttle
                    .run(|| self.container.create_item(doc.pk.clone(), &doc.id, &doc, None))
                    .await;
                ("create_item", res)
            }
            Some(etag) => {
                let opts = || {
                    Some(
                        ItemWriteOptions::default()
                            .with_precondition(Precondition::if_match(etag.to_owned())),
                    )
                };
                let res = self
                    .throttle
                    .run(|| self.container.replace_item(doc.pk.clone(), &doc.id, &doc, opts()))
                    .await;
                ("replace_item", res)
            }
        };
        match res {
            Ok(_) => Ok(Write::Done),
            Err(e)
                if e.status().is_conflict()
                    || e.status().is_precondition_failed()
                    || e.status().is_not_found() =>
            {
                Ok(Write::Lost)
            }
            Err(e) => Err(self.throttle.fail(op, e)),
        }
    }

    /// Deletes `id` if its ETag is still `etag`; whether it did.
    async fn delete(&self, id: &str, etag: &str) -> Result<bool, Error> {
        let opts = || {
            Some(
                ItemWriteOptions::default()
                    .with_precondition(Precondition::if_match(etag.to_owned())),
            )
        };
        match self.throttle.run(|| self.container.delete_item(id.to_owned(), id, opts())).await {
            Ok(_) => Ok(true),
            Err(e) if e.status().is_precondition_failed() || e.status().is_not_found() => Ok(false),
            Err(e) => Err(self.throttle.fail("delete_item", e)),
        }
    }

    /// Claims one key for `reqs` (its requests, in batch order) with one conditional write:
    /// the rule is applied to each request in turn on the record as the earlier ones left it,
    /// and the last record it produced is written with `If-Match` (or created), so the key's
    /// requests are one atomic step. Again from a fresh read if another writer got in between.
    async fn claim_key(&self, reqs: &[&ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        let Some(first) = reqs.first() else { return Ok(Vec::new()) };
        let id = doc_id(&first.key);
        // Most claims are of new keys: try the create first, read only when it exists.
        let mut stored: Option<RecordDoc> = None;
        for _ in 0..MAX_ROUNDS {
            let now = self.now();
            let mut rec = stored.as_ref().map(RecordDoc::to_record).transpose()?;
            let etag = stored.as_ref().and_then(|d| d.etag.clone());
            let mut claims = Vec::with_capacity(reqs.len());
            let mut write = None;
            for req in reqs {
                let d = claim_rule::apply(rec.as_ref(), req, now);
                if let Some(w) = d.write {
                    rec = Some(w.clone());
                    write = Some(w);
                }
                claims.push(d.claim);
            }
            let Some(write) = write else { return Ok(claims) };
            match self.write(&write, etag.as_deref(), now).await? {
                Write::Done => return Ok(claims),
                Write::Lost => stored = self.read(&id).await?,
            }
        }
        Err(contended("claim"))
    }

    /// Reads the lease's record, checks its token, applies `change`, writes it back with
    /// `If-Match`; again from the read if another writer got in between.
    async fn fenced(
        &self,
        op: &'static str,
        lease: &Lease,
        change: impl Fn(&mut Record, Timestamp),
    ) -> Result<Timestamp, StoreError> {
        let id = doc_id(lease.key());
        let lost = || StoreError::LeaseLost { key: lease.key().to_string() };
        for _ in 0..MAX_ROUNDS {
            let Some(doc) = self.read(&id).await? else { return Err(lost()) };
            let mut rec = doc.to_record()?;
            if rec.token != lease.token() || rec.state != RecordState::InProgress {
                return Err(lost());
            }
            let now = self.now();
            change(&mut rec, now);
            let Some(etag) = doc.etag.as_deref() else {
                return Err(StoreError::Corrupt { what: format!("document {id} has no _etag") });
            };
            match self.write(&rec, Some(etag), now).await? {
                Write::Done => return Ok(now),
                // Gone or changed: the next read says whether this lease still holds.
                Write::Lost => {}
            }
        }
        Err(contended(op))
    }

    async fn finish(
        &self,
        op: &'static str,
        lease: &Lease,
        state: RecordState,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        StoreError::check_len("result", result.map_or(0, <[u8]>::len), MAX_RESULT_BYTES)?;
        self.fenced(op, lease, |rec, now| {
            rec.state = state;
            rec.result = result.map(<[u8]>::to_vec);
            rec.updated_at = now;
            rec.lease_until = None;
            rec.expires_at = now.plus(retain_for);
        })
        .await
        .map(drop)
    }
}

/// One key's answers in a batch, or the error that stopped them.
type ClaimsOf = Result<Vec<Claim>, StoreError>;

fn contended(op: &'static str) -> StoreError {
    StoreError::backend(op, true, "the record kept changing under concurrent writers")
}

impl DedupStore for CosmosStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let mut claims = self.claim_key(&[req]).await?;
        claims.pop().ok_or_else(|| StoreError::Corrupt { what: "claim without an answer".into() })
    }

    /// Atomic per key (each key is its own partition; Cosmos DB has no transaction across
    /// partitions): a key's requests, repeats included, are one conditional write; the keys
    /// are claimed concurrently.
    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        let mut by_key: Vec<Vec<usize>> = Vec::new();
        let mut slot: std::collections::HashMap<_, usize> = std::collections::HashMap::new();
        for (i, r) in reqs.iter().enumerate() {
            let n = *slot.entry(r.key.hash()).or_insert_with(|| {
                by_key.push(Vec::new());
                by_key.len() - 1
            });
            by_key[n].push(i);
        }
        let answers: Vec<(Vec<usize>, ClaimsOf)> = stream::iter(by_key)
            .map(|idx| async move {
                let group: Vec<&ClaimRequest> = idx.iter().map(|&i| &reqs[i]).collect();
                let claims = self.claim_key(&group).await;
                (idx, claims)
            })
            .buffer_unordered(BATCH_CONCURRENCY)
            .collect()
            .await;
        let mut out: Vec<Option<Claim>> = reqs.iter().map(|_| None).collect();
        for (idx, claims) in answers {
            for (&i, c) in idx.iter().zip(claims?) {
                out[i] = Some(c);
            }
        }
        out.into_iter()
            .map(|c| {
                c.ok_or_else(|| StoreError::backend("claim_many", true, "a claim went missing"))
            })
            .collect()
    }

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.finish("complete", &lease, RecordState::Completed, result, retain_for).await
    }

    async fn fail(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.finish("fail", &lease, kind.state(), Some(reason.as_bytes()), retain_for).await
    }

    async fn release(&self, lease: Lease) -> Result<(), StoreError> {
        self.fenced("release", &lease, |rec, now| {
            rec.state = RecordState::Released;
            rec.updated_at = now;
            rec.lease_until = None;
        })
        .await
        .map(drop)
    }

    async fn extend(&self, lease: &mut Lease, by: Duration) -> Result<(), StoreError> {
        let now = self
            .fenced("extend", lease, |rec, now| {
                let until = now.plus(by);
                rec.lease_until = Some(until);
                rec.expires_at = rec.expires_at.max(until);
                rec.updated_at = now;
            })
            .await?;
        lease.set_until(now.plus(by));
        Ok(())
    }

    async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        self.purge_expired(limit).await
    }
}
