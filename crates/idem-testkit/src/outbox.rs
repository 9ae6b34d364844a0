//! The outbox-store contract ([`idem_core::outbox::OutboxStore`]): leases, fencing, ordering
//! keys, retries and parking, purge. Run it with [`outbox_conformance!`](crate::outbox_conformance).

#![allow(clippy::unwrap_used, missing_docs)] // test cases: a failed unwrap is the case failing

use std::collections::HashSet;
use std::sync::Arc;

use idem_core::outbox::{OutboxId, OutboxStore, Outgoing, Pending, PublishFailure, Ticket};

use crate::{Harness, TimeControl};

fn msg(dest: &str, body: &str) -> Outgoing {
    Outgoing::new(dest, body.as_bytes().to_vec())
}

fn tickets(p: &[Pending]) -> Vec<Ticket> {
    p.iter().map(|p| p.ticket).collect()
}

fn bodies(p: &[Pending]) -> Vec<String> {
    let mut v: Vec<String> =
        p.iter().map(|p| String::from_utf8_lossy(p.message.payload()).into_owned()).collect();
    v.sort();
    v
}

/// A claim leases its rows alone until the lease runs out; a stale ticket is fenced; sent rows
/// are never leased again.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn claim_leases_exclusively<S: OutboxStore, C: TimeControl>(h: Harness<S, C>) {
    let s = &h.store;
    s.send(vec![msg("q", "a"), msg("q", "b"), msg("q", "c")]).await.unwrap();
    let first = s.claim(10, h.unit).await.unwrap();
    assert_eq!(bodies(&first), ["a", "b", "c"]);
    assert!(s.claim(10, h.unit).await.unwrap().is_empty(), "leased rows were leased again");
    h.time.advance(h.unit * 2).await;
    let again = s.claim(10, h.unit).await.unwrap();
    assert_eq!(bodies(&again), ["a", "b", "c"], "rows whose lease ran out are due again");
    for (a, b) in first.iter().zip(&again) {
        assert!(b.ticket.token > a.ticket.token, "a new lease has a higher token");
    }
    assert_eq!(s.mark_sent(&tickets(&first)).await.unwrap(), 0, "stale tickets are fenced");
    assert_eq!(s.mark_sent(&tickets(&again)).await.unwrap(), 3);
    let c = s.counts().await.unwrap();
    assert_eq!((c.pending, c.sent, c.parked), (0, 3, 0));
    h.time.advance(h.unit * 2).await;
    assert!(s.claim(10, h.unit).await.unwrap().is_empty(), "sent rows are never leased");
}

/// Concurrent claims lease disjoint rows.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn concurrent_claims_are_disjoint<S: OutboxStore, C: TimeControl>(h: Harness<S, C>) {
    let store = Arc::new(h.store);
    let all: Vec<_> = (0..200).map(|i| msg("q", &format!("m{i}"))).collect();
    store.send(all).await.unwrap();
    let tasks = (0..4).map(|_| {
        let s = Arc::clone(&store);
        let unit = h.unit;
        tokio::spawn(async move {
            let mut got = Vec::new();
            loop {
                let batch = s.claim(7, unit * 10).await.unwrap();
                if batch.is_empty() {
                    return got;
                }
                got.extend(batch.iter().map(|p| p.message.id().clone()));
            }
        })
    });
    let mut seen: HashSet<OutboxId> = HashSet::new();
    for t in tasks {
        for id in t.await.unwrap() {
            assert!(seen.insert(id.clone()), "{id} was leased twice");
        }
    }
    assert_eq!(seen.len(), 200);
}

/// One row per (destination, ordering key) is leased at a time, in enqueue order.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn ordering_keys_go_one_at_a_time<S: OutboxStore, C: TimeControl>(h: Harness<S, C>) {
    let s = &h.store;
    let k = |dest: &str, body: &str, key: &str| msg(dest, body).ordering_key(key);
    s.send(vec![k("q", "a1", "a"), k("q", "a2", "a"), k("q", "b1", "b"), msg("q", "free")])
        .await
        .unwrap();
    s.send(vec![k("other", "x1", "a"), k("q", "a3", "a")]).await.unwrap();
    let first = s.claim(10, h.unit).await.unwrap();
    assert_eq!(bodies(&first), ["a1", "b1", "free", "x1"], "one row per (destination, key)");
    let a1 = first.iter().find(|p| p.message.payload() == b"a1").unwrap().ticket;
    // a1 fails and waits for a retry: a2 must not overtake it.
    let fail = PublishFailure { ticket: a1, reason: "nack".into(), retry_in: Some(h.unit) };
    assert_eq!(s.mark_failed(&[fail]).await.unwrap(), 1);
    assert!(s.claim(10, h.unit).await.unwrap().is_empty(), "a2 overtook a1 waiting for a retry");
    h.time.advance(h.unit * 2).await;
    let retry = s.claim(10, h.unit).await.unwrap();
    let retried = retry.iter().find(|p| p.message.payload() == b"a1").expect("a1 is due again");
    assert_eq!(retried.failures, 1);
    assert_eq!(bodies(&retry), ["a1", "b1", "free", "x1"]);
    s.mark_sent(&tickets(&retry)).await.unwrap();
    let next = s.claim(10, h.unit).await.unwrap();
    assert_eq!(bodies(&next), ["a2"]);
    s.mark_sent(&tickets(&next)).await.unwrap();
    assert_eq!(bodies(&s.claim(10, h.unit).await.unwrap()), ["a3"]);
}

