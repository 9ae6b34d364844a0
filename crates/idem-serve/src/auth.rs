//! API tokens, each limited to a set of scopes.

use std::collections::BTreeSet;
use std::fmt;

use axum::http::HeaderMap;
use axum::http::header::AUTHORIZATION;
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;

use crate::error::ApiError;

/// Shortest secret a token may have: 16 bytes.
pub const MIN_SECRET_LEN: usize = 16;

/// The scopes a token may use: listed, or all (`*`). Store-wide operations (purge, stats and
/// listings without a scope) need `*`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scopes {
    /// Every scope, and the store-wide operations.
    All,
    /// Only these scopes.
    Only(BTreeSet<String>),
}

impl Scopes {
    /// From a list in which `*` means all.
    pub fn from_list<I: IntoIterator<Item = S>, S: Into<String>>(list: I) -> Self {
        let set: BTreeSet<String> = list.into_iter().map(Into::into).collect();
        if set.contains("*") { Self::All } else { Self::Only(set) }
    }

    fn allows(&self, scope: &str) -> bool {
        match self {
            Self::All => true,
            Self::Only(set) => set.contains(scope),
        }
    }
}

/// One API token: a name (shown in logs and errors), the SHA-256 of its secret (the secret itself
/// is not kept), and its scopes.
#[derive(Clone)]
pub struct Token {
    name: String,
    digest: [u8; 32],
    scopes: Scopes,
}

impl fmt::Debug for Token {
    // Neither the secret nor its digest reaches a log line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Token").field("name", &self.name).field("scopes", &self.scopes).finish()
    }
}

/// A token could not be configured.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The secret is shorter than [`MIN_SECRET_LEN`].
    #[error("token {name}: the secret is {len} bytes, shorter than the minimum of {min} bytes")]
    TooShort {
        /// The token's name.
        name: String,
        /// The secret's length.
        len: usize,
        /// [`MIN_SECRET_LEN`].
        min: usize,
    },
    /// The token lists no scope.
    #[error("token {0}: no scope (list the scopes it may use, or \"*\" for all)")]
    NoScope(String),
    /// Two tokens share a name or a secret.
    #[error("token {0}: its name or secret is another token's too")]
    Duplicate(String),
    /// A name or scope that cannot be one.
    #[error("token {name}: {problem}")]
    Invalid {
        /// The token's name.
        name: String,
        /// What is wrong.
        problem: String,
    },
}

impl Token {
    /// A token named `name` with the given secret and scopes.
    ///
    /// # Errors
    /// [`TokenError`] when the secret is shorter than 16 bytes, the scope list is empty, or the
    /// name is empty.
    pub fn new(name: &str, secret: &str, scopes: Scopes) -> Result<Self, TokenError> {
        if name.is_empty() || name.chars().any(char::is_control) {
            return Err(TokenError::Invalid {
                name: name.escape_debug().to_string(),
                problem: "the name must be non-empty printable text".into(),
            });
        }
        if secret.len() < MIN_SECRET_LEN {
            return Err(TokenError::TooShort {
                name: name.to_owned(),
                len: secret.len(),
                min: MIN_SECRET_LEN,
            });
        }
        if matches!(&scopes, Scopes::Only(s) if s.is_empty()) {
            return Err(TokenError::NoScope(name.to_owned()));
        }
        Ok(Self { name: name.to_owned(), digest: digest(secret.as_bytes()), scopes })
    }

    /// The token's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

fn digest(secret: &[u8]) -> [u8; 32] {
    Sha256::digest(secret).into()
}

/// Who may call the API.
#[derive(Debug, Clone)]
pub struct Tokens {
    tokens: Vec<Token>,
    anonymous: bool,
}

/// The caller of one request, once authenticated.
#[derive(Debug, Clone)]
pub struct Caller {
    name: String,
    scopes: Scopes,
}

impl Tokens {
    /// Only these tokens.
    ///
    /// # Errors
    /// [`TokenError::Duplicate`] when two tokens share a name or secret.
    pub fn new(tokens: Vec<Token>) -> Result<Self, TokenError> {
        for (i, t) in tokens.iter().enumerate() {
            if tokens[..i].iter().any(|o| o.name == t.name || o.digest == t.digest) {
                return Err(TokenError::Duplicate(t.name.clone()));
            }
        }
        Ok(Self { tokens, anonymous: false })
    }

    /// No authentication: every caller may use every scope. For a listener only the
    /// application's own pod can reach (a sidecar on `127.0.0.1`), never a shared service.
    pub fn anonymous() -> Self {
        Self { tokens: Vec::new(), anonymous: true }
    }

    /// Whether requests need no token.
    pub fn is_anonymous(&self) -> bool {
        self.anonymous
    }

    /// How many tokens there are.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there is no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The caller of a request with these headers.
    ///
    /// Every configured token is compared, each in constant time, whichever matches: the time
    /// taken says nothing about which token, or how much of one, a guess got right.
    ///
    /// # Errors
    /// [`ApiError::Unauthorized`] when the header is missing, not `Bearer`, or no token matches.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        if self.anonymous {
            return Ok(Caller { name: "anonymous".into(), scopes: Scopes::All });
        }
        let value = headers
            .get(AUTHORIZATION)
            .ok_or(ApiError::Unauthorized("missing Authorization: Bearer <token>"))?;
        let secret = value
            .to_str()
            .ok()
            // The scheme is case-insensitive (RFC 9110 §11.1): `Bearer`, `bearer`, `BEARER`.
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token)
            .ok_or(ApiError::Unauthorized("Authorization must be Bearer <token>"))?
            .trim();
        let presented = digest(secret.as_bytes());
        let mut found: Option<&Token> = None;
        for t in &self.tokens {
            if bool::from(t.digest.ct_eq(&presented)) {
                found = Some(t);
            }
        }
        let t = found.ok_or(ApiError::Unauthorized("unknown token"))?;
        Ok(Caller { name: t.name.clone(), scopes: t.scopes.clone() })
    }
}

