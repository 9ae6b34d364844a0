//! Opt-in end to end against a real Azure Cosmos DB account: set `IDEM_TEST_COSMOS_ENDPOINT`
//! and `IDEM_TEST_COSMOS_KEY`. Prints `skipped: …` otherwise (never required in CI).

use crate::common;

use std::time::Duration;

use idem_core::{Claim, ClaimRequest, DedupKey, DedupStore, Fingerprint};
use idem_cosmos::{CosmosMarker, CosmosStore};
use serde_json::json;

fn key(id: &str) -> DedupKey {
    DedupKey::new("order-writer", id).expect("key")
}

fn account() -> Option<(String, String)> {
    let Ok(endpoint) = std::env::var("IDEM_TEST_COSMOS_ENDPOINT") else {
        eprintln!("skipped: IDEM_TEST_COSMOS_ENDPOINT unset");
        return None;
    };
    let Ok(key) = std::env::var("IDEM_TEST_COSMOS_KEY") else {
        eprintln!("skipped: IDEM_TEST_COSMOS_KEY unset");
        return None;
    };
    Some((endpoint, key))
}

#[tokio::test]
async fn store_and_marker_on_azure() {
    let Some((endpoint, account_key)) = account() else { return };
    let client = common::account::client(&endpoint, &account_key).await;
    let (container, cleanup) =
        common::account::container(&client, CosmosStore::container_properties("idem")).await;
    let store = CosmosStore::new(container);
    let req = ClaimRequest::new(
        DedupKey::new("azure", common::unique("k")).expect("key"),
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
        other => panic!("expected Acquired, got {other:?}"),
    };
    let (orders, cleanup_orders) = common::account::container(
        &client,
        azure_data_cosmos::models::ContainerProperties::new("orders", "/orderId".into()),
    )
    .await;
    let marker = CosmosMarker::new(orders, "/orderId").expect("marker");
    let doc = json!({"id": "o-1", "orderId": "o-1"});
    let m1 = marker.create_once(&key("o-1"), "o-1", &doc, None).await;
    let m2 = marker.create_once(&key("o-1"), "o-1", &doc, None).await;
    cleanup.run().await;
    cleanup_orders.run().await;
    completed.expect("complete");
    assert!(matches!(again, Ok(Claim::Completed(_))));
    let m1 = m1.expect("create");
    assert!(matches!(m1, Claim::Acquired(_)), "{m1:?}");
    assert!(matches!(m2, Ok(Claim::Completed(_))));
}
