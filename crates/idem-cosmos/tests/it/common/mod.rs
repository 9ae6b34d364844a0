//! The SDK's in-memory Cosmos DB emulator: a fresh account per test, no server.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use azure_data_cosmos::clients::ContainerClient;
use azure_data_cosmos::options::Region;
use azure_data_cosmos::{
    AccountEndpoint, AccountReference, CosmosClient, CosmosClientBuilder, CosmosRuntimeBuilder,
    RoutingStrategy,
};
use azure_data_cosmos_driver::in_memory_emulator::{
    ConsistencyLevel, EmulatorStore, InMemoryEmulatorHttpClient, VirtualAccountConfig,
    VirtualRegion,
};

pub mod account;

const GATEWAY: &str = "https://eastus.emulator.local";

/// One emulated account.
pub struct Emulator {
    pub client: CosmosClient,
    pub store: Arc<EmulatorStore>,
}

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A name unique to this test process.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed))
}

impl Emulator {
    pub async fn start() -> Self {
        Self::start_with(|builder| builder).await
    }

    /// Like [`Emulator::start`], with the client builder customised (fault injection rules,
    /// default operation options) before the client is built.
    pub async fn start_with(
        customize: impl FnOnce(CosmosClientBuilder) -> CosmosClientBuilder,
    ) -> Self {
        idem_cosmos::install_crypto_provider();
        let url = azure_core::http::Url::parse(GATEWAY).expect("url");
        let config = VirtualAccountConfig::new(vec![VirtualRegion::new("East US", url)])
            .expect("emulator config")
            .with_consistency(ConsistencyLevel::Session);
        let emulator = Arc::new(InMemoryEmulatorHttpClient::new(config));
        let store = emulator.store();
        let account = AccountReference::with_authentication_key(
            GATEWAY.parse::<AccountEndpoint>().expect("endpoint"),
            azure_core::credentials::Secret::new("dGVzdGtleQ=="),
        );
        let runtime = CosmosRuntimeBuilder::from(emulator.runtime_builder())
            .build()
            .await
            .expect("emulator runtime");
        let client = customize(CosmosClientBuilder::new())
            .with_runtime(runtime)
            .build(account, RoutingStrategy::ProximityTo(Region::EAST_US))
            .await
            .expect("emulator client");
        Self { client, store }
    }

    /// A fresh database with one container partitioned on `pk_path`.
    pub async fn container(&self, pk_path: &str) -> ContainerClient {
        let db = unique("db");
        let coll = unique("coll");
        self.store.create_database(&db);
        let pk_def = serde_json::from_value(serde_json::json!({
            "paths": [pk_path], "kind": "Hash", "version": 2
        }))
        .expect("pk definition");
        self.store.create_container(&db, &coll, pk_def);
        self.client.database_client(&db).container_client(&coll, None).await.expect("container")
    }
}
