//! The API's errors: one [`Problem`] document per cause, with its status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use idem_core::StoreError;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// An error the claim API answers with. Each becomes an RFC 9457 problem document whose `type`
/// is one word (see [`Problem::kind`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// `400`: a field is missing, malformed or past its limit.
    #[error("{field} {detail}")]
    Invalid {
        /// The field, as the request names it (`lease_ms`, `lease.token`).
        field: String,
        /// What is wrong with it.
        detail: String,
        /// The limit it broke, when it is a number.
        limit: Option<u64>,
    },
    /// `401`: no `Authorization: Bearer` token, or one the server does not know.
    #[error("{0}")]
    Unauthorized(&'static str),
    /// `403`: the token is not allowed this scope (or a store-wide operation).
    #[error("token {token} may not use {what}")]
    Forbidden {
        /// The token's name (never the secret).
        token: String,
        /// The scope or operation refused.
        what: String,
    },
    /// `405`: the route exists, not with this method.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// `404`: no record for the key.
    #[error("no record for {0}")]
    NotFound(String),
    /// `409`: the lease's fencing token is stale; nothing changed.
    #[error("{0}")]
    LeaseLost(String),
    /// `413`: a result or reason is longer than the store keeps, or the request body longer than
    /// the API reads.
    #[error("{}", too_large(.field, *.len, *.limit))]
    TooLarge {
        /// `result` or `reason`.
        field: String,
        /// Its size.
        len: u64,
        /// The limit.
        limit: u64,
    },
    /// `503`: the store failed (a lost connection, a timeout); `retryable` says whether trying
    /// again may help. Converted from a [`StoreError`], the detail names no store internals
    /// (they are logged at warn, `target=idem::api`).
    #[error("{detail}")]
    Unavailable {
        /// The store's error chain.
        detail: String,
        /// Whether trying again may succeed.
        retryable: bool,
    },
    /// `503`: the server is answering as many requests as it may ([`Limits::max_in_flight`](crate::Limits::max_in_flight));
    /// try again shortly (`Retry-After: 1`).
    #[error("the server is answering as many requests as it may; try again")]
    Busy,
    /// `408`: the request was not read and answered within the request timeout.
    #[error("the request was not read and answered within {ms} ms")]
    RequestTimeout {
        /// The bound, in ms.
        ms: u64,
    },
    /// `500`: the store holds something that does not decode, or is not migrated.
    #[error("{detail}")]
    Internal {
        /// `corrupt`, `not_migrated` or `internal`.
        kind: &'static str,
        /// What happened.
        detail: String,
    },
}

impl ApiError {
    /// `invalid` naming `field`.
    pub(crate) fn invalid(field: &str, detail: impl Into<String>) -> Self {
        Self::Invalid { field: field.to_owned(), detail: detail.into(), limit: None }
    }

