//! Concurrent histories against `RedisStore` (single node, with the script-free fresh claim and
//! with scripts only), checked for linearizability against the store model
//! (`idem_testkit::linearize`); each run in a fresh namespace, deleted afterwards.
//!
//! With scripts only the store passes the strict model. With the script-free fresh claim,
//! `claim_many` is a pipeline of `SET … NX GET`, then one script for the requests it did not
//! decide: two steps, so a batch is not atomic (checked request by request), and a repeat of
//! a key decided from its `GET` reply may answer `Conflict` carrying the record as it was before
//! the batch's own first request acquired it through the script (right kind, stale state and
//! attempt; only a conflict's fingerprint is compared). The `#[ignore]`d strict test shows it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::sync::Arc;

use idem_core::{BatchConfig, Batched};
use idem_testkit::linearize::{Config, Summary, Violation, check_store};

async fn run(tag: &str, fast: bool, cfg: Config) {
    let Some(url) = common::url() else { return };
    let (store, _offset, _cleanup) = common::store_with(&url, tag, fast).await;
    report(tag, check_store(Arc::new(store), &cfg).await, &cfg);
}

fn report(tag: &str, r: Result<Summary, Violation>, cfg: &Config) {
    match r {
        Ok(sum) => eprintln!("{tag}: seed {} {sum:?}", cfg.seed),
        Err(v) => panic!("{tag}: {v}"),
    }
}

/// Completions through `Batched`: the `complete_many` script must fence each lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_group_commit_is_linearizable() {
    let Some(url) = common::url() else { return };
    let (store, _offset, _cleanup) = common::store_with(&url, "lin-batched", false).await;
    let store = Batched::new(store, BatchConfig::default());
    let cfg = Config::default();
    report("lin-batched", check_store(Arc::new(store), &cfg).await, &cfg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_is_linearizable() {
    let cfg = Config { atomic_batches: false, exact_conflicts: false, ..Config::default() };
    run("lin", true, cfg).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "known: claim_many is not atomic and may answer a stale conflict record"]
async fn redis_store_strict() {
    run("lin-strict", true, Config::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_scripts_only_is_linearizable() {
    run("lin-scripts", false, Config::default()).await;
}
