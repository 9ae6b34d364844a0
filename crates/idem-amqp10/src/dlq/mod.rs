//! Dead letters read back from an AMQP 1.0 node or a Service Bus dead-letter sub-queue, for
//! `idem dlq` and the console: the [`DeadLetterQueue`] of [`idem_dlq`].

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use fe2o3_amqp::link::receiver::CreditMode;
use fe2o3_amqp::link::{Receiver, Sender};
use fe2o3_amqp::types::definitions::{ReceiverSettleMode, SenderSettleMode};
use fe2o3_amqp::types::messaging::{Accepted, Body, Outcome, Released};
use fe2o3_amqp::types::primitives::Value;
use idem_core::consumer::headers;
use idem_dlq::{DeadLetterQueue, DlqError, Letter, MAX_LETTERS, Republish};

use crate::config::{Amqp10Config, DeadLetters};
use crate::connect::{self, Endpoint, Opened};
use crate::delivery::{Delivery, id_text};
use crate::error::Error;
use crate::servicebus::{self, ServiceBusConfig};
use crate::tls::Tls;

/// What the trait's methods return (`futures::future::BoxFuture`).
type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The sub-queue where Service Bus keeps an entity's dead letters.
pub const SERVICE_BUS_DEAD_LETTER_QUEUE: &str = "$deadletterqueue";

/// Application properties Service Bus sets when it dead-letters a message: shown in a
/// [`Letter`], never sent again by a replay.
const SERVICE_BUS_PROPERTIES: [&str; 3] =
    ["DeadLetterReason", "DeadLetterErrorDescription", "DeadLetterSource"];

/// Deliveries granted at a time: the next grant goes out once these have arrived.
const CREDIT: u32 = 500;

/// The dead letters at an AMQP 1.0 address — a RabbitMQ queue such as `/amq/queue/orders.dlq`
/// ([`DeadLetters::Address`]) or a Service Bus entity's dead-letter sub-queue
/// (`orders/$deadletterqueue`) — read, replayed and removed by the rules of
/// [`Workbench`](idem_dlq::Workbench). Every call opens a connection of its own and
/// closes it before it returns.
///
/// - **read** receives up to `limit` messages unsettled, then settles them all `released`
///   (the delivery count does not grow), so they go back where they were; it stops at `limit`
///   or when nothing more arrives within [`read_wait`](Self::read_wait) (AMQP 1.0 does not say
///   how many messages a node holds). Meanwhile a consumer of that address, or a second reader,
///   does not get them.
/// - a letter's **id** is a digest of its message id, content type, application properties and
///   body (16 hex digits of SHA-256), the same from one read to the next; identical copies are
///   numbered `<digest>.2`, `<digest>.3` in arrival order.
/// - **remove** receives again from the head, settles the letters with those ids `accepted`
///   and releases the others.
/// - **republish** sends each message, durable, to its destination address and waits for the
///   broker's `accepted`; any other outcome fails the call with [`DlqError::NotPublished`].
///   RabbitMQ 3.x's AMQP 1.0 plugin accepts a message it routes to no queue (an
///   `/amq/queue/<name>` or `/exchange/…` target whose queue does not exist) and drops it, and
///   `/queue/<name>` declares the queue: the destination is the address the consumer read
///   from, which exists while its queue does. RabbitMQ 4 answers `released` instead, which
///   fails the replay.
///
/// Application properties read as text (numbers in decimal, binary in hex, timestamps in
/// milliseconds). A replay sends the message id, content type, the headers as string
/// application properties and the payload as one `data` section: other properties, the
/// annotations, and a body that is not `data` or a string or binary `amqp-value` are not sent
/// again.
///
/// # Service Bus
/// Service Bus moves a rejected message to `<entity>/$deadletterqueue` with the application
/// properties `DeadLetterReason` (the idem outcome) and `DeadLetterErrorDescription` (the
/// reason). Where a letter has no `idem-outcome` they stand in for `idem-outcome` and
/// `idem-reason`, and the entity, when it is a queue, for `idem-source`, so the letter is
/// replayed to its queue. A subscription's dead letters get no `idem-source` (a replay would go
/// to the topic and reach every subscription), so the workbench refuses to replay them.
///
/// ```no_run
/// use idem_amqp10::{Amqp10Config, Amqp10DeadLetters, DeadLetters};
/// use idem_dlq::Workbench;
///
/// # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let config = Amqp10Config::new("amqp://guest:guest@127.0.0.1:5672", "/amq/queue/orders")
///     .dead_letters(DeadLetters::Address("/amq/queue/orders.dlq".into()));
/// let bench = Workbench::new(Amqp10DeadLetters::for_source(&config)?);
/// for letter in bench.list(100).await? {
///     println!("{} {:?}", letter.id, letter.reason());
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Amqp10DeadLetters {
    endpoint: Endpoint,
    tls: Tls,
    address: String,
    verb_timeout: Duration,
    read_wait: Duration,
}