/// Concurrent relays publish each ordering key's messages in enqueue order.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn concurrent_relays_keep_key_order<S: OutboxStore, C: TimeControl>(h: Harness<S, C>) {
    use std::sync::Mutex;
    let store = Arc::new(h.store);
    // 5 ordering keys × 20 messages, enqueued interleaved, plus 20 without a key.
    let mut all = Vec::new();
    for i in 0..20 {
        for k in 0..5 {
            all.push(msg("q", &format!("{k}:{i:02}")).ordering_key(format!("k{k}")));
        }
        all.push(msg("q", &format!("free:{i:02}")));
    }
    store.send(all).await.unwrap();
    let in_flight: Arc<Mutex<HashSet<String>>> = Arc::default();
    let order: Arc<Mutex<Vec<String>>> = Arc::default();
    let tasks = (0..4).map(|_| {
        let (s, in_flight, order, unit) =
            (Arc::clone(&store), Arc::clone(&in_flight), Arc::clone(&order), h.unit);
        tokio::spawn(async move {
            let mut idle = 0;
            while idle < 50 {
                let batch = s.claim(8, unit * 10).await.unwrap();
                if batch.is_empty() {
                    idle += 1;
                    tokio::task::yield_now().await;
                    continue;
                }
                idle = 0;
                let keys: Vec<String> = batch
                    .iter()
                    .filter_map(|p| p.message.ordering_key().map(str::to_owned))
                    .collect();
                {
                    let mut f = in_flight.lock().unwrap();
                    for k in &keys {
                        assert!(f.insert(k.clone()), "two rows of ordering key {k} leased at once");
                    }
                }
                order.lock().unwrap().extend(
                    batch.iter().map(|p| String::from_utf8_lossy(p.message.payload()).into_owned()),
                );
                // Released before the mark: the next row of a key is due only after it.
                for k in &keys {
                    in_flight.lock().unwrap().remove(k);
                }
                s.mark_sent(&tickets(&batch)).await.unwrap();
            }
        })
    });
    for t in tasks {
        t.await.unwrap();
    }
    let order = order.lock().unwrap().clone();
    assert_eq!(order.len(), 120, "every row published once");
    for k in 0..5 {
        let seen: Vec<&String> = order.iter().filter(|b| b.starts_with(&format!("{k}:"))).collect();
        let mut sorted = seen.clone();
        sorted.sort();
        assert_eq!(seen, sorted, "key k{k} out of order");
    }
    assert_eq!(store.counts().await.unwrap().sent, 120);
}

/// A failed row is retried after its backoff, or parked; a marked lease is spent.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn failures_retry_then_park<S: OutboxStore, C: TimeControl>(h: Harness<S, C>) {
    let s = &h.store;
    s.send(vec![msg("q", "a"), msg("q", "b")]).await.unwrap();
    let batch = s.claim(10, h.unit * 10).await.unwrap();
    let (a, b) = (batch[0].ticket, batch[1].ticket);
    let retry = PublishFailure { ticket: a, reason: "broker away".into(), retry_in: Some(h.unit) };
    let park = PublishFailure { ticket: b, reason: "x".repeat(5000), retry_in: None };
    assert_eq!(s.mark_failed(&[retry.clone(), park]).await.unwrap(), 2);
    assert_eq!(s.mark_failed(&[retry]).await.unwrap(), 0, "a marked lease is spent");
    assert!(s.claim(10, h.unit).await.unwrap().is_empty(), "a retry waits for its backoff");
    let c = s.counts().await.unwrap();
    assert_eq!((c.pending, c.parked), (1, 1));
    h.time.advance(h.unit * 2).await;
    let again = s.claim(10, h.unit).await.unwrap();
    assert_eq!(bodies(&again), ["a"], "parked rows are never leased");
    assert_eq!(again[0].failures, 1);
    assert_eq!(s.retry_parked(10).await.unwrap(), 1);
    let revived = s.claim(10, h.unit).await.unwrap();
    assert_eq!(bodies(&revived), ["b"]);
    assert_eq!(revived[0].failures, 0, "an operator's retry starts the count again");
}

