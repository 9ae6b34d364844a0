//! Following rebalances: revocations applied as librdkafka reports them, and commits that
//! never move a group's offset back past another member's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::error::KafkaError;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::source::{ADMIN_TIMEOUT, KafkaSource, State, Tp};

/// Follows rebalances as librdkafka reports them, inside a poll. A pipelined consumer polls
/// for its next batch while it settles the last one on another task, so a revocation is
/// applied to the source's state here, under its lock, at once: a settlement then sees its
/// message's partition either still owned (and a pause it makes is undone by the
/// reassignment below) or already revoked (and makes none). Recorded for the next fetch and
/// applied there instead, a settlement in between paused a partition that had just been
/// reassigned and resumed, then the revocation made the source forget the pause: the
/// partition was never read again (seen under load, `crash_two_phase_mode_postgres`).
pub(crate) struct Ctx {
    state: Arc<Mutex<State>>,
    /// Partitions assigned since the source last looked, with how often a seek to their stored
    /// position was tried.
    pub(crate) assigned: Mutex<Vec<(Tp, u32)>>,
}

impl Ctx {
    pub(crate) fn new(state: Arc<Mutex<State>>) -> Self {
        Self { state, assigned: Mutex::default() }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl ClientContext for Ctx {}

impl ConsumerContext for Ctx {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let revoked: Vec<Tp> =
                tpl.elements().iter().map(|e| (e.topic().to_owned(), e.partition())).collect();
            self.state().revoke(&revoked);
            tracing::info!(target: "idem", partitions = tpl.count(), "partitions revoked");
        }
        if let Rebalance::Assign(tpl) = rebalance {
            let parts: Vec<i32> = tpl.elements().iter().map(|e| e.partition()).collect();
            tracing::debug!(target: "idem", ?parts, "partitions assigned");
        }
    }

    /// Resumes every partition just assigned. librdkafka keeps a partition paused across its
    /// revocation and reassignment to the same member, while the source forgot its pauses at
    /// the revocation (the retry that paused it is no longer this member's to schedule): left
    /// paused, the partition would never be read again. Under the state lock, so no settlement
    /// pauses it between the revocation and here.
    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        let Rebalance::Assign(tpl) = rebalance else { return };
        let mut a = self.assigned.lock().unwrap_or_else(PoisonError::into_inner);
        a.extend(tpl.elements().iter().map(|e| ((e.topic().to_owned(), e.partition()), 0)));
        let _st = self.state();
        if tpl.count() > 0
            && let Err(e) = consumer.resume(tpl)
        {
            tracing::warn!(target: "idem", error = %e, "could not resume the assigned partitions");
        }
    }
}

impl State {
    /// Applies a revocation: forget the partitions' progress so nothing more is committed for
    /// them (the new owner resumes at the committed offset, which is never past a message this
    /// consumer has not settled). Messages of theirs already polled — in a batch or waiting for
    /// a retry — are still processed: the store makes a second processing a duplicate, while
    /// dropping them would lose them if the client resumed past them (seen against tansu when
    /// a partition came back to the same member).
    pub(crate) fn revoke(&mut self, revoked: &[Tp]) {
        self.epoch += 1;
        for tp in revoked {
            self.tracker.forget(tp);
            self.paused.remove(tp);
            self.verified.remove(tp);
            self.next_from.remove(tp);
            self.bridges.remove(tp);
            self.reread_below.remove(tp);
            let e = self.epoch;
            self.revoked_at.insert(tp.clone(), e);
        }
    }
}

