//! The Idempotent Consumer pattern's Azure example, end to end: orders received from a Service
//! Bus queue in PeekLock mode, `MessageId` as the dedup key (never `CorrelationId`), and the
//! order written to Cosmos DB in one transactional batch with its dedup marker, in the order's
//! partition (`/orderId`).
//!
//! `cargo run -p idem-consumer --features amqp10,cosmos,amqp --example servicebus_cosmos_orders`
//!
//! By default it runs on local stand-ins: RabbitMQ's AMQP 1.0 plugin for Service Bus
//! (`IDEM_AMQP10_URL`, default `amqp://guest:guest@127.0.0.1:5672`, on a queue of its own that
//! it deletes at the end) and the Cosmos DB SDK's in-memory emulator for Cosmos DB. It
//! publishes five orders — three orders, the producer's retry of one, and an order id reused
//! with other content — consumes them, and exits non-zero unless each order (and its lines)
//! is stored once and the reused id went to the dead-letter queue with its reason.
//!
//! Against Azure, set `IDEM_SERVICEBUS_CONNECTION` (a connection string with
//! `EntityPath=<queue>` and Listen rights) and `IDEM_COSMOS_ENDPOINT` / `IDEM_COSMOS_KEY`
//! (an account with a database `idem` holding a container `orders` partitioned by `/orderId`,
//! TTL on): it then consumes what is on the queue for `IDEM_RUN_SECONDS` (default 30) and
//! prints each outcome; dead letters go to the queue's dead-letter sub-queue.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use azure_data_cosmos::clients::ContainerClient;
use idem::OutcomeKind;
use idem::Tx;
use idem::amqp::lapin;
use idem::amqp10::fe2o3_amqp::types::messaging::{Body, Data, Message, MessageId, Properties};
use idem::amqp10::fe2o3_amqp::types::primitives::{Binary, Value};
use idem::amqp10::fe2o3_amqp::{Connection, Receiver, Sender, Session};
use idem::amqp10::{Amqp10Config, Amqp10Consumer, DeadLetters, Delivery, ServiceBus};
use idem::consumer::Settlement;
use idem::cosmos::CosmosInbox;
use idem::engine::{HandlerError, Verb};
use idem::extract::Envelope;
use serde_json::json;

type Error = Box<dyn std::error::Error + Send + Sync>;

const WEEK: Duration = Duration::from_secs(7 * 86_400);

/// The handler: the order and one document per line, in the order's partition. Cosmos DB
/// commits them with the dedup marker in one transactional batch once this returns `Ok`; a
/// redelivery meets the marker (409 on the batch) and is completed as a duplicate.
async fn write_order(
    mut docs: Tx<CosmosInbox>,
    msg: Delivery,
) -> Result<u64, HandlerError<String>> {
    let permanent = |e: &dyn std::fmt::Display| HandlerError::Permanent(e.to_string());
    let order: serde_json::Value =
        serde_json::from_slice(msg.payload()).map_err(|e| permanent(&e))?;
    let id = order["orderId"].as_str().ok_or_else(|| permanent(&"no orderId"))?.to_owned();
    docs.set_partition_key(id.clone()).map_err(|e| permanent(&e))?;
    docs.create(
        &json!({"id": id, "orderId": id, "customer": order["customer"], "cents": order["cents"]}),
    )
    .map_err(|e| permanent(&e))?;
    let lines = order["lines"].as_array().cloned().unwrap_or_default();
    for (n, line) in lines.iter().enumerate() {
        docs.create(&json!({"id": format!("{id}-line-{n}"), "orderId": id, "line": line}))
            .map_err(|e| permanent(&e))?;
    }
    Ok(lines.len() as u64)
}

type Seen = Arc<Mutex<Vec<(String, OutcomeKind)>>>;

