//! A client for a real endpoint: `@vercel/cosmosdb-server` on loopback, or an Azure account.

use azure_data_cosmos::clients::ContainerClient;
use azure_data_cosmos::models::ContainerProperties;
use azure_data_cosmos::options::{
    BinaryEncodingOptions, ConnectionPoolOptionsBuilder, PartitionFailoverOptions,
    PartitionTopologyCacheMode, ServerCertificateValidation,
};
use azure_data_cosmos::{
    AccountEndpoint, AccountReference, CosmosClient, CosmosClientBuilder, CosmosRuntimeBuilder,
    RoutingStrategy,
};

/// A client for `endpoint` with account `key`, with the SDK's default settings.
pub async fn client(endpoint: &str, key: &str) -> CosmosClient {
    client_with(endpoint, key, |b| b).await
}

/// A client for the local `@vercel/cosmosdb-server` 1.0.1. The server checks no signature, so
/// any base64 key will do. Two client settings differ from the defaults, each because the server
/// cannot answer what the SDK would otherwise send (found by logging the wire):
///
/// - **Lazy partition topology.** By default `container_client()` reads
///   `GET /dbs/{db}/colls/{coll}/pkranges` (change feed, `A-IM: Incremental Feed`). The server
///   answers `{"PartitionKeyRanges":[{"id":0,...}]}`: a JSON *number* for `id`, which the
///   driver's `PartitionKeyRange { id: String }` refuses to parse, so the topology load fails
///   with 503/20305. Point operations (all these tests use) need no topology; lazy mode defers
///   the read until an operation does, so a test that needs it would still fail here.
/// - **Text JSON bodies.** The SDK sends point-operation bodies in Cosmos *binary* JSON by
///   default; the server `JSON.parse`s every body and answers 500.
pub async fn cosmosdb_server_client(endpoint: &str) -> CosmosClient {
    client_with(endpoint, "dGVzdGtleQ==", |b| {
        b.with_partition_failover_options(
            PartitionFailoverOptions::builder()
                .with_partition_topology_cache_mode(PartitionTopologyCacheMode::Lazy)
                .build()
                .expect("partition failover options"),
        )
        .with_binary_encoding_options(BinaryEncodingOptions::new().with_enabled(false))
    })
    .await
}

async fn client_with(
    endpoint: &str,
    key: &str,
    configure: impl FnOnce(CosmosClientBuilder) -> CosmosClientBuilder,
) -> CosmosClient {
    idem_cosmos::install_crypto_provider();
    let account = AccountReference::with_authentication_key(
        endpoint.parse::<AccountEndpoint>().expect("endpoint"),
        azure_core::credentials::Secret::new(key.to_owned()),
    );
    // Loopback (the local cosmosdb-server) may present a self-signed certificate.
    let pool = ConnectionPoolOptionsBuilder::new()
        .with_server_certificate_validation(ServerCertificateValidation::RequiredUnlessEmulator)
        // cosmosdb-server speaks HTTP/1.1 only (its TLS offers no h2).
        .with_is_http2_allowed(false)
        .build()
        .expect("pool options");
    let runtime =
        CosmosRuntimeBuilder::new().with_connection_pool(pool).build().await.expect("runtime");
    configure(CosmosClientBuilder::new().with_runtime(runtime))
        .build(account, RoutingStrategy::PreferredRegions(Vec::new()))
        .await
        .expect("client")
}

/// A fresh database (deleted by [`Cleanup`]) with a container of `props`.
pub async fn container(
    client: &CosmosClient,
    props: ContainerProperties,
) -> (ContainerClient, Cleanup) {
    let db = super::unique("idem-test");
    client.create_database(&db, None).await.expect("create database");
    let name = props.id.to_string();
    let database = client.database_client(&db);
    database.create_container(props, None).await.expect("create container");
    let container = database.container_client(&name, None).await.expect("container client");
    (container, Cleanup { client: client.clone(), db })
}

/// Deletes the test database.
pub struct Cleanup {
    client: CosmosClient,
    db: String,
}

impl Cleanup {
    pub async fn run(self) {
        if let Err(e) = self.client.database_client(&self.db).delete(None).await {
            eprintln!("cleanup: deleting database {} failed: {e}", self.db);
        }
    }
}
