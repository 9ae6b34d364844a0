//! The canonical-JSON fingerprint: total on hostile bytes, one fingerprint per value (within
//! the documented number range), a different one for any other value.

use idem_core::fingerprint::canonical_json;
use idem_core::{Fingerprint, FingerprintSpec};
use proptest::prelude::*;
use serde_json::Value;

use super::config;
use super::json::{Choices, fraction, norm, respell, value};

fn fp(text: &str) -> Fingerprint {
    Fingerprint::of_json_bytes(text.as_bytes()).unwrap()
}

/// Whitespace outside strings: canonical JSON has none.
fn has_insignificant_whitespace(json: &str) -> bool {
    let (mut in_string, mut escaped) = (false, false);
    for c in json.chars() {
        match (in_string, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => in_string = !in_string,
            (false, _, ' ' | '\t' | '\n' | '\r') => return true,
            _ => {}
        }
    }
    false
}

/// Replaces the `target`-th node (depth first) of `v`: by `with`, or for `grow` by a container
/// one member larger (objects and arrays) or one smaller (`shrink`). Returns whether a node
/// was reached.
fn mutate(v: &mut Value, target: &mut usize, with: &Value, how: u8) -> bool {
    if *target == 0 {
        match (how % 3, &mut *v) {
            (1, Value::Array(items)) => items.push(with.clone()),
            (1, Value::Object(map)) => {
                let key = (0..).map(|i| format!("k{i}")).find(|k| !map.contains_key(k)).unwrap();
                map.insert(key, with.clone());
            }
            (2, Value::Array(items)) if !items.is_empty() => {
                items.pop();
            }
            (2, Value::Object(map)) if !map.is_empty() => {
                let first = map.keys().next().cloned().unwrap();
                map.remove(&first);
            }
            _ => *v = with.clone(),
        }
        return true;
    }
    *target -= 1;
    match v {
        Value::Array(items) => items.iter_mut().any(|i| mutate(i, target, with, how)),
        Value::Object(map) => map.values_mut().any(|i| mutate(i, target, with, how)),
        _ => false,
    }
}

fn nodes(v: &Value) -> usize {
    1 + match v {
        Value::Array(items) => items.iter().map(nodes).sum(),
        Value::Object(map) => map.values().map(nodes).sum(),
        _ => 0,
    }
}

fn next_float(f: f64) -> f64 {
    f64::from_bits(f.to_bits() + 1)
}

