//! The batch skeleton, written once for both modes: prepare every message, decide rounds of
//! distinct keys, observe every outcome.

use std::collections::HashSet;
use std::fmt::Display;
use std::future::Future;

use super::prepare::Prepared;
use super::{Engine, Outcome};
use crate::extract::Envelope;
use crate::{ClaimRequest, DedupKey};

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
    /// Decides `round` (indices into the batch), answering once per item, in any order.
    fn decide(&self, round: Vec<Item>) -> impl Future<Output = Vec<Decided<T, E>>> + Send + '_;
}

impl<B> Engine<B> {
    /// Decides `msgs` with `mode` (`prepared`: the messages' preparations made ahead, or
    /// empty): each message prepared (a message without a usable key is
    /// decided here), then rounds of distinct keys — a key repeated in the batch waits until
    /// the round of its first copy is durable, and is then a duplicate of it — then every
    /// outcome observed. Outcomes are in message order.
    pub(crate) async fn decide_in_rounds<M, T, E, R>(
        &self,
        msgs: &[M],
        mode: &R,
        prepared: Vec<Prepared<(), ()>>,
    ) -> Vec<Outcome<T, E>>
    where
        M: Envelope,
        E: Display,
        R: Round<T, E>,
    {
        let mut out: Vec<Option<Outcome<T, E>>> = msgs.iter().map(|_| None).collect();
        let mut keys: Vec<Option<DedupKey>> = msgs.iter().map(|_| None).collect();
        let mut todo: Vec<Item> = Vec::with_capacity(msgs.len());
        // Made ahead (with the claims taken ahead) when there is one per message.
        let mut prepared = (prepared.len() == msgs.len()).then(|| prepared.into_iter());
        for (i, m) in msgs.iter().enumerate() {
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
                    self.observe(None, m.correlation_id(), &o, 0);
                    out[i] = Some(o);
                }
            }
        }
        while !todo.is_empty() {
            let mut seen = HashSet::new();
            let (round, later): (Vec<Item>, Vec<Item>) = todo
                .into_iter()
                .partition(|(_, r)| r.as_ref().is_none_or(|r| seen.insert(r.key.hash())));
            for d in mode.decide(round).await {
                self.observe(
                    keys[d.index].as_ref(),
                    msgs[d.index].correlation_id(),
                    &d.outcome,
                    d.attempt,
                );
                out[d.index] = Some(d.outcome);
            }
            todo = later;
        }
        // Every index was prepared and then decided in some round.
        out.into_iter().map(|o| o.expect("every message of the batch has an outcome")).collect()
    }
}
