//! Azure Event Hubs through its Kafka endpoint (feature `event-hubs`).
//!
//! An Event Hubs namespace answers the Kafka protocol on `<namespace>.servicebus.windows.net:9093`
//! (Standard tier and above), an event hub being a topic. [`EventHubsConfig`] turns a connection
//! string and a consumer group into the [`ClientConfig`] the adapter needs — SASL PLAIN over
//! TLS, user `$ConnectionString`, the connection string as the password — plus the client
//! settings Microsoft recommends for Event Hubs, and into a [`KafkaConfig`] ready for the
//! consumer.
//!
//! ```no_run
//! use std::time::Duration;
//! use idem_kafka::{EventHubsConfig, KafkaConsumer};
//! use idem_sqlx::PostgresStore;
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! const DAY: Duration = Duration::from_secs(86_400);
//! let connection = std::env::var("EVENTHUBS_CONNECTION")?; // Endpoint=sb://…;SharedAccessKey…
//! let hubs = EventHubsConfig::new(&connection, "order-writer")?.redelivery_window(DAY); // kept 1 day
//! let store = PostgresStore::connect("postgres://postgres@127.0.0.1:5432/test").await?;
//! store.migrate().await?; // once: creates the table (a consumer's build checks it)
//! let consumer = KafkaConsumer::builder(hubs.kafka(&["orders"], "orders-dlq"))
//!     .inbox(store.inbox(DAY * 2)) // must cover the hub's retention, or opening fails
//!     .scope("order-writer")
//!     .build()
//!     .await?;
//! # let _ = consumer; Ok(()) }
//! ```
//!
//! # Retention
//! A consumer group that starts again from an old offset replays every event the hub still
//! holds, so the dedup records must be kept at least as long as the hub keeps events (1 to 7
//! days on Standard, up to 90 on Premium and Dedicated). The adapter's usual check asks the
//! brokers for each topic's `retention.ms` with `DescribeConfigs`, which the Event Hubs
//! endpoint long did not answer. So the hub's retention is stated here
//! ([`EventHubsConfig::redelivery_window`]) and checked when the consumer opens: opening fails with
//! [`Error::Retention`](crate::Error::Retention), showing the arithmetic, when the
//! records are kept for less. Without a stated retention the brokers are asked as for any
//! Kafka cluster, and a shorter dedup retention, or an unanswered question, is only logged.
//!
//! # Consumer groups
//! The group is the Kafka `group.id`. Event Hubs creates Kafka consumer groups on first use and
//! keeps their committed offsets itself; they are not the consumer groups listed on the hub
//! in the portal, and need not be created there.

mod connection;

use std::fmt;
use std::time::Duration;

use rdkafka::config::ClientConfig;

use connection::ConnectionString;
pub use connection::Error;

use crate::KafkaConfig;

/// The Kafka endpoint's port, the same in every Azure cloud.
const PORT: u16 = 9093;

/// A Kafka consumer group on an Event Hubs namespace: the connection string, the group, and
/// optionally how long the hubs keep events. See the [module docs](self).
///
/// `Debug` never shows the shared access key.
///
/// ```
/// use idem_kafka::EventHubsConfig;
///
/// let hubs = EventHubsConfig::new(
///     "Endpoint=sb://idem.servicebus.windows.net/;SharedAccessKeyName=listen;\
///      SharedAccessKey=c2VjcmV0;EntityPath=orders",
///     "order-writer",
/// )?;
/// let config = hubs.client_config();
/// assert_eq!(config.get("bootstrap.servers"), Some("idem.servicebus.windows.net:9093"));
/// assert_eq!(config.get("group.id"), Some("order-writer"));
/// assert_eq!(hubs.topic(), Some("orders"));
/// assert!(!format!("{hubs:?}").contains("c2VjcmV0"));
/// # Ok::<(), idem_kafka::event_hubs::Error>(())
/// ```
#[derive(Clone)]
#[must_use]
pub struct EventHubsConfig {
    connection: ConnectionString,
    group: String,
    redelivery_window: Option<Duration>,
}

impl EventHubsConfig {
    /// A member of consumer group `group` on the namespace of `connection_string`
    /// (`Endpoint=sb://<ns>.servicebus.windows.net/;SharedAccessKeyName=<policy>;`
    /// `SharedAccessKey=<key>[;EntityPath=<event hub>]`, as the portal shows it; the policy
    /// needs the Listen right, and Send too for the dead-letter hub).
    ///
    /// # Errors
    /// [`Error`] naming the field that is missing or invalid: no `Endpoint`, an endpoint that is
    /// not `sb://<host>/`, no `SharedAccessKeyName` or `SharedAccessKey`, a field given twice, a
    /// part that is not `Name=value`. An empty `group` is reported as a missing `group.id` when
    /// the consumer opens, like any Kafka configuration.
    pub fn new(connection_string: &str, group: impl Into<String>) -> Result<Self, Error> {
        Ok(Self {
            connection: ConnectionString::parse(connection_string)?,
            group: group.into(),
            redelivery_window: None,
        })
    }

    /// The consumed event hubs' redelivery window: how long they keep events (their message
    /// retention). The consumer then refuses to open when its dedup records are kept for less.
    pub fn redelivery_window(mut self, retention: Duration) -> Self {
        self.redelivery_window = Some(retention);
        self
    }

    /// The event hub the connection string is scoped to (its `EntityPath`): the Kafka topic.
    /// A string scoped to one hub reaches only that hub, so the dead-letter hub needs a
    /// namespace-level policy.
    pub fn topic(&self) -> Option<&str> {
        self.connection.entity_path()
    }

