//! The claim API's JSON bodies, shared by the server and [`RemoteStore`](crate::RemoteStore).
//!
//! Times are milliseconds (`*_ms`) for durations and microseconds since the Unix epoch (`*_us`,
//! the store's clock) for instants. Fencing tokens are decimal strings: they exceed what a
//! JavaScript number holds exactly. Results travel as `result` (UTF-8 text) or, when the bytes
//! are not UTF-8, `result_base64`.

use std::time::Duration;

use base64::Engine as _;
use idem_core::{Claim, DedupKey, FailKind, Fingerprint, Lease, Record, RecordState, Timestamp};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;
pub use crate::error::Problem;

/// Default lease when a claim names none: 30 s.
pub const DEFAULT_LEASE_MS: u64 = 30_000;
/// Default retention when a claim or completion names none: 7 days.
pub const DEFAULT_RETAIN_MS: u64 = 7 * 86_400_000;
/// The longest lease a claim may ask for: 24 hours.
pub const MAX_LEASE_MS: u64 = 86_400_000;
/// The longest retention: 400 days.
pub const MAX_RETAIN_MS: u64 = 400 * 86_400_000;
/// Claims in one `POST /v1/claims/batch`, and completions in one `POST /v1/complete/batch`.
pub const MAX_BATCH: usize = 1000;
/// The longest result or reason the API carries (stores keep less: 1 MiB on most); longer ones
/// are refused with `413 too_large` before they reach the store.
pub const MAX_RESULT_BYTES: usize = 4 << 20;
/// The largest request body the server reads: 8 MiB (a batch of results, base64 included).
pub const MAX_BODY_BYTES: usize = 8 << 20;
/// Records one `GET /v1/records` returns at most.
pub const MAX_LIST: usize = 1000;

/// `POST /v1/claims`: claim a key before running its effect.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimBody {
    /// The consumer's identity (e.g. `payments`); the token must be allowed it.
    pub scope: String,
    /// The message's identity within the scope (a message id, an order number).
    pub key: String,
    /// SHA-256 of the payload, 64 hex digits: a later claim of the key with another fingerprint
    /// is a conflict. Give this or `payload`, or neither (never a conflict).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// The payload itself, fingerprinted by the server (SHA-256 of its UTF-8 bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<String>,
    /// How long the lease lasts before another caller may take the key over (1 ms to 24 h;
    /// default 30 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// How long the record is kept from the claim (default 7 days, at most 400 days).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retain_ms: Option<u64>,
    /// `false`: do not take over a lease that ran out; answer `in_progress` with
    /// `retry_after_ms` 0 instead, and change nothing (default `true`). A caller that claims
    /// several keys a crashed consumer held takes them over one at a time this way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub takeover: Option<bool>,
}

/// The answer to a claim: exactly one of four outcomes, in `outcome`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ClaimAnswer {
    /// The caller owns the key: run the effect, then `complete` (or `release`/`fail`) with the
    /// lease.
    Acquired {
        /// Proof of ownership; send it back with `complete`, `release`, `fail`, `extend`.
        lease: LeaseBody,
        /// A key for calls to other services (`Idempotency-Key`), the same on every attempt.
        downstream_key: String,
    },
    /// The key is done (completed, or parked in doubt): do not run the effect again; the stored
    /// result is in the record.
    Duplicate {
        /// The stored record.
        record: RecordBody,
    },
    /// Another caller holds a live lease: try again after `retry_after_ms`.
    InProgress {
        /// Time left on that lease.
        retry_after_ms: u64,
        /// The holder's attempt number.
        attempt: u32,
    },
    /// The key was claimed with a different fingerprint: same key, different content. Never
    /// run it; report it.
    Conflict {
        /// The stored record (its fingerprint is the other payload's).
        record: RecordBody,
    },
}

/// A lease, as the server hands it out and takes it back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LeaseBody {
    /// The key's scope.
    pub scope: String,
    /// The key.
    pub key: String,
    /// The fencing token (decimal): stale once a newer claim holds the key.
    pub token: String,
    /// 1 for the first claim; each takeover adds one.
    pub attempt: u32,
    /// When the lease ends (store clock, µs since the epoch).
    pub until_us: i64,
    /// The fingerprint the key was claimed with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// The state this claim took over (`in_progress` means an earlier holder's lease ran out:
    /// its effect may or may not have happened).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    /// Holders that died holding the key (their lease ran out), this claim's takeover
    /// included; what a crash-loop limit counts. Absent: 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub deaths: u32,
}

