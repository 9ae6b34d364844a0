//! Concurrent histories against a real store, checked against [`StoreModel`].
//!
//! Each history runs a few tasks at once on a fresh scope of the store; each task does a few
//! operations chosen by its own seeded generator (claims and batches of the history's keys with
//! the same or different fingerprints, completions, failures, releases and extensions of the
//! leases it holds, operator releases and failures, purges). After a `complete`, `fail` or
//! `release` a task may keep a copy of the spent lease (same token) and use it again later: the
//! store must fence it. Every call and return instant is recorded and the history checked
//! with [`super::check`].
//!
//! The seed fixes each task's choices given the answers it gets; the interleaving is the
//! runtime's, so a failing seed reproduces the same kind of history, not always the same one.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::{
    Claim, ClaimRequest, DedupKey, DedupStore, FailKind, Fingerprint, InspectStore, Lease,
    StoreError,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Barrier;

use super::model::{Answer, LeaseId, StoreModel, StoreOp, StoreRet};
use super::{Entry, check};

/// Long enough that no lease runs out and no record expires within a history.
const LEASE: Duration = Duration::from_secs(3600);
const RETAIN: Duration = Duration::from_secs(86_400);

/// How many histories, of what shape.
#[derive(Debug, Clone)]
pub struct Config {
    /// Histories to run.
    pub histories: usize,
    /// Concurrent tasks per history.
    pub tasks: usize,
    /// Operations per task.
    pub ops_per_task: usize,
    /// Keys per history (histories alternate between this and one fewer, at least 1).
    pub keys: usize,
    /// Seed of the first history; history `n` uses `seed + n`.
    pub seed: u64,
    /// What one `claim_many` must be: one atomic step, or one per key.
    pub batches: Batches,
}

/// How much of a `claim_many` takes effect as one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Batches {
    /// The whole batch (the contract's reading: one transaction or script).
    #[default]
    Atomic,
    /// Each key's requests (a store without transactions across keys, such as Cosmos DB where
    /// each key is its own partition): the batch takes effect key by key within the call, a
    /// key's repeats together and in batch order.
    PerKey,
}

impl Default for Config {
    /// 200 histories of 3 tasks × 6 operations over 2–3 keys; the seed from `IDEM_LIN_SEED`
    /// or random; the count from `IDEM_LIN_HISTORIES`.
    fn default() -> Self {
        let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        Self {
            histories: env("IDEM_LIN_HISTORIES")
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(200),
            tasks: 3,
            ops_per_task: 6,
            keys: 3,
            seed: env("IDEM_LIN_SEED").unwrap_or_else(rand::random),
            batches: Batches::Atomic,
        }
    }
}

/// What a passing run checked.
#[derive(Debug, Clone, Default)]
pub struct Summary {
    /// Histories checked.
    pub histories: usize,
    /// Operations in them.
    pub ops: usize,
    /// Operations that overlapped another in real time (the rest were ordered by the clock
    /// alone, and checked all the same).
    pub overlapping: usize,
    /// Operations whose answer was lost to a backend error.
    pub lost: usize,
    /// (model state, done set) pairs the search visited, over all histories.
    pub explored: usize,
    /// `LeaseLost` answers (fencing exercised).
    pub fenced: usize,
    /// Acquired answers that took a key over (attempt > 1).
    pub takeovers: usize,
    /// Wall time.
    pub elapsed: Duration,
}

/// A history no order of the model explains.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The history's seed (`IDEM_LIN_SEED` reproduces its choices as the first history).
    pub seed: u64,
    /// The history, one operation a line, and the closest linearization found.
    pub report: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "history with seed {} is not linearizable:\n{}", self.seed, self.report)
    }
}

type Hist = Vec<Entry<StoreOp, StoreRet>>;
type Logged = (usize, Entry<StoreOp, StoreRet>, Option<String>);

