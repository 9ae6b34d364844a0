//! The transactional-batch inbox through idem-core's inbox decider, on the in-memory emulator.

use crate::common;

use azure_data_cosmos::clients::ContainerClient;
use idem_core::engine::{FailureKind, HandlerError};
use idem_core::extract::Message;
use idem_core::inbox::TxInbox;
use idem_core::{DedupKey, Engine, Inbox, Outcome, Tx};
use idem_cosmos::CosmosInbox;
use serde_json::{Value, json};

async fn inbox() -> (Engine<Inbox<CosmosInbox>>, ContainerClient, common::Emulator) {
    let emu = common::Emulator::start().await;
    let orders = emu.container("/orderId").await;
    let inbox = CosmosInbox::new(orders.clone(), "/orderId").expect("inbox");
    let consumer = Engine::builder(Inbox::new(inbox)).scope("orders").build().expect("consumer");
    (consumer, orders, emu)
}

fn order(msg_id: &str, order_id: &str, total: i64) -> Message {
    Message::new(serde_json::to_vec(&json!({"orderId": order_id, "total": total})).expect("json"))
        .with_message_id(msg_id)
}

/// Writes the order and one line, in the order's partition; fails when `fail` says so.
async fn handle(
    mut tx: Tx<CosmosInbox>,
    m: Message,
    fail: bool,
) -> Result<i64, HandlerError<String>> {
    let body: Value =
        serde_json::from_slice(&m.payload).map_err(|e| HandlerError::Permanent(e.to_string()))?;
    let id = body["orderId"].as_str().unwrap_or_default().to_owned();
    let total = body["total"].as_i64().unwrap_or_default();
    let err = |e: idem_cosmos::Error| HandlerError::Permanent(e.to_string());
    tx.set_partition_key(id.clone()).map_err(err)?;
    tx.create(&json!({"id": id, "orderId": id, "total": total})).map_err(err)?;
    tx.create(&json!({"id": format!("{id}-line-1"), "orderId": id, "sku": "A"})).map_err(err)?;
    if fail {
        return Err(HandlerError::Transient("downstream timeout".to_owned()));
    }
    Ok(total)
}

async fn exists(c: &ContainerClient, pk: &str, id: &str) -> bool {
    match c.read_item(pk.to_owned(), id, None).await {
        Ok(_) => true,
        Err(e) if e.status().is_not_found() => false,
        Err(e) => panic!("read {id}: {e}"),
    }
}

#[tokio::test]
async fn first_is_processed_then_duplicate_with_result() {
    let (consumer, orders, _emu) = inbox().await;
    let h = |d, m| handle(d, m, false);
    let out = consumer.decide_batch(&[order("m-1", "o-1", 10)], &h).await;
    assert!(matches!(out[..], [Outcome::Processed(10)]), "{out:?}");
    assert!(exists(&orders, "o-1", "o-1").await && exists(&orders, "o-1", "o-1-line-1").await);
    // Redelivered, and repeated inside one fetched batch.
    let out = consumer.decide_batch(&[order("m-1", "o-1", 10), order("m-1", "o-1", 10)], &h).await;
    assert!(
        matches!(out[..], [Outcome::Duplicate(Some(10)), Outcome::Duplicate(Some(10))]),
        "{out:?}"
    );
}

#[tokio::test]
async fn same_key_other_payload_is_conflict() {
    let (consumer, _orders, _emu) = inbox().await;
    let h = |d, m| handle(d, m, false);
    let out = consumer.decide_batch(&[order("m-2", "o-2", 10)], &h).await;
    assert!(matches!(out[..], [Outcome::Processed(_)]));
    let out = consumer.decide_batch(&[order("m-2", "o-2", 99)], &h).await;
    match &out[..] {
        [Outcome::Conflict(c)] => assert_eq!(c.key.id(), "m-2"),
        other => panic!("expected a conflict, got {other:?}"),
    }
}

