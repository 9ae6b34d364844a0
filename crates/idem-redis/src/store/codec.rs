//! The packed record value the scripts write (Lua `struct`, big-endian):
//!
//! | field | format | |
//! |---|---|---|
//! | state | `B` | `RecordState::code` |
//! | previous state | `b` | -1 for none |
//! | attempt | `I4` | |
//! | token, created, updated, lease end, expiry | 5 × `d` | µs; lease end -1 for none |
//! | fingerprint | `I4` length + bytes | length 0 for none |
//! | has result, result | `B`, `I4` length + bytes | |
//! | scope, id | `I4` length + bytes each | |
//! | deaths | `I4` | only when above 0 (records written before it existed lack it) |

use idem_core::{Fingerprint, KeyHash, Record, RecordState, StoreError, Timestamp};

fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::Corrupt { what: what.into() }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], StoreError> {
        if self.0.len() < n {
            return Err(corrupt("record value is truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, StoreError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, StoreError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A double holding an integer (µs, token), as the scripts write them.
    fn int(&mut self, what: &str) -> Result<i64, StoreError> {
        let b = self.take(8)?;
        let f = f64::from_be_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
        if f.fract() != 0.0 || f.abs() > 9.0e15 {
            return Err(corrupt(format!("{what} {f} is not an exact integer")));
        }
        #[allow(clippy::cast_possible_truncation)] // checked just above: |f| < 2^53, no fraction
        Ok(f as i64)
    }

    fn bytes(&mut self) -> Result<&'a [u8], StoreError> {
        let n = usize::try_from(self.u32()?).map_err(|_| corrupt("length"))?;
        self.take(n)
    }
}

pub(crate) fn state(code: i64) -> Result<RecordState, StoreError> {
    RecordState::from_code(code).ok_or_else(|| corrupt(format!("state code {code}")))
}

/// A fingerprint field: empty means none.
pub(crate) fn fingerprint(b: &[u8]) -> Result<Option<Fingerprint>, StoreError> {
    if b.is_empty() {
        return Ok(None);
    }
    Fingerprint::from_slice(b).map(Some).map_err(|n| corrupt(format!("fingerprint of {n} bytes")))
}

/// Decodes a packed record.
pub(crate) fn record(v: &[u8], hash: KeyHash) -> Result<Record, StoreError> {
    let mut r = Reader(v);
    let st = state(i64::from(r.u8()?))?;
    let prev = i8::from_be_bytes([r.u8()?]);
    let attempt = r.u32()?;
    let token = r.int("token")?;
    let created = r.int("created")?;
    let updated = r.int("updated")?;
    let lease = r.int("lease end")?;
    let expires = r.int("expiry")?;
    let fp = fingerprint(r.bytes()?)?;
    let has_result = match r.u8()? {
        0 => false,
        1 => true,
        other => return Err(corrupt(format!("has-result flag {other}"))),
    };
    let result = r.bytes()?;
    if !has_result && !result.is_empty() {
        return Err(corrupt(format!("{} result bytes without the has-result flag", result.len())));
    }
    let text = |b: &[u8], what: &str| {
        String::from_utf8(b.to_vec()).map_err(|_| corrupt(format!("{what} is not UTF-8")))
    };
    let scope = text(r.bytes()?, "scope")?;
    let id = text(r.bytes()?, "id")?;
    // Absent means 0; the scripts never write a 0, so one written is not their value.
    let deaths = match r.0.is_empty() {
        true => 0,
        false => match r.u32()? {
            0 => return Err(corrupt("deaths 0 written (the scripts leave it out)")),
            d => d,
        },
    };
    if !r.0.is_empty() {
        return Err(corrupt(format!("record value has {} bytes past its end", r.0.len())));
    }
    // -1 stands for none; the scripts write nothing below it.
    if prev < -1 {
        return Err(corrupt(format!("previous state code {prev}")));
    }
    if lease < -1 {
        return Err(corrupt(format!("lease end {lease}")));
    }
    Ok(Record {
        key_hash: hash,
        scope,
        id,
        state: st,
        fingerprint: fp,
        result: has_result.then(|| result.to_vec()),
        attempt,
        token: u64::try_from(token).map_err(|_| corrupt(format!("token {token}")))?,
        previous: if prev < 0 { None } else { Some(state(i64::from(prev))?) },
        created_at: Timestamp::from_micros(created),
        updated_at: Timestamp::from_micros(updated),
        lease_until: (lease >= 0).then(|| Timestamp::from_micros(lease)),
        expires_at: Timestamp::from_micros(expires),
        deaths,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packs a record the way the scripts' `struct.pack` does.
    fn pack(st: u8, prev: i8, lease: f64, fp: &[u8], res: Option<&[u8]>) -> Vec<u8> {
        let mut v = vec![st, prev.to_be_bytes()[0]];
        v.extend(3u32.to_be_bytes());
        for d in [1_796_280_526_751_527.0f64, 10.0, 11.0, lease, 99.0] {
            v.extend(d.to_be_bytes());
        }
        let field = |v: &mut Vec<u8>, b: &[u8]| {
            v.extend(u32::try_from(b.len()).unwrap().to_be_bytes());
            v.extend(b);
        };
        field(&mut v, fp);
        v.push(u8::from(res.is_some()));
        field(&mut v, res.unwrap_or_default());
        field(&mut v, b"orders");
        field(&mut v, "o-1é".as_bytes());
        v
    }

    #[test]
    fn decodes_what_the_scripts_write() {
        let h = KeyHash([7; 32]);
        let r = record(&pack(1, 2, -1.0, &[5; 32], Some(b"ok")), h).unwrap();
        assert_eq!(r.state, RecordState::Completed);
        assert_eq!(r.previous, Some(RecordState::Released));
        assert_eq!(r.attempt, 3);
        assert_eq!(r.token, 1_796_280_526_751_527);
        assert_eq!(r.lease_until, None);
        assert_eq!(r.expires_at, Timestamp::from_micros(99));
        assert_eq!(r.fingerprint, Some(Fingerprint([5; 32])));
        assert_eq!(r.result.as_deref(), Some(&b"ok"[..]));
        assert_eq!((r.scope.as_str(), r.id.as_str()), ("orders", "o-1é"));

        let r = record(&pack(0, -1, 42.0, &[], None), h).unwrap();
        assert_eq!((r.previous, r.fingerprint, r.result), (None, None, None));
        assert_eq!(r.lease_until, Some(Timestamp::from_micros(42)));
    }

    #[test]
    fn refuses_malformed_values() {
        let h = KeyHash([0; 32]);
        let good = pack(0, -1, 1.0, &[], None);
        for cut in [0, 1, 10, good.len() - 1] {
            assert!(matches!(record(&good[..cut], h), Err(StoreError::Corrupt { .. })), "{cut}");
        }
        assert!(record(&pack(9, -1, 1.0, &[], None), h).is_err(), "unknown state");
        assert!(record(&pack(0, -1, 1.5, &[], None), h).is_err(), "fractional time");
        assert!(record(&pack(0, -1, 1.0, &[1; 7], None), h).is_err(), "short fingerprint");
    }
}

/// Property tests: packed values that are well formed, cut, flipped, extended or random
/// (512 cases each; see `docs/RELIABILITY.md`).
#[cfg(test)]
mod props {
    use proptest::collection::vec;
    use proptest::option;
    use proptest::prelude::*;
    use proptest::test_runner::Config;

    use super::*;

    fn config() -> Config {
        Config { cases: 512, failure_persistence: None, ..Config::default() }
    }

    /// Offsets of the five doubles (after state, previous state and attempt).
    const DOUBLES: [usize; 5] = [6, 14, 22, 30, 38];

    /// Integers a double holds exactly, as the reader accepts them.
    const EXACT: i64 = 9_000_000_000_000_000;

    fn state() -> impl Strategy<Value = RecordState> {
        prop::sample::select(RecordState::ALL.to_vec())
    }

    fn any_record() -> impl Strategy<Value = Record> {
        let text = ".{0,6}";
        (
            (any::<[u8; 32]>(), text, text, state(), option::of(any::<[u8; 32]>())),
            (
                option::of(vec(any::<u8>(), 0..8)),
                any::<u32>(),
                0..=EXACT,
                option::of(state()),
                prop_oneof![2 => Just(0u32), 1 => any::<u32>()],
            ),
            ([-EXACT..=EXACT, -EXACT..=EXACT, -EXACT..=EXACT], option::of(0..=EXACT)),
        )
            .prop_map(
                |(
                    (hash, scope, id, state, fp),
                    (result, attempt, token, previous, deaths),
                    times,
                )| {
                    let ([created, updated, expires], lease) = times;
                    Record {
                        key_hash: KeyHash(hash),
                        scope,
                        id,
                        state,
                        fingerprint: fp.map(Fingerprint),
                        result,
                        attempt,
                        token: token.unsigned_abs(),
                        previous,
                        created_at: Timestamp::from_micros(created),
                        updated_at: Timestamp::from_micros(updated),
                        lease_until: lease.map(Timestamp::from_micros),
                        expires_at: Timestamp::from_micros(expires),
                        deaths,
                    }
                },
            )
    }

    /// The value the scripts write for `r` (`struct.pack('>BbI4dddddI4c0BI4c0I4c0I4c0', …)`).
    #[allow(clippy::cast_precision_loss)] // below 2^53: exact
    fn pack(r: &Record) -> Vec<u8> {
        let mut v = vec![u8::try_from(r.state.code()).unwrap()];
        v.extend(r.previous.map_or(-1, |p| i8::try_from(p.code()).unwrap()).to_be_bytes());
        v.extend(r.attempt.to_be_bytes());
        let lease = r.lease_until.map_or(-1, Timestamp::as_micros);
        for n in
            [i64::try_from(r.token).unwrap(), r.created_at.as_micros(), r.updated_at.as_micros()]
                .into_iter()
                .chain([lease, r.expires_at.as_micros()])
        {
            v.extend((n as f64).to_be_bytes());
        }
        let field = |v: &mut Vec<u8>, b: &[u8]| {
            v.extend(u32::try_from(b.len()).unwrap().to_be_bytes());
            v.extend(b);
        };
        field(&mut v, r.fingerprint.as_ref().map_or(&[][..], |f| &f.0[..]));
        v.push(u8::from(r.result.is_some()));
        field(&mut v, r.result.as_deref().unwrap_or_default());
        field(&mut v, r.scope.as_bytes());
        field(&mut v, r.id.as_bytes());
        if r.deaths > 0 {
            v.extend(r.deaths.to_be_bytes());
        }
        v
    }

    /// `v` with -0.0 doubles written as 0.0: the one other spelling of an integer a double has.
    fn without_negative_zeros(mut v: Vec<u8>) -> Vec<u8> {
        for at in DOUBLES {
            if v.get(at..at + 8) == Some(&(-0.0f64).to_be_bytes()[..]) {
                v[at..at + 8].copy_from_slice(&0.0f64.to_be_bytes());
            }
        }
        v
    }

    /// Packed records cut short, with a byte changed, with bytes appended, or random bytes.
    fn hostile_value() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            (any_record(), any::<prop::sample::Index>()).prop_map(|(r, cut)| {
                let v = pack(&r);
                v[..cut.index(v.len())].to_vec()
            }),
            (any_record(), any::<prop::sample::Index>(), any::<u8>()).prop_map(|(r, at, b)| {
                let mut v = pack(&r);
                let at = at.index(v.len());
                v[at] = b;
                v
            }),
            (any_record(), vec(any::<u8>(), 1..4)).prop_map(|(r, tail)| [pack(&r), tail].concat()),
            vec(any::<u8>(), 0..96),
        ]
    }

    proptest! {
        #![proptest_config(config())]

        /// What the scripts write decodes to the record it was written for.
        #[test]
        fn packed_records_round_trip(r in any_record()) {
            prop_assert_eq!(record(&pack(&r), r.key_hash)?, r);
        }

        /// Any value: corrupt, or the one record whose packing it is — no byte is ignored
        /// and no flag or code outside the layout is read as something else.
        #[test]
        fn hostile_values_are_corrupt_or_exact(v in hostile_value()) {
            match record(&v, KeyHash([1; 32])) {
                Ok(r) => prop_assert_eq!(pack(&r), without_negative_zeros(v)),
                Err(StoreError::Corrupt { .. }) => {}
                Err(e) => prop_assert!(false, "{e:?}"),
            }
        }
    }

    /// Regressions found by `hostile_values_are_corrupt_or_exact`: each of these decoded to a
    /// record (bytes dropped, a flag or code read as another).
    #[test]
    fn malformed_layouts_are_corrupt() {
        let r = Record {
            key_hash: KeyHash([1; 32]),
            scope: "s".into(),
            id: "i".into(),
            state: RecordState::InProgress,
            fingerprint: None,
            result: None,
            attempt: 1,
            token: 5,
            previous: None,
            created_at: Timestamp::from_micros(1),
            updated_at: Timestamp::from_micros(1),
            lease_until: None,
            expires_at: Timestamp::from_micros(2),
            deaths: 0,
        };
        let good = pack(&r);
        let changed = |at: usize, b: &[u8]| {
            let mut v = good.clone();
            v.splice(at..at + b.len(), b.iter().copied());
            v
        };
        let has_result = 46 + 4; // after the doubles and the empty fingerprint
        for (what, v) in [
            ("trailing byte", [good.clone(), vec![0]].concat()),
            ("has-result flag 2", changed(has_result, &[2])),
            ("result without the flag", {
                let mut v = good.clone();
                v.splice(has_result + 1..has_result + 5, [0, 0, 0, 1, b'x']);
                v
            }),
            ("previous state -2", changed(1, &[0xfe])),
            ("lease end -2", changed(30, &(-2.0f64).to_be_bytes())),
            ("deaths 0 written", [good.clone(), vec![0; 4]].concat()),
        ] {
            assert!(matches!(record(&v, r.key_hash), Err(StoreError::Corrupt { .. })), "{what}");
        }
        assert_eq!(record(&good, r.key_hash).unwrap(), r);
    }
}