/// Runs `cfg.histories` concurrent histories against `store` and checks each one; stops at the
/// first that is not linearizable.
///
/// # Errors
/// The first [`Violation`].
pub async fn check_store<S>(store: Arc<S>, cfg: &Config) -> Result<Summary, Violation>
where
    S: DedupStore + InspectStore,
{
    let started = Instant::now();
    let mut sum = Summary::default();
    for n in 0..cfg.histories {
        let seed = cfg.seed.wrapping_add(n as u64);
        let keys = (cfg.keys - n % 2).max(1);
        let (history, errors) = run_history(Arc::clone(&store), cfg, seed, keys).await;
        let verdict = check(&StoreModel { keys }, &history);
        if !verdict.is_linearizable() {
            return Err(Violation { seed, report: describe(&history, &errors, &verdict.longest) });
        }
        sum.histories += 1;
        sum.ops += history.len();
        sum.overlapping += overlapping(&history);
        sum.lost += history.iter().filter(|e| e.ret.is_none()).count();
        sum.explored += verdict.explored;
        for e in &history {
            match &e.ret {
                Some((_, StoreRet::LeaseLost)) => sum.fenced += 1,
                Some((_, StoreRet::Claims(a))) => {
                    sum.takeovers += a
                        .iter()
                        .filter(|a| matches!(a, Answer::Acquired { attempt: 2.., .. }))
                        .count();
                }
                _ => {}
            }
        }
    }
    sum.elapsed = started.elapsed();
    Ok(sum)
}

/// A lease a task holds: live, or a spent copy kept to be used again.
struct Held {
    id: LeaseId,
    lease: Lease,
}

impl Held {
    fn copy(&self) -> Self {
        Self { id: self.id, lease: crate::cases::spent_copy(&self.lease) }
    }
}

struct Shared<S> {
    store: Arc<S>,
    keys: Vec<DedupKey>,
    fps: [Fingerprint; 2],
    barrier: Barrier,
    /// Each operation's id, entry and the error that lost its answer.
    log: Mutex<Vec<Logged>>,
    next_id: Mutex<usize>,
}

async fn run_history<S>(store: Arc<S>, cfg: &Config, seed: u64, keys: usize) -> (Hist, Vec<String>)
where
    S: DedupStore + InspectStore,
{
    let scope = format!("lin-{seed:016x}-{:08x}", rand::random::<u32>());
    let shared = Arc::new(Shared {
        store,
        keys: (0..keys)
            .map(|k| DedupKey::new(&scope, format!("k{k}")).expect("valid key"))
            .collect(),
        fps: [Fingerprint::of_bytes(b"payload-a"), Fingerprint::of_bytes(b"payload-b")],
        barrier: Barrier::new(cfg.tasks),
        log: Mutex::new(Vec::new()),
        next_id: Mutex::new(0),
    });
    let tasks: Vec<_> = (0..cfg.tasks)
        .map(|t| {
            let shared = Arc::clone(&shared);
            let rng = StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(t as u64));
            let ops = cfg.ops_per_task;
            tokio::spawn(async move { task(shared, t, rng, ops).await })
        })
        .collect();
    for t in tasks {
        t.await.expect("history task panicked");
    }
    let mut log = std::mem::take(&mut *shared.log.lock().unwrap_or_else(|p| p.into_inner()));
    // Each entry goes at its id (handed out at call time), which `LeaseId::op` names.
    log.sort_by_key(|(id, _, _)| *id);
    let mut errors = Vec::new();
    let mut hist = Vec::with_capacity(log.len());
    for (_, e, err) in log {
        if let Some(err) = err {
            errors.push(format!("op {}: {err}", hist.len()));
        }
        hist.push(e);
    }
    if cfg.batches == Batches::PerKey {
        split_by_key(&mut hist);
    }
    (hist, errors)
}

/// Replaces each `claim_many` by one entry per key it names, with the batch's call and return
/// instants and that key's requests (extra entries go at the end, so indices stay put).
fn split_by_key(hist: &mut Hist) {
    for i in 0..hist.len() {
        let StoreOp::ClaimMany(reqs) = &hist[i].op else { continue };
        let reqs = reqs.clone();
        let (task, call, ret) = (hist[i].task, hist[i].call, hist[i].ret.clone());
        let answers = match &ret {
            Some((_, StoreRet::Claims(a))) if a.len() == reqs.len() => Some(a.clone()),
            _ => None,
        };
        let mut keys: Vec<usize> = reqs.iter().map(|r| r.0).collect();
        keys.sort_unstable();
        keys.dedup();
        for (n, key) in keys.into_iter().enumerate() {
            let slots: Vec<usize> = (0..reqs.len()).filter(|&s| reqs[s].0 == key).collect();
            let op = StoreOp::ClaimKey {
                key,
                op: i,
                reqs: slots.iter().map(|&s| (s, reqs[s].1)).collect(),
            };
            let ret = match (&ret, &answers) {
                (Some((at, _)), Some(a)) => {
                    Some((*at, StoreRet::Claims(slots.iter().map(|&s| a[s].clone()).collect())))
                }
                _ => None,
            };
            let entry = Entry { task, op, call, ret };
            if n == 0 {
                hist[i] = entry;
            } else {
                hist.push(entry);
            }
        }
    }
}

