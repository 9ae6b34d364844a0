//! Service Bus' verbs at the mapping, against a scripted peer on fe2o3's acceptor (no Azure
//! here): SAS authorisation on `$cbs`, complete / abandon / dead-letter with `DeadLetterReason`
//! and `DeadLetterErrorDescription`, dead-lettering before `MaxDeliveryCount`, lock renewal
//! while a handler outlives the lock, session filters and session-lock renewal, and the
//! startup check of the redelivery window. The real service is exercised by the opt-in test
//! at the end (`IDEM_TEST_SERVICEBUS_CONNECTION`).
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fe2o3_amqp::acceptor::{
    ConnectionAcceptor, LinkAcceptor, LinkEndpoint, SaslAnonymousMechanism, SessionAcceptor,
};
use fe2o3_amqp::link::{Receiver, SendError, Sender};
use fe2o3_amqp::types::messaging::annotations::OwnedKey;
use fe2o3_amqp::types::messaging::{
    AmqpValue, ApplicationProperties, Body, Data, Header, Message, MessageAnnotations, MessageId,
    Outcome, Properties,
};
use fe2o3_amqp::types::primitives::{Binary, SimpleValue, Symbol, Value};
use idem_amqp10::{
    Amqp10Consumer, Delivery, Error, ServiceBus, ServiceBusConfig, SessionFilter, fe2o3_amqp,
};
use idem_core::MemoryStore;
use idem_core::consumer::Report;
use idem_core::engine::{Context, HandlerError};
use tokio::sync::{Notify, mpsc};

const QUEUE: &str = "orders";

/// What the peer saw.
#[derive(Debug, Clone)]
enum Seen {
    PutToken { name: String, kind: String, token: String },
    Attached { filter: Option<Value> },
    Outcome { id: String, outcome: Outcome },
    Management { operation: String, body: Value },
}

/// A one-connection Service Bus stand-in: answers `$cbs` and `$management`, sends the
/// messages it is given on the queue link and reports each outcome.
struct Peer {
    port: u16,
    send: mpsc::UnboundedSender<Message<Body<Value>>>,
    seen: mpsc::UnboundedReceiver<Seen>,
    aside: Vec<Seen>,
}

async fn peer(renewed: Arc<Notify>) -> Peer {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (send, mut to_send) = mpsc::unbounded_channel::<Message<Body<Value>>>();
    let (seen_tx, seen) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let acceptor = ConnectionAcceptor::builder()
            .container_id("fake-service-bus")
            .sasl_acceptor(SaslAnonymousMechanism::new())
            .build();
        let mut connection = acceptor.accept(stream).await.unwrap();
        let mut session = SessionAcceptor::new().accept(&mut connection).await.unwrap();
        let links = LinkAcceptor::new();
        let mut requests: HashMap<String, Receiver> = HashMap::new();
        loop {
            let Ok(link) = links.accept(&mut session).await else { return };
            match link {
                LinkEndpoint::Receiver(r) => {
                    let node = address_of(r.target().as_ref().and_then(|t| t.address.clone()));
                    requests.insert(node, r);
                }
                LinkEndpoint::Sender(s) => {
                    let node = address_of(s.source().as_ref().and_then(|t| t.address.clone()));
                    if let Some(r) = requests.remove(&node) {
                        tokio::spawn(respond(r, s, seen_tx.clone(), Arc::clone(&renewed)));
                    } else if node == QUEUE {
                        let filter =
                            s.source().as_ref().and_then(|src| src.filter.as_ref()).and_then(|f| {
                                f.get(&Symbol::from("com.microsoft:session-filter")).cloned()
                            });
                        let _ = seen_tx.send(Seen::Attached { filter });
                        let (mut s, seen_tx) = (s, seen_tx.clone());
                        let mut to_send =
                            std::mem::replace(&mut to_send, mpsc::unbounded_channel().1);
                        tokio::spawn(async move {
                            while let Some(m) = to_send.recv().await {
                                let id = match m
                                    .properties
                                    .as_ref()
                                    .and_then(|p| p.message_id.clone())
                                {
                                    Some(MessageId::String(s)) => s,
                                    _ => String::new(),
                                };
                                let outcome = match s.send(m).await {
                                    Ok(o) => o,
                                    Err(SendError::Detached(_)) => return,
                                    Err(e) => panic!("send: {e:?}"),
                                };
                                let _ = seen_tx.send(Seen::Outcome { id, outcome });
                            }
                        });
                    }
                }
            }
        }
    });
    Peer { port, send, seen, aside: Vec::new() }
}

