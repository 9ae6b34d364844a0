//! The guarded path: claim the key, run the handler once, store and replay its response.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::{HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, FailKind, Lease, RecordState};
use tower_service::Service;
use tracing::Instrument as _;

use crate::body::{BoxError, Read, read_limited};
use crate::key::Titled;
use crate::layer::{Config, IDEMPOTENT_REPLAYED};
use crate::scope::{fingerprint, scope};
use crate::service::count;
use crate::stored::StoredResponse;
use crate::{IdempotentRequest, Problem, ProblemKind, ResponseBody};

type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

pub(crate) async fn guarded<S, St, ReqBody, ResBody>(
    inner: S,
    store: Arc<St>,
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
            count(&cfg, "body_too_large");
            return Ok(problem(ProblemKind::BodyTooLarge, detail));
        }
        Err(e) => {
            count(&cfg, "body_unreadable");
            return Ok(problem(ProblemKind::BodyUnreadable, e.to_string()));
        }
    };
    let fingerprint = match fingerprint(&cfg.fingerprint, &parts, &bytes) {
        Ok(fp) => fp,
        Err(e) => {
            count(&cfg, "body_unreadable");
            return Ok(problem(ProblemKind::BodyUnreadable, format!("the body is not JSON: {e}")));
        }
    };
    let scope = scope(&cfg.scope_prefix, &parts, principal_tag.as_deref());
    let dedup_key = match DedupKey::new(scope, key) {
        Ok(k) => k,
        // The key was validated against a limit no larger than the store's and the scope is
        // hashed when too long, so this is unreachable in practice; answer it as a bad key.
        Err(e) => {
            count(&cfg, "malformed_key");
            return Ok(problem(ProblemKind::Malformed, e.to_string()));
        }
    };
    // The scope holds the principal's keyed hash only: spans and logs never see the principal.
    let span = tracing::debug_span!(target: "idem", "idem.http", scope = %dedup_key.scope(),
        key = %dedup_key.id(), outcome = tracing::field::Empty);
    let claim_req = ClaimRequest::new(dedup_key, fingerprint, cfg.lease, cfg.retain);
    let req = Request::from_parts(parts, ReqBody::from(bytes));
    let task = decide(inner, store, cfg, claim_req, req, span.clone()).instrument(span);
    // From the claim on, the work runs on its own task: when the client disconnects, hyper drops
    // this future, but a claimed key is still answered, and a handler's effect and its stored
    // response stay together.
    match tokio::spawn(task).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => Ok(problem(ProblemKind::StoreUnavailable, "the server is shutting down")),
    }
}

async fn decide<S, St, ReqBody, ResBody>(
    inner: S,
    store: Arc<St>,
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
    let claim = store.claim(&claim_req).await;
    let header = Titled(&cfg.header);
    let (label, response) = match claim {
        Err(e) => {
            tracing::warn!(target: "idem", parent: &span, error = &e as &dyn std::error::Error,
                "idempotency store unavailable");
            let p = Problem::new(ProblemKind::StoreUnavailable, "try again shortly")
                .retry_after(Duration::from_secs(1));
            ("store_unavailable", p.into_response())
        }
        Ok(Claim::Completed(rec)) if rec.state == RecordState::InDoubt => {
            let detail = format!(
                "the request with this {header} was processed, but its response was too large to \
                 store; it will not run again"
            );
            ("response_not_stored", problem(ProblemKind::ResponseNotStored, detail))
        }
        Ok(Claim::Completed(rec)) => match rec.result.as_deref().and_then(StoredResponse::decode) {
            Some(stored) => ("replayed", replay(stored)),
            None => (
                "stored_response_corrupt",
                problem(ProblemKind::StoredResponseCorrupt, "the stored response is corrupt"),
            ),
        },
        Ok(Claim::InProgress { retry_after, .. }) => {
            let detail = format!("a request with this {header} is still being processed");
            let p = Problem::new(ProblemKind::InProgress, detail).retry_after(retry_after);
            ("in_progress", p.into_response())
        }
        Ok(Claim::Conflict(_)) => {
            let detail = format!(
                "this {header} was already used for a different request (method, path or body differ)"
            );
            ("reused", problem(ProblemKind::Reused, detail))
        }
        Ok(Claim::Acquired(lease)) => {
            req.extensions_mut().insert(IdempotentRequest {
                key: lease.key().clone(),
                attempt: lease.attempt(),
                took_over: lease.took_over_expired(),
            });
            let (label, result) = run(inner, store, &cfg, lease, req).await;
            span.record("outcome", label);
            count(&cfg, label);
            return result;
        }
    };
    span.record("outcome", label);
    count(&cfg, label);
    tracing::debug!(target: "idem", parent: &span, outcome = label, "idempotent request answered");
    Ok(response)
}

