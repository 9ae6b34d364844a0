//! The store contract every backend implements.

use std::error::Error as StdError;
use std::future::Future;
use std::time::Duration;

use crate::{Claim, ClaimRequest, DedupKey, FailKind, Lease, Record, RecordState};

/// Errors from a store. Outcomes (duplicate, conflict, in progress) are [`Claim`] values, not
/// errors; these are failures to reach a decision.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The lease's fencing token no longer matches: the lease expired and another consumer took
    /// the key over, or an operator released it. Nothing was changed.
    #[error("lease on {key} was lost: the key was taken over or released since it was claimed")]
    LeaseLost {
        /// The key, as `scope/id`.
        key: String,
    },
    /// A value is larger than the store accepts.
    #[error("{field} is {len} bytes, longer than the store's limit of {limit} bytes")]
    TooLarge {
        /// What was too large (`"result"`, `"reason"`).
        field: &'static str,
        /// Its size in bytes.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// A row read back does not decode (wrong hash length, unknown state code).
    #[error("store returned a malformed record: {what}")]
    Corrupt {
        /// What did not decode.
        what: String,
    },
    /// The store's table is missing, or lacks columns it needs: it was not created (or not by
    /// this version's migration). Found by [`DedupStore::check`] before a consumer starts.
    #[error(
        "table {table} {problem}: run {migrate} once (or apply the DDL it runs) before starting \
         a consumer"
    )]
    NotMigrated {
        /// The table, as the database names it (`"idem"."idem_records"`).
        table: String,
        /// What is wrong (`does not exist`, `lacks the columns …`).
        problem: String,
        /// The call that creates it (`PostgresStore::migrate()`).
        migrate: &'static str,
    },
    /// The backend failed (connection, I/O, SQL error).
    #[error("store operation `{op}` failed")]
    Backend {
        /// The operation that failed (`"claim"`, `"complete"`, …).
        op: &'static str,
        /// Whether trying again may succeed (a deadlock, a busy database, a lost connection).
        retryable: bool,
        /// The driver's error.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
}

impl StoreError {
    /// Wraps a driver error.
    pub fn backend(
        op: &'static str,
        retryable: bool,
        source: impl Into<Box<dyn StdError + Send + Sync>>,
    ) -> Self {
        Self::Backend { op, retryable, source: source.into() }
    }

    /// The same failure again, for each caller of a batch that failed as a whole (driver errors
    /// are not `Clone`): the kind, retryability and message are kept, the source becomes text.
    #[must_use]
    pub fn copy_for(&self, op: &'static str) -> Self {
        match self {
            Self::LeaseLost { key } => Self::LeaseLost { key: key.clone() },
            Self::TooLarge { field, len, limit } => {
                Self::TooLarge { field, len: *len, limit: *limit }
            }
            Self::Corrupt { what } => Self::Corrupt { what: what.clone() },
            Self::NotMigrated { table, problem, migrate } => {
                Self::NotMigrated { table: table.clone(), problem: problem.clone(), migrate }
            }
            other => Self::backend(op, other.is_retryable(), format!("batched {op}: {other:#}")),
        }
    }

    /// [`StoreError::TooLarge`] when `len` exceeds `limit`: the size check every store makes
    /// before writing a result or reason.
    ///
    /// # Errors
    /// `TooLarge` naming `field` and the limit.
    pub fn check_len(field: &'static str, len: usize, limit: usize) -> Result<(), Self> {
        if len > limit { Err(Self::TooLarge { field, len, limit }) } else { Ok(()) }
    }

    /// Whether the operation may succeed if tried again.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Backend { retryable: true, .. })
    }
}

