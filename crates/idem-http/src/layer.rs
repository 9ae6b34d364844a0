//! The layer and its configuration.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, Method, StatusCode};
use idem_core::{DedupStore, Engine, FingerprintSpec};
use tower_layer::Layer;

use crate::store_rule::StoreRule;
use crate::{IdempotencyKey, KeyFormat, PrincipalKey};

/// The header carrying the key, as the IETF draft names it.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The header marking a replayed response.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Response headers never stored: hop-by-hop headers, and ones that describe this transmission
/// rather than the resource (`date`, `content-length`, which hyper recomputes) or another
/// session (`set-cookie`).
const SKIPPED_HEADERS: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "date",
    "content-length",
    "set-cookie",
];

#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) header: HeaderName,
    pub(crate) methods: Vec<Method>,
    pub(crate) required: bool,
    pub(crate) max_body: usize,
    pub(crate) max_key_len: usize,
    pub(crate) lease: Duration,
    pub(crate) retain: Duration,
    pub(crate) scope_prefix: String,
    pub(crate) fingerprint: FingerprintSpec,
    pub(crate) skipped_headers: Vec<HeaderName>,
    pub(crate) allow_anonymous: bool,
    pub(crate) principal_key: Option<PrincipalKey>,
    pub(crate) store_rule: StoreRule,
    pub(crate) key_format: Option<KeyFormat>,
}

impl Config {
    /// Counts one guarded request's outcome: `idem_http_requests_total{scope_prefix, outcome}`.
    pub(crate) fn count(&self, outcome: &'static str) {
        metrics::counter!(idem_core::telemetry::HTTP_REQUESTS_TOTAL,
            "scope_prefix" => self.scope_prefix.clone(), "outcome" => outcome)
        .increment(1);
    }
}

