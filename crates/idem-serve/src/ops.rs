//! The claim API's operations, whatever the transport: the shared state, and each
//! operation with its checks and metrics. The axum handlers (`http.rs`) and the gRPC
//! service (`grpc/`) only translate to and from them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idem_core::{ClaimRequest, Completion, Fingerprint};
use serde::Deserialize;
use utoipa::IntoParams;

use crate::auth::{Caller, Tokens};
use crate::dynstore::DynStore;
use crate::error::ApiError;
use crate::wire::{self, *};

/// How long `/readyz` waits for the store's check.
pub(crate) const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// Renders the Prometheus text of `/metrics`.
pub type MetricsRender = Arc<dyn Fn() -> String + Send + Sync>;

#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) store: Arc<dyn DynStore>,
    pub(crate) tokens: Arc<Tokens>,
    pub(crate) metrics: Option<MetricsRender>,
}

// ---- metrics ---------------------------------------------------------------------------------

/// Every metric `idem serve` adds to the engine's (`docs/OPERATIONS.md` lists each).
pub const METRICS: [&str; 7] = [
    "idem_api_requests_total",
    "idem_api_request_seconds",
    "idem_api_claims_total",
    "idem_push_requests_total",
    DENIED_TOTAL,
    crate::server::REFUSED_CONNECTIONS_TOTAL,
    crate::server::REQUESTS_BOUNDED_TOTAL,
];

/// Callers refused (`401`, `403`, and their gRPC statuses), by `reason`.
pub(crate) const DENIED_TOTAL: &str = "idem_api_denied_total";

/// The audit of every API request: a refusal of the caller is counted
/// (`idem_api_denied_total{reason}`: `missing_token`, `malformed_token`, `unknown_token`,
/// `scope`) and logged at debug with the method and the route (never the token).
pub(crate) async fn audit(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let method = req.method().clone();
    // The route's template (`/v1/records/{scope}/{key}`), not the path with a key in it; for
    // gRPC, the method (`/idem.v1.Claims/Claim`).
    let route = if crate::grpc::is_grpc(req.headers()) {
        req.uri().path().to_owned()
    } else {
        req.extensions()
            .get::<axum::extract::MatchedPath>()
            .map_or("(no route)", axum::extract::MatchedPath::as_str)
            .to_owned()
    };
    let res = next.run(req).await;
    // A refusal answered by this crate is marked (`ApiError::respond`); a gRPC method's own
    // `PERMISSION_DENIED` comes from tonic, known only by its status.
    let reason = res.extensions().get::<crate::error::Denied>().map(|d| d.0).or_else(|| {
        let status = res.headers().get("grpc-status").map(axum::http::HeaderValue::as_bytes);
        (status == Some(b"7")).then_some("scope")
    });
    if let Some(reason) = reason {
        metrics::counter!(DENIED_TOTAL, "reason" => reason).increment(1);
        tracing::debug!(target: "idem::api", %method, route, reason, status = res.status().as_u16(),
            "request denied");
    }
    res
}

/// Counts a finished request: `idem_api_requests_total{operation, status}` and its latency.
pub(crate) fn observe<T>(op: &'static str, started: Instant, r: &Result<T, ApiError>) {
    let status = match r {
        Ok(_) => "200".to_owned(),
        Err(e) => e.status().as_u16().to_string(),
    };
    metrics::counter!("idem_api_requests_total", "operation" => op, "status" => status)
        .increment(1);
    metrics::histogram!("idem_api_request_seconds", "operation" => op)
        .record(started.elapsed().as_secs_f64());
}

pub(crate) fn count_outcome(a: &ClaimAnswer) {
    let outcome = match a {
        ClaimAnswer::Acquired { .. } => "acquired",
        ClaimAnswer::Duplicate { .. } => "duplicate",
        ClaimAnswer::InProgress { .. } => "in_progress",
        ClaimAnswer::Conflict { .. } => "conflict",
    };
    metrics::counter!("idem_api_claims_total", "outcome" => outcome).increment(1);
}

pub(crate) fn request(caller: &Caller, b: ClaimBody) -> Result<ClaimRequest, ApiError> {
    let key = wire::key(&b.scope, &b.key)?;
    caller.may_use(&b.scope)?;
    let fingerprint = match (b.fingerprint.as_deref(), b.payload.as_deref()) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("payload", "give fingerprint or payload, not both"));
        }
        (Some(f), None) => Some(wire::parse_fingerprint("fingerprint", f)?),
        (None, Some(p)) => Some(Fingerprint::of_bytes(p.as_bytes())),
        (None, None) => None,
    };
    let lease = wire::millis("lease_ms", b.lease_ms, DEFAULT_LEASE_MS, MAX_LEASE_MS)?;
    let retain = wire::millis("retain_ms", b.retain_ms, DEFAULT_RETAIN_MS, MAX_RETAIN_MS)?;
    let req = ClaimRequest::new(key, fingerprint, lease, retain);
    Ok(if b.takeover == Some(false) { req.without_takeover() } else { req })
}

pub(crate) fn completion(caller: &Caller, b: CompleteBody) -> Result<Completion, ApiError> {
    caller.may_use(&b.lease.scope)?;
    let lease = b.lease.to_lease()?;
    let result = wire::decode_result(b.result, b.result_base64)?;
    let retain_for = wire::millis("retain_ms", b.retain_ms, DEFAULT_RETAIN_MS, MAX_RETAIN_MS)?;
    Ok(Completion { lease, result, retain_for })
}

/// The key of a record route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Path)]
pub(crate) struct RecordPath {
    /// The key's scope.
    pub(crate) scope: String,
    /// The key (percent-encoded).
    pub(crate) key: String,
}

