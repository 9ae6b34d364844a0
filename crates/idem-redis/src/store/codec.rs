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
    let has_result = r.u8()? == 1;
    let result = r.bytes()?;
    let text = |b: &[u8], what: &str| {
        String::from_utf8(b.to_vec()).map_err(|_| corrupt(format!("{what} is not UTF-8")))
    };
    let scope = text(r.bytes()?, "scope")?;
    let id = text(r.bytes()?, "id")?;
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
