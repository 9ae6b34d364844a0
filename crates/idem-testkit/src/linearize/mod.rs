//! Linearizability checking: concurrent histories against a sequential model.
//!
//! A *history* is what concurrent callers saw: each operation with the instant it was called,
//! the instant it returned and its answer. The history is *linearizable* when the operations can
//! be put in one order that (1) respects real time — an operation that returned before another
//! was called comes first — and (2) gives every answer the sequential [`Model`] gives. [`check`]
//! searches for such an order the way Wing and Gong's algorithm does, depth first over the
//! operations that may come next, and memoises each (model state, set of operations done) it
//! has already found to be a dead end, as Lowe's refinement does, so a history of a few dozen
//! operations is decided in microseconds.
//!
//! An operation whose answer was lost (the call failed with a backend error, so its effect may
//! or may not have happened) has no return instant: it may take effect at any point after its
//! call, with whatever answer the model gives, or never.
//!
//! [`model`] is the sequential contract of [`DedupStore`](idem_core::DedupStore) and
//! [`run`] generates concurrent histories against a real store and checks them.

pub mod model;
pub mod run;

pub use model::{Answer, LeaseId, StoreModel, StoreOp, StoreRet};
pub use run::{Batches, Config, Summary, Violation, check_store};

use std::collections::HashSet;
use std::hash::Hash;
use std::time::Instant;

/// A sequential specification: a deterministic state machine whose steps say which answers an
/// operation may give.
pub trait Model {
    /// The state; hashed for the memo.
    type State: Clone + Eq + Hash;
    /// An operation, as called.
    type Op;
    /// An answer, as returned.
    type Ret;

    /// The state before any operation.
    fn init(&self) -> Self::State;

    /// Applies operation number `id` of the history to `state`. With `ret` given, returns the
    /// next state only if the model answers `ret`; with `None` (the answer was lost), returns
    /// the next state whatever the answer.
    fn step(
        &self,
        state: &Self::State,
        id: usize,
        op: &Self::Op,
        ret: Option<&Self::Ret>,
    ) -> Option<Self::State>;
}

/// One operation of a history.
#[derive(Debug, Clone)]
pub struct Entry<O, R> {
    /// Which caller ran it (operations of one caller never overlap).
    pub task: usize,
    /// What was called.
    pub op: O,
    /// When it was called.
    pub call: Instant,
    /// When it returned and what it answered; `None` when the answer was lost.
    pub ret: Option<(Instant, R)>,
}

/// What [`check`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// An order of the history's indices that explains every answer, or `None`.
    pub order: Option<Vec<usize>>,
    /// The longest prefix of an order the search reached (the closest miss, when there is no
    /// order).
    pub longest: Vec<usize>,
    /// (state, done set) pairs visited.
    pub explored: usize,
}

impl Verdict {
    /// Whether the history is linearizable.
    pub fn is_linearizable(&self) -> bool {
        self.order.is_some()
    }
}

/// Largest history [`check`] accepts (the set of operations done is a `u64`).
pub const MAX_OPS: usize = 64;

/// Searches for a linearization of `history` under `model`.
///
/// # Panics
/// When the history has more than [`MAX_OPS`] operations.
pub fn check<M: Model>(model: &M, history: &[Entry<M::Op, M::Ret>]) -> Verdict {
    assert!(history.len() <= MAX_OPS, "at most {MAX_OPS} operations per history");
    let mut search = Search {
        model,
        history,
        memo: HashSet::new(),
        path: Vec::with_capacity(history.len()),
        longest: Vec::new(),
    };
    let required: u64 = history
        .iter()
        .enumerate()
        .filter(|(_, e)| e.ret.is_some())
        .fold(0, |acc, (i, _)| acc | (1 << i));
    let found = search.dfs(&model.init(), 0, required);
    Verdict {
        order: found.then(|| search.path.clone()),
        longest: search.longest,
        explored: search.memo.len(),
    }
}

struct Search<'a, M: Model> {
    model: &'a M,
    history: &'a [Entry<M::Op, M::Ret>],
    memo: HashSet<(M::State, u64)>,
    path: Vec<usize>,
    longest: Vec<usize>,
}

impl<M: Model> Search<'_, M> {
    fn dfs(&mut self, state: &M::State, done: u64, required: u64) -> bool {
        if done & required == required {
            return true;
        }
        if !self.memo.insert((state.clone(), done)) {
            return false;
        }
        // An operation may come next only if no pending operation returned before it was
        // called; lost answers never returned, so they bound nothing.
        let horizon = self
            .history
            .iter()
            .enumerate()
            .filter(|(i, _)| done & (1 << i) == 0)
            .filter_map(|(_, e)| e.ret.as_ref().map(|(at, _)| *at))
            .min();
        for (i, e) in self.history.iter().enumerate() {
            if done & (1 << i) != 0 || horizon.is_some_and(|h| e.call > h) {
                continue;
            }
            let Some(next) = self.model.step(state, i, &e.op, e.ret.as_ref().map(|(_, r)| r))
            else {
                continue;
            };
            self.path.push(i);
            if self.path.len() > self.longest.len() {
                self.longest.clone_from(&self.path);
            }
            if self.dfs(&next, done | (1 << i), required) {
                return true;
            }
            self.path.pop();
        }
        false
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::time::Duration;

    /// A register: write v → (), read → v.
    struct Register;

    #[derive(Debug)]
    enum RegOp {
        Write(u8),
        Read,
    }

    impl Model for Register {
        type State = u8;
        type Op = RegOp;
        type Ret = u8;
        fn init(&self) -> u8 {
            0
        }
        fn step(&self, s: &u8, _: usize, op: &RegOp, ret: Option<&u8>) -> Option<u8> {
            match op {
                RegOp::Write(v) => Some(*v),
                RegOp::Read => ret.is_none_or(|r| r == s).then_some(*s),
            }
        }
    }

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    fn e(
        task: usize,
        op: RegOp,
        t0: Instant,
        call: u64,
        ret: Option<(u64, u8)>,
    ) -> Entry<RegOp, u8> {
        Entry { task, op, call: at(t0, call), ret: ret.map(|(t, r)| (at(t0, t), r)) }
    }

    #[test]
    fn overlapping_write_may_be_seen_or_not() {
        let t0 = Instant::now();
        let h = vec![
            e(0, RegOp::Write(1), t0, 0, Some((10, 0))),
            e(1, RegOp::Read, t0, 1, Some((2, 0))),
            e(2, RegOp::Read, t0, 3, Some((4, 1))),
        ];
        let v = check(&Register, &h);
        assert_eq!(v.order, Some(vec![1, 0, 2]));
    }

    #[test]
    fn stale_read_after_write_returned_is_caught() {
        let t0 = Instant::now();
        let h = vec![
            e(0, RegOp::Write(1), t0, 0, Some((1, 0))),
            e(1, RegOp::Read, t0, 2, Some((3, 0))),
        ];
        let v = check(&Register, &h);
        assert!(!v.is_linearizable());
        assert_eq!(v.longest, vec![0]);
    }

    #[test]
    fn lost_answer_may_apply_late_or_never() {
        let t0 = Instant::now();
        let late = vec![
            e(0, RegOp::Write(1), t0, 0, None),
            e(1, RegOp::Read, t0, 5, Some((6, 0))),
            e(1, RegOp::Read, t0, 7, Some((8, 1))),
        ];
        assert!(check(&Register, &late).is_linearizable());
        let never =
            vec![e(0, RegOp::Write(1), t0, 0, None), e(1, RegOp::Read, t0, 5, Some((6, 0)))];
        assert!(check(&Register, &never).is_linearizable());
    }
}
