//! Engine configuration: one set of settings, for an [`Engine`] built on its own or for a
//! broker consumer's engine (the consumer builder forwards every setting here).

use std::sync::Arc;
use std::time::Duration;

use super::Engine;
use crate::extract::{KeyExtractor, MessageId};
use crate::retention::{RedeliveryWindow, RetentionTooShort};
use crate::{DEFAULT_MAX_KEY_BYTES, DedupKey, FingerprintSpec, KeyError};

/// What to do with a message that carries no key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissingKeyPolicy {
    /// Fail it permanently (dead-letter). The default: a message that cannot be deduplicated is
    /// an error of the producer.
    #[default]
    Reject,
    /// Run the handler without deduplication and count it in `idem_missing_key_total`.
    ProcessWithoutDedup,
}

/// What to do when a claim takes over a lease that ran out (a consumer crashed or stalled
/// mid-effect, so the effect may or may not have happened).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ExpiredLeasePolicy {
    /// Run the handler again with the next attempt number and the same downstream idempotency
    /// key, so an external callee deduplicates the repeated call. The default.
    #[default]
    Rerun,
    /// Park the key as in doubt, fail the delivery permanently and let an operator decide.
    Park,
}

/// Invalid consumer configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// No scope was set.
    #[error("consumer scope is not set: call `.scope(\"<consumer name>\")`")]
    MissingScope,
    /// The scope is not a valid key scope (empty, longer than 512 bytes, or with a NUL byte).
    /// The message carries the key error's, naming the field and the limit; the key error is
    /// kept as the field, not as a `source()`, so a report does not print it twice.
    #[error("invalid consumer scope: {0}")]
    InvalidScope(KeyError),
    /// A duration must be positive.
    #[error("{field} must be longer than zero")]
    ZeroDuration {
        /// The setting (`"lease"`, `"retain"`).
        field: &'static str,
    },
    /// A count must be at least one.
    #[error("{field} must be at least 1 (u32::MAX turns it off)")]
    ZeroLimit {
        /// The setting (`"crash_loop_limit"`).
        field: &'static str,
    },
    /// Retention shorter than the broker's redelivery window.
    #[error(transparent)]
    Retention(#[from] RetentionTooShort),
}

pub(crate) struct Config {
    pub(crate) scope: String,
    pub(crate) lease: Duration,
    pub(crate) retain: Duration,
    pub(crate) heartbeat: Option<Duration>,
    pub(crate) extractor: Box<dyn KeyExtractor>,
    pub(crate) fingerprint: FingerprintSpec,
    pub(crate) missing_key: MissingKeyPolicy,
    pub(crate) expired_lease: ExpiredLeasePolicy,
    pub(crate) crash_loop_limit: u32,
    pub(crate) max_key_bytes: usize,
    pub(crate) max_result_bytes: usize,
    pub(crate) complete_retry: Duration,
    pub(crate) store_timeout: Duration,
}

/// The longest a store call, or an inbox batch's whole transaction, may take (see
/// [`EngineBuilder::store_timeout`]).
pub(crate) const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(120);

/// How many holders of a key may die holding it (their lease ran out) before the engine
/// dead-letters it as a crash loop (see [`EngineBuilder::crash_loop_limit`]).
pub const DEFAULT_CRASH_LOOP_LIMIT: u32 = 5;

/// Builds an [`Engine`]. Only the scope is required.
///
/// Defaults: lease 30 s, retention 7 days, key from the producer's message id, fingerprint of
/// the canonical JSON payload (raw bytes if it is not JSON), reject messages without a key, rerun
/// after an expired lease, keys up to 512 bytes, stored results up to 64 KiB, completions
/// retried for up to 5 s when the store fails.
///
/// ```
/// use std::time::Duration;
/// use idem_core::{Engine, MemoryStore};
///
/// let engine = Engine::builder(MemoryStore::new())
///     .scope("billing")
///     .lease(Duration::from_secs(60))
///     .heartbeat(Duration::from_secs(20))
///     .build()?;
/// assert_eq!(engine.scope(), "billing");
/// # Ok::<(), idem_core::engine::ConfigError>(())
/// ```
#[must_use]
pub struct EngineBuilder<S> {
    store: S,
    settings: Settings,
}

