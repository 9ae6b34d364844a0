//! [`Amqp10Source`]: the consumer's verbs on an AMQP 1.0 receiving link.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use fe2o3_amqp::connection::ConnectionHandle;
use fe2o3_amqp::link::delivery::DeliveryInfo;
use fe2o3_amqp::link::{Receiver, Sender};
use fe2o3_amqp::session::SessionHandle;
use fe2o3_amqp::types::definitions::{
    self, ErrorCondition, Fields, ReceiverSettleMode, SenderSettleMode,
};
use fe2o3_amqp::types::messaging::{Body, Message, Modified, Outcome};

use crate::link::{Disposition, Gone, Link};
use fe2o3_amqp::link::receiver::CreditMode;
use fe2o3_amqp::types::primitives::{Symbol, Value};
use idem_core::consumer::{DeadLetter, Opening, Source, headers};
use idem_core::engine::Verb;
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::config::{Amqp10Config, DeadLetters};
use crate::connect::{self, Endpoint};
use crate::delivery::Delivery;
use crate::error::{Error, bounded};
use crate::servicebus::{self, Management, ServiceBusSettings};

/// Which broker's verbs the source speaks beyond AMQP 1.0's own.
#[derive(Debug, Clone)]
pub(crate) enum Dialect {
    /// Only the core outcomes: accepted, rejected, released (RabbitMQ offers no `modified`).
    Generic,
    /// Service Bus: abandon is `modified`, dead-letter is `rejected` with
    /// `com.microsoft:dead-letter`, locks are renewed through `$management`.
    ServiceBus(ServiceBusSettings),
}

/// An AMQP 1.0 receiving link as a consumer [`Source`]: deliveries arrive unsettled (locked on
/// Service Bus, unacknowledged on RabbitMQ) and are settled once the consumer has decided.
/// Built by [`Amqp10Config`] or [`ServiceBusConfig`](crate::ServiceBusConfig).
pub struct Amqp10Source {
    address: String,
    dead_letters: DeadLetters,
    dialect: Dialect,
    retry_delay: (Duration, Duration),
    batch_wait: Duration,
    verb_timeout: Duration,
    link: Link,
    /// The dead-letter address and its sender, in [`DeadLetters::Address`] mode.
    dlq: Option<(String, Mutex<Sender>)>,
    management: Option<Arc<Mutex<Management>>>,
    /// Retries held until due (AMQP 1.0 cannot delay a redelivery).
    held: std::sync::Mutex<Vec<(Instant, DeliveryInfo)>>,
    /// Dead letters the broker moves itself, by delivery id, until their `rejected` is sent.
    rejects: std::sync::Mutex<HashMap<u32, DeadLetter>>,
    /// The assigned session id, for a session consumer.
    session_id: Option<String>,
    /// Background tasks that end with the source: token renewal, session-lock renewal.
    tasks: Vec<tokio::task::JoinHandle<()>>,
    session: Mutex<Option<SessionHandle<()>>>,
    connection: Mutex<Option<ConnectionHandle<()>>>,
}

impl std::fmt::Debug for Amqp10Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Amqp10Source")
            .field("address", &self.address)
            .field("dead_letters", &self.dead_letters)
            .field("session_id", &self.session_id)
            .finish_non_exhaustive()
    }
}

/// A container id from the scope: the broker shows it in its connection list.
fn container_id(scope: &str) -> String {
    let clean: String = scope
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || "-_.".contains(*c))
        .take(64)
        .collect();
    format!("idem-{clean}-{}", uuid_v4())
}

/// A random id (uuid v4 from `rand`, without enabling uuid's own RNG feature).
fn uuid_v4() -> String {
    uuid::Builder::from_random_bytes(rand::random()).into_uuid().simple().to_string()
}

