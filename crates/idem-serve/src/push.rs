//! Push mode: each new message goes to the application's HTTP endpoint.

use std::time::Duration;

use idem_core::engine::{Context, HandlerError};
use idem_core::extract::Envelope;
use idem_core::redact;
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject as _;

/// Longest `Retry-After` push mode waits for in place (longer: the message goes back to the
/// broker and is redelivered after its retry delay).
pub const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(30);

/// Most of an error response's body kept in the dead-letter reason.
const REASON_BODY: usize = 512;

/// Default [`Pusher::max_response_bytes`]: the engine's default limit on a stored result.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 64 * 1024;

/// Why a push did not succeed. [`Pusher::push`] wraps it in a [`HandlerError`]: `Transient`
/// (the message is retried) or `Permanent` (dead-lettered with this text as its reason).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PushError {
    /// The application answered with a status other than 2xx.
    #[error("the application answered HTTP {status}: {body}")]
    Status {
        /// The status code.
        status: u16,
        /// The start of the response body.
        body: String,
    },
    /// The request did not get an answer (refused, reset, timed out).
    #[error("no answer from the application: {0}")]
    Transport(String),
    /// The endpoint is not an HTTP(S) URL, or the client cannot be built.
    #[error("push endpoint: {0}")]
    Config(String),
}

/// Delivers messages to an application endpoint, one POST per new message: the handler of a
/// push-mode consumer. Duplicates and conflicts never reach it (the engine answers those); what
/// reaches it carries:
///
/// | header | value |
/// |---|---|
/// | `Idempotency-Key` | the downstream key: the same on every attempt and redelivery |
/// | `Idem-Attempt` | 1, then more after a failure or a takeover |
/// | `Idem-Took-Over` | `true` when an earlier attempt's lease ran out (its write may exist) |
/// | `Idem-Fencing-Token` | the lease's token |
/// | `Idem-Scope`, `Idem-Key` | the dedup key |
/// | `Idem-Message-Id` | the broker's message id, when the message has one |
/// | `Content-Type` and each forwarded header | from the message |
///
/// The answer decides: 2xx completes the key with the response body as its stored result (the
/// broker message is then acked); 429 or 503 with `Retry-After` up to
/// [`max_retry_after`](Self::max_retry_after) is retried in place after that time; 408, other
/// 5xx, timeouts and refused connections are retried (transient); any other 4xx dead-letters
/// the message with the status and body as its reason.
///
/// What the pusher does not trust: a redirect is not followed (a 3xx is a failed push with its
/// status, retried: `307`/`308` would resend the message to wherever the answer points); the
/// `HTTP(S)_PROXY` variables are ignored (a [`proxy`](Self::proxy) is used only when given);
/// a response body is read up to [`max_response_bytes`](Self::max_response_bytes) and no
/// further; the endpoint URL is shown redacted (`idem_core::redact`) in errors, logs and
/// `Debug`.
///
/// ```
/// use std::time::Duration;
/// let pusher = idem_serve::Pusher::new("http://127.0.0.1:8080/orders", Duration::from_secs(10))?
///     .forward_headers(["traceparent"]);
/// # Ok::<_, idem_serve::PushError>(())
/// ```
#[derive(Clone)]
pub struct Pusher {
    http: reqwest::Client,
    endpoint: String,
    forward: Vec<String>,
    max_retry_after: Duration,
    max_response: usize,
    timeout: Duration,
    proxy: Option<reqwest::Proxy>,
    roots: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for Pusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pusher")
            .field("endpoint", &redact::url(&self.endpoint))
            .field("forward", &self.forward)
            .field("max_retry_after", &self.max_retry_after)
            .field("max_response", &self.max_response)
            .field("timeout", &self.timeout)
            .field("proxy", &self.proxy.is_some())
            .field("extra_roots", &self.roots.len())
            .finish_non_exhaustive()
    }
}

