//! Payload fingerprints: same key with a different fingerprint is a conflict, never a duplicate.

use std::fmt;

use serde_json::Value;
use sha2::{Digest, Sha256};

/// SHA-256 of a message's canonical content.
///
/// ```
/// use idem_core::Fingerprint;
///
/// let a = Fingerprint::of_json_bytes(br#"{"a":1,"b":[2]}"#)?;
/// let b = Fingerprint::of_json_bytes(br#"{ "b":[2], "a":1.0 }"#)?;
/// assert_eq!(a, b);
/// assert_ne!(a, Fingerprint::of_json_bytes(br#"{"a":1,"b":[3]}"#)?);
/// # Ok::<(), serde_json::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Hash of raw bytes, for payloads that are not JSON.
    pub fn of_bytes(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// Hash of the canonical form of a JSON value (see [`canonical_json`]).
    pub fn of_json(value: &Value) -> Self {
        Self::of_bytes(canonical_json(value).as_bytes())
    }

    /// Parses JSON bytes, then hashes their canonical form.
    ///
    /// # Errors
    /// The parse error when `bytes` is not JSON.
    pub fn of_json_bytes(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        Ok(Self::of_json(&serde_json::from_slice(bytes)?))
    }

    /// Hash of chosen fields only (RFC 6901 JSON pointers), for payloads that carry volatile fields
    /// such as a send timestamp. A pointer that matches nothing counts as `null`, so adding the
    /// field later changes the fingerprint.
    pub fn of_json_pointers<S: AsRef<str>>(value: &Value, pointers: &[S]) -> Self {
        let mut h = Sha256::new();
        for p in pointers {
            let p = p.as_ref();
            let part = canonical_json(value.pointer(p).unwrap_or(&Value::Null));
            for field in [p, part.as_str()] {
                h.update((field.len() as u64).to_be_bytes());
                h.update(field.as_bytes());
            }
        }
        Self(h.finalize().into())
    }

    /// Rebuilds a fingerprint read back from a store.
    ///
    /// # Errors
    /// Returns the length found when `bytes` is not 32 bytes long.
    pub fn from_slice(bytes: &[u8]) -> Result<Self, usize> {
        <[u8; 32]>::try_from(bytes).map(Self).map_err(|_| bytes.len())
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(&self.0[..8]))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// How a consumer fingerprints a payload.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FingerprintSpec {
    /// Canonical JSON when the payload parses as JSON, raw bytes otherwise (the default).
    #[default]
    Auto,
    /// Canonical JSON; a payload that is not JSON is a permanent failure.
    CanonicalJson,
    /// The raw bytes as received.
    Bytes,
    /// Only these JSON pointers of a JSON payload.
    JsonPointers(Vec<String>),
    /// No fingerprint: a reused key is always treated as a duplicate. Use only when the producer
    /// guarantees a key is never reused for other content.
    None,
}

impl FingerprintSpec {
    /// Fingerprints `payload`.
    ///
    /// # Errors
    /// The parse error when the spec needs JSON and the payload is not JSON.
    pub fn fingerprint(&self, payload: &[u8]) -> Result<Option<Fingerprint>, serde_json::Error> {
        Ok(match self {
            Self::Auto => Some(
                Fingerprint::of_json_bytes(payload)
                    .unwrap_or_else(|_| Fingerprint::of_bytes(payload)),
            ),
            Self::CanonicalJson => Some(Fingerprint::of_json_bytes(payload)?),
            Self::Bytes => Some(Fingerprint::of_bytes(payload)),
            Self::JsonPointers(ptrs) => {
                Some(Fingerprint::of_json_pointers(&serde_json::from_slice(payload)?, ptrs))
            }
            Self::None => None,
        })
    }

    /// Whether fingerprinting parses the payload as JSON (so a key extractor can read the same
    /// parse: see [`KeyExtractor::extract_parsed`](crate::extract::KeyExtractor::extract_parsed)).
    pub fn reads_json(&self) -> bool {
        matches!(self, Self::Auto | Self::CanonicalJson | Self::JsonPointers(_))
    }

    /// Fingerprints a payload that parsed as `json`: what [`fingerprint`](Self::fingerprint)
    /// answers for it, without parsing it again.
    pub fn fingerprint_parsed(&self, payload: &[u8], json: &Value) -> Option<Fingerprint> {
        match self {
            Self::Auto | Self::CanonicalJson => Some(Fingerprint::of_json(json)),
            Self::Bytes => Some(Fingerprint::of_bytes(payload)),
            Self::JsonPointers(ptrs) => Some(Fingerprint::of_json_pointers(json, ptrs)),
            Self::None => None,
        }
    }
}

