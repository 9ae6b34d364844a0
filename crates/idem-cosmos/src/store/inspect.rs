//! Operator access (`InspectStore`) and `purge`: queries across the container's partitions.

use azure_data_cosmos::{FeedScope, Query};
use futures_util::TryStreamExt as _;
use idem_core::claim::next_token;
use idem_core::{Counts, DedupKey, InspectStore, ListFilter, Record, RecordState, StoreError};

use super::doc::{RecordDoc, doc_id};
use super::{CosmosStore, MAX_RESULT_BYTES, MAX_ROUNDS, Write, contended};
use crate::Error;

impl CosmosStore {
    /// Every document `query` selects, across partitions. Operator tools and `purge` use it;
    /// claims never query.
    async fn query(
        &self,
        text: &str,
        params: &[(&str, serde_json::Value)],
    ) -> Result<Vec<RecordDoc>, Error> {
        let mut query = Query::from(text);
        for (name, value) in params {
            query = query.with_parameter(*name, value).map_err(|e| Error::cosmos("query", e))?;
        }
        let items = self
            .container
            .query_items::<serde_json::Value>(query, FeedScope::full_container(), None)
            .await
            .map_err(|e| self.throttle.fail("query", e))?;
        let docs: Vec<_> = items.try_collect().await.map_err(|e| self.throttle.fail("query", e))?;
        docs.into_iter().map(RecordDoc::from_json).collect()
    }

    async fn records(&self, scope: Option<&str>) -> Result<Vec<Record>, StoreError> {
        let docs = match scope {
            Some(s) => {
                self.query("SELECT * FROM c WHERE c.scope = @scope", &[("@scope", s.into())])
                    .await?
            }
            None => self.query("SELECT * FROM c", &[]).await?,
        };
        docs.iter().map(|d| d.to_record().map_err(StoreError::from)).collect()
    }

    /// Deletes at most `limit` records expired by this store's clock, each only if unchanged
    /// since it was read (`If-Match`), so a claim racing the purge wins.
    pub(super) async fn purge_expired(&self, limit: usize) -> Result<u64, StoreError> {
        let now = self.now();
        let candidates = self
            .query("SELECT * FROM c WHERE c.expires <= @now", &[("@now", now.as_micros().into())])
            .await?;
        let mut deleted = 0;
        for doc in candidates {
            if deleted >= limit as u64 {
                break;
            }
            let Some(etag) = doc.etag.as_deref() else { continue };
            if doc.to_record()?.is_expired_at(now) && self.delete(&doc.id, etag).await? {
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    /// An operator's change to a record: `change` sets its state (or answers `false` to leave it
    /// alone); the token moves on so a lease holder is fenced out, and the write is conditional
    /// on the version read (`If-Match`), retried when another writer got there first. Whether
    /// the record was changed.
    async fn override_record(
        &self,
        key: &DedupKey,
        op: &'static str,
        change: impl Fn(&mut Record) -> bool,
    ) -> Result<bool, StoreError> {
        let id = doc_id(key);
        for _ in 0..MAX_ROUNDS {
            let Some(doc) = self.read(&id).await? else { return Ok(false) };
            let mut rec = doc.to_record()?;
            if !change(&mut rec) {
                return Ok(false);
            }
            let now = self.now();
            rec.token = next_token(Some(rec.token), now);
            rec.lease_until = None;
            rec.updated_at = now;
            match self.write(&rec, doc.etag.as_deref(), now).await? {
                Write::Done => return Ok(true),
                Write::Lost => {}
            }
        }
        Err(contended(op))
    }
}

/// Operator access. `list` and `count` query across partitions and read every matching
/// document: they are for operators, not for hot paths.
impl InspectStore for CosmosStore {
    async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        match self.read(&doc_id(key)).await? {
            Some(doc) => Ok(Some(doc.to_record()?)),
            None => Ok(None),
        }
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        let mut out: Vec<Record> = self
            .records(filter.scope.as_deref())
            .await?
            .into_iter()
            .filter(|r| filter.state.is_none_or(|s| s == r.state))
            .collect();
        out.sort_by_key(|r| std::cmp::Reverse(r.updated_at));
        out.truncate(filter.limit);
        Ok(out)
    }

    async fn count(&self, scope: Option<&str>) -> Result<Counts, StoreError> {
        let now = self.now();
        let mut counts = Counts::default();
        for r in self.records(scope).await? {
            counts.add(r.state, 1);
            counts.expired += u64::from(r.is_expired_at(now));
        }
        Ok(counts)
    }

    async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        self.override_record(key, "force_release", |rec| {
            rec.state = RecordState::Released;
            true
        })
        .await
    }

    async fn force_fail(&self, key: &DedupKey, reason: &str) -> Result<bool, StoreError> {
        StoreError::check_len("reason", reason.len(), MAX_RESULT_BYTES)?;
        self.override_record(key, "force_fail", |rec| {
            // Decided on the version the If-Match write is conditional on.
            if rec.state == RecordState::Completed {
                return false;
            }
            rec.state = RecordState::Failed;
            rec.result = Some(reason.as_bytes().to_vec());
            true
        })
        .await
    }
}
