//! `MemoryStore`: the reference implementation of the store contract, for tests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::claim::next_token;
use crate::claim_rule;
use crate::time::{Clock, SystemClock};
use crate::{
    Advance, Claim, ClaimRequest, Counts, DedupKey, DedupStore, FailKind, InspectStore, KeyHash,
    Lease, ListFilter, Record, RecordState, StoreError, Timestamp, VersionGuard,
};

/// Largest stored result or reason the in-memory store accepts.
pub const MAX_RESULT_BYTES: usize = 1 << 20;

/// An in-process store behind a mutex. Each operation is atomic because it holds the lock for its
/// whole read-decide-write. Nothing survives the process: use it in tests and examples, not to
/// deduplicate across restarts.
///
/// ```
/// use std::time::Duration;
/// use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, MemoryStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = MemoryStore::new();
/// let req = ClaimRequest::new(DedupKey::new("orders", "42").unwrap(), None,
///                             Duration::from_secs(30), Duration::from_secs(3600));
/// let Claim::Acquired(lease) = store.claim(&req).await.unwrap() else { panic!() };
/// store.complete(lease, Some(b"done"), Duration::from_secs(3600)).await.unwrap();
/// assert!(matches!(store.claim(&req).await.unwrap(), Claim::Completed(_)));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct MemoryStore {
    inner: Arc<Mutex<Inner>>,
    clock: Arc<dyn Clock>,
}

#[derive(Debug, Default)]
struct Inner {
    records: HashMap<KeyHash, Record>,
    versions: HashMap<KeyHash, i64>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(SystemClock)
    }

    /// An empty store reading `clock` (a `ManualClock` or `TokioClock` in tests).
    pub fn with_clock(clock: impl Clock) -> Self {
        Self { inner: Arc::default(), clock: Arc::new(clock) }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave a record half-written (each mutation is a
        // single insert or field assignment), so a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn claim_locked(inner: &mut Inner, req: &ClaimRequest, now: Timestamp) -> Claim {
        let hash = req.key.hash();
        let decision = claim_rule::apply(inner.records.get(&hash), req, now);
        if let Some(rec) = decision.write {
            inner.records.insert(hash, rec);
        }
        decision.claim
    }

    fn fenced<'a>(inner: &'a mut Inner, lease: &Lease) -> Result<&'a mut Record, StoreError> {
        match inner.records.get_mut(&lease.key().hash()) {
            Some(rec) if rec.token == lease.token() && rec.state == RecordState::InProgress => {
                Ok(rec)
            }
            _ => Err(StoreError::LeaseLost { key: lease.key().to_string() }),
        }
    }

    fn finish(
        &self,
        lease: &Lease,
        state: RecordState,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        StoreError::check_len("result", result.map_or(0, <[u8]>::len), MAX_RESULT_BYTES)?;
        let now = self.clock.now();
        let mut inner = self.lock();
        let rec = Self::fenced(&mut inner, lease)?;
        rec.state = state;
        rec.result = result.map(<[u8]>::to_vec);
        rec.updated_at = now;
        rec.lease_until = None;
        rec.expires_at = now.plus(retain_for);
        Ok(())
    }
}

impl DedupStore for MemoryStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let now = self.clock.now();
        Ok(Self::claim_locked(&mut self.lock(), req, now))
    }

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        let now = self.clock.now();
        let mut inner = self.lock();
        Ok(reqs.iter().map(|r| Self::claim_locked(&mut inner, r, now)).collect())
    }

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.finish(&lease, RecordState::Completed, result, retain_for)
    }

    async fn fail(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.finish(&lease, kind.state(), Some(reason.as_bytes()), retain_for)
    }

    async fn release(&self, lease: Lease) -> Result<(), StoreError> {
        let now = self.clock.now();
        let mut inner = self.lock();
        let rec = Self::fenced(&mut inner, &lease)?;
        rec.state = RecordState::Released;
        rec.updated_at = now;
        rec.lease_until = None;
        Ok(())
    }

    async fn extend(&self, lease: &mut Lease, by: Duration) -> Result<(), StoreError> {
        let now = self.clock.now();
        let mut inner = self.lock();
        let rec = Self::fenced(&mut inner, lease)?;
        let until = now.plus(by);
        rec.lease_until = Some(until);
        rec.expires_at = rec.expires_at.max(until);
        rec.updated_at = now;
        lease.set_until(until);
        Ok(())
    }

    async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        let now = self.clock.now();
        let mut inner = self.lock();
        let doomed: Vec<KeyHash> = inner
            .records
            .iter()
            .filter(|(_, r)| r.is_expired_at(now))
            .map(|(h, _)| *h)
            .take(limit)
            .collect();
        for h in &doomed {
            inner.records.remove(h);
        }
        Ok(doomed.len() as u64)
    }
}

impl InspectStore for MemoryStore {
    async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        Ok(self.lock().records.get(&key.hash()).cloned())
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        let inner = self.lock();
        let mut out: Vec<Record> = inner
            .records
            .values()
            .filter(|r| filter.scope.as_deref().is_none_or(|s| s == r.scope))
            .filter(|r| filter.state.is_none_or(|s| s == r.state))
            .cloned()
            .collect();
        out.sort_by_key(|r| std::cmp::Reverse(r.updated_at));
        out.truncate(filter.limit);
        Ok(out)
    }

    async fn count(&self, scope: Option<&str>) -> Result<Counts, StoreError> {
        let now = self.clock.now();
        let mut counts = Counts::default();
        for r in self.lock().records.values().filter(|r| scope.is_none_or(|s| s == r.scope)) {
            counts.add(r.state, 1);
            counts.expired += u64::from(r.is_expired_at(now));
        }
        Ok(counts)
    }

    async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let now = self.clock.now();
        let mut inner = self.lock();
        let Some(rec) = inner.records.get_mut(&key.hash()) else { return Ok(false) };
        rec.state = RecordState::Released;
        rec.token = next_token(Some(rec.token), now);
        rec.lease_until = None;
        rec.updated_at = now;
        Ok(true)
    }

    async fn force_fail(&self, key: &DedupKey, reason: &str) -> Result<bool, StoreError> {
        StoreError::check_len("reason", reason.len(), MAX_RESULT_BYTES)?;
        let now = self.clock.now();
        let mut inner = self.lock();
        let Some(rec) = inner.records.get_mut(&key.hash()) else { return Ok(false) };
        if rec.state == RecordState::Completed {
            return Ok(false);
        }
        rec.state = RecordState::Failed;
        rec.result = Some(reason.as_bytes().to_vec());
        rec.token = next_token(Some(rec.token), now);
        rec.lease_until = None;
        rec.updated_at = now;
        Ok(true)
    }
}

impl VersionGuard for MemoryStore {
    async fn advance(&self, entity: &DedupKey, version: i64) -> Result<Advance, StoreError> {
        let mut inner = self.lock();
        let slot = inner.versions.entry(entity.hash());
        Ok(match slot {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                let current = *e.get();
                if version > current {
                    e.insert(version);
                    Advance::Applied
                } else {
                    Advance::Stale { current }
                }
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(version);
                Advance::Applied
            }
        })
    }
}
