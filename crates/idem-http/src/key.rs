//! Reading and validating the `Idempotency-Key` header.

use http::HeaderMap;
use http::header::HeaderName;

/// Why an `Idempotency-Key` header was refused. Each becomes a `400 Bad Request` naming it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyProblem {
    /// The header is present but empty (or an empty quoted string).
    #[error("the {} header is empty", Titled(header))]
    Empty {
        /// The header's name.
        header: HeaderName,
    },
    /// The key is longer than the limit.
    #[error(
        "the {} header is {len} bytes long, longer than the limit of {limit} bytes",
        Titled(header)
    )]
    TooLong {
        /// The header's name.
        header: HeaderName,
        /// Length of the key in bytes.
        len: usize,
        /// The limit in force.
        limit: usize,
    },
    /// The key contains a control character or a byte outside visible ASCII.
    #[error(
        "the {} header contains a control or non-ASCII character at byte {offset}",
        Titled(header)
    )]
    InvalidCharacter {
        /// The header's name.
        header: HeaderName,
        /// Byte offset of the first bad byte in the header value.
        offset: usize,
    },
    /// The header appears more than once.
    #[error("the {} header appears {count} times; send it once", Titled(header))]
    Repeated {
        /// The header's name.
        header: HeaderName,
        /// How many times it appeared.
        count: usize,
    },
    /// A quoted key (a structured-field string) is not closed or has a bad escape.
    #[error("the {} header is a malformed quoted string", Titled(header))]
    BadQuoting {
        /// The header's name.
        header: HeaderName,
    },
    /// The key does not have the form the layer requires
    /// ([`IdempotencyKeyLayer::key_format`](crate::IdempotencyKeyLayer::key_format)).
    #[error("the {} header must be {rule}", Titled(header))]
    WrongFormat {
        /// The header's name.
        header: HeaderName,
        /// The rule, as [`KeyFormat`](crate::KeyFormat) describes it.
        rule: String,
    },
}

/// A header name as people write it (`Idempotency-Key`); `HeaderName` itself is lower case.
pub(crate) struct Titled<'a>(pub(crate) &'a HeaderName);

impl std::fmt::Display for Titled<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, part) in self.0.as_str().split('-').enumerate() {
            if i > 0 {
                f.write_str("-")?;
            }
            let mut chars = part.chars();
            if let Some(c) = chars.next() {
                write!(f, "{}{}", c.to_ascii_uppercase(), chars.as_str())?;
            }
        }
        Ok(())
    }
}

/// The key of a request: `Ok(None)` when the header is absent.
///
/// The draft standard sends the key as a structured-field string (`Idempotency-Key: "abc"`);
/// many clients send it bare (`Idempotency-Key: abc`). Both are accepted and mean the same key.
pub(crate) fn read(
    headers: &HeaderMap,
    name: &HeaderName,
    limit: usize,
) -> Result<Option<String>, KeyProblem> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else { return Ok(None) };
    let extra = values.count();
    if extra > 0 {
        return Err(KeyProblem::Repeated { header: name.clone(), count: extra + 1 });
    }
    let raw = value.as_bytes();
    // Visible ASCII and spaces only: HeaderValue already excludes CR/LF/NUL, but allows other
    // controls (tab, DEL) and obs-text bytes ≥ 0x80, which a key must not carry.
    if let Some(offset) = raw.iter().position(|&b| !(0x20..0x7f).contains(&b)) {
        return Err(KeyProblem::InvalidCharacter { header: name.clone(), offset });
    }
    // Only ASCII remains, so this cannot fail; the fallback keeps it from panicking regardless.
    let text = std::str::from_utf8(raw).unwrap_or_default().trim_matches(' ');
    let key = if let Some(inner) = text.strip_prefix('"') {
        unquote(inner).ok_or_else(|| KeyProblem::BadQuoting { header: name.clone() })?
    } else {
        text.to_owned()
    };
    if key.is_empty() {
        return Err(KeyProblem::Empty { header: name.clone() });
    }
    if key.len() > limit {
        return Err(KeyProblem::TooLong { header: name.clone(), len: key.len(), limit });
    }
    Ok(Some(key))
}

