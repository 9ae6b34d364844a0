//! RFC 9457 problem details: the bodies of the layer's own error responses.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// The problems the layer answers with, one per status and cause.
///
/// The `type` of each problem document is this enum's documentation anchor
/// (`…/idem_http/enum.ProblemKind.html#variant.Missing`), so a client following it reads this list.
/// The exceptions are the server's own setup mistakes ([`NoPrincipal`](Self::NoPrincipal),
/// [`NoPrincipalKey`](Self::NoPrincipalKey)): the client gets a plain `500` (`type`
/// `about:blank`, title `Internal Server Error`) that says nothing about how the server is
/// built, and the server's log says what to fix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// `400`: the route requires an `Idempotency-Key` and the request has none.
    Missing,
    /// `400`: the key is empty, too long, repeated, badly quoted or has a control character.
    Malformed,
    /// `409`: a request with this key is still being processed; retry after `Retry-After`.
    InProgress,
    /// `422`: the key was already used for a different request (method, path or body differ).
    Reused,
    /// `413`: the request body is larger than the layer fingerprints.
    BodyTooLarge,
    /// `400`: the request body could not be read.
    BodyUnreadable,
    /// `503`: the dedup store could not be reached; retry after `Retry-After`.
    StoreUnavailable,
    /// `500`: the stored response for this key does not decode.
    StoredResponseCorrupt,
    /// `409`: a request with this key was processed, but its response was larger than the layer
    /// stores (or, with the engine's expired-lease policy set to park, an earlier attempt ran
    /// out of time and its effect is unknown); the handler is not run again. An operator may
    /// release the key.
    ResponseNotStored,
    /// `500`: earlier attempts of a request with this key ended without an answer (the server
    /// died or hung past the lease) more times than the engine's crash-loop limit; the handler
    /// is not run for this attempt, and the key is failed (a later retry runs it again).
    CrashLoop,
    /// `500`: a request with a key reached the layer without a
    /// [`Principal`](crate::Principal): the authentication runs after the layer instead of
    /// before it (or lets the caller through without one). The handler does not run. See
    /// [`IdempotencyKeyLayer::allow_anonymous`](crate::IdempotencyKeyLayer::allow_anonymous).
    /// Sent as a plain `500`; the advice goes to the server's log, once per process.
    NoPrincipal,
    /// `500`: a request with a key and a [`Principal`](crate::Principal) reached a layer built
    /// without a [`PrincipalKey`](crate::PrincipalKey) to hash it with. The handler does not
    /// run. Sent as a plain `500`; the advice goes to the server's log, once per process.
    NoPrincipalKey,
    /// `500`: the handler's response body failed while it was read for storing; the key is
    /// released.
    ResponseUnreadable,
}

impl ProblemKind {
    /// The HTTP status this problem is sent with.
    pub fn status(self) -> StatusCode {
        match self {
            Self::Missing | Self::Malformed | Self::BodyUnreadable => StatusCode::BAD_REQUEST,
            Self::InProgress | Self::ResponseNotStored => StatusCode::CONFLICT,
            Self::Reused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::StoredResponseCorrupt
            | Self::NoPrincipal
            | Self::NoPrincipalKey
            | Self::ResponseUnreadable
            | Self::CrashLoop => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The problem's `title` (the titles of the IETF draft where it gives one).
    pub fn title(self) -> &'static str {
        match self {
            Self::Missing => "Idempotency-Key is missing",
            Self::Malformed => "Idempotency-Key is malformed",
            Self::InProgress => "A request is outstanding for this Idempotency-Key",
            Self::Reused => "Idempotency-Key is already used",
            Self::BodyTooLarge => "Request body is too large for an idempotent request",
            Self::BodyUnreadable => "Request body could not be read",
            Self::StoreUnavailable => "Idempotency store is unavailable",
            Self::StoredResponseCorrupt => "Stored response could not be read",
            Self::ResponseNotStored => "Request was processed; its response was not stored",
            Self::NoPrincipal | Self::NoPrincipalKey => "Internal Server Error",
            Self::ResponseUnreadable => "Response body failed",
            Self::CrashLoop => "Request failed the server repeatedly",
        }
    }

    /// The problem's `type`: a URI naming this variant, or `about:blank` for the server's setup
    /// mistakes.
    pub fn type_uri(self) -> &'static str {
        macro_rules! anchor {
            ($v:literal) => {
                concat!(
                    "https://docs.rs/idem-http/latest/idem_http/enum.ProblemKind.html#variant.",
                    $v
                )
            };
        }
        match self {
            Self::Missing => anchor!("Missing"),
            Self::Malformed => anchor!("Malformed"),
            Self::InProgress => anchor!("InProgress"),
            Self::Reused => anchor!("Reused"),
            Self::BodyTooLarge => anchor!("BodyTooLarge"),
            Self::BodyUnreadable => anchor!("BodyUnreadable"),
            Self::StoreUnavailable => anchor!("StoreUnavailable"),
            Self::StoredResponseCorrupt => anchor!("StoredResponseCorrupt"),
            Self::ResponseNotStored => anchor!("ResponseNotStored"),
            // RFC 9457: `about:blank` when the problem has no semantics beyond the status.
            Self::NoPrincipal | Self::NoPrincipalKey => "about:blank",
            Self::ResponseUnreadable => anchor!("ResponseUnreadable"),
            Self::CrashLoop => anchor!("CrashLoop"),
        }
    }
}

/// One problem document (RFC 9457), rendered as `application/problem+json`.
///
/// ```
/// use idem_http::{Problem, ProblemKind};
///
/// let p = Problem::new(ProblemKind::Missing, "POST /payments requires an Idempotency-Key header");
/// let body = p.to_json();
/// assert!(body.contains(r#""status":400"#));
/// assert!(body.contains("Idempotency-Key is missing"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    kind: ProblemKind,
    detail: String,
    retry_after: Option<Duration>,
}

impl Problem {
    /// A problem of `kind` with a `detail` for this occurrence.
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self { kind, detail: detail.into(), retry_after: None }
    }

    /// Adds a `Retry-After` header (whole seconds, rounded up, at least 1).
    #[must_use]
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// What kind of problem this is.
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The occurrence's detail.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The JSON document.
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "type": self.kind.type_uri(),
            "title": self.kind.title(),
            "status": self.kind.status().as_u16(),
            "detail": self.detail,
        })
        .to_string()
    }

    /// The response: status, `Content-Type: application/problem+json`, `Retry-After` if set.
    pub fn into_response<B: From<Bytes>>(self) -> Response<B> {
        let mut res = Response::new(B::from(Bytes::from(self.to_json())));
        *res.status_mut() = self.kind.status();
        let h = res.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if let Some(after) = self.retry_after {
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        res
    }
}

#[cfg(feature = "axum")]
impl axum::response::IntoResponse for Problem {
    fn into_response(self) -> axum::response::Response {
        Problem::into_response(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_rfc9457_with_retry_after() {
        let res: Response<Bytes> = Problem::new(ProblemKind::InProgress, "wait")
            .retry_after(Duration::from_millis(1_500))
            .into_response();
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert_eq!(res.headers()[header::RETRY_AFTER], "2");
        assert_eq!(res.headers()[header::CONTENT_TYPE], "application/problem+json");
        let v: serde_json::Value = serde_json::from_slice(res.body()).unwrap();
        assert_eq!(v["status"], 409);
        assert_eq!(v["detail"], "wait");
        assert!(v["type"].as_str().unwrap().ends_with("#variant.InProgress"));
    }
}
