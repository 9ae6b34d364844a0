//! Script replies to idem values.

use idem_core::{Claim, ClaimRequest, Fingerprint, KeyHash, Lease, Record, StoreError, Timestamp};

use super::codec;
use redis::Value;

fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::Corrupt { what: what.into() }
}

fn int(v: &Value, what: &str) -> Result<i64, StoreError> {
    match v {
        Value::Int(n) => Ok(*n),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| corrupt(format!("{what} is not an integer"))),
        other => Err(corrupt(format!("{what}: unexpected reply {other:?}"))),
    }
}

fn bytes(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        _ => None,
    }
}

fn u64_of(n: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(n).map_err(|_| corrupt(format!("{what} {n}")))
}

fn u32_of(n: i64, what: &str) -> Result<u32, StoreError> {
    u32::try_from(n).map_err(|_| corrupt(format!("{what} {n}")))
}

fn array<'a>(v: &'a Value, what: &str) -> Result<&'a [Value], StoreError> {
    match v {
        Value::Array(items) => Ok(items),
        other => Err(corrupt(format!("{what}: expected an array, got {other:?}"))),
    }
}

/// A record from a `GET` reply (or a script's); `None` when the key does not exist.
pub(crate) fn record(v: &Value, hash: KeyHash) -> Result<Option<Record>, StoreError> {
    match v {
        Value::Nil => Ok(None),
        Value::BulkString(b) => codec::record(b, hash).map(Some),
        other => Err(corrupt(format!("record: unexpected reply {other:?}"))),
    }
}

/// A fingerprint reply: a bulk string, empty for none.
fn fingerprint(v: &Value) -> Result<Option<Fingerprint>, StoreError> {
    codec::fingerprint(
        bytes(v).ok_or_else(|| corrupt(format!("fingerprint: unexpected reply {v:?}")))?,
    )
}

/// A claim reply (see `scripts::CLAIM_FN`).
pub(crate) fn claim(v: &Value, req: &ClaimRequest) -> Result<Claim, StoreError> {
    let f = array(v, "claim reply")?;
    let kind = f.first().map(|k| int(k, "claim kind")).transpose()?;
    let hash = req.key.hash();
    let rec = |i: usize| -> Result<Record, StoreError> {
        let v = f.get(i).ok_or_else(|| corrupt("claim reply without record"))?;
        record(v, hash)?.ok_or_else(|| corrupt("claim reply with an empty record"))
    };
    match (kind, f) {
        (Some(0), [_, token, attempt, until, prev, fp, deaths]) => {
            let prev = int(prev, "previous state")?;
            if prev < -1 {
                return Err(corrupt(format!("previous state code {prev}")));
            }
            Ok(Claim::Acquired(
                Lease::new(
                    req.key.clone(),
                    fingerprint(fp)?,
                    u64_of(int(token, "token")?, "token")?,
                    u32_of(int(attempt, "attempt")?, "attempt")?,
                    Timestamp::from_micros(int(until, "lease end")?),
                    if prev < 0 { None } else { Some(codec::state(prev)?) },
                )
                .with_deaths(u32_of(int(deaths, "deaths")?, "deaths")?),
            ))
        }
        (Some(1), _) => Ok(Claim::Completed(rec(1)?)),
        (Some(2), [_, left, attempt]) => Ok(Claim::InProgress {
            retry_after: std::time::Duration::from_micros(u64_of(
                int(left, "retry after")?,
                "retry after",
            )?),
            attempt: u32_of(int(attempt, "attempt")?, "attempt")?,
        }),
        (Some(3), _) => Ok(Claim::Conflict(rec(1)?)),
        _ => Err(corrupt(format!("unexpected claim reply {v:?}"))),
    }
}

/// The replies of a batch claim, in order.
pub(crate) fn claims(v: &Value, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
    let items = array(v, "batch claim reply")?;
    if items.len() != reqs.len() {
        return Err(corrupt(format!("{} answers to {} claims", items.len(), reqs.len())));
    }
    items.iter().zip(reqs).map(|(v, r)| claim(v, r)).collect()
}

/// The scope and state of a scanned record, for counting without decoding it whole.
pub(crate) fn int_reply(v: &Value, what: &str) -> Result<i64, StoreError> {
    int(v, what)
}