/// A stored record.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RecordBody {
    /// The key's scope.
    pub scope: String,
    /// The key.
    pub key: String,
    /// `in_progress`, `completed`, `released`, `failed` or `in_doubt`.
    pub state: String,
    /// The stored fingerprint (64 hex digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// The stored result (completed) or reason (failed), when it is UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// The stored result, base64, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_base64: Option<String>,
    /// Attempts so far.
    pub attempt: u32,
    /// The latest fencing token (decimal).
    pub token: String,
    /// The state the latest claim took over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous: Option<String>,
    /// Holders that died holding the key (their lease ran out). Absent: 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub deaths: u32,
    /// First claimed (µs since the epoch).
    pub created_us: i64,
    /// Last changed (µs since the epoch).
    pub updated_us: i64,
    /// When the current lease ends, while in progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_until_us: Option<i64>,
    /// When the record may be purged.
    pub expires_us: i64,
}

/// `POST /v1/claims/batch`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ClaimBatchBody {
    /// At most 1000 claims; answered in order.
    pub claims: Vec<ClaimBody>,
}

/// The answers to a batch of claims, in request order.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ClaimBatchAnswer {
    /// One answer per claim.
    pub answers: Vec<ClaimAnswer>,
}

/// `POST /v1/complete`: the effect happened; store its result.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompleteBody {
    /// The lease from the claim.
    pub lease: LeaseBody,
    /// The result to hand to duplicates (UTF-8 text, e.g. JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<String>,
    /// The result as base64, for bytes that are not UTF-8 (not with `result`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_base64: Option<String>,
    /// How long to keep the record from now (default 7 days).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retain_ms: Option<u64>,
}

/// `POST /v1/complete/batch`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CompleteBatchBody {
    /// At most 1000 completions; answered in order.
    pub items: Vec<CompleteBody>,
}

/// The answers to a batch of completions, in request order.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CompleteBatchAnswer {
    /// `null` where the completion applied, else the problem (e.g. `lease_lost`).
    pub results: Vec<Option<Problem>>,
}

/// `POST /v1/fail`: the effect will not happen (dead-lettered), or parked in doubt.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FailBody {
    /// The lease from the claim.
    pub lease: LeaseBody,
    /// `permanent` (re-claimable later: a resubmitted message runs again) or `in_doubt`
    /// (parked until an operator releases it). Default `permanent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Why, stored for operators.
    pub reason: String,
    /// How long to keep the record from now (default 7 days).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retain_ms: Option<u64>,
}

/// `POST /v1/release`: give the key back now (transient failure); the next claim runs it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseBody {
    /// The lease from the claim.
    pub lease: LeaseBody,
}

/// `POST /v1/extend`: a longer lease for a long effect.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExtendBody {
    /// The lease from the claim.
    pub lease: LeaseBody,
    /// The new lease length, from now (1 ms to 24 h).
    pub by_ms: u64,
}

/// The lease after an extension.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ExtendAnswer {
    /// The same lease with its new end.
    pub lease: LeaseBody,
}

/// `POST /v1/records/{scope}/{key}/fail`: an operator fails a record parked in doubt.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ForceFailBody {
    /// Why; stored as the record's result.
    pub reason: String,
}

/// Whether an operator action found what it acts on.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Changed {
    /// `release`: a record existed; `fail`: a record was failed (not absent, not completed).
    pub changed: bool,
}

/// `POST /v1/purge`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PurgeBody {
    /// Delete at most this many expired records (1 to 10000; default 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
}

/// What a purge deleted.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Purged {
    /// Records deleted (fewer than the limit: nothing more is expired).
    pub deleted: u64,
}

/// Records by state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CountsBody {
    /// Claimed.
    pub in_progress: u64,
    /// Completed.
    pub completed: u64,
    /// Released.
    pub released: u64,
    /// Failed.
    pub failed: u64,
    /// Parked in doubt.
    pub in_doubt: u64,
    /// Of all the above, expired and awaiting purge.
    pub expired: u64,
}

/// `GET /v1/records`: records, most recently changed first.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RecordList {
    /// The records.
    pub records: Vec<RecordBody>,
}

// ---- conversions -------------------------------------------------------------------------

fn hex_fingerprint(f: Fingerprint) -> String {
    hex::encode(f.as_bytes())
}

