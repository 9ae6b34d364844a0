//! The claim API over gRPC (`proto/idem/v1/claims.proto`): the same operations as the
//! HTTP/JSON routes, run by the same code, on the same port (HTTP/2, with or without TLS).

use idem_core::Fingerprint;
use tonic::{Code, Request, Response, Status};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::ops::{self, AppState, RecordPath, StatsQuery};
use crate::wire;

#[allow(
    missing_docs,
    unreachable_pub,
    clippy::all,
    clippy::pedantic,
    clippy::nursery,
    rustdoc::all
)]
#[rustfmt::skip]
pub mod pb;

use pb::claims_server::{Claims, ClaimsServer};

/// The gRPC service, routed by the axum router under `/idem.v1.Claims/`. The token is checked
/// on the headers, before a byte of the message is read: a caller without one costs its headers
/// only. Messages are decoded up to the API's body limit ([`wire::MAX_BODY_BYTES`]).
pub(crate) fn service(
    state: AppState,
) -> impl tower::Service<
    axum::extract::Request,
    Response = axum::response::Response,
    Error = std::convert::Infallible,
    Future = impl Send + 'static,
> + Clone
+ Send
+ Sync
+ 'static {
    let tokens = std::sync::Arc::clone(&state.tokens);
    let claims =
        ClaimsServer::new(Service { state }).max_decoding_message_size(wire::MAX_BODY_BYTES);
    tower::service_fn(move |mut req: axum::extract::Request| {
        let claims = claims.clone();
        let caller = tokens.authenticate(req.headers());
        async move {
            let res = match caller {
                Ok(caller) => {
                    req.extensions_mut().insert(caller);
                    match tower::ServiceExt::oneshot(claims, req).await {
                        Ok(res) => res.map(axum::body::Body::new),
                        Err(never) => match never {},
                    }
                }
                Err(e) => e.respond(true),
            };
            Ok::<_, std::convert::Infallible>(res)
        }
    })
}

/// Whether a request is a gRPC call (its answer must be a gRPC status, not a problem document).
pub(crate) fn is_grpc(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/grpc"))
}

pub(crate) struct Service {
    state: AppState,
}

impl Service {
    fn caller<T>(&self, req: &Request<T>) -> Result<Caller, Status> {
        // Authenticated on the headers before the message was read: `service`, the only way
        // in, puts the caller there or answers the refusal itself.
        req.extensions()
            .get::<Caller>()
            .cloned()
            .ok_or_else(|| status(ApiError::Unauthorized("missing Authorization: Bearer <token>")))
    }
}

/// The gRPC status of an API error; `idem-problem` metadata carries the problem's type.
pub(crate) fn status(e: ApiError) -> Status {
    let code = match &e {
        ApiError::Invalid { .. } => Code::InvalidArgument,
        ApiError::Unauthorized(_) => Code::Unauthenticated,
        ApiError::Forbidden { .. } => Code::PermissionDenied,
        ApiError::NotFound(_) => Code::NotFound,
        ApiError::LeaseLost(_) => Code::FailedPrecondition,
        ApiError::TooLarge { .. } => Code::ResourceExhausted,
        ApiError::Unavailable { .. } | ApiError::Busy => Code::Unavailable,
        ApiError::RequestTimeout { .. } => Code::DeadlineExceeded,
        _ => Code::Internal,
    };
    let problem = e.problem();
    let mut s = Status::new(code, problem.detail);
    if let Ok(v) = problem.kind.parse() {
        s.metadata_mut().insert("idem-problem", v);
    }
    if let Some(field) = problem.field.and_then(|f| f.parse().ok()) {
        s.metadata_mut().insert("idem-field", field);
    }
    s
}

fn missing(field: &str) -> Status {
    status(ApiError::invalid(field, "is required"))
}

fn claim_body(c: pb::ClaimRequest) -> ClaimBodyResult {
    let fingerprint = match (c.fingerprint, c.payload) {
        (Some(_), Some(_)) => {
            return Err(status(ApiError::invalid(
                "payload",
                "give fingerprint or payload, not both",
            )));
        }
        (Some(f), None) => Some(f),
        (None, Some(p)) => Some(hex::encode(Fingerprint::of_bytes(&p).as_bytes())),
        (None, None) => None,
    };
    Ok(wire::ClaimBody {
        scope: c.scope,
        key: c.key,
        fingerprint,
        payload: None,
        lease_ms: c.lease_ms,
        retain_ms: c.retain_ms,
        // Not in the gRPC message: a gRPC claim always takes over a lease that ran out.
        takeover: None,
    })
}

type ClaimBodyResult = Result<wire::ClaimBody, Status>;

fn lease_in(l: Option<pb::Lease>) -> Result<wire::LeaseBody, Status> {
    let l = l.ok_or_else(|| missing("lease"))?;
    Ok(wire::LeaseBody {
        scope: l.scope,
        key: l.key,
        token: l.token.to_string(),
        attempt: l.attempt,
        until_us: l.until_us,
        fingerprint: l.fingerprint,
        previous: l.previous,
        deaths: l.deaths,
    })
}

fn lease_out(l: wire::LeaseBody) -> Result<pb::Lease, Status> {
    Ok(pb::Lease {
        token: l.token.parse().map_err(|_| Status::internal("fencing token"))?,
        scope: l.scope,
        key: l.key,
        attempt: l.attempt,
        until_us: l.until_us,
        fingerprint: l.fingerprint,
        previous: l.previous,
        deaths: l.deaths,
    })
}

