//! The claim API over HTTP: axum handlers (each documented for the OpenAPI document),
//! the extractors that answer bad input with problem documents, and the routes.

use std::time::Instant;

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idem_core::ListFilter;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use utoipa::IntoParams;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::wire::{self, *};

use crate::ops::*;

/// The HTTP routes of the claim API (the OpenAPI document's route is added by the server).
pub(crate) fn routes(state: AppState) -> Router {
    Router::new()
        .route("/v1/claims", post(claim))
        .route("/v1/claims/batch", post(claim_batch))
        .route("/v1/complete", post(complete))
        .route("/v1/complete/batch", post(complete_batch))
        .route("/v1/fail", post(fail))
        .route("/v1/release", post(release))
        .route("/v1/extend", post(extend))
        .route("/v1/records", get(list))
        .route("/v1/records/{scope}/{key}", get(inspect))
        .route("/v1/records/{scope}/{key}/release", post(force_release))
        .route("/v1/records/{scope}/{key}/fail", post(force_fail))
        .route("/v1/stats", get(stats))
        .route("/v1/purge", post(purge))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

// ---- extractors that answer in problem documents -------------------------------------------

/// A JSON body whose rejection is a `400` problem naming what did not parse.
pub(crate) struct Body<T>(T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for Body<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(Self(v)),
            Err(e) => Err(json_rejection(&e)),
        }
    }
}

fn json_rejection(e: &JsonRejection) -> ApiError {
    match e {
        JsonRejection::MissingJsonContentType(_) => {
            ApiError::invalid("content-type", "must be application/json")
        }
        JsonRejection::BytesRejection(b) if b.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::TooLarge { field: "body".into(), len: 0, limit: MAX_BODY_BYTES as u64 }
        }
        JsonRejection::BytesRejection(_) => ApiError::invalid("body", "could not be read"),
        other => ApiError::invalid("body", other.body_text()),
    }
}

pub(crate) struct PathOf<T>(T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for PathOf<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(v)| Self(v))
            .map_err(|e: PathRejection| ApiError::invalid("path", e.body_text()))
    }
}

pub(crate) struct QueryOf<T>(T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for QueryOf<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(v)| Self(v))
            .map_err(|e: QueryRejection| ApiError::invalid("query", e.body_text()))
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ApiError> {
        state.tokens.authenticate(&parts.headers)
    }
}

// ---- the claim API ---------------------------------------------------------------------------
/// Claims a key before its effect runs.
#[utoipa::path(post, path = "/v1/claims", tag = "claims", request_body = ClaimBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "One of four outcomes", body = ClaimAnswer),
        (status = 400, description = "A field is missing, malformed or past its limit", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use this scope", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn claim(
    State(s): State<AppState>,
    caller: Caller,
    Body(b): Body<ClaimBody>,
) -> Result<Json<ClaimAnswer>, ApiError> {
    op_claim(&s, &caller, b).await.map(Json)
}

/// Claims up to 1000 keys in one round trip; answers in request order.
#[utoipa::path(post, path = "/v1/claims/batch", tag = "claims", request_body = ClaimBatchBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "One answer per claim, in order", body = ClaimBatchAnswer),
        (status = 400, description = "A claim is malformed, or more than 1000", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use a scope of the batch", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn claim_batch(
    State(s): State<AppState>,
    caller: Caller,
    Body(b): Body<ClaimBatchBody>,
) -> Result<Json<ClaimBatchAnswer>, ApiError> {
    op_claim_batch(&s, &caller, b).await.map(Json)
}