/// Anonymous access answers only requests addressed to a loopback name (`localhost`,
/// `127.0.0.1`, `[::1]`, with any port): a web page whose own name an attacker re-pointed at
/// 127.0.0.1 (DNS rebinding) sends its name as the `Host`, and is refused `403`. A request that
/// names no host is let through: no browser sends one.
pub(crate) async fn loopback_host_only(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let host = req.uri().authority().map(|a| a.host().to_owned()).or_else(|| {
        let value = req.headers().get(axum::http::header::HOST)?;
        // A `Host` that does not parse names no loopback host: refused below.
        let authority =
            value.to_str().ok().and_then(|v| v.parse::<axum::http::uri::Authority>().ok());
        Some(authority.map_or_else(String::new, |a| a.host().to_owned()))
    });
    // No name at all is no browser's request (HTTP/1.1 requires `Host`; HTTP/2 sends
    // `:authority`): in-process callers and raw HTTP/1.0 clients.
    if host.as_deref().is_none_or(is_loopback_name) {
        return next.run(req).await;
    }
    let e = ApiError::Forbidden {
        token: "anonymous".into(),
        what: format!(
            "host {:?} (anonymous access answers only localhost, 127.0.0.1 and [::1])",
            host.unwrap_or_default()
        ),
    };
    e.respond(crate::grpc::is_grpc(req.headers()))
}

/// `localhost`, `*.localhost`, or a loopback address (`[::1]` with its brackets).
fn is_loopback_name(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost"
        || host.ends_with(".localhost")
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl Caller {
    /// The token's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The scopes it may use (the console lists exactly these).
    pub(crate) fn scopes(&self) -> &Scopes {
        &self.scopes
    }

    /// Refuses a scope the token is not allowed.
    ///
    /// # Errors
    /// [`ApiError::Forbidden`] naming the token and the scope.
    pub fn may_use(&self, scope: &str) -> Result<(), ApiError> {
        if self.scopes.allows(scope) {
            Ok(())
        } else {
            Err(ApiError::Forbidden {
                token: self.name.clone(),
                what: format!("scope {:?}", scope.escape_debug().to_string()),
            })
        }
    }

    /// Refuses a store-wide operation (purge; stats or listings of every scope) to a token
    /// without `*`.
    ///
    /// # Errors
    /// [`ApiError::Forbidden`] naming the token and the operation.
    pub fn may_use_all(&self, what: &str) -> Result<(), ApiError> {
        if self.scopes == Scopes::All {
            Ok(())
        } else {
            Err(ApiError::Forbidden {
                token: self.name.clone(),
                what: format!("{what} (it needs a token with scope \"*\")"),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(v: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, v.parse().expect("header"));
        h
    }

    #[test]
    fn a_token_opens_only_its_scopes() {
        let tokens = Tokens::new(vec![
            Token::new("orders", "orders-secret-0123456789", Scopes::from_list(["orders"]))
                .expect("token"),
            Token::new("ops", "ops-secret-0123456789abc", Scopes::from_list(["*"])).expect("token"),
        ])
        .expect("tokens");
        let c = tokens.authenticate(&headers("Bearer orders-secret-0123456789")).expect("known");
        for scheme in ["bearer", "BEARER", "BeArEr"] {
            let h = headers(&format!("{scheme} orders-secret-0123456789"));
            assert_eq!(tokens.authenticate(&h).expect("any case").name, "orders", "{scheme}");
        }
        assert_eq!(c.name(), "orders");
        assert!(c.may_use("orders").is_ok());
        assert!(matches!(c.may_use("payments"), Err(ApiError::Forbidden { .. })));
        for name in ["localhost", "LOCALHOST.", "app.localhost", "127.0.0.1", "127.1.2.3", "[::1]"]
        {
            assert!(super::is_loopback_name(name), "{name}");
        }
        for name in ["evil.example", "localhost.evil.example", "10.0.0.1", "[::2]", ""] {
            assert!(!super::is_loopback_name(name), "{name}");
        }
        assert!(c.may_use_all("purge").is_err());
        let ops = tokens.authenticate(&headers("Bearer ops-secret-0123456789abc")).expect("ops");
        assert!(ops.may_use_all("purge").is_ok());
        for bad in ["Bearer nope-nope-nope-nope", "Basic b3JkZXJz", "orders-secret-0123456789"] {
            assert!(matches!(tokens.authenticate(&headers(bad)), Err(ApiError::Unauthorized(_))));
        }
        assert!(tokens.authenticate(&HeaderMap::new()).is_err());
    }

    #[test]
    fn weak_or_duplicate_tokens_are_refused() {
        assert!(matches!(
            Token::new("a", "short", Scopes::All),
            Err(TokenError::TooShort { len: 5, min: 16, .. })
        ));
        assert!(matches!(
            Token::new("a", "long-enough-secret", Scopes::from_list(Vec::<String>::new())),
            Err(TokenError::NoScope(_))
        ));
        let t = Token::new("a", "long-enough-secret", Scopes::All).expect("token");
        let u = Token::new("b", "long-enough-secret", Scopes::All).expect("token");
        assert!(matches!(Tokens::new(vec![t, u]), Err(TokenError::Duplicate(_))));
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let t = Token::new("a", "super-secret-value-1", Scopes::All).expect("token");
        let shown = format!("{t:?} {:?}", Tokens::new(vec![t.clone()]).expect("tokens"));
        assert!(!shown.contains("super-secret"), "{shown}");
    }
}