    /// The namespace's Kafka bootstrap address, `<ns>.servicebus.windows.net:9093`.
    pub fn bootstrap_servers(&self) -> String {
        format!("{}:{PORT}", self.connection.host())
    }

    /// The client settings: connection, credentials, group, and the settings Microsoft
    /// recommends for Kafka clients of Event Hubs. Add or override others on the result (the
    /// adapter sets the offset-commit settings itself).
    pub fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", self.bootstrap_servers())
            .set("security.protocol", "SASL_SSL")
            .set("sasl.mechanism", "PLAIN")
            // Event Hubs takes the literal user `$ConnectionString` and the whole connection
            // string as the password.
            .set("sasl.username", "$ConnectionString")
            .set("sasl.password", self.connection.as_secret())
            .set("group.id", &self.group);
        for (key, value) in RECOMMENDED {
            c.set(*key, *value);
        }
        c
    }

    /// A [`KafkaConfig`] consuming `topics` (event hubs) and dead-lettering to `dead_letter_topic`
    /// (another event hub of the namespace: Event Hubs creates no topic on first use), with
    /// [`client_config`](Self::client_config) and the stated retention, if any.
    pub fn kafka(&self, topics: &[&str], dead_letter_topic: impl Into<String>) -> KafkaConfig {
        let kafka = KafkaConfig::new(&self.client_config(), topics, dead_letter_topic);
        match self.redelivery_window {
            Some(d) => kafka.redelivery_window(d),
            None => kafka,
        }
    }
}

/// Microsoft's recommended client settings for Event Hubs' Kafka endpoint ("Recommended
/// configurations for Apache Kafka clients", Azure Event Hubs docs), in librdkafka's names.
const RECOMMENDED: &[(&str, &str)] = &[
    // Azure closes inbound TCP connections idle for more than 240 s; without keepalives and
    // an earlier close on our side, a request can go out on a connection that is already dead
    // and wait for its timeout.
    ("socket.keepalive.enable", "true"),
    ("connections.max.idle.ms", "180000"),
    // Refresh metadata before the service's 240 s idle limit (recommended ~180 s, < 240 s).
    ("metadata.max.age.ms", "180000"),
    // Recommended at least 30 s: shorter sessions time out under the service's latency,
    // which causes rebalances, which cause more timeouts.
    ("session.timeout.ms", "30000"),
    ("heartbeat.interval.ms", "3000"),
    // The service answers requests within 20 s at least; Microsoft recommends a 60 s request
    // timeout. librdkafka's consumer calls that `socket.timeout.ms` (`request.timeout.ms` is a
    // producer-only property there), so it is set explicitly even though 60 s is its default.
    ("socket.timeout.ms", "60000"),
];

impl fmt::Debug for EventHubsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventHubsConfig")
            .field("connection", &self.connection)
            .field("group", &self.group)
            .field("redelivery_window", &self.redelivery_window)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use rdkafka::consumer::{BaseConsumer, Consumer as _};

    use super::*;

    const KEY: &str = "c2VjcmV0LWtleS1kby1ub3Qtc2hvdw==";

    fn connection(host: &str) -> String {
        format!(
            "Endpoint=sb://{host}/;SharedAccessKeyName=listen;SharedAccessKey={KEY};EntityPath=orders"
        )
    }

    #[test]
    fn the_config_has_the_endpoint_credentials_group_and_recommended_settings() {
        let s = connection("idem-ns.servicebus.windows.net");
        let c = EventHubsConfig::new(&s, "order-writer").unwrap().client_config();
        for (key, value) in [
            ("bootstrap.servers", "idem-ns.servicebus.windows.net:9093"),
            ("security.protocol", "SASL_SSL"),
            ("sasl.mechanism", "PLAIN"),
            ("sasl.username", "$ConnectionString"),
            ("sasl.password", s.as_str()),
            ("group.id", "order-writer"),
            ("socket.keepalive.enable", "true"),
            ("connections.max.idle.ms", "180000"),
            ("metadata.max.age.ms", "180000"),
            ("session.timeout.ms", "30000"),
            ("heartbeat.interval.ms", "3000"),
            ("socket.timeout.ms", "60000"),
        ] {
            assert_eq!(c.get(key), Some(value), "{key}");
        }
    }

    #[test]
    fn debug_of_the_builder_and_of_its_config_hides_the_key() {
        let hubs = EventHubsConfig::new(&connection("ns.servicebus.windows.net"), "g").unwrap();
        let d = format!("{hubs:?} {:?}", hubs.kafka(&["orders"], "dlq"));
        assert!(!d.contains(KEY), "{d}");
        assert!(d.contains("ns.servicebus.windows.net") && d.contains("listen"), "{d}");
    }

    /// librdkafka checks its configuration when a client is created, without the network:
    /// a build without OpenSSL fails here ("OpenSSL not available at build time"), and so
    /// would a property it does not know or a value it rejects.
    #[test]
    fn librdkafka_is_built_with_ssl_and_accepts_the_config_for_a_consumer() {
        let native = ClientConfig::new().create_native_config().unwrap();
        let features = native.get("builtin.features").unwrap();
        assert!(features.split(',').any(|f| f == "ssl"), "{features}");
        assert!(features.split(',').any(|f| f == "sasl_plain"), "{features}");
        // `.invalid` never resolves: the client's background connection attempts go nowhere.
        let hubs = EventHubsConfig::new(&connection("idem-test.invalid"), "g").unwrap();
        let consumer: BaseConsumer = hubs.client_config().create().unwrap();
        assert_eq!(consumer.subscription().unwrap().count(), 0);
    }
}
