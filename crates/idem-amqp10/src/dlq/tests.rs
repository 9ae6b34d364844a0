use super::*;
use fe2o3_amqp::types::primitives::{SimpleValue, Symbol};

#[test]
fn service_bus_addresses() {
    let sb = crate::ServiceBus::from_connection_string(
        "Endpoint=sb://shop.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=c2VjcmV0",
    )
    .expect("connection string");
    let q = Amqp10DeadLetters::for_service_bus(&sb.queue("orders"));
    assert_eq!(q.address(), "orders/$deadletterqueue");
    assert_eq!(q.service_bus_entity(), Some("orders"));
    assert_eq!(q.describe(), "amqp 1.0 address orders/$deadletterqueue");
    let s = Amqp10DeadLetters::for_service_bus(&sb.subscription("events", "billing"));
    assert_eq!(s.address(), "events/Subscriptions/billing/$deadletterqueue");
    assert_eq!(s.service_bus_entity(), Some("events/Subscriptions/billing"));
}

#[test]
fn a_source_config_names_its_dead_letters() {
    let url = "amqp://guest:guest@127.0.0.1:5672";
    let c = Amqp10Config::new(url, "/amq/queue/orders")
        .dead_letters(DeadLetters::Address("/amq/queue/orders.dlq".into()));
    let q = Amqp10DeadLetters::for_source(&c).expect("an address");
    assert_eq!(q.address(), "/amq/queue/orders.dlq");
    assert_eq!(q.service_bus_entity(), None);
    let rejected = Amqp10DeadLetters::for_source(&Amqp10Config::new(url, "/amq/queue/orders"));
    assert!(matches!(rejected, Err(Error::Config { field: "dead_letters", .. })));
}

#[test]
fn service_bus_reasons_stand_in_for_idem_headers() {
    let l = Letter::new("1", Vec::new())
        .with_header("DeadLetterReason", "failed_permanent")
        .with_header("DeadLetterErrorDescription", "card declined");
    let l = service_bus_headers(l, "orders");
    assert_eq!(l.outcome(), Some("failed_permanent"));
    assert_eq!(l.reason(), Some("card declined"));
    assert_eq!(l.source(), Some("orders"));
    let sub = service_bus_headers(
        Letter::new("2", Vec::new()).with_header("DeadLetterReason", "conflict"),
        "events/Subscriptions/billing",
    );
    assert_eq!(sub.source(), None);
    // idem's own headers win.
    let own = Letter::new("3", Vec::new())
        .with_header(headers::OUTCOME, "conflict")
        .with_header("DeadLetterReason", "other");
    assert_eq!(service_bus_headers(own, "orders").outcome(), Some("conflict"));
}

#[test]
fn identical_copies_get_ids_of_their_own() {
    let mut ids = Ids::default();
    assert_eq!(ids.next("ab".into()), "ab");
    assert_eq!(ids.next("ab".into()), "ab.2");
    assert_eq!(ids.next("ab".into()), "ab.3");
}

#[test]
fn properties_read_as_text() {
    assert_eq!(text(&SimpleValue::Int(-5)), "-5");
    assert_eq!(text(&SimpleValue::Binary(vec![0xca, 0xfe].into())), "cafe");
    assert_eq!(text(&SimpleValue::Symbol(Symbol::from("x"))), "x");
    assert_eq!(text(&SimpleValue::Null), "");
}
