//! Generators of JSON values and of other spellings of the same value.

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::{Number, Value};

/// 2^53: the canonical form prints integral numbers below it as integers.
pub(crate) const MAX_SAFE: i64 = 1 << 53;

/// Characters that stress escaping and key order: quotes, backslashes, controls, DEL, line
/// separators, the last BMP code points and non-BMP ones (UTF-16 surrogate pairs).
pub(crate) fn text() -> impl Strategy<Value = String> {
    let ch = prop_oneof![
        4 => proptest::char::range('a', 'e'),
        2 => prop::sample::select(vec![
            '"', '\\', '/', '\u{0}', '\u{1f}', '\n', '\t', '\u{7f}', 'é', '\u{2028}', '\u{e000}',
            '\u{fffd}', '\u{ffff}', '\u{1f600}', '\u{10ffff}',
        ]),
        1 => any::<char>(),
    ];
    proptest::collection::vec(ch, 0..8).prop_map(|v| v.into_iter().collect())
}

/// Numbers within the documented range: integers below 2^53 in magnitude (and the edges),
/// integral floats there, and any finite non-integral float (all of them are below 2^52).
pub(crate) fn number() -> impl Strategy<Value = Number> {
    let edges = vec![0, 1, -1, MAX_SAFE - 1, -(MAX_SAFE - 1), MAX_SAFE - 2, 10, 1000];
    prop_oneof![
        3 => (-MAX_SAFE + 1..MAX_SAFE).prop_map(Number::from),
        1 => prop::sample::select(edges).prop_map(Number::from),
        1 => (-1000i64..1000).prop_map(Number::from),
        1 => (-MAX_SAFE + 1..MAX_SAFE).prop_filter_map("float", integral_float),
        3 => fraction().prop_filter_map("finite", Number::from_f64),
    ]
}

/// Finite non-integral floats of any magnitude below 2^52, subnormals included: a random
/// sign and mantissa under a biased exponent below 1075 (so that bits below the point exist).
pub(crate) fn fraction() -> impl Strategy<Value = f64> {
    (any::<bool>(), 0u64..1075, any::<u64>())
        .prop_map(|(neg, exp, m)| {
            f64::from_bits((u64::from(neg) << 63) | (exp << 52) | (m & ((1 << 52) - 1)))
        })
        .prop_filter("non-integral", |f| f.fract() != 0.0)
}

#[allow(clippy::cast_precision_loss)] // below 2^53: exact
fn integral_float(i: i64) -> Option<Number> {
    Number::from_f64(i as f64)
}

/// Any JSON value with numbers in the documented range, up to 4 levels deep.
pub(crate) fn value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number().prop_map(Value::Number),
        text().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::vec((text(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A value as the documentation defines equality: numbers by value (an integral float below
/// 2^53 equals the integer, -0 equals 0), objects as maps.
#[derive(Debug, PartialEq)]
pub(crate) enum Norm {
    Null,
    Bool(bool),
    Int(i128),
    Float(u64),
    Str(String),
    Array(Vec<Norm>),
    Object(BTreeMap<String, Norm>),
}

pub(crate) fn norm(v: &Value) -> Norm {
    match v {
        Value::Null => Norm::Null,
        Value::Bool(b) => Norm::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Norm::Int(i.into()),
            (_, Some(u), _) => Norm::Int(u.into()),
            #[allow(clippy::cast_possible_truncation)] // integral and below 2^53: exact
            (_, _, Some(f)) if f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0 => {
                Norm::Int(i128::from(f as i64))
            }
            (_, _, f) => Norm::Float(f.unwrap_or(f64::NAN).to_bits()),
        },
        Value::String(s) => Norm::Str(s.clone()),
        Value::Array(items) => Norm::Array(items.iter().map(norm).collect()),
        Value::Object(map) => Norm::Object(map.iter().map(|(k, v)| (k.clone(), norm(v))).collect()),
    }
}

/// A small deterministic source of spelling choices (SplitMix64), seeded by the test.
pub(crate) struct Choices(u64);

impl Choices {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A choice in `0..n`.
    pub(crate) fn pick(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        usize::try_from(z % n as u64).unwrap_or(0)
    }
}

/// Another spelling of `v`: object keys in another order, insignificant whitespace, characters
/// escaped in every allowed way, numbers in equivalent notations.
pub(crate) fn respell(v: &Value, c: &mut Choices) -> String {
    let mut out = String::new();
    write(v, c, &mut out);
    out
}

fn ws(c: &mut Choices, out: &mut String) {
    for _ in 0..c.pick(3) {
        out.push([' ', '\t', '\n', '\r'][c.pick(4)]);
    }
}

fn write(v: &Value, c: &mut Choices, out: &mut String) {
    ws(c, out);
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&spell_number(n, c)),
        Value::String(s) => spell_string(s, c, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(item, c, out);
            }
            ws(c, out);
            out.push(']');
        }
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            for i in (1..entries.len()).rev() {
                entries.swap(i, c.pick(i + 1));
            }
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                ws(c, out);
                spell_string(k, c, out);
                ws(c, out);
                out.push(':');
                write(v, c, out);
            }
            ws(c, out);
            out.push('}');
        }
    }
    ws(c, out);
}