/// Runs the handler under the lease; returns the outcome label with the result.
async fn run<S, St, ReqBody, ResBody>(
    mut inner: S,
    store: Arc<St>,
    cfg: &Config,
    lease: Lease,
    req: Request<ReqBody>,
) -> (&'static str, Answer<ResBody, S::Error>)
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    St: DedupStore + 'static,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError> + Send,
{
    let result = match AssertUnwindSafe(inner.call(req)).catch_unwind().await {
        Ok(r) => r,
        Err(panic) => {
            release(&*store, lease).await;
            count(cfg, "released");
            std::panic::resume_unwind(panic);
        }
    };
    let res = match result {
        Ok(res) if cfg.store_rule.stores(res.status(), res.headers()) => res,
        other => {
            // Not the endpoint's answer (by the rule), or a service error: nothing is stored,
            // the client's retry runs again. The body is passed through unread.
            release(&*store, lease).await;
            return ("released", other.map(|res| res.map(ResponseBody::inner)));
        }
    };
    let (parts, body) = res.into_parts();
    let too_large = |len: u64| usize::try_from(len).map_or(true, |l| l > cfg.max_body);
    if too_large(body.size_hint().lower()) {
        // Known too large before reading: stream it through; record that it ran.
        park_unstored(&*store, lease, cfg).await;
        return ("not_stored", Ok(Response::from_parts(parts, ResponseBody::inner(body))));
    }
    let bytes = match read_limited(body, cfg.max_body).await {
        Read::Whole(bytes) => bytes,
        Read::TooLarge(body) => {
            // Reading stopped at the first frame past the limit: the client gets what was read
            // and then the rest; the key records that the request ran.
            park_unstored(&*store, lease, cfg).await;
            return ("not_stored", Ok(Response::from_parts(parts, body)));
        }
        Read::Failed(e) => {
            tracing::warn!(target: "idem", error = %e, "response body failed; key released");
            release(&*store, lease).await;
            let res = problem(ProblemKind::ResponseUnreadable, "the response body failed");
            return ("released", Ok(res));
        }
    };
    let mut headers = parts.headers.clone();
    for name in &cfg.skipped_headers {
        headers.remove(name);
    }
    let stored = StoredResponse { status: parts.status, headers, body: bytes.clone() };
    let label = match store.complete(lease, Some(&stored.encode()), cfg.retain).await {
        Ok(()) => "stored",
        Err(e) => {
            // The handler's effect happened: answer with its response. The key stays in
            // progress until the lease runs out (or was taken over, when the lease was
            // lost); a retry after that runs the handler again.
            tracing::warn!(target: "idem", error = &e as &dyn std::error::Error,
                "response not stored; a retry after the lease will run the handler again");
            "store_failed"
        }
    };
    (label, Ok(Response::from_parts(parts, ResponseBody::full(bytes))))
}

async fn release<St: DedupStore>(store: &St, lease: Lease) {
    let key = lease.key().to_string();
    if let Err(e) = store.release(lease).await {
        tracing::warn!(target: "idem", %key, error = &e as &dyn std::error::Error,
            "could not release the key; it frees itself when the lease runs out");
    }
}

async fn park_unstored<St: DedupStore>(store: &St, lease: Lease, cfg: &Config) {
    let reason = format!("response larger than max_body ({} bytes); not stored", cfg.max_body);
    tracing::warn!(target: "idem", key = %lease.key(), "{reason}");
    if let Err(e) = store.fail(lease, FailKind::InDoubt, &reason, cfg.retain).await {
        tracing::warn!(target: "idem", error = &e as &dyn std::error::Error,
            "could not park the key; a retry after the lease will run the handler again");
    }
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