/// A dedup store: the arbiter of every race between deliveries of one key.
///
/// # Contract
/// - **Atomic per key.** `claim` is one atomic conditional write (unique constraint,
///   `INSERT … ON CONFLICT`, `SET NX`, a script); never a read followed by a write. Of any number
///   of concurrent claims of one key, at most one returns [`Claim::Acquired`].
/// - **Fenced.** Every claim gets a fencing token that strictly increases per key. `complete`,
///   `fail`, `release` and `extend` succeed only while the lease's token is the key's latest;
///   otherwise they fail with [`StoreError::LeaseLost`] and change nothing. A lease that ran out
///   but was not taken over may still complete.
/// - **Whose clock.** Lease ends and expiries are measured by the store's clock (the database or
///   Redis server's, or the [`Clock`](crate::time::Clock) an embedded store was given), never by
///   comparing consumer clocks.
/// - **Takeover.** A claim on an in-progress record whose lease ran out, or on a released or
///   failed record, acquires it with `attempt + 1`; [`Lease::previous`] says what it took over.
///   A claim on an expired record (retention passed) starts afresh at attempt 1. A request
///   without takeover ([`ClaimRequest::without_takeover`]) leaves an in-progress record whose
///   lease ran out as it is and answers [`Claim::InProgress`] with a zero `retry_after` and the
///   holder's attempt; released and failed records it claims as usual.
/// - **Conflict first.** When both the stored and the requested fingerprint are present and
///   differ, the claim answers [`Claim::Conflict`] whatever the record's state (unless expired).
/// - **Scoped.** Keys are `(scope, id)`; scopes never see each other's records.
///
/// `MemoryStore` is the reference implementation; the conformance suite in `idem-testkit` checks
/// every store against this contract.
pub trait DedupStore: Send + Sync + 'static {
    /// Atomically claims a key.
    ///
    /// # Errors
    /// [`StoreError::Backend`] when the store cannot be reached or the write fails.
    ///
    /// # Cancel safety
    /// Not cancel safe: if the future is dropped after the store applied the claim, the lease is
    /// lost with it, and the key stays in progress until the lease runs out.
    fn claim(&self, req: &ClaimRequest) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Claims a batch in one round trip where the store can, as **one atomic step**: answers
    /// are in request order, all decided at one instant during the call, each the one a single
    /// claim of that request would give after the batch's earlier requests. No other operation
    /// (a claim, a completion, an operator's `force_*`, a purge) lands between two of its
    /// requests. A key that repeats inside the batch is decided in order: the first occurrence
    /// may acquire it, later ones then see it in progress, or in conflict when their
    /// fingerprint differs (carrying the record that acquisition wrote).
    ///
    /// Stores without a transaction across keys apply a batch **atomically per key**: Cosmos
    /// DB keeps each key in its own partition, so a key's requests are decided together by one
    /// conditional write and the keys one after another within the call.
    ///
    /// # Errors
    /// As [`DedupStore::claim`]. A batch that fails acquired none of its keys (one transaction
    /// or script), unless the error hid a commit that did happen (the answer was lost); on a
    /// store atomic per key it may have acquired some. Leases lost with an error run out by
    /// themselves, as a lost single claim's does.
    ///
    /// # Cancel safety
    /// As [`DedupStore::claim`].
    fn claim_many(
        &self,
        reqs: &[ClaimRequest],
    ) -> impl Future<Output = Result<Vec<Claim>, StoreError>> + Send;

    /// Marks the key completed with its result and keeps it for `retain_for` (from now).
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when the fencing token is stale (nothing changes);
    /// [`StoreError::TooLarge`] when the result exceeds the store's limit; backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: if dropped, the completion either happened or did not; a later
    /// delivery sees a duplicate, or takes the key over after the lease.
    fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Completes many leases in one round trip and one commit where the store can (group
    /// commit); answers are in input order, each as [`DedupStore::complete`] would answer it.
    /// The default completes one at a time.
    ///
    /// # Errors
    /// The outer error when the batch as a whole failed (nothing of it applied on stores that
    /// batch; on the default, the completions before the failure did apply).
    ///
    /// # Cancel safety
    /// As [`DedupStore::complete`].
    fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> impl Future<Output = Result<Vec<Result<(), StoreError>>, StoreError>> + Send {
        async move {
            let mut out = Vec::with_capacity(items.len());
            for c in items {
                out.push(self.complete(c.lease, c.result.as_deref(), c.retain_for).await);
            }
            Ok(out)
        }
    }

    /// Whether [`complete_and_claim`](Self::complete_and_claim) sends its completions and claims
    /// in one write (one round trip). When it does, a pipelined consumer holds the claims it
    /// takes ahead for the next completion to carry them. Default `false`.
    fn combines_writes(&self) -> bool {
        false
    }

    /// Records `items` as [`complete_many`](Self::complete_many) does and claims `reqs` (other
    /// keys) as [`claim_many`](Self::claim_many) does, in one call: each half answers as that
    /// method would, and neither waits for the other's answer to be applied. A store that can
    /// send both in one write overrides this and [`combines_writes`](Self::combines_writes);
    /// the default runs the two calls concurrently.
    ///
    /// # Errors
    /// Each half carries its own outer error, as its method would.
    ///
    /// # Cancel safety
    /// Not cancel safe, as [`claim_many`](Self::claim_many).
    fn complete_and_claim(
        &self,
        items: Vec<Completion>,
        reqs: &[ClaimRequest],
    ) -> impl Future<Output = CompleteAndClaim> + Send {
        async move { futures_util::future::join(self.complete_many(items), self.claim_many(reqs)).await }
    }

    /// Ends the lease without a result: permanently failed (re-claimable, so a dead-lettered
    /// message resubmitted later runs again) or parked in doubt (stays until an operator releases
    /// it). `reason` is stored for operators.
    ///
    /// # Errors
    /// As [`DedupStore::complete`].
    ///
    /// # Cancel safety
    /// As [`DedupStore::complete`].
    fn fail(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Gives the key back at once (transient failure) so the next delivery re-claims it with
    /// `attempt + 1`.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when the token is stale; backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: if dropped, the key is released or stays leased until it expires.
    fn release(&self, lease: Lease) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Extends a live lease to `by` from now (store clock), for long handlers.
    ///
    /// # Errors
    /// [`StoreError::LeaseLost`] when the token is stale; backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: the lease keeps its old end if the extension did not apply.
    fn extend(
        &self,
        lease: &mut Lease,
        by: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Deletes at most `limit` expired records and returns how many it deleted. Never touches a
    /// record under a live lease or one younger than its retention; never blocks claims for
    /// longer than one bounded batch. Call it in a loop until it returns less than `limit`.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe.
    fn purge(&self, limit: usize) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Checks that the store can work as configured, before a consumer starts (the driver's
    /// `build` calls it): an error when it cannot — its table is missing
    /// ([`StoreError::NotMigrated`], naming the migration to run), the server cannot be
    /// reached — and, when it can, the problems that weaken a guarantee without stopping it
    /// (durability settings, a key column of the wrong type), which the store also logs.
    /// Default: nothing to check.
    ///
    /// # Errors
    /// [`StoreError::NotMigrated`] and backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    fn check(&self) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send {
        async { Ok(Vec::new()) }
    }
}

/// What [`DedupStore::complete_and_claim`] answers: the completions' answers as
/// [`DedupStore::complete_many`] gives them, and the claims as [`DedupStore::claim_many`] does.
pub type CompleteAndClaim =
    (Result<Vec<Result<(), StoreError>>, StoreError>, Result<Vec<Claim>, StoreError>);

/// One completion of a [`DedupStore::complete_many`] batch.
#[derive(Debug)]
pub struct Completion {
    /// The lease to complete.
    pub lease: Lease,
    /// The result to store.
    pub result: Option<Vec<u8>>,
    /// How long to keep the record from now.
    pub retain_for: Duration,
}

/// Which records [`InspectStore::list`] returns.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ListFilter {
    /// Only this scope, matched byte for byte (see [`InspectStore`]).
    pub scope: Option<String>,
    /// Only this state.
    pub state: Option<RecordState>,
    /// At most this many, newest first.
    pub limit: usize,
}

impl ListFilter {
    /// All records, at most `limit`.
    pub fn new(limit: usize) -> Self {
        Self { scope: None, state: None, limit }
    }

    /// Only records of `scope`.
    #[must_use]
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }

    /// Only records in `state`.
    #[must_use]
    pub fn state(mut self, state: RecordState) -> Self {
        self.state = Some(state);
        self
    }
}

