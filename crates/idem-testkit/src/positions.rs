//! The offset-inbox contract ([`TxPositions`]), one case per promise, run against every SQL
//! inbox by [`tx_positions_conformance!`](crate::tx_positions_conformance).
//!
//! The cases decide batches of log deliveries built by hand ([`LogMessage`], no broker) through
//! the engine a Kafka consumer drives (`Engine<OffsetInbox<_>>::decide_batch`) and check the
//! database: the harness's ledger (no unique key: a second effect is a second row) and the
//! committed positions. Two cases hold the primitives to the contract directly: a locked
//! position row makes a second locker wait, and a position never moves back.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failure is the test failing

use std::sync::Arc;
use std::time::Duration;

use idem_core::engine::HandlerError;
use idem_core::extract::{Envelope, LogPosition};
use idem_core::inbox::{OffsetInbox, PositionReader, Tx, TxInbox, TxPositions};
use idem_core::{Engine, Outcome, OutcomeKind};

use crate::inbox::InboxHarness;

const SCOPE: &str = "offsets";

/// A delivery of an ordered log, built by hand: message id `id`, at `offset` of
/// `log`/`partition`, read right after `from` (see [`LogPosition::from`]).
#[derive(Debug, Clone)]
pub struct LogMessage {
    /// The message id (the dedup key).
    pub id: String,
    /// The body: `fail` makes the suite's handler fail after writing, `hang` never answer.
    pub body: &'static str,
    /// The log (topic).
    pub log: String,
    /// The partition.
    pub partition: i32,
    /// The offset.
    pub offset: i64,
    /// Where the reading of the partition continued from.
    pub from: Option<i64>,
}

impl LogMessage {
    /// Offset `offset` of `log`/`partition` with id `<log>-<partition>-<offset>`, read right
    /// after the message before it.
    pub fn at(log: &str, partition: i32, offset: i64) -> Self {
        Self {
            id: format!("{log}-{partition}-{offset}"),
            body: "ok",
            log: log.to_owned(),
            partition,
            offset,
            from: Some(offset),
        }
    }

    /// With another body.
    #[must_use]
    pub fn body(mut self, body: &'static str) -> Self {
        self.body = body;
        self
    }

    /// With another message id.
    #[must_use]
    pub fn id(mut self, id: &str) -> Self {
        id.clone_into(&mut self.id);
        self
    }

    /// Read from `from` (`None`: unknown, as after a new assignment).
    #[must_use]
    pub fn from(mut self, from: Option<i64>) -> Self {
        self.from = from;
        self
    }
}

impl Envelope for LogMessage {
    fn payload(&self) -> &[u8] {
        self.body.as_bytes()
    }
    fn message_id(&self) -> Option<&str> {
        Some(&self.id)
    }
    fn header(&self, _: &str) -> Option<&str> {
        None
    }
    fn log_position(&self) -> Option<LogPosition<'_>> {
        Some(LogPosition::new(&self.log, self.partition, self.offset).read_from(self.from))
    }
}

/// `n` messages of `log`/`partition` from `start`, each read right after the one before it
/// (the first from `first_from`).
fn run_of(
    log: &str,
    partition: i32,
    start: i64,
    n: i64,
    first_from: Option<i64>,
) -> Vec<LogMessage> {
    (start..start + n)
        .map(|o| {
            let m = LogMessage::at(log, partition, o);
            if o == start { m.from(first_from) } else { m }
        })
        .collect()
}

fn engine<H: InboxHarness>(h: &H, markers: bool) -> Engine<OffsetInbox<H::Inbox>>
where
    H::Inbox: TxPositions,
{
    let inbox = OffsetInbox::new(h.inbox());
    let inbox = if markers { inbox } else { inbox.without_markers() };
    Engine::builder(inbox).scope(SCOPE).build().unwrap()
}

/// Decides `batch`: each run writes one ledger row for its message id, then fails (`fail`),
/// hangs (`hang`) or succeeds.
async fn decide<H: InboxHarness>(
    h: &Arc<H>,
    e: &Engine<OffsetInbox<H::Inbox>>,
    batch: &[LogMessage],
) -> Vec<OutcomeKind>
where
    H::Inbox: TxPositions,
{
    let handler = |mut tx: Tx<H::Inbox>, m: LogMessage| {
        let h = Arc::clone(h);
        async move {
            h.write(&mut tx, &m.id).await.map_err(|e| HandlerError::Transient(e.to_string()))?;
            match m.body {
                "fail" => Err(HandlerError::Transient("refused".to_owned())),
                "hang" => std::future::pending().await,
                _ => Ok(()),
            }
        }
    };
    let outs: Vec<Outcome<(), String>> = e.decide_batch(batch, &handler).await;
    outs.iter().map(Outcome::kind).collect()
}

