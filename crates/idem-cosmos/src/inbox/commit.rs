//! The batch to Cosmos DB: marker first, then the handler's documents; a 409 answered by
//! reading the marker.

use azure_data_cosmos::TransactionalBatch;
use azure_data_cosmos::models::TransactionalBatchResponse;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use idem_core::{Claim, DedupKey, Fingerprint, Record, Timestamp};
use serde_json::{Map, Value};

use super::CosmosInbox;
use super::docs::{Op, PendingMarker};
use crate::Error;
use crate::limits::{
    MAX_BATCH_BYTES, MAX_BATCH_OPERATIONS, MAX_ITEM_BYTES, check_id, check_partition,
    check_partition_key, check_size,
};
use crate::marker::{DEFAULT_FINGERPRINT_FIELD, entity_lease};
use crate::store::doc::fingerprint_field;

/// A stored marker, as far as the decision needs it.
#[derive(Debug, PartialEq)]
pub(super) struct Marker {
    pub(super) fingerprint: Option<Fingerprint>,
    pub(super) result: Option<Vec<u8>>,
    /// When it was written (`idemCreated`), if it says.
    pub(super) created: Option<Timestamp>,
}

impl Marker {
    /// The answer for a delivery of `key` with `incoming` that found this marker: a duplicate
    /// ([`Claim::Completed`], with the stored result) unless both fingerprints are known and
    /// differ ([`Claim::Conflict`]).
    pub(super) fn claim(self, key: &DedupKey, incoming: Option<Fingerprint>) -> Claim {
        let mut rec = Record::entity(key, self.fingerprint);
        rec.result = self.result;
        if let Some(at) = self.created {
            (rec.created_at, rec.updated_at) = (at, at);
        }
        match (self.fingerprint, incoming) {
            (Some(stored), Some(asked)) if stored != asked => Claim::Conflict(rec),
            _ => Claim::Completed(rec),
        }
    }
}

/// The marker's document id: the key hash (always a valid id), prefixed so it cannot meet an
/// entity id.
fn marker_id(key: &DedupKey) -> String {
    format!("idem-{}", hex::encode(key.hash().as_bytes()))
}

/// Sets `value` at `path` (`/a/b`) in `doc`, creating objects on the way.
fn set_path(doc: &mut Map<String, Value>, path: &str, value: Value) {
    let mut parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let last = parts.pop().unwrap_or_default();
    let mut at = doc;
    for p in parts {
        let slot = at.entry(p.to_owned()).or_insert_with(|| Value::Object(Map::new()));
        if !slot.is_object() {
            *slot = Value::Object(Map::new());
        }
        let Value::Object(next) = slot else { return };
        at = next;
    }
    at.insert(last.to_owned(), value);
}

impl CosmosInbox {
    fn marker_doc(&self, marker: &PendingMarker, partition: &str) -> Value {
        let key = &marker.key;
        let mut doc = Map::new();
        doc.insert("id".into(), marker_id(key).into());
        doc.insert("idemScope".into(), key.scope().into());
        doc.insert("idemKey".into(), key.id().into());
        if let Some(fp) = marker.fingerprint {
            doc.insert(DEFAULT_FINGERPRINT_FIELD.into(), hex::encode(fp.as_bytes()).into());
        }
        if let Some(r) = &marker.result {
            doc.insert("idemResult".into(), STANDARD.encode(r).into());
        }
        doc.insert("idemCreated".into(), self.clock.now().as_micros().into());
        let ttl = i64::try_from(self.retention.as_secs())
            .unwrap_or(i64::MAX)
            .clamp(1, i64::from(i32::MAX));
        doc.insert("ttl".into(), ttl.into());
        set_path(&mut doc, &self.partition_path, partition.into());
        Value::Object(doc)
    }