/// Canonical JSON in the style of RFC 8785 (JCS): object keys sorted by their UTF-16 code units
/// (whatever order the map holds them in, so also with serde_json's `preserve_order`), no
/// insignificant whitespace, minimal string escapes, and one form per number — an integral
/// value within ±2^53 prints as an integer (`1.0`, `1e0` and `1` are equal), other floats in
/// their shortest round-trip form.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            // References to the entries, sorted here in every build: serde_json's map iterates
            // in key order only without its `preserve_order` feature, and any crate in a build
            // can turn that on for all of them (then the map keeps insertion order).
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            sort_entries(&mut entries);
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(k, out);
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
    }
}

/// Sorts object entries by their keys' UTF-16 code units (RFC 8785).
fn sort_entries(entries: &mut [(&String, &Value)]) {
    if entries.iter().all(|(k, _)| k.is_ascii()) {
        // For ASCII keys byte order is UTF-16 order. Entries already in order (serde_json's
        // default map) cost one comparison per key and no sort.
        if !entries.is_sorted_by(|a, b| a.0 <= b.0) {
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
        }
    } else {
        // Keys are unique, so an unstable sort gives the one order.
        entries.sort_unstable_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
    }
}

const MAX_SAFE_INTEGER: f64 = 9_007_199_254_740_992.0; // 2^53

fn write_number(n: &serde_json::Number, out: &mut String) {
    use std::fmt::Write;
    if let Some(i) = n.as_i64() {
        let _ = write!(out, "{i}");
    } else if let Some(u) = n.as_u64() {
        let _ = write!(out, "{u}");
    } else if let Some(f) = n.as_f64() {
        if f == 0.0 {
            out.push('0'); // -0 and 0 are one number
        } else if f.fract() == 0.0 && f.abs() < MAX_SAFE_INTEGER {
            #[allow(clippy::cast_possible_truncation)] // integral and below 2^53: exact
            let i = f as i64;
            let _ = write!(out, "{i}");
        } else {
            let _ = write!(out, "{f}");
        }
    }
}