fn record_out(r: wire::RecordBody) -> Result<pb::Record, Status> {
    let result = wire::decode_result(r.result, r.result_base64).map_err(status)?;
    Ok(pb::Record {
        token: r.token.parse().map_err(|_| Status::internal("fencing token"))?,
        scope: r.scope,
        key: r.key,
        state: r.state,
        fingerprint: r.fingerprint,
        result,
        attempt: r.attempt,
        previous: r.previous,
        deaths: r.deaths,
        created_us: r.created_us,
        updated_us: r.updated_us,
        lease_until_us: r.lease_until_us,
        expires_us: r.expires_us,
    })
}

fn answer_out(a: wire::ClaimAnswer) -> Result<pb::ClaimAnswer, Status> {
    use pb::claim_answer::Outcome;
    let outcome = match a {
        wire::ClaimAnswer::Acquired { lease, downstream_key } => {
            Outcome::Acquired(pb::Acquired { lease: Some(lease_out(lease)?), downstream_key })
        }
        wire::ClaimAnswer::Duplicate { record } => Outcome::Duplicate(record_out(record)?),
        wire::ClaimAnswer::InProgress { retry_after_ms, attempt } => {
            Outcome::InProgress(pb::InProgress { retry_after_ms, attempt })
        }
        wire::ClaimAnswer::Conflict { record } => Outcome::Conflict(record_out(record)?),
    };
    Ok(pb::ClaimAnswer { outcome: Some(outcome) })
}

fn result_in(result: Option<Vec<u8>>) -> (Option<String>, Option<String>) {
    wire::encode_result(result.as_deref())
}

#[tonic::async_trait]
impl Claims for Service {
    async fn claim(
        &self,
        req: Request<pb::ClaimRequest>,
    ) -> Result<Response<pb::ClaimAnswer>, Status> {
        let caller = self.caller(&req)?;
        let body = claim_body(req.into_inner())?;
        let a = ops::op_claim(&self.state, &caller, body).await.map_err(status)?;
        Ok(Response::new(answer_out(a)?))
    }

    async fn claim_batch(
        &self,
        req: Request<pb::ClaimBatchRequest>,
    ) -> Result<Response<pb::ClaimBatchAnswer>, Status> {
        let caller = self.caller(&req)?;
        let claims =
            req.into_inner().claims.into_iter().map(claim_body).collect::<Result<Vec<_>, _>>()?;
        let a = ops::op_claim_batch(&self.state, &caller, wire::ClaimBatchBody { claims })
            .await
            .map_err(status)?;
        let answers = a.answers.into_iter().map(answer_out).collect::<Result<Vec<_>, _>>()?;
        Ok(Response::new(pb::ClaimBatchAnswer { answers }))
    }

    async fn complete(
        &self,
        req: Request<pb::CompleteRequest>,
    ) -> Result<Response<pb::Done>, Status> {
        let caller = self.caller(&req)?;
        let c = req.into_inner();
        let (result, result_base64) = result_in(c.result);
        let body = wire::CompleteBody {
            lease: lease_in(c.lease)?,
            result,
            result_base64,
            retain_ms: c.retain_ms,
        };
        ops::op_complete(&self.state, &caller, body).await.map_err(status)?;
        Ok(Response::new(pb::Done {}))
    }

    async fn fail(&self, req: Request<pb::FailRequest>) -> Result<Response<pb::Done>, Status> {
        let caller = self.caller(&req)?;
        let f = req.into_inner();
        let body = wire::FailBody {
            lease: lease_in(f.lease)?,
            kind: f.kind,
            reason: f.reason,
            retain_ms: f.retain_ms,
        };
        ops::op_fail(&self.state, &caller, body).await.map_err(status)?;
        Ok(Response::new(pb::Done {}))
    }

    async fn release(
        &self,
        req: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::Done>, Status> {
        let caller = self.caller(&req)?;
        let body = wire::ReleaseBody { lease: lease_in(req.into_inner().lease)? };
        ops::op_release(&self.state, &caller, body).await.map_err(status)?;
        Ok(Response::new(pb::Done {}))
    }

    async fn extend(&self, req: Request<pb::ExtendRequest>) -> Result<Response<pb::Lease>, Status> {
        let caller = self.caller(&req)?;
        let e = req.into_inner();
        let body = wire::ExtendBody { lease: lease_in(e.lease)?, by_ms: e.by_ms };
        let a = ops::op_extend(&self.state, &caller, body).await.map_err(status)?;
        Ok(Response::new(lease_out(a.lease)?))
    }

    async fn inspect(
        &self,
        req: Request<pb::InspectRequest>,
    ) -> Result<Response<pb::Record>, Status> {
        let caller = self.caller(&req)?;
        let i = req.into_inner();
        let r = ops::op_inspect(&self.state, &caller, RecordPath { scope: i.scope, key: i.key })
            .await
            .map_err(status)?;
        Ok(Response::new(record_out(r)?))
    }

    async fn stats(&self, req: Request<pb::StatsRequest>) -> Result<Response<pb::Counts>, Status> {
        let caller = self.caller(&req)?;
        let scope = req.into_inner().scope;
        let c = ops::op_stats(&self.state, &caller, StatsQuery { scope }).await.map_err(status)?;
        Ok(Response::new(pb::Counts {
            in_progress: c.in_progress,
            completed: c.completed,
            released: c.released,
            failed: c.failed,
            in_doubt: c.in_doubt,
            expired: c.expired,
        }))
    }
}