impl Amqp10DeadLetters {
    /// The dead letters at `address` on the broker at `url` (`amqp://user:pass@host:port` or
    /// `amqps://…`, as [`Amqp10Config::new`]).
    pub fn new(url: impl Into<String>, address: impl Into<String>) -> Self {
        Self {
            endpoint: Endpoint::Url(url.into()),
            tls: Tls::default(),
            address: address.into(),
            verb_timeout: Duration::from_secs(10),
            read_wait: Duration::from_millis(500),
        }
    }

    /// Where a consumer built from `config` puts its dead letters: the address of
    /// [`DeadLetters::Address`], on the same broker, with the same TLS settings and verb
    /// timeout.
    ///
    /// # Errors
    /// [`Error::Config`] for [`DeadLetters::Reject`]: the broker then moves them to a
    /// destination of its own (RabbitMQ: the queue's dead-letter exchange), which the source
    /// address does not name; give its address to [`new`](Self::new).
    pub fn for_source(config: &Amqp10Config) -> Result<Self, Error> {
        let address = match (&config.dead_letters, &config.endpoint) {
            (DeadLetters::Address(a), _) => a.clone(),
            (DeadLetters::Reject, Endpoint::ServiceBus { .. }) => {
                format!("{}/{SERVICE_BUS_DEAD_LETTER_QUEUE}", config.address)
            }
            (DeadLetters::Reject, Endpoint::Url(_)) => {
                return Err(Error::config(
                    "dead_letters",
                    "rejected messages go to the broker's own dead-letter destination (on \
                     RabbitMQ the queue's dead-letter exchange), which the source address does \
                     not name: give that queue's address to Amqp10DeadLetters::new",
                ));
            }
        };
        Ok(Self {
            endpoint: config.endpoint.clone(),
            tls: config.tls.clone(),
            address,
            verb_timeout: config.verb_timeout,
            read_wait: Duration::from_millis(500),
        })
    }

    /// The dead-letter sub-queue of a Service Bus queue or subscription,
    /// `<entity>/$deadletterqueue`, where [`ServiceBusConfig`]'s consumer dead-letters.
    pub fn for_service_bus(config: &ServiceBusConfig) -> Self {
        let base = config.base();
        Self {
            endpoint: base.endpoint.clone(),
            tls: base.tls.clone(),
            address: format!("{}/{SERVICE_BUS_DEAD_LETTER_QUEUE}", base.address),
            verb_timeout: base.verb_timeout,
            read_wait: Duration::from_millis(500),
        }
    }

    /// How `amqps://` verifies the broker (see [`Amqp10Config::tls`]).
    pub fn tls(mut self, tls: Tls) -> Self {
        self.tls = tls;
        self
    }

    /// The bound on each broker step: connect, attach, send, close (default 10 s).
    pub fn verb_timeout(mut self, timeout: Duration) -> Self {
        self.verb_timeout = timeout;
        self
    }

    /// How long a read or remove waits for the next message before it takes the node to be
    /// exhausted (default 500 ms; every read of a node with fewer than `limit` messages lasts
    /// at least this long).
    pub fn read_wait(mut self, wait: Duration) -> Self {
        self.read_wait = wait;
        self
    }

    /// The dead-letter address.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The Service Bus entity the address belongs to (`orders` for `orders/$deadletterqueue`).
    fn service_bus_entity(&self) -> Option<&str> {
        if !matches!(self.endpoint, Endpoint::ServiceBus { .. }) {
            return None;
        }
        let cut = self.address.len().checked_sub(SERVICE_BUS_DEAD_LETTER_QUEUE.len() + 1)?;
        let (entity, tail) = self.address.split_at_checked(cut)?;
        tail.eq_ignore_ascii_case(&format!("/{SERVICE_BUS_DEAD_LETTER_QUEUE}")).then_some(entity)
    }

