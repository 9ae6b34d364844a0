//! Concurrent histories against `CosmosStore` on the SDK's in-memory emulator, checked for
//! linearizability against the store model (`idem_testkit::linearize`).
//!
//! Each key is its own partition and Cosmos DB has no transaction across partitions, so a
//! `claim_many` is one atomic step per key: a key's requests (a repeat included) are decided by
//! one conditional write, keys one after another within the call (`Batches::PerKey`). Conflicts
//! carry the current record and the operator's `force_*` run beside the rest.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use crate::common;

use std::sync::Arc;

use idem_core::{BatchConfig, Batched};
use idem_cosmos::CosmosStore;
use idem_testkit::linearize::{Batches, Config, check_store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cosmos_store_is_linearizable() {
    run(false).await;
}

/// Completions through `Batched` (`complete_many`: one fenced write per lease).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cosmos_group_commit_is_linearizable() {
    run(true).await;
}

async fn run(grouped: bool) {
    let cfg = Config { batches: Batches::PerKey, ..Config::default() };
    let emu = common::Emulator::start().await;
    let container = emu.container("/pk").await;
    let store = CosmosStore::new(container);
    let r = if grouped {
        check_store(Arc::new(Batched::new(store, BatchConfig::default())), &cfg).await
    } else {
        check_store(Arc::new(store), &cfg).await
    };
    match r {
        Ok(sum) => eprintln!("cosmos: seed {} {sum:?}", cfg.seed),
        Err(v) => panic!("cosmos: {v}"),
    }
}