fn address_of(a: Option<impl std::fmt::Debug>) -> String {
    // `Address` is a string; its Debug form is quoted.
    a.map(|a| format!("{a:?}").trim_matches('"').to_owned()).unwrap_or_default()
}

/// Answers requests on a `$cbs` or `$management` node: 202 to put-token, 200 to the rest.
async fn respond(
    mut rx: Receiver,
    mut tx: Sender,
    seen: mpsc::UnboundedSender<Seen>,
    renewed: Arc<Notify>,
) {
    while let Ok(d) = rx.recv::<Body<Value>>().await {
        rx.accept(&d).await.unwrap();
        let m = d.into_message();
        let app = m.application_properties.clone().unwrap_or_default();
        let text = |k: &str| match app.0.get(k) {
            Some(SimpleValue::String(s)) => s.clone(),
            _ => String::new(),
        };
        let operation = text("operation");
        let status = if operation == "put-token" {
            let token = match &m.body {
                Body::Value(AmqpValue(Value::String(s))) => s.clone(),
                other => format!("{other:?}"),
            };
            let _ = seen.send(Seen::PutToken { name: text("name"), kind: text("type"), token });
            202
        } else {
            let body = match m.body {
                Body::Value(AmqpValue(v)) => v,
                _ => Value::Null,
            };
            let _ = seen.send(Seen::Management { operation, body });
            renewed.notify_one();
            200
        };
        let mut props = ApplicationProperties::default();
        props.0.insert("status-code".to_owned(), SimpleValue::Int(status));
        props.0.insert("statusCode".to_owned(), SimpleValue::Int(status));
        let reply = Message {
            header: None,
            delivery_annotations: None,
            message_annotations: None,
            properties: Some(Properties {
                correlation_id: m.properties.and_then(|p| p.message_id),
                ..Properties::default()
            }),
            application_properties: Some(props),
            body: Body::Value(AmqpValue(Value::Map(Default::default()))),
            footer: None,
        };
        if tx.send(reply).await.is_err() {
            return;
        }
    }
}

/// A PeekLock delivery: `message-id`, body, delivery count and lock token.
fn message(id: &str, body: &str, delivery_count: u32, lock: uuid::Uuid) -> Message<Body<Value>> {
    let mut annotations = MessageAnnotations::default();
    annotations.0.insert(
        OwnedKey::Symbol(Symbol::from("x-opt-lock-token")),
        Value::Uuid((*lock.as_bytes()).into()),
    );
    Message {
        header: Some(Header { delivery_count, ..Header::default() }),
        delivery_annotations: None,
        message_annotations: Some(annotations),
        properties: Some(Properties {
            message_id: Some(MessageId::String(id.to_owned())),
            ..Properties::default()
        }),
        application_properties: None,
        body: Body::Data(vec![Data(Binary::from(body.as_bytes().to_vec()))].into()),
        footer: None,
    }
}

fn namespace(port: u16) -> ServiceBus {
    ServiceBus::from_connection_string(
        "Endpoint=sb://idem-test.servicebus.windows.net/;SharedAccessKeyName=listen;SharedAccessKey=c2VjcmV0",
    )
    .unwrap()
    .endpoint("127.0.0.1", port, false)
}