    /// `invalid` naming `field` and its limit.
    pub(crate) fn invalid_limit(field: &str, detail: impl Into<String>, limit: u64) -> Self {
        Self::Invalid { field: field.to_owned(), detail: detail.into(), limit: Some(limit) }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Invalid { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Forbidden { .. } => StatusCode::FORBIDDEN,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::LeaseLost(_) => StatusCode::CONFLICT,
            Self::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unavailable { .. } | Self::Busy => StatusCode::SERVICE_UNAVAILABLE,
            Self::RequestTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            Self::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The problem document.
    pub fn problem(&self) -> Problem {
        let status = self.status();
        let (kind, field, limit, retryable) = match self {
            Self::Invalid { field, limit, .. } => ("invalid", Some(field.clone()), *limit, false),
            Self::Unauthorized(_) => ("unauthorized", None, None, false),
            Self::Forbidden { .. } => ("forbidden", None, None, false),
            Self::NotFound(_) => ("not_found", None, None, false),
            Self::MethodNotAllowed(_) => ("method_not_allowed", None, None, false),
            Self::LeaseLost(_) => ("lease_lost", None, None, false),
            Self::TooLarge { field, limit, .. } => {
                ("too_large", Some(field.clone()), Some(*limit), false)
            }
            Self::Unavailable { retryable, .. } => ("unavailable", None, None, *retryable),
            Self::Busy => ("busy", None, None, true),
            Self::RequestTimeout { ms } => ("request_timeout", None, Some(*ms), true),
            Self::Internal { kind, .. } => (*kind, None, None, false),
        };
        Problem {
            kind: kind.to_owned(),
            title: status.canonical_reason().unwrap_or("Error").to_owned(),
            status: status.as_u16(),
            detail: self.to_string(),
            field,
            limit,
            retryable,
        }
    }

    /// Why the caller was refused, for the audit (`idem_api_denied_total{reason}`): none when
    /// the error is not a refusal of the caller.
    pub(crate) fn denial(&self) -> Option<&'static str> {
        match self {
            Self::Unauthorized(m) if m.starts_with("missing") => Some("missing_token"),
            Self::Unauthorized("unknown token") => Some("unknown_token"),
            Self::Unauthorized(_) => Some("malformed_token"),
            Self::Forbidden { .. } => Some("scope"),
            _ => None,
        }
    }

    /// The error a client gets back from a problem document.
    pub(crate) fn from_problem(p: Problem) -> Self {
        match p.kind.as_str() {
            "invalid" => Self::Invalid {
                field: p.field.unwrap_or_default(),
                detail: p.detail,
                limit: p.limit,
            },
            "lease_lost" => Self::LeaseLost(p.detail),
            "not_found" => Self::NotFound(p.detail),
            "too_large" => Self::TooLarge {
                len: len_in(&p.detail).unwrap_or(0),
                field: p.field.unwrap_or_default(),
                limit: p.limit.unwrap_or(0),
            },
            "unavailable" => Self::Unavailable { detail: p.detail, retryable: p.retryable },
            "busy" => Self::Busy,
            "request_timeout" => Self::RequestTimeout { ms: p.limit.unwrap_or(0) },
            "forbidden" => Self::Forbidden { token: String::new(), what: p.detail },
            "unauthorized" => Self::Unauthorized("the server refused the token"),
            "corrupt" => Self::Internal { kind: "corrupt", detail: p.detail },
            "not_migrated" => Self::Internal { kind: "not_migrated", detail: p.detail },
            _ => Self::Internal { kind: "internal", detail: p.detail },
        }
    }
}

/// A `too_large` detail: a stored field's length and the store's limit, or the request body's
/// limit (its length is not known: reading stopped at the limit).
fn too_large(field: &str, len: u64, limit: u64) -> String {
    if field == "body" {
        format!("the request body is longer than the API's limit of {limit} bytes")
    } else {
        format!("{field} is {len} bytes, longer than the store's limit of {limit} bytes")
    }
}

/// The length a `too_large` detail names ("result is 300 bytes, …").
fn len_in(detail: &str) -> Option<u64> {
    detail.split(" is ").nth(1)?.split(' ').next()?.parse().ok()
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match &e {
            StoreError::LeaseLost { .. } => Self::LeaseLost(e.to_string()),
            StoreError::TooLarge { field, len, limit } => Self::TooLarge {
                field: (*field).to_owned(),
                len: *len as u64,
                limit: *limit as u64,
            },
            StoreError::Corrupt { .. } => Self::Internal { kind: "corrupt", detail: e.to_string() },
            StoreError::NotMigrated { .. } => {
                Self::Internal { kind: "not_migrated", detail: e.to_string() }
            }
            _ => {
                // The store's own text (host names, statements, driver internals) stays in the
                // server's log; the caller learns that the store failed and whether to retry.
                let retryable = e.is_retryable();
                tracing::warn!(target: "idem::api", error = %idem_core::ErrorChain(&e), retryable,
                    "store call failed");
                Self::Unavailable {
                    detail: format!(
                        "the store failed{}; the server's log has its error",
                        if retryable { " (try again)" } else { "" }
                    ),
                    retryable,
                }
            }
        }
    }
}

impl ApiError {
    /// This error as the answer to a request: a problem document, or for a gRPC call a gRPC
    /// status (HTTP 200, the status in its headers). A refusal of the caller is marked on the
    /// response for the audit layer either way.
    pub(crate) fn respond(self, grpc: bool) -> Response {
        let denied = self.denial();
        let mut res = if grpc {
            crate::grpc::status(self).into_http::<axum::body::Body>()
        } else {
            self.problem_response()
        };
        if let Some(reason) = denied {
            res.extensions_mut().insert(Denied(reason));
        }
        res
    }

    fn problem_response(self) -> Response {
        let status = self.status();
        let mut res = (status, axum::Json(self.problem())).into_response();
        res.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
        if matches!(self, Self::Busy) {
            res.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if status == StatusCode::UNAUTHORIZED {
            res.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        res
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.respond(false)
    }
}

/// A refusal of the caller ([`ApiError::denial`]), carried on its response to the audit layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Denied(pub(crate) &'static str);

/// An RFC 9457 problem document: every error the API answers with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Problem {
    /// What went wrong, one word: `invalid`, `unauthorized`, `forbidden`, `not_found`,
    /// `lease_lost`, `too_large`, `unavailable`, `busy`, `request_timeout`, `corrupt`,
    /// `not_migrated`, `internal`.
    #[serde(rename = "type")]
    pub kind: String,
    /// A short summary.
    pub title: String,
    /// The HTTP status.
    pub status: u16,
    /// What happened, for a person.
    pub detail: String,
    /// The field at fault (`invalid`, `too_large`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The limit it broke, in its unit (`too_large`: bytes; `request_timeout`: ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// Whether trying again may succeed (`unavailable`, `busy`, `request_timeout`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retryable: bool,
}