/// The content of an RFC 8941 string after its opening quote: `\"` and `\\` escapes, a closing
/// quote that ends the value.
fn unquote(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                e @ ('"' | '\\') => out.push(e),
                _ => return None,
            },
            '"' => return chars.as_str().is_empty().then_some(out),
            c => out.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn key(values: &[&[u8]]) -> Result<Option<String>, KeyProblem> {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("idempotency-key", HeaderValue::from_bytes(v).unwrap());
        }
        read(&h, &HeaderName::from_static("idempotency-key"), 16)
    }

    #[test]
    fn bare_and_quoted_keys_are_the_same_key() {
        assert_eq!(key(&[b"abc-1"]).unwrap().as_deref(), Some("abc-1"));
        assert_eq!(key(&[b"\"abc-1\""]).unwrap().as_deref(), Some("abc-1"));
        assert_eq!(key(&[br#""a\"b\\c""#]).unwrap().as_deref(), Some(r#"a"b\c"#));
        assert_eq!(key(&[]).unwrap(), None);
    }

    #[test]
    fn malformed_keys_name_the_problem() {
        let h = || HeaderName::from_static("idempotency-key");
        assert_eq!(key(&[b""]).unwrap_err(), KeyProblem::Empty { header: h() });
        assert_eq!(key(&[b"\"\""]).unwrap_err(), KeyProblem::Empty { header: h() });
        assert_eq!(
            key(&[b"x".repeat(17).as_slice()]).unwrap_err(),
            KeyProblem::TooLong { header: h(), len: 17, limit: 16 }
        );
        assert_eq!(
            key(&[b"ab\tc"]).unwrap_err(),
            KeyProblem::InvalidCharacter { header: h(), offset: 2 }
        );
        assert_eq!(
            key(&[b"caf\xc3\xa9"]).unwrap_err(),
            KeyProblem::InvalidCharacter { header: h(), offset: 3 }
        );
        assert_eq!(key(&[b"\"abc"]).unwrap_err(), KeyProblem::BadQuoting { header: h() });
        assert_eq!(key(&[b"\"a\"b\""]).unwrap_err(), KeyProblem::BadQuoting { header: h() });
        assert_eq!(key(&[b"a", b"b"]).unwrap_err(), KeyProblem::Repeated { header: h(), count: 2 });
        assert!(
            KeyProblem::TooLong { header: h(), len: 17, limit: 16 }
                .to_string()
                .contains("longer than the limit of 16 bytes")
        );
    }
}

/// Property tests over arbitrary header bytes (512 cases each; see `docs/RELIABILITY.md`).
#[cfg(test)]
mod props {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;
    use proptest::test_runner::Config;

    fn config() -> Config {
        Config { cases: 512, failure_persistence: None, ..Config::default() }
    }

    fn name() -> HeaderName {
        HeaderName::from_static("idempotency-key")
    }

    fn read_one(raw: &[u8], limit: usize) -> Option<Result<Option<String>, KeyProblem>> {
        let mut h = HeaderMap::new();
        h.append(name(), HeaderValue::from_bytes(raw).ok()?);
        Some(read(&h, &name(), limit))
    }

    /// Keys as the rules allow them: visible ASCII and spaces.
    fn key(limit: usize) -> impl Strategy<Value = String> {
        proptest::collection::vec(prop_oneof![4 => 0x21u8..0x7f, 1 => Just(b' ')], 1..=limit)
            .prop_map(|b| b.into_iter().map(char::from).collect())
    }

    /// `key` as a structured-field string.
    fn quoted(key: &str) -> String {
        format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""))
    }

    proptest! {
        #![proptest_config(config())]

        /// Any bytes a client can put in the header: an accepted key meets the rules (non-empty,
        /// within the limit, visible ASCII and spaces); a refusal says which rule, truthfully,
        /// and names the header.
        #[test]
        fn arbitrary_bytes_never_panic_and_refusals_are_truthful(
            raw in prop_oneof![
                // Mostly bytes a header value may hold (tab, visible ASCII, obs-text), the
                // ones it may not (CR, LF, NUL, DEL) now and then.
                proptest::collection::vec(
                    prop_oneof![1 => Just(b'\t'), 6 => 0x20u8..0x7f, 2 => 0x80u8.., 1 => any::<u8>()],
                    0..48,
                ),
                r#"[ "\\a-c\t]{0,24}"#.prop_map(String::into_bytes),
            ],
            limit in 1usize..32,
        ) {
            let answer = read_one(&raw, limit);
            prop_assume!(answer.is_some(), "not a header value");
            let Some(answer) = answer else { return Ok(()) };
            let trimmed = raw.trim_ascii_start().trim_ascii_end();
            match answer {
                Ok(Some(k)) => {
                    prop_assert!(!k.is_empty() && k.len() <= limit, "{:?}", k);
                    prop_assert!(k.bytes().all(|b| (0x20..0x7f).contains(&b)), "{:?}", k);
                    if !trimmed.starts_with(b"\"") {
                        prop_assert_eq!(k.as_bytes(), trimmed);
                    }
                }
                Ok(None) => prop_assert!(false, "a present header read as absent"),
                Err(e) => {
                    prop_assert!(e.to_string().contains("Idempotency-Key"), "{}", e);
                    match e {
                        KeyProblem::InvalidCharacter { offset, .. } => {
                            let bad = |b: &u8| !(0x20..0x7f).contains(b);
                            prop_assert!(bad(&raw[offset]) && !raw[..offset].iter().any(bad));
                        }
                        KeyProblem::TooLong { len, limit: l, .. } => {
                            prop_assert!(len > limit && l == limit);
                        }
                        KeyProblem::Empty { .. } => {
                            prop_assert!(trimmed.is_empty() || trimmed == b"\"\"");
                        }
                        KeyProblem::BadQuoting { .. } => prop_assert!(trimmed.starts_with(b"\"")),
                        other => prop_assert!(false, "{other:?} for one header"),
                    }
                }
            }
        }

        /// Every key the rules allow comes back as it was sent quoted, and bare when it can be
        /// sent bare (no surrounding space, no leading quote).
        #[test]
        fn valid_keys_round_trip((limit, k) in (1usize..40).prop_flat_map(|l| (Just(l), key(l)))) {
            prop_assert_eq!(read_one(quoted(&k).as_bytes(), limit), Some(Ok(Some(k.clone()))));
            if k.trim_matches(' ') == k && !k.starts_with('"') {
                prop_assert_eq!(read_one(k.as_bytes(), limit), Some(Ok(Some(k.clone()))));
            }
            // One byte over the limit is refused with the length and the limit.
            let long = format!("{k}{}", "x".repeat(limit + 1 - k.len()));
            prop_assert_eq!(
                read_one(quoted(&long).as_bytes(), limit),
                Some(Err(KeyProblem::TooLong { header: name(), len: limit + 1, limit }))
            );
        }

        /// A header sent more than once is refused, whatever the copies hold.
        #[test]
        fn repeated_headers_are_refused(copies in proptest::collection::vec(key(8), 2..5)) {
            let mut h = HeaderMap::new();
            for c in &copies {
                h.append(name(), HeaderValue::from_str(c)?);
            }
            let e = read(&h, &name(), 8).unwrap_err();
            prop_assert_eq!(e, KeyProblem::Repeated { header: name(), count: copies.len() });
        }
    }
}
