//! An exhaustive model check of the lease and fencing protocol (stateright, breadth first over
//! every interleaving): three consumers, two keys, a store clock that advances so leases run
//! out, consumers that crash mid-handler and lose their lease, takeover with `attempt + 1` and a
//! new fencing token, and completion fenced by token, as `MemoryStore` decides them.
//!
//! The effect is the handler's write to the outside world; it happens before `complete`, so a
//! crash between the two repeats it on the next attempt (at-least-once effects). What the
//! protocol promises is about the store: at most one completion per key is accepted, so at most
//! one effect is *recorded* as the key's outcome. A seeded variant whose `complete` skips the
//! fencing check must break that, and the checker must say so.
//!
//! Not modelled: fingerprints and conflicts, `claim_many`, retention and purge (a record never
//! expires here), operator release, and a store that loses writes — the linearizability test
//! and the conformance suite hold the stores to those.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use stateright::{Checker, HasDiscoveries, Model, Property};

const CONSUMERS: usize = 3;
const KEYS: usize = 2;
/// Lease length in clock ticks.
const LEASE: u8 = 1;
/// The exploration stops at this clock reading and this many claims of one key.
const MAX_CLOCK: u8 = 4;
const MAX_ATTEMPT: u8 = 3;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum RecState {
    Absent,
    InProgress,
    Released,
    Completed,
}

/// A key's record in the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Rec {
    state: RecState,
    /// The fencing token of the latest claim (strictly increasing per key).
    token: u8,
    attempt: u8,
    lease_until: u8,
    /// Completions the store accepted for this key.
    accepted: u8,
    /// Handler effects performed for this key (committed or not).
    effects: u8,
}

/// What a consumer knows: nothing, or the lease it holds and whether its handler ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Local {
    Idle,
    Leased { key: usize, token: u8 },
    Effected { key: usize, token: u8 },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    clock: u8,
    recs: [Rec; KEYS],
    consumers: [Local; CONSUMERS],
    /// Whether a completion was refused with `LeaseLost`.
    refused: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    /// The store's clock advances one tick.
    Tick,
    /// Consumer claims a key (only when the claim acquires; other answers change nothing).
    Claim(usize, usize),
    /// The handler runs the effect.
    Handle(usize),
    /// The consumer completes under its lease.
    Complete(usize),
    /// Transient failure before the effect: the consumer releases.
    Release(usize),
    /// The consumer heartbeats: extends its lease.
    Extend(usize),
    /// The consumer crashes: it forgets its lease, which stays until it runs out.
    Crash(usize),
}

struct Protocol {
    /// The seeded bug: `complete` without the fencing check.
    unfenced_complete: bool,
}