    /// A connection, authorised on Service Bus for each of `entities`.
    async fn open(&self, entities: &[&str]) -> Result<Conn, DlqError> {
        let what = |e: Error| DlqError::broker(format!("connecting for `{}`", self.address), e);
        let container = format!("idem-dlq-{:016x}", rand::random::<u64>());
        let mut opened = connect::open(&self.endpoint, &self.tls, &container, self.verb_timeout)
            .await
            .map_err(what)?;
        let mut renewals = Vec::new();
        if let Endpoint::ServiceBus { namespace, credential, .. } = &self.endpoint {
            for entity in entities {
                let renew = servicebus::authorize(
                    &mut opened.session,
                    namespace,
                    entity,
                    credential.clone(),
                    self.verb_timeout,
                )
                .await
                .map_err(what)?;
                renewals.extend(renew);
            }
        }
        Ok(Conn { opened, renewals, container, bound: self.verb_timeout })
    }

    /// The entity to authorise for reading: the address's own (Service Bus only).
    fn read_entities(&self) -> Vec<&str> {
        self.service_bus_entity().into_iter().collect()
    }

    /// Receives from the head until `keep` says stop, `max` deliveries, or the node is quiet.
    async fn receive(
        &self,
        rx: &mut Receiver,
        max: usize,
        mut keep: impl FnMut(&Delivery) -> bool,
    ) -> Result<Vec<Delivery>, DlqError> {
        let failed = |e: &dyn std::fmt::Display| {
            DlqError::broker(format!("receiving from `{}`", self.address), e.to_string())
        };
        let mut out = Vec::new();
        let mut left = 0u32;
        while out.len() < max {
            if left == 0 {
                let want = u32::try_from(max - out.len()).unwrap_or(u32::MAX).min(CREDIT);
                rx.set_credit(want).await.map_err(|e| failed(&e))?;
                left = want;
            }
            let d = match tokio::time::timeout(self.read_wait, rx.recv::<Body<Value>>()).await {
                Err(_) => break,
                Ok(Err(e)) => return Err(failed(&e)),
                Ok(Ok(d)) => d,
            };
            left -= 1;
            let (info, message) = d.into_parts();
            let d = Delivery::new(info, message);
            let more = keep(&d);
            out.push(d);
            if !more {
                break;
            }
        }
        Ok(out)
    }

    async fn attach_receiver(&self, conn: &mut Conn) -> Result<Receiver, DlqError> {
        let attach = Receiver::builder()
            .name(format!("{}-receiver", conn.container))
            .source(self.address.clone())
            .target(conn.container.clone())
            .sender_settle_mode(SenderSettleMode::Unsettled)
            .receiver_settle_mode(ReceiverSettleMode::First)
            .credit_mode(CreditMode::Manual)
            .auto_accept(false)
            .attach(&mut conn.opened.session);
        let what = format!("attaching a receiver to `{}`", self.address);
        match tokio::time::timeout(conn.bound, attach).await {
            Ok(Ok(rx)) => Ok(rx),
            Ok(Err(e)) => Err(DlqError::broker(
                what,
                Error::AttachReceiver { address: self.address.clone(), source: e },
            )),
            Err(_) => Err(DlqError::broker(
                what,
                Error::Timeout { verb: "attach receiver", after: conn.bound },
            )),
        }
    }

    fn letter(&self, id: String, d: &Delivery) -> Letter {
        let m = d.message();
        let mut l = Letter::new(id, d.payload().to_vec());
        let props = m.properties.as_ref();
        if let Some(mid) = props.and_then(|p| p.message_id.as_ref()) {
            l = l.with_message_id(id_text(mid));
        }
        if let Some(ct) = props.and_then(|p| p.content_type.as_ref()) {
            l = l.with_content_type(ct.0.as_str());
        }
        if let Some(ce) = props.and_then(|p| p.content_encoding.as_ref()) {
            l = l.with_content_encoding(ce.0.as_str());
        }
        if let Some(c) = props.and_then(|p| p.correlation_id.as_ref()) {
            l = l.with_correlation_id(id_text(c));
        }
        if let Some(ms) = props.and_then(|p| p.creation_time.as_ref()).map(|t| t.milliseconds())
            && let Ok(ms) = u64::try_from(ms)
        {
            l = l.with_timestamp(std::time::UNIX_EPOCH + Duration::from_millis(ms));
        }
        for (k, v) in m.application_properties.iter().flat_map(|a| a.0.iter()) {
            l = l.with_header(k.as_str(), text(v));
        }
        if let Some(entity) = self.service_bus_entity() {
            l = service_bus_headers(l, entity);
        }
        l
    }
}

