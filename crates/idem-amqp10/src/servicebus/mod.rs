//! Azure Service Bus over AMQP 1.0: the namespace, its credentials, and a queue or
//! subscription as a [`ServiceBusConfig`].
//!
//! | idem outcome | Service Bus (PeekLock) |
//! | --- | --- |
//! | processed, duplicate | complete (`accepted`) |
//! | in progress elsewhere | held for the other lease's remaining time (clamped to [`ServiceBusConfig::retry_delay`]), then abandon; with [`ServiceBusConfig::schedule_retries`], a scheduled copy (confirmed), then complete |
//! | transient failure | abandon (`modified`, `delivery-failed`: the delivery count goes up) |
//! | conflict, permanent failure, missing key | dead-letter (`rejected` with `com.microsoft:dead-letter`, `DeadLetterReason` = the idem outcome, `DeadLetterErrorDescription` = the reason) |
//! | the next abandon would reach `MaxDeliveryCount` | dead-letter with the last outcome, so the reason is idem's, not `MaxDeliveryCountExceeded` |
//! | fetched while the consumer shuts down | `released` (the delivery count does not go up) |

mod auth;
mod management;

use std::time::Duration;

use fe2o3_amqp::link::Receiver;
use fe2o3_amqp::types::definitions::{self, ErrorCondition, Fields};
use fe2o3_amqp::types::primitives::{Symbol, Value};
use idem_core::RedeliveryWindow;
use idem_core::consumer::{DeadLetter, Opening, SourceConfig};

pub use auth::{AccessToken, BoxError, TokenKind, TokenSource};
pub(crate) use auth::{Credential, authorize};
pub(crate) use management::Management;

use crate::config::{Amqp10Config, DeadLetters};
use crate::connect::Endpoint;
use crate::delivery::Delivery;
use crate::error::Error;
use crate::source::{Amqp10Source, Dialect};
use crate::tls::Tls;

/// The source filter that asks for a session.
pub(crate) const SESSION_FILTER: &str = "com.microsoft:session-filter";
const DEAD_LETTER: &str = "com.microsoft:dead-letter";

/// A Service Bus namespace and how to authorise against it.
///
/// ```
/// use idem_amqp10::ServiceBus;
///
/// let sb = ServiceBus::from_connection_string(
///     "Endpoint=sb://shop.servicebus.windows.net/;SharedAccessKeyName=listen;SharedAccessKey=c2VjcmV0",
/// )?;
/// let orders = sb.queue("orders").max_delivery_count(10).lock_duration(std::time::Duration::from_secs(60));
/// # Ok::<(), idem_amqp10::Error>(())
/// ```
#[derive(Clone)]
pub struct ServiceBus {
    /// The namespace's name (`shop.servicebus.windows.net`): the token audience, the AMQP
    /// hostname and the TLS server name.
    namespace: String,
    /// Where to connect (the namespace unless [`endpoint`](Self::endpoint) says otherwise).
    host: String,
    port: u16,
    tls: bool,
    credential: Credential,
    entity_path: Option<String>,
    tls_settings: Tls,
}

impl std::fmt::Debug for ServiceBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceBus")
            .field("namespace", &self.namespace)
            .field("host", &self.host)
            .field("credential", &self.credential)
            .finish()
    }
}

impl ServiceBus {
    /// From a connection string as the portal shows it: `Endpoint=sb://<namespace>/;`
    /// `SharedAccessKeyName=…;SharedAccessKey=…` (or `SharedAccessSignature=…`), and
    /// optionally `EntityPath=<queue>`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field that is missing or malformed.
    pub fn from_connection_string(connection: &str) -> Result<Self, Error> {
        let parsed = auth::parse_connection_string(connection)?;
        Ok(Self {
            namespace: parsed.host.clone(),
            host: parsed.host,
            port: 5671,
            tls: true,
            credential: parsed.credential,
            entity_path: parsed.entity_path,
            tls_settings: Tls::default(),
        })
    }

