//! What a handler is told about the delivery it runs for.

use std::sync::OnceLock;

use crate::DedupKey;

/// Per-delivery context handed to a handler.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) key: Option<DedupKey>,
    /// Derived from the key when first asked for (a hash most handlers never need).
    downstream_key: OnceLock<String>,
    pub(crate) attempt: u32,
    pub(crate) token: u64,
    pub(crate) took_over: bool,
}

impl Context {
    /// The context of a message without a key, processed without dedup.
    pub(crate) fn unkeyed() -> Self {
        Self { key: None, downstream_key: OnceLock::new(), attempt: 1, token: 0, took_over: false }
    }

    /// The context of a delivery holding `lease`.
    pub(crate) fn of(lease: &crate::Lease) -> Self {
        Self {
            downstream_key: OnceLock::new(),
            key: Some(lease.key().clone()),
            attempt: lease.attempt(),
            token: lease.token(),
            took_over: lease.took_over_expired(),
        }
    }

    /// The dedup key; `None` when the message had none and the policy processes it anyway.
    pub fn key(&self) -> Option<&DedupKey> {
        self.key.as_ref()
    }

    /// An idempotency key for calls to other services (a payment API), derived from the dedup key:
    /// the same on every attempt and redelivery, so the callee deduplicates a repeated call.
    pub fn downstream_key(&self) -> Option<&str> {
        let key = self.key.as_ref()?;
        Some(self.downstream_key.get_or_init(|| key.downstream_key()))
    }

    /// 1 on the first claim; more when an earlier attempt failed, was released or crashed.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The lease's fencing token (pass it to systems that can reject stale writers).
    pub fn fencing_token(&self) -> u64 {
        self.token
    }

    /// Whether an earlier attempt's lease ran out: its effect may have happened, so external
    /// calls must carry [`Context::downstream_key`].
    pub fn took_over_expired(&self) -> bool {
        self.took_over
    }
}
