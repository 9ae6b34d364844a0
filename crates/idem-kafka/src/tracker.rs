//! Which offset of each partition may be committed: the contiguous prefix of settled messages.

use std::collections::{BTreeMap, HashMap};

type Tp = (String, i32);

#[derive(Debug, Default)]
struct Part {
    /// Offsets polled and not yet part of the durable prefix → settled?
    open: BTreeMap<i64, bool>,
    /// The next offset after the durable prefix (what a commit would store).
    durable: Option<i64>,
    /// The last offset committed.
    committed: Option<i64>,
}

/// Per-partition completion. An offset is committable only when every message polled before it
/// in its partition has settled (processed, duplicate or dead-lettered), however out of order
/// they finished.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    parts: HashMap<Tp, Part>,
}

impl Tracker {
    /// A message was polled.
    pub(crate) fn polled(&mut self, tp: &Tp, offset: i64) {
        let p = self.parts.entry(tp.clone()).or_default();
        if p.durable.is_none_or(|d| offset >= d) {
            p.open.entry(offset).or_insert(false);
        }
    }

    /// A message's outcome is durable.
    pub(crate) fn settled(&mut self, tp: &Tp, offset: i64) {
        let Some(p) = self.parts.get_mut(tp) else { return };
        if let Some(done) = p.open.get_mut(&offset) {
            *done = true;
        }
        while let Some(entry) = p.open.first_entry() {
            if !*entry.get() {
                break;
            }
            p.durable = Some(entry.key() + 1);
            entry.remove();
        }
    }

    /// The partitions whose durable prefix moved past their last commit, with the offset to
    /// commit.
    pub(crate) fn committable(&self) -> Vec<(Tp, i64)> {
        let mut out: Vec<(Tp, i64)> = self
            .parts
            .iter()
            .filter_map(|(tp, p)| {
                let d = p.durable?;
                (p.committed.is_none_or(|c| d > c)).then(|| (tp.clone(), d))
            })
            .collect();
        out.sort();
        out
    }

    /// These offsets were committed.
    pub(crate) fn committed(&mut self, done: &[(Tp, i64)]) {
        for (tp, off) in done {
            if let Some(p) = self.parts.get_mut(tp) {
                p.committed = Some(p.committed.map_or(*off, |c| c.max(*off)));
            }
        }
    }

    /// The partition was revoked: forget it (a new owner starts from the committed offset).
    pub(crate) fn forget(&mut self, tp: &Tp) {
        self.parts.remove(tp);
    }

    /// Messages polled and not settled, over all partitions.
    pub(crate) fn open(&self) -> usize {
        self.parts.values().map(|p| p.open.values().filter(|d| !**d).count()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(p: i32) -> Tp {
        ("t".to_owned(), p)
    }

    #[test]
    fn commits_only_the_contiguous_prefix_when_messages_finish_out_of_order() {
        let mut t = Tracker::default();
        for o in 10..15 {
            t.polled(&tp(0), o);
        }
        t.settled(&tp(0), 12);
        t.settled(&tp(0), 11);
        assert!(t.committable().is_empty(), "10 is still in flight");
        t.settled(&tp(0), 10);
        assert_eq!(t.committable(), vec![(tp(0), 13)]);
        t.committed(&[(tp(0), 13)]);
        assert!(t.committable().is_empty());
        t.settled(&tp(0), 14);
        assert!(t.committable().is_empty(), "13 is still open: nothing new to commit");
        t.settled(&tp(0), 13);
        assert_eq!(t.committable(), vec![(tp(0), 15)]);
        assert_eq!(t.open(), 0);
    }

    #[test]
    fn partitions_are_independent_and_gaps_in_offsets_are_fine() {
        let mut t = Tracker::default();
        t.polled(&tp(0), 5);
        t.polled(&tp(0), 9); // 6..8 were control records, never polled
        t.polled(&tp(1), 0);
        t.settled(&tp(0), 5);
        t.settled(&tp(0), 9);
        assert_eq!(t.committable(), vec![(tp(0), 10)]);
        t.settled(&tp(1), 0);
        assert_eq!(t.committable(), vec![(tp(0), 10), (tp(1), 1)]);
    }

    #[test]
    fn a_retried_message_holds_its_partition_back_and_a_revoked_partition_is_forgotten() {
        let mut t = Tracker::default();
        t.polled(&tp(0), 0);
        t.polled(&tp(0), 1);
        t.polled(&tp(0), 0); // the retry of offset 0 is polled again: no second entry
        t.settled(&tp(0), 1);
        assert!(t.committable().is_empty());
        assert_eq!(t.open(), 1);
        t.forget(&tp(0));
        assert!(t.committable().is_empty());
        assert_eq!(t.open(), 0);
        t.settled(&tp(0), 0); // settling on a forgotten partition changes nothing
        assert!(t.committable().is_empty());
    }
}
