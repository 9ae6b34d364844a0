//! An optional rule on what keys look like, beyond the header rules every key meets.

use std::fmt;
use std::sync::Arc;

/// The form a key must have, checked after the header rules (non-empty, within the length
/// limit, visible ASCII). A key of another form is refused with `400 Bad Request`
/// ([`ProblemKind::Malformed`](crate::ProblemKind::Malformed)) whose detail names the rule;
/// the handler does not run. Set it with
/// [`IdempotencyKeyLayer::key_format`](crate::IdempotencyKeyLayer::key_format).
///
/// ```
/// use idem_http::KeyFormat;
///
/// assert!(KeyFormat::Uuid.accepts("6F9619FF-8B86-D011-B42D-00C04FC964FF"));
/// assert!(!KeyFormat::Uuid.accepts("order-42"));
///
/// let ulid = KeyFormat::matching("a ULID (26 Crockford base-32 characters)", |k| {
///     k.len() == 26 && k.bytes().all(|b| b.is_ascii_alphanumeric())
/// });
/// assert!(ulid.accepts("01ARZ3NDEKTSV4RRFFQ69G5FAV"));
/// assert_eq!(ulid.to_string(), "a ULID (26 Crockford base-32 characters)");
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub enum KeyFormat {
    /// A UUID as text: 32 hexadecimal digits (either case) in groups of 8-4-4-4-12 separated by
    /// hyphens, as clients generate with `crypto.randomUUID()` or `uuid.uuid4()`. Any version.
    Uuid,
    /// Keys the predicate accepts; `rule` describes them to the client.
    Matching {
        /// What the client is told a key must be, e.g. `"a ULID"`.
        rule: String,
        /// Whether a key has the form.
        accepts: Arc<dyn Fn(&str) -> bool + Send + Sync>,
    },
}

impl KeyFormat {
    /// Keys that `accepts`; the client is told they must be `rule`.
    pub fn matching(
        rule: impl Into<String>,
        accepts: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Self {
        Self::Matching { rule: rule.into(), accepts: Arc::new(accepts) }
    }

    /// Whether `key` has this form.
    pub fn accepts(&self, key: &str) -> bool {
        match self {
            Self::Uuid => is_uuid(key),
            Self::Matching { accepts, .. } => accepts(key),
        }
    }
}

/// The rule as the client is told it: "the Idempotency-Key header must be {this}".
impl fmt::Display for KeyFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Uuid => f.write_str("a UUID (8-4-4-4-12 hexadecimal digits)"),
            Self::Matching { rule, .. } => f.write_str(rule),
        }
    }
}

impl fmt::Debug for KeyFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Uuid => f.write_str("Uuid"),
            Self::Matching { rule, .. } => f.debug_struct("Matching").field("rule", rule).finish(),
        }
    }
}

fn is_uuid(key: &str) -> bool {
    let b = key.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_in_either_case_and_nothing_else() {
        for ok in ["00000000-0000-0000-0000-000000000000", "6f9619ff-8b86-d011-b42d-00c04fc964ff"] {
            assert!(KeyFormat::Uuid.accepts(ok), "{ok}");
        }
        for bad in [
            "",
            "6f9619ff8b86d011b42d00c04fc964ff",
            "{6f9619ff-8b86-d011-b42d-00c04fc964ff}",
            "6f9619ff-8b86-d011-b42d-00c04fc964f",
            "6f9619ff-8b86-d011-b42d-00c04fc964fff",
            "6f9619ff-8b86-d011-b42d_00c04fc964ff",
            "6f9619fg-8b86-d011-b42d-00c04fc964ff",
        ] {
            assert!(!KeyFormat::Uuid.accepts(bad), "{bad}");
        }
    }
}
