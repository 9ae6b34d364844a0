//! Shared helpers of the real-server tests: a fresh schema or database per test, dropped after.
#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicU64, Ordering};

static SEQ: AtomicU64 = AtomicU64::new(0);

/// A name no other test (or test process) uses.
pub fn unique(prefix: &str) -> String {
    let n = SEQ.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}_{}_{n}_{nanos}", std::process::id())
}

pub fn pg_url() -> Option<String> {
    idem_testkit::service::require(
        "postgres",
        "IDEM_TEST_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
}

pub fn mysql_url() -> Option<String> {
    idem_testkit::service::require(
        "mysql",
        "IDEM_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    )
}

/// Runs `sql` on its own connection and runtime when dropped (cleanup that outlives the test's
/// runtime and pool).
pub struct DropSql {
    pub url: String,
    pub sql: String,
}

impl Drop for DropSql {
    fn drop(&mut self) {
        let (url, sql) = (self.url.clone(), self.sql.clone());
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
                return;
            };
            rt.block_on(async move {
                use sqlx::Connection as _;
                if url.starts_with("mysql") {
                    if let Ok(mut c) = sqlx::MySqlConnection::connect(&url).await {
                        let sql = format!("SET SESSION lock_wait_timeout = 5; {sql}");
                        let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut c).await;
                    }
                } else if let Ok(mut c) = sqlx::PgConnection::connect(&url).await {
                    // Bounded: a transaction the test left open (its rollback cannot run while
                    // this drop blocks the test's runtime) must not hang the suite.
                    let sql = format!("SET lock_timeout = '5s'; {sql}");
                    let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut c).await;
                }
            });
        })
        .join();
    }
}
