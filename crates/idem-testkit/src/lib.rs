//! Test support for idem stores and adapters.
//!
//! - [`dedup_store_conformance!`]: one macro that runs the whole store contract
//!   ([`idem_core::DedupStore`] + [`idem_core::InspectStore`]) against a store.
//! - [`tx_inbox_conformance!`]: the transactional-inbox contract ([`idem_core::inbox::TxInbox`]
//!   and the consumer backend every broker adapter drives), against each SQL inbox.
//! - `source_conformance!` (feature `source`): the broker-source contract ([`idem_core::consumer::Source`] through
//!   the driver): every mode through the same builder calls on a real broker.
//! - [`outbox_conformance!`]: the outbox-store contract ([`idem_core::outbox::OutboxStore`]):
//!   leases, fencing, ordering keys, retries and parking, purge.
//! - `crash_conformance!` (feature `source`): the crash suite every broker adapter runs —
//!   abort between commit and ack, SIGKILL mid-handler, a connection cut mid-handler — in inbox
//!   and two-phase mode, over the same harness as the source suite plus [`crash::CrashHarness`].
//! - `publisher_conformance!` (feature `source`): the outbox-publisher contract
//!   ([`idem_core::outbox::Publisher`]) on a real broker, read back through the same crate's source.
//! - [`linearize`]: a linearizability checker (Wing–Gong search, memoised) and the sequential
//!   model of the store contract; [`linearize::check_store`] runs seeded concurrent histories
//!   against a real store and checks each one.
//! - [`netns`] and [`proxy`]: network namespaces as test hosts, cut from their servers and
//!   healed, and a TCP proxy that stalls, delays or closes connections (network partitions).
//! - [`service`]: finds the real servers integration tests need, and refuses to let a suite pass
//!   silently without them under `CI=true`; [`tls`]: the test PKI of the TLS listeners.

#[cfg(feature = "source")]
pub mod bare;
pub mod cases;
#[cfg(feature = "source")]
pub mod crash;
#[cfg(feature = "source")]
pub mod dlq;
pub mod faults;
pub mod inbox;
pub mod linearize;
pub mod netns;
pub mod outbox;
pub mod positions;
#[cfg(feature = "source")]
pub mod process;
pub mod proxy;
#[cfg(feature = "source")]
pub mod publisher;
pub mod service;
#[cfg(feature = "source")]
pub mod source;
pub mod tls;
mod wait;
pub mod workload;

pub use wait::wait_for;

use std::future::Future;
use std::time::Duration;

use idem_core::time::ManualClock;

/// Moves a store's clock forward.
pub trait TimeControl: Send + Sync {
    /// Returns once the store's clock reads at least `d` later than when called.
    ///
    /// # Cancel safety
    /// Implementations must be: dropped, the clock has moved by at most `d`.
    fn advance(&self, d: Duration) -> impl Future<Output = ()> + Send;
}

impl TimeControl for ManualClock {
    async fn advance(&self, d: Duration) {
        ManualClock::advance(self, d);
    }
}

/// Paused tokio time (`#[tokio::test(start_paused = true)]`): advancing moves tokio's clock, which
/// a store on a [`TokioClock`](idem_core::time::TokioClock) reads.
impl TimeControl for idem_core::time::TokioClock {
    async fn advance(&self, d: Duration) {
        tokio::time::advance(d).await;
    }
}

/// A store on a server clock (PostgreSQL, MySQL, Redis) shifted by a [`ClockSkew`](idem_core::time::ClockSkew).
impl TimeControl for idem_core::time::ClockSkew {
    async fn advance(&self, d: Duration) {
        idem_core::time::ClockSkew::advance(self, d);
    }
}