/// The committed positions of `partitions` of log `t`.
async fn positions<I: TxPositions>(
    e: &Engine<OffsetInbox<I>>,
    partitions: &[i32],
) -> Vec<Option<i64>> {
    let parts: Vec<(String, i32)> = partitions.iter().map(|p| ("t".to_owned(), *p)).collect();
    PositionReader::read(e.store(), SCOPE, &parts).await.unwrap()
}

use OutcomeKind::{Duplicate as D, FailedTransient as W, Processed as P};

/// Every message's effect once; a redelivery from an older offset is a duplicate by its
/// offset alone, and the next message after the stored position runs.
pub async fn exactly_once_and_a_redelivery_is_known_by_its_offset<H: InboxHarness>(h: H)
where
    H::Inbox: TxPositions,
{
    let h = Arc::new(h);
    let e = engine(&*h, true);
    let mut batch = run_of("t", 0, 0, 5, None);
    batch.extend(run_of("t", 1, 0, 3, None));
    assert_eq!(decide(&h, &e, &batch).await, [P; 8]);
    // The group resumes from an older offset (a new assignment: `from` unknown).
    assert_eq!(decide(&h, &e, &run_of("t", 0, 2, 3, None)).await, [D; 3]);
    assert_eq!(decide(&h, &e, &run_of("t", 0, 5, 1, Some(5))).await, [P]);
    assert_eq!(h.ledger_rows().await, 9);
    assert_eq!(positions(&e, &[0, 1]).await, [Some(6), Some(3)]);
}

/// A process that dies before the commit leaves neither writes nor a moved position; the
/// redelivery runs each message once.
pub async fn a_crash_before_the_commit_leaves_nothing_and_the_redelivery_runs_once<
    H: InboxHarness,
>(
    h: H,
) where
    H::Inbox: TxPositions,
{
    let h = Arc::new(h);
    let e = engine(&*h, false);
    let mut batch = run_of("t", 0, 0, 3, None);
    batch.push(LogMessage::at("t", 0, 3).body("hang"));
    // The process dies while the last handler runs: the transaction is dropped.
    let crashed = tokio::time::timeout(Duration::from_secs(2), decide(&h, &e, &batch));
    assert!(crashed.await.is_err());
    assert_eq!(h.ledger_rows().await, 0, "nothing committed");
    assert_eq!(positions(&e, &[0]).await, [None]);
    let redelivered = run_of("t", 0, 0, 4, None);
    assert_eq!(decide(&h, &e, &redelivered).await, [P; 4]);
    // The broker's offset was never committed: it delivers all four again.
    assert_eq!(decide(&h, &e, &redelivered).await, [D; 4]);
    assert_eq!(h.ledger_rows().await, 4);
}

/// A failed message holds back the later messages of its partition (never the other
/// partitions), and its failed run leaves no write.
pub async fn a_failed_message_holds_its_partition_back_not_the_others<H: InboxHarness>(h: H)
where
    H::Inbox: TxPositions,
{
    let h = Arc::new(h);
    let e = engine(&*h, true);
    let mut batch = run_of("t", 0, 0, 4, None);
    batch[1] = LogMessage::at("t", 0, 1).body("fail");
    batch.extend(run_of("t", 1, 0, 2, None));
    assert_eq!(decide(&h, &e, &batch).await, [P, W, W, W, P, P], "1 failed; 2 and 3 wait");
    assert_eq!(positions(&e, &[0]).await, [Some(1)]);
    // 3 comes back alone (retried sooner): it still waits for 1.
    assert_eq!(decide(&h, &e, &batch[3..4]).await, [W]);
    // 1 succeeds on its retry; then 2 and 3 run, in offset order.
    let rev: Vec<LogMessage> = run_of("t", 0, 1, 3, Some(1)).into_iter().rev().collect();
    assert_eq!(decide(&h, &e, &rev).await, [P; 3]);
    assert_eq!(h.ledger_rows().await, 6, "the failed runs rolled back");
    assert_eq!(positions(&e, &[0]).await, [Some(4)]);
}

/// A producer's duplicate (the same id at a later offset, in another partition, twice in one
/// batch) is a duplicate while markers are kept, and duplicates move the positions too.
pub async fn a_producer_duplicate_is_caught_by_markers_in_their_window<H: InboxHarness>(h: H)
where
    H::Inbox: TxPositions,
{
    let h = Arc::new(h);
    let e = engine(&*h, true);
    assert_eq!(decide(&h, &e, &run_of("t", 0, 0, 1, None)).await, [P]);
    let copy = |p: i32, o: i64| LogMessage::at("t", p, o).id("t-0-0");
    let batch = vec![copy(0, 1), copy(1, 0).from(None), copy(0, 2)];
    assert_eq!(decide(&h, &e, &batch).await, [D, D, D]);
    assert_eq!(h.ledger_rows().await, 1);
    assert_eq!(positions(&e, &[0, 1]).await, [Some(3), Some(1)]);
}

