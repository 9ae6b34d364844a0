//! Over the wire against `@vercel/cosmosdb-server` 1.0.1 (started by `.ci/services.sh`; set
//! `IDEM_TEST_COSMOS_SERVER_URL` to move it). Prints `skipped: …` when it does not answer, and
//! fails instead under `CI=true`.
//!
//! What this proves: the SDK's real HTTPS requests for create, read and If-Match replace, and the
//! statuses they come back with (201, 409, 200), are mapped the way idem-cosmos expects, on a
//! server other than the SDK's own in-memory emulator. What it does not prove: that server checks
//! no signature, keeps no session tokens, and its batches are not atomic, so nothing about auth,
//! consistency or batch atomicity is claimed from it. The client runs with lazy partition topology
//! and text JSON (see `common::account::cosmosdb_server_client` for why), so the SDK's topology
//! and binary-encoding paths are not exercised here.

use crate::common;

use std::time::Duration;

use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, Fingerprint};
use idem_cosmos::{CosmosMarker, CosmosStore};
use serde_json::json;

fn key(id: &str) -> DedupKey {
    DedupKey::new("order-writer", id).expect("key")
}

fn server() -> Option<String> {
    idem_testkit::service::require(
        "cosmosdb-server",
        "IDEM_TEST_COSMOS_SERVER_URL",
        "https://127.0.0.1:8081/",
    )
}

/// created → duplicate (same fingerprint, read back after the 409) → conflict (other fingerprint).
#[tokio::test]
async fn marker_409_path_over_rest() {
    let Some(url) = server() else { return };
    let client = common::account::cosmosdb_server_client(&url).await;
    let props = azure_data_cosmos::models::ContainerProperties::new("orders", "/orderId".into());
    let (orders, cleanup) = common::account::container(&client, props).await;
    let marker = CosmosMarker::new(orders, "/orderId").expect("marker");
    let doc = json!({"id": "o-1", "orderId": "o-1", "total": 10});
    let fp = |b: &[u8]| Some(Fingerprint::of_bytes(b));
    let first = marker.create_once(&key("o-1"), "o-1", &doc, fp(b"a")).await;
    let again = marker.create_once(&key("o-1"), "o-1", &doc, fp(b"a")).await;
    let other = marker.create_once(&key("o-1"), "o-1", &doc, fp(b"b")).await;
    cleanup.run().await;
    let first = first.expect("create");
    assert!(matches!(first, Claim::Acquired(_)), "{first:?}");
    match again.expect("duplicate") {
        Claim::Completed(rec) => {
            let stored: serde_json::Value =
                serde_json::from_slice(rec.result.as_deref().expect("the stored document"))
                    .expect("json");
            assert_eq!(stored["total"], 10);
        }
        other => panic!("expected a duplicate, got {other:?}"),
    }
    assert!(matches!(other.expect("conflict"), Claim::Conflict(_)));
}

/// claim (create, 201) → complete (read + If-Match replace) → claim again sees `Completed` with
/// the stored result.
#[tokio::test]
async fn store_claim_complete_duplicate_over_rest() {
    let Some(url) = server() else { return };
    let client = common::account::cosmosdb_server_client(&url).await;
    let (container, cleanup) =
        common::account::container(&client, CosmosStore::container_properties("idem")).await;
    let store = CosmosStore::new(container);
    let req = ClaimRequest::new(
        DedupKey::new("wire", common::unique("k")).expect("key"),
        Some(Fingerprint::of_bytes(b"a")),
        Duration::from_secs(30),
        Duration::from_secs(600),
    );
    let first = store.claim(&req).await;
    let (completed, again) = match first {
        Ok(Claim::Acquired(lease)) => (
            store.complete(lease, Some(b"r"), Duration::from_secs(600)).await,
            store.claim(&req).await,
        ),
        other => {
            cleanup.run().await;
            panic!("expected Acquired, got {other:?}");
        }
    };
    cleanup.run().await;
    completed.expect("complete");
    match again.expect("second claim") {
        Claim::Completed(record) => assert_eq!(record.result.as_deref(), Some(&b"r"[..])),
        other => panic!("expected Completed, got {other:?}"),
    }
}