/// Makes `POST` and `PATCH` requests that carry an `Idempotency-Key` idempotent, over any
/// [`DedupStore`](idem_core::DedupStore).
///
/// Following the IETF HTTPAPI draft "The Idempotency-Key HTTP Header Field":
///
/// | request | response |
/// | --- | --- |
/// | first with this key | the handler's; its status, headers and body are stored (see below for the statuses that are not) |
/// | retry, same method, path and body | the stored response, with `Idempotent-Replayed: true` |
/// | same key while the first is in flight | `409 Conflict` with `Retry-After` |
/// | same key, different method, path or body | `422 Unprocessable Content` |
/// | no key where [`required`](Self::required) | `400 Bad Request` |
/// | empty, too long, repeated or control characters in the key, or not of the [`key_format`](Self::key_format) | `400 Bad Request` naming the rule |
/// | a key, but no [`Principal`](crate::Principal) in the request, or a principal and no [`principal_key`](Self::principal_key) (see below) | a plain `500 Internal Server Error`; the handler does not run; the log says why |
///
/// Error bodies are RFC 9457 `application/problem+json` ([`Problem`](crate::Problem)).
///
/// # Which responses are stored
///
/// Only what the endpoint produced. By default a `401`, `403`, `408`, `425`, `429` or `5xx`
/// releases the key instead, so the client's retry runs again: these typically come from a
/// layer inside this one (authorisation, rate or concurrency limits, timeouts) before the
/// endpoint ran. Every other status, `4xx` included, is stored and replayed. Change the rule
/// with [`store_response_if`](Self::store_response_if). A service error or a panic always
/// releases the key.
///
/// A response body larger than [`max_body`](Self::max_body) is not stored: the layer reads it
/// frame by frame and stops at the first frame past the limit, so an endless or huge body is
/// never buffered. The client still gets the whole response (the frames read, then the rest,
/// streamed); the key is parked *in doubt*, so a retry gets `409`
/// ([`ProblemKind::ResponseNotStored`](crate::ProblemKind::ResponseNotStored)) and the handler
/// does not run again. The effect happened: releasing the key would let a retry repeat it, and
/// there is no response to replay. The record expires after [`retain`](Self::retain) like a
/// stored response; an operator may release it sooner.
///
/// # Scope
///
/// The store key is `(scope, idempotency key)`. The scope is the route — axum's route template
/// when the `axum` feature is on and the layer is added with `Router::layer`, else the request
/// path — and the [`Principal`](crate::Principal) the application put in the request's
/// extensions, so one client can never replay another's response. The principal enters the
/// scope, and so the store and the logs, only as its HMAC-SHA256 under the
/// [`principal_key`](Self::principal_key), never as the id itself.
///
/// # Authentication runs first
///
/// The principal is there only if authentication ran *before* this layer. In axum the layer
/// added last runs first, so add this layer, then the authentication:
/// `router.layer(idempotency).layer(auth)`. Layered the other way round, every request would
/// reach this layer as "no principal" and one user's retry could replay another user's stored
/// response. So a request with a key and no principal is refused with a plain `500`
/// ([`ProblemKind::NoPrincipal`](crate::ProblemKind::NoPrincipal)) and the handler does not
/// run. The body tells the client nothing about the server's setup; the server's log says what
/// to fix (`tracing::error!`, once per process). Routes whose callers are anonymous (a public
/// endpoint, a webhook without a verified sender) opt out with
/// [`allow_anonymous`](Self::allow_anonymous).
///
/// From the claim on, the work runs on a spawned tokio task: a client that disconnects
/// mid-request cannot strand a claimed key or cancel the handler between its effect and the
/// stored response. Make the [`lease`](Self::lease) longer than the slowest handler: a request
/// still running when its lease ends may be taken over by a retry (the stale run is then fenced
/// out and cannot overwrite the retry's stored response).
///
/// # On the engine's rules
///
/// A keyed request is decided by an idem [`Engine`] ([`Engine::guard`]), so the rules of every
/// other mode hold here too: each store call is bounded by the engine's
/// [store timeout](idem_core::engine::EngineBuilder::store_timeout) (a claim that never answers is a
/// `503`, a completion that never answers is retried for the
/// [completion retry](idem_core::engine::EngineBuilder::complete_retry)); a request whose earlier
/// attempts ended with the server dying or hanging past their lease (a takeover) more than
/// the [crash-loop limit](idem_core::engine::EngineBuilder::crash_loop_limit) is refused with a `500`
/// ([`ProblemKind::CrashLoop`](crate::ProblemKind::CrashLoop)) instead of run again; a
/// [heartbeat](idem_core::engine::EngineBuilder::heartbeat) extends the lease while the handler runs.
/// [`new`](Self::new) uses the engine's defaults; [`with_engine`](Self::with_engine) takes an
/// engine you configured.
///
/// Each guarded request emits a `tracing` span `idem.http` (scope, key, outcome) and counts
/// `idem_http_requests_total{scope_prefix, outcome}`, with `outcome` one of `stored`,
/// `replayed`, `in_progress`, `reused`, `crash_loop`, `in_doubt`, `released` (not stored by the
/// [rule](Self::store_response_if), error or panic), `not_stored` (too large),
/// `response_not_stored`, `store_failed`, `store_unavailable`, `stored_response_corrupt`,
/// `missing_key`, `malformed_key`, `no_key` (passed through without dedup), `no_principal`,
/// `no_principal_key`, `body_too_large`, `body_unreadable`.
///
/// ```
/// use std::time::Duration;
/// use idem_core::MemoryStore;
/// use idem_http::{IdempotencyKeyLayer, PrincipalKey};
///
/// // Behind the authentication, which puts a `Principal` in each request.
/// # let secret = [0u8; 32];
/// let layer = IdempotencyKeyLayer::new(MemoryStore::new())
///     .principal_key(PrincipalKey::new(secret)?) // the same secret on every instance
///     .required(true)
///     .lease(Duration::from_secs(60))
///     .retain(Duration::from_secs(24 * 3600));
/// # let _ = layer;
/// # Ok::<(), idem_http::PrincipalKeyError>(())
/// ```
#[derive(Debug)]
#[must_use]
pub struct IdempotencyKeyLayer<St> {
    engine: Arc<Engine<St>>,
    cfg: Config,
}

impl<St> Clone for IdempotencyKeyLayer<St> {
    fn clone(&self) -> Self {
        Self { engine: Arc::clone(&self.engine), cfg: self.cfg.clone() }
    }
}

impl<St: DedupStore> IdempotencyKeyLayer<St> {
    /// A layer over `store`, with the defaults: header `Idempotency-Key`, methods `POST` and
    /// `PATCH`, key optional and of any format, a [`Principal`](crate::Principal) required with
    /// a key (and then a [`principal_key`](Self::principal_key)), keys up to 255 bytes, bodies
    /// up to 256 KiB, lease 30 s, retention 24 h, scope prefix `http`, fingerprint of the raw
    /// body bytes, responses stored by [`stored_by_default`](crate::stored_by_default), and
    /// the engine's defaults for the store timeout (2 min), completion retry and crash-loop
    /// limit (5).
    pub fn new(store: St) -> Self {
        let engine = match Engine::builder(store).scope("http").build() {
            Ok(engine) => engine,
            // Only a missing or invalid scope, a zero duration or a zero limit fail, and the
            // scope is set to a valid one and every other setting is the default.
            Err(e) => unreachable!("the default engine settings are valid: {e}"),
        };
        Self::defaults(engine)
    }