    /// A namespace (`shop.servicebus.windows.net`) with tokens from `source`: Entra ID
    /// (JWT for the audience `https://servicebus.azure.net/.default`) or SAS tokens made
    /// elsewhere. Tokens are put on the `$cbs` node before attaching and again before they
    /// expire.
    pub fn with_token_source(namespace: impl Into<String>, source: impl TokenSource) -> Self {
        let namespace = namespace.into();
        Self {
            host: namespace.clone(),
            namespace,
            port: 5671,
            tls: true,
            credential: Credential::Source(std::sync::Arc::new(source)),
            entity_path: None,
            tls_settings: Tls::default(),
        }
    }

    /// Connects to `host:port` instead, with or without TLS: a private endpoint or a proxy (or
    /// a local peer in tests). Tokens, the AMQP hostname and the TLS server name stay the
    /// namespace's.
    #[must_use]
    pub fn endpoint(mut self, host: impl Into<String>, port: u16, tls: bool) -> Self {
        self.host = host.into();
        self.port = port;
        self.tls = tls;
        self
    }

    /// How TLS verifies the namespace and which client certificate it presents (default: the
    /// OS trust store, which holds the roots Azure's certificates chain to).
    #[must_use]
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls_settings = tls;
        self
    }

    /// A consumer of `queue`.
    pub fn queue(&self, queue: &str) -> ServiceBusConfig {
        ServiceBusConfig::new(self, queue.to_owned())
    }

    /// The queue named by the connection string's `EntityPath`.
    ///
    /// # Errors
    /// [`Error::Config`] when the connection string had no `EntityPath`.
    pub fn entity(&self) -> Result<ServiceBusConfig, Error> {
        let path = self
            .entity_path
            .clone()
            .ok_or_else(|| Error::config("EntityPath", "the connection string names no entity"))?;
        Ok(ServiceBusConfig::new(self, path))
    }

    /// A consumer of `subscription` on `topic`.
    pub fn subscription(&self, topic: &str, subscription: &str) -> ServiceBusConfig {
        ServiceBusConfig::new(self, format!("{topic}/Subscriptions/{subscription}"))
    }
}

/// Which session a session consumer takes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SessionFilter {
    /// The next session with messages and no owner.
    Next,
    /// This session.
    Id(String),
}

