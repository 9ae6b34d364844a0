use super::*;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, DecimalValue, FieldArray, FieldTable, LongString, ShortString};

fn delivery(redelivered: bool, headers: FieldTable) -> Delivery {
    let mut d = Delivery::mock(7, "".into(), "q".into(), redelivered, b"{}".to_vec());
    d.properties = BasicProperties::default()
        .with_message_id("m-1".into())
        .with_content_type("application/json".into())
        .with_headers(headers);
    d
}

fn table(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert(ShortString::from(*k), v.clone());
    }
    t
}

#[test]
fn the_id_is_the_content_not_the_delivery() {
    let s = |v: &str| AMQPValue::LongString(LongString::from(v));
    let first = delivery(false, table(&[("idem-reason", s("no"))]));
    let again = delivery(
        true,
        table(&[("idem-reason", s("no")), ("x-delivery-count", AMQPValue::LongLongInt(3))]),
    );
    assert_eq!(digest(&first), digest(&again));
    assert_eq!(digest(&first).len(), 16);
    let other = delivery(false, table(&[("idem-reason", s("yes"))]));
    assert_ne!(digest(&first), digest(&other));
    // A number is not the same header as the string of its digits.
    let n = delivery(false, table(&[("n", AMQPValue::LongInt(5))]));
    let t = delivery(false, table(&[("n", s("5"))]));
    assert_ne!(digest(&n), digest(&t));
}

#[test]
fn identical_copies_get_ids_of_their_own() {
    let mut ids = Ids::default();
    assert_eq!(ids.next("ab".into()), "ab");
    assert_eq!(ids.next("cd".into()), "cd");
    assert_eq!(ids.next("ab".into()), "ab.2");
}

#[test]
fn headers_read_as_text() {
    let death = table(&[
        ("count", AMQPValue::LongLongInt(2)),
        ("reason", AMQPValue::LongString("expired".into())),
        ("queue", AMQPValue::LongString("q.idem.delay".into())),
    ]);
    let d = delivery(
        false,
        table(&[
            (
                "x-death",
                AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::FieldTable(death)])),
            ),
            ("n", AMQPValue::LongInt(-5)),
            ("ok", AMQPValue::Boolean(true)),
            ("price", AMQPValue::DecimalValue(DecimalValue { scale: 3, value: 25 })),
            ("raw", AMQPValue::ByteArray(vec![0xca, 0xfe].into())),
            ("t", AMQPValue::FieldTable(table(&[("a", AMQPValue::Void)]))),
        ]),
    );
    let l = letter("x".into(), &d);
    assert_eq!(l.header("x-death"), Some("2× expired in queue q.idem.delay"));
    assert_eq!(l.header("n"), Some("-5"));
    assert_eq!(l.header("ok"), Some("true"));
    assert_eq!(l.header("price"), Some("0.025"));
    assert_eq!(l.header("raw"), Some("cafe"));
    assert_eq!(l.header("t"), Some("{a: }"));
    assert_eq!(l.message_id.as_deref(), Some("m-1"));
    assert_eq!(l.content_type.as_deref(), Some("application/json"));
}

#[test]
fn a_replay_leaves_the_brokers_headers_to_the_broker() {
    let mut r = sample();
    r.headers = vec![
        ("traceparent".into(), "00-1".into()),
        ("x-death".into(), "1× expired in queue q".into()),
        ("x-first-death-queue".into(), "q".into()),
        ("CC".into(), "[audit]".into()),
        ("BCC".into(), "[secret]".into()),
    ];
    let props = properties(&r).expect("properties");
    let h = props.headers().clone().unwrap_or_default();
    let names: Vec<&str> = h.inner().keys().map(ShortString::as_str).collect();
    assert_eq!(names, ["traceparent"]);
    assert_eq!(props.delivery_mode(), &Some(2));
    r.destination = "q".repeat(256);
    assert!(
        matches!(properties(&r), Err(DlqError::NotPublished { why, .. }) if why.contains("256 bytes"))
    );
}

fn sample() -> Republish {
    use idem_dlq::{MemoryDeadLetters, OnConflict, Workbench};
    // The workbench builds a Republish; take one from the in-memory queue.
    let q = MemoryDeadLetters::new();
    q.push(
        Letter::new("1", b"{}".to_vec())
            .with_message_id("m-1")
            .with_header("idem-outcome", "failed_permanent")
            .with_header("idem-source", "orders"),
    );
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    rt.block_on(async {
        let bench = Workbench::new(q.clone());
        let ls = bench.list(10).await.expect("list");
        bench.replay(&ls, OnConflict::Refuse).await.expect("replay");
    });
    q.published().remove(0)
}