impl Pusher {
    /// POSTs to `endpoint`, each request given `timeout` to answer.
    ///
    /// # Errors
    /// [`PushError::Config`] when `endpoint` is not `http://` or `https://`.
    pub fn new(endpoint: &str, timeout: Duration) -> Result<Self, PushError> {
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(PushError::Config(format!(
                "{:?} must start with http:// or https://",
                redact::url(endpoint)
            )));
        }
        Ok(Self {
            http: client(timeout, None, &[])?,
            endpoint: endpoint.to_owned(),
            forward: vec!["traceparent".into(), "tracestate".into(), "correlation-id".into()],
            max_retry_after: DEFAULT_MAX_RETRY_AFTER,
            max_response: DEFAULT_MAX_RESPONSE_BYTES,
            timeout,
            proxy: None,
            roots: Vec::new(),
        })
    }

    /// The HTTP client for the current settings.
    fn client(&self) -> Result<reqwest::Client, PushError> {
        client(self.timeout, self.proxy.as_ref(), &self.roots)
    }

    /// Sends every push through the HTTP(S) proxy at `url` (by default none: pushes go
    /// straight to the endpoint, and `HTTP_PROXY`/`HTTPS_PROXY` are ignored, so an egress proxy
    /// never sees deliveries unless it is configured here).
    ///
    /// # Errors
    /// [`PushError::Config`] when `url` is not a proxy URL.
    pub fn proxy(mut self, url: &str) -> Result<Self, PushError> {
        let proxy = reqwest::Proxy::all(url).map_err(|e| {
            PushError::Config(format!("proxy {}: {}", redact::url(url), e.without_url()))
        })?;
        self.proxy = Some(proxy);
        self.http = self.client()?;
        Ok(self)
    }

    /// Also trusts the CA certificates in `pem` for an `https://` endpoint (the system's are
    /// always trusted): for an application whose certificate comes from a private CA.
    ///
    /// # Errors
    /// [`PushError::Config`] when `pem` holds no certificate or one does not parse.
    pub fn ca_pem(mut self, pem: &[u8]) -> Result<Self, PushError> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<_, _>>()
            .map_err(|e| PushError::Config(format!("CA file: {e}")))?;
        if certs.is_empty() {
            return Err(PushError::Config("CA file: no BEGIN CERTIFICATE block".into()));
        }
        self.roots.extend(certs);
        self.http = self.client()?;
        Ok(self)
    }

    /// Largest response body read (default 64 KiB, the engine's default limit on a stored
    /// result). A 2xx answer with a larger body completes the key without a stored result;
    /// an error answer's reason keeps its first 512 bytes either way.
    #[must_use]
    pub fn max_response_bytes(mut self, n: usize) -> Self {
        self.max_response = n;
        self
    }

    /// Message headers copied onto the request, besides `Content-Type` (default: `traceparent`,
    /// `tracestate`, `correlation-id`). Replaces the list.
    #[must_use]
    pub fn forward_headers<I: IntoIterator<Item = S>, S: Into<String>>(mut self, names: I) -> Self {
        self.forward = names.into_iter().map(Into::into).collect();
        self
    }

    /// Longest `Retry-After` waited for in place (default 30 s). Keep it well inside the lease.
    #[must_use]
    pub fn max_retry_after(mut self, d: Duration) -> Self {
        self.max_retry_after = d;
        self
    }

    /// The endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn headers(&self, ctx: &Context, msg: &impl Envelope) -> HeaderMap {
        let mut h = HeaderMap::new();
        let key = ctx.key().map(ToString::to_string);
        let mut put = |name: &str, value: &str| {
            match (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(value)) {
                (Ok(n), Ok(v)) => {
                    h.insert(n, v);
                }
                // Not sent: say which header of which message, never its value.
                _ => {
                    tracing::warn!(target: "idem", header = name, key = key.as_deref().unwrap_or(""),
                    "header not forwarded: not a valid HTTP header name or value")
                }
            }
        };
        put("content-type", msg.header("content-type").unwrap_or("application/octet-stream"));
        for name in &self.forward {
            if let Some(v) = msg.header(name) {
                put(name, v);
            }
        }
        if let Some(k) = ctx.downstream_key() {
            put("idempotency-key", k);
        }
        if let Some(k) = ctx.key() {
            put("idem-scope", k.scope());
            put("idem-key", k.id());
        }
        put("idem-attempt", &ctx.attempt().to_string());
        put("idem-fencing-token", &ctx.fencing_token().to_string());
        if ctx.took_over_expired() {
            put("idem-took-over", "true");
        }
        if let Some(id) = msg.message_id() {
            put("idem-message-id", id);
        }
        h
    }

    /// Delivers one message: `Ok(body)` on 2xx (stored as the key's result: the body itself
    /// when it is JSON, else as a JSON string), else the failure and whether to retry it.
    ///
    /// # Errors
    /// `HandlerError::Transient` for timeouts, 408, 429, 5xx and transport failures;
    /// `HandlerError::Permanent` for any other non-2xx answer.
    pub async fn push(
        &self,
        ctx: &Context,
        msg: &impl Envelope,
    ) -> Result<serde_json::Value, HandlerError<PushError>> {
        let headers = self.headers(ctx, msg);
        let body = msg.payload().to_vec();
        let mut waited = Duration::ZERO;
        loop {
            let sent = self
                .http
                .post(&self.endpoint)
                .headers(headers.clone())
                .body(body.clone())
                .send()
                .await;
            let mut res = match sent {
                Ok(r) => r,
                Err(e) => {
                    metrics::counter!("idem_push_requests_total", "status" => "error").increment(1);
                    return Err(HandlerError::Transient(PushError::Transport(error_text(e))));
                }
            };
            let status = res.status();
            metrics::counter!("idem_push_requests_total", "status" => status.as_u16().to_string())
                .increment(1);
            let retry_after = retry_after(res.headers());
            let (bytes, whole) = read_up_to(&mut res, self.max_response).await;
            let text = String::from_utf8_lossy(&bytes).into_owned();
            if status.is_success() {
                if !whole {
                    tracing::warn!(target: "idem", key = %ctx.key().map(ToString::to_string).unwrap_or_default(),
                        limit = self.max_response, "push answer larger than max_response_bytes; not stored");
                    return Ok(serde_json::Value::Null);
                }
                // The engine stores a handler's value as JSON: a JSON body as itself, not as a
                // string holding it.
                return Ok(serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text)));
            }
            let err = PushError::Status { status: status.as_u16(), body: truncate(&text) };
            match status {
                StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
                    match retry_after {
                        Some(d) if waited + d <= self.max_retry_after => {
                            waited += d;
                            tokio::time::sleep(d).await;
                        }
                        _ => return Err(HandlerError::Transient(err)),
                    }
                }
                StatusCode::REQUEST_TIMEOUT => return Err(HandlerError::Transient(err)),
                s if s.is_client_error() => return Err(HandlerError::Permanent(err)),
                _ => return Err(HandlerError::Transient(err)),
            }
        }
    }
}