#[tokio::test]
async fn failing_handler_leaves_nothing() {
    let (consumer, orders, _emu) = inbox().await;
    let out = consumer.decide_batch(&[order("m-3", "o-3", 10)], &|d, m| handle(d, m, true)).await;
    match &out[..] {
        [Outcome::Failed(f)] => assert_eq!(f.kind, FailureKind::Transient),
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(!exists(&orders, "o-3", "o-3").await);
    assert!(!exists(&orders, "o-3", "o-3-line-1").await);
    // Nothing marked: the redelivery runs.
    let out = consumer.decide_batch(&[order("m-3", "o-3", 10)], &|d, m| handle(d, m, false)).await;
    assert!(matches!(out[..], [Outcome::Processed(10)]), "{out:?}");
}

#[tokio::test]
async fn batch_is_atomic() {
    let (consumer, orders, _emu) = inbox().await;
    // The second business document exists already: its create fails the whole batch.
    orders
        .create_item("o-4", "o-4-line-1", json!({"id": "o-4-line-1", "orderId": "o-4"}), None)
        .await
        .expect("seed");
    let out = consumer.decide_batch(&[order("m-4", "o-4", 10)], &|d, m| handle(d, m, false)).await;
    match &out[..] {
        [Outcome::Failed(f)] => {
            assert_eq!(f.kind, FailureKind::Permanent);
            assert!(f.cause.to_string().contains("already exists"), "{}", f.cause);
        }
        other => panic!("expected a permanent failure, got {other:?}"),
    }
    // Neither the marker nor the order (created before the failing line) was written.
    assert!(!exists(&orders, "o-4", "o-4").await, "order written by a failed batch");
    let again =
        consumer.decide_batch(&[order("m-4", "o-4", 10)], &|d, m| handle(d, m, false)).await;
    assert!(matches!(again[..], [Outcome::Failed(_)]), "no marker was left behind: {again:?}");
}

#[tokio::test]
async fn document_in_another_partition_is_refused() {
    let (consumer, orders, _emu) = inbox().await;
    let h = |mut tx: Tx<CosmosInbox>, _m: Message| async move {
        let err = |e: idem_cosmos::Error| HandlerError::Permanent(e.to_string());
        tx.set_partition_key("o-5").map_err(err)?;
        tx.create(&json!({"id": "o-6", "orderId": "o-6"})).map_err(err)?;
        Ok::<_, HandlerError<String>>(())
    };
    let out = consumer.decide_batch(&[order("m-5", "o-5", 1)], &h).await;
    match &out[..] {
        [Outcome::Failed(f)] => {
            assert_eq!(f.kind, FailureKind::Permanent);
            assert!(f.cause.to_string().contains("partition key"), "{}", f.cause);
        }
        other => panic!("expected a permanent failure, got {other:?}"),
    }
    assert!(!exists(&orders, "o-6", "o-6").await);
}

/// Outside any broker: one message in its own batch through `TxInbox::process`, a duplicate
/// on the second call, with the result stored in the marker.
#[tokio::test]
async fn process_outside_a_broker() {
    let emu = common::Emulator::start().await;
    let orders = emu.container("/orderId").await;
    let inbox = CosmosInbox::new(orders.clone(), "/orderId").expect("inbox");
    let key = DedupKey::new("orders", "m-7").expect("key");
    let write = |mut tx: Tx<CosmosInbox>| async move {
        let err = |e: idem_cosmos::Error| HandlerError::Permanent(e.to_string());
        tx.set_partition_key("o-7").map_err(err)?;
        tx.create(&json!({"id": "o-7", "orderId": "o-7"})).map_err(err)?;
        Ok::<_, HandlerError<String>>(7)
    };
    let first = inbox.process(&key, None, write).await;
    assert!(matches!(first, Outcome::Processed(7)), "{first:?}");
    assert!(exists(&orders, "o-7", "o-7").await);
    let again = inbox.process(&key, None, write).await;
    assert!(matches!(again, Outcome::Duplicate(Some(7))), "{again:?}");
}

/// A message without a key, processed without dedup: its documents commit unmarked, and it
/// must name its partition.
#[tokio::test]
async fn keyless_messages_commit_unmarked() {
    let emu = common::Emulator::start().await;
    let orders = emu.container("/orderId").await;
    let inbox = CosmosInbox::new(orders.clone(), "/orderId").expect("inbox");
    let engine = Engine::builder(Inbox::new(inbox))
        .scope("orders")
        .missing_key(idem_core::engine::MissingKeyPolicy::ProcessWithoutDedup)
        .build()
        .expect("engine");
    let keyless = |order_id: &str| {
        Message::new(serde_json::to_vec(&json!({"orderId": order_id, "total": 1})).expect("json"))
    };
    let out = engine.decide_batch(&[keyless("o-8")], &|t, m| handle(t, m, false)).await;
    assert!(matches!(out[..], [Outcome::Processed(1)]), "{out:?}");
    assert!(exists(&orders, "o-8", "o-8").await && exists(&orders, "o-8", "o-8-line-1").await);
    let no_partition = |mut tx: Tx<CosmosInbox>, _m: Message| async move {
        tx.create(&json!({"id": "o-9", "orderId": "o-9"}))
            .map_err(|e| HandlerError::Permanent(e.to_string()))?;
        Ok::<_, HandlerError<String>>(0)
    };
    let out = engine.decide_batch(&[keyless("o-9")], &no_partition).await;
    match &out[..] {
        [Outcome::Failed(f)] => {
            assert_eq!(f.kind, FailureKind::Permanent);
            assert!(f.cause.to_string().contains("partition key"), "{}", f.cause);
        }
        other => panic!("expected a permanent failure, got {other:?}"),
    }
    assert!(!exists(&orders, "o-9", "o-9").await);
}

/// Crash notes in a `/pk` container of their own: a poison message whose handler "kills the
/// process" (the batch dropped while it runs) is dead-lettered after 3 deaths at limit 3 — the
/// first in its batch, uncounted until its redeliveries run under notes — and its batch-mates'
/// documents are written once each.
#[tokio::test]
async fn a_poison_message_is_dead_lettered_as_a_crash_loop() {
    use idem_core::engine::Cause;
    use idem_core::extract::Redelivery;
    use idem_core::time::ManualClock;
    use std::time::Duration;

    let emu = common::Emulator::start().await;
    let orders = emu.container("/orderId").await;
    let clock = ManualClock::new();
    let notes = idem_cosmos::CosmosStore::new(emu.container("/pk").await).with_clock(clock.clone());
    let inbox = CosmosInbox::new(orders.clone(), "/orderId").expect("inbox").crash_notes(notes);
    let lease = Duration::from_secs(30);
    let engine = Engine::builder(Inbox::new(inbox))
        .scope("orders")
        .lease(lease)
        .crash_loop_limit(3)
        .build()
        .expect("engine");
    let first: Vec<Message> =
        (0..4).map(|i| order(&format!("m-{i}"), &format!("o-{i}"), i)).collect();
    let again: Vec<Message> =
        first.iter().cloned().map(|m| m.with_redelivery(Redelivery::Again)).collect();
    let crashed = tokio::sync::Notify::new();
    let handler = |tx: Tx<CosmosInbox>, m: Message| {
        let poison = m.message_id.as_deref() == Some("m-2");
        let crashed = &crashed;
        async move {
            if poison {
                crashed.notify_one();
                std::future::pending::<()>().await;
            }
            handle(tx, m, false).await
        }
    };
    let (mut crashes, mut msgs) = (0, &first);
    let outs = loop {
        tokio::select! {
            outs = engine.decide_batch(msgs, &handler) => break outs,
            () = crashed.notified() => crashes += 1,
        }
        assert!(crashes <= 10, "still crashing after {crashes} deliveries");
        msgs = &again;
        clock.advance(lease + Duration::from_secs(1));
    };
    assert_eq!(crashes, 3);
    let Outcome::Failed(f) = &outs[2] else { panic!("{outs:?}") };
    assert!(matches!(f.cause, Cause::CrashLoop { deaths: 3, limit: 3 }), "{:?}", f.cause);
    for i in [0, 1, 3] {
        assert!(matches!(outs[i], Outcome::Processed(_) | Outcome::Duplicate(_)), "{outs:?}");
        let id = format!("o-{i}");
        assert!(exists(&orders, &id, &id).await, "{id}");
    }
    assert!(!exists(&orders, "o-2", "o-2").await);
}
