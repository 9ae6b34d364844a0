//! The stored document of one dedup record, and its conversion to and from [`Record`].

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use idem_core::{DedupKey, Fingerprint, KeyHash, Record, RecordState, Timestamp};
use serde::{Deserialize, Serialize};
use serde_json::Value;

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
    /// [`Record::deaths`]; absent (0) in documents written before it existed.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub(crate) deaths: u32,
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

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's `skip_serializing_if` passes a reference
fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A fingerprint stored as hex, or `None` when it is not one.
pub(crate) fn fingerprint_from_hex(h: &str) -> Option<Fingerprint> {
    hex::decode(h).ok().and_then(|b| Fingerprint::from_slice(&b).ok())
}

/// The fingerprint in a document's top-level `field`: absent or null is none; a value that is
/// not a 64-digit hex string is `Err` (never read as none, which would make any payload a
/// duplicate).
pub(crate) fn fingerprint_field(doc: &Value, field: &str) -> Result<Option<Fingerprint>, ()> {
    match doc.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(h)) => fingerprint_from_hex(h).map(Some).ok_or(()),
        Some(_) => Err(()),
    }
}

/// The document id (and partition key) of `key`.
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
            deaths: rec.deaths,
            created: rec.created_at.as_micros(),
            updated: rec.updated_at.as_micros(),
            lease_until: rec.lease_until.map(Timestamp::as_micros),
            expires: rec.expires_at.as_micros(),
            ttl,
            etag: None,
        }
    }

    /// A document as read back; [`Error::Corrupt`] when a field is missing or of another type.
    pub(crate) fn from_json(doc: Value) -> Result<Self, Error> {
        let id = doc.get("id").and_then(Value::as_str).unwrap_or("without an id").to_owned();
        serde_json::from_value(doc)
            .map_err(|e| Error::Corrupt { what: format!("document {id} does not decode: {e}") })
    }

    /// The record this document stores.
    pub(crate) fn to_record(&self) -> Result<Record, Error> {
        let corrupt =
            |what: &str| Error::Corrupt { what: format!("{what} of document {}", self.id) };
        // The id is the hash as `doc_id` writes it (lower-case hex), not merely some hex.
        let hash = hex::decode(&self.id)
            .ok()
            .and_then(|b| KeyHash::from_slice(&b).ok())
            .filter(|h| hex::encode(h.as_bytes()) == self.id)
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
            deaths: self.deaths,
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
            deaths: 3,
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

/// Property tests: documents with every field well formed, malformed, of another type or
/// missing (512 cases; see `docs/RELIABILITY.md`).
#[cfg(test)]
mod props {
    use std::time::Duration;

    use proptest::collection::vec;
    use proptest::prelude::*;
    use proptest::test_runner::Config;
    use serde_json::{Map, json};

    use super::*;

    /// The fields `to_record` reads (the rest — `pk`, `ttl`, `_etag` — must only decode).
    const RECORD_FIELDS: [&str; 13] = [
        "id",
        "scope",
        "key",
        "state",
        "fp",
        "result",
        "attempt",
        "token",
        "previous",
        "created",
        "updated",
        "lease_until",
        "expires",
    ];

    /// A field: its value (`None`: absent) and whether the decoder must accept it.
    type Field = (Option<Value>, bool);

    /// Well formed (in the form `from_record` writes), malformed, or absent.
    fn field(
        good: impl Strategy<Value = Value> + 'static,
        bad: impl Strategy<Value = Value> + 'static,
        optional: bool,
    ) -> BoxedStrategy<Field> {
        prop_oneof![
            6 => good.prop_map(|v| (Some(v), true)),
            1 => bad.prop_map(|v| (Some(v), false)),
            1 => Just((None, optional)),
        ]
        .boxed()
    }

    fn hex32() -> impl Strategy<Value = String> {
        any::<[u8; 32]>().prop_map(hex::encode)
    }

    fn int(v: Vec<Value>) -> impl Strategy<Value = Value> {
        prop::sample::select(v)
    }

    fn document() -> impl Strategy<Value = (Value, bool)> {
        let not_text = || int(vec![json!(5), Value::Null, json!([])]);
        let fields = vec![
            // Upper-case hex with a letter in it names a hash, but not as `doc_id` writes it.
            field(
                hex32().prop_map(Value::from),
                prop_oneof![
                    hex32().prop_map(|h| format!("A{}", &h[1..]).into()),
                    Just(json!("abcd")),
                    Just(json!("zz".repeat(32))),
                    Just(json!(5)),
                ],
                false,
            ),
            field(".{0,4}".prop_map(Value::from), not_text(), false),
            field(".{0,4}".prop_map(Value::from), not_text(), false),
            field(
                (0..5).prop_map(Value::from),
                int(vec![json!(5), json!(-1), json!(40000), json!("1"), json!(1.5)]),
                false,
            ),
            field(
                prop_oneof![hex32().prop_map(Value::from), Just(Value::Null)],
                int(vec![json!("abc"), json!(5), json!("zz".repeat(32))]),
                true,
            ),
            field(
                prop_oneof![
                    vec(any::<u8>(), 0..8).prop_map(|b| STANDARD.encode(b).into()),
                    Just(Value::Null)
                ],
                int(vec![json!("!!"), json!("QQ"), json!(5)]),
                true,
            ),
            field(
                any::<u32>().prop_map(Value::from),
                int(vec![json!(-1), json!(4_294_967_296_u64), json!(1.5), json!("1")]),
                false,
            ),
            field(
                any::<u64>().prop_map(|t| t.to_string().into()),
                int(vec![
                    json!("-1"),
                    json!("x"),
                    json!(""),
                    json!("18446744073709551616"),
                    json!(5),
                ]),
                false,
            ),
            field(
                prop_oneof![(0..5).prop_map(Value::from), Just(Value::Null)],
                int(vec![json!(9), json!(-1), json!("1")]),
                true,
            ),
            field(
                any::<i64>().prop_map(Value::from),
                int(vec![json!(1.5), json!("1"), Value::Null]),
                false,
            ),
            field(
                any::<i64>().prop_map(Value::from),
                int(vec![json!(1.5), json!("1"), Value::Null]),
                false,
            ),
            field(
                prop_oneof![any::<i64>().prop_map(Value::from), Just(Value::Null)],
                int(vec![json!("x"), json!(1.5)]),
                true,
            ),
            field(
                any::<i64>().prop_map(Value::from),
                int(vec![json!(1.5), json!("1"), Value::Null]),
                false,
            ),
        ];
        let extra = vec![
            field(".{0,4}".prop_map(Value::from), not_text(), false),
            field(any::<i64>().prop_map(Value::from), int(vec![json!("x"), json!(1.5)]), false),
            field(
                prop_oneof![".{0,4}".prop_map(Value::from), Just(Value::Null)],
                int(vec![json!(5)]),
                true,
            ),
        ];
        assert_eq!(fields.len(), RECORD_FIELDS.len());
        (fields, extra).prop_map(|(fields, extra)| {
            let names = RECORD_FIELDS.iter().chain(&["pk", "ttl", "_etag"]);
            let mut doc = Map::new();
            let mut valid = true;
            for (name, (value, ok)) in names.zip(fields.into_iter().chain(extra)) {
                valid &= ok;
                if let Some(v) = value {
                    doc.insert((*name).to_owned(), v);
                }
            }
            (Value::Object(doc), valid)
        })
    }

    /// A field as the record sees it: null and absent are the same.
    fn present(doc: &Value, name: &str) -> Option<Value> {
        doc.get(name).filter(|v| !v.is_null()).cloned()
    }

    proptest! {
        #![proptest_config(Config { cases: 512, failure_persistence: None, ..Config::default() })]

        /// A document decodes to the record that `from_record` writes back field for field, or
        /// fails as corrupt — a missing field or one of another type included, never a
        /// backend error or a guess.
        #[test]
        fn documents_decode_exactly_or_are_corrupt((doc, valid) in document()) {
            let decoded = RecordDoc::from_json(doc.clone()).and_then(|d| d.to_record());
            match (decoded, valid) {
                (Ok(rec), true) => {
                    let back = RecordDoc::from_record(&rec, Timestamp::from_micros(0), Duration::ZERO);
                    let back = serde_json::to_value(back)?;
                    for name in RECORD_FIELDS {
                        prop_assert_eq!(present(&doc, name), present(&back, name), "{}", name);
                    }
                }
                (Err(Error::Corrupt { .. }), false) => {}
                (got, valid) => prop_assert!(false, "{got:?} (valid: {valid}) for {doc}"),
            }
        }
    }

    /// Regression: an id in upper-case hex decoded to the hash whose document id is the
    /// lower-case one, so `list` reported a record that `get` cannot find.
    #[test]
    fn an_id_not_written_by_doc_id_is_corrupt() {
        let key = DedupKey::new("s", "k").unwrap();
        let rec = Record {
            key_hash: key.hash(),
            scope: "s".into(),
            id: "k".into(),
            state: RecordState::Completed,
            fingerprint: None,
            result: None,
            attempt: 1,
            token: 1,
            previous: None,
            deaths: 0,
            created_at: Timestamp::from_micros(0),
            updated_at: Timestamp::from_micros(0),
            lease_until: None,
            expires_at: Timestamp::from_micros(0),
        };
        let mut doc = RecordDoc::from_record(&rec, Timestamp::from_micros(0), Duration::ZERO);
        assert_eq!(doc.to_record().unwrap(), rec);
        doc.id = doc.id.to_uppercase();
        assert!(matches!(doc.to_record(), Err(Error::Corrupt { .. })));
    }
}