proptest! {
    #![proptest_config(config())]

    /// Arbitrary bytes (and JSON-like token soup): every spec answers without panicking, and
    /// the specs that need JSON fail exactly when the bytes are not JSON.
    #[test]
    fn fingerprint_never_panics_on_arbitrary_bytes(
        bytes in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..128),
            r#"[\[\]{}:,"0-9eE.+\- \\u/a-fnlrst]{0,64}"#.prop_map(String::into_bytes),
        ],
        pointer in r"(/[a-z0-9~]{0,3}){0,3}",
    ) {
        let json = Fingerprint::of_json_bytes(&bytes);
        let auto = FingerprintSpec::Auto.fingerprint(&bytes)?;
        prop_assert_eq!(auto, Some(json.as_ref().map_or(Fingerprint::of_bytes(&bytes), |f| *f)));
        prop_assert_eq!(FingerprintSpec::CanonicalJson.fingerprint(&bytes).is_ok(), json.is_ok());
        let pointers = FingerprintSpec::JsonPointers(vec![pointer]).fingerprint(&bytes);
        prop_assert_eq!(pointers.is_ok(), json.is_ok());
        prop_assert_eq!(
            FingerprintSpec::Bytes.fingerprint(&bytes)?,
            Some(Fingerprint::of_bytes(&bytes))
        );
    }

    /// Nesting up to thousands of levels, balanced or not: never a panic or a stack overflow.
    /// The parser refuses depths past its limit (128), so `Auto` falls back to the bytes.
    #[test]
    fn deep_nesting_never_panics(depth in 1usize..4000, kind in 0u8..4) {
        let text = match kind {
            0 => format!("{}{}", "[".repeat(depth), "]".repeat(depth)),
            1 => format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth)),
            2 => format!("{}null{}", r#"[{"a":"#.repeat(depth), "}]".repeat(depth)),
            _ => "[".repeat(depth),
        };
        let json = Fingerprint::of_json_bytes(text.as_bytes());
        if depth <= 60 && kind < 3 {
            let expected = fp(&canonical_json(&serde_json::from_str::<Value>(&text)?));
            prop_assert_eq!(json.as_ref().ok(), Some(&expected));
        }
        if depth > 128 || kind == 3 {
            prop_assert!(json.is_err());
        }
        let auto = FingerprintSpec::Auto.fingerprint(text.as_bytes())?;
        prop_assert!(auto.is_some());
    }

    /// Numbers of up to 400 digits with any exponent: parsed or refused (out of range), never a
    /// panic; what parses has a canonical form that parses back to itself.
    #[test]
    fn huge_numbers_never_panic(
        neg in any::<bool>(),
        int in r"0|[1-9][0-9]{0,400}",
        frac in proptest::option::of(r"[0-9]{1,400}"),
        exp in proptest::option::of((prop::sample::select(vec!["e", "E", "e+", "e-", "E-"]), 0u32..9999)),
    ) {
        let mut text = format!("{}{int}", if neg { "-" } else { "" });
        if let Some(f) = frac {
            text = format!("{text}.{f}");
        }
        if let Some((e, n)) = exp {
            text = format!("{text}{e}{n}");
        }
        if let Ok(v) = serde_json::from_str::<Value>(&text) {
            let c = canonical_json(&v);
            prop_assert!(c.parse::<f64>().is_ok() || c.parse::<i128>().is_ok(), "{}", c);
            prop_assert_eq!(canonical_json(&serde_json::from_str(&c)?), c.clone(), "{}", text);
            prop_assert_eq!(fp(&text), fp(&c));
        } else {
            prop_assert!(Fingerprint::of_json_bytes(text.as_bytes()).is_err());
        }
    }

    /// One value, many spellings — keys permuted, whitespace anywhere, every escape, numbers as
    /// `1`, `1.0…0`, `1e0`, `10e-1`, `0.1e1`, `-0`… — one fingerprint.
    #[test]
    fn equivalent_spellings_share_a_fingerprint(v in value(), seed in any::<u64>()) {
        let compact = serde_json::to_string(&v)?;
        let other = respell(&v, &mut Choices::new(seed));
        let parsed: Value = serde_json::from_str(&other)?;
        prop_assert_eq!(canonical_json(&parsed), canonical_json(&v), "{}", other);
        prop_assert_eq!(fp(&compact), fp(&other), "{}", other);
    }

    /// The canonical form is JSON without insignificant whitespace that parses back to an
    /// equal value and is its own canonical form. Since it is faithful, two values with one
    /// canonical form are equal: different values never share a fingerprint.
    #[test]
    fn canonical_form_is_faithful(v in value()) {
        let c = canonical_json(&v);
        prop_assert!(!has_insignificant_whitespace(&c), "{}", c);
        let back: Value = serde_json::from_str(&c)?;
        prop_assert_eq!(norm(&back), norm(&v), "{}", c);
        prop_assert_eq!(canonical_json(&back), c);
    }

    /// Any change — a leaf or subtree replaced, a member added or removed, a type changed —
    /// changes the fingerprint, unless the documented equality says the values are equal.
    #[test]
    fn any_change_changes_the_fingerprint(
        v in value(),
        with in value(),
        target in 0usize..64,
        how in any::<u8>(),
    ) {
        let mut w = v.clone();
        let mut t = target % nodes(&v);
        prop_assert!(mutate(&mut w, &mut t, &with, how));
        let same = norm(&v) == norm(&w);
        prop_assert_eq!(Fingerprint::of_json(&v) == Fingerprint::of_json(&w), same, "{} vs {}", v, w);
    }

    /// Neighbouring numbers differ: a float and the next float up, an integer and its
    /// successor (up to ±2^53), a number and its text; an integral float is its integer.
    #[test]
    fn neighbouring_numbers_differ(
        f in prop_oneof![fraction(), any::<f64>()]
            .prop_filter("finite", |f| f.is_finite() && next_float(*f).is_finite()),
        i in -(1i64 << 53) + 1..(1i64 << 53) - 1,
    ) {
        prop_assert_ne!(fp(&format!("[{f:?}]")), fp(&format!("[{:?}]", next_float(f))));
        prop_assert_ne!(fp(&i.to_string()), fp(&(i + 1).to_string()));
        prop_assert_ne!(fp(&i.to_string()), fp(&format!("\"{i}\"")));
        prop_assert_eq!(fp(&i.to_string()), fp(&format!("{i}.0")));
        if i != 0 {
            prop_assert_eq!(fp(&i.to_string()), fp(&format!("{i}000e-3")));
        }
    }
}

/// Regression: with serde_json's default (fast, not correctly rounded) float parser,
/// `9007199254740991.0` parsed as 9007199254740990, so it fingerprinted like a different
/// integer and unlike `9007199254740991`. Found by `equivalent_spellings_share_a_fingerprint`.
#[test]
fn long_spellings_of_integers_parse_exactly() {
    assert_eq!(fp("9007199254740991.0"), fp("9007199254740991"));
    assert_ne!(fp("9007199254740991.0"), fp("9007199254740990"));
    assert_eq!(fp("1.00000000000000000000000000"), fp("1"));
    assert_eq!(fp("0.300000000000000040"), fp("0.30000000000000004"));
}

proptest! {
    #![proptest_config(config())]

    /// A fingerprint read from the engine's one parse of a payload is the one the spec gives
    /// the payload's bytes, for every spec.
    #[test]
    fn fingerprint_parsed_is_the_fingerprint(doc in value(), pretty in any::<bool>()) {
        let bytes = if pretty { serde_json::to_vec_pretty(&doc)? } else { serde_json::to_vec(&doc)? };
        let json: Value = serde_json::from_slice(&bytes)?;
        let specs = [
            FingerprintSpec::Auto,
            FingerprintSpec::CanonicalJson,
            FingerprintSpec::Bytes,
            FingerprintSpec::JsonPointers(vec!["/a".into(), "/b/0".into(), String::new()]),
            FingerprintSpec::None,
        ];
        for spec in &specs {
            prop_assert_eq!(spec.fingerprint(&bytes)?, spec.fingerprint_parsed(&bytes, &json), "{:?}", spec);
        }
    }
}
