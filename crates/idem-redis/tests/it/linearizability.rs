//! Concurrent histories against `RedisStore` (single node and cluster, with the script-free fresh
//! claim and with scripts only, each also through `Batched`), checked for linearizability against the store model
//! (`idem_testkit::linearize`); each run in a fresh namespace, deleted afterwards.
//!
//! Both pass the strict model: with the fast claim, `claim_many` is one script that tries each
//! key's `SET … NX GET` and decides the rest in the same step.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::sync::Arc;

use idem_core::{BatchConfig, Batched};
use idem_testkit::linearize::{Config, Summary, Violation, check_store};

/// On the single server, or on the local Redis Cluster (`cluster`); `fast`: the script-free
/// fresh claim; `grouped`: completions through `Batched` (`complete_many`'s script fences each).
async fn run(tag: &str, cluster: bool, fast: bool, grouped: bool) {
    let (store, _offset, _cleanup) = if cluster {
        let Some(urls) = common::cluster_urls() else { return };
        common::cluster_store(&urls, tag, fast).await
    } else {
        let Some(url) = common::url() else { return };
        common::store_with(&url, tag, fast).await
    };
    let cfg = Config::default();
    let r = if grouped {
        check_store(Arc::new(Batched::new(store, BatchConfig::default())), &cfg).await
    } else {
        check_store(Arc::new(store), &cfg).await
    };
    report(tag, r, &cfg);
}

fn report(tag: &str, r: Result<Summary, Violation>, cfg: &Config) {
    match r {
        Ok(sum) => eprintln!("{tag}: seed {} {sum:?}", cfg.seed),
        Err(v) => panic!("{tag}: {v}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_is_linearizable() {
    run("lin", false, true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_group_commit_is_linearizable() {
    run("lin-batched", false, true, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_scripts_only_is_linearizable() {
    run("lin-scripts", false, false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_scripts_only_group_commit_is_linearizable() {
    run("lin-scripts-batched", false, false, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_store_is_linearizable() {
    run("lin-cluster", true, true, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_group_commit_is_linearizable() {
    run("lin-cluster-batched", true, true, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_cluster_scripts_only_is_linearizable() {
    run("lin-cluster-scripts", true, false, false).await;
}
