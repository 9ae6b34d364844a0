//! Operator access (`InspectStore`) and the offset-only purge sweep. Both scan the namespace.

use idem_core::{Counts, DedupKey, InspectStore, ListFilter, Record, StoreError, Timestamp};
use redis::Value;

use super::{MAX_RESULT_BYTES, RedisStore, backend, decode};

/// Keys per `SCAN` step (a hint to the server, not a bound).
const SCAN_COUNT: usize = 1000;

impl RedisStore {
    /// One `SCAN … MATCH idem:{ns}:*` step from `cursor` (on a cluster, on the namespace's
    /// master): the next cursor (0 at the end) and a page of record keys. `SCAN` visits the whole database (other keys too) a page at a time
    /// without blocking the server; a key may be visited twice.
    async fn scan_step(
        &self,
        op: &'static str,
        cursor: u64,
    ) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
        let mut scan = redis::cmd("SCAN");
        scan.arg(cursor)
            .arg("MATCH")
            .arg(format!("{}*", self.ns.key_prefix()))
            .arg("COUNT")
            .arg(SCAN_COUNT);
        // On a cluster, the namespace's records all live on the master owning its slot.
        let v = self
            .conn
            .on_slot_master(self.ns.key_prefix(), scan)
            .await
            .map_err(|e| backend(op, e))?;
        redis::from_redis_value(v)
            .map_err(|e| StoreError::Corrupt { what: format!("SCAN reply: {e}") })
    }

    /// The records behind `keys`, decoded; keys deleted meanwhile are skipped.
    async fn fetch(&self, op: &'static str, keys: &[Vec<u8>]) -> Result<Vec<Record>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let mut pipe = redis::pipe();
        for k in keys {
            pipe.cmd("GET").arg(k);
        }
        let replies: Vec<Value> =
            pipe.query_async(&mut self.conn.clone()).await.map_err(|e| backend(op, e))?;
        let prefix = self.ns.key_prefix().len();
        let mut out = Vec::with_capacity(keys.len());
        for (k, v) in keys.iter().zip(&replies) {
            if let Some(r) = decode::record(v, decode::hash_of_key(k, prefix)?)? {
                out.push(r);
            }
        }
        Ok(out)
    }

    /// The purge sweep for a store with a test clock offset: deletes records whose shifted
    /// expiry passed, checking each again inside a script (never a read then a delete).
    pub(super) async fn purge_shifted(&self, limit: usize) -> Result<u64, StoreError> {
        let limit = u64::try_from(limit).unwrap_or(u64::MAX);
        let mut deleted: u64 = 0;
        let mut cursor = 0;
        loop {
            let (next, keys) = self.scan_step("purge", cursor).await?;
            if !keys.is_empty() {
                let mut inv = self.scripts.purge.prepare_invoke();
                inv.arg(self.offset_us()).arg(limit - deleted);
                for k in &keys {
                    inv.key(k);
                }
                let n: Value = inv
                    .invoke_async(&mut self.conn.clone())
                    .await
                    .map_err(|e| backend("purge", e))?;
                deleted += u64::try_from(decode::int_reply(&n, "purge count")?).unwrap_or(0);
            }
            if next == 0 || deleted >= limit {
                break;
            }
            cursor = next;
        }
        Ok(deleted)
    }
}

/// Operator access. `get`, `force_release` and `force_fail` touch one key; `list` and `count` **scan the
/// whole database** (`SCAN MATCH` on the namespace prefix, pages of 1,000, then one pipelined
/// `GET` per page): O(keys in the database) time and round trips, and `list` holds every
/// matching record in memory to sort it. Fine for operator tools; not for a hot path.
impl InspectStore for RedisStore {
    async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        let v: Value = redis::cmd("GET")
            .arg(self.record_key(key))
            .query_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend("get", e))?;
        decode::record(&v, key.hash())
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        let mut out = Vec::new();
        let mut cursor = 0;
        loop {
            let (next, keys) = self.scan_step("list", cursor).await?;
            out.extend(self.fetch("list", &keys).await?.into_iter().filter(|r| {
                filter.scope.as_deref().is_none_or(|s| s == r.scope)
                    && filter.state.is_none_or(|s| s == r.state)
            }));
            if next == 0 {
                break;
            }
            cursor = next;
        }
        out.sort_by_key(|r| std::cmp::Reverse(r.updated_at));
        out.dedup_by_key(|r| r.key_hash);
        out.truncate(filter.limit);
        Ok(out)
    }

    async fn count(&self, scope: Option<&str>) -> Result<Counts, StoreError> {
        let now: Timestamp = self.now().await?;
        let mut seen = std::collections::HashSet::new();
        let mut counts = Counts::default();
        let mut cursor = 0;
        loop {
            let (next, keys) = self.scan_step("count", cursor).await?;
            for r in self.fetch("count", &keys).await? {
                if scope.is_none_or(|s| s == r.scope) && seen.insert(r.key_hash) {
                    counts.add(r.state, 1);
                    counts.expired += u64::from(r.is_expired_at(now));
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        Ok(counts)
    }

    async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let n: i64 = self
            .scripts
            .force_release
            .key(self.record_key(key))
            .arg(self.offset_us())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend("force_release", e))?;
        Ok(n == 1)
    }

    async fn force_fail(&self, key: &DedupKey, reason: &str) -> Result<bool, StoreError> {
        StoreError::check_len("reason", reason.len(), MAX_RESULT_BYTES)?;
        let n: i64 = self
            .scripts
            .force_fail
            .key(self.record_key(key))
            .arg(reason.as_bytes())
            .arg(self.offset_us())
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(|e| backend("force_fail", e))?;
        Ok(n == 1)
    }
}