    /// A layer deciding through `engine` (see [On the engine's rules](Self#on-the-engines-rules)):
    /// its store, store timeout, completion retry, crash-loop limit, expired-lease policy and
    /// heartbeat; its lease and retention are this layer's starting [`lease`](Self::lease)
    /// and [`retain`](Self::retain), and its scope labels its metrics. The other settings are
    /// [`new`](Self::new)'s defaults.
    ///
    /// ```
    /// use std::time::Duration;
    /// use idem_core::{Engine, MemoryStore};
    /// use idem_http::IdempotencyKeyLayer;
    ///
    /// let engine = Engine::builder(MemoryStore::new())
    ///     .scope("http")
    ///     .store_timeout(Duration::from_secs(2)) // a hung store answers 503 within 2 s
    ///     .crash_loop_limit(3)
    ///     .build()?;
    /// let layer = IdempotencyKeyLayer::with_engine(engine).allow_anonymous();
    /// # let _ = layer;
    /// # Ok::<(), idem_core::engine::ConfigError>(())
    /// ```
    pub fn with_engine(engine: Engine<St>) -> Self {
        let (lease, retain) = (engine.lease(), engine.retain());
        let mut layer = Self::defaults(engine);
        layer.cfg.lease = lease;
        layer.cfg.retain = retain;
        layer
    }

    fn defaults(engine: Engine<St>) -> Self {
        Self {
            engine: Arc::new(engine),
            cfg: Config {
                header: IDEMPOTENCY_KEY,
                methods: vec![Method::POST, Method::PATCH],
                required: false,
                max_body: 256 * 1024,
                max_key_len: 255,
                lease: Duration::from_secs(30),
                retain: Duration::from_secs(24 * 3600),
                scope_prefix: "http".to_owned(),
                fingerprint: FingerprintSpec::Bytes,
                skipped_headers: SKIPPED_HEADERS.map(HeaderName::from_static).to_vec(),
                allow_anonymous: false,
                principal_key: None,
                store_rule: StoreRule::default(),
                key_format: None,
            },
        }
    }

    /// The header carrying the key (default `Idempotency-Key`).
    pub fn header(mut self, name: HeaderName) -> Self {
        self.cfg.header = name;
        self
    }

