#![doc = include_str!("../README.md")]

pub use idem_core::*;
/// Dead letters read back and replayed by the rules: the [`idem_dlq`] crate.
pub use idem_dlq as dlq;

/// The embedded store and transactional inbox on SQLite (feature `sqlite`, on by default).
#[cfg(feature = "sqlite")]
pub mod sqlite {
    pub use idem_sqlx::sqlite::*;
}

#[cfg(feature = "sqlite")]
pub use idem_sqlx::{SqliteInbox, SqliteOutbox, SqliteStore};

/// The SQL client the stores and inboxes are built on, re-exported so handlers use the same
/// version for their own writes (`sqlx::query(…).execute(&mut *tx)`).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub use idem_sqlx::sqlx;

/// Where outboxes enqueue ([`Enqueue`]: an inbox handler's [`Tx`], a transaction or a
/// connection).
#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
pub use idem_sqlx::Enqueue;

/// PostgreSQL store, transactional inbox and entity-as-marker helper (feature `postgres`).
#[cfg(feature = "postgres")]
pub mod postgres {
    pub use idem_sqlx::postgres::*;
}

#[cfg(feature = "postgres")]
pub use idem_sqlx::{PostgresInbox, PostgresOutbox, PostgresStore};

/// MySQL / MariaDB store and transactional inbox (feature `mysql`).
#[cfg(feature = "mysql")]
pub mod mysql {
    pub use idem_sqlx::mysql::*;
}

#[cfg(feature = "mysql")]
pub use idem_sqlx::{MySqlInbox, MySqlOutbox, MySqlStore};

/// The HTTP `Idempotency-Key` layer (feature `http`; `axum` adds its axum glue).
#[cfg(feature = "http")]
pub mod http {
    pub use idem_http::*;
}

/// The RabbitMQ consumer adapter (feature `amqp`).
#[cfg(feature = "amqp")]
pub use idem_amqp as amqp;

/// The AMQP 1.0 and Azure Service Bus consumer adapter (feature `amqp10`).
#[cfg(feature = "amqp10")]
pub use idem_amqp10 as amqp10;

/// The Azure Cosmos DB store, entity-as-marker check and transactional-batch inbox (feature
/// `cosmos`).
#[cfg(feature = "cosmos")]
pub use idem_cosmos as cosmos;

/// The Kafka consumer adapter (feature `kafka`; `event-hubs` adds Azure Event Hubs' settings).
#[cfg(feature = "kafka")]
pub use idem_kafka as kafka;
/// The NATS JetStream consumer adapter (feature `nats`).
#[cfg(feature = "nats")]
pub use idem_nats as nats;

/// The Redis store and the Redis Streams consumer adapter (feature `redis`); `idem::redis::redis`
/// is the client crate they are built on.
#[cfg(feature = "redis")]
pub use idem_redis as redis;

#[cfg(feature = "prometheus")]
pub mod prometheus;
