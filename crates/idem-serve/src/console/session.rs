//! Console sessions: login with an API token, a cookie naming a server-side session, and the
//! CSRF token every action must carry.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

use super::ConsoleState;
use super::html::{self, ConsoleError, esc};
use crate::auth::Caller;

/// The session cookie's name.
pub(crate) const COOKIE: &str = "idem_console";
/// Sessions kept at most; past it, the oldest is dropped.
const MAX_SESSIONS: usize = 1024;
/// The largest form a console action reads.
const MAX_FORM_BYTES: usize = 256 << 10;
/// The longest token the login form takes.
const MAX_TOKEN_LEN: usize = 1024;

/// The live sessions, by the SHA-256 of their id (an id never sits in memory as a lookup key
/// an attacker could time).
#[derive(Default)]
pub(crate) struct Sessions {
    map: Mutex<HashMap<[u8; 32], Session>>,
}

struct Session {
    caller: Caller,
    csrf: String,
    created: Instant,
    expires: Instant,
    flash: Option<String>,
}

fn digest(id: &str) -> [u8; 32] {
    Sha256::digest(id.as_bytes()).into()
}

fn random_hex() -> Result<String, ConsoleError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| {
        ConsoleError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("the OS's random source failed: {e}"),
        )
    })?;
    Ok(hex::encode(b))
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Session>> {
        self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A new session for `caller`; returns its id (the cookie's value).
    fn create(&self, caller: Caller, ttl: std::time::Duration) -> Result<String, ConsoleError> {
        let id = random_hex()?;
        let csrf = random_hex()?;
        let now = Instant::now();
        let mut map = self.lock();
        map.retain(|_, s| s.expires > now);
        if map.len() >= MAX_SESSIONS
            && let Some(oldest) = map.iter().min_by_key(|(_, s)| s.created).map(|(k, _)| *k)
        {
            map.remove(&oldest);
        }
        map.insert(
            digest(&id),
            Session { caller, csrf, created: now, expires: now + ttl, flash: None },
        );
        Ok(id)
    }

    /// The live session `id`; with `take_flash`, its flash message too (only a page shows it:
    /// the charts' polling must not swallow it).
    fn open(&self, id: &str, take_flash: bool) -> Option<Viewer> {
        let mut map = self.lock();
        let key = digest(id);
        let s = map.get_mut(&key)?;
        if s.expires <= Instant::now() {
            map.remove(&key);
            return None;
        }
        Some(Viewer {
            caller: s.caller.clone(),
            csrf: s.csrf.clone(),
            flash: if take_flash { s.flash.take() } else { None },
            sid: id.to_owned(),
        })
    }

    /// Shows `html` once, on the session's next page.
    pub(crate) fn flash(&self, id: &str, html: String) {
        if let Some(s) = self.lock().get_mut(&digest(id)) {
            s.flash = Some(html);
        }
    }

    fn remove(&self, id: &str) {
        self.lock().remove(&digest(id));
    }
}

/// The operator of a page: a live session.
pub(crate) struct Viewer {
    /// Who logged in, with the token's scopes.
    pub(crate) caller: Caller,
    /// The token every action of this session carries.
    pub(crate) csrf: String,
    /// What the last action did, shown once.
    pub(crate) flash: Option<String>,
    sid: String,
}

impl Viewer {
    /// Shows `html` on this session's next page.
    pub(crate) fn flash(&self, s: &ConsoleState, html: String) {
        s.sessions.flash(&self.sid, html);
    }
}

fn cookie(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v)
        .filter(|v| v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()))
}

impl FromRequestParts<ConsoleState> for Viewer {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, s: &ConsoleState) -> Result<Self, Response> {
        let json = parts.uri.path().ends_with(".json");
        if let Some(v) = cookie(&parts.headers).and_then(|id| s.sessions.open(id, !json)) {
            return Ok(v);
        }
        if json {
            let body = serde_json::json!({ "error": "not logged in (or the session expired)" });
            return Err((StatusCode::UNAUTHORIZED, axum::Json(body)).into_response());
        }
        Err(Redirect::to("/console/login").into_response())
    }
}

/// Which POSTs a read-only console refuses.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Gate {
    /// Changes something: refused when read-only.
    Action,
    /// Logging out: allowed when read-only.
    Logout,
}

