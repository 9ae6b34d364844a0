//! Claims taken ahead: a pipelined consumer claims the keys of its next batch while the
//! handlers of the current one run, so the claim's round trip overlaps them.
//!
//! Only two-phase backends claim ahead (an inbox marks its keys inside the batch's own
//! transaction). The claims are those of the batch's first round — its distinct keys, as
//! [`decide_in_rounds`](super::Engine::decide_in_rounds) forms it — taken with one
//! `claim_many`. They are used when the batch is decided, if still fresh; otherwise, and at
//! shutdown, the leases acquired are released.

use std::collections::HashSet;
use std::time::Instant;

use super::Engine;
use super::prepare::Prepared;
use super::ride::Ticket;
use crate::extract::Envelope;
use crate::{Claim, ClaimRequest, DedupStore, KeyHash, StoreError};

/// A claim taken ahead, or `None`: claim the key again now.
pub(crate) type Slot = Option<Result<Claim, StoreError>>;

/// The first round's claims of a batch, taken before its turn (see the module docs).
#[derive(Debug)]
pub struct Ahead {
    taken: Instant,
    /// Every message's preparation (key, fingerprint), so the decision does not redo it.
    prepared: Vec<Prepared<(), ()>>,
    claims: Vec<(KeyHash, Result<Claim, StoreError>)>,
}

impl Ahead {
    /// The messages' preparations, for [`decide_in_rounds`](Engine::decide_in_rounds); what
    /// remains holds the claims.
    pub(crate) fn take_prepared(&mut self) -> Vec<Prepared<(), ()>> {
        std::mem::take(&mut self.prepared)
    }

    /// The claims for `reqs`, if they were taken for exactly these requests (same keys, same
    /// order), and whether they are old (taken a quarter of the lease ago or more: their leases
    /// must be extended before the handlers get them). `None` in a slot asks for a fresh claim
    /// of that key: an answer that can change with time (another holder's lease, often the
    /// batch decided just before this one, or a store error) is never trusted late. `Err`
    /// gives them back untouched, for [`Engine::drop_ahead`].
    pub(crate) fn take_for(
        self,
        reqs: &[ClaimRequest],
        lease: std::time::Duration,
    ) -> Result<(Vec<Slot>, bool), Self> {
        let same = self.claims.len() == reqs.len()
            && self.claims.iter().zip(reqs).all(|((h, _), r)| *h == r.key.hash());
        if !same {
            return Err(self);
        }
        let old = self.taken.elapsed() >= lease / 4;
        let claims = self
            .claims
            .into_iter()
            .map(|(_, c)| match c {
                Ok(Claim::InProgress { .. }) | Err(_) => None,
                settled => Some(settled),
            })
            .collect();
        Ok((claims, old))
    }
}

impl<B> Engine<B> {
    /// Every message's preparation, and the claim requests of the batch's first round: the
    /// keyed messages whose key is the first of its kind in the batch, in message order.
    fn first_round<M: Envelope>(&self, msgs: &[M]) -> (Vec<Prepared<(), ()>>, Vec<ClaimRequest>) {
        let prepared: Vec<Prepared<(), ()>> = msgs.iter().map(|m| self.prepare(m)).collect();
        let mut seen = HashSet::new();
        // Without takeover, as the round claims them (see `TwoPhase`): a key whose lease ran
        // out is taken over alone, when its turn comes, never ahead.
        let reqs = prepared
            .iter()
            .filter_map(|p| match p {
                Prepared::Claim(req) => {
                    seen.insert(req.key.hash()).then(|| req.clone().without_takeover())
                }
                Prepared::Unkeyed | Prepared::Done(_) => None,
            })
            .collect();
        (prepared, reqs)
    }

    /// `m`'s preparation made ahead, in the handler's types (a message decided without the
    /// store is prepared again: its outcome carries them).
    pub(crate) fn reuse<M: Envelope, T, E>(&self, m: &M, p: Prepared<(), ()>) -> Prepared<T, E> {
        match p {
            Prepared::Claim(req) => Prepared::Claim(req),
            Prepared::Unkeyed => Prepared::Unkeyed,
            Prepared::Done(_) => self.prepare(m),
        }
    }
}

impl<S: DedupStore> Engine<S> {
    /// Claims the first round of `msgs` now (one `claim_many`, or riding on the completion of
    /// another batch than `ticket`'s: see [`ride`](super::ride)), for a later decision of the
    /// same batch.
    pub(crate) async fn claim_ahead<M: Envelope>(
        &self,
        msgs: &[M],
        ticket: Ticket,
    ) -> Option<Ahead> {
        // Takeovers are running alone: a key claimed now would be held if one of them kills
        // the process again, and counted as its suspect.
        if self.solo_running() {
            return None;
        }
        let (prepared, reqs) = self.first_round(msgs);
        if reqs.is_empty() {
            return None;
        }
        let taken = Instant::now();
        // On a store that sends a completion and claims in one write, they ride on the next
        // completion of a decision in flight (one write for both), or go now when none is due.
        let rode = match self.store.combines_writes() {
            true => self.rides.ride(&reqs, ticket).await,
            false => None,
        };
        let claims = match rode {
            Some(claims) => claims,
            None => self.claim_all(&reqs).await,
        };
        let claims = reqs.iter().map(|r| r.key.hash()).zip(claims).collect();
        let ahead = Ahead { taken, prepared, claims };
        if self.solo_running() {
            self.drop_ahead(ahead).await;
            return None;
        }
        Some(ahead)
    }

    /// Gives back the leases of claims taken ahead and not used. Claims ahead never take over an
    /// expired lease (they are made without takeover); should one have, it is left to expire
    /// rather than released: released, the next claim would find the key free and never learn
    /// that an earlier holder may have made the effect (the in-doubt check).
    pub(crate) async fn drop_ahead(&self, ahead: Ahead) {
        let leases = ahead.claims.into_iter().filter_map(|(_, c)| match c {
            Ok(Claim::Acquired(lease)) if !lease.took_over_expired() => Some(lease),
            _ => None,
        });
        let released = futures_util::future::join_all(leases.map(|l| self.store.release(l))).await;
        for e in released.iter().filter_map(|r| r.as_ref().err()) {
            self.observe_store_error("release", e);
        }
    }
}
