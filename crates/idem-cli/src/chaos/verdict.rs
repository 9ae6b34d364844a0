//! The verdict: what was published against what the ledger and the dead-letter queue hold.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::Duration;

/// The two bodies one id can be published with.
pub(crate) const ORIGINAL: &str = "original";
/// A later message reusing an id with another body: must be dead-lettered, never applied.
pub(crate) const REUSED: &str = "reused";
/// A message whose handler aborts the worker process (`--poison`): must be dead-lettered as a
/// crash loop, never applied.
pub(crate) const POISON: &str = "poison";

/// One row of the ledger: a handler's effect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Effect {
    pub(crate) id: String,
    /// [`ORIGINAL`] or [`REUSED`], from the payload the handler ran on.
    pub(crate) body: String,
    /// The idem attempt in two-phase mode (the inbox has none: its marker commits with the row).
    pub(crate) attempt: Option<u32>,
}

/// What the run did besides messages.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Events {
    pub(crate) kills: u64,
    /// Of the kills, those of the push-mode application.
    pub(crate) app_kills: u64,
    pub(crate) stalls: u64,
    /// Workers that ended by themselves (an error), replaced like killed ones.
    pub(crate) worker_exits: u64,
    /// Messages still in the broker after the workers stopped.
    pub(crate) left_in_broker: u64,
    pub(crate) wall: Duration,
    /// The longest time the run saw no progress (see `--timeout`).
    pub(crate) longest_idle: Duration,
    /// Nothing progressed for `--timeout`: the run gave up.
    pub(crate) timed_out: bool,
}

/// The table's numbers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Tally {
    pub(crate) attempted: u64,
    pub(crate) unique: u64,
    pub(crate) reused: u64,
    pub(crate) poison: u64,
    pub(crate) effects: u64,
    pub(crate) lost: u64,
    pub(crate) duplicated: u64,
    pub(crate) reruns_after_takeover: u64,
    pub(crate) unexpected: u64,
    pub(crate) dead_letters: u64,
    /// Poison ids found in the dead-letter queue.
    pub(crate) crash_loops: u64,
}

/// The ids published, by what must become of them.
pub(crate) struct Published<'a> {
    /// Every id published with its original body (the poison ids are not among them).
    pub(crate) unique: &'a HashSet<String>,
    /// Ids also published with another body: dead-lettered as conflicts.
    pub(crate) reused: &'a HashSet<String>,
    /// Ids whose handler aborts the worker: dead-lettered as crash loops.
    pub(crate) poison: &'a HashSet<String>,
}

impl Tally {
    /// Counts what became of `published`; `dead_letters` holds the distinct ids in the
    /// dead-letter queue.
    pub(crate) fn count(
        attempted: u64,
        published: &Published<'_>,
        effects: &[Effect],
        dead_letters: &HashSet<String>,
    ) -> Self {
        let (unique, reused) = (published.unique, published.reused);
        let mut per_id: HashMap<&str, u64> = HashMap::new();
        let mut per_attempt: HashMap<(&str, u32), u64> = HashMap::new();
        let mut unexpected = 0;
        for e in effects {
            if !unique.contains(&e.id) || e.body != ORIGINAL {
                unexpected += 1;
                continue;
            }
            *per_id.entry(e.id.as_str()).or_default() += 1;
            if let Some(a) = e.attempt {
                *per_attempt.entry((e.id.as_str(), a)).or_default() += 1;
            }
        }
        let two_phase = effects.iter().any(|e| e.attempt.is_some());
        let (duplicated, reruns) = if two_phase {
            // The same attempt twice is a duplicate; another attempt after a takeover is a
            // rerun, which the downstream idempotency key (scope, id, attempt-independent)
            // makes safe.
            let dup: u64 = per_attempt.values().map(|n| n - 1).sum();
            let extra: u64 = per_id.values().map(|n| n - 1).sum();
            (dup, extra - dup)
        } else {
            (per_id.values().map(|n| n - 1).sum(), 0)
        };
        Self {
            attempted,
            unique: unique.len() as u64,
            reused: reused.len() as u64,
            poison: published.poison.len() as u64,
            effects: effects.len() as u64,
            lost: unique.iter().filter(|id| !per_id.contains_key(id.as_str())).count() as u64,
            duplicated,
            reruns_after_takeover: reruns,
            unexpected,
            dead_letters: dead_letters.len() as u64,
            crash_loops: published.poison.iter().filter(|id| dead_letters.contains(*id)).count()
                as u64,
        }
    }

    /// Whether the run proves nothing wrong: no lost, duplicated or unexpected effect, every
    /// reused id dead-lettered and every poison id dead-lettered as a crash loop.
    pub(crate) fn passed(&self) -> bool {
        self.lost == 0
            && self.duplicated == 0
            && self.unexpected == 0
            && self.crash_loops == self.poison
            && self.dead_letters == self.reused + self.poison
    }
}

/// The printed table.
pub(crate) struct Table<'a> {
    pub(crate) tally: &'a Tally,
    pub(crate) events: &'a Events,
    /// Push mode: poison is refused by the application (4xx), not a crash.
    pub(crate) push: bool,
}