impl<S> Shared<S> {
    fn fp(&self, i: Option<u8>) -> Option<Fingerprint> {
        i.map(|i| self.fps[usize::from(i)])
    }

    fn fp_index(&self, fp: Option<Fingerprint>) -> Option<u8> {
        fp.map(|f| {
            self.fps
                .iter()
                .position(|x| *x == f)
                .map_or(u8::MAX, |i| u8::try_from(i).unwrap_or(u8::MAX))
        })
    }

    fn req(&self, key: usize, fp: Option<u8>) -> ClaimRequest {
        ClaimRequest::new(self.keys[key].clone(), self.fp(fp), LEASE, RETAIN)
    }
}

fn pick_fp(rng: &mut StdRng) -> Option<u8> {
    match rng.random_range(0..10) {
        0..7 => Some(0),
        7..9 => Some(1),
        _ => None,
    }
}

async fn task<S>(shared: Arc<Shared<S>>, t: usize, mut rng: StdRng, ops: usize)
where
    S: DedupStore + InspectStore,
{
    let mut held: Vec<Held> = Vec::new();
    shared.barrier.wait().await;
    let nkeys = shared.keys.len();
    for _ in 0..ops {
        let id = {
            let mut next = shared.next_id.lock().unwrap_or_else(|p| p.into_inner());
            *next += 1;
            *next - 1
        };
        let call = Instant::now();
        // Lets the other tasks run between the call instant and the operation: against a store
        // that answers in microseconds (MemoryStore) the tasks would otherwise rarely overlap.
        tokio::task::yield_now().await;
        let use_lease = !held.is_empty() && rng.random_bool(0.55);
        let (op, outcome) = if use_lease {
            let h = held.swap_remove(rng.random_range(0..held.len()));
            lease_op(&shared, &mut rng, id, h, &mut held).await
        } else {
            key_op(&shared, &mut rng, id, nkeys, &mut held).await
        };
        let ret_at = Instant::now();
        let (ret, err) = match outcome {
            Ok(r) => (Some((ret_at, r)), None),
            Err(e) => (None, Some(idem_core::ErrorChain(&e).to_string())),
        };
        let entry = Entry { task: t, op, call, ret };
        shared.log.lock().unwrap_or_else(|p| p.into_inner()).push((id, entry, err));
    }
}

/// An operation on a held lease; puts back what stays held (an extended lease, a spent copy).
async fn lease_op<S>(
    shared: &Shared<S>,
    rng: &mut StdRng,
    id: usize,
    h: Held,
    held: &mut Vec<Held>,
) -> (StoreOp, Result<StoreRet, StoreError>)
where
    S: DedupStore + InspectStore,
{
    let store = &shared.store;
    let lease = h.id;
    if rng.random_bool(0.2) {
        let mut h = h;
        let r = store.extend(&mut h.lease, LEASE).await;
        held.push(h);
        return (StoreOp::Extend { lease }, fenced(r));
    }
    // Keep a copy of the spent lease a third of the time, to use it again later.
    if rng.random_bool(0.35) {
        held.push(h.copy());
    }
    match rng.random_range(0..10) {
        0..6 => {
            let result = format!("r{id}");
            let r = store.complete(h.lease, Some(result.as_bytes()), RETAIN).await;
            (StoreOp::Complete { lease, result }, fenced(r))
        }
        6..8 => (StoreOp::Release { lease }, fenced(store.release(h.lease).await)),
        n => {
            let kind = if n == 8 { FailKind::Permanent } else { FailKind::InDoubt };
            let reason = format!("f{id}");
            let r = store.fail(h.lease, kind, &reason, RETAIN).await;
            (StoreOp::Fail { lease, kind, reason }, fenced(r))
        }
    }
}

