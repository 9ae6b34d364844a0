//! The outbox-store conformance suite (`idem_testkit::outbox_conformance!`) on each SQL
//! database: SQLite on a file, PostgreSQL in a schema of its own, MariaDB in a table of its
//! own — all dropped afterwards. Time moves through the stores' clock controls.
#![allow(clippy::unwrap_used)] // test setup: a failure here is the test failing

#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::common;

use std::time::Duration;

use idem_testkit::Harness;

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;
    use idem_core::time::ClockSkew;
    use idem_sqlx::PostgresStore;

    idem_testkit::outbox_conformance!(|| async {
        let url = common::pg_url()?;
        let schema = common::unique("idem_outbox");
        let pool =
            sqlx::postgres::PgPoolOptions::new().max_connections(8).connect(&url).await.unwrap();
        let skew = ClockSkew::new();
        let store =
            PostgresStore::new(pool).with_schema(&schema).unwrap().with_clock_skew(skew.clone());
        let outbox = store.outbox();
        outbox.migrate().await.unwrap();
        let guard =
            common::DropSql { url, sql: format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE") };
        Some(Harness::new(outbox, skew, Duration::from_secs(10)).with_guard(guard))
    });
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use idem_core::time::ManualClock;
    use idem_sqlx::SqliteStore;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

    idem_testkit::outbox_conformance!(|| async {
        let dir = tempfile::tempdir().unwrap();
        let opts = SqliteConnectOptions::new()
            .filename(dir.path().join("outbox.sqlite"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(30));
        let pool = SqlitePoolOptions::new().max_connections(4).connect_with(opts).await.unwrap();
        let clock = ManualClock::new();
        let store = SqliteStore::new(pool).with_clock(clock.clone());
        let outbox = store.outbox();
        outbox.migrate().await.unwrap();
        Some(Harness::manual(outbox, clock).with_guard(dir))
    });
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use idem_core::time::ClockSkew;
    use idem_sqlx::MySqlStore;

    idem_testkit::outbox_conformance!(|| async {
        let url = common::mysql_url()?;
        let table = common::unique("outbox");
        let pool =
            sqlx::mysql::MySqlPoolOptions::new().max_connections(8).connect(&url).await.unwrap();
        let skew = ClockSkew::new();
        let store = MySqlStore::new(pool).with_clock_skew(skew.clone());
        let outbox = store.outbox().with_table_name(&table).unwrap();
        outbox.migrate().await.unwrap();
        let guard = common::DropSql { url, sql: format!("DROP TABLE IF EXISTS `{table}`") };
        Some(Harness::new(outbox, skew, Duration::from_secs(10)).with_guard(guard))
    });
}
