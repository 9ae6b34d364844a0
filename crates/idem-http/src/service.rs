//! The service: checks a request's key and caller, then hands it to the guarded path.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::TryFutureExt as _;
use http::{Request, Response};
use http_body::Body;
use idem_core::Engine;
use tower_service::Service;

use crate::body::BoxError;
use crate::key::{self, KeyProblem, Titled};
use crate::layer::Config;
use crate::{Principal, Problem, ProblemKind, ResponseBody};

/// The response future of [`IdempotencyKey`].
pub type ResponseFuture<R, E> = Pin<Box<dyn Future<Output = Result<R, E>> + Send>>;

/// The service [`IdempotencyKeyLayer`](crate::IdempotencyKeyLayer) wraps around an inner
/// service. See the layer for the semantics.
///
/// Its responses carry a [`ResponseBody`] around the inner service's body.
#[derive(Debug)]
pub struct IdempotencyKey<S, St> {
    inner: S,
    engine: Arc<Engine<St>>,
    cfg: Arc<Config>,
}

impl<S: Clone, St> Clone for IdempotencyKey<S, St> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            engine: Arc::clone(&self.engine),
            cfg: Arc::clone(&self.cfg),
        }
    }
}

impl<S, St> IdempotencyKey<S, St> {
    pub(crate) fn new(inner: S, engine: Arc<Engine<St>>, cfg: Arc<Config>) -> Self {
        Self { inner, engine, cfg }
    }
}

impl<S, St, ReqBody, ResBody> Service<Request<ReqBody>> for IdempotencyKey<S, St>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: idem_core::DedupStore + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError> + Send,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError> + Send,
{
    type Response = Response<ResponseBody<ResBody>>;
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
        let pass = |fut: S::Future| -> Self::Future {
            Box::pin(fut.map_ok(|res| res.map(ResponseBody::inner)))
        };
        if !cfg.methods.contains(req.method()) {
            return pass(inner.call(req));
        }
        let key = match key::read(req.headers(), &cfg.header, cfg.max_key_len) {
            Ok(Some(key)) => key,
            Ok(None) if !cfg.required => {
                cfg.count("no_key");
                return pass(inner.call(req));
            }
            Ok(None) => {
                cfg.count("missing_key");
                let detail = format!(
                    "{} {} requires an {} header",
                    req.method(),
                    req.uri().path(),
                    Titled(&cfg.header)
                );
                return ready(Problem::new(ProblemKind::Missing, detail));
            }
            Err(problem) => {
                cfg.count("malformed_key");
                return ready(Problem::new(ProblemKind::Malformed, problem.to_string()));
            }
        };
        if let Some(format) = cfg.key_format.as_ref().filter(|f| !f.accepts(&key)) {
            cfg.count("malformed_key");
            let rule = format.to_string();
            let problem = KeyProblem::WrongFormat { header: cfg.header.clone(), rule };
            return ready(Problem::new(ProblemKind::Malformed, problem.to_string()));
        }
        let principal_tag = match (req.extensions().get::<Principal>(), &cfg.principal_key) {
            (Some(p), Some(k)) => Some(k.tag(p)),
            (None, _) if cfg.allow_anonymous => None,
            (None, _) => {
                cfg.count("no_principal");
                log_setup_once(&LOGGED_NO_PRINCIPAL, cfg, &req, NO_PRINCIPAL);
                return ready(setup_problem(ProblemKind::NoPrincipal));
            }
            (Some(_), None) => {
                cfg.count("no_principal_key");
                log_setup_once(&LOGGED_NO_PRINCIPAL_KEY, cfg, &req, NO_PRINCIPAL_KEY);
                return ready(setup_problem(ProblemKind::NoPrincipalKey));
            }
        };
        let engine = Arc::clone(&self.engine);
        Box::pin(crate::guarded::guarded(inner, engine, Arc::clone(cfg), key, principal_tag, req))
    }
}

/// Whether the setup advice was logged: once per process, as it says how to fix the server,
/// not how often a request hit the mistake (the `outcome` counter says that).
static LOGGED_NO_PRINCIPAL: AtomicBool = AtomicBool::new(false);
static LOGGED_NO_PRINCIPAL_KEY: AtomicBool = AtomicBool::new(false);

/// Why a keyed request without a principal is refused: without one, every caller of the route
/// would share a scope, and one user's retry could replay another user's response. For the
/// server's log only: the client is not told how the server is built.
const NO_PRINCIPAL: &str = "keyed request refused with 500: no Principal in the request. The \
    authentication layer must run before the idempotency layer and put the caller's Principal \
    in the request's extensions (in axum, add IdempotencyKeyLayer with .layer() before the \
    authentication's .layer()); for routes whose callers are anonymous, configure the layer \
    with .allow_anonymous()";

const NO_PRINCIPAL_KEY: &str = "keyed request refused with 500: the request has a Principal but \
    the idempotency layer has no key to hash it with. Configure the layer with \
    .principal_key(PrincipalKey::new(secret)?), the same secret on every instance";

/// Logs `advice` at error level the first time only.
fn log_setup_once<B>(logged: &AtomicBool, cfg: &Config, req: &Request<B>, advice: &str) {
    if !logged.swap(true, Ordering::Relaxed) {
        tracing::error!(target: "idem", scope_prefix = %cfg.scope_prefix,
            method = %req.method(), path = req.uri().path(), "{advice}");
    }
}

/// The client's side of a setup mistake: a plain 500 that says nothing about the setup.
fn setup_problem(kind: ProblemKind) -> Problem {
    Problem::new(kind, "the request was not processed")
}

fn ready<B, E>(p: Problem) -> ResponseFuture<Response<ResponseBody<B>>, E>
where
    B: Send + 'static,
    E: Send + 'static,
{
    Box::pin(std::future::ready(Ok(p.into_response())))
}
