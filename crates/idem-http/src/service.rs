//! The service: claim the key, run the handler once, store and replay its response.

use std::fmt::Write as _;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::FutureExt as _;
use http::{HeaderValue, Request, Response, request};
use http_body::Body;
use http_body_util::{BodyExt as _, LengthLimitError, Limited};
use idem_core::{
    Claim, ClaimRequest, DedupKey, DedupStore, FailKind, Fingerprint, Lease, RecordState,
};
use sha2::{Digest, Sha256};
use tower_service::Service;
use tracing::Instrument as _;

use crate::key::{self, Titled};
use crate::layer::{Config, IDEMPOTENT_REPLAYED};
use crate::stored::StoredResponse;
use crate::{IdempotentRequest, Principal, Problem, ProblemKind};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The response future of [`IdempotencyKey`].
pub type ResponseFuture<R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send>>;

/// The service [`IdempotencyKeyLayer`](crate::IdempotencyKeyLayer) wraps around an inner
/// service. See the layer for the semantics.
#[derive(Debug)]
pub struct IdempotencyKey<S, St> {
    inner: S,
    store: Arc<St>,
    cfg: Arc<Config>,
}

impl<S: Clone, St> Clone for IdempotencyKey<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            store: Arc::clone(&self.store),
            cfg: Arc::clone(&self.cfg),
        }
    }
}

impl<S, St> IdempotencyKey<S, St> {
    pub(crate) fn new(inner: S, store: Arc<St>, cfg: Arc<Config>) -> Self {
        Self { inner, store, cfg }
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyKey<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: DedupStore + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError> + Send,
    ResBody: Body + From<Bytes> + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError> + Send,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // The ready service answers this request; a fresh clone waits for the next poll_ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let cfg = &self.cfg;
        if !cfg.methods.contains(req.method()) {
            return Box::pin(inner.call(req));
        }
        let key = match key::read(req.headers(), &cfg.header, cfg.max_key_len) {
            Ok(Some(key)) => key,
            Ok(None) if !cfg.required => {
                count(cfg, "no_key");
                return Box::pin(inner.call(req));
            }
            Ok(None) => {
                count(cfg, "missing_key");
                let detail = format!(
                    "{} {} requires an {} header",
                    req.method(),
                    req.uri().path(),
                    Titled(&cfg.header)
                );
                return ready(Problem::new(ProblemKind::Missing, detail));
            }
            Err(problem) => {
                count(cfg, "malformed_key");
                return ready(Problem::new(ProblemKind::Malformed, problem.to_string()));
            }
        };
        if !cfg.allow_anonymous && req.extensions().get::<Principal>().is_none() {
            count(cfg, "no_principal");
            if !cfg.logged_no_principal.swap(true, Ordering::Relaxed) {
                tracing::error!(target: "idem", scope_prefix = %cfg.scope_prefix,
                    method = %req.method(), path = req.uri().path(), "{NO_PRINCIPAL}");
            }
            return ready(Problem::new(ProblemKind::NoPrincipal, NO_PRINCIPAL));
        }
        Box::pin(guarded(inner, Arc::clone(&self.store), Arc::clone(cfg), key, req))
    }
}

/// Why a keyed request without a principal is refused: without one, every caller of the route
/// would share a scope, and one user's retry could replay another user's response.
const NO_PRINCIPAL: &str = "no Principal in the request: the authentication layer must run \
    before the idempotency layer and put the caller's Principal in the request's extensions \
    (in axum, add IdempotencyKeyLayer with .layer() before the authentication's .layer()); \
    for routes whose callers are anonymous, configure the layer with .allow_anonymous()";

fn ready<R, E>(p: Problem) -> ResponseFuture<Response<R>, E>
where
    R: From<Bytes> + Send + 'static,
    E: Send + 'static,
{
    Box::pin(std::future::ready(Ok(p.into_response())))
}

/// Counts one guarded request's outcome: `idem_http_requests_total{scope_prefix, outcome}`.
fn count(cfg: &Config, outcome: &'static str) {
    metrics::counter!(idem_core::telemetry::HTTP_REQUESTS_TOTAL, "scope_prefix" => cfg.scope_prefix.clone(),
        "outcome" => outcome)
    .increment(1);
}

fn problem<R: From<Bytes>>(kind: ProblemKind, detail: impl Into<String>) -> Response<R> {
    Problem::new(kind, detail).into_response()
}

