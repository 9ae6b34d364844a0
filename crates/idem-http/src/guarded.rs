//! The guarded path: claim the key, run the handler once, store and replay its response.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use idem_core::engine::{Context, Finish, Guarded};
use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, Engine, RecordState};
use tower_service::Service;
use tracing::Instrument as _;

use crate::body::{BoxError, Read, read_limited};
use crate::key::Titled;
use crate::layer::{Config, IDEMPOTENT_REPLAYED};
use crate::scope::{fingerprint, scope};
use crate::stored::StoredResponse;
use crate::{IdempotentRequest, Problem, ProblemKind, ResponseBody};

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

pub(crate) async fn guarded<S, St, ReqBody, ResBody>(
    inner: S,
    engine: Arc<Engine<St>>,
    cfg: Arc<Config>,
    key: String,
    principal_tag: Option<String>,
    req: Request<ReqBody>,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: DedupStore + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError> + Send,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError> + Send,
{
    let (parts, body) = req.into_parts();
    let bytes = match Limited::new(body, cfg.max_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            let detail = format!(
                "the body is larger than the {} bytes this endpoint fingerprints for {}",
                cfg.max_body,
                Titled(&cfg.header)
            );
            cfg.count("body_too_large");
            return Ok(problem(ProblemKind::BodyTooLarge, detail));
        }
        Err(e) => {
            cfg.count("body_unreadable");
            return Ok(problem(ProblemKind::BodyUnreadable, e.to_string()));
        }
    };
    let fingerprint = match fingerprint(&cfg.fingerprint, &parts, &bytes) {
        Ok(fp) => fp,
        Err(e) => {
            cfg.count("body_unreadable");
            return Ok(problem(ProblemKind::BodyUnreadable, format!("the body is not JSON: {e}")));
        }
    };
    let scope = scope(&cfg.scope_prefix, &parts, principal_tag.as_deref());
    let dedup_key = match DedupKey::new(scope, key) {
        Ok(k) => k,
        // The key was validated against a limit no larger than the store's and the scope is
        // hashed when too long, so this is unreachable in practice; answer it as a bad key.
        Err(e) => {
            cfg.count("malformed_key");
            return Ok(problem(ProblemKind::Malformed, e.to_string()));
        }
    };
    // The scope holds the principal's keyed hash only: spans and logs never see the principal.
    let span = tracing::debug_span!(target: "idem", "idem.http", scope = %dedup_key.scope(),
        key = %dedup_key.id(), outcome = tracing::field::Empty);
    let claim_req = ClaimRequest::new(dedup_key, fingerprint, cfg.lease, cfg.retain);
    let req = Request::from_parts(parts, ReqBody::from(bytes));
    let task = decide(inner, engine, cfg, claim_req, req, span.clone()).instrument(span);
    // From the claim on, the work runs on its own task: when the client disconnects, hyper drops
    // this future, but a claimed key is still answered, and a handler's effect and its stored
    // response stay together.
    match tokio::spawn(task).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Ok(problem(ProblemKind::StoreUnavailable, "the server is shutting down")),
    }
}

