//! The stored response: status, the headers worth replaying and the body, as the store's result
//! bytes.
//!
//! Layout (big-endian): magic `IDH1`, status `u16`, header count `u16`, then per header name
//! length `u16`, name, value length `u16`, value; then the body to the end. Binary rather than
//! JSON so a body of any bytes replays identically without an encoding step.

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

const MAGIC: &[u8; 4] = b"IDH1";

/// A response as the layer stores and replays it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredResponse {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl StoredResponse {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + self.body.len() + 64 * self.headers.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        // Header names and values longer than u16::MAX or more than u16::MAX headers cannot be
        // produced by hyper's default limits; any that could are dropped rather than truncated.
        let fits: Vec<_> = self
            .headers
            .iter()
            .filter(|(n, v)| {
                u16::try_from(n.as_str().len()).is_ok() && u16::try_from(v.len()).is_ok()
            })
            .take(usize::from(u16::MAX))
            .collect();
        out.extend_from_slice(&u16::try_from(fits.len()).unwrap_or(u16::MAX).to_be_bytes());
        for (name, value) in fits {
            for part in [name.as_str().as_bytes(), value.as_bytes()] {
                out.extend_from_slice(&u16::try_from(part.len()).unwrap_or(0).to_be_bytes());
                out.extend_from_slice(part);
            }
        }
        out.extend_from_slice(&self.body);
        out
    }

    pub(crate) fn decode(bytes: &[u8]) -> Option<Self> {
        let mut r = Reader(bytes);
        if r.take(4)? != MAGIC {
            return None;
        }
        let status = StatusCode::from_u16(r.u16()?).ok()?;
        let count = r.u16()?;
        // The count is not trusted: `HeaderMap::with_capacity` panics past 24,576 and `append`
        // past 32,768 entries, so grow as headers are read and refuse what does not fit.
        let mut headers = HeaderMap::new();
        for _ in 0..count {
            let n = usize::from(r.u16()?);
            let name = HeaderName::from_bytes(r.take(n)?).ok()?;
            let n = usize::from(r.u16()?);
            let value = HeaderValue::from_bytes(r.take(n)?).ok()?;
            headers.try_append(name, value).ok()?;
        }
        Some(Self { status, headers, body: Bytes::copy_from_slice(r.0) })
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.0.split_at_checked(n)?;
        self.0 = tail;
        Some(head)
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_any_body_and_repeated_headers() {
        let mut headers = HeaderMap::new();
        headers.append("content-type", HeaderValue::from_static("application/json"));
        headers.append("link", HeaderValue::from_static("<a>"));
        headers.append("link", HeaderValue::from_static("<b>"));
        let r = StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"\x00\xff{\"id\":1}"),
        };
        let bytes = r.encode();
        assert_eq!(StoredResponse::decode(&bytes), Some(r));
        assert_eq!(StoredResponse::decode(&bytes[..bytes.len() - 12]).map(|d| d.status), None);
        assert_eq!(StoredResponse::decode(b"IDH2\x00\xc8\x00\x00"), None);
    }
}

/// Property tests of the stored-response decoder (512 cases each; see `docs/RELIABILITY.md`).
#[cfg(test)]
mod props {
    use proptest::collection::vec;
    use proptest::prelude::*;
    use proptest::test_runner::Config;

    use super::*;

    fn response() -> impl Strategy<Value = StoredResponse> {
        let header = ("[a-z0-9-]{1,12}", "[ -~]{0,16}");
        (100u16..1000, vec(header, 0..5), vec(any::<u8>(), 0..32)).prop_map(|(s, hs, body)| {
            let mut headers = HeaderMap::new();
            for (n, v) in hs {
                headers.append(HeaderName::from_bytes(n.as_bytes()).unwrap(), v.parse().unwrap());
            }
            StoredResponse { status: StatusCode::from_u16(s).unwrap(), headers, body: body.into() }
        })
    }

    proptest! {
        #![proptest_config(Config { cases: 512, failure_persistence: None, ..Config::default() })]

        /// Every response replays exactly: status, each header in order (repeats kept), body.
        #[test]
        fn responses_round_trip(r in response()) {
            prop_assert_eq!(StoredResponse::decode(&r.encode()), Some(r));
        }

        /// Cut, changed or random bytes: refused or decoded, never a panic; what decodes
        /// encodes back to the same bytes (up to header-name case, which HTTP ignores).
        #[test]
        fn hostile_bytes_decode_to_what_they_encode(
            bytes in prop_oneof![
                (response(), any::<prop::sample::Index>()).prop_map(|(r, cut)| {
                    let b = r.encode();
                    b[..cut.index(b.len())].to_vec()
                }),
                (response(), any::<prop::sample::Index>(), any::<u8>()).prop_map(|(r, at, x)| {
                    let mut b = r.encode();
                    let at = at.index(b.len());
                    b[at] = x;
                    b
                }),
                vec(any::<u8>(), 0..64).prop_map(|b| [&MAGIC[..], &b].concat()),
            ],
        ) {
            if let Some(r) = StoredResponse::decode(&bytes) {
                prop_assert_eq!(r.encode(), lower_names(&bytes));
            }
        }
    }

    /// Regression: a header count of 24,832 (bytes 6–7 = `61 00`) panicked in
    /// `HeaderMap::with_capacity` before a single header was read. Found by
    /// `hostile_bytes_decode_to_what_they_encode`; this is its minimal input.
    #[test]
    fn a_huge_header_count_is_refused_not_a_panic() {
        assert_eq!(StoredResponse::decode(b"IDH1\x00\x64\x61\x00\x00\x00\x00\x00"), None);
        assert_eq!(StoredResponse::decode(b"IDH1\x00\x64\xff\xff"), None);
    }

    /// `bytes` with the header names in lower case, as `HeaderName` keeps them.
    fn lower_names(bytes: &[u8]) -> Vec<u8> {
        let mut out = bytes.to_vec();
        let count = usize::from(u16::from_be_bytes([bytes[6], bytes[7]]));
        let mut at = 8;
        for _ in 0..count {
            let n = usize::from(u16::from_be_bytes([bytes[at], bytes[at + 1]]));
            out[at + 2..at + 2 + n].make_ascii_lowercase();
            at += 2 + n;
            at += 2 + usize::from(u16::from_be_bytes([bytes[at], bytes[at + 1]]));
        }
        out
    }
}