    /// Checks the batch against Cosmos DB's rules and builds it.
    fn build(
        &self,
        partition: &str,
        marker: Option<Value>,
        ops: Vec<Op>,
    ) -> Result<TransactionalBatch, Error> {
        check_partition_key(partition)?;
        let count = ops.len() + usize::from(marker.is_some());
        if count > MAX_BATCH_OPERATIONS {
            return Err(Error::TooManyOperations { count, limit: MAX_BATCH_OPERATIONS });
        }
        let mut total = 0;
        let mut batch = TransactionalBatch::new(partition.to_owned());
        let add = |e| Error::cosmos("batch", e);
        if let Some(m) = marker {
            total += serde_json::to_vec(&m).map_or(0, |b| b.len());
            batch = batch.create_item(m).map_err(add)?;
        }
        for op in ops {
            match op {
                Op::Create(doc) => {
                    total += check_doc(&doc, &self.partition_path, partition)?;
                    batch = batch.create_item(doc).map_err(add)?;
                }
                Op::Upsert(doc) => {
                    total += check_doc(&doc, &self.partition_path, partition)?;
                    batch = batch.upsert_item(doc, None).map_err(add)?;
                }
                Op::Delete(id) => {
                    check_id(&id)?;
                    batch = batch.delete_item(id, None);
                }
            }
        }
        check_size("batch", total, MAX_BATCH_BYTES)?;
        Ok(batch)
    }

    /// Writes `marker` and `ops` in one transactional batch under `partition`; the answer is
    /// the marker's: acquired when the batch committed, else what the existing marker says.
    pub(super) async fn commit_marked(
        &self,
        marker: &PendingMarker,
        partition: &str,
        ops: Vec<Op>,
    ) -> Result<Claim, Error> {
        let doc = self.marker_doc(marker, partition);
        let batch = self.build(partition, Some(doc), ops)?;
        let key = &marker.key;
        match self.execute(batch).await? {
            None => Ok(Claim::Acquired(entity_lease(key, marker.fingerprint))),
            Some((409, index)) => match self.read_marker(key, partition).await? {
                Some(m) => Ok(m.claim(key, marker.fingerprint)),
                None => Err(Error::Exists { id: format!("operation {index} of the batch") }),
            },
            Some((status, index)) => Err(Error::BatchFailed { status, index }),
        }
    }

    /// Writes `ops` in one transactional batch without a marker (a message without a key).
    pub(super) async fn commit_unmarked(&self, partition: &str, ops: Vec<Op>) -> Result<(), Error> {
        let batch = self.build(partition, None, ops)?;
        match self.execute(batch).await? {
            None => Ok(()),
            Some((409, index)) => {
                Err(Error::Exists { id: format!("operation {index} of the batch") })
            }
            Some((status, index)) => Err(Error::BatchFailed { status, index }),
        }
    }

    /// Runs the batch; `None` when it committed, else the failing operation's status and
    /// index (the others answer 424).
    async fn execute(&self, batch: TransactionalBatch) -> Result<Option<(u16, usize)>, Error> {
        let res = self
            .throttle
            .run(|| self.container.execute_transactional_batch(batch.clone(), None))
            .await;
        let response: TransactionalBatchResponse = match res {
            Ok(r) => r.into_model().map_err(|e| Error::cosmos("batch", e))?,
            // A failed batch may come back as an error with the culprit's status.
            Err(e) if e.status().is_conflict() => return Ok(Some((409, 0))),
            Err(e) => return Err(self.throttle.fail("batch", e)),
        };
        let culprit = response
            .results()
            .iter()
            .enumerate()
            .find(|(_, r)| !r.is_success() && r.status_code() != 424);
        Ok(match culprit {
            Some((i, r)) => Some((r.status_code(), i)),
            None if response.results().iter().all(|r| r.is_success()) => None,
            None => Some((424, 0)),
        })
    }

    async fn read_marker(&self, key: &DedupKey, partition: &str) -> Result<Option<Marker>, Error> {
        let id = marker_id(key);
        let pk = partition.to_owned();
        let res = self.throttle.run(|| self.container.read_item(pk.clone(), &id, None)).await;
        let doc: Value = match res {
            Ok(r) => r.into_model().map_err(|e| Error::cosmos("read_item", e))?,
            Err(e) if e.status().is_not_found() => return Ok(None),
            Err(e) => return Err(self.throttle.fail("read_item", e)),
        };
        marker_of(&doc, &id).map(Some)
    }
}

