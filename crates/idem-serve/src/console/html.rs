//! The console's HTML: escaping, the page layout, errors as pages, the embedded assets.

use std::fmt::Write as _;

use axum::extract::Path;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use idem_dlq::DlqError;

use crate::error::ApiError;

const CSS: &str = include_str!("assets/console.css");
const CHARTS_JS: &str = include_str!("assets/charts.js");

/// Text made safe for HTML content and attribute values.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Text made safe for one URL path segment or query value (then escaped for HTML by `esc`
/// where it lands in an attribute: the encoding leaves no `&`, `<`, `"` or `'`).
pub(crate) fn enc(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>().replace('+', "%20")
}

/// A payload for reading: pretty JSON, text, or (not UTF-8) base64; cut at `max` bytes.
pub(crate) fn payload_text(p: &[u8], max: usize) -> String {
    let shown = &p[..p.len().min(max)];
    let mut out = match std::str::from_utf8(p) {
        Ok(text) => serde_json::from_str::<serde_json::Value>(text)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .filter(|_| p.len() <= max)
            .unwrap_or_else(|| String::from_utf8_lossy(shown).into_owned()),
        Err(_) => {
            use base64::Engine as _;
            format!(
                "(not UTF-8; base64) {}",
                base64::engine::general_purpose::STANDARD.encode(shown)
            )
        }
    };
    if p.len() > max {
        let _ = write!(out, "\n… ({} more bytes not shown)", p.len() - max);
    }
    out
}

/// A console error, shown as a page with its status.
#[derive(Debug)]
pub(crate) struct ConsoleError {
    status: StatusCode,
    message: String,
}

impl ConsoleError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into() }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub(crate) fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, message)
    }

    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// What went wrong.
    pub(crate) fn message(&self) -> &str {
        &self.message
    }
}

impl From<ApiError> for ConsoleError {
    fn from(e: ApiError) -> Self {
        Self::new(e.status(), e.to_string())
    }
}

impl From<idem_core::StoreError> for ConsoleError {
    fn from(e: idem_core::StoreError) -> Self {
        ApiError::from(e).into()
    }
}

impl From<DlqError> for ConsoleError {
    fn from(e: DlqError) -> Self {
        let status = match e {
            DlqError::TooMany { .. } => StatusCode::BAD_REQUEST,
            _ => StatusCode::BAD_GATEWAY,
        };
        Self::new(status, idem_core::ErrorChain(&e).to_string())
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let title = self.status.canonical_reason().unwrap_or("Error");
        let body = format!(
            "<main class=\"narrow\"><h1>{} {}</h1><p class=\"error\" role=\"alert\">{}</p>\
             <p><a href=\"/console\">Back to the console</a></p></main>",
            self.status.as_u16(),
            esc(title),
            esc(&self.message)
        );
        bare_page(self.status, title, &body)
    }
}

pub(super) fn secured(mut res: Response) -> Response {
    let h = res.headers_mut();
    // No inline script or style anywhere: the policy can forbid both.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
             connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}

pub(super) fn document(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{} · idem console</title>\
         <link rel=\"stylesheet\" href=\"/console/assets/console.css\"></head><body>{body}</body></html>",
        esc(title)
    )
}

/// A page without navigation (login, errors).
pub(crate) fn bare_page(status: StatusCode, title: &str, body: &str) -> Response {
    secured((status, Html(document(title, body))).into_response())
}

/// `GET /console/assets/{file}`: the stylesheet and the charts' script.
pub(crate) async fn asset(Path(file): Path<String>) -> Response {
    let (body, ty) = match file.as_str() {
        "console.css" => (CSS, "text/css; charset=utf-8"),
        "charts.js" => (CHARTS_JS, "text/javascript; charset=utf-8"),
        _ => return ConsoleError::not_found(format!("no asset {file}")).into_response(),
    };
    let mut res = ([(header::CONTENT_TYPE, ty)], body).into_response();
    res.headers_mut().insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    res.headers_mut().insert(header::CACHE_CONTROL, HeaderValue::from_static("max-age=300"));
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_everything_that_could_open_markup() {
        assert_eq!(
            esc("<a href=\"x\" onclick='y'>&</a>"),
            "&lt;a href=&quot;x&quot; onclick=&#39;y&#39;&gt;&amp;&lt;/a&gt;"
        );
        assert_eq!(enc("a b/c?d&e\"'<"), "a%20b%2Fc%3Fd%26e%22%27%3C");
    }

    #[test]
    fn payloads_are_shown_as_text_json_or_base64() {
        assert_eq!(payload_text(br#"{"b":1}"#, 100), "{\n  \"b\": 1\n}");
        assert_eq!(payload_text(b"not json", 100), "not json");
        assert!(payload_text(&[0xff, 0xfe], 100).starts_with("(not UTF-8; base64) //4="));
        assert!(payload_text(b"abcdef", 3).starts_with("abc\n… (3 more bytes"));
    }
}