async fn guarded<S, St, ReqBody, ResBody>(
    inner: S,
    store: Arc<St>,
    cfg: Arc<Config>,
    key: String,
    req: Request<ReqBody>,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: DedupStore + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError> + Send,
    ResBody: Body + From<Bytes> + Send + 'static,
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
    let fingerprint = match fingerprint(&cfg, &parts, &bytes) {
        Ok(fp) => fp,
        Err(e) => {
            count(&cfg, "body_unreadable");
            return Ok(problem(ProblemKind::BodyUnreadable, format!("the body is not JSON: {e}")));
        }
    };
    let dedup_key = match DedupKey::new(scope(&cfg.scope_prefix, &parts), key) {
        Ok(k) => k,
        // The key was validated against a limit no larger than the store's and the scope is
        // hashed when too long, so this is unreachable in practice; answer it as a bad key.
        Err(e) => {
            count(&cfg, "malformed_key");
            return Ok(problem(ProblemKind::Malformed, e.to_string()));
        }
    };
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
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    St: DedupStore + 'static,
    ResBody: Body + From<Bytes> + Send + 'static,
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
) -> (&'static str, Result<Response<ResBody>, S::Error>)
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    St: DedupStore + 'static,
    ResBody: Body + From<Bytes> + Send + 'static,
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
        Ok(res) if !res.status().is_server_error() => res,
        other => {
            // A 5xx or a service error: nothing is stored, the client may retry.
            release(&*store, lease).await;
            return ("released", other);
        }
    };
    let (parts, body) = res.into_parts();
    let too_large = |len: u64| usize::try_from(len).map_or(true, |l| l > cfg.max_body);
    if too_large(body.size_hint().lower()) {
        // Known too large before reading: stream it through; record that it ran.
        park_unstored(&*store, lease, cfg).await;
        return ("not_stored", Ok(Response::from_parts(parts, body)));
    }
    let bytes = match body.collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            let e: BoxError = e.into();
            tracing::warn!(target: "idem", error = %e, "response body failed; key released");
            release(&*store, lease).await;
            let res = problem(ProblemKind::ResponseUnreadable, "the response body failed");
            return ("released", Ok(res));
        }
    };
    let label = if bytes.len() > cfg.max_body {
        park_unstored(&*store, lease, cfg).await;
        "not_stored"
    } else {
        let mut headers = parts.headers.clone();
        for name in &cfg.skipped_headers {
            headers.remove(name);
        }
        let stored = StoredResponse { status: parts.status, headers, body: bytes.clone() };
        match store.complete(lease, Some(&stored.encode()), cfg.retain).await {
            Ok(()) => "stored",
            Err(e) => {
                // The handler's effect happened: answer with its response. The key stays in
                // progress until the lease runs out (or was taken over, when the lease was
                // lost); a retry after that runs the handler again.
                tracing::warn!(target: "idem", error = &e as &dyn std::error::Error,
                    "response not stored; a retry after the lease will run the handler again");
                "store_failed"
            }
        }
    };
    (label, Ok(Response::from_parts(parts, ResBody::from(bytes))))
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

fn replay<R: From<Bytes>>(stored: StoredResponse) -> Response<R> {
    let mut res = Response::new(R::from(stored.body));
    *res.status_mut() = stored.status;
    *res.headers_mut() = stored.headers;
    res.headers_mut().insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    res
}

/// Method, path with query, and the body as the configured spec sees it.
fn fingerprint(
    cfg: &Config,
    parts: &request::Parts,
    body: &[u8],
) -> Result<Option<Fingerprint>, serde_json::Error> {
    let Some(body_fp) = cfg.fingerprint.fingerprint(body)? else { return Ok(None) };
    let path = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let mut h = Sha256::new();
    for part in [parts.method.as_str().as_bytes(), path.as_bytes(), body_fp.as_bytes()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    Ok(Some(Fingerprint(h.finalize().into())))
}

/// `{prefix} {route}` and, with a principal, ` {len}:{principal}`. Routes hold no spaces and the
/// principal is length-prefixed, so distinct (route, principal) pairs never share a scope. A
/// scope the store would refuse (too long, NUL) is replaced by its hash.
fn scope(prefix: &str, parts: &request::Parts) -> String {
    let mut s = format!("{prefix} {}", route(parts));
    if let Some(p) = parts.extensions.get::<Principal>() {
        let _ = write!(s, " {}:{}", p.as_str().len(), p.as_str());
    }
    if DedupKey::new(s.as_str(), "k").is_err() {
        s = format!("{prefix} sha256:{}", hex::encode(Sha256::digest(s.as_bytes())));
    }
    s
}

fn route(parts: &request::Parts) -> &str {
    #[cfg(feature = "axum")]
    if let Some(p) = parts.extensions.get::<axum::extract::MatchedPath>() {
        return p.as_str();
    }
    parts.uri.path()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_separates_principals_and_hashes_long_ones() {
        let mut parts = Request::new(()).into_parts().0;
        parts.uri = "/payments?x=1".parse().unwrap();
        assert_eq!(scope("http", &parts), "http /payments");
        parts.extensions.insert(Principal::new("a b"));
        assert_eq!(scope("http", &parts), "http /payments 3:a b");
        parts.extensions.insert(Principal::new("x".repeat(600)));
        let s = scope("http", &parts);
        assert!(s.starts_with("http sha256:") && s.len() < 100, "{s}");
    }
}
