//! Waiting for replicas after each write ([`RedisStoreBuilder::wait_for_replicas`]).
//!
//! [`RedisStoreBuilder::wait_for_replicas`]: super::RedisStoreBuilder::wait_for_replicas

use std::time::Duration;

use idem_core::StoreError;

use super::{RedisStore, backend, coalesce, decode};

/// `WAIT` after each write: at least `replicas` acknowledgements within `timeout`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Replication {
    pub(super) replicas: u32,
    pub(super) timeout: Duration,
}

impl RedisStore {
    /// With [`RedisStoreBuilder::wait_for_replicas`]: waits for a `WAIT` sent after this
    /// caller's write (one `WAIT` covers every earlier write on the connection, so concurrent
    /// callers share one: see [`coalesce::replicated`]).
    pub(super) async fn replicated(&self, op: &'static str) -> Result<(), StoreError> {
        if self.replication.is_none() {
            return Ok(());
        }
        coalesce::replicated(self, op).await
    }

    /// One `WAIT` on the namespace's master: an error when fewer replicas acknowledged.
    pub(crate) async fn wait_once(&self, op: &'static str) -> Result<(), StoreError> {
        let Some(r) = self.replication else { return Ok(()) };
        let ms = u64::try_from(r.timeout.as_millis()).unwrap_or(u64::MAX).max(1);
        let v = self
            .conn
            .on_slot_master(
                self.ns.key_prefix(),
                redis::cmd("WAIT").arg(r.replicas).arg(ms).clone(),
            )
            .await
            .map_err(|e| backend(op, e))?;
        let acked = decode::int_reply(&v, "WAIT reply")?;
        if acked < i64::from(r.replicas) {
            return Err(StoreError::backend(
                op,
                true,
                format!(
                    "Redis acknowledged the write on {acked} of the {} replicas asked for within \
                     {:?} (WAIT): it may be lost if the master fails now",
                    r.replicas, r.timeout
                ),
            ));
        }
        Ok(())
    }
}