/// Every engine setting but the store: what [`EngineBuilder`] and a broker consumer's builder
/// hold until the engine is built.
pub(crate) struct Settings {
    pub(crate) scope: Option<String>,
    pub(crate) lease: Duration,
    pub(crate) retain: Duration,
    pub(crate) window: Option<RedeliveryWindow>,
    pub(crate) heartbeat: Option<Duration>,
    pub(crate) extractor: Box<dyn KeyExtractor>,
    pub(crate) fingerprint: FingerprintSpec,
    pub(crate) missing_key: MissingKeyPolicy,
    pub(crate) expired_lease: ExpiredLeasePolicy,
    pub(crate) crash_loop_limit: u32,
    pub(crate) max_key_bytes: usize,
    pub(crate) max_result_bytes: usize,
    pub(crate) complete_retry: Duration,
    pub(crate) store_timeout: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            scope: None,
            lease: Duration::from_secs(30),
            retain: Duration::from_secs(7 * 86_400),
            window: None,
            heartbeat: None,
            extractor: Box::new(MessageId),
            fingerprint: FingerprintSpec::default(),
            missing_key: MissingKeyPolicy::default(),
            expired_lease: ExpiredLeasePolicy::default(),
            crash_loop_limit: DEFAULT_CRASH_LOOP_LIMIT,
            max_key_bytes: DEFAULT_MAX_KEY_BYTES,
            max_result_bytes: 64 * 1024,
            complete_retry: Duration::from_secs(5),
            store_timeout: DEFAULT_STORE_TIMEOUT,
        }
    }
}

/// The setters of every engine setting, on a type holding [`Settings`]: written once, for
/// [`EngineBuilder`] and the broker consumer's builder.
macro_rules! engine_setters {
    ($settings:ident) => {
        /// The consumer's identity (a consumer group, a handler name). Required.
        pub fn scope(mut self, scope: impl Into<String>) -> Self {
            self.$settings.scope = Some(scope.into());
            self
        }

        /// How long a claim holds a key before another delivery may take it over (two-phase
        /// mode, and inbox mode's crash notes of redelivered messages; default 30 s). Make it
        /// longer than the slowest handler, or set a [`heartbeat`](Self::heartbeat) (two-phase).
        pub fn lease(mut self, lease: std::time::Duration) -> Self {
            self.$settings.lease = lease;
            self
        }

        /// How long completed records are kept (two-phase mode; default 7 days). Must outlast
        /// the broker's redelivery window. An inbox keeps its markers for its own retention.
        pub fn retain(mut self, retain: std::time::Duration) -> Self {
            self.$settings.retain = retain;
            self
        }

        /// Checks when the engine is built that the retention (the store's, or the inbox's
        /// own) covers this redelivery window.
        pub fn redelivery_window(mut self, window: $crate::RedeliveryWindow) -> Self {
            self.$settings.window = Some(window);
            self
        }

        /// Extends the lease every `interval` while the handler runs (for long handlers). A
        /// handler that hangs then holds the key for as long as it hangs.
        pub fn heartbeat(mut self, interval: std::time::Duration) -> Self {
            self.$settings.heartbeat = Some(interval);
            self
        }

        /// Where the key comes from (default: the producer's message id).
        pub fn key(mut self, extractor: impl $crate::extract::KeyExtractor) -> Self {
            self.$settings.extractor = Box::new(extractor);
            self
        }

        /// How payloads are fingerprinted.
        pub fn fingerprint(mut self, spec: $crate::FingerprintSpec) -> Self {
            self.$settings.fingerprint = spec;
            self
        }

        /// What to do with messages that carry no key.
        pub fn missing_key(mut self, policy: $crate::engine::MissingKeyPolicy) -> Self {
            self.$settings.missing_key = policy;
            self
        }

        /// What to do when a claim takes over an expired lease.
        pub fn on_expired_lease(mut self, policy: $crate::engine::ExpiredLeasePolicy) -> Self {
            self.$settings.expired_lease = policy;
            self
        }

        /// How many attempts of one key may end with their lease running out (the process
        /// died, was killed or hung while the handler ran) before the key is dead-lettered as a
        /// crash loop instead of run again (default 5). A message
        /// that aborts the process never returns an error, so no broker counts it; the store
        /// does: each claim that takes over a lease that ran out counts a death
        /// ([`Lease::deaths`](crate::Lease::deaths)). When a takeover brings a key's deaths to
        /// the limit, the record is failed with the reason, so a resubmission runs again.
        /// Only deaths count: a transient failure, a claim taken ahead and given back (a
        /// rebalance, a shutdown) or a failed push releases the key, and a handler that runs
        /// long in a live process keeps its lease with a [`heartbeat`](Self::heartbeat). A
        /// process stalled past its lease (a VM pause, `SIGSTOP`) is a death: nobody else can
        /// tell it from one.
        /// Takeovers of a batch run one at a time after the rest of the batch, so a message
        /// that kills the process does not take its batch's other messages with it again.
        /// Inbox mode: a message the broker flags as a redelivery
        /// ([`Envelope::redelivery`](crate::extract::Envelope::redelivery)) runs alone, after
        /// the rest of its batch, under a crash note — a two-phase claim of a key of its own
        /// with this [`lease`](Self::lease), taken outside the transaction — so a process that
        /// dies running it leaves a note that runs out, and the next run counts the death. A
        /// certain redelivery counts one death more (the first one, in the batch's transaction,
        /// leaves no trace: first deliveries write no note), so a message given back alive
        /// (a transient failure, a shutdown) that later kills the process is dead-lettered one
        /// death early. An inbox without notes (Cosmos DB without `CosmosInbox::crash_notes`)
        /// detects no crash loop.
        /// `u32::MAX` turns the check off. With
        /// [`ExpiredLeasePolicy::Park`](crate::engine::ExpiredLeasePolicy::Park) every takeover
        /// is parked first.
        pub fn crash_loop_limit(mut self, deaths: u32) -> Self {
            self.$settings.crash_loop_limit = deaths;
            self
        }

        /// The longest a store call (two-phase: claim, complete, fail, release) or an inbox
        /// batch's whole transaction (its marks, its handlers' statements, its commit) may take
        /// before it is given up as a transient failure (default 120 s). A
        /// connection cut by a network partition drops packets without a reset: without a bound
        /// a consumer would wait in its read until the kernel gives up (about 15 minutes) or for
        /// ever. Giving up is safe: an inbox transaction that did commit makes the redelivery a
        /// duplicate, one that did not leaves nothing; a two-phase call is answered as a store
        /// error (a completion is tried again with the same lease). Make it longer than the
        /// slowest inbox batch; `Duration::MAX` turns it off. Needs a Tokio runtime with timers
        /// (`enable_time`, or `enable_all`), as the heartbeat and completion retries do.
        pub fn store_timeout(mut self, limit: std::time::Duration) -> Self {
            self.$settings.store_timeout = limit;
            self
        }

        /// Longest key id accepted, in bytes.
        pub fn max_key_bytes(mut self, limit: usize) -> Self {
            self.$settings.max_key_bytes = limit;
            self
        }

        /// Largest serialized result stored for duplicates; a larger one is not stored (the
        /// duplicate then carries no result) and a warning is logged.
        pub fn max_result_bytes(mut self, limit: usize) -> Self {
            self.$settings.max_result_bytes = limit;
            self
        }

        /// How long a completion that failed for a retryable reason (the store restarting, a
        /// connection cut) is tried again before the delivery is given up as a transient
        /// failure. The effect has happened by then; a completion given up on leaves the key
        /// leased, so the redelivered copy waits for the lease to run out and runs the handler
        /// again. Default 5 s, and never more than half the lease. Zero turns the retries off.
        pub fn complete_retry(mut self, limit: std::time::Duration) -> Self {
            self.$settings.complete_retry = limit;
            self
        }
    };
}
pub(crate) use engine_setters;

