//! Validated SQL identifiers (table, schema and prefix names).

use std::fmt;

/// Longest identifier accepted: PostgreSQL silently cuts identifiers at 63 bytes.
pub(crate) const MAX_IDENTIFIER_BYTES: usize = 63;

/// Why an identifier was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentifierError {
    /// Empty name.
    #[error("{field} is empty")]
    Empty {
        /// What the name is for (`"table name"`, `"schema name"`).
        field: &'static str,
    },
    /// Longer than the limit (at most 63 bytes, PostgreSQL's).
    #[error("{field} {value:?} is {len} bytes, longer than the limit of {limit} bytes")]
    TooLong {
        /// What the name is for.
        field: &'static str,
        /// The rejected value.
        value: String,
        /// Its length in bytes.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// Contains a character outside `[A-Za-z0-9_]` or starts with a digit.
    #[error(
        "{field} {value:?} is not a plain identifier: use ASCII letters, digits and `_`, not starting with a digit"
    )]
    Invalid {
        /// What the name is for.
        field: &'static str,
        /// The rejected value.
        value: String,
    },
}

/// A name that is safe to interpolate into SQL: `[A-Za-z_][A-Za-z0-9_]*`, at most 63 bytes.
///
/// ```
/// use idem_core::Identifier;
///
/// assert!(Identifier::new("table name", "idem_records").is_ok());
/// let err = Identifier::new("table name", "x; DROP TABLE y").unwrap_err();
/// assert!(err.to_string().contains("table name"));
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Identifier(String);

impl Identifier {
    /// Validates `value`; `field` names it in the error.
    ///
    /// # Errors
    /// [`IdentifierError`] naming the field and the rule broken.
    pub fn new(field: &'static str, value: impl Into<String>) -> Result<Self, IdentifierError> {
        Self::with_limit(field, value, MAX_IDENTIFIER_BYTES)
    }

    /// As [`Identifier::new`], with a tighter length limit (a table name whose derived index
    /// names must stay within the database's identifier limit).
    ///
    /// # Errors
    /// [`IdentifierError`] naming the field and the rule broken.
    pub fn with_limit(
        field: &'static str,
        value: impl Into<String>,
        limit: usize,
    ) -> Result<Self, IdentifierError> {
        let limit = limit.min(MAX_IDENTIFIER_BYTES);
        let value = value.into();
        let mut bytes = value.bytes();
        match bytes.next() {
            None => return Err(IdentifierError::Empty { field }),
            Some(b) if b.is_ascii_alphabetic() || b == b'_' => {}
            Some(_) => return Err(IdentifierError::Invalid { field, value }),
        }
        if !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(IdentifierError::Invalid { field, value });
        }
        if value.len() > limit {
            let len = value.len();
            return Err(IdentifierError::TooLong { field, value, len, limit });
        }
        Ok(Self(value))
    }

    /// The validated name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Identifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Identifier({})", self.0)
    }
}

impl fmt::Display for Identifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_injection_and_long_names() {
        for bad in ["", "1abc", "a-b", "a b", "t\"; drop", "é", "a.b"] {
            assert!(Identifier::new("table name", bad).is_err(), "{bad:?} accepted");
        }
        let long = "a".repeat(64);
        let err = Identifier::new("table name", long).unwrap_err();
        assert!(err.to_string().contains("64 bytes, longer than the limit of 63"), "{err}");
        assert!(Identifier::new("table name", "a".repeat(63)).is_ok());
        assert!(Identifier::new("table name", "_x9").is_ok());
    }
}