/// A key hash from a record key's hex suffix.
pub(crate) fn hash_of_key(key: &[u8], prefix_len: usize) -> Result<KeyHash, StoreError> {
    let hex = key.get(prefix_len..).ok_or_else(|| corrupt("record key shorter than its prefix"))?;
    let mut out = [0u8; 32];
    if hex.len() != 64 {
        return Err(corrupt(format!("record key suffix of {} bytes", hex.len())));
    }
    // Lower-case hex digits only, as `record_key` writes them: `u8::from_str_radix` would also
    // take `+f` and `AB`, naming a key this store never wrote after one it did.
    let digit = |b: u8| match b {
        b'0'..=b'9' => Ok(b - b'0'),
        b'a'..=b'f' => Ok(b - b'a' + 10),
        _ => Err(corrupt("record key is not lower-case hex")),
    };
    for (i, pair) in hex.chunks(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Ok(KeyHash(out))
}

/// Property tests: script replies of any shape, and claim replies with each field in or out
/// of its domain (512 cases each; see `docs/RELIABILITY.md`).
#[cfg(test)]
mod props {
    use std::time::Duration;

    use idem_core::{DedupKey, RecordState};
    use proptest::collection::vec;
    use proptest::prelude::*;
    use proptest::test_runner::Config;

    use super::*;

    fn config() -> Config {
        Config { cases: 512, failure_persistence: None, ..Config::default() }
    }

    fn request() -> ClaimRequest {
        let key = DedupKey::new("scope", "id").unwrap();
        ClaimRequest::new(key, None, Duration::from_secs(1), Duration::from_secs(2))
    }

    /// Any reply a server or a proxy could send, nested.
    fn any_reply() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Nil),
            Just(Value::Okay),
            any::<i64>().prop_map(Value::Int),
            (-3i64..6).prop_map(Value::Int),
            vec(any::<u8>(), 0..40).prop_map(Value::BulkString),
            "-?[0-9]{1,3}".prop_map(|s| Value::BulkString(s.into_bytes())),
            ".{0,4}".prop_map(Value::SimpleString),
            any::<f64>().prop_map(Value::Double),
            any::<bool>().prop_map(Value::Boolean),
        ];
        leaf.prop_recursive(3, 24, 7, |inner| {
            prop_oneof![
                vec(inner.clone(), 0..7).prop_map(Value::Array),
                vec(inner.clone(), 0..4).prop_map(Value::Set),
                vec((inner.clone(), inner), 0..3).prop_map(Value::Map),
            ]
        })
    }

    /// Replies that are no integer at all.
    fn junk() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Nil),
            Just(Value::Okay),
            Just(Value::BulkString(b"x".to_vec())),
            Just(Value::SimpleString("1".into())),
            Just(Value::Double(1.0)),
            Just(Value::Array(vec![])),
        ]
    }

    /// An integer field: the reply, and the value when it lies in `lo..=hi`.
    fn int_field(lo: i64, hi: i64) -> impl Strategy<Value = (Value, Option<i64>)> {
        let out = vec![lo.saturating_sub(1), hi.saturating_add(1), i64::MIN, i64::MAX]
            .into_iter()
            .filter(move |n| !(lo..=hi).contains(n))
            .collect::<Vec<_>>();
        let bad = if out.is_empty() {
            junk().prop_map(|v| (v, None)).boxed()
        } else {
            prop_oneof![
                prop::sample::select(out).prop_map(|n| (Value::Int(n), None)),
                junk().prop_map(|v| (v, None)),
            ]
            .boxed()
        };
        prop_oneof![
            4 => (lo..=hi).prop_map(|n| (Value::Int(n), Some(n))),
            1 => (lo..=hi).prop_map(|n| (Value::BulkString(n.to_string().into_bytes()), Some(n))),
            2 => bad,
        ]
    }

    /// A fingerprint field: the reply, and `Some(fingerprint or none)` when it is well formed.
    fn fp_field() -> impl Strategy<Value = (Value, Option<Option<Fingerprint>>)> {
        prop_oneof![
            3 => any::<[u8; 32]>().prop_map(|b| (Value::BulkString(b.to_vec()), Some(Some(Fingerprint(b))))),
            1 => Just((Value::BulkString(vec![]), Some(None))),
            1 => vec(any::<u8>(), 1..40)
                .prop_filter("not 32", |b| b.len() != 32)
                .prop_map(|b| (Value::BulkString(b), None)),
            1 => prop_oneof![Just(Value::Nil), Just(Value::Int(0))].prop_map(|v| (v, None)),
        ]
    }

    proptest! {
        #![proptest_config(config())]

        /// Any reply to a claim or a batch claim: an answer or a corrupt error, never a panic.
        #[test]
        fn any_reply_is_an_answer_or_corrupt(v in any_reply(), n in 0usize..3) {
            match claim(&v, &request()) {
                Ok(_) | Err(StoreError::Corrupt { .. }) => {}
                Err(e) => prop_assert!(false, "{e:?}"),
            }
            let reqs: Vec<_> = (0..n).map(|_| request()).collect();
            match claims(&v, &reqs) {
                Ok(answers) => prop_assert_eq!(answers.len(), n),
                Err(StoreError::Corrupt { .. }) => {}
                Err(e) => prop_assert!(false, "{e:?}"),
            }
        }

        /// An acquired reply `{0, token, attempt, until, prev, fp, deaths}` is the lease it describes
        /// when every field is in its domain, and corrupt otherwise.
        #[test]
        fn acquired_replies_decode_exactly_or_are_corrupt(
            token in int_field(0, i64::MAX),
            attempt in int_field(0, u32::MAX.into()),
            until in int_field(i64::MIN, i64::MAX),
            prev in int_field(-1, 4),
            fp in fp_field(),
            deaths in int_field(0, u32::MAX.into()),
        ) {
            let reply = Value::Array(vec![
                Value::Int(0), token.0, attempt.0, until.0, prev.0, fp.0, deaths.0,
            ]);
            let want = (token.1, attempt.1, until.1, prev.1, fp.1, deaths.1);
            match (claim(&reply, &request()), want) {
                (Ok(Claim::Acquired(l)), (Some(t), Some(a), Some(u), Some(p), Some(f), Some(d))) => {
                    prop_assert_eq!(i64::from(l.deaths()), d);
                    prop_assert_eq!(i64::try_from(l.token()).ok(), Some(t));
                    prop_assert_eq!(i64::from(l.attempt()), a);
                    prop_assert_eq!(l.until(), Timestamp::from_micros(u));
                    prop_assert_eq!(l.previous().map(|s| i64::from(s.code())), (p >= 0).then_some(p));
                    prop_assert_eq!(l.fingerprint(), f);
                    prop_assert_eq!(l.key(), &request().key);
                }
                (Err(StoreError::Corrupt { .. }), w) => {
                    let all = w.0.is_some() && w.1.is_some() && w.2.is_some() && w.3.is_some() && w.4.is_some() && w.5.is_some();
                    prop_assert!(!all, "corrupt, but every field is fine");
                }
                (got, w) => prop_assert!(false, "{got:?} for {w:?}"),
            }
        }

        /// A record key's suffix is the hash exactly as `record_key` writes it (64 lower-case
        /// hex digits); anything else is corrupt.
        #[test]
        fn record_keys_name_their_hash_or_are_corrupt(
            prefix in "[a-z:{}]{0,8}",
            hash in any::<[u8; 32]>(),
            noise in prop_oneof![
                Just(None),
                (0usize..64, prop::sample::select(vec![b'+', b'A', b'F', b'g', b' ', b'-', 0xc3]))
                    .prop_map(Some),
            ],
            junk in vec(any::<u8>(), 0..80),
            random in any::<bool>(),
        ) {
            let hex = KeyHash(hash).to_string();
            let mut key = if random { junk } else { format!("{prefix}{hex}").into_bytes() };
            if let (Some((at, b)), false) = (noise, random) {
                key[prefix.len() + at] = b;
            }
            match hash_of_key(&key, prefix.len()) {
                Ok(h) => {
                    let written = h.to_string();
                    prop_assert_eq!(key.get(prefix.len()..), Some(written.as_bytes()));
                }
                Err(StoreError::Corrupt { .. }) => {
                    prop_assert!(random || noise.is_some(), "refused a key it writes: {}", hex);
                }
                Err(e) => prop_assert!(false, "{e:?}"),
            }
        }
    }

    /// Regressions found by `record_keys_name_their_hash_or_are_corrupt` and
    /// `acquired_replies_decode_exactly_or_are_corrupt`: each of these was decoded.
    #[test]
    fn near_misses_are_corrupt() {
        let hex = KeyHash([0x0f; 32]).to_string();
        for key in [hex.replace("0f", "+f"), hex.to_uppercase()] {
            assert!(hash_of_key(key.as_bytes(), 0).is_err(), "{key}");
        }
        assert_eq!(hash_of_key(hex.as_bytes(), 0).unwrap(), KeyHash([0x0f; 32]));
        let acquired = |prev: i64, fp: Value| {
            let v = [
                Value::Int(0),
                Value::Int(1),
                Value::Int(1),
                Value::Int(5),
                Value::Int(prev),
                fp,
                Value::Int(0),
            ];
            claim(&Value::Array(v.to_vec()), &request())
        };
        assert!(acquired(-2, Value::BulkString(vec![])).is_err(), "previous state -2");
        assert!(acquired(-1, Value::Int(7)).is_err(), "a fingerprint that is not a string");
        let ok = acquired(RecordState::Released.code().into(), Value::BulkString(vec![]));
        assert!(matches!(ok, Ok(Claim::Acquired(_))));
    }
}