impl Amqp10Source {
    pub(crate) async fn open(config: Amqp10Config, opening: Opening<'_>) -> Result<Self, Error> {
        let bound = config.verb_timeout;
        let container = container_id(opening.scope);
        let mut opened = connect::open(&config.endpoint, &config.tls, &container, bound).await?;
        let refresher = match (&config.endpoint, &config.dialect) {
            (Endpoint::ServiceBus { namespace, credential, .. }, Dialect::ServiceBus(sb)) => {
                servicebus::authorize(
                    &mut opened.session,
                    namespace,
                    &sb.entity,
                    credential.clone(),
                    bound,
                )
                .await?
            }
            _ => None,
        };
        let credit = u32::try_from(opening.batch.saturating_mul(opening.concurrency))
            .unwrap_or(u32::MAX)
            .max(config.prefetch);
        let mut terminus =
            fe2o3_amqp::types::messaging::Source::builder().address(config.address.clone());
        if let Dialect::ServiceBus(ServiceBusSettings { session: Some(filter), .. }) =
            &config.dialect
        {
            // Service Bus reads the legacy (undescribed) filter value: the session id or null.
            terminus = terminus.add_to_filter_using_legacy_format(
                Symbol::from(servicebus::SESSION_FILTER),
                filter.value(),
            );
        }
        let attach = Receiver::builder()
            .name(format!("{container}-receiver"))
            .source(terminus.build())
            .target(
                fe2o3_amqp::types::messaging::Target::builder().address(container.clone()).build(),
            )
            .sender_settle_mode(SenderSettleMode::Unsettled)
            .receiver_settle_mode(ReceiverSettleMode::First)
            .credit_mode(CreditMode::Manual) // granted by the link task
            .auto_accept(false)
            .attach(&mut opened.session);
        let receiver = bounded("attach receiver", bound, async {
            attach
                .await
                .map_err(|source| Error::AttachReceiver { address: config.address.clone(), source })
        })
        .await?;
        let session_id = match &config.dialect {
            Dialect::ServiceBus(sb) if sb.session.is_some() => {
                servicebus::assigned_session(&receiver)
            }
            _ => None,
        };
        let dlq = match &config.dead_letters {
            DeadLetters::Address(address) => {
                let attach = Sender::attach(
                    &mut opened.session,
                    format!("{container}-dlq"),
                    address.clone(),
                );
                let sender = bounded("attach dead-letter sender", bound, async {
                    attach
                        .await
                        .map_err(|source| Error::AttachSender { address: address.clone(), source })
                })
                .await?;
                Some((address.clone(), Mutex::new(sender)))
            }
            DeadLetters::Reject => None,
        };
        let management = match &config.dialect {
            Dialect::ServiceBus(sb) => Some(Arc::new(Mutex::new(
                Management::attach(&mut opened.session, &sb.entity, &container, bound).await?,
            ))),
            Dialect::Generic => None,
        };
        let mut tasks: Vec<_> = refresher.into_iter().collect();
        if let (Dialect::ServiceBus(sb), Some(mgmt), Some(id)) =
            (&config.dialect, &management, &session_id)
        {
            // A session's lock must outlive idle spells too, not only running handlers.
            tasks.push(tokio::spawn(renew_session(
                Arc::clone(mgmt),
                id.clone(),
                sb.renew_every(),
                bound,
            )));
        }
        tracing::info!(address = %config.address, addr = %opened.addr, credit, session_id = ?session_id,
            "AMQP 1.0 receiver attached");
        Ok(Self {
            link: Link::spawn(receiver, credit),
            address: config.address,
            dead_letters: config.dead_letters,
            dialect: config.dialect,
            retry_delay: config.retry_delay,
            batch_wait: config.batch_wait,
            verb_timeout: bound,
            dlq,
            management,
            held: std::sync::Mutex::default(),
            rejects: std::sync::Mutex::default(),
            session_id,
            tasks,
            session: Mutex::new(Some(opened.session)),
            connection: Mutex::new(Some(opened.connection)),
        })
    }

    /// The session id this consumer holds (Service Bus session consumers only).
    pub fn session_id(&self) -> Option<&str> {
        self.session_id.as_deref()
    }

    /// The retries held until now (all of them with `all`), oldest first.
    fn take_held(&self, all: bool) -> Vec<DeliveryInfo> {
        let now = Instant::now();
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (due, keep): (Vec<_>, Vec<_>) = held.drain(..).partition(|(at, _)| all || *at <= now);
        *held = keep;
        due.into_iter().map(|(_, info)| info).collect()
    }

    fn next_held(&self) -> Option<Instant> {
        let held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        held.iter().map(|(at, _)| *at).min()
    }

    /// Gives retries back to the broker: abandon (counts a delivery) on Service Bus, release
    /// elsewhere.
    async fn retry_now(&self, infos: Vec<DeliveryInfo>) -> Result<(), Error> {
        let verb = match self.dialect {
            Dialect::ServiceBus(_) => Disposition::Modify(abandon()),
            Dialect::Generic => Disposition::Release,
        };
        self.dispose(infos, verb).await
    }