/// What the handler's run asks the engine to record, and answers: the outcome label and the
/// response, or the handler's panic (resumed once the key is released).
type Work<B, E> = Finish<(&'static str, Result<Answer<B, E>, Panic>)>;
type Panic = Box<dyn std::any::Any + Send>;

async fn decide<S, St, ReqBody, ResBody>(
    inner: S,
    engine: Arc<Engine<St>>,
    cfg: Arc<Config>,
    claim_req: ClaimRequest,
    mut req: Request<ReqBody>,
    span: tracing::Span,
) -> Answer<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    St: DedupStore + 'static,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError> + Send,
{
    let header = Titled(&cfg.header);
    let key = claim_req.key.clone();
    let work = |ctx: Context| {
        req.extensions_mut().insert(IdempotentRequest {
            key,
            attempt: ctx.attempt(),
            took_over: ctx.took_over_expired(),
        });
        run(inner, &cfg, req)
    };
    let (label, response) = match engine.guard(&claim_req, work).await {
        Guarded::Ran { answer: (label, answer), recorded, .. } => {
            let label = match (label, &recorded) {
                ("stored", Err(e)) => {
                    // The handler's effect happened: answer with its response. The key stays
                    // in progress until the lease runs out (or was taken over, when the lease
                    // was lost); a retry after that runs the handler again.
                    tracing::warn!(target: "idem", parent: &span, error = e as &dyn std::error::Error,
                        "response not stored; a retry after the lease will run the handler again");
                    "store_failed"
                }
                ("not_stored", Err(e)) => {
                    tracing::warn!(target: "idem", parent: &span, error = e as &dyn std::error::Error,
                        "could not park the key; a retry after the lease will run the handler again");
                    label
                }
                _ => label,
            };
            span.record("outcome", label);
            cfg.count(label);
            return answer.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        }
        Guarded::Answered(Claim::Completed(rec)) if rec.state == RecordState::InDoubt => {
            let why = rec.result.as_deref().map(String::from_utf8_lossy).unwrap_or_default();
            let detail = format!(
                "the request with this {header} was processed, but its response was not stored \
                 ({why}); it will not run again"
            );
            ("response_not_stored", problem(ProblemKind::ResponseNotStored, detail))
        }
        Guarded::Answered(Claim::Completed(rec)) => {
            match rec.result.as_deref().and_then(StoredResponse::decode) {
                Some(stored) => ("replayed", replay(stored)),
                None => (
                    "stored_response_corrupt",
                    problem(ProblemKind::StoredResponseCorrupt, "the stored response is corrupt"),
                ),
            }
        }
        Guarded::Answered(Claim::InProgress { retry_after, .. }) => {
            let detail = format!("a request with this {header} is still being processed");
            let p = Problem::new(ProblemKind::InProgress, detail).retry_after(retry_after);
            ("in_progress", p.into_response())
        }
        Guarded::Answered(Claim::Conflict(_)) => {
            let detail = format!(
                "this {header} was already used for a different request (method, path or body differ)"
            );
            ("reused", problem(ProblemKind::Reused, detail))
        }
        Guarded::CrashLoop { deaths, limit } => {
            tracing::error!(target: "idem", parent: &span, deaths, limit,
                "request refused: crash loop");
            let detail = format!(
                "earlier attempts of the request with this {header} ended without an answer \
                 (the server died or hung); it was not run again"
            );
            ("crash_loop", problem(ProblemKind::CrashLoop, detail))
        }
        Guarded::InDoubt { attempt } => {
            tracing::warn!(target: "idem", parent: &span, attempt, "request parked in doubt");
            let detail = format!(
                "an earlier attempt of the request with this {header} ran out of time; whether it \
                 took effect is unknown, so it is not run again"
            );
            ("in_doubt", problem(ProblemKind::ResponseNotStored, detail))
        }
        Guarded::Failed(e) => {
            tracing::warn!(target: "idem", parent: &span, error = &e as &dyn std::error::Error,
                "idempotency store unavailable");
            store_unavailable()
        }
        // `Answered(Acquired)` never comes (the engine runs the work itself), and no other
        // variant exists yet.
        _ => store_unavailable(),
    };
    span.record("outcome", label);
    cfg.count(label);
    tracing::debug!(target: "idem", parent: &span, outcome = label, "idempotent request answered");
    Ok(response)
}

fn store_unavailable<B>() -> (&'static str, Response<ResponseBody<B>>) {
    let p = Problem::new(ProblemKind::StoreUnavailable, "try again shortly")
        .retry_after(Duration::from_secs(1));
    ("store_unavailable", p.into_response())
}

/// Runs the handler under the lease; what to record, with the outcome label and the answer.
async fn run<S, ReqBody, ResBody>(
    mut inner: S,
    cfg: &Config,
    req: Request<ReqBody>,
) -> Work<ResBody, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError> + Send,
{
    let result = match AssertUnwindSafe(inner.call(req)).catch_unwind().await {
        Ok(r) => r,
        Err(panic) => return Finish::Release(("released", Err(panic))),
    };
    let res = match result {
        Ok(res) if cfg.store_rule.stores(res.status(), res.headers()) => res,
        other => {
            // Not the endpoint's answer (by the rule), or a service error: nothing is stored,
            // the client's retry runs again. The body is passed through unread.
            let answer = other.map(|res| res.map(ResponseBody::inner));
            return Finish::Release(("released", Ok(answer)));
        }
    };
    let (parts, body) = res.into_parts();
    let too_large = |len: u64| usize::try_from(len).map_or(true, |l| l > cfg.max_body);
    let reason = || format!("response larger than max_body ({} bytes); not stored", cfg.max_body);
    if too_large(body.size_hint().lower()) {
        // Known too large before reading: stream it through; record that it ran.
        let answer = Ok(Response::from_parts(parts, ResponseBody::inner(body)));
        return Finish::Park { reason: reason(), answer: ("not_stored", Ok(answer)) };
    }
    let bytes = match read_limited(body, cfg.max_body).await {
        Read::Whole(bytes) => bytes,
        Read::TooLarge(body) => {
            // Reading stopped at the first frame past the limit: the client gets what was read
            // and then the rest; the key records that the request ran.
            let answer = Ok(Response::from_parts(parts, body));
            return Finish::Park { reason: reason(), answer: ("not_stored", Ok(answer)) };
        }
        Read::Failed(e) => {
            tracing::warn!(target: "idem", error = %e, "response body failed; key released");
            let res = problem(ProblemKind::ResponseUnreadable, "the response body failed");
            return Finish::Release(("released", Ok(Ok(res))));
        }
    };
    let mut headers = parts.headers.clone();
    for name in &cfg.skipped_headers {
        headers.remove(name);
    }
    let stored = StoredResponse { status: parts.status, headers, body: bytes.clone() }.encode();
    let answer = Ok(Response::from_parts(parts, ResponseBody::full(bytes)));
    Finish::Keep { stored, answer: ("stored", Ok(answer)) }
}

fn replay<B>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    let mut res = Response::new(ResponseBody::full(stored.body));
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored.headers;
    res.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    res
}

fn problem<B>(kind: ProblemKind, detail: impl Into<String>) -> Response<ResponseBody<B>> {
    Problem::new(kind, detail).into_response()
}