fn write_string(s: &str, out: &mut String) {
    // serde_json escapes exactly `"`, `\` and control characters, with the short forms
    // (\n, \t, …) and lowercase \u00xx otherwise: the escaping JCS prescribes. A string with
    // none of them is written as it is, without a round through serde_json.
    if s.bytes().any(|b| b == b'"' || b == b'\\' || b < 0x20) {
        out.push_str(&Value::String(s.to_owned()).to_string());
    } else {
        out.reserve(s.len() + 2);
        out.push('"');
        out.push_str(s);
        out.push('"');
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fp(s: &str) -> Fingerprint {
        Fingerprint::of_json_bytes(s.as_bytes()).unwrap()
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        assert_eq!(fp(r#"{"a":1,"b":[2]}"#), fp("{ \"b\" : [ 2 ],\n \"a\":1 }"));
        assert_eq!(
            canonical_json(&json!({"b": {"d": 1, "c": 2}, "a": null})),
            r#"{"a":null,"b":{"c":2,"d":1}}"#
        );
    }

    #[test]
    fn one_number_form() {
        assert_eq!(fp(r#"{"a":1}"#), fp(r#"{"a":1.0}"#));
        assert_eq!(fp(r#"{"a":1}"#), fp(r#"{"a":1e0}"#));
        assert_eq!(fp(r#"{"a":0}"#), fp(r#"{"a":-0.0}"#));
        assert_ne!(fp(r#"{"a":1}"#), fp(r#"{"a":1.5}"#));
        assert_eq!(canonical_json(&json!(1.5)), "1.5");
    }

    #[test]
    fn any_changed_value_differs() {
        let base = fp(r#"{"a":1,"b":[2],"c":"x"}"#);
        for other in [
            r#"{"a":2,"b":[2],"c":"x"}"#,
            r#"{"a":1,"b":[2,2],"c":"x"}"#,
            r#"{"a":1,"b":[2],"c":"y"}"#,
            r#"{"a":1,"b":[2],"c":"x","d":null}"#,
            r#"{"a":"1","b":[2],"c":"x"}"#,
        ] {
            assert_ne!(base, fp(other), "{other}");
        }
    }

    #[test]
    fn keys_sort_by_utf16() {
        // U+E000 sorts after U+1F600 in UTF-8 but before it in UTF-16 (surrogates are 0xD8xx).
        let v = json!({"\u{1F600}": 1, "\u{E000}": 2});
        assert_eq!(canonical_json(&v), "{\"\u{1F600}\":1,\"\u{E000}\":2}");
    }

    #[test]
    fn entries_are_sorted_whatever_order_the_map_gives() {
        // A map with serde_json's `preserve_order` hands entries over in insertion order; the
        // default build's map never does, so the sort is tested on the entries directly.
        let keys = ["b", "a", "B", "", "a b", "\u{E000}", "\u{1F600}", "\u{e9}"].map(String::from);
        let v = Value::Null;
        for n in [3, keys.len()] {
            let mut entries: Vec<(&String, &Value)> = keys[..n].iter().map(|k| (k, &v)).collect();
            sort_entries(&mut entries);
            let got: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
            let want: &[&str] = if n == 3 {
                &["B", "a", "b"]
            } else {
                &["", "B", "a", "a b", "b", "\u{e9}", "\u{1F600}", "\u{E000}"]
            };
            assert_eq!(got, want);
        }
    }

    #[test]
    fn strings_are_escaped_as_serde_json_escapes_them() {
        // The unescaped fast path must agree with serde_json for every kind of character.
        for s in [
            "",
            "plain",
            "q\"uote",
            "back\\slash",
            "nl\n",
            "tab\t",
            "\u{1}",
            "\u{1f}",
            "\u{7f}",
            "/slash",
            "é",
            "\u{E000}",
            "\u{1F600}",
            "mixed \u{1F600} \"x\"",
        ] {
            let mut got = String::new();
            write_string(s, &mut got);
            assert_eq!(got, serde_json::to_string(s).unwrap(), "{s:?}");
        }
    }

    #[test]
    fn fingerprints_stay_what_stores_already_hold() {
        // Records written by earlier versions must keep matching: pinned digests.
        assert_eq!(
            fp(r#"{"b":[1,2.0,"x\"y"],"a":{"\u00e9":null,"z":true}}"#).to_string(),
            "f6ab2826ef2fc36802ce22e3f3efc42db81ae59395490020287521c4835bff62"
        );
        assert_eq!(
            fp(r#"{"\ud83d\ude00":1,"\ue000":2,"k":"\u0001"}"#).to_string(),
            "8b394f85d4d320f4d85b64f4404c44f111102f9250ac38a9f3f32f36f0db0d99"
        );
    }

    #[test]
    fn fingerprints_of_reordered_objects_stay_what_stores_already_hold() {
        // Computed before canonical JSON sorted keys itself in every build: ASCII keys out of
        // order at several depths, escaped keys, keys that differ in case, non-ASCII keys mixed
        // with ASCII ones, pointers.
        for (json, digest) in [
            (
                r#"{"z":1,"a":{"y":[{"c":3,"b":2}],"x":null},"m":"s"}"#,
                "e5fae018970d6d83cffb47f8f3892c364be87573254d00a97627dbfb40b88ffa",
            ),
            (
                r#"{"a\"b":1,"a":2,"a b":3,"a\\":4}"#,
                "63721437d18cc2eb650a4c0579747469910190c0d589c57e6714915d5f18fbea",
            ),
            (
                r#"{"B":1,"a":2,"_":3,"1":4,"":5}"#,
                "ebc0da8962d9aaefb3df8c83d357b82c9050b5d808a6fcbf7643e4b509c8e3e2",
            ),
            (
                r#"{"\u00e9":1,"e":2,"f":{"\u00fc":true,"u":false,"\ud83d\ude00":[]}}"#,
                "24438089e769cb3f5d1d7705367b0e83f851aa09ef863fad1ab94dde8b0202ea",
            ),
            (
                r#"[{"b":1,"a":2},{},[{"d":{"f":1,"e":2}}]]"#,
                "52fe9248716e702fd796850f26b57c54dd4160d2c1ff3f438ff59068568eb1b2",
            ),
        ] {
            assert_eq!(fp(json).to_string(), digest, "{json}");
        }
        let v: Value = serde_json::from_str(r#"{"o":{"b":1,"a":{"d":2,"c":3}},"t":0}"#).unwrap();
        assert_eq!(
            Fingerprint::of_json_pointers(&v, &["/o", "/t"]).to_string(),
            "d660a60c788d33681b0f86f9ead2ff4ff481ab904a4d9186325fd17eb797ffff"
        );
    }

    #[test]
    fn pointers_select_fields() {
        let a = json!({"order": {"id": 7, "total": 10}, "sent_at": "t1"});
        let b = json!({"order": {"id": 7, "total": 10}, "sent_at": "t2"});
        let c = json!({"order": {"id": 7, "total": 11}, "sent_at": "t1"});
        let ptrs = ["/order"];
        assert_eq!(
            Fingerprint::of_json_pointers(&a, &ptrs),
            Fingerprint::of_json_pointers(&b, &ptrs)
        );
        assert_ne!(
            Fingerprint::of_json_pointers(&a, &ptrs),
            Fingerprint::of_json_pointers(&c, &ptrs)
        );
    }

    #[test]
    fn auto_falls_back_to_bytes() {
        let spec = FingerprintSpec::Auto;
        assert_eq!(
            spec.fingerprint(b"not json").unwrap(),
            Some(Fingerprint::of_bytes(b"not json"))
        );
        assert!(FingerprintSpec::CanonicalJson.fingerprint(b"not json").is_err());
        assert_eq!(FingerprintSpec::None.fingerprint(b"x").unwrap(), None);
    }
}