    async fn dispose(&self, infos: Vec<DeliveryInfo>, verb: Disposition) -> Result<(), Error> {
        let name = verb.name();
        match self.link.dispose(infos, verb).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(source)) => Err(Error::Disposition { verb: name, source }),
            Err(Gone) => Err(Error::LinkGone { address: self.address.clone() }),
        }
    }

    fn schedules(&self) -> bool {
        matches!(&self.dialect, Dialect::ServiceBus(sb) if sb.schedule_retries)
    }

    /// Schedules a copy of each message `delay` from now, through `$management`.
    async fn schedule(&self, items: &[(Delivery, Duration)]) -> Result<(), Error> {
        let Some(mgmt) = &self.management else {
            return Err(Error::Management {
                operation: "com.microsoft:schedule-message",
                reason: "no management link".into(),
            });
        };
        let mut messages = Vec::with_capacity(items.len());
        for (msg, delay) in items {
            let at = std::time::SystemTime::now() + *delay;
            let encoded = servicebus::scheduled_copy(msg, at)?;
            let id = idem_core::extract::Envelope::message_id(msg).unwrap_or_default().to_owned();
            messages.push((id, self.session_id.clone(), encoded));
        }
        bounded("schedule retries", self.verb_timeout, async {
            mgmt.lock().await.schedule(messages).await
        })
        .await
    }

    fn rejection(&self, msg: &Delivery, reason: &str) -> definitions::Error {
        let dl = self
            .rejects
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&msg.info().delivery_id());
        let description = headers::header_safe(reason);
        match &self.dialect {
            Dialect::ServiceBus(_) => servicebus::dead_letter_error(dl.as_ref(), &description),
            Dialect::Generic => {
                let mut info = Fields::default();
                for (k, v) in dl.iter().flat_map(DeadLetter::headers) {
                    info.insert(Symbol::from(k), Value::String(v));
                }
                definitions::Error {
                    condition: ErrorCondition::Custom(Symbol::from("idem:dead-letter")),
                    description: Some(description),
                    info: Some(Box::new(info)),
                }
            }
        }
    }

    fn copy(&self, msg: &Delivery, dl: &DeadLetter) -> Message<Body<Value>> {
        msg.copy_with(dl.headers().into_iter().chain([
            (headers::SOURCE, self.address.clone()),
            (headers::DELIVERED, (msg.delivery_count() + 1).to_string()),
        ]))
    }
}

/// Renews a session's lock for as long as the source lives.
async fn renew_session(mgmt: Arc<Mutex<Management>>, id: String, every: Duration, bound: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let renewed = async { mgmt.lock().await.renew_session_lock(&id).await };
        if let Err(e) = bounded("renew session lock", bound, renewed).await {
            tracing::warn!(error = %e, session = %id, "session lock renewal failed; the session may be lost");
        }
    }
}

/// Service Bus' abandon: `modified` with `delivery-failed` (the delivery count goes up).
fn abandon() -> Modified {
    Modified {
        delivery_failed: Some(true),
        undeliverable_here: Some(false),
        message_annotations: None,
    }
}

impl Source for Amqp10Source {
    type Delivery = Delivery;
    type Error = Error;

    /// # Cancel safety
    /// Cancel safe: fe2o3's `recv` is, and a delivery is owned by the batch once received.
    async fn fetch(&self, max: usize, wait: Duration) -> Result<Vec<Delivery>, Error> {
        self.retry_now(self.take_held(false)).await?;
        let wait = match self.next_held() {
            Some(at) => wait.min(at.saturating_duration_since(Instant::now())),
            None => wait,
        };
        match self.link.fetch(max, wait, self.batch_wait).await {
            Ok(batch) => Ok(batch),
            Err(Ok(source)) => Err(Error::Recv { address: self.address.clone(), source }),
            Err(Err(Gone)) => Err(Error::LinkGone { address: self.address.clone() }),
        }
    }

    fn is_fatal(&self, error: &Error) -> bool {
        error.is_fatal()
    }