impl fmt::Display for Table<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (t, e) = (self.tally, self.events);
        let flag = |bad: bool| if bad { "  <-- FAIL" } else { "" };
        let mut rows: Vec<(&str, String, &str)> = vec![
            ("attempted", t.attempted.to_string(), ""),
            ("unique", t.unique.to_string(), ""),
            ("reused (other body)", t.reused.to_string(), ""),
            (
                if self.push { "poison (HTTP 422)" } else { "poison (abort)" },
                t.poison.to_string(),
                "",
            ),
            ("effects", t.effects.to_string(), ""),
            ("lost", t.lost.to_string(), flag(t.lost > 0)),
            ("duplicated", t.duplicated.to_string(), flag(t.duplicated > 0)),
            ("reruns after takeover", t.reruns_after_takeover.to_string(), ""),
            ("unexpected", t.unexpected.to_string(), flag(t.unexpected > 0)),
            (
                "dead letters",
                t.dead_letters.to_string(),
                flag(t.dead_letters != t.reused + t.poison),
            ),
            (
                if self.push { "4xx dead-lettered" } else { "crash loops" },
                t.crash_loops.to_string(),
                flag(t.crash_loops != t.poison),
            ),
            ("kills", e.kills.to_string(), ""),
            ("application kills", e.app_kills.to_string(), ""),
            ("stalls", e.stalls.to_string(), ""),
            ("worker exits", e.worker_exits.to_string(), ""),
            ("left in broker", e.left_in_broker.to_string(), ""),
            (
                "longest no progress",
                format!("{:.1} s", e.longest_idle.as_secs_f64()),
                flag(e.timed_out),
            ),
            ("wall time", format!("{:.1} s", e.wall.as_secs_f64()), ""),
        ];
        if !self.push {
            rows.retain(|(name, _, _)| *name != "application kills");
        }
        for (name, value, note) in rows {
            writeln!(f, "{name:<22} {value:>10}{note}")?;
        }
        let verdict = if t.passed() && !e.timed_out { "PASS" } else { "FAIL" };
        write!(f, "{:<22} {verdict:>10}", "verdict")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[&str]) -> HashSet<String> {
        ids.iter().map(|s| (*s).to_owned()).collect()
    }

    fn count(
        attempted: u64,
        unique: &HashSet<String>,
        reused: &HashSet<String>,
        effects: &[Effect],
        dead: &HashSet<String>,
    ) -> Tally {
        let poison = HashSet::new();
        Tally::count(attempted, &Published { unique, reused, poison: &poison }, effects, dead)
    }

    fn fx(id: &str, body: &str, attempt: Option<u32>) -> Effect {
        Effect { id: id.into(), body: body.into(), attempt }
    }

    #[test]
    fn exactly_once_passes() {
        let effects = [fx("a", ORIGINAL, None), fx("b", ORIGINAL, None)];
        let t = count(4, &set(&["a", "b"]), &set(&["b"]), &effects, &set(&["b"]));
        assert_eq!((t.lost, t.duplicated, t.unexpected, t.dead_letters), (0, 0, 0, 1));
        assert!(t.passed());
    }

    #[test]
    fn inbox_counts_lost_duplicated_and_unexpected() {
        let effects = [
            fx("a", ORIGINAL, None),
            fx("a", ORIGINAL, None),
            fx("b", REUSED, None),
            fx("zz", ORIGINAL, None),
        ];
        let t = count(5, &set(&["a", "b", "c"]), &set(&["b"]), &effects, &set(&[]));
        assert_eq!((t.lost, t.duplicated, t.unexpected), (2, 1, 2));
        assert!(!t.passed());
    }

    #[test]
    fn two_phase_separates_reruns_from_duplicates() {
        let effects = [
            fx("a", ORIGINAL, Some(1)),
            fx("a", ORIGINAL, Some(2)),
            fx("b", ORIGINAL, Some(1)),
            fx("b", ORIGINAL, Some(1)),
        ];
        let t = count(2, &set(&["a", "b"]), &set(&[]), &effects, &set(&[]));
        assert_eq!((t.duplicated, t.reruns_after_takeover), (1, 1));
        assert!(!t.passed());
    }

    #[test]
    fn poison_must_be_dead_lettered_and_never_applied() {
        let (unique, reused, poison) = (set(&["a"]), set(&[]), set(&["p"]));
        let published = Published { unique: &unique, reused: &reused, poison: &poison };
        let ok = Tally::count(2, &published, &[fx("a", ORIGINAL, Some(1))], &set(&["p"]));
        assert_eq!((ok.crash_loops, ok.lost), (1, 0));
        assert!(ok.passed());
        let missing = Tally::count(2, &published, &[fx("a", ORIGINAL, Some(1))], &set(&[]));
        assert!(!missing.passed());
        let applied = [fx("a", ORIGINAL, Some(1)), fx("p", POISON, Some(1))];
        let applied = Tally::count(2, &published, &applied, &set(&["p"]));
        assert_eq!(applied.unexpected, 1);
        assert!(!applied.passed());
    }

    #[test]
    fn missing_dead_letter_fails() {
        let t = count(2, &set(&["a"]), &set(&["a"]), &[fx("a", ORIGINAL, None)], &set(&[]));
        assert!(!t.passed());
    }
}