async fn consumer(config: ServiceBusConfig) -> Amqp10Consumer<MemoryStore> {
    Amqp10Consumer::builder(config)
        .store(MemoryStore::new())
        .scope("orders")
        .idle_wait(Duration::from_millis(50))
        .build()
        .await
        .unwrap()
}

/// The next event `want` accepts, from what was put aside first; others are put aside.
async fn next(p: &mut Peer, want: impl Fn(&Seen) -> bool) -> Seen {
    if let Some(i) = p.aside.iter().position(&want) {
        return p.aside.remove(i);
    }
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let s = p.seen.recv().await.expect("peer gone");
            if want(&s) {
                return s;
            }
            p.aside.push(s);
        }
    })
    .await
    .expect("the peer did not see it")
}

async fn outcome(
    p: &mut Peer,
    c: &Amqp10Consumer<MemoryStore>,
    flaky: &Arc<AtomicBool>,
) -> (String, Outcome) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let handler = {
            let flaky = Arc::clone(flaky);
            move |_: Context, _: Delivery| {
                let fail = flaky.swap(false, Ordering::SeqCst);
                async move {
                    if fail {
                        Err(HandlerError::Transient("database away".to_owned()))
                    } else {
                        Ok::<_, HandlerError<String>>(())
                    }
                }
            }
        };
        let _: Report = c.poll(handler).await.unwrap();
        while let Ok(s) = p.seen.try_recv() {
            match s {
                Seen::Outcome { id, outcome } => return (id, outcome),
                other => p.aside.push(other),
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "no outcome");
    }
}