impl<S> EngineBuilder<S> {
    pub(crate) fn new(store: S) -> Self {
        Self { store, settings: Settings::default() }
    }

    engine_setters!(settings);
}

impl<S: super::Backend> EngineBuilder<S> {
    /// Validates the configuration.
    ///
    /// # Errors
    /// [`ConfigError`] naming the bad setting.
    pub fn build(self) -> Result<Engine<S>, ConfigError> {
        self.settings.build(self.store)
    }
}

impl Settings {
    /// The engine over `store` with these settings.
    pub(crate) fn build<S: super::Backend>(self, store: S) -> Result<Engine<S>, ConfigError> {
        let scope = self.scope.ok_or(ConfigError::MissingScope)?;
        DedupKey::with_limit(scope.clone(), "x", DEFAULT_MAX_KEY_BYTES)
            .map_err(ConfigError::InvalidScope)?;
        if self.lease.is_zero() {
            return Err(ConfigError::ZeroDuration { field: "lease" });
        }
        if self.retain.is_zero() {
            return Err(ConfigError::ZeroDuration { field: "retain" });
        }
        if self.store_timeout.is_zero() {
            return Err(ConfigError::ZeroDuration { field: "store_timeout" });
        }
        if self.crash_loop_limit == 0 {
            return Err(ConfigError::ZeroLimit { field: "crash_loop_limit" });
        }
        let window = self.window;
        let engine = Engine {
            store,
            cfg: Arc::new(Config {
                scope,
                lease: self.lease,
                retain: self.retain,
                heartbeat: self.heartbeat,
                extractor: self.extractor,
                fingerprint: self.fingerprint,
                missing_key: self.missing_key,
                expired_lease: self.expired_lease,
                crash_loop_limit: self.crash_loop_limit,
                max_key_bytes: self.max_key_bytes,
                max_result_bytes: self.max_result_bytes,
                complete_retry: self.complete_retry.min(self.lease / 2),
                store_timeout: self.store_timeout,
            }),
            solo: Arc::default(),
            rides: Arc::default(),
        };
        if let Some(w) = window {
            w.check(S::retention(&engine))?;
        }
        Ok(engine)
    }
}