fn printer(seen: Seen) -> impl Fn(&Settlement<'_, Delivery>) + Send + Sync + 'static {
    move |s| {
        let id = s.message.message_id().unwrap_or("-").to_owned();
        let verb = match s.verb {
            Verb::Ack => "complete".to_owned(),
            Verb::DeadLetter { reason } => format!("dead-letter ({reason})"),
            Verb::Retry { .. } => "abandon".to_owned(),
            _ => "release".to_owned(),
        };
        println!("  {id:<10} {:<18} → {verb}", s.outcome.as_str());
        seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((id, s.outcome));
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    match (std::env::var("IDEM_SERVICEBUS_CONNECTION"), std::env::var("IDEM_COSMOS_ENDPOINT")) {
        (Ok(sb), Ok(endpoint)) => azure(&sb, &endpoint).await,
        _ => local().await,
    }
}

/// Against Azure: consume what the queue holds for a while.
async fn azure(connection: &str, endpoint: &str) -> Result<(), Error> {
    let key = std::env::var("IDEM_COSMOS_KEY").map_err(|_| "IDEM_COSMOS_KEY is unset")?;
    let seconds: u64 =
        std::env::var("IDEM_RUN_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    idem::cosmos::install_crypto_provider();
    let account = azure_data_cosmos::AccountReference::with_authentication_key(
        endpoint.parse::<azure_data_cosmos::AccountEndpoint>()?,
        azure_core::credentials::Secret::new(key),
    );
    let client = azure_data_cosmos::CosmosClientBuilder::new()
        .build(account, azure_data_cosmos::RoutingStrategy::PreferredRegions(Vec::new()))
        .await?;
    let orders = client.database_client("idem").container_client("orders", None).await?;
    let queue = ServiceBus::from_connection_string(connection)?.entity()?; // MaxDeliveryCount 10, lock 60 s
    let seen = Seen::default();
    let consumer = Amqp10Consumer::builder(queue)
        .inbox(CosmosInbox::new(orders, "/orderId")?.retention(WEEK))
        .scope("order-writer")
        .on_settle(printer(Arc::clone(&seen)))
        .build()
        .await?;
    println!("consuming from Service Bus for {seconds} s");
    let report =
        consumer.run(write_order, tokio::time::sleep(Duration::from_secs(seconds))).await?;
    println!("{report}");
    Ok(())
}

/// On the local stand-ins: publish, consume, check.
async fn local() -> Result<(), Error> {
    let url = std::env::var("IDEM_AMQP10_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672".to_owned());
    let queue = format!("idem-example-sb-orders-{}", std::process::id());
    let admin = Admin::declare(&queue).await?;
    println!("stand-ins: RabbitMQ AMQP 1.0 queue {queue}, Cosmos DB in-memory emulator");

    let mut connection = Connection::open(format!("{queue}-producer"), url.as_str()).await?;
    let mut session = Session::begin(&mut connection).await?;
    let mut producer =
        Sender::attach(&mut session, "producer", format!("/amq/queue/{queue}")).await?;
    let orders = [
        (
            "o-1",
            json!({"orderId": "o-1", "customer": "ada", "cents": 1200, "lines": ["book", "pen"]}),
        ),
        ("o-2", json!({"orderId": "o-2", "customer": "bob", "cents": 550, "lines": ["mug"]})),
        (
            "o-1",
            json!({"orderId": "o-1", "customer": "ada", "cents": 1200, "lines": ["book", "pen"]}),
        ), // retry
        ("o-3", json!({"orderId": "o-3", "customer": "cy", "cents": 9900, "lines": ["lamp"]})),
        ("o-2", json!({"orderId": "o-2", "customer": "eve", "cents": 1, "lines": []})), // reused id
    ];
    for (id, body) in &orders {
        let message = Message {
            header: None,
            delivery_annotations: None,
            message_annotations: None,
            properties: Some(Properties {
                message_id: Some(MessageId::String((*id).to_owned())),
                correlation_id: Some(MessageId::String("checkout-7".to_owned())), // never the key
                ..Properties::default()
            }),
            application_properties: None,
            body: Body::<Value>::Data(vec![Data(Binary::from(serde_json::to_vec(body)?))].into()),
            footer: None,
        };
        producer.send(message).await?;
        println!("published {id}: {body}");
    }
    // RabbitMQ answers a closing detach without `closed=true`: do not wait on it.
    drop(producer);

    let emulator = emulator::Emulator::start().await?;
    let container = emulator.orders().await?;
    let seen = Seen::default();
    // The whole consumer: the queue, the inbox on the container, a scope.
    let config = Amqp10Config::new(url.clone(), format!("/amq/queue/{queue}"))
        .dead_letters(DeadLetters::Address(format!("/amq/queue/{queue}.dlq")));
    let consumer = Amqp10Consumer::builder(config)
        .inbox(CosmosInbox::new(container.clone(), "/orderId")?.retention(WEEK))
        .scope("order-writer")
        .idle_wait(Duration::from_millis(300))
        .on_settle(printer(Arc::clone(&seen)))
        .build()
        .await?;
    let drained = {
        let seen = Arc::clone(&seen);
        async move {
            while seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()
                < orders.len()
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let report = tokio::time::timeout(Duration::from_secs(60), consumer.run(write_order, drained))
        .await
        .map_err(|_| "the queue did not drain within 60 s")??;
    println!("{report}");

    // Check the story: each order once, with the first content; the reuse dead-lettered.
    let mut failures = Vec::new();
    for (id, cents, lines) in [("o-1", 1200, 2), ("o-2", 550, 1), ("o-3", 9900, 1)] {
        let doc = read(&container, id, id).await?;
        if doc.as_ref().map(|d| d["cents"].clone()) != Some(json!(cents)) {
            failures.push(format!("{id}: stored {doc:?}, expected {cents} cents"));
        }
        for n in 0..lines {
            if read(&container, id, &format!("{id}-line-{n}")).await?.is_none() {
                failures.push(format!("{id}: line {n} missing"));
            }
        }
    }
    let kinds = seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    let count = |k: OutcomeKind| kinds.iter().filter(|(_, o)| *o == k).count();
    if (count(OutcomeKind::Processed), count(OutcomeKind::Duplicate), count(OutcomeKind::Conflict))
        != (3, 1, 1)
    {
        failures.push(format!("outcomes {kinds:?}"));
    }
    let dead = admin.dead_letters(&url, &queue).await?;
    if dead != ["o-2"] {
        failures.push(format!("dead letters {dead:?}, expected [\"o-2\"]"));
    }
    let _ = connection.close().await;
    admin.delete(&queue).await?;
    if failures.is_empty() {
        println!(
            "ok: 3 orders stored once with their lines, 1 retry completed as a duplicate, 1 reused id dead-lettered"
        );
        Ok(())
    } else {
        Err(failures.join("; ").into())
    }
}

async fn read(c: &ContainerClient, pk: &str, id: &str) -> Result<Option<serde_json::Value>, Error> {
    match c.read_item(pk.to_owned(), id, None).await {
        Ok(r) => Ok(Some(r.into_model()?)),
        Err(e) if e.status().is_not_found() => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The local queue and its dead-letter queue, declared and deleted over AMQP 0-9-1 (AMQP 1.0
/// on RabbitMQ 3.10 cannot delete a queue).
struct Admin {
    channel: lapin::Channel,
    _conn: lapin::Connection,
}

impl Admin {
    async fn declare(queue: &str) -> Result<Self, Error> {
        let url = std::env::var("IDEM_AMQP_URL")
            .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned());
        let conn = lapin::Connection::connect(&url, lapin::ConnectionProperties::default()).await?;
        let channel = conn.create_channel().await?;
        for q in [queue.to_owned(), format!("{queue}.dlq")] {
            let durable = lapin::options::QueueDeclareOptions::durable();
            channel
                .queue_declare(q.as_str().into(), durable, lapin::types::FieldTable::default())
                .await?;
        }
        Ok(Self { channel, _conn: conn })
    }

    /// The message ids in the dead-letter queue (read over AMQP 1.0, as a consumer would).
    async fn dead_letters(&self, url: &str, queue: &str) -> Result<Vec<String>, Error> {
        let mut connection = Connection::open(format!("{queue}-dlq-reader"), url).await?;
        let mut session = Session::begin(&mut connection).await?;
        let mut rx =
            Receiver::attach(&mut session, "dlq-reader", format!("/amq/queue/{queue}.dlq")).await?;
        let mut ids = Vec::new();
        while let Ok(Ok(d)) =
            tokio::time::timeout(Duration::from_millis(500), rx.recv::<Body<Value>>()).await
        {
            rx.accept(&d).await?;
            let reason = d
                .message()
                .application_properties
                .as_ref()
                .and_then(|a| a.0.get("idem-reason").cloned());
            if let Some(MessageId::String(id)) =
                d.message().properties.as_ref().and_then(|p| p.message_id.clone())
            {
                println!("dead letter {id}: {reason:?}");
                ids.push(id);
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), connection.close()).await;
        Ok(ids)
    }

    async fn delete(&self, queue: &str) -> Result<(), Error> {
        for q in [queue.to_owned(), format!("{queue}.dlq")] {
            self.channel
                .queue_delete(q.as_str().into(), lapin::options::QueueDeleteOptions::default())
                .await?;
        }
        Ok(())
    }
}

/// The Cosmos DB SDK's in-memory emulator (its authors' own: 409 on create, atomic
/// transactional batches, `If-Match`), standing in for an account.
mod emulator {
    use std::sync::Arc;

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

    use super::Error;

    const GATEWAY: &str = "https://eastus.emulator.local";

    pub(super) struct Emulator {
        client: CosmosClient,
        store: Arc<EmulatorStore>,
    }

    impl Emulator {
        pub(super) async fn start() -> Result<Self, Error> {
            idem::cosmos::install_crypto_provider();
            let config = VirtualAccountConfig::new(vec![VirtualRegion::new(
                "East US",
                azure_core::http::Url::parse(GATEWAY)?,
            )])?
            .with_consistency(ConsistencyLevel::Session);
            let emulator = Arc::new(InMemoryEmulatorHttpClient::new(config));
            let store = emulator.store();
            let account = AccountReference::with_authentication_key(
                GATEWAY.parse::<AccountEndpoint>()?,
                azure_core::credentials::Secret::new("dGVzdGtleQ=="),
            );
            let runtime = CosmosRuntimeBuilder::from(emulator.runtime_builder()).build().await?;
            let client = CosmosClientBuilder::new()
                .with_runtime(runtime)
                .build(account, RoutingStrategy::ProximityTo(Region::EAST_US))
                .await?;
            Ok(Self { client, store })
        }

        /// Database `idem`, container `orders` partitioned by `/orderId`.
        pub(super) async fn orders(&self) -> Result<ContainerClient, Error> {
            self.store.create_database("idem");
            let pk = serde_json::from_value(
                serde_json::json!({"paths": ["/orderId"], "kind": "Hash", "version": 2}),
            )?;
            self.store.create_container("idem", "orders", pk);
            Ok(self.client.database_client("idem").container_client("orders", None).await?)
        }
    }
}
