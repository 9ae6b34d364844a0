//! The conformance suite against `MySqlStore` on the real MariaDB, each case in its own table;
//! time moves through a `ClockSkew` on the server clock. Also through `Batched`.
#![cfg(feature = "mysql")]

use crate::common;

use std::time::Duration;

use idem_core::time::ClockSkew;
use idem_sqlx::MySqlStore;
use idem_testkit::Harness;

async fn store() -> Option<(MySqlStore, ClockSkew, common::DropSql)> {
    let url = common::mysql_url()?;
    let table = common::unique("conf");
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .expect("connect to mysql");
    let skew = ClockSkew::new();
    let store = MySqlStore::new(pool)
        .with_table_name(&table)
        .expect("valid table")
        .with_clock_skew(skew.clone());
    store.migrate().await.expect("migrate");
    let guard = common::DropSql {
        url,
        sql: format!("DROP TABLE IF EXISTS `{table}`, `{table}_positions`"),
    };
    Some((store, skew, guard))
}

mod direct {
    use super::*;

    idem_testkit::dedup_store_conformance!(server: || async {
        let (store, skew, guard) = store().await?;
        Some(Harness::new(store, skew, Duration::from_secs(10)).with_guard(guard))
    });
}

mod group_commit {
    use super::*;
    use idem_core::{BatchConfig, Batched};

    idem_testkit::dedup_store_conformance!(server: || async {
        let (store, skew, guard) = store().await?;
        let store = Batched::new(store, BatchConfig::default());
        Some(Harness::new(store, skew, Duration::from_secs(10)).with_guard(guard))
    });
}
