//! What identifies a request in the store: its scope, and its fingerprint.

use std::fmt::Write as _;

use http::request;
use idem_core::{DedupKey, Fingerprint, FingerprintSpec};
use sha2::{Digest, Sha256};

/// Method, path with query, and the body as `spec` sees it.
pub(crate) fn fingerprint(
    spec: &FingerprintSpec,
    parts: &request::Parts,
    body: &[u8],
) -> Result<Option<Fingerprint>, serde_json::Error> {
    let Some(body_fp) = spec.fingerprint(body)? else { return Ok(None) };
    let path = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let mut h = Sha256::new();
    for part in [parts.method.as_str().as_bytes(), path.as_bytes(), body_fp.as_bytes()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    Ok(Some(Fingerprint(h.finalize().into())))
}

/// `{prefix} {route}` and, with a principal, ` {tag}`: the principal's keyed hash
/// ([`PrincipalKey::tag`](crate::PrincipalKey::tag), 64 hex digits), never the principal itself.
/// Routes hold no spaces and tags are hex, so distinct (route, principal) pairs never share a
/// scope. A scope the store would refuse (too long, NUL) is replaced by its hash.
pub(crate) fn scope(prefix: &str, parts: &request::Parts, principal_tag: Option<&str>) -> String {
    let mut s = format!("{prefix} {}", route(parts));
    if let Some(tag) = principal_tag {
        let _ = write!(s, " {tag}");
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
    use crate::{Principal, PrincipalKey};

    #[test]
    fn scope_holds_the_principal_tag_not_the_principal() {
        let mut parts = http::Request::new(()).into_parts().0;
        parts.uri = "/payments?x=1".parse().unwrap();
        assert_eq!(scope("http", &parts, None), "http /payments");
        let key = PrincipalKey::new([1u8; 32]).unwrap();
        let alice = key.tag(&Principal::new("alice"));
        let s = scope("http", &parts, Some(&alice));
        assert_eq!(s, format!("http /payments {alice}"));
        assert!(!s.contains("alice"), "{s}");
        assert_ne!(s, scope("http", &parts, Some(&key.tag(&Principal::new("bob")))));
        parts.uri = format!("/{}", "x".repeat(600)).parse().unwrap();
        let s = scope("http", &parts, Some(&alice));
        assert!(s.starts_with("http sha256:") && s.len() < 100, "{s}");
    }
}
