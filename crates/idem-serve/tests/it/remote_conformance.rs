//! The store contract through the API: the whole `DedupStore` + `InspectStore` conformance
//! suite runs against `RemoteStore`, talking HTTP to an in-process server over SQLite,
//! PostgreSQL and Redis. Time moves on the server's store (its clock), as the cases expect.

use crate::common;

use std::time::Duration;

use idem_testkit::{Harness, TimeControl};

mod sqlite {
    use super::*;
    use idem_core::time::ManualClock;

    idem_testkit::dedup_store_conformance!(|| async {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new();
        let store = idem_sqlx::SqliteStore::open(dir.path().join("remote.sqlite"))
            .await
            .expect("open sqlite store")
            .with_clock(clock.clone());
        let server = common::serve(store).await;
        let remote = server.admin();
        Harness::manual(remote, clock).with_guard((dir, server))
    });
}

mod postgres {
    use super::*;
    use idem_core::time::ClockSkew;

    struct DropSchema(String, String);

    impl Drop for DropSchema {
        fn drop(&mut self) {
            let (url, schema) = (self.0.clone(), self.1.clone());
            let _ = std::thread::spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build()
                else {
                    return;
                };
                rt.block_on(async move {
                    use sqlx::Connection as _;
                    if let Ok(mut c) = sqlx::PgConnection::connect(&url).await {
                        let sql = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
                        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut c).await;
                    }
                });
            })
            .join();
        }
    }

    idem_testkit::dedup_store_conformance!(server: || async {
        let url = idem_testkit::service::require(
            "postgres",
            "IDEM_TEST_POSTGRES_URL",
            "postgres://postgres@127.0.0.1:5432/test",
        )?;
        let schema = common::unique("idem_remote");
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(&url)
            .await
            .expect("connect to postgres");
        let skew = ClockSkew::new();
        let store = idem_sqlx::PostgresStore::new(pool)
            .with_schema(&schema)
            .expect("schema")
            .with_clock_skew(skew.clone());
        store.migrate().await.expect("migrate");
        let server = common::serve(store).await;
        let remote = server.admin();
        Some(Harness::new(remote, skew, Duration::from_secs(10)).with_guard((server, DropSchema(url, schema))))
    });
}

mod redis {
    use super::*;
    use idem_redis::ClockOffset;

    struct Offset(ClockOffset);

    impl TimeControl for Offset {
        async fn advance(&self, d: Duration) {
            self.0.advance(d);
        }
    }

    struct Sweep(String, String);

    impl Drop for Sweep {
        fn drop(&mut self) {
            if let Ok(mut c) =
                ::redis::Client::open(self.0.as_str()).and_then(|c| c.get_connection())
            {
                let keys: Vec<String> = ::redis::cmd("KEYS")
                    .arg(format!("{}*", self.1))
                    .query(&mut c)
                    .unwrap_or_default();
                for chunk in keys.chunks(500) {
                    let _: Result<i64, _> = ::redis::cmd("DEL").arg(chunk).query(&mut c);
                }
            }
        }
    }

    idem_testkit::dedup_store_conformance!(server: || async {
        let url = idem_testkit::service::require(
            "redis",
            "IDEM_TEST_REDIS_URL",
            "redis://127.0.0.1:6379/",
        )?;
        let offset = ClockOffset::new();
        let store = idem_redis::RedisStore::builder(&url)
            .expect("url")
            .namespace(&common::unique("remote"))
            .expect("namespace")
            .clock_offset(offset.clone())
            .connect()
            .await
            .expect("connect to redis");
        let prefix = store.namespace().key_prefix().to_owned();
        let server = common::serve(store).await;
        let remote = server.admin();
        Some(Harness::new(remote, Offset(offset), Duration::from_secs(10)).with_guard((server, Sweep(url, prefix))))
    });
}
