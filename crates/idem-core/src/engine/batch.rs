//! The batch skeleton, written once for every mode: prepare every message, decide rounds of
//! distinct keys, observe every outcome.

use std::collections::{HashMap, HashSet};
use std::fmt::Display;
use std::future::Future;

use super::prepare::Prepared;
use super::{Engine, Outcome};
use crate::extract::Envelope;
use crate::{ClaimRequest, DedupKey, StoreError};

/// One message of a round: its index in the batch, and its claim (`None`: it has no key and
/// is processed without dedup).
pub(crate) type Item = (usize, Option<ClaimRequest>);

/// One delivery of a round, decided: its index, its outcome, and the attempt the store
/// reported (for the delivery's event).
#[derive(Debug)]
pub(crate) struct Decided<T, E> {
    pub(crate) index: usize,
    pub(crate) outcome: Outcome<T, E>,
    pub(crate) attempt: u32,
}

/// How a mode decides one round of a batch (it holds the batch's messages): messages whose
/// keys are distinct. Every outcome that calls for an ack must be durable when the round's
/// future completes.
pub(crate) trait Round<T, E>: Sync {
    /// Whether messages settle in log order within their partition (the offset inbox): see
    /// [`Engine::decide_in_rounds`].
    const ORDERED: bool = false;

    /// What the mode took ahead for the batch's first round (two-phase: its claims), given
    /// to that round.
    type Ahead: Send;

    /// Whether messages are claimed by key. `false` (the offset inbox without markers): every
    /// message goes to the rounds unkeyed, known by its log position alone, and a missing
    /// key fails nothing.
    fn keyed(&self) -> bool {
        true
    }

    /// Decides `round` (indices into the batch), answering once per item, in any order;
    /// `ahead`, for the first round, is what was taken ahead for it (the round gives back
    /// what it does not use).
    fn decide(
        &self,
        round: Vec<Item>,
        ahead: Option<Self::Ahead>,
    ) -> impl Future<Output = Vec<Decided<T, E>>> + Send + '_;
}

/// A message held back because an earlier message of its partition did not settle.
#[derive(Debug, thiserror::Error)]
#[error("waits for an earlier message of partition {partition} of `{log}` to settle")]
struct Waiting {
    log: String,
    partition: i32,
}

/// The error of a message held back because an earlier message of its partition did not
/// settle (transient: it runs once that one has).
pub(crate) fn waiting(log: &str, partition: i32) -> StoreError {
    StoreError::backend("log order", true, Waiting { log: log.to_owned(), partition })
}

/// A partition of a log, owned: an ordered mode's lane.
type Lane = (String, i32);