/// A key repeated in one batch, first seen in it: the first copy runs, the later copies are
/// its duplicates, and the messages between and after them run in order.
pub async fn a_key_repeated_in_a_batch_runs_once<H: InboxHarness>(h: H)
where
    H::Inbox: TxPositions,
{
    let h = Arc::new(h);
    let e = engine(&*h, true);
    let mut batch = run_of("t", 0, 0, 5, None);
    batch[3] = LogMessage::at("t", 0, 3).id("t-0-1");
    assert_eq!(decide(&h, &e, &batch).await, [P, P, P, D, P]);
    assert_eq!(h.ledger_rows().await, 4);
    assert_eq!(positions(&e, &[0]).await, [Some(5)]);
}

/// Without markers only offsets are known: a message published twice runs twice (what the
/// docs say an idempotent producer must prevent).
pub async fn without_markers_a_republished_message_runs_twice<H: InboxHarness>(h: H)
where
    H::Inbox: TxPositions,
{
    let h = Arc::new(h);
    let e = engine(&*h, false);
    assert_eq!(decide(&h, &e, &run_of("t", 0, 0, 1, None)).await, [P]);
    let republished = LogMessage::at("t", 0, 1).id("t-0-0");
    assert_eq!(decide(&h, &e, &[republished]).await, [P]);
    assert_eq!(h.ledger_rows().await, 2, "the producer must be idempotent");
}

/// The primitives: a second transaction locking a position row waits for the first, and
/// sees what it committed; `advance` never moves a position back; `read_positions` reads
/// only what is committed.
pub async fn a_locked_position_waits_and_never_moves_back<H: InboxHarness>(h: H)
where
    H::Inbox: TxPositions,
{
    let inbox = h.inbox();
    let part = [("t", 0)];
    let mut first = inbox.begin().await.unwrap();
    let conn = <H::Inbox as TxInbox>::connection(&mut first);
    assert_eq!(inbox.lock_positions(conn, SCOPE, &part).await.unwrap(), [None]);
    inbox.advance(conn, SCOPE, &[(("t", 0), 7)]).await.unwrap();
    assert_eq!(inbox.read_positions(SCOPE, &part).await.unwrap(), [None], "not committed yet");
    let second = {
        let inbox = inbox.clone();
        tokio::spawn(async move {
            let mut tx = inbox.begin().await.unwrap();
            let conn = <H::Inbox as TxInbox>::connection(&mut tx);
            let seen = inbox.lock_positions(conn, SCOPE, &[("t", 0)]).await.unwrap();
            // Behind the stored position: must not move it back.
            inbox.advance(conn, SCOPE, &[(("t", 0), 3)]).await.unwrap();
            inbox.commit(tx).await.unwrap();
            seen
        })
    };
    h.wait_until_blocked().await;
    assert!(!second.is_finished(), "the second locker did not wait");
    inbox.commit(first).await.unwrap();
    assert_eq!(second.await.unwrap(), [Some(7)], "the second locker saw the first's commit");
    assert_eq!(inbox.read_positions(SCOPE, &part).await.unwrap(), [Some(7)]);
}

/// Runs the offset-inbox conformance suite against an [`InboxHarness`] whose inbox is also
/// [`TxPositions`]: `$make` is an async fn (or closure) returning `Option<H>` (`None` skips,
/// when the database is unreachable and `CI` is not set).
///
/// ```ignore
/// idem_testkit::tx_positions_conformance!(harness);
/// ```
#[macro_export]
macro_rules! tx_positions_conformance {
    ($make:expr) => {
        $crate::__positions_cases!($make;
            exactly_once_and_a_redelivery_is_known_by_its_offset,
            a_crash_before_the_commit_leaves_nothing_and_the_redelivery_runs_once,
            a_failed_message_holds_its_partition_back_not_the_others,
            a_producer_duplicate_is_caught_by_markers_in_their_window,
            a_key_repeated_in_a_batch_runs_once,
            without_markers_a_republished_message_runs_twice,
            a_locked_position_waits_and_never_moves_back,
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __positions_cases {
    ($make:expr; $($name:ident),+ $(,)?) => {
        mod positions {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(harness) = ($make)().await else { return };
                    $crate::positions::$name(harness).await;
                }
            )+
        }
    };
}