impl Protocol {
    /// A completion the store accepts: the lease's token is the key's latest and the record is
    /// in progress (a lease that ran out but was not taken over may still complete).
    fn accepts(&self, rec: &Rec, token: u8) -> bool {
        self.unfenced_complete || (rec.state == RecState::InProgress && rec.token == token)
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let rec = Rec {
            state: RecState::Absent,
            token: 0,
            attempt: 0,
            lease_until: 0,
            accepted: 0,
            effects: 0,
        };
        vec![State {
            clock: 0,
            recs: [rec; KEYS],
            consumers: [Local::Idle; CONSUMERS],
            refused: false,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        if s.clock < MAX_CLOCK {
            actions.push(Action::Tick);
        }
        for (c, local) in s.consumers.iter().enumerate() {
            match local {
                Local::Idle => {
                    for (k, rec) in s.recs.iter().enumerate() {
                        let claimable = match rec.state {
                            RecState::Absent | RecState::Released => true,
                            RecState::InProgress => rec.lease_until <= s.clock,
                            RecState::Completed => false,
                        };
                        if claimable && rec.attempt < MAX_ATTEMPT {
                            actions.push(Action::Claim(c, k));
                        }
                    }
                }
                Local::Leased { .. } => {
                    actions.extend([
                        Action::Handle(c),
                        Action::Release(c),
                        Action::Extend(c),
                        Action::Crash(c),
                    ]);
                }
                Local::Effected { .. } => {
                    actions.extend([Action::Complete(c), Action::Extend(c), Action::Crash(c)]);
                }
            }
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        match action {
            Action::Tick => n.clock += 1,
            Action::Claim(c, k) => {
                let rec = &mut n.recs[k];
                rec.state = RecState::InProgress;
                rec.token += 1;
                rec.attempt += 1;
                rec.lease_until = s.clock + LEASE;
                n.consumers[c] = Local::Leased { key: k, token: rec.token };
            }
            Action::Handle(c) => {
                let Local::Leased { key, token } = s.consumers[c] else { return None };
                n.recs[key].effects += 1;
                n.consumers[c] = Local::Effected { key, token };
            }
            Action::Complete(c) => {
                let Local::Effected { key, token } = s.consumers[c] else { return None };
                let rec = &mut n.recs[key];
                if self.accepts(rec, token) {
                    rec.state = RecState::Completed;
                    rec.accepted += 1;
                } else {
                    n.refused = true;
                }
                n.consumers[c] = Local::Idle;
            }
            Action::Release(c) => {
                let Local::Leased { key, token } = s.consumers[c] else { return None };
                let rec = &mut n.recs[key];
                if rec.state == RecState::InProgress && rec.token == token {
                    rec.state = RecState::Released;
                }
                n.consumers[c] = Local::Idle;
            }
            Action::Extend(c) => {
                let (Local::Leased { key, token } | Local::Effected { key, token }) =
                    s.consumers[c]
                else {
                    return None;
                };
                let rec = &mut n.recs[key];
                if rec.state == RecState::InProgress && rec.token == token {
                    rec.lease_until = s.clock + LEASE;
                } else {
                    // LeaseLost: the consumer stops (its handler is told the lease is gone).
                    n.consumers[c] = Local::Idle;
                }
            }
            Action::Crash(c) => n.consumers[c] = Local::Idle,
        }
        Some(n)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always("at most one accepted completion per key", |_, s: &State| {
                s.recs.iter().all(|r| r.accepted <= 1)
            }),
            Property::always("a completed key stays completed", |_, s: &State| {
                s.recs.iter().all(|r| r.accepted == 0 || r.state == RecState::Completed)
            }),
            Property::always("every accepted completion had an effect", |_, s: &State| {
                s.recs.iter().all(|r| r.effects >= r.accepted)
            }),
            Property::always(
                "no consumer holds a token the store has not issued",
                |_, s: &State| {
                    s.consumers.iter().all(|l| match l {
                        Local::Idle => true,
                        Local::Leased { key, token } | Local::Effected { key, token } => {
                            *token <= s.recs[*key].token
                        }
                    })
                },
            ),
            Property::always("at most one consumer holds a key's current lease", |_, s: &State| {
                (0..KEYS).all(|k| {
                    let current = s.recs[k].token;
                    s.consumers
                        .iter()
                        .filter(|l| {
                            matches!(l, Local::Leased { key, token } | Local::Effected { key, token }
                                if *key == k && *token == current)
                        })
                        .count()
                        <= 1
                })
            }),
            Property::always("attempt counts the claims (one token per claim)", |_, s: &State| {
                s.recs.iter().all(|r| r.attempt == r.token)
            }),
            // Witnesses that the interesting paths are reached at all.
            Property::sometimes("an effect runs twice (crash, then takeover)", |_, s: &State| {
                s.recs.iter().any(|r| r.effects >= 2)
            }),
            Property::sometimes("a stale completion is refused", |_, s: &State| s.refused),
            Property::sometimes("a key completes on attempt 3", |_, s: &State| {
                s.recs.iter().any(|r| r.state == RecState::Completed && r.attempt == 3)
            }),
        ]
    }
}

/// Consumers are interchangeable: a state with two consumers' local states swapped is the same
/// state (symmetry reduction; stateright applies it in its depth-first search).
fn representative(s: &State) -> State {
    let mut r = s.clone();
    r.consumers.sort_unstable();
    r
}

#[test]
fn fenced_protocol_accepts_one_completion_per_key() {
    let started = Instant::now();
    let checker = Protocol { unfenced_complete: false }
        .checker()
        .symmetry_fn(representative)
        .threads(2)
        .spawn_dfs()
        .join();
    checker.assert_properties();
    eprintln!(
        "fenced protocol: {} states ({} unique), depth {}, {:?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
}

#[test]
fn completion_without_fencing_is_caught() {
    let started = Instant::now();
    let checker = Protocol { unfenced_complete: true }
        .checker()
        .symmetry_fn(representative)
        .finish_when(HasDiscoveries::AnyFailures)
        .spawn_bfs()
        .join();
    let path = checker.assert_any_discovery("at most one accepted completion per key");
    eprintln!(
        "unfenced complete: counterexample after {} states, {:?}:\n{:?}\nlast state: {:?}",
        checker.unique_state_count(),
        started.elapsed(),
        path.clone().into_actions(),
        path.last_state()
    );
}