/// Parses a 64-hex-digit fingerprint.
pub(crate) fn parse_fingerprint(field: &'static str, s: &str) -> Result<Fingerprint, ApiError> {
    let bytes = hex::decode(s)
        .map_err(|_| ApiError::invalid(field, "must be 64 hexadecimal digits (SHA-256)"))?;
    Fingerprint::from_slice(&bytes)
        .map_err(|_| ApiError::invalid(field, "must be 64 hexadecimal digits (SHA-256)"))
}

pub(crate) fn millis(
    field: &'static str,
    v: Option<u64>,
    default: u64,
    max: u64,
) -> Result<Duration, ApiError> {
    let v = v.unwrap_or(default);
    if v == 0 || v > max {
        return Err(ApiError::invalid_limit(field, format!("must be 1 to {max} ms, not {v}"), max));
    }
    Ok(Duration::from_millis(v))
}

pub(crate) fn key(scope: &str, key: &str) -> Result<DedupKey, ApiError> {
    DedupKey::new(scope, key).map_err(|e| ApiError::invalid("key", e.to_string()))
}

fn state_name(s: Option<RecordState>) -> Option<String> {
    s.map(|s| s.as_str().to_owned())
}

fn parse_state(field: &'static str, s: Option<&str>) -> Result<Option<RecordState>, ApiError> {
    s.map(|s| {
        RecordState::parse(s).ok_or_else(|| {
            ApiError::invalid(
                field,
                "must be in_progress, completed, released, failed or in_doubt".to_owned(),
            )
        })
    })
    .transpose()
}

/// `result` / `result_base64` of bytes.
pub(crate) fn encode_result(bytes: Option<&[u8]>) -> (Option<String>, Option<String>) {
    match bytes {
        None => (None, None),
        Some(b) => match std::str::from_utf8(b) {
            Ok(s) => (Some(s.to_owned()), None),
            Err(_) => (None, Some(base64::engine::general_purpose::STANDARD.encode(b))),
        },
    }
}

pub(crate) fn decode_result(
    text: Option<String>,
    b64: Option<String>,
) -> Result<Option<Vec<u8>>, ApiError> {
    let bytes = decode_any(text, b64)?;
    if let Some(b) = &bytes {
        check_size("result", b.len())?;
    }
    Ok(bytes)
}

/// `too_large` past [`MAX_RESULT_BYTES`].
pub(crate) fn check_size(field: &str, len: usize) -> Result<(), ApiError> {
    if len > MAX_RESULT_BYTES {
        return Err(ApiError::TooLarge {
            field: field.to_owned(),
            len: len as u64,
            limit: MAX_RESULT_BYTES as u64,
        });
    }
    Ok(())
}