/// Whose counts.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct StatsQuery {
    /// Only this scope (without it, the token needs `*`).
    pub(crate) scope: Option<String>,
}

// ---- the operations, shared with gRPC ---------------------------------------------------------

/// claim: the operation behind both transports (HTTP and gRPC), counted in the API's metrics.
pub(crate) async fn op_claim(
    s: &AppState,
    caller: &Caller,
    b: ClaimBody,
) -> Result<ClaimAnswer, ApiError> {
    let started = Instant::now();
    let r = async {
        let req = request(caller, b)?;
        let claim = s.store.claim(&req).await?;
        let answer = ClaimAnswer::from_claim(&claim);
        count_outcome(&answer);
        // The lease travels to the caller; the in-process value is only a copy of it.
        drop(claim);
        Ok(answer)
    }
    .await;
    observe("claim", started, &r);
    r
}

/// claim_batch: the operation behind both transports (HTTP and gRPC), counted in the API's metrics.
pub(crate) async fn op_claim_batch(
    s: &AppState,
    caller: &Caller,
    b: ClaimBatchBody,
) -> Result<ClaimBatchAnswer, ApiError> {
    let started = Instant::now();
    let r = async {
        if b.claims.len() > MAX_BATCH {
            return Err(ApiError::invalid_limit(
                "claims",
                format!("holds {} claims, more than {MAX_BATCH}", b.claims.len()),
                MAX_BATCH as u64,
            ));
        }
        let reqs =
            b.claims.into_iter().map(|c| request(caller, c)).collect::<Result<Vec<_>, _>>()?;
        let claims = if reqs.is_empty() { Vec::new() } else { s.store.claim_many(&reqs).await? };
        let answers: Vec<ClaimAnswer> = claims.iter().map(ClaimAnswer::from_claim).collect();
        answers.iter().for_each(count_outcome);
        drop(claims);
        Ok(ClaimBatchAnswer { answers })
    }
    .await;
    observe("claim_batch", started, &r);
    r
}

/// complete: the operation behind both transports (HTTP and gRPC), counted in the API's metrics.
pub(crate) async fn op_complete(
    s: &AppState,
    caller: &Caller,
    b: CompleteBody,
) -> Result<(), ApiError> {
    let started = Instant::now();
    let r = async {
        let c = completion(caller, b)?;
        s.store.complete(c.lease, c.result.as_deref(), c.retain_for).await?;
        Ok(())
    }
    .await;
    observe("complete", started, &r);
    r
}

/// fail: the operation behind both transports (HTTP and gRPC), counted in the API's metrics.
pub(crate) async fn op_fail(s: &AppState, caller: &Caller, b: FailBody) -> Result<(), ApiError> {
    let started = Instant::now();
    let r = async {
        caller.may_use(&b.lease.scope)?;
        wire::check_size("reason", b.reason.len())?;
        let kind = b.fail_kind()?;
        let lease = b.lease.to_lease()?;
        let retain = wire::millis("retain_ms", b.retain_ms, DEFAULT_RETAIN_MS, MAX_RETAIN_MS)?;
        s.store.fail(lease, kind, &b.reason, retain).await?;
        Ok(())
    }
    .await;
    observe("fail", started, &r);
    r
}

/// release: the operation behind both transports (HTTP and gRPC), counted in the API's metrics.
pub(crate) async fn op_release(
    s: &AppState,
    caller: &Caller,
    b: ReleaseBody,
) -> Result<(), ApiError> {
    let started = Instant::now();
    let r = async {
        caller.may_use(&b.lease.scope)?;
        s.store.release(b.lease.to_lease()?).await?;
        Ok(())
    }
    .await;
    observe("release", started, &r);
    r
}

/// extend: the operation behind both transports (HTTP and gRPC), counted in the API's metrics.
pub(crate) async fn op_extend(
    s: &AppState,
    caller: &Caller,
    b: ExtendBody,
) -> Result<ExtendAnswer, ApiError> {
    let started = Instant::now();
    let r = async {
        caller.may_use(&b.lease.scope)?;
        let mut lease = b.lease.to_lease()?;
        let by = wire::millis("by_ms", Some(b.by_ms), DEFAULT_LEASE_MS, MAX_LEASE_MS)?;
        s.store.extend(&mut lease, by).await?;
        Ok(ExtendAnswer { lease: LeaseBody::from_lease(&lease) })
    }
    .await;
    observe("extend", started, &r);
    r
}

/// inspect: the operation behind both transports (HTTP and gRPC), counted in the API's metrics.
pub(crate) async fn op_inspect(
    s: &AppState,
    caller: &Caller,
    p: RecordPath,
) -> Result<RecordBody, ApiError> {
    let started = Instant::now();
    let r = async {
        let key = wire::key(&p.scope, &p.key)?;
        caller.may_use(&p.scope)?;
        match s.store.get(&key).await? {
            Some(r) => Ok(RecordBody::from_record(&r)),
            None => Err(ApiError::NotFound(format!("{}/{}", p.scope, p.key))),
        }
    }
    .await;
    observe("inspect", started, &r);
    r
}

/// stats: the operation behind both transports (HTTP and gRPC), counted in the API's metrics.
pub(crate) async fn op_stats(
    s: &AppState,
    caller: &Caller,
    q: StatsQuery,
) -> Result<CountsBody, ApiError> {
    let started = Instant::now();
    let r = async {
        match &q.scope {
            Some(scope) => caller.may_use(scope)?,
            None => caller.may_use_all("counting every scope")?,
        }
        Ok(s.store.count(q.scope.as_deref()).await?.into())
    }
    .await;
    observe("stats", started, &r);
    r
}
