//! The stored document of one dedup record, and its conversion to and from [`Record`].

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use idem_core::{DedupKey, Fingerprint, KeyHash, Record, RecordState, Timestamp};
use serde::{Deserialize, Serialize};

use crate::Error;

/// The partition key path of a store container.
pub(crate) const PK_PATH: &str = "/pk";

/// One record as Cosmos DB stores it. `id` and `pk` are both the key hash in hex (64
/// characters, always a valid id), so every key is its own logical partition and claims
/// spread evenly. Times are microseconds since the epoch (below 2^53, exact as JSON numbers);
/// the token is a string because it may not be.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RecordDoc {
    pub(crate) id: String,
    pub(crate) pk: String,
    pub(crate) scope: String,
    pub(crate) key: String,
    pub(crate) state: i16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) fp: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) result: Option<String>,
    pub(crate) attempt: u32,
    pub(crate) token: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) previous: Option<i16>,
    pub(crate) created: i64,
    pub(crate) updated: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) lease_until: Option<i64>,
    pub(crate) expires: i64,
    /// Cosmos DB's per-item time to live, in seconds from the last write.
    pub(crate) ttl: i64,
    /// Cosmos DB's ETag, as read; never written.
    #[serde(rename = "_etag", default, skip_serializing)]
    pub(crate) etag: Option<String>,
}

/// The document id (and partition key) of `key`.
/// A fingerprint stored as hex, or `None` when it is not one.
pub(crate) fn fingerprint_from_hex(h: &str) -> Option<Fingerprint> {
    hex::decode(h).ok().and_then(|b| Fingerprint::from_slice(&b).ok())
}

pub(crate) fn doc_id(key: &DedupKey) -> String {
    hex::encode(key.hash().as_bytes())
}

impl RecordDoc {
    /// The document for `rec`, with a `ttl` covering its expiry (as of `now`) plus `grace`.
    pub(crate) fn from_record(rec: &Record, now: Timestamp, grace: std::time::Duration) -> Self {
        let id = hex::encode(rec.key_hash.as_bytes());
        let left = rec.expires_at.since(now) + grace;
        // At least a second (0 is not a valid item ttl); at most what an i32 holds.
        let ttl = i64::try_from(left.as_secs().saturating_add(1))
            .unwrap_or(i64::MAX)
            .min(i64::from(i32::MAX));
        Self {
            pk: id.clone(),
            id,
            scope: rec.scope.clone(),
            key: rec.id.clone(),
            state: rec.state.code(),
            fp: rec.fingerprint.map(|f| hex::encode(f.as_bytes())),
            result: rec.result.as_deref().map(|b| STANDARD.encode(b)),
            attempt: rec.attempt,
            token: rec.token.to_string(),
            previous: rec.previous.map(RecordState::code),
            created: rec.created_at.as_micros(),
            updated: rec.updated_at.as_micros(),
            lease_until: rec.lease_until.map(Timestamp::as_micros),
            expires: rec.expires_at.as_micros(),
            ttl,
            etag: None,
        }
    }

    /// The record this document stores.
    pub(crate) fn to_record(&self) -> Result<Record, Error> {
        let corrupt =
            |what: &str| Error::Corrupt { what: format!("{what} of document {}", self.id) };
        let hash = hex::decode(&self.id)
            .ok()
            .and_then(|b| KeyHash::from_slice(&b).ok())
            .ok_or_else(|| corrupt("id (not a key hash)"))?;
        let state = |code: i16| RecordState::from_code(i64::from(code));
        let fingerprint = match &self.fp {
            None => None,
            Some(h) => Some(fingerprint_from_hex(h).ok_or_else(|| corrupt("fingerprint"))?),
        };
        let result = match &self.result {
            None => None,
            Some(b) => Some(STANDARD.decode(b).map_err(|_| corrupt("result (not base64)"))?),
        };
        Ok(Record {
            key_hash: hash,
            scope: self.scope.clone(),
            id: self.key.clone(),
            state: state(self.state).ok_or_else(|| corrupt("state"))?,
            fingerprint,
            result,
            attempt: self.attempt,
            token: self.token.parse().map_err(|_| corrupt("token"))?,
            previous: match self.previous {
                None => None,
                Some(c) => Some(state(c).ok_or_else(|| corrupt("previous state"))?),
            },
            created_at: Timestamp::from_micros(self.created),
            updated_at: Timestamp::from_micros(self.updated),
            lease_until: self.lease_until.map(Timestamp::from_micros),
            expires_at: Timestamp::from_micros(self.expires),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn round_trip() {
        let key = DedupKey::new("s", "a/b?#").expect("key");
        let now = Timestamp::from_micros(1_700_000_000_000_000);
        let rec = Record {
            key_hash: key.hash(),
            scope: "s".into(),
            id: key.id().into(),
            state: RecordState::Completed,
            fingerprint: Some(Fingerprint::of_bytes(b"x")),
            result: Some(vec![0, 1, 255]),
            attempt: 2,
            token: u64::MAX,
            previous: Some(RecordState::Released),
            created_at: now,
            updated_at: now,
            lease_until: None,
            expires_at: now.plus(Duration::from_secs(60)),
        };
        let doc = RecordDoc::from_record(&rec, now, Duration::from_secs(10));
        assert_eq!(doc.id, doc_id(&key));
        assert!(crate::limits::check_id(&doc.id).is_ok());
        assert_eq!(doc.ttl, 71);
        let json = serde_json::to_value(&doc).expect("json");
        let back: RecordDoc = serde_json::from_value(json).expect("decode");
        assert_eq!(back.to_record().expect("record"), rec);
    }
}