/// Service Bus' own dead-letter properties standing in for idem's missing headers.
fn service_bus_headers(mut l: Letter, entity: &str) -> Letter {
    if l.outcome().is_some() {
        return l;
    }
    let reason = l.header("DeadLetterErrorDescription").map(str::to_owned);
    if let Some(outcome) = l.header("DeadLetterReason").map(str::to_owned) {
        l = l.with_header(headers::OUTCOME, outcome);
    }
    if let Some(reason) = reason {
        l = l.with_header(headers::REASON, reason);
    }
    let subscription = entity.to_ascii_lowercase().contains("/subscriptions/");
    if l.source().is_none() && !subscription {
        l = l.with_header(headers::SOURCE, entity);
    }
    l
}

/// An open connection and session, and the token renewals that end with it.
struct Conn {
    opened: Opened,
    renewals: Vec<tokio::task::JoinHandle<()>>,
    container: String,
    bound: Duration,
}

impl Conn {
    /// Ends the session and closes the connection, each bounded: the broker has then handled
    /// every disposition sent before.
    async fn close(mut self, what: &str) -> Result<(), DlqError> {
        for r in &self.renewals {
            r.abort();
        }
        let fail = |e: &dyn std::fmt::Display| {
            DlqError::broker(format!("closing the connection after {what}"), e.to_string())
        };
        let ended = tokio::time::timeout(self.bound, self.opened.session.end()).await;
        let closed = tokio::time::timeout(self.bound, self.opened.connection.close()).await;
        match (ended, closed) {
            (_, Ok(Ok(()))) => Ok(()),
            (_, Ok(Err(e))) => Err(fail(&e)),
            (_, Err(e)) => Err(fail(&e)),
        }
    }
}

/// Detaches `rx` without closing the node's link state, bounded: RabbitMQ's AMQP 1.0 plugin
/// answers a closing detach without `closed=true`.
async fn detach(rx: Receiver, bound: Duration) {
    let bound = bound.min(Duration::from_secs(1));
    if tokio::time::timeout(bound, rx.detach()).await.is_err() {
        tracing::debug!("receiver detach unanswered within {bound:?}");
    }
}

impl DeadLetterQueue for Amqp10DeadLetters {
    fn describe(&self) -> String {
        format!("amqp 1.0 address {}", self.address)
    }