/// `unsent` lists the rows not yet sent, parked ones first, with their destination, failure
/// count and last error; sent rows are not listed, and the limit holds.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn unsent_lists_parked_then_pending_rows<S: OutboxStore, C: TimeControl>(
    h: Harness<S, C>,
) {
    let s = &h.store;
    let ids = s.send(vec![msg("q1", "a"), msg("q2", "b"), msg("q1", "c")]).await.unwrap();
    let batch = s.claim(10, h.unit * 10).await.unwrap();
    let ticket =
        |body: &str| batch.iter().find(|p| p.message.payload() == body.as_bytes()).unwrap().ticket;
    let fail = |body: &str, reason: &str, retry_in| PublishFailure {
        ticket: ticket(body),
        reason: reason.into(),
        retry_in,
    };
    let failures = [fail("a", "broker away", Some(h.unit)), fail("b", "no such queue", None)];
    assert_eq!(s.mark_failed(&failures).await.unwrap(), 2);
    assert_eq!(s.mark_sent(&[ticket("c")]).await.unwrap(), 1);
    let rows = s.unsent(10).await.unwrap();
    let seen: Vec<(&str, &str, bool, u32, Option<&str>)> = rows
        .iter()
        .map(|r| {
            (
                r.message_id.as_str(),
                r.destination.as_str(),
                r.parked,
                r.failures,
                r.last_error.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (ids[1].as_str(), "q2", true, 1, Some("no such queue")),
            (ids[0].as_str(), "q1", false, 1, Some("broker away")),
        ]
    );
    assert!(rows[0].row != rows[1].row);
    assert_eq!(s.unsent(1).await.unwrap().len(), 1, "the limit holds");
}

/// Purge removes sent rows older than the retention, a bounded number at a time, never
/// unsent ones.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn purge_removes_only_old_sent_rows<S: OutboxStore, C: TimeControl>(h: Harness<S, C>) {
    let s = &h.store;
    s.send((0..5).map(|i| msg("q", &format!("m{i}"))).collect()).await.unwrap();
    let batch = s.claim(4, h.unit * 100).await.unwrap();
    s.mark_sent(&tickets(&batch[..3])).await.unwrap();
    assert_eq!(s.purge_sent(h.unit, 100).await.unwrap(), 0, "sent just now: kept");
    h.time.advance(h.unit * 2).await;
    assert_eq!(s.purge_sent(h.unit, 2).await.unwrap(), 2, "purge is bounded");
    assert_eq!(s.purge_sent(h.unit, 100).await.unwrap(), 1);
    let c = s.counts().await.unwrap();
    assert_eq!((c.pending, c.sent, c.parked), (2, 0, 0), "unsent rows are never purged");
}

/// `remove_sent` deletes only rows its tickets still hold.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn remove_sent_deletes_only_held_rows<S: OutboxStore, C: TimeControl>(h: Harness<S, C>) {
    let s = &h.store;
    s.send(vec![msg("q", "a"), msg("q", "b"), msg("q", "c")]).await.unwrap();
    let stale = s.claim(10, h.unit).await.unwrap();
    h.time.advance(h.unit * 2).await;
    let held = s.claim(10, h.unit).await.unwrap();
    assert_eq!(s.remove_sent(&tickets(&stale)).await.unwrap(), 0, "stale tickets are fenced");
    assert_eq!(s.remove_sent(&tickets(&held[..2])).await.unwrap(), 2);
    let c = s.counts().await.unwrap();
    assert_eq!((c.pending, c.sent, c.parked), (1, 0, 0), "removed rows are gone, the third waits");
    h.time.advance(h.unit * 2).await;
    assert_eq!(bodies(&s.claim(10, h.unit).await.unwrap()), ["c"]);
}