/// An operation naming keys: a claim, a batch, an operator release or failure, a purge.
async fn key_op<S>(
    shared: &Shared<S>,
    rng: &mut StdRng,
    id: usize,
    nkeys: usize,
    held: &mut Vec<Held>,
) -> (StoreOp, Result<StoreRet, StoreError>)
where
    S: DedupStore + InspectStore,
{
    let store = &shared.store;
    match rng.random_range(0..100) {
        0..55 => {
            let (key, fp) = (rng.random_range(0..nkeys), pick_fp(rng));
            let r = store.claim(&shared.req(key, fp)).await;
            let r = r.map(|c| StoreRet::Claims(vec![answer(shared, c, id, 0, held)]));
            (StoreOp::Claim { key, fp }, r)
        }
        55..75 => {
            let reqs: Vec<(usize, Option<u8>)> =
                (0..2).map(|_| (rng.random_range(0..nkeys), pick_fp(rng))).collect();
            let batch: Vec<ClaimRequest> = reqs.iter().map(|(k, f)| shared.req(*k, *f)).collect();
            let r = store.claim_many(&batch).await.map(|cs| {
                StoreRet::Claims(
                    cs.into_iter()
                        .enumerate()
                        .map(|(slot, c)| answer(shared, c, id, slot, held))
                        .collect(),
                )
            });
            (StoreOp::ClaimMany(reqs), r)
        }
        75..85 => {
            let key = rng.random_range(0..nkeys);
            let r = store.force_release(&shared.keys[key]).await.map(StoreRet::Changed);
            (StoreOp::ForceRelease { key }, r)
        }
        85..93 => {
            let key = rng.random_range(0..nkeys);
            let reason = format!("ff{id}");
            let r = store.force_fail(&shared.keys[key], &reason).await.map(StoreRet::Changed);
            (StoreOp::ForceFail { key, reason }, r)
        }
        _ => (StoreOp::Purge, store.purge(100).await.map(StoreRet::Purged)),
    }
}

fn fenced(r: Result<(), StoreError>) -> Result<StoreRet, StoreError> {
    match r {
        Ok(()) => Ok(StoreRet::Ok),
        Err(StoreError::LeaseLost { .. }) => Ok(StoreRet::LeaseLost),
        Err(e) => Err(e),
    }
}

fn answer<S>(shared: &Shared<S>, c: Claim, op: usize, slot: usize, held: &mut Vec<Held>) -> Answer {
    match c {
        Claim::Acquired(lease) => {
            let a = Answer::Acquired {
                attempt: lease.attempt(),
                previous: lease.previous(),
                fp: shared.fp_index(lease.fingerprint()),
            };
            held.push(Held { id: LeaseId { op, slot }, lease });
            a
        }
        Claim::Completed(rec) => Answer::Completed {
            state: rec.state,
            attempt: rec.attempt,
            fp: shared.fp_index(rec.fingerprint),
            result: rec.result.map(|r| String::from_utf8_lossy(&r).into_owned()),
        },
        Claim::InProgress { attempt, .. } => Answer::InProgress { attempt },
        Claim::Conflict(rec) => Answer::Conflict {
            state: rec.state,
            attempt: rec.attempt,
            fp: shared.fp_index(rec.fingerprint),
        },
    }
}

/// How many operations overlap at least one other (a lost answer overlaps all that follow).
fn overlapping(history: &Hist) -> usize {
    let end = |e: &Entry<StoreOp, StoreRet>| e.ret.as_ref().map(|(at, _)| *at);
    let overlaps = |a: &Entry<StoreOp, StoreRet>, b: &Entry<StoreOp, StoreRet>| {
        end(a).is_none_or(|ea| b.call < ea) && end(b).is_none_or(|eb| a.call < eb)
    };
    history
        .iter()
        .enumerate()
        .filter(|(i, a)| history.iter().enumerate().any(|(j, b)| *i != j && overlaps(a, b)))
        .count()
}

fn describe(history: &Hist, errors: &[String], longest: &[usize]) -> String {
    let t0 = history.iter().map(|e| e.call).min().unwrap_or_else(Instant::now);
    let us = |t: Instant| t.duration_since(t0).as_micros();
    let mut out = String::new();
    for (i, e) in history.iter().enumerate() {
        let ret = match &e.ret {
            Some((at, r)) => format!("{:>7}µs {r:?}", us(*at)),
            None => "   lost".to_owned(),
        };
        let _ = writeln!(out, "  #{i:<2} task {} [{:>7}µs → {ret}] {:?}", e.task, us(e.call), e.op);
    }
    for err in errors {
        let _ = writeln!(out, "  error: {err}");
    }
    let _ = writeln!(out, "  longest linearizable prefix: {longest:?}");
    if let Some(next) = (0..history.len()).find(|i| !longest.contains(i)) {
        let _ = writeln!(out, "  (no operation can follow it; first left out: #{next})");
    }
    out
}