/// A form's fields, in order (a field may repeat).
pub(crate) struct Form(Vec<(String, String)>);

impl Form {
    fn parse(body: &[u8]) -> Self {
        Self(form_urlencoded::parse(body).into_owned().collect())
    }

    /// The first value of `name`.
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// Every value of `name`.
    pub(crate) fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0.iter().filter(move |(k, _)| k == name).map(|(_, v)| v.as_str())
    }

    /// The value of `name`: present, non-empty, at most `max` bytes.
    pub(crate) fn required(&self, name: &str, max: usize) -> Result<&str, ConsoleError> {
        let v = self.get(name).map(str::trim).unwrap_or_default();
        if v.is_empty() {
            return Err(ConsoleError::bad_request(format!("{name}: missing")));
        }
        if v.len() > max {
            return Err(ConsoleError::bad_request(format!(
                "{name}: {} bytes, more than the limit of {max}",
                v.len()
            )));
        }
        Ok(v)
    }
}

/// An action: a POST from a live session, with its CSRF token, on a console that allows it.
pub(crate) struct Action {
    pub(crate) viewer: Viewer,
    pub(crate) form: Form,
}

impl FromRequest<ConsoleState> for Action {
    type Rejection = ConsoleError;

    async fn from_request(req: Request, s: &ConsoleState) -> Result<Self, ConsoleError> {
        let (viewer, form) = verify_post(s, req, Gate::Action).await?;
        Ok(Self { viewer, form })
    }
}

/// Refuses a POST from another origin: a browser names the page that sent it in `Origin`.
fn same_origin(headers: &HeaderMap) -> Result<(), ConsoleError> {
    let Some(origin) = headers.get(header::ORIGIN) else { return Ok(()) };
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    let origin_host = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .map(|(_, rest)| rest.trim_end_matches('/'));
    match (origin_host, host) {
        (Some(o), Some(h)) if o.eq_ignore_ascii_case(h) => Ok(()),
        _ => Err(ConsoleError::forbidden("the request comes from another origin")),
    }
}

async fn read_form(req: Request) -> Result<Form, ConsoleError> {
    let form_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if !form_type {
        return Err(ConsoleError::bad_request(
            "the body must be a form (application/x-www-form-urlencoded)",
        ));
    }
    let body = axum::body::to_bytes(req.into_body(), MAX_FORM_BYTES).await.map_err(|_| {
        ConsoleError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the form is larger than {MAX_FORM_BYTES} bytes (select fewer letters)"),
        )
    })?;
    Ok(Form::parse(&body))
}

async fn verify_post(
    s: &ConsoleState,
    req: Request,
    gate: Gate,
) -> Result<(Viewer, Form), ConsoleError> {
    if gate == Gate::Action && s.console.read_only {
        return Err(ConsoleError::forbidden("this console is read-only"));
    }
    same_origin(req.headers())?;
    let viewer = cookie(req.headers())
        .and_then(|id| s.sessions.open(id, false))
        .ok_or_else(|| ConsoleError::forbidden("no session (log in again)"))?;
    let form = read_form(req).await?;
    let presented = form.get("csrf").unwrap_or_default();
    if !bool::from(presented.as_bytes().ct_eq(viewer.csrf.as_bytes())) {
        return Err(ConsoleError::forbidden("missing or wrong CSRF token (reload the page)"));
    }
    Ok((viewer, form))
}

fn set_cookie(s: &ConsoleState, value: &str, max_age: u64) -> HeaderValue {
    let secure = if s.console.secure_cookie { "; Secure" } else { "" };
    let c = format!(
        "{COOKIE}={value}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"
    );
    HeaderValue::from_str(&c)
        .unwrap_or_else(|_| HeaderValue::from_static("idem_console=; Max-Age=0"))
}

fn start(s: &ConsoleState, caller: Caller) -> Result<Response, ConsoleError> {
    let name = caller.name().to_owned();
    let id = s.sessions.create(caller, s.console.session_ttl)?;
    tracing::info!(target: "idem::console", token = %name, "console login");
    let mut res = Redirect::to("/console").into_response();
    res.headers_mut()
        .insert(header::SET_COOKIE, set_cookie(s, &id, s.console.session_ttl.as_secs()));
    Ok(res)
}

