//! The offset inbox's positions on SQLite: one row per (scope, log, partition) in
//! `<table>_positions`, beside the markers' table. Transactions begin with `BEGIN IMMEDIATE`,
//! so the database's write lock already orders batches; one statement per partition.

use idem_core::StoreError;
use idem_core::inbox::{Partition, TxPositions};
use sqlx::AssertSqlSafe;
use sqlx::sqlite::SqliteConnection;

use super::{SqliteInbox, backend};

impl SqliteInbox {
    fn positions_table(&self) -> String {
        format!("{}_positions", self.store.table.as_str())
    }
}

impl TxPositions for SqliteInbox {
    async fn lock_positions(
        &self,
        conn: &mut SqliteConnection,
        scope: &str,
        parts: &[Partition<'_>],
    ) -> Result<Vec<Option<i64>>, StoreError> {
        let sql = format!(
            "INSERT INTO {} (scope, log, part, next_offset) VALUES (?1, ?2, ?3, NULL) \
             ON CONFLICT (scope, log, part) DO UPDATE SET next_offset = next_offset \
             RETURNING next_offset",
            self.positions_table()
        );
        let mut out = Vec::with_capacity(parts.len());
        for (l, p) in parts {
            let o: Option<i64> = sqlx::query_scalar(AssertSqlSafe(sql.clone()))
                .bind(scope)
                .bind(*l)
                .bind(*p)
                .fetch_one(&mut *conn)
                .await
                .map_err(|e| backend("lock_positions", e))?;
            out.push(o);
        }
        Ok(out)
    }

    async fn advance(
        &self,
        conn: &mut SqliteConnection,
        scope: &str,
        positions: &[(Partition<'_>, i64)],
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE {} SET next_offset = max(coalesce(next_offset, ?4), ?4) \
             WHERE scope = ?1 AND log = ?2 AND part = ?3",
            self.positions_table()
        );
        for ((l, p), o) in positions {
            sqlx::query(AssertSqlSafe(sql.clone()))
                .bind(scope)
                .bind(*l)
                .bind(*p)
                .bind(*o)
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
        let sql = format!(
            "SELECT next_offset FROM {} WHERE scope = ?1 AND log = ?2 AND part = ?3",
            self.positions_table()
        );
        let mut conn = self.pool().acquire().await.map_err(|e| backend("read_positions", e))?;
        let mut out = Vec::with_capacity(parts.len());
        for (l, p) in parts {
            let o: Option<Option<i64>> = sqlx::query_scalar(AssertSqlSafe(sql.clone()))
                .bind(scope)
                .bind(*l)
                .bind(*p)
                .fetch_optional(&mut *conn)
                .await
                .map_err(|e| backend("read_positions", e))?;
            out.push(o.flatten());
        }
        Ok(out)
    }
}
