//! The secret the principal is hashed with before it enters the store or a log.

use std::fmt;

use hmac::{Hmac, Mac as _};
use sha2::Sha256;

use crate::Principal;

/// Separates this use of the secret from any other use an application makes of the same bytes.
const CONTEXT: &[u8] = b"idem-http principal\0";

/// The secret the layer hashes each [`Principal`] with (HMAC-SHA256), so that the store's records,
/// the tracing spans and the logs hold a tag of the caller, never the caller's id itself.
///
/// Required as soon as a request carries a principal: set it with
/// [`IdempotencyKeyLayer::principal_key`](crate::IdempotencyKeyLayer::principal_key). There is
/// deliberately no default. A random key per process would give the same caller another scope
/// after every restart and on every other instance, so a retry there would run the handler
/// again; a fixed key written in this crate would be a plain hash, and user ids (numbers, email
/// addresses) are few enough to be found again from it by trying them all.
///
/// Every instance serving the same routes over the same store needs the same secret, for as long
/// as stored responses are kept: a different secret is a different scope, so a retry would run
/// the handler again instead of being replayed. Load it from your secret store; rotate it only
/// when retries of requests made before the change may run again (or after the retention
/// period).
///
/// ```
/// use idem_http::PrincipalKey;
///
/// let secret = "0123456789abcdef0123456789abcdef"; // 32 bytes; load yours from a secret store
/// let key = PrincipalKey::new(secret)?;
/// assert_eq!(format!("{key:?}"), "PrincipalKey(<redacted>)");
/// assert!(PrincipalKey::new("short").is_err());
/// # Ok::<(), idem_http::PrincipalKeyError>(())
/// ```
#[derive(Clone)]
pub struct PrincipalKey(Hmac<Sha256>);

/// Why a [`PrincipalKey`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PrincipalKeyError {
    /// The secret is shorter than the minimum.
    #[error(
        "the principal key is {len} bytes long, shorter than the minimum of {min} bytes \
         (use a random secret of at least {min} bytes)"
    )]
    TooShort {
        /// Length of the secret given, in bytes.
        len: usize,
        /// The minimum length.
        min: usize,
    },
}

impl PrincipalKey {
    /// The shortest secret accepted, in bytes: the size of the hash, as RFC 2104 recommends.
    pub const MIN_LEN: usize = 32;

    /// A key from `secret`: any bytes (a random string from your secret store works), at
    /// least [`MIN_LEN`](Self::MIN_LEN) of them.
    ///
    /// # Errors
    /// [`PrincipalKeyError::TooShort`] when `secret` has fewer than 32 bytes.
    pub fn new(secret: impl AsRef<[u8]>) -> Result<Self, PrincipalKeyError> {
        let secret = secret.as_ref();
        if secret.len() < Self::MIN_LEN {
            return Err(PrincipalKeyError::TooShort { len: secret.len(), min: Self::MIN_LEN });
        }
        // HMAC takes keys of any length; the length was checked above.
        Hmac::new_from_slice(secret)
            .map(Self)
            .map_err(|_| PrincipalKeyError::TooShort { len: secret.len(), min: Self::MIN_LEN })
    }

    /// The principal's tag: HMAC-SHA256 of it under this key, in hex (64 characters).
    ///
    /// ```
    /// use idem_http::{Principal, PrincipalKey};
    ///
    /// let key = PrincipalKey::new([7u8; 32])?;
    /// let tag = key.tag(&Principal::new("customer-42"));
    /// assert_eq!(tag.len(), 64);
    /// assert!(!tag.contains("customer-42"));
    /// assert_eq!(tag, key.tag(&Principal::new("customer-42")));
    /// assert_ne!(tag, key.tag(&Principal::new("customer-43")));
    /// # Ok::<(), idem_http::PrincipalKeyError>(())
    /// ```
    pub fn tag(&self, principal: &Principal) -> String {
        let mut mac = self.0.clone();
        mac.update(CONTEXT);
        mac.update(principal.as_str().as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }
}

impl fmt::Debug for PrincipalKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PrincipalKey(<redacted>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_keyed_and_pinned() {
        let a = PrincipalKey::new([1u8; 32]).unwrap();
        let b = PrincipalKey::new([2u8; 32]).unwrap();
        let p = Principal::new("alice");
        assert_ne!(a.tag(&p), b.tag(&p), "another secret, another tag");
        // HMAC-SHA256(key = 32 × 0x01, "idem-http principal\0alice"), computed with Python's
        // hmac module: pinned, so a stored scope keeps meaning the same caller across versions.
        assert_eq!(a.tag(&p), "51904c679ed809f47ec3e5b3c272ec63cc1ac140e9606cdf6b03231d10064fc5");
    }

    #[test]
    fn short_secrets_are_refused_naming_the_limit() {
        let e = PrincipalKey::new([0u8; 31]).unwrap_err();
        assert_eq!(e, PrincipalKeyError::TooShort { len: 31, min: 32 });
        assert!(e.to_string().contains("31 bytes long, shorter than the minimum of 32"), "{e}");
    }
}
