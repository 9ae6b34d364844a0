//! An error with its causes on one line.

use std::error::Error;
use std::fmt;

/// Shows an error followed by each of its `source()`s, joined by `: ` — what a log line or a
/// report needs when the top message alone ("connecting failed") hides the reason.
///
/// ```
/// use idem_core::ErrorChain;
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("connecting to the store failed")]
/// struct Connect(#[source] std::io::Error);
///
/// let e = Connect(std::io::Error::other("connection refused"));
/// assert_eq!(
///     ErrorChain(&e).to_string(),
///     "connecting to the store failed: connection refused"
/// );
/// ```
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn Error + 'a));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

impl fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorChain;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] Middle);

    #[derive(Debug, thiserror::Error)]
    #[error("middle")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn every_cause_once_in_order() {
        let e = Outer(Middle(std::io::Error::other("inner")));
        assert_eq!(ErrorChain(&e).to_string(), "outer: middle: inner");
        let alone = std::io::Error::other("alone");
        assert_eq!(ErrorChain(&alone).to_string(), "alone");
    }
}
