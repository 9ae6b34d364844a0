//! Cosmos DB's limits, checked before a request so the error names the field and the limit.

use crate::Error;

/// Longest document id Cosmos DB accepts, in characters.
pub const MAX_ID_CHARS: usize = 255;
/// Longest partition key value Cosmos DB accepts, in bytes.
pub const MAX_PARTITION_KEY_BYTES: usize = 2048;
/// Largest item Cosmos DB stores, in bytes (of its JSON).
pub const MAX_ITEM_BYTES: usize = 2 * 1024 * 1024;
/// Most operations in one transactional batch.
pub const MAX_BATCH_OPERATIONS: usize = 100;
/// Largest transactional batch request, in bytes.
pub const MAX_BATCH_BYTES: usize = 2 * 1024 * 1024;

/// Checks a document id against Cosmos DB's rules: 1 to 255 characters, none of `/ \ ? #`.
///
/// ```
/// assert!(idem_cosmos::limits::check_id("order-42").is_ok());
/// assert!(idem_cosmos::limits::check_id("a/b").is_err());
/// ```
///
/// # Errors
/// [`Error::InvalidId`] naming the rule broken.
pub fn check_id(id: &str) -> Result<(), Error> {
    let reason = if id.is_empty() {
        "it is empty"
    } else if id.chars().count() > MAX_ID_CHARS {
        "it is longer than 255 characters"
    } else if id.contains(['/', '\\', '?', '#']) {
        "it contains one of '/', '\\', '?', '#'"
    } else {
        return Ok(());
    };
    Err(Error::InvalidId { id: id.to_owned(), reason })
}

/// Checks a partition key value: not empty, at most 2 KiB.
///
/// ```
/// assert!(idem_cosmos::limits::check_partition_key("o-1").is_ok());
/// assert!(idem_cosmos::limits::check_partition_key("").is_err());
/// ```
///
/// # Errors
/// [`Error::InvalidPartitionKey`] naming the rule broken.
pub fn check_partition_key(value: &str) -> Result<(), Error> {
    if value.is_empty() {
        return Err(Error::InvalidPartitionKey { reason: "it is empty" });
    }
    if value.len() > MAX_PARTITION_KEY_BYTES {
        return Err(Error::InvalidPartitionKey { reason: "it is longer than 2 KiB" });
    }
    Ok(())
}

/// [`Error::TooLarge`] when `len` exceeds `limit`.
pub(crate) fn check_size(field: &'static str, len: usize, limit: usize) -> Result<(), Error> {
    if len > limit { Err(Error::TooLarge { field, len, limit }) } else { Ok(()) }
}

/// Checks that `doc` holds `expected` at the partition key `path` (`/orderId`, nested paths
/// as `/customer/id`), so a write cannot land in another partition than the one it is
/// batched or marked under.
pub(crate) fn check_partition(
    doc: &serde_json::Value,
    path: &str,
    expected: &str,
) -> Result<(), Error> {
    let found = doc.pointer(path);
    if found.and_then(serde_json::Value::as_str) == Some(expected) {
        return Ok(());
    }
    let id = doc.get("id").and_then(serde_json::Value::as_str).unwrap_or("").to_owned();
    Err(Error::WrongPartition {
        id,
        path: path.to_owned(),
        expected: expected.to_owned(),
        found: found.map_or_else(|| "null".to_owned(), ToString::to_string),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(check_id(&"x".repeat(255)).is_ok());
        assert!(matches!(check_id(&"x".repeat(256)), Err(Error::InvalidId { .. })));
        for bad in ["", "a/b", "a\\b", "a?b", "a#b"] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn partition_keys() {
        assert!(check_partition_key(&"k".repeat(2048)).is_ok());
        assert!(check_partition_key(&"k".repeat(2049)).is_err());
    }

    #[test]
    fn partitions() {
        let doc = serde_json::json!({"id": "l1", "orderId": "o-1", "c": {"id": "x"}});
        assert!(check_partition(&doc, "/orderId", "o-1").is_ok());
        assert!(check_partition(&doc, "/c/id", "x").is_ok());
        let Err(Error::WrongPartition { found, .. }) = check_partition(&doc, "/orderId", "o-2")
        else {
            panic!("expected WrongPartition")
        };
        assert_eq!(found, "\"o-1\"");
        assert!(check_partition(&doc, "/missing", "o-1").is_err());
    }
}