/// Record counts by state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counts {
    /// Claimed, lease live or not.
    pub in_progress: u64,
    /// Completed.
    pub completed: u64,
    /// Released.
    pub released: u64,
    /// Failed permanently.
    pub failed: u64,
    /// Parked in doubt.
    pub in_doubt: u64,
    /// Of all the above, how many have expired and await purge.
    pub expired: u64,
}

impl Counts {
    /// Adds one record in `state`.
    pub fn add(&mut self, state: RecordState, n: u64) {
        match state {
            RecordState::InProgress => self.in_progress += n,
            RecordState::Completed => self.completed += n,
            RecordState::Released => self.released += n,
            RecordState::Failed => self.failed += n,
            RecordState::InDoubt => self.in_doubt += n,
        }
    }

    /// All records.
    pub fn total(&self) -> u64 {
        self.in_progress + self.completed + self.released + self.failed + self.in_doubt
    }
}

/// Operator access to a store: look at, count and release records. A separate capability from
/// [`DedupStore`] so consumers need not be given it.
///
/// A scope filter matches the scope byte for byte, as keys are matched: scopes differing only
/// by case or a trailing space are counted and listed apart, whatever the database's collation.
pub trait InspectStore: Send + Sync {
    /// The record for `key`, if any.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    fn get(
        &self,
        key: &DedupKey,
    ) -> impl Future<Output = Result<Option<Record>, StoreError>> + Send;

    /// Records matching `filter`, most recently updated first.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    fn list(
        &self,
        filter: &ListFilter,
    ) -> impl Future<Output = Result<Vec<Record>, StoreError>> + Send;

    /// Counts by state, of one scope or of all.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe (read only).
    fn count(&self, scope: Option<&str>)
    -> impl Future<Output = Result<Counts, StoreError>> + Send;

    /// Operator release: whatever its state, the record becomes released and its token moves on,
    /// so a consumer still holding a lease is fenced out and the next delivery runs the handler
    /// again. Returns whether a record existed.
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: the record was released or it was not.
    fn force_release(
        &self,
        key: &DedupKey,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Operator failure, for a record parked in doubt whose effect the operator has checked:
    /// unless it is completed, the record becomes [`RecordState::Failed`] with `reason` stored as
    /// its result, and its token moves on as in [`InspectStore::force_release`], so a consumer
    /// still holding a lease is fenced out. A failed record is re-claimable: a resubmitted
    /// message runs the handler again. Its expiry is unchanged. A completed record is left
    /// alone, in the same atomic write (its effect happened: failing it would let a resubmission
    /// repeat it; [`force_release`](InspectStore::force_release) is the deliberate way).
    /// Returns whether a record was failed: `false` when absent or completed.
    ///
    /// # Errors
    /// [`StoreError::TooLarge`] when `reason` exceeds the store's limit (nothing changes);
    /// backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe in effect: the record was failed or it was not.
    fn force_fail(
        &self,
        key: &DedupKey,
        reason: &str,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;
}