/// `GET /console/login`: the form (or, without tokens, a session at once).
pub(crate) async fn login_page(State(s): State<ConsoleState>) -> Result<Response, ConsoleError> {
    if s.app.tokens.is_anonymous() {
        let caller = s.app.tokens.authenticate(&HeaderMap::new())?;
        return start(&s, caller);
    }
    Ok(login_form(StatusCode::OK, None))
}

fn login_form(status: StatusCode, error: Option<&str>) -> Response {
    let error = error
        .map(|e| format!("<p class=\"error\" role=\"alert\">{}</p>", esc(e)))
        .unwrap_or_default();
    let body = format!(
        "<form class=\"login\" method=\"post\" action=\"/console/login\">\
         <h1>idem console</h1>{error}\
         <label for=\"token\">API token</label>\
         <input id=\"token\" name=\"token\" type=\"password\" autocomplete=\"off\" required \
         maxlength=\"{MAX_TOKEN_LEN}\" autofocus>\
         <p class=\"hint\">The same token as for the API (<code>Authorization: Bearer …</code>): \
         the console shows only what its scopes allow.</p>\
         <button type=\"submit\">Log in</button></form>"
    );
    html::bare_page(status, "Log in", &body)
}

/// `POST /console/login`: a token for a session.
pub(crate) async fn login(State(s): State<ConsoleState>, req: Request) -> Response {
    let run = async {
        same_origin(req.headers())?;
        let form = read_form(req).await?;
        let token = form.get("token").map(str::trim).unwrap_or_default();
        if token.is_empty() || token.len() > MAX_TOKEN_LEN {
            return Ok(login_form(StatusCode::BAD_REQUEST, Some("paste an API token")));
        }
        let mut headers = HeaderMap::new();
        let Ok(bearer) = HeaderValue::from_str(&format!("Bearer {token}")) else {
            return Ok(login_form(
                StatusCode::BAD_REQUEST,
                Some("the token has invalid characters"),
            ));
        };
        headers.insert(header::AUTHORIZATION, bearer);
        match s.app.tokens.authenticate(&headers) {
            Ok(caller) => start(&s, caller),
            Err(_) => {
                tracing::info!(target: "idem::console", "console login refused: unknown token");
                Ok(login_form(StatusCode::UNAUTHORIZED, Some("unknown token")))
            }
        }
    };
    run.await.unwrap_or_else(|e: ConsoleError| e.into_response())
}

/// `POST /console/logout`: ends the session.
pub(crate) async fn logout(State(s): State<ConsoleState>, req: Request) -> Response {
    match verify_post(&s, req, Gate::Logout).await {
        Ok((viewer, _)) => {
            s.sessions.remove(&viewer.sid);
            let mut res = Redirect::to("/console/login").into_response();
            res.headers_mut().insert(header::SET_COOKIE, set_cookie(&s, "", 0));
            res
        }
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(k.clone(), v.parse().expect("value"));
        }
        h
    }

    #[test]
    fn the_cookie_is_found_among_others_and_must_look_like_an_id() {
        let id = "ab".repeat(32);
        let h = headers(&[(header::COOKIE, &format!("a=b; {COOKIE}={id}; c=d"))]);
        assert_eq!(cookie(&h), Some(id.as_str()));
        let h = headers(&[(header::COOKIE, &format!("{COOKIE}=<script>"))]);
        assert_eq!(cookie(&h), None);
    }

    #[test]
    fn another_origin_is_refused() {
        let ok =
            headers(&[(header::HOST, "127.0.0.1:7700"), (header::ORIGIN, "http://127.0.0.1:7700")]);
        assert!(same_origin(&ok).is_ok());
        let none = headers(&[(header::HOST, "127.0.0.1:7700")]);
        assert!(same_origin(&none).is_ok());
        for bad in ["http://evil.example", "null"] {
            let h = headers(&[(header::HOST, "127.0.0.1:7700"), (header::ORIGIN, bad)]);
            assert!(same_origin(&h).is_err(), "{bad}");
        }
    }

    #[test]
    fn forms_keep_repeated_fields() {
        let f = Form::parse(b"id=1-0&id=2-0&csrf=x&reason=a+b%21");
        assert_eq!(f.all("id").collect::<Vec<_>>(), ["1-0", "2-0"]);
        assert_eq!(f.get("reason"), Some("a b!"));
        assert!(f.required("missing", 10).is_err());
        assert!(f.required("reason", 2).is_err());
    }
}
