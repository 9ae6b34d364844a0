//! Entity as marker on the in-memory emulator: 409 → read → compare.

use crate::common;

use idem_core::{Claim, DedupKey, Fingerprint};
use idem_cosmos::{CosmosMarker, Error};
use serde_json::json;

async fn marker() -> (CosmosMarker, common::Emulator) {
    let emu = common::Emulator::start().await;
    let orders = emu.container("/orderId").await;
    (CosmosMarker::new(orders, "/orderId").expect("marker"), emu)
}

fn key(id: &str) -> DedupKey {
    DedupKey::new("order-writer", id).expect("key")
}

fn fp(b: &[u8]) -> Option<Fingerprint> {
    Some(Fingerprint::of_bytes(b))
}

#[tokio::test]
async fn created_then_duplicate_then_conflict() {
    let (m, _emu) = marker().await;
    let doc = json!({"id": "o-1", "orderId": "o-1", "total": 10});
    let first = m.create_once(&key("o-1"), "o-1", &doc, fp(b"a")).await.expect("create");
    assert!(matches!(first, Claim::Acquired(ref l) if l.key() == &key("o-1")), "{first:?}");
    match m.create_once(&key("o-1"), "o-1", &doc, fp(b"a")).await.expect("again") {
        Claim::Completed(rec) => {
            assert_eq!((rec.id.as_str(), rec.fingerprint), ("o-1", fp(b"a")));
            let stored: serde_json::Value =
                serde_json::from_slice(rec.result.as_deref().expect("the stored document"))
                    .expect("json");
            assert_eq!(stored["total"], 10);
        }
        other => panic!("expected duplicate, got {other:?}"),
    }
    match m.create_once(&key("o-1"), "o-1", &doc, fp(b"b")).await.expect("other payload") {
        Claim::Conflict(rec) => assert_eq!(rec.fingerprint, fp(b"a"), "the stored fingerprint"),
        other => panic!("expected conflict, got {other:?}"),
    }
}

#[tokio::test]
async fn immutable_fields_decide() {
    let (m, _emu) = marker().await;
    let m = m.compare_fields(["/total"]).expect("pointers");
    let doc = json!({"id": "o-2", "orderId": "o-2", "total": 10, "note": "x"});
    let first = m.create_once(&key("o-2"), "o-2", &doc, None).await.expect("create");
    assert!(matches!(first, Claim::Acquired(_)), "{first:?}");
    let same_total = json!({"id": "o-2", "orderId": "o-2", "total": 10, "note": "y"});
    assert!(matches!(
        m.create_once(&key("o-2"), "o-2", &same_total, None).await,
        Ok(Claim::Completed(_))
    ));
    let other_total = json!({"id": "o-2", "orderId": "o-2", "total": 11});
    assert!(matches!(
        m.create_once(&key("o-2"), "o-2", &other_total, None).await,
        Ok(Claim::Conflict(_))
    ));
}

#[tokio::test]
async fn validation_before_any_request() {
    let (m, _emu) = marker().await;
    let bad_id = json!({"id": "o/3", "orderId": "o-3"});
    assert!(matches!(
        m.create_once(&key("o/3"), "o-3", &bad_id, None).await,
        Err(Error::InvalidId { .. })
    ));
    let not_the_key = json!({"id": "o-4", "orderId": "o-3"});
    assert!(matches!(
        m.create_once(&key("o-3"), "o-3", &not_the_key, None).await,
        Err(Error::InvalidId { .. })
    ));
    let elsewhere = json!({"id": "o-3", "orderId": "o-4"});
    assert!(matches!(
        m.create_once(&key("o-3"), "o-3", &elsewhere, None).await,
        Err(Error::WrongPartition { .. })
    ));
    let empty_pk = json!({"id": "o-3", "orderId": ""});
    assert!(matches!(
        m.create_once(&key("o-3"), "", &empty_pk, None).await,
        Err(Error::InvalidPartitionKey { .. })
    ));
    let huge = json!({"id": "o-3", "orderId": "o-3", "blob": "x".repeat(2 * 1024 * 1024)});
    match m.create_once(&key("o-3"), "o-3", &huge, None).await {
        Err(Error::TooLarge { field, limit, .. }) => {
            assert_eq!(field, "document");
            assert_eq!(limit, 2 * 1024 * 1024);
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(!Error::InvalidPartitionKey { reason: "x" }.is_retryable());
}