impl SessionFilter {
    pub(crate) fn value(&self) -> Value {
        match self {
            Self::Next => Value::Null,
            Self::Id(id) => Value::String(id.clone()),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ServiceBusSettings {
    pub(crate) entity: String,
    pub(crate) lock_duration: Duration,
    pub(crate) max_delivery_count: u32,
    pub(crate) session: Option<SessionFilter>,
    pub(crate) heartbeat: Option<Duration>,
    pub(crate) schedule_retries: bool,
}

impl ServiceBusSettings {
    /// A message can come back until its deliveries reach `MaxDeliveryCount`, each ending at
    /// the latest when its lock expires.
    pub(crate) fn window(&self) -> RedeliveryWindow {
        RedeliveryWindow::new(self.max_delivery_count, self.lock_duration)
    }

    /// Locks are renewed on the engine's heartbeat, and at least twice per lock duration.
    pub(crate) fn renew_every(&self) -> Duration {
        let half = (self.lock_duration / 2).max(Duration::from_millis(500));
        self.heartbeat.map_or(half, |h| h.min(half))
    }
}

/// A Service Bus queue or subscription as a consumer source: PeekLock, complete / abandon /
/// dead-letter, locks renewed while handlers run, sessions. Made by [`ServiceBus::queue`].
///
/// Service Bus does not tell an AMQP client the entity's `LockDuration` and
/// `MaxDeliveryCount`: state them here as they are set on the entity (defaults: 60 s and
/// 10, Azure's defaults). They bound the redelivery window the dedup retention must cover
/// (`LockDuration × MaxDeliveryCount`, checked when the consumer is built), set how often
/// locks are renewed, and when a failing message is dead-lettered by idem with its reason.
#[derive(Debug, Clone)]
#[must_use]
pub struct ServiceBusConfig {
    base: Amqp10Config,
    settings: ServiceBusSettings,
}

impl ServiceBusConfig {
    fn new(sb: &ServiceBus, entity: String) -> Self {
        let mut base =
            Amqp10Config::new(String::new(), entity.clone()).dead_letters(DeadLetters::Reject);
        base.endpoint = Endpoint::ServiceBus {
            namespace: sb.namespace.clone(),
            host: sb.host.clone(),
            port: sb.port,
            tls: sb.tls,
            credential: sb.credential.clone(),
        };
        base.tls = sb.tls_settings.clone();
        let settings = ServiceBusSettings {
            entity,
            lock_duration: Duration::from_secs(60),
            max_delivery_count: 10,
            session: None,
            heartbeat: None,
            schedule_retries: false,
        };
        Self { base, settings }
    }

    /// The connection settings and the entity path, for [`Amqp10DeadLetters`](crate::Amqp10DeadLetters).
    pub(crate) fn base(&self) -> &Amqp10Config {
        &self.base
    }

    /// The entity's `LockDuration` (default 60 s).
    pub fn lock_duration(mut self, lock: Duration) -> Self {
        self.settings.lock_duration = lock;
        self
    }

    /// The entity's `MaxDeliveryCount` (default 10).
    pub fn max_delivery_count(mut self, count: u32) -> Self {
        self.settings.max_delivery_count = count;
        self
    }

    /// A message found in progress elsewhere is scheduled again (`com.microsoft:schedule-message`,
    /// enqueued after the other lease's remaining time, clamped to
    /// [`retry_delay`](Self::retry_delay)) and completed once the broker has stored the copy,
    /// instead of being held locked and abandoned. Frees the lock and the prefetch slot at once
    /// and counts no delivery; the copy is a new message (new sequence number, its delivery
    /// count back to zero, `idem-delays` counting the reschedules). Needs **Send** rights on the
    /// entity; if scheduling fails, the message is abandoned instead. Off by default.
    pub fn schedule_retries(mut self, on: bool) -> Self {
        self.settings.schedule_retries = on;
        self
    }

    /// Receive from a session-enabled entity: one session at a time, in order.
    pub fn session(mut self, filter: SessionFilter) -> Self {
        self.settings.session = Some(filter);
        self
    }

    /// The link credit (Service Bus prefetch; default 128). Prefetched messages are locked
    /// too: keep it near `batch × concurrency` so locks do not expire unseen.
    pub fn prefetch(mut self, prefetch: u32) -> Self {
        self.base = self.base.prefetch(prefetch);
        self
    }

    /// See [`Amqp10Config::batch_wait`].
    pub fn batch_wait(mut self, wait: Duration) -> Self {
        self.base = self.base.batch_wait(wait);
        self
    }

    /// See [`Amqp10Config::retry_delay`].
    pub fn retry_delay(mut self, min: Duration, max: Duration) -> Self {
        self.base = self.base.retry_delay(min, max);
        self
    }

    /// See [`Amqp10Config::verb_timeout`].
    pub fn verb_timeout(mut self, timeout: Duration) -> Self {
        self.base = self.base.verb_timeout(timeout);
        self
    }
}

impl SourceConfig for ServiceBusConfig {
    type Source = Amqp10Source;

    async fn open(self, opening: Opening<'_>) -> Result<Amqp10Source, Error> {
        let Self { mut base, mut settings } = self;
        if settings.max_delivery_count == 0 {
            return Err(Error::config("max_delivery_count", "must be at least 1"));
        }
        if settings.lock_duration < Duration::from_secs(1) {
            return Err(Error::config("lock_duration", "must be at least 1 s"));
        }
        settings.heartbeat = opening.heartbeat;
        base.dialect = Dialect::ServiceBus(settings);
        base.check(&opening)?;
        Amqp10Source::open(base, opening).await
    }
}

/// The `rejected` error that moves a message to the dead-letter sub-queue.
pub(crate) fn dead_letter_error(dl: Option<&DeadLetter>, description: &str) -> definitions::Error {
    let mut info = Fields::default();
    let reason = dl.map_or("failed", |d| d.outcome.as_str());
    info.insert(Symbol::from("DeadLetterReason"), Value::String(reason.to_owned()));
    // Service Bus keeps at most 4096 characters of each.
    let description: String = description.chars().take(4096).collect();
    info.insert(Symbol::from("DeadLetterErrorDescription"), Value::String(description.clone()));
    definitions::Error {
        condition: ErrorCondition::Custom(Symbol::from(DEAD_LETTER)),
        description: Some(description),
        info: Some(Box::new(info)),
    }
}

/// The lock token: the `x-opt-lock-token` annotation, else the delivery tag read as a .NET
/// GUID (little-endian fields), as Service Bus sends it.
pub(crate) fn lock_token(msg: &Delivery) -> uuid::Uuid {
    let annotated = msg.message().message_annotations.as_ref().and_then(|a| {
        a.0.iter().find_map(|(k, v)| match (k, v) {
            (fe2o3_amqp::types::messaging::annotations::OwnedKey::Symbol(s), Value::Uuid(u))
                if s.0 == "x-opt-lock-token" =>
            {
                Some(uuid::Uuid::from_bytes(*u.as_inner()))
            }
            _ => None,
        })
    });
    annotated.unwrap_or_else(|| {
        let tag = msg.delivery_tag();
        let mut bytes = [0u8; 16];
        let n = tag.len().min(16);
        bytes[..n].copy_from_slice(&tag[..n]);
        uuid::Uuid::from_bytes_le(bytes)
    })
}

/// The AMQP encoding of a copy of `msg` to be enqueued at `at`: the bare message with
/// `x-opt-scheduled-enqueue-time` set and `idem-delays` counted up (the broker's own
/// annotations — lock token, sequence number — are not copied).
pub(crate) fn scheduled_copy(msg: &Delivery, at: std::time::SystemTime) -> Result<Vec<u8>, Error> {
    use fe2o3_amqp::types::messaging::MessageAnnotations;
    use fe2o3_amqp::types::messaging::message::__private::Serializable;
    use fe2o3_amqp::types::primitives::Timestamp;

    let millis = at
        .duration_since(std::time::UNIX_EPOCH)
        .ok()
        .and_then(|d| i64::try_from(d.as_millis()).ok())
        .ok_or_else(|| Error::config("retry_delay", "schedules past the representable time"))?;
    let mut annotations = MessageAnnotations::default();
    annotations.0.insert(
        fe2o3_amqp::types::messaging::annotations::OwnedKey::Symbol(Symbol::from(
            "x-opt-scheduled-enqueue-time",
        )),
        Value::Timestamp(Timestamp::from_milliseconds(millis)),
    );
    let mut copy =
        msg.copy_with([(crate::delivery::DELAYS, msg.delays().saturating_add(1).to_string())]);
    copy.message_annotations = Some(annotations);
    if let Some(h) = copy.header.as_mut() {
        h.delivery_count = 0;
    }
    // fe2o3 encodes messages through this wrapper (doc-hidden, stable within 0.18).
    serde_amqp::to_vec(&Serializable(copy)).map_err(|e| Error::Management {
        operation: "com.microsoft:schedule-message",
        reason: format!("encoding: {e}"),
    })
}

/// The session id the broker assigned, from the attach reply's source filter.
pub(crate) fn assigned_session(receiver: &Receiver) -> Option<String> {
    let source = receiver.source().as_ref()?;
    match source.filter.as_ref()?.get(&Symbol::from(SESSION_FILTER))? {
        Value::String(s) => Some(s.clone()),
        Value::Described(d) => match &d.value {
            Value::String(s) => Some(s.clone()),
            _ => None,
        },
        _ => None,
    }
}