    async fn keep_alive<'a>(&'a self, batch: &'a [Delivery]) {
        let (Dialect::ServiceBus(sb), Some(mgmt)) = (&self.dialect, &self.management) else {
            return std::future::pending().await;
        };
        let every = sb.renew_every();
        loop {
            tokio::time::sleep(every).await;
            if self.session_id.is_some() {
                continue; // renewed on its own task
            }
            let renewed = async {
                mgmt.lock()
                    .await
                    .renew_locks(batch.iter().map(servicebus::lock_token).collect())
                    .await
            };
            if let Err(e) = bounded("renew lock", self.verb_timeout, renewed).await {
                tracing::warn!(error = %e, "lock renewal failed; the broker may redeliver when the lock expires");
            }
        }
    }

    fn give_up(&self, msg: &Delivery) -> Option<String> {
        let Dialect::ServiceBus(sb) = &self.dialect else { return None };
        let delivery = msg.delivery_count().saturating_add(1);
        (delivery >= sb.max_delivery_count).then(|| {
            format!(
                "delivery {delivery} reached the queue's MaxDeliveryCount {}",
                sb.max_delivery_count
            )
        })
    }

    async fn dead_letter<'a>(
        &'a self,
        items: &'a [(&'a Delivery, DeadLetter)],
    ) -> Vec<Result<(), Error>> {
        let Some((address, dlq)) = &self.dlq else {
            // The broker dead-letters on `rejected`, in the same step as the removal.
            let mut rejects =
                self.rejects.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for (msg, dl) in items {
                rejects.insert(msg.info().delivery_id(), dl.clone());
            }
            return items.iter().map(|_| Ok(())).collect();
        };
        let mut sender = dlq.lock().await;
        let mut out = Vec::with_capacity(items.len());
        for (msg, dl) in items {
            let sent = match sender.send(self.copy(msg, dl)).await {
                Ok(Outcome::Accepted(_)) => Ok(()),
                Ok(other) => Err(Error::NotAccepted {
                    address: address.clone(),
                    outcome: format!("{other:?}"),
                }),
                Err(source) => Err(Error::Send { address: address.clone(), source }),
            };
            out.push(sent);
        }
        out
    }

    async fn settle(&self, items: Vec<(Delivery, Verb)>) -> Result<u64, Error> {
        let mut accept = Vec::new();
        let mut release = Vec::new();
        let mut retry = Vec::new();
        let mut scheduled = Vec::new();
        let now = Instant::now();
        for (msg, verb) in items {
            match verb {
                Verb::Ack => accept.push(msg.info().clone()),
                Verb::DeadLetter { reason } => {
                    if self.dlq.is_some() {
                        accept.push(msg.info().clone());
                    } else {
                        let error = self.rejection(&msg, &reason);
                        self.dispose(vec![msg.info().clone()], Disposition::Reject(error)).await?;
                    }
                }
                Verb::Retry { after: Some(after) } if !after.is_zero() && self.schedules() => {
                    scheduled.push((msg, after.clamp(self.retry_delay.0, self.retry_delay.1)));
                }
                Verb::Retry { after: Some(after) } if !after.is_zero() => {
                    let delay = after.clamp(self.retry_delay.0, self.retry_delay.1);
                    self.held
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((now + delay, msg.info().clone()));
                }
                Verb::Retry { .. } => retry.push(msg.info().clone()),
                _ => release.push(msg.info().clone()),
            }
        }
        if !scheduled.is_empty() {
            // Completed only once the broker has stored the scheduled copy; else abandoned.
            match self.schedule(&scheduled).await {
                Ok(()) => accept.extend(scheduled.iter().map(|(m, _)| m.info().clone())),
                Err(e) => {
                    tracing::warn!(error = %e, "scheduling the retry failed; abandoning instead");
                    retry.extend(scheduled.iter().map(|(m, _)| m.info().clone()));
                }
            }
        }
        self.dispose(accept, Disposition::Accept).await?;
        self.retry_now(retry).await?;
        self.dispose(release, Disposition::Release).await?;
        Ok(0)
    }

    /// Gives back held retries and what the link received but the consumer never fetched, then
    /// closes the links, the session and the connection, each bounded (a peer that never
    /// answers a close does not hold the shutdown).
    async fn close(&self) -> Result<u64, Error> {
        for task in &self.tasks {
            task.abort();
        }
        self.link.quiesce(self.verb_timeout).await;
        self.retry_now(self.take_held(true)).await?;
        let given_back = self.link.close(self.verb_timeout).await;
        if let Some(mut session) = self.session.lock().await.take() {
            let _ = tokio::time::timeout(self.verb_timeout, session.end()).await;
        }
        if let Some(mut connection) = self.connection.lock().await.take() {
            let _ = tokio::time::timeout(self.verb_timeout, connection.close()).await;
        }
        Ok(given_back)
    }
}