fn dead_letter_info(o: &Outcome) -> (String, String, String) {
    let Outcome::Rejected(r) = o else { panic!("not rejected: {o:?}") };
    let e = r.error.as_ref().expect("error");
    let info = e.info.as_ref().expect("info");
    let get = |k: &str| match info.get(&Symbol::from(k)) {
        Some(Value::String(s)) => s.clone(),
        other => panic!("{k}: {other:?}"),
    };
    (format!("{:?}", e.condition), get("DeadLetterReason"), get("DeadLetterErrorDescription"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_map_to_complete_abandon_and_dead_letter() {
    let mut p = peer(Arc::new(Notify::new())).await;
    let c = consumer(namespace(p.port).queue(QUEUE).max_delivery_count(5)).await;

    // Authorised with a SAS token for the entity before the receiver attached.
    let Seen::PutToken { name, kind, token } =
        next(&mut p, |s| matches!(s, Seen::PutToken { .. })).await
    else {
        unreachable!()
    };
    assert_eq!(name, "sb://idem-test.servicebus.windows.net/orders");
    assert_eq!(kind, "servicebus.windows.net:sastoken");
    assert!(
        token.starts_with(
            "SharedAccessSignature sr=sb%3A%2F%2Fidem-test.servicebus.windows.net%2Forders&sig="
        ),
        "{token}"
    );
    assert!(token.ends_with("&skn=listen"), "{token}");

    let flaky = Arc::new(AtomicBool::new(false));
    let lock = uuid::Uuid::from_u128(7);
    // Processed → complete.
    p.send.send(message("o-1", r#"{"n":1}"#, 0, lock)).unwrap();
    let (id, o) = outcome(&mut p, &c, &flaky).await;
    assert_eq!(id, "o-1");
    assert!(matches!(o, Outcome::Accepted(_)), "{o:?}");
    // Duplicate → complete.
    p.send.send(message("o-1", r#"{"n":1}"#, 0, lock)).unwrap();
    assert!(matches!(outcome(&mut p, &c, &flaky).await.1, Outcome::Accepted(_)));
    // Reused id with other content → dead-letter, reason and description set.
    p.send.send(message("o-1", r#"{"n":2}"#, 0, lock)).unwrap();
    let (cond, reason, description) = dead_letter_info(&outcome(&mut p, &c, &flaky).await.1);
    assert!(cond.contains("com.microsoft:dead-letter"), "{cond}");
    assert_eq!(reason, "conflict");
    assert!(description.contains("o-1"), "{description}");
    // Transient failure → abandon (delivery count goes up), then complete on redelivery.
    flaky.store(true, Ordering::SeqCst);
    p.send.send(message("o-2", "{}", 0, lock)).unwrap();
    let o = outcome(&mut p, &c, &flaky).await.1;
    let Outcome::Modified(m) = o else { panic!("not abandoned: {o:?}") };
    assert_eq!((m.delivery_failed, m.undeliverable_here), (Some(true), Some(false)));
    p.send.send(message("o-2", "{}", 1, lock)).unwrap();
    assert!(matches!(outcome(&mut p, &c, &flaky).await.1, Outcome::Accepted(_)));
    // A failure on the last delivery MaxDeliveryCount allows → dead-lettered by idem, with
    // its own reason, instead of an abandon the broker would turn into MaxDeliveryCountExceeded.
    flaky.store(true, Ordering::SeqCst);
    p.send.send(message("o-3", "{}", 4, lock)).unwrap();
    let (_, reason, description) = dead_letter_info(&outcome(&mut p, &c, &flaky).await.1);
    assert_eq!(reason, "failed_transient");
    assert!(description.contains("MaxDeliveryCount 5"), "{description}");
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_are_renewed_while_a_handler_outlives_them() {
    let renewed = Arc::new(Notify::new());
    let mut p = peer(Arc::clone(&renewed)).await;
    let c = consumer(namespace(p.port).queue(QUEUE).lock_duration(Duration::from_secs(1))).await;
    let lock = uuid::Uuid::from_u128(0x1234_5678_9abc_def0_1122_3344_5566_7788);
    p.send.send(message("slow", "{}", 0, lock)).unwrap();
    // The handler finishes only after the peer has seen two renewals (≈ 1 s, past the lock).
    let handler = move |_: Context, _: Delivery| {
        let renewed = Arc::clone(&renewed);
        async move {
            renewed.notified().await;
            renewed.notified().await;
            Ok::<_, HandlerError<String>>(())
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let mut report = Report::default();
    while report.processed == 0 {
        assert!(tokio::time::Instant::now() < deadline, "not processed: {report}");
        report += c.poll(handler.clone()).await.unwrap();
    }
    let Seen::Management { operation, body } =
        next(&mut p, |s| matches!(s, Seen::Management { .. })).await
    else {
        unreachable!()
    };
    assert_eq!(operation, "com.microsoft:renew-lock");
    let Value::Map(map) = body else { panic!("{body:?}") };
    let Some(Value::Array(tokens)) = map.get(&Value::String("lock-tokens".into())) else {
        panic!("{map:?}")
    };
    assert_eq!(tokens.0, vec![Value::Uuid((*lock.as_bytes()).into())]);
    assert!(matches!(
        next(&mut p, |s| matches!(s, Seen::Outcome { .. })).await,
        Seen::Outcome { outcome: Outcome::Accepted(_), .. }
    ));
    c.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_consumer_asks_for_its_session_and_renews_its_lock() {
    let renewed = Arc::new(Notify::new());
    let mut p = peer(Arc::clone(&renewed)).await;
    let config = namespace(p.port)
        .queue(QUEUE)
        .session(SessionFilter::Id("customer-42".into()))
        .lock_duration(Duration::from_secs(1));
    let c = consumer(config).await;
    let Seen::Attached { filter } = next(&mut p, |s| matches!(s, Seen::Attached { .. })).await
    else {
        unreachable!()
    };
    assert_eq!(filter, Some(Value::String("customer-42".into())));
    assert_eq!(c.source().session_id(), Some("customer-42"));
    p.send.send(message("s-1", "{}", 0, uuid::Uuid::from_u128(1))).unwrap();
    let handler = move |_: Context, _: Delivery| {
        let renewed = Arc::clone(&renewed);
        async move {
            renewed.notified().await;
            Ok::<_, HandlerError<String>>(())
        }
    };
    let mut report = Report::default();
    while report.processed == 0 {
        report += c.poll(handler.clone()).await.unwrap();
    }
    let Seen::Management { operation, body } =
        next(&mut p, |s| matches!(s, Seen::Management { .. })).await
    else {
        unreachable!()
    };
    assert_eq!(operation, "com.microsoft:renew-session-lock");
    let Value::Map(map) = body else { panic!("{body:?}") };
    assert_eq!(
        map.get(&Value::String("session-id".into())),
        Some(&Value::String("customer-42".into()))
    );
    c.close().await.unwrap();
}

#[tokio::test]
async fn retention_must_cover_lock_duration_times_max_delivery_count() {
    // Checked before connecting: no peer needed. 10 × 1 day > the 7-day retention.
    let config =
        namespace(1).queue(QUEUE).lock_duration(Duration::from_secs(86_400)).max_delivery_count(10);
    let err = Amqp10Consumer::builder(config)
        .store(MemoryStore::new())
        .scope("s")
        .build()
        .await
        .map(|_| ())
        .unwrap_err();
    let idem_core::consumer::BuildError::Open(e @ Error::Retention(_)) = &err else {
        panic!("{err:?}")
    };
    assert!(e.to_string().contains("10 deliveries × 1d"), "{e}");
}

/// Against a real namespace when `IDEM_TEST_SERVICEBUS_CONNECTION` (with `EntityPath`, a queue
/// the test may drain) is set: connects, authorises and receives for a few seconds, then reads
/// the queue's dead-letter sub-queue twice (the same letters both times).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_service_bus_when_configured() {
    let Ok(connection) = std::env::var("IDEM_TEST_SERVICEBUS_CONNECTION") else {
        println!("skipped: IDEM_TEST_SERVICEBUS_CONNECTION unset");
        return;
    };
    let sb = ServiceBus::from_connection_string(&connection).unwrap();
    let c = Amqp10Consumer::builder(sb.entity().unwrap())
        .store(MemoryStore::new())
        .scope("idem-e2e")
        .build()
        .await
        .unwrap();
    let r = c
        .poll(|_: Context, _: Delivery| async { Ok::<_, HandlerError<String>>(()) })
        .await
        .unwrap();
    println!("real Service Bus: {r}");
    c.close().await.unwrap();
    // Its dead-letter sub-queue, read as `idem dlq` reads it (taken, then given back).
    let dlq = idem_amqp10::Amqp10DeadLetters::for_service_bus(&sb.entity().unwrap());
    let letters = idem_dlq::DeadLetterQueue::read(&dlq, 10).await.unwrap();
    println!("real Service Bus dead letters (first 10): {}", letters.len());
    let again = idem_dlq::DeadLetterQueue::read(&dlq, 10).await.unwrap();
    let ids = |ls: &[idem_dlq::Letter]| ls.iter().map(|l| l.id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&letters), ids(&again), "a read changed the dead-letter sub-queue");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_progress_elsewhere_is_scheduled_then_completed() {
    use fe2o3_amqp::types::messaging::message::__private::Deserializable;
    use idem_core::{ClaimRequest, DedupKey, DedupStore};

    let mut p = peer(Arc::new(Notify::new())).await;
    let store = MemoryStore::new();
    // Another consumer holds o-9 under a 30 s lease.
    let held = ClaimRequest::new(
        DedupKey::new("orders", "o-9").unwrap(),
        None,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    );
    let _lease = store.claim(&held).await.unwrap();
    let config = namespace(p.port)
        .queue(QUEUE)
        .schedule_retries(true)
        .retry_delay(Duration::from_secs(1), Duration::from_secs(10));
    let c = Amqp10Consumer::builder(config)
        .store(store)
        .scope("orders")
        .idle_wait(Duration::from_millis(50))
        .build()
        .await
        .unwrap();
    p.send.send(message("o-9", r#"{"n":9}"#, 0, uuid::Uuid::from_u128(9))).unwrap();
    let before = std::time::SystemTime::now();
    let (_, o) = outcome(&mut p, &c, &Arc::new(AtomicBool::new(false))).await;
    assert!(matches!(o, Outcome::Accepted(_)), "completed once the copy was scheduled: {o:?}");
    let Seen::Management { operation, body } =
        next(&mut p, |s| matches!(s, Seen::Management { .. })).await
    else {
        unreachable!()
    };
    assert_eq!(operation, "com.microsoft:schedule-message");
    let Value::Map(map) = body else { panic!("{body:?}") };
    let Some(Value::List(messages)) = map.get(&Value::String("messages".into())) else {
        panic!("{map:?}")
    };
    let [Value::Map(entry)] = &messages[..] else { panic!("{messages:?}") };
    assert_eq!(entry.get(&Value::String("message-id".into())), Some(&Value::String("o-9".into())));
    let Some(Value::Binary(encoded)) = entry.get(&Value::String("message".into())) else {
        panic!("{entry:?}")
    };
    let copy: Deserializable<Message<Body<Value>>> = serde_amqp::from_slice(encoded).unwrap();
    let copy = copy.0;
    let at = copy
        .message_annotations
        .as_ref()
        .and_then(|a| a.0.get(&OwnedKey::Symbol(Symbol::from("x-opt-scheduled-enqueue-time"))))
        .cloned();
    let Some(Value::Timestamp(at)) = at else { panic!("no enqueue time: {copy:?}") };
    // The other lease has ~30 s left, clamped to the 10 s maximum.
    let delay = at.milliseconds()
        - i64::try_from(before.duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()).unwrap();
    assert!((9_000..=11_000).contains(&delay), "scheduled {delay} ms ahead");
    assert_eq!(
        copy.application_properties.unwrap().0.get("idem-delays"),
        Some(&SimpleValue::String("1".into()))
    );
    assert!(matches!(copy.body, Body::Data(_)));
    c.close().await.unwrap();
}

/// Entra ID: tokens come from a [`TokenSource`] (e.g. wrapping `azure_identity`), are put on
/// `$cbs` as `jwt` for the entity's audience, and the source is asked for the entity's audience.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entra_id_tokens_from_a_token_source_are_put_as_jwt() {
    use idem_amqp10::{AccessToken, BoxError, TokenKind, TokenSource};
    use std::sync::Mutex;

    struct Recorder(Arc<Mutex<Vec<String>>>);
    impl TokenSource for Recorder {
        fn token<'a>(
            &'a self,
            audience: &'a str,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Result<AccessToken, BoxError>> + Send + 'a>,
        > {
            self.0.lock().unwrap().push(audience.to_owned());
            let expires = std::time::SystemTime::now() + Duration::from_secs(3600);
            Box::pin(async move { Ok(AccessToken::new("eyJ.header.sig", TokenKind::Jwt, expires)) })
        }
    }

    let mut p = peer(Arc::new(Notify::new())).await;
    let asked = Arc::new(Mutex::new(Vec::new()));
    let sb = ServiceBus::with_token_source(
        "idem-test.servicebus.windows.net",
        Recorder(Arc::clone(&asked)),
    )
    .endpoint("127.0.0.1", p.port, false);
    let c = consumer(sb.queue(QUEUE)).await;
    let Seen::PutToken { name, kind, token } =
        next(&mut p, |s| matches!(s, Seen::PutToken { .. })).await
    else {
        unreachable!()
    };
    assert_eq!((kind.as_str(), token.as_str()), ("jwt", "eyJ.header.sig"));
    assert_eq!(name, "sb://idem-test.servicebus.windows.net/orders");
    assert_eq!(
        *asked.lock().unwrap(),
        vec!["sb://idem-test.servicebus.windows.net/orders".to_owned()]
    );
    c.close().await.unwrap();
}