/// A `Retry-After` in seconds (the HTTP-date form is treated as absent).
fn retry_after(h: &HeaderMap) -> Option<Duration> {
    let secs: f64 = h.get(RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(86_400.0)))
}

fn truncate(s: &str) -> String {
    if s.len() <= REASON_BODY {
        return s.to_owned();
    }
    let mut end = REASON_BODY;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// An HTTP client that follows no redirect and takes no proxy from the environment: only
/// `proxy`, when given.
fn client(
    timeout: Duration,
    proxy: Option<&reqwest::Proxy>,
    roots: &[CertificateDer<'static>],
) -> Result<reqwest::Client, PushError> {
    let builder = crate::tls::client_builder(roots)
        .map_err(PushError::Config)?
        .timeout(timeout)
        .connect_timeout(timeout)
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy();
    let builder = match proxy {
        Some(p) => builder.proxy(p.clone()),
        None => builder,
    };
    builder.build().map_err(|e| PushError::Config(e.to_string()))
}

/// Reads at most `limit` bytes of `res`'s body (and no further); whether that was all of it.
/// A body that fails midway counts as what was read.
async fn read_up_to(res: &mut reqwest::Response, limit: usize) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    loop {
        match res.chunk().await {
            Ok(Some(chunk)) => {
                if out.len() + chunk.len() > limit {
                    out.extend_from_slice(&chunk[..limit - out.len()]);
                    return (out, false);
                }
                out.extend_from_slice(&chunk);
            }
            Ok(None) | Err(_) => return (out, true),
        }
    }
}

/// A transport failure in words, without the URL (it may carry a password).
fn error_text(e: reqwest::Error) -> String {
    let e = e.without_url();
    if e.is_timeout() {
        "timed out".to_owned()
    } else if e.is_connect() {
        format!("could not connect: {}", idem_core::ErrorChain(&e))
    } else {
        idem_core::ErrorChain(&e).to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_only() {
        let mut h = HeaderMap::new();
        h.insert(RETRY_AFTER, HeaderValue::from_static("2"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(2)));
        h.insert(RETRY_AFTER, HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"));
        assert_eq!(retry_after(&h), None);
    }

    #[test]
    fn long_bodies_are_cut_on_a_char_boundary() {
        let s = "é".repeat(400);
        let t = truncate(&s);
        assert!(t.len() <= REASON_BODY + "…".len());
        assert!(t.ends_with('…'));
        assert_eq!(PushError::Config("x".into()).to_string(), "push endpoint: x");
        assert!(Pusher::new("ftp://x", Duration::from_secs(1)).is_err());
    }
}