/// The marker a stored document holds. A field that is absent (or null) is none; one of
/// another type or not decodable is corrupt, never none: a missing fingerprint would make any
/// payload a duplicate.
fn marker_of(doc: &Value, id: &str) -> Result<Marker, Error> {
    let corrupt = |what: &str| Error::Corrupt { what: format!("{what} of marker {id}") };
    let fingerprint =
        fingerprint_field(doc, DEFAULT_FINGERPRINT_FIELD).map_err(|()| corrupt("fingerprint"))?;
    let result = match doc.get("idemResult") {
        None | Some(Value::Null) => None,
        Some(Value::String(b)) => Some(STANDARD.decode(b).map_err(|_| corrupt("result"))?),
        Some(_) => return Err(corrupt("result")),
    };
    let created = doc.get("idemCreated").and_then(Value::as_i64).map(Timestamp::from_micros);
    Ok(Marker { fingerprint, result, created })
}

/// Validates one document of the batch; its size in bytes.
fn check_doc(doc: &Value, path: &str, partition: &str) -> Result<usize, Error> {
    check_id(doc.get("id").and_then(Value::as_str).unwrap_or(""))?;
    check_partition(doc, path, partition)?;
    let len = serde_json::to_vec(doc).map_or(0, |b| b.len());
    check_size("document", len, MAX_ITEM_BYTES)?;
    Ok(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_partition_paths() {
        let mut m = Map::new();
        set_path(&mut m, "/customer/id", "c-1".into());
        assert_eq!(Value::Object(m), serde_json::json!({"customer": {"id": "c-1"}}));
    }
}

/// Property tests of the stored-marker decoder (512 cases; see `docs/RELIABILITY.md`).
#[cfg(test)]
mod props {
    use proptest::prelude::*;
    use proptest::test_runner::Config;
    use serde_json::json;

    use super::*;

    /// A marker field: its value (`None`: absent) and what it decodes to when well formed.
    fn field<T: Clone + std::fmt::Debug + 'static>(
        good: impl Strategy<Value = (Value, T)> + 'static,
        bad: Vec<Value>,
    ) -> BoxedStrategy<(Option<Value>, Option<Option<T>>)> {
        prop_oneof![
            3 => good.prop_map(|(v, t)| (Some(v), Some(Some(t)))),
            1 => Just((None, Some(None))),
            1 => Just((Some(Value::Null), Some(None))),
            2 => prop::sample::select(bad).prop_map(|v| (Some(v), None)),
        ]
        .boxed()
    }

    proptest! {
        #![proptest_config(Config { cases: 512, failure_persistence: None, ..Config::default() })]

        /// A marker's fingerprint and result are what the document holds, or it is corrupt:
        /// a fingerprint of another type is never read as none.
        #[test]
        fn markers_decode_exactly_or_are_corrupt(
            fp in field(
                any::<[u8; 32]>().prop_map(|b| (Value::from(hex::encode(b)), Fingerprint(b))),
                vec![json!(5), json!(true), json!(["ab"]), json!("abc"), json!("zz".repeat(32))],
            ),
            result in field(
                proptest::collection::vec(any::<u8>(), 0..8)
                    .prop_map(|b| (Value::from(STANDARD.encode(&b)), b)),
                vec![json!(5), json!("!!"), json!({})],
            ),
        ) {
            let mut doc = json!({"id": "m", "other": 1});
            for (name, v) in [(DEFAULT_FINGERPRINT_FIELD, &fp.0), ("idemResult", &result.0)] {
                if let Some(v) = v {
                    doc[name] = v.clone();
                }
            }
            match (marker_of(&doc, "m"), fp.1, result.1) {
                (Ok(m), Some(f), Some(r)) => {
                    prop_assert_eq!(m, Marker { fingerprint: f, result: r, created: None });
                }
                (Err(Error::Corrupt { what }), f, r) => {
                    prop_assert!(f.is_none() || r.is_none(), "corrupt ({}) but both are fine", what);
                    prop_assert!(what.ends_with("of marker m"), "{}", what);
                }
                (got, f, r) => prop_assert!(false, "{got:?} for {f:?}, {r:?}"),
            }
        }
    }

    /// Regression: a fingerprint field holding a number was read as "no fingerprint", so a
    /// reused id with other content counted as a duplicate instead of a conflict.
    #[test]
    fn a_fingerprint_of_another_type_is_corrupt() {
        let doc = json!({"id": "m", DEFAULT_FINGERPRINT_FIELD: 5});
        assert!(matches!(marker_of(&doc, "m"), Err(Error::Corrupt { .. })));
        let none = json!({"id": "m"});
        assert_eq!(
            marker_of(&none, "m").unwrap(),
            Marker { fingerprint: None, result: None, created: None }
        );
    }
}
