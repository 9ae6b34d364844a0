//! The conformance suite against `PostgresStore` on the real server, each case in its own
//! schema; time moves through a `ClockSkew` on the database clock. Also through `Batched`.
#![cfg(feature = "postgres")]

use crate::common;

use idem_core::time::ClockSkew;
use idem_sqlx::PostgresStore;
use idem_testkit::Harness;
use std::time::Duration;

async fn store() -> Option<(PostgresStore, ClockSkew, common::DropSql)> {
    let url = common::pg_url()?;
    let schema = common::unique("idem_conf");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .expect("connect to postgres");
    let skew = ClockSkew::new();
    let store = PostgresStore::new(pool)
        .with_schema(&schema)
        .expect("valid schema")
        .with_clock_skew(skew.clone());
    store.migrate().await.expect("migrate");
    let guard = common::DropSql { url, sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
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
