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

fn fingerprint(v: &Value) -> Result<Option<Fingerprint>, StoreError> {
    codec::fingerprint(bytes(v).unwrap_or_default())
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
        (Some(0), [_, token, attempt, until, prev, fp]) => {
            let prev = int(prev, "previous state")?;
            Ok(Claim::Acquired(Lease::new(
                req.key.clone(),
                fingerprint(fp)?,
                u64_of(int(token, "token")?, "token")?,
                u32_of(int(attempt, "attempt")?, "attempt")?,
                Timestamp::from_micros(int(until, "lease end")?),
                if prev < 0 { None } else { Some(codec::state(prev)?) },
            )))
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
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).map_err(|_| corrupt("record key is not hex"))?;
        out[i] = u8::from_str_radix(s, 16).map_err(|_| corrupt("record key is not hex"))?;
    }
    Ok(KeyHash(out))
}