/// A store under test, the control of its clock, and the time unit its cases use (leases are a
/// few units long).
pub struct Harness<S, C> {
    /// The store.
    pub store: S,
    /// Its clock.
    pub time: C,
    /// One unit of lease time.
    pub unit: Duration,
    guard: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl<S, C> Harness<S, C> {
    /// A harness with an explicit time unit.
    pub fn new(store: S, time: C, unit: Duration) -> Self {
        Self { store, time, unit, guard: None }
    }

    /// Keeps `guard` (a temporary directory, a schema dropper) alive until the case ends, so
    /// each case cleans up after itself.
    #[must_use]
    pub fn with_guard(mut self, guard: impl std::any::Any + Send + Sync) -> Self {
        self.guard = Some(Box::new(guard));
        self
    }
}

impl<S> Harness<S, ManualClock> {
    /// A harness over a store that reads `clock`, with a unit of 10 s of manual time.
    pub fn manual(store: S, clock: ManualClock) -> Self {
        Self::new(store, clock, Duration::from_secs(10))
    }
}

impl<S, C> std::fmt::Debug for Harness<S, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Harness").field("unit", &self.unit).finish_non_exhaustive()
    }
}

/// Runs every conformance case against a store.
///
/// The argument is a closure returning a future that yields a fresh [`Harness`] (its own table,
/// schema or prefix) for each case. The calling crate needs `tokio` (macros, multi-thread
/// runtime) as a dev-dependency.
///
/// ```no_run
/// idem_testkit::dedup_store_conformance!(|| async {
///     let clock = idem_core::time::ManualClock::new();
///     idem_testkit::Harness::manual(idem_core::MemoryStore::with_clock(clock.clone()), clock)
/// });
/// ```
///
/// With `paused:` before the closure the cases run on a current-thread runtime with tokio time
/// paused (`start_paused = true`), for stores whose clock is a `TokioClock`.
///
/// With `server:` before the closure, the future yields `Option<Harness>`: `None` means the
/// server is unreachable and the case is skipped (build it with [`service::require`], which has
/// already printed `skipped: …`, or panicked under `CI=true`).
///
/// ```no_run
/// idem_testkit::dedup_store_conformance!(server: || async {
///     let _url = idem_testkit::service::require("postgres", "IDEM_TEST_POSTGRES_URL",
///         "postgres://postgres@127.0.0.1:5432/test")?;
///     let clock = idem_core::time::ManualClock::new();
///     Some(idem_testkit::Harness::manual(idem_core::MemoryStore::with_clock(clock.clone()), clock))
/// });
/// ```
#[macro_export]
macro_rules! dedup_store_conformance {
    (paused: $make:expr) => {
        $crate::dedup_store_conformance!(@cases (start_paused = true) some $make);
    };
    (server: $make:expr) => {
        $crate::dedup_store_conformance!(@cases (flavor = "multi_thread", worker_threads = 2) optional $make);
    };
    ($make:expr) => {
        $crate::dedup_store_conformance!(@cases (flavor = "multi_thread", worker_threads = 2) some $make);
    };
    (@cases $rt:tt $mode:ident $make:expr) => {
        $crate::__conformance_cases!($rt $mode $make;
            claim_is_exclusive,
            concurrent_claims_have_one_winner,
            completed_is_duplicate_with_result,
            release_allows_reclaim,
            expired_lease_is_taken_over,
            deaths_count_only_expired_takeovers,
            a_claim_without_takeover_leaves_an_expired_lease,
            live_lease_is_not_taken_over,
            stale_lease_cannot_complete_or_release,
            fencing_tokens_strictly_increase,
            extend_keeps_the_lease,
            fingerprint_mismatch_is_conflict,
            missing_fingerprint_never_conflicts,
            scopes_isolate,
            purge_removes_only_expired,
            purge_is_bounded,
            expired_record_is_claimed_afresh,
            claim_many_in_order_with_repeats,
            claim_many_mixed_states_match_single_claims,
            claim_many_distinct_mixed_states,
            claim_many_large_batch,
            complete_many_tells_a_spent_lease_it_is_lost,
            complete_and_claim_answers_both_halves,
            failed_is_reclaimable_in_doubt_is_not,
            force_release_fences_the_holder,
            force_fail_fences_the_holder,
            inspect_counts_and_lists,
            inspect_scope_filter_is_exact,
            oversized_result_is_refused,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($rt:tt some $make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test $rt]
            async fn $name() {
                let harness = ($make)().await;
                $crate::cases::$name(harness).await;
            }
        )+
    };
    ($rt:tt optional $make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test $rt]
            async fn $name() {
                let Some(harness) = ($make)().await else { return };
                $crate::cases::$name(harness).await;
            }
        )+
    };
}
