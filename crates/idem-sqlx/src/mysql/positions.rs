//! The offset inbox's positions on MySQL / MariaDB: one row per (scope, log, partition) in
//! `<table>_positions`, beside the markers' table.

use std::collections::HashMap;

use idem_core::StoreError;
use idem_core::inbox::{Partition, TxPositions};
use sqlx::AssertSqlSafe;
use sqlx::mysql::MySqlConnection;

use super::{MySqlInbox, backend};

impl MySqlInbox {
    fn positions_table(&self) -> String {
        format!("`{}_positions`", self.store.table.as_str())
    }

    /// `SELECT … WHERE scope = ? AND (log, part) IN ((?, ?), …)` with `suffix`.
    async fn select_positions(
        &self,
        conn: &mut MySqlConnection,
        scope: &str,
        parts: &[Partition<'_>],
        suffix: &str,
    ) -> Result<Vec<Option<i64>>, StoreError> {
        let tuples = vec!["(?, ?)"; parts.len()].join(", ");
        let sql = format!(
            "SELECT log, part, next_offset FROM {} WHERE scope = ? AND (log, part) IN ({tuples}){suffix}",
            self.positions_table()
        );
        let mut q = sqlx::query_as::<_, (Vec<u8>, i32, Option<i64>)>(AssertSqlSafe(sql))
            .bind(scope.as_bytes());
        for (l, p) in parts {
            q = q.bind(l.as_bytes()).bind(*p);
        }
        let rows = q.fetch_all(&mut *conn).await.map_err(|e| backend("positions", e))?;
        let found: HashMap<(Vec<u8>, i32), Option<i64>> =
            rows.into_iter().map(|(l, p, o)| ((l, p), o)).collect();
        Ok(parts
            .iter()
            .map(|(l, p)| found.get(&(l.as_bytes().to_vec(), *p)).copied().flatten())
            .collect())
    }
}

/// Two statements: an insert of the missing rows whose duplicate branch changes nothing (it
/// takes the row lock all the same), then a locking read.
impl TxPositions for MySqlInbox {
    async fn lock_positions(
        &self,
        conn: &mut MySqlConnection,
        scope: &str,
        parts: &[Partition<'_>],
    ) -> Result<Vec<Option<i64>>, StoreError> {
        if parts.is_empty() {
            return Ok(Vec::new());
        }
        let rows = vec!["(?, ?, ?, NULL)"; parts.len()].join(", ");
        let sql = format!(
            "INSERT INTO {} (scope, log, part, next_offset) VALUES {rows} \
             ON DUPLICATE KEY UPDATE next_offset = next_offset",
            self.positions_table()
        );
        let mut q = sqlx::query(AssertSqlSafe(sql));
        for (l, p) in parts {
            q = q.bind(scope.as_bytes()).bind(l.as_bytes()).bind(*p);
        }
        q.execute(&mut *conn).await.map_err(|e| backend("lock_positions", e))?;
        self.select_positions(conn, scope, parts, " FOR UPDATE").await
    }

    async fn advance(
        &self,
        conn: &mut MySqlConnection,
        scope: &str,
        positions: &[(Partition<'_>, i64)],
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE {} SET next_offset = GREATEST(COALESCE(next_offset, ?), ?) \
             WHERE scope = ? AND log = ? AND part = ?",
            self.positions_table()
        );
        for ((l, p), o) in positions {
            sqlx::query(AssertSqlSafe(sql.clone()))
                .bind(*o)
                .bind(*o)
                .bind(scope.as_bytes())
                .bind(l.as_bytes())
                .bind(*p)
                .execute(&mut *conn)
                .await
                .map_err(|e| backend("advance", e))?;
        }
        Ok(())
    }

    async fn read_positions(
        &self,
        scope: &str,
        parts: &[Partition<'_>],
    ) -> Result<Vec<Option<i64>>, StoreError> {
        if parts.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.pool().acquire().await.map_err(|e| backend("read_positions", e))?;
        self.select_positions(&mut conn, scope, parts, "").await
    }
}