/// A message id is enqueued once; messages without one get distinct random ids.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn an_id_is_enqueued_once<S: OutboxStore, C: TimeControl>(h: Harness<S, C>) {
    let s = &h.store;
    let id = OutboxId::new("order-7-accepted").unwrap();
    let a = s.send(vec![msg("q", "x").id(id.clone())]).await.unwrap();
    let b = s.send(vec![msg("q", "x").id(id.clone())]).await.unwrap();
    assert_eq!((a[0].clone(), b[0].clone()), (id.clone(), id));
    assert_eq!(s.counts().await.unwrap().pending, 1);
    let fresh = s.send(vec![msg("q", "y"), msg("q", "z")]).await.unwrap();
    assert_ne!(fresh[0], fresh[1], "messages without an id get distinct random ids");
}

/// Ids are compared byte for byte: ids differing only by case or a trailing space are three
/// messages, whatever the database's collation does with text.
/// Ids differing by case or a trailing space are distinct messages.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn ids_differing_by_case_or_a_trailing_space_are_apart<S: OutboxStore, C: TimeControl>(
    h: Harness<S, C>,
) {
    let s = &h.store;
    for id in ["order-8", "Order-8", "order-8 "] {
        s.send(vec![msg("q", "x").id(OutboxId::new(id).unwrap())]).await.unwrap();
    }
    assert_eq!(s.counts().await.unwrap().pending, 3, "three ids, three messages");
    let mut ids: Vec<String> =
        s.claim(10, h.unit).await.unwrap().iter().map(|l| l.message.id().to_string()).collect();
    ids.sort();
    assert_eq!(ids, ["Order-8", "order-8", "order-8 "]);
}

/// A send with a message over a limit is refused whole, naming the field.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn bad_messages_are_refused_whole<S: OutboxStore, C: TimeControl>(h: Harness<S, C>) {
    let s = &h.store;
    let e = s.send(vec![msg("q", "ok"), msg("bad\ndest", "x")]).await.unwrap_err();
    assert!(e.to_string().contains("destination"), "{e}");
    let big = Outgoing::new("q", vec![7u8; idem_core::outbox::MAX_PAYLOAD_BYTES + 1]);
    let e = s.send(vec![big]).await.unwrap_err();
    assert!(e.to_string().contains("payload") && e.to_string().contains("1048576"), "{e}");
    assert_eq!(s.counts().await.unwrap().pending, 0, "nothing of a refused send is enqueued");
}

/// A message comes back from a claim as it was sent: id, destination, key, payload, headers.
///
/// # Cancel safety
/// Dropped midway, the case leaves its messages in the harness's outbox, which the
/// harness cleans up.
pub async fn messages_round_trip<S: OutboxStore, C: TimeControl>(h: Harness<S, C>) {
    let s = &h.store;
    let payload: Vec<u8> = (0..=255u8).collect();
    let m = Outgoing::new("orders.accepted", payload.clone())
        .header("content-type", "application/octet-stream")
        .header("trace", "a b \"quoted\" =;,")
        .ordering_key("customer-7");
    let ids = s.send(vec![m]).await.unwrap();
    let got = s.claim(1, h.unit).await.unwrap();
    let p = &got[0].message;
    assert_eq!(p.id(), &ids[0]);
    assert_eq!(p.destination(), "orders.accepted");
    assert_eq!(p.payload(), &payload[..]);
    assert_eq!(p.ordering_key(), Some("customer-7"));
    assert_eq!(p.headers()[1], ("trace".to_owned(), "a b \"quoted\" =;,".to_owned()));
    assert_eq!(got[0].failures, 0);
}

/// Runs every outbox case against a store. The argument is a closure returning a future that
/// yields `Option<Harness>` for a fresh, empty outbox (`None`: its server is unreachable, the
/// case is skipped; see [`service::require`](crate::service::require)).
///
/// ```no_run
/// idem_testkit::outbox_conformance!(|| async {
///     let clock = idem_core::time::ManualClock::new();
///     Some(idem_testkit::Harness::manual(
///         idem_core::outbox::MemoryOutbox::with_clock(clock.clone()), clock))
/// });
/// ```
#[macro_export]
macro_rules! outbox_conformance {
    ($make:expr) => {
        $crate::__outbox_cases!($make;
            claim_leases_exclusively,
            concurrent_claims_are_disjoint,
            ordering_keys_go_one_at_a_time,
            concurrent_relays_keep_key_order,
            failures_retry_then_park,
            unsent_lists_parked_then_pending_rows,
            purge_removes_only_old_sent_rows,
            an_id_is_enqueued_once,
            ids_differing_by_case_or_a_trailing_space_are_apart,
            remove_sent_deletes_only_held_rows,
            bad_messages_are_refused_whole,
            messages_round_trip,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __outbox_cases {
    ($make:expr; $($name:ident),+ $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let Some(harness) = ($make)().await else { return };
                $crate::outbox::$name(harness).await;
            }
        )+
    };
}