/// Marks the key completed and stores the effect's result for duplicates.
#[utoipa::path(post, path = "/v1/complete", tag = "leases", request_body = CompleteBody,
    security(("bearer" = [])),
    responses(
        (status = 204, description = "Completed"),
        (status = 400, description = "A field is malformed", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use this scope", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The lease was lost (taken over or released); nothing changed", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The result is longer than the store keeps", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn complete(
    State(s): State<AppState>,
    caller: Caller,
    Body(b): Body<CompleteBody>,
) -> Result<StatusCode, ApiError> {
    op_complete(&s, &caller, b).await.map(|()| StatusCode::NO_CONTENT)
}

/// Completes up to 1000 leases in one round trip (group commit where the store has it).
#[utoipa::path(post, path = "/v1/complete/batch", tag = "leases", request_body = CompleteBatchBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "`null` per applied completion, else its problem", body = CompleteBatchAnswer),
        (status = 400, description = "An item is malformed, or more than 1000", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use a scope of the batch", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn complete_batch(
    State(s): State<AppState>,
    caller: Caller,
    Body(b): Body<CompleteBatchBody>,
) -> Result<Json<CompleteBatchAnswer>, ApiError> {
    let started = Instant::now();
    let r = async {
        if b.items.len() > MAX_BATCH {
            return Err(ApiError::invalid_limit(
                "items",
                format!("holds {} completions, more than {MAX_BATCH}", b.items.len()),
                MAX_BATCH as u64,
            ));
        }
        let items =
            b.items.into_iter().map(|c| completion(&caller, c)).collect::<Result<Vec<_>, _>>()?;
        let done = s.store.complete_many(items).await?;
        let results =
            done.into_iter().map(|r| r.err().map(|e| ApiError::from(e).problem())).collect();
        Ok(Json(CompleteBatchAnswer { results }))
    }
    .await;
    observe("complete_batch", started, &r);
    r
}

/// Ends the lease without a result: failed for good (dead-lettered), or parked in doubt.
#[utoipa::path(post, path = "/v1/fail", tag = "leases", request_body = FailBody,
    security(("bearer" = [])),
    responses(
        (status = 204, description = "Failed"),
        (status = 400, description = "A field is malformed", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use this scope", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The lease was lost; nothing changed", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The reason is longer than the store keeps", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn fail(
    State(s): State<AppState>,
    caller: Caller,
    Body(b): Body<FailBody>,
) -> Result<StatusCode, ApiError> {
    op_fail(&s, &caller, b).await.map(|()| StatusCode::NO_CONTENT)
}

/// Gives the key back now (a transient failure): the next claim runs it, attempt + 1.
#[utoipa::path(post, path = "/v1/release", tag = "leases", request_body = ReleaseBody,
    security(("bearer" = [])),
    responses(
        (status = 204, description = "Released"),
        (status = 400, description = "A field is malformed", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use this scope", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The lease was lost; nothing changed", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn release(
    State(s): State<AppState>,
    caller: Caller,
    Body(b): Body<ReleaseBody>,
) -> Result<StatusCode, ApiError> {
    op_release(&s, &caller, b).await.map(|()| StatusCode::NO_CONTENT)
}

/// Extends a live lease to `by_ms` from now, for a long effect.
#[utoipa::path(post, path = "/v1/extend", tag = "leases", request_body = ExtendBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The lease with its new end", body = ExtendAnswer),
        (status = 400, description = "A field is malformed", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use this scope", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "The lease was lost; nothing changed", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn extend(
    State(s): State<AppState>,
    caller: Caller,
    Body(b): Body<ExtendBody>,
) -> Result<Json<ExtendAnswer>, ApiError> {
    op_extend(&s, &caller, b).await.map(Json)
}

// ---- operators -------------------------------------------------------------------------------

/// Reads one record.
#[utoipa::path(get, path = "/v1/records/{scope}/{key}", tag = "operators", params(RecordPath),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The record", body = RecordBody),
        (status = 400, description = "The key is malformed", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use this scope", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No record for the key", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn inspect(
    State(s): State<AppState>,
    caller: Caller,
    PathOf(p): PathOf<RecordPath>,
) -> Result<Json<RecordBody>, ApiError> {
    op_inspect(&s, &caller, p).await.map(Json)
}

/// Which records to list.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListQuery {
    /// Only this scope (without it, the token needs `*`).
    scope: Option<String>,
    /// Only this state: `in_progress`, `completed`, `released`, `failed`, `in_doubt`.
    state: Option<String>,
    /// At most this many (1 to 1000; default 100).
    limit: Option<u64>,
}

/// Lists records, most recently changed first.
#[utoipa::path(get, path = "/v1/records", tag = "operators", params(ListQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The records", body = RecordList),
        (status = 400, description = "A parameter is malformed", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use this scope (or all of them)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn list(
    State(s): State<AppState>,
    caller: Caller,
    QueryOf(q): QueryOf<ListQuery>,
) -> Result<Json<RecordList>, ApiError> {
    let started = Instant::now();
    let r = async {
        let limit = q.limit.unwrap_or(100);
        if limit == 0 || limit > MAX_LIST as u64 {
            return Err(ApiError::invalid_limit(
                "limit",
                format!("must be 1 to {MAX_LIST}, not {limit}"),
                MAX_LIST as u64,
            ));
        }
        let mut filter = ListFilter::new(usize::try_from(limit).unwrap_or(MAX_LIST));
        match &q.scope {
            Some(scope) => {
                caller.may_use(scope)?;
                filter = filter.scope(scope.clone());
            }
            None => caller.may_use_all("listing every scope")?,
        }
        if let Some(state) = wire::state_filter(q.state.as_deref())? {
            filter = filter.state(state);
        }
        let records = s.store.list(&filter).await?;
        Ok(Json(RecordList { records: records.iter().map(RecordBody::from_record).collect() }))
    }
    .await;
    observe("list", started, &r);
    r
}

/// Counts records by state.
#[utoipa::path(get, path = "/v1/stats", tag = "operators", params(StatsQuery),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Counts by state", body = CountsBody),
        (status = 400, description = "A parameter is malformed", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use this scope (or all of them)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn stats(
    State(s): State<AppState>,
    caller: Caller,
    QueryOf(q): QueryOf<StatsQuery>,
) -> Result<Json<CountsBody>, ApiError> {
    op_stats(&s, &caller, q).await.map(Json)
}

/// Operator release: whatever its state, the record is released and its holder fenced out.
#[utoipa::path(post, path = "/v1/records/{scope}/{key}/release", tag = "operators", params(RecordPath),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Whether a record existed", body = Changed),
        (status = 400, description = "The key is malformed", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use this scope", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn force_release(
    State(s): State<AppState>,
    caller: Caller,
    PathOf(p): PathOf<RecordPath>,
) -> Result<Json<Changed>, ApiError> {
    let started = Instant::now();
    let r = async {
        let key = wire::key(&p.scope, &p.key)?;
        caller.may_use(&p.scope)?;
        let changed = s.store.force_release(&key).await?;
        tracing::info!(target: "idem::api", token = caller.name(), scope = key.scope(),
            key = key.id(), changed, "operator action: force release");
        Ok(Json(Changed { changed }))
    }
    .await;
    observe("force_release", started, &r);
    r
}

/// Operator failure of a record parked in doubt (never of a completed one).
#[utoipa::path(post, path = "/v1/records/{scope}/{key}/fail", tag = "operators", params(RecordPath),
    request_body = ForceFailBody, security(("bearer" = [])),
    responses(
        (status = 200, description = "Whether a record was failed", body = Changed),
        (status = 400, description = "A field is malformed", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token may not use this scope", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The reason is longer than the store keeps", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn force_fail(
    State(s): State<AppState>,
    caller: Caller,
    PathOf(p): PathOf<RecordPath>,
    Body(b): Body<ForceFailBody>,
) -> Result<Json<Changed>, ApiError> {
    let started = Instant::now();
    let r = async {
        let key = wire::key(&p.scope, &p.key)?;
        caller.may_use(&p.scope)?;
        wire::check_size("reason", b.reason.len())?;
        let changed = s.store.force_fail(&key, &b.reason).await?;
        tracing::info!(target: "idem::api", token = caller.name(), scope = key.scope(),
            key = key.id(), changed, "operator action: force fail");
        Ok(Json(Changed { changed }))
    }
    .await;
    observe("force_fail", started, &r);
    r
}

/// Deletes expired records (every scope: the token needs `*`), in one bounded batch.
#[utoipa::path(post, path = "/v1/purge", tag = "operators", request_body = PurgeBody,
    security(("bearer" = [])),
    responses(
        (status = 200, description = "How many were deleted", body = Purged),
        (status = 400, description = "The limit is out of range", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No token, or an unknown one", body = Problem, content_type = "application/problem+json"),
        (status = 403, description = "The token lacks scope \"*\"", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The store failed", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn purge(
    State(s): State<AppState>,
    caller: Caller,
    Body(b): Body<PurgeBody>,
) -> Result<Json<Purged>, ApiError> {
    let started = Instant::now();
    let r = async {
        caller.may_use_all("purge")?;
        let limit = b.limit.unwrap_or(1000);
        if limit == 0 || limit > 10_000 {
            return Err(ApiError::invalid_limit(
                "limit",
                format!("must be 1 to 10000, not {limit}"),
                10_000,
            ));
        }
        let limit = usize::try_from(limit).unwrap_or(10_000);
        let deleted = s.store.purge(limit).await?;
        tracing::info!(target: "idem::api", token = caller.name(), limit, deleted,
            "operator action: purge");
        Ok(Json(Purged { deleted }))
    }
    .await;
    observe("purge", started, &r);
    r
}

// ---- health, metrics, the document -------------------------------------------------------------

/// The process is up (no store call).
#[utoipa::path(get, path = "/healthz", tag = "health",
    responses((status = 200, description = "Up", content_type = "text/plain", body = String)))]
pub(crate) async fn healthz() -> &'static str {
    "ok\n"
}

/// The store answers its startup check within 2 s.
#[utoipa::path(get, path = "/readyz", tag = "health",
    responses(
        (status = 200, description = "Ready", content_type = "text/plain", body = String),
        (status = 503, description = "The store does not answer", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn readyz(State(s): State<AppState>) -> Result<&'static str, ApiError> {
    match tokio::time::timeout(READY_TIMEOUT, s.store.check()).await {
        Ok(Ok(_)) => Ok("ready\n"),
        // The endpoint answers anyone: the store's error goes to the log, not to the caller.
        Ok(Err(e)) => {
            tracing::warn!(target: "idem", error = %idem_core::ErrorChain(&e), "not ready: the store check failed");
            Err(ApiError::Unavailable {
                detail: "the store check failed (the server's log says why)".to_owned(),
                retryable: e.is_retryable(),
            })
        }
        Err(_) => Err(ApiError::Unavailable {
            detail: format!("the store did not answer within {READY_TIMEOUT:?}"),
            retryable: true,
        }),
    }
}

/// Prometheus metrics: the engine's set and the API's own (`idem_api_*`).
#[utoipa::path(get, path = "/metrics", tag = "health",
    responses(
        (status = 200, description = "Prometheus text format", content_type = "text/plain", body = String),
        (status = 404, description = "Metrics are off", body = Problem, content_type = "application/problem+json"),
    ))]
pub(crate) async fn metrics_text(State(s): State<AppState>) -> Response {
    match &s.metrics {
        Some(render) => ([("content-type", "text/plain; version=0.0.4")], render()).into_response(),
        None => ApiError::NotFound("metrics (this server was started without them)".into())
            .into_response(),
    }
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::MethodNotAllowed(format!("{} is not a method of {}", req.method(), req.uri().path()))
}

async fn not_found(req: Request) -> ApiError {
    ApiError::NotFound(format!("route {} {}", req.method(), req.uri().path()))
}