    /// # Cancel safety
    /// Dropped midway, the connection is dropped with the future and the broker gives back
    /// what it had delivered.
    fn read(&self, limit: usize) -> BoxFuture<'_, Result<Vec<Letter>, DlqError>> {
        Box::pin(async move {
            let mut conn = self.open(&self.read_entities()).await?;
            let mut rx = self.attach_receiver(&mut conn).await?;
            let taken = self.receive(&mut rx, limit.min(MAX_LETTERS), |_| true).await;
            let infos: Vec<_> = taken.iter().flatten().map(|d| d.info().clone()).collect();
            let released = rx.dispose_all(infos, Released {}).await;
            detach(rx, conn.bound).await;
            let closed = conn.close("reading").await;
            let taken = taken?;
            released.map_err(|e| {
                DlqError::broker(format!("releasing messages back to `{}`", self.address), e)
            })?;
            closed?;
            let mut ids = Ids::default();
            Ok(taken.iter().map(|d| self.letter(ids.next(digest(d)), d)).collect())
        })
    }

    fn republish<'a>(&'a self, messages: &'a [Republish]) -> BoxFuture<'a, Result<(), DlqError>> {
        Box::pin(async move {
            if messages.is_empty() {
                return Ok(());
            }
            let mut destinations: Vec<&str> = Vec::new();
            for m in messages {
                if !destinations.contains(&m.destination.as_str()) {
                    destinations.push(&m.destination);
                }
            }
            let mut conn = self.open(&destinations).await?;
            let sent = self.send_all(&mut conn, &destinations, messages).await;
            let closed = conn.close("republishing").await;
            sent?;
            closed
        })
    }

    /// # Cancel safety
    /// As [`read`](Self::read); an `accepted` already sent stays sent.
    fn remove<'a>(&'a self, ids: &'a [String]) -> BoxFuture<'a, Result<u64, DlqError>> {
        Box::pin(async move {
            if ids.is_empty() {
                return Ok(0);
            }
            let wanted: HashSet<&str> = ids.iter().map(String::as_str).collect();
            let mut conn = self.open(&self.read_entities()).await?;
            let mut rx = self.attach_receiver(&mut conn).await?;
            let mut numbering = Ids::default();
            let mut found = HashSet::new();
            let mut matched = Vec::new();
            let taken = self
                .receive(&mut rx, MAX_LETTERS, |d| {
                    let id = numbering.next(digest(d));
                    if wanted.contains(id.as_str()) && found.insert(id) {
                        matched.push(d.info().delivery_id());
                    }
                    found.len() < wanted.len()
                })
                .await;
            let (accept, release): (Vec<_>, Vec<_>) = taken
                .iter()
                .flatten()
                .map(|d| d.info().clone())
                .partition(|i| matched.contains(&i.delivery_id()));
            let n = u64::try_from(accept.len()).unwrap_or(u64::MAX);
            let accepted = rx.dispose_all(accept, Accepted {}).await;
            let released = rx.dispose_all(release, Released {}).await;
            detach(rx, conn.bound).await;
            let closed = conn.close("removing").await;
            taken?;
            accepted.map_err(|e| {
                DlqError::broker(format!("removing dead letters from `{}`", self.address), e)
            })?;
            released.map_err(|e| {
                DlqError::broker(format!("releasing messages back to `{}`", self.address), e)
            })?;
            closed?;
            Ok(n)
        })
    }
}

impl Amqp10DeadLetters {
    /// Sends every message on a sender per destination, all in flight at once, and checks
    /// that each was accepted.
    async fn send_all(
        &self,
        conn: &mut Conn,
        destinations: &[&str],
        messages: &[Republish],
    ) -> Result<(), DlqError> {
        let mut senders = HashMap::new();
        for (i, dest) in destinations.iter().enumerate() {
            let attach = Sender::attach(
                &mut conn.opened.session,
                format!("{}-sender-{i}", conn.container),
                (*dest).to_owned(),
            );
            let sender = match tokio::time::timeout(conn.bound, attach).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    return Err(DlqError::broker(
                        format!("attaching a sender to `{dest}`"),
                        Error::AttachSender { address: (*dest).to_owned(), source: e },
                    ));
                }
                Err(_) => {
                    return Err(DlqError::broker(
                        format!("attaching a sender to `{dest}`"),
                        Error::Timeout { verb: "attach sender", after: conn.bound },
                    ));
                }
            };
            senders.insert(*dest, sender);
        }
        let mut pending = Vec::with_capacity(messages.len());
        for m in messages {
            let Some(sender) = senders.get_mut(m.destination.as_str()) else { continue };
            let fut = sender.send_batchable(message(m, self.service_bus_entity().is_some())).await;
            pending.push((m, fut.map_err(|e| sent_failed(m, &e))?));
        }
        // Every message is on the wire already: awaiting the outcomes in turn waits no longer
        // than the slowest.
        let outcomes = tokio::time::timeout(conn.bound, async {
            let mut out = Vec::with_capacity(pending.len());
            for (m, f) in pending {
                out.push((m, f.await));
            }
            out
        })
        .await
        .map_err(|_| {
            DlqError::broker(
                "republishing",
                Error::Timeout { verb: "await the broker's outcome", after: conn.bound },
            )
        })?;
        for (m, outcome) in outcomes {
            match outcome.map_err(|e| sent_failed(m, &e))? {
                Outcome::Accepted(_) => {}
                other => {
                    return Err(DlqError::NotPublished {
                        letter: m.letter.clone(),
                        why: format!("`{}` did not accept it: {other:?}", m.destination),
                    });
                }
            }
        }
        for (_, sender) in senders {
            let _ =
                tokio::time::timeout(conn.bound.min(Duration::from_secs(1)), sender.detach()).await;
        }
        Ok(())
    }
}

mod convert;
use convert::*;

#[cfg(test)]
mod tests;