fn decode_any(text: Option<String>, b64: Option<String>) -> Result<Option<Vec<u8>>, ApiError> {
    match (text, b64) {
        (Some(_), Some(_)) => {
            Err(ApiError::invalid("result_base64", "give result or result_base64, not both"))
        }
        (Some(t), None) => Ok(Some(t.into_bytes())),
        (None, Some(b)) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .map(Some)
            .map_err(|_| ApiError::invalid("result_base64", "is not base64 (RFC 4648, padded)")),
        (None, None) => Ok(None),
    }
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl LeaseBody {
    /// The wire form of a lease.
    pub fn from_lease(l: &Lease) -> Self {
        Self {
            scope: l.key().scope().to_owned(),
            key: l.key().id().to_owned(),
            token: l.token().to_string(),
            attempt: l.attempt(),
            until_us: l.until().as_micros(),
            fingerprint: l.fingerprint().map(hex_fingerprint),
            previous: state_name(l.previous()),
            deaths: l.deaths(),
        }
    }

    /// The lease again, as the store handed it out.
    ///
    /// # Errors
    /// `invalid` naming the field that does not parse.
    pub(crate) fn to_lease(&self) -> Result<Lease, ApiError> {
        let k = key(&self.scope, &self.key)?;
        let token = self
            .token
            .parse::<u64>()
            .map_err(|_| ApiError::invalid("lease.token", "must be a decimal fencing token"))?;
        // Every store hands out tokens from its clock in microseconds, below i64::MAX (the SQL
        // stores keep them as BIGINT): a larger one was never handed out, so its lease is lost.
        if i64::try_from(token).is_err() {
            return Err(ApiError::LeaseLost(format!(
                "lease on {}/{} was lost: token {token} was never handed out",
                self.scope, self.key
            )));
        }
        let fingerprint = self
            .fingerprint
            .as_deref()
            .map(|f| parse_fingerprint("lease.fingerprint", f))
            .transpose()?;
        let previous = parse_state("lease.previous", self.previous.as_deref())?;
        Ok(Lease::new(
            k,
            fingerprint,
            token,
            self.attempt,
            Timestamp::from_micros(self.until_us),
            previous,
        )
        .with_deaths(self.deaths))
    }
}

impl RecordBody {
    /// The wire form of a record.
    pub fn from_record(r: &Record) -> Self {
        let (result, result_base64) = encode_result(r.result.as_deref());
        Self {
            scope: r.scope.clone(),
            key: r.id.clone(),
            state: r.state.as_str().to_owned(),
            fingerprint: r.fingerprint.map(hex_fingerprint),
            result,
            result_base64,
            attempt: r.attempt,
            token: r.token.to_string(),
            previous: state_name(r.previous),
            deaths: r.deaths,
            created_us: r.created_at.as_micros(),
            updated_us: r.updated_at.as_micros(),
            lease_until_us: r.lease_until.map(Timestamp::as_micros),
            expires_us: r.expires_at.as_micros(),
        }
    }

    /// The record again.
    ///
    /// # Errors
    /// `corrupt` (as an [`ApiError`]) when a field does not parse.
    pub(crate) fn to_record(&self) -> Result<Record, ApiError> {
        let k = key(&self.scope, &self.key)?;
        let state = parse_state("record.state", Some(&self.state))?
            .ok_or_else(|| ApiError::invalid("record.state", "missing"))?;
        Ok(Record {
            key_hash: k.hash(),
            scope: self.scope.clone(),
            id: self.key.clone(),
            state,
            fingerprint: self
                .fingerprint
                .as_deref()
                .map(|f| parse_fingerprint("record.fingerprint", f))
                .transpose()?,
            result: decode_result(self.result.clone(), self.result_base64.clone())?,
            attempt: self.attempt,
            token: self
                .token
                .parse()
                .map_err(|_| ApiError::invalid("record.token", "must be a decimal"))?,
            previous: parse_state("record.previous", self.previous.as_deref())?,
            created_at: Timestamp::from_micros(self.created_us),
            updated_at: Timestamp::from_micros(self.updated_us),
            lease_until: self.lease_until_us.map(Timestamp::from_micros),
            expires_at: Timestamp::from_micros(self.expires_us),
            deaths: self.deaths,
        })
    }
}

impl ClaimAnswer {
    /// The wire form of a claim's answer.
    pub fn from_claim(c: &Claim) -> Self {
        match c {
            Claim::Acquired(l) => Self::Acquired {
                lease: LeaseBody::from_lease(l),
                downstream_key: l.key().downstream_key(),
            },
            Claim::Completed(r) => Self::Duplicate { record: RecordBody::from_record(r) },
            Claim::InProgress { retry_after, attempt } => Self::InProgress {
                retry_after_ms: u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX),
                attempt: *attempt,
            },
            Claim::Conflict(r) => Self::Conflict { record: RecordBody::from_record(r) },
        }
    }

    /// The claim again (client side). `retry_after` keeps millisecond precision.
    pub(crate) fn into_claim(self) -> Result<Claim, ApiError> {
        Ok(match self {
            Self::Acquired { lease, .. } => Claim::Acquired(lease.to_lease()?),
            Self::Duplicate { record } => Claim::Completed(record.to_record()?),
            Self::InProgress { retry_after_ms, attempt } => {
                Claim::InProgress { retry_after: Duration::from_millis(retry_after_ms), attempt }
            }
            Self::Conflict { record } => Claim::Conflict(record.to_record()?),
        })
    }
}

impl FailBody {
    pub(crate) fn fail_kind(&self) -> Result<FailKind, ApiError> {
        match self.kind.as_deref() {
            None | Some("permanent") => Ok(FailKind::Permanent),
            Some("in_doubt") => Ok(FailKind::InDoubt),
            Some(_) => Err(ApiError::invalid("kind", "must be permanent or in_doubt")),
        }
    }
}

pub(crate) fn fail_kind_name(k: FailKind) -> &'static str {
    match k {
        FailKind::InDoubt => "in_doubt",
        _ => "permanent",
    }
}

impl From<idem_core::Counts> for CountsBody {
    fn from(c: idem_core::Counts) -> Self {
        Self {
            in_progress: c.in_progress,
            completed: c.completed,
            released: c.released,
            failed: c.failed,
            in_doubt: c.in_doubt,
            expired: c.expired,
        }
    }
}

pub(crate) fn state_filter(s: Option<&str>) -> Result<Option<RecordState>, ApiError> {
    parse_state("state", s)
}