fn spell_string(s: &str, c: &mut Choices, out: &mut String) {
    out.push('"');
    for ch in s.chars() {
        let short = match ch {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            _ => None,
        };
        let must_escape = ch == '"' || ch == '\\' || ch < ' ';
        match (c.pick(3), short) {
            (0, _) if !must_escape => out.push(ch),
            (1, Some(short)) => out.push_str(short),
            _ => {
                let mut units = [0u16; 2];
                for u in ch.encode_utf16(&mut units) {
                    let hex = format!("{u:04x}");
                    out.push_str("\\u");
                    out.push_str(&if c.pick(2) == 0 { hex } else { hex.to_uppercase() });
                }
            }
        }
    }
    out.push('"');
}

fn spell_number(n: &Number, c: &mut Choices) -> String {
    match (n.as_i64(), n.as_u64(), n.as_f64()) {
        (Some(i), _, _) => spell_integer(i.into(), c),
        (_, Some(u), _) => spell_integer(u.into(), c),
        #[allow(clippy::cast_possible_truncation)] // integral and below 2^53: exact
        (_, _, Some(f)) if f.fract() == 0.0 => spell_integer(i128::from(f as i64), c),
        (_, _, Some(f)) => spell_float(f, c),
        _ => n.to_string(),
    }
}

/// `i` as an integer, with a fraction of zeros, with an exponent, or as a scaled mantissa.
fn spell_integer(i: i128, c: &mut Choices) -> String {
    let sign = if i < 0 || (i == 0 && c.pick(2) == 0) { "-" } else { "" };
    let digits = i.unsigned_abs().to_string();
    let zeros = |c: &mut Choices| "0".repeat(1 + c.pick(24));
    match c.pick(7) {
        0 => format!("{sign}{digits}"),
        // Many zeros: more digits than a u64 significand holds.
        1 => format!("{sign}{digits}.{}", zeros(c)),
        2 => format!("{sign}{digits}{}", ["e0", "E0", "e+0", "e-0", "E+000"][c.pick(5)]),
        // `12300e-2`; for zero, `0e-2` (JSON allows no leading zeros).
        3 => {
            let z = zeros(c);
            let scaled = if i == 0 { String::from("0") } else { format!("{digits}{z}") };
            format!("{sign}{scaled}e-{}", z.len())
        }
        4 => {
            let (head, tail) = digits.split_at(1);
            let e = digits.len() - 1;
            if tail.is_empty() {
                format!("{sign}{head}e{e}")
            } else {
                format!("{sign}{head}.{tail}e+{e}")
            }
        }
        5 => format!("{sign}0.{digits}e{}", digits.len()),
        _ => format!("{sign}0.{digits}{}E{}", zeros(c), digits.len()),
    }
}

/// A non-integral float in shortest, plain, exponent or padded notation.
fn spell_float(f: f64, c: &mut Choices) -> String {
    let exp = format!("{f:e}"); // shortest round-trip digits: `-1.2345e-7`
    let (mantissa, e) = exp.split_once('e').unwrap_or((&exp, "0"));
    let e: i64 = e.parse().unwrap_or(0);
    match c.pick(5) {
        0 => format!("{f:?}"),
        1 => format!("{f}"),
        2 => exp.clone(),
        // Trailing zeros in the mantissa.
        3 => {
            let dot = if mantissa.contains('.') { "" } else { "." };
            format!("{mantissa}{dot}{}e{e}", "0".repeat(1 + c.pick(20)))
        }
        // An integer mantissa: `-12345e-11`.
        _ => {
            let frac = mantissa.split_once('.').map_or(0, |(_, t)| t.len());
            let whole = mantissa.replace('.', "");
            format!("{whole}e{}", e - i64::try_from(frac).unwrap_or(0))
        }
    }
}
