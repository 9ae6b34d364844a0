//! Validated key namespaces.

use crate::Error;

/// Longest namespace accepted, in bytes.
pub const MAX_NAMESPACE_BYTES: usize = 64;

/// The part of every record key that names one store: records live at
/// `idem:{<namespace>}:<sha256 of scope and id>`.
///
/// The braces are a Redis Cluster hash tag: every record of a namespace hashes to the same slot,
/// so each single-key script, the one-script `claim_many` over many keys and the operator scans
/// all stay on one node. Spread load over a cluster with several namespaces (one per consumer
/// group, say). Allowed characters are ASCII letters, digits, `_`, `-`, `.` and `:`; no braces
/// (they would move the hash tag) and no glob characters (the operator scans use `MATCH`).
///
/// ```
/// use idem_redis::Namespace;
///
/// assert_eq!(Namespace::new("orders")?.key_prefix(), "idem:{orders}:");
/// assert!(Namespace::new("a}b").is_err());
/// assert!(Namespace::new("a*").is_err());
/// # Ok::<(), idem_redis::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    name: String,
    prefix: String,
}

impl Namespace {
    /// Validates `name`.
    ///
    /// # Errors
    /// [`Error::InvalidNamespace`] naming the rule broken.
    pub fn new(name: impl Into<String>) -> Result<Self, Error> {
        let name = name.into();
        let bad = |reason| Error::InvalidNamespace { value: name.clone(), reason };
        if name.is_empty() {
            return Err(bad("it is empty"));
        }
        if name.len() > MAX_NAMESPACE_BYTES {
            return Err(bad("it is longer than 64 bytes"));
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'))
        {
            return Err(bad("use ASCII letters, digits, `_`, `-`, `.` and `:` only"));
        }
        let prefix = format!("idem:{{{name}}}:");
        Ok(Self { name, prefix })
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.name
    }

    /// `idem:{<name>}:`, the prefix of every record key.
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }
}

impl Default for Namespace {
    /// The namespace `default`.
    fn default() -> Self {
        Self { name: "default".to_owned(), prefix: "idem:{default}:".to_owned() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates() {
        for bad in ["", "a b", "a{b", "a}b", "a*", "a?", "a[b]", "é", "a\\b"] {
            assert!(Namespace::new(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Namespace::new("x".repeat(65)).is_err());
        assert!(Namespace::new("x".repeat(64)).is_ok());
        assert_eq!(Namespace::new("t:1-a.b_c").unwrap().key_prefix(), "idem:{t:1-a.b_c}:");
        assert_eq!(Namespace::default().key_prefix(), "idem:{default}:");
        let e = Namespace::new("a}").unwrap_err().to_string();
        assert!(e.contains("\"a}\"") && e.contains("letters"), "{e}");
    }
}
