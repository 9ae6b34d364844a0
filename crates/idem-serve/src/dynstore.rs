//! Any store behind one object-safe trait, so the server's handlers are written once.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use idem_core::{
    Claim, ClaimRequest, Completion, Counts, DedupKey, DedupStore, FailKind, InspectStore, Lease,
    ListFilter, Record, StoreError,
};

pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// [`DedupStore`] + [`InspectStore`], boxed.
pub(crate) trait DynStore: Send + Sync + 'static {
    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Result<Vec<Claim>, StoreError>>;
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>>;
    fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> BoxFuture<'_, Result<Vec<Result<(), StoreError>>, StoreError>>;
    fn complete<'a>(
        &'a self,
        lease: Lease,
        result: Option<&'a [u8]>,
        retain_for: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn fail<'a>(
        &'a self,
        lease: Lease,
        kind: FailKind,
        reason: &'a str,
        retain_for: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn release(&self, lease: Lease) -> BoxFuture<'_, Result<(), StoreError>>;
    fn extend<'a>(
        &'a self,
        lease: &'a mut Lease,
        by: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn purge(&self, limit: usize) -> BoxFuture<'_, Result<u64, StoreError>>;
    fn check(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>>;
    fn get<'a>(&'a self, key: &'a DedupKey) -> BoxFuture<'a, Result<Option<Record>, StoreError>>;
    fn list<'a>(&'a self, filter: &'a ListFilter)
    -> BoxFuture<'a, Result<Vec<Record>, StoreError>>;
    fn count<'a>(&'a self, scope: Option<&'a str>) -> BoxFuture<'a, Result<Counts, StoreError>>;
    fn force_release<'a>(&'a self, key: &'a DedupKey) -> BoxFuture<'a, Result<bool, StoreError>>;
    fn force_fail<'a>(
        &'a self,
        key: &'a DedupKey,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
}

impl<S: DedupStore + InspectStore> DynStore for S {
    fn claim_many<'a>(
        &'a self,
        reqs: &'a [ClaimRequest],
    ) -> BoxFuture<'a, Result<Vec<Claim>, StoreError>> {
        Box::pin(DedupStore::claim_many(self, reqs))
    }
    fn claim<'a>(&'a self, req: &'a ClaimRequest) -> BoxFuture<'a, Result<Claim, StoreError>> {
        Box::pin(DedupStore::claim(self, req))
    }
    fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> BoxFuture<'_, Result<Vec<Result<(), StoreError>>, StoreError>> {
        Box::pin(DedupStore::complete_many(self, items))
    }
    fn complete<'a>(
        &'a self,
        lease: Lease,
        result: Option<&'a [u8]>,
        retain_for: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(DedupStore::complete(self, lease, result, retain_for))
    }
    fn fail<'a>(
        &'a self,
        lease: Lease,
        kind: FailKind,
        reason: &'a str,
        retain_for: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(DedupStore::fail(self, lease, kind, reason, retain_for))
    }
    fn release(&self, lease: Lease) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(DedupStore::release(self, lease))
    }
    fn extend<'a>(
        &'a self,
        lease: &'a mut Lease,
        by: Duration,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(DedupStore::extend(self, lease, by))
    }
    fn purge(&self, limit: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(DedupStore::purge(self, limit))
    }
    fn check(&self) -> BoxFuture<'_, Result<Vec<String>, StoreError>> {
        Box::pin(DedupStore::check(self))
    }
    fn get<'a>(&'a self, key: &'a DedupKey) -> BoxFuture<'a, Result<Option<Record>, StoreError>> {
        Box::pin(InspectStore::get(self, key))
    }
    fn list<'a>(
        &'a self,
        filter: &'a ListFilter,
    ) -> BoxFuture<'a, Result<Vec<Record>, StoreError>> {
        Box::pin(InspectStore::list(self, filter))
    }
    fn count<'a>(&'a self, scope: Option<&'a str>) -> BoxFuture<'a, Result<Counts, StoreError>> {
        Box::pin(InspectStore::count(self, scope))
    }
    fn force_release<'a>(&'a self, key: &'a DedupKey) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(InspectStore::force_release(self, key))
    }
    fn force_fail<'a>(
        &'a self,
        key: &'a DedupKey,
        reason: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(InspectStore::force_fail(self, key, reason))
    }
}