    /// The methods the layer guards (default `POST` and `PATCH`); others pass straight through.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.cfg.methods = methods.into_iter().collect();
        self
    }

    /// Whether a guarded request without a key is refused with `400` (default `false`: it is
    /// passed through without deduplication).
    pub fn required(mut self, required: bool) -> Self {
        self.cfg.required = required;
        self
    }

    /// The secret each [`Principal`](crate::Principal) is hashed with before it enters the
    /// scope: the store and the logs hold `HMAC-SHA256(secret, principal)`, never the caller's
    /// id. Required once requests carry a principal: without it such a keyed request is refused
    /// with a plain `500` ([`ProblemKind::NoPrincipalKey`](crate::ProblemKind::NoPrincipalKey)),
    /// logged once per process. See [`PrincipalKey`] for why there is no default, and why every
    /// instance must share the secret.
    ///
    /// ```
    /// use idem_core::MemoryStore;
    /// use idem_http::{IdempotencyKeyLayer, PrincipalKey};
    ///
    /// # fn secret_store(_: &str) -> String { "an example secret of 32 or more bytes".into() }
    /// let secret = secret_store("idem-principal-key"); // the same on every instance
    /// let layer =
    ///     IdempotencyKeyLayer::new(MemoryStore::new()).principal_key(PrincipalKey::new(secret)?);
    /// # let _ = layer;
    /// # Ok::<(), idem_http::PrincipalKeyError>(())
    /// ```
    pub fn principal_key(mut self, key: PrincipalKey) -> Self {
        self.cfg.principal_key = Some(key);
        self
    }

    /// Which of the handler's responses are stored and replayed; the others release the key,
    /// so a retry runs the handler again. The default,
    /// [`stored_by_default`](crate::stored_by_default), stores everything but `401`, `403`,
    /// `408`, `425`, `429` and `5xx`. A rule may also store `5xx` responses (Stripe replays its
    /// `500`s once the endpoint ran). A service error or a panic always releases the key.
    ///
    /// ```
    /// use http::StatusCode;
    /// use idem_core::MemoryStore;
    /// use idem_http::{IdempotencyKeyLayer, stored_by_default};
    ///
    /// // Also let a retry run again after a 409 from the endpoint, and trust an inner layer
    /// // that marks the responses it produced itself.
    /// let layer = IdempotencyKeyLayer::new(MemoryStore::new()).store_response_if(|status, h| {
    ///     status != StatusCode::CONFLICT
    ///         && !h.contains_key("x-rejected-by")
    ///         && stored_by_default(status, h)
    /// });
    /// # let _ = layer;
    /// ```
    pub fn store_response_if(
        mut self,
        rule: impl Fn(StatusCode, &HeaderMap) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.cfg.store_rule = StoreRule::new(rule);
        self
    }

    /// Accepts only keys of this form (default: any key the header rules allow); any other is
    /// refused with `400` and an `application/problem+json` body naming the rule.
    ///
    /// ```
    /// use idem_core::MemoryStore;
    /// use idem_http::{IdempotencyKeyLayer, KeyFormat};
    ///
    /// // Clients send `Idempotency-Key: 6f9619ff-8b86-d011-b42d-00c04fc964ff`.
    /// let layer = IdempotencyKeyLayer::new(MemoryStore::new()).key_format(KeyFormat::Uuid);
    /// # let _ = layer;
    /// ```
    pub fn key_format(mut self, format: KeyFormat) -> Self {
        self.cfg.key_format = Some(format);
        self
    }

    /// Accepts keyed requests without a [`Principal`](crate::Principal): all such callers of a
    /// route share one scope, so one anonymous caller's key replays to any other anonymous
    /// caller who sends the same key. For routes whose callers really are anonymous; requests
    /// with a principal are still kept apart (and need a [`principal_key`](Self::principal_key)).
    /// Without it a keyed request without a principal is refused with `500`, because it means
    /// the authentication runs after this layer (see
    /// [the layer's docs](Self#authentication-runs-first)).
    ///
    /// ```
    /// use idem_core::MemoryStore;
    /// use idem_http::IdempotencyKeyLayer;
    ///
    /// // A public sign-up form: no authentication, keys are random per form.
    /// let layer = IdempotencyKeyLayer::new(MemoryStore::new()).allow_anonymous();
    /// # let _ = layer;
    /// ```
    pub fn allow_anonymous(mut self) -> Self {
        self.cfg.allow_anonymous = true;
        self
    }

    /// The largest request body fingerprinted and the largest response body stored (default
    /// 256 KiB). A larger request is refused with `413`. A larger response is read only up to
    /// the first frame past the limit, then streamed to this client whole (what was read, then
    /// the rest); only the fact that it was processed is stored (the record is parked *in
    /// doubt*): a retry gets `409` ([`ProblemKind::ResponseNotStored`](crate::ProblemKind)) and
    /// the handler does not run again. Keep it below your store's result limit (1 MiB for the
    /// memory and SQLite stores).
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.cfg.max_body = bytes;
        self
    }

    /// The longest key accepted, in bytes (default 255; at most 512, the store's key limit).
    pub fn max_key_len(mut self, bytes: usize) -> Self {
        self.cfg.max_key_len = bytes.min(idem_core::DEFAULT_MAX_KEY_BYTES);
        self
    }

    /// How long a request holds its key before a retry may take it over (default 30 s). Make it
    /// longer than the slowest handler; zero is raised to one millisecond.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.cfg.lease = lease.max(Duration::from_millis(1));
        self
    }

    /// How long a stored response is kept and replayed (default 24 h); zero is raised to one
    /// second.
    pub fn retain(mut self, retain: Duration) -> Self {
        self.cfg.retain = retain.max(Duration::from_secs(1));
        self
    }

    /// The first part of every scope (default `http`): give each service sharing a store its own.
    pub fn scope_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.cfg.scope_prefix = prefix.into();
        self
    }

    /// How the body enters the fingerprint (default the raw bytes; `CanonicalJson` ignores key
    /// order and whitespace, `None` never reports a reused key). The method and the path with
    /// its query are always part of it.
    pub fn fingerprint(mut self, spec: FingerprintSpec) -> Self {
        self.cfg.fingerprint = spec;
        self
    }

    /// A response header not to store or replay, besides the hop-by-hop headers, `date`,
    /// `content-length` and `set-cookie`.
    pub fn skip_header(mut self, name: HeaderName) -> Self {
        self.cfg.skipped_headers.push(name);
        self
    }
}

impl<S, St> Layer<S> for IdempotencyKeyLayer<St> {
    type Service = IdempotencyKey<S, St>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyKey::new(inner, Arc::clone(&self.engine), Arc::new(self.cfg.clone()))
    }
}
