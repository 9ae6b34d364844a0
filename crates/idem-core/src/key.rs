//! Dedup keys: the `(scope, id)` pair that names one logical message.

use std::fmt;

use sha2::{Digest, Sha256};

/// Default limit, in bytes, for each of a key's two fields.
pub const DEFAULT_MAX_KEY_BYTES: usize = 512;

/// Why a key was refused. Each variant names the field (`scope` or `id`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The field is empty.
    #[error("dedup key {field} is empty")]
    Empty {
        /// `"scope"` or `"id"`.
        field: &'static str,
    },
    /// The field is longer than the limit.
    #[error("dedup key {field} is {len} bytes, longer than the limit of {limit} bytes")]
    TooLong {
        /// `"scope"` or `"id"`.
        field: &'static str,
        /// Length of the rejected value in bytes.
        len: usize,
        /// The limit in force.
        limit: usize,
    },
    /// The field contains a NUL byte, which several stores and protocols cannot carry.
    #[error("dedup key {field} contains a NUL byte at offset {offset}")]
    Nul {
        /// `"scope"` or `"id"`.
        field: &'static str,
        /// Byte offset of the first NUL.
        offset: usize,
    },
}

fn hash_of(scope: &str, id: &str) -> KeyHash {
    let mut h = Sha256::new();
    for part in [scope, id] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    KeyHash(h.finalize().into())
}

/// The identity of one logical message within one consumer's scope.
///
/// `scope` is the consumer's identity (a consumer group, a handler name, a route and principal);
/// `id` names the message and is identical on every redelivery (a producer message id, a business
/// key). Stores index [`DedupKey::hash`], never the raw text, so database collations, trailing
/// spaces and index-length limits cannot merge or reject keys.
///
/// ```
/// use idem_core::DedupKey;
///
/// let key = DedupKey::new("orders", "order-42")?;
/// assert_eq!(key.scope(), "orders");
/// assert!(DedupKey::new("orders", "").is_err());
/// // Keys differing only by case or a trailing space stay distinct.
/// assert_ne!(DedupKey::new("s", "a")?.hash(), DedupKey::new("s", "a ")?.hash());
/// # Ok::<(), idem_core::KeyError>(())
/// ```
#[derive(Clone)]
pub struct DedupKey {
    scope: String,
    id: String,
    /// Computed once: stores, batches and lock orders all read it.
    hash: KeyHash,
}

/// Keys are equal when their hashes are: the hash is of the length-prefixed `(scope, id)`.
impl PartialEq for DedupKey {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash
    }
}

impl Eq for DedupKey {}

impl std::hash::Hash for DedupKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.hash.hash(state);
    }
}

impl DedupKey {
    /// Builds a key with the default limit of [`DEFAULT_MAX_KEY_BYTES`] bytes per field.
    ///
    /// # Errors
    /// [`KeyError`] when either field is empty, too long or contains NUL.
    pub fn new(scope: impl Into<String>, id: impl Into<String>) -> Result<Self, KeyError> {
        Self::with_limit(scope, id, DEFAULT_MAX_KEY_BYTES)
    }

    /// Builds a key with an explicit limit (bytes per field).
    ///
    /// # Errors
    /// [`KeyError`] when either field is empty, longer than `limit` or contains NUL.
    pub fn with_limit(
        scope: impl Into<String>,
        id: impl Into<String>,
        limit: usize,
    ) -> Result<Self, KeyError> {
        let scope = scope.into();
        let id = id.into();
        validate("scope", &scope, limit)?;
        validate("id", &id, limit)?;
        let hash = hash_of(&scope, &id);
        Ok(Self { scope, id, hash })
    }

    /// The consumer's identity.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The message's identity within the scope.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// SHA-256 of the length-prefixed `(scope, id)`: what stores index.
    ///
    /// Length prefixes make the encoding unambiguous: `("ab", "c")` and `("a", "bc")` differ.
    pub fn hash(&self) -> KeyHash {
        self.hash
    }

    /// A key for calls to other services (a payment API's `Idempotency-Key`), derived from
    /// `(scope, id)` only: identical on every attempt and every redelivery of the message.
    pub fn downstream_key(&self) -> String {
        let mut h = Sha256::new();
        h.update(b"idem-downstream-v1");
        h.update(self.hash().0);
        format!("idem-{}", hex::encode(&h.finalize()[..16]))
    }
}

impl fmt::Debug for DedupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DedupKey({:?}/{:?})", self.scope, self.id)
    }
}

impl fmt::Display for DedupKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.scope, self.id)
    }
}

fn validate(field: &'static str, value: &str, limit: usize) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty { field });
    }
    if value.len() > limit {
        return Err(KeyError::TooLong { field, len: value.len(), limit });
    }
    if let Some(offset) = value.bytes().position(|b| b == 0) {
        return Err(KeyError::Nul { field, offset });
    }
    Ok(())
}

/// The 32-byte SHA-256 a store indexes for a [`DedupKey`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyHash(pub [u8; 32]);

impl KeyHash {
    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Rebuilds a hash read back from a store.
    ///
    /// # Errors
    /// Returns the length found when `bytes` is not 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, usize> {
        <[u8; 32]>::try_from(bytes).map(Self).map_err(|_| bytes.len())
    }
}

impl fmt::Debug for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyHash({})", hex::encode(&self.0[..8]))
    }
}

impl fmt::Display for KeyHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_field_and_the_limit() {
        let long = "x".repeat(513);
        let err = DedupKey::new("orders", long).unwrap_err();
        assert_eq!(err, KeyError::TooLong { field: "id", len: 513, limit: 512 });
        assert_eq!(
            err.to_string(),
            "dedup key id is 513 bytes, longer than the limit of 512 bytes"
        );
        assert_eq!(DedupKey::new("", "a").unwrap_err(), KeyError::Empty { field: "scope" });
        assert_eq!(
            DedupKey::new("s", "a\0b").unwrap_err(),
            KeyError::Nul { field: "id", offset: 1 }
        );
        assert!(DedupKey::new("s", "x".repeat(512)).is_ok());
        assert!(DedupKey::with_limit("s", "abcd", 3).is_err());
    }

    #[test]
    fn hash_is_length_prefixed_and_scoped() {
        let a = DedupKey::new("ab", "c").unwrap();
        let b = DedupKey::new("a", "bc").unwrap();
        assert_ne!(a.hash(), b.hash());
        assert_eq!(a.hash(), DedupKey::new("ab", "c").unwrap().hash());
        assert_ne!(
            DedupKey::new("s", "A").unwrap().hash(),
            DedupKey::new("s", "a").unwrap().hash()
        );
    }

    #[test]
    fn downstream_key_is_stable_and_scoped() {
        let a = DedupKey::new("orders", "42").unwrap();
        assert_eq!(a.downstream_key(), DedupKey::new("orders", "42").unwrap().downstream_key());
        assert_ne!(a.downstream_key(), DedupKey::new("refunds", "42").unwrap().downstream_key());
        assert_eq!(a.downstream_key().len(), 5 + 32);
    }
}