impl KafkaSource {
    /// Commits every partition's durable prefix (synchronously, on a blocking thread). `false`
    /// when the commit failed; the offsets stay pending for the next one.
    ///
    /// A commit never
    /// moves a group's offset backwards as far as this member can see: the first commit of a
    /// partition after its assignment, and every commit at close, reads the group's committed
    /// offsets first (one round trip) and leaves out a partition whose group offset is past
    /// this member's. That happens only when another member consumed the partition meanwhile,
    /// which a broker that fences stale members' commits (Kafka) never allows, and one that does
    /// not (tansu 0.6.0 after a restart) does: without the check the stale member's commit
    /// hands the partition's messages back.
    pub(crate) async fn commit(&self, consumer: &Arc<StreamConsumer<Ctx>>, closing: bool) -> bool {
        let (due, check) = {
            let st = self.state();
            let due = st.tracker.committable();
            let check: Vec<Tp> = due
                .iter()
                .filter(|(tp, _)| closing || !st.verified.contains(tp))
                .map(|(tp, _)| tp.clone())
                .collect();
            (due, check)
        };
        if due.is_empty() {
            return true;
        }
        let c = Arc::clone(consumer);
        let r = tokio::task::spawn_blocking(move || {
            let group = if check.is_empty() {
                None
            } else {
                let mut tpl = TopicPartitionList::new();
                for tp in &check {
                    tpl.add_partition(&tp.0, tp.1);
                }
                match c.committed_offsets(tpl, ADMIN_TIMEOUT) {
                    Ok(got) => Some(
                        got.elements()
                            .iter()
                            .filter_map(|e| match e.offset() {
                                Offset::Offset(o) => {
                                    Some(((e.topic().to_owned(), e.partition()), o))
                                }
                                _ => None,
                            })
                            .collect::<HashMap<Tp, i64>>(),
                    ),
                    Err(e) => {
                        // Not knowing is no reason to hold every offset back: commit as a
                        // broker that fences would want.
                        tracing::debug!(target: "idem", error = %e,
                            "could not read the group's committed offsets; committing unchecked");
                        None
                    }
                }
            };
            let (commit, ahead) = match &group {
                Some(group) => not_behind(&due, group),
                None => (due, Vec::new()),
            };
            let mut tpl = TopicPartitionList::new();
            for ((topic, p), off) in &commit {
                tpl.add_partition_offset(topic, *p, Offset::Offset(*off))?;
            }
            if !commit.is_empty() {
                c.commit(&tpl, CommitMode::Sync)?;
            }
            let checked: Vec<Tp> = if group.is_some() { check } else { Vec::new() };
            Ok::<_, KafkaError>((commit, ahead, checked))
        })
        .await;
        match r {
            Ok(Ok((done, ahead, checked))) => {
                for ((topic, p), ours, theirs) in &ahead {
                    tracing::warn!(target: "idem", %topic, partition = p, ours, theirs,
                        "the group's committed offset is past this member's: another member \
                         consumed the partition (a broker that does not fence stale members); \
                         not committed");
                }
                if !done.is_empty() {
                    tracing::debug!(target: "idem", offsets = ?done, "offsets committed");
                }
                let mut st = self.state();
                st.tracker.committed(&done);
                for tp in checked {
                    if !ahead.iter().any(|(a, _, _)| *a == tp) {
                        st.verified.insert(tp);
                    }
                }
                true
            }
            Ok(Err(e)) => {
                tracing::warn!(target: "idem", error = %e, "offset commit failed; retried with the next batch");
                false
            }
            Err(e) => {
                tracing::warn!(target: "idem", error = %e, "offset commit task failed");
                false
            }
        }
    }
}

/// A partition left out of a commit: (partition, this member's offset, the group's).
type Ahead = (Tp, i64, i64);

/// Splits `due` into the offsets to commit and the partitions whose group offset (`group`) is
/// already past ours, as (partition, ours, theirs). A partition the group has no offset for is
/// committed.
fn not_behind(due: &[(Tp, i64)], group: &HashMap<Tp, i64>) -> (Vec<(Tp, i64)>, Vec<Ahead>) {
    let mut commit = Vec::with_capacity(due.len());
    let mut ahead = Vec::new();
    for (tp, ours) in due {
        match group.get(tp) {
            Some(&theirs) if theirs > *ours => ahead.push((tp.clone(), *ours, theirs)),
            _ => commit.push((tp.clone(), *ours)),
        }
    }
    (commit, ahead)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(p: i32) -> Tp {
        ("t".to_owned(), p)
    }

    #[test]
    fn a_partition_whose_group_offset_is_ahead_is_left_out() {
        let due = vec![(tp(0), 32), (tp(1), 100), (tp(2), 7)];
        let group: HashMap<Tp, i64> = [(tp(0), 2000), (tp(1), 100)].into_iter().collect();
        let (commit, ahead) = not_behind(&due, &group);
        assert_eq!(commit, vec![(tp(1), 100), (tp(2), 7)], "level, or no group offset: committed");
        assert_eq!(ahead, vec![(tp(0), 32, 2000)]);
    }
}