impl<B> Engine<B> {
    /// Decides `msgs` with `mode` (`prepared`, `ahead`: the messages' preparations and what
    /// was taken ahead for the first round, or nothing): each message prepared (a message without a usable key is decided here), then
    /// rounds of distinct keys — a key repeated in the batch waits until the round of its
    /// first copy is durable, and is then a duplicate of it — then every outcome observed.
    /// Outcomes are in message order.
    ///
    /// In an ordered mode ([`Round::ORDERED`]) rounds follow each partition's offsets: a
    /// message held back to a later round holds back every later message of its partition,
    /// and one that did not settle (decided as a failure, here or in a round) fails every
    /// later message of its partition as transient, so a committed position never passes it.
    pub(crate) async fn decide_in_rounds<M, T, E, R>(
        &self,
        msgs: &[M],
        mode: &R,
        prepared: Vec<Prepared<(), ()>>,
        mut ahead: Option<R::Ahead>,
    ) -> Vec<Outcome<T, E>>
    where
        M: Envelope,
        E: Display,
        R: Round<T, E>,
    {
        let mut out: Vec<Option<Outcome<T, E>>> = msgs.iter().map(|_| None).collect();
        let mut keys: Vec<Option<DedupKey>> = msgs.iter().map(|_| None).collect();
        let mut todo: Vec<Item> = Vec::with_capacity(msgs.len());
        // The first offset of each partition that did not settle (ordered modes).
        let mut stopped: HashMap<Lane, i64> = HashMap::new();
        // Made ahead (with the claims taken ahead) when there is one per message.
        let mut prepared = (prepared.len() == msgs.len()).then(|| prepared.into_iter());
        for (i, m) in msgs.iter().enumerate() {
            if !mode.keyed() {
                keys[i] = self.key_of(m).ok();
                todo.push((i, None));
                continue;
            }
            let p = match prepared.as_mut().and_then(Iterator::next) {
                Some(p) => self.reuse(m, p),
                None => self.prepare(m),
            };
            match p {
                Prepared::Claim(req) => {
                    keys[i] = Some(req.key.clone());
                    todo.push((i, Some(req)));
                }
                Prepared::Unkeyed => todo.push((i, None)),
                Prepared::Done(o) => {
                    if R::ORDERED {
                        stop(&mut stopped, m, &o);
                    }
                    self.observe(None, m.correlation_id(), &o, 0);
                    out[i] = Some(o);
                }
            }
        }
        if R::ORDERED {
            // Each partition's messages in offset order, so a key's first copy is its earliest.
            todo.sort_by_key(|(i, _)| in_log_order(&msgs[*i]));
        }
        while !todo.is_empty() {
            if R::ORDERED {
                let (held, rest): (Vec<Item>, Vec<Item>) =
                    todo.into_iter().partition(|(i, _)| stopped_at(&stopped, &msgs[*i]).is_some());
                for (i, _) in held {
                    let (log, partition) =
                        stopped_at(&stopped, &msgs[i]).expect("held: its partition stopped");
                    let o = Outcome::transient(waiting(&log, partition));
                    self.observe(keys[i].as_ref(), msgs[i].correlation_id(), &o, 0);
                    out[i] = Some(o);
                }
                todo = rest;
            }
            let mut seen = HashSet::new();
            let (mut round, mut later): (Vec<Item>, Vec<Item>) = todo
                .into_iter()
                .partition(|(_, r)| r.as_ref().is_none_or(|r| seen.insert(r.key.hash())));
            if R::ORDERED {
                // What follows a message held back in its partition waits with it.
                let mut first_later: HashMap<Lane, i64> = HashMap::new();
                for (i, _) in &later {
                    lowest(&mut first_later, &msgs[*i]);
                }
                let (now, after): (Vec<Item>, Vec<Item>) = round.into_iter().partition(|(i, _)| {
                    msgs[*i].log_position().is_none_or(|p| {
                        first_later
                            .get(&(p.log.to_owned(), p.partition))
                            .is_none_or(|&first| p.offset < first)
                    })
                });
                round = now;
                later.extend(after);
                later.sort_by_key(|(i, _)| in_log_order(&msgs[*i]));
            }
            for d in mode.decide(round, ahead.take()).await {
                let m = &msgs[d.index];
                if R::ORDERED {
                    stop(&mut stopped, m, &d.outcome);
                }
                self.observe(keys[d.index].as_ref(), m.correlation_id(), &d.outcome, d.attempt);
                out[d.index] = Some(d.outcome);
            }
            todo = later;
        }
        if ahead.is_some() {
            // No round to use it: the mode gives it back.
            mode.decide(Vec::new(), ahead).await;
        }
        // Every index was prepared and then decided in some round.
        out.into_iter().map(|o| o.expect("every message of the batch has an outcome")).collect()
    }
}

/// Notes that `m` did not settle when its outcome leaves it unacknowledged or to be
/// dead-lettered: its partition stops at its offset.
fn stop<M: Envelope, T, E>(stopped: &mut HashMap<Lane, i64>, m: &M, o: &Outcome<T, E>) {
    if !matches!(o, Outcome::Processed(_) | Outcome::Duplicate(_)) {
        lowest(stopped, m);
    }
}

/// Keeps in `at` the lowest offset seen in `m`'s partition.
fn lowest<M: Envelope>(at: &mut HashMap<Lane, i64>, m: &M) {
    if let Some(p) = m.log_position() {
        let low = at.entry((p.log.to_owned(), p.partition)).or_insert(p.offset);
        *low = (*low).min(p.offset);
    }
}

/// The sort key of log order: partition, then offset (messages without a position first).
fn in_log_order<M: Envelope>(m: &M) -> Option<(String, i32, i64)> {
    m.log_position().map(|p| (p.log.to_owned(), p.partition, p.offset))
}

/// The partition `m` waits in, when a message before it there did not settle.
fn stopped_at<M: Envelope>(stopped: &HashMap<Lane, i64>, m: &M) -> Option<(String, i32)> {
    let p = m.log_position()?;
    let lane = (p.log.to_owned(), p.partition);
    stopped.get(&lane).is_some_and(|&at| p.offset > at).then_some(lane)
}
