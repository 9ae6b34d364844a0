//! The offset inbox's positions on PostgreSQL: one row per (scope, log, partition) in
//! `<table>_positions`, beside the markers' table.

use std::collections::HashMap;

use idem_core::StoreError;
use idem_core::inbox::{Partition, TxPositions};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgConnection;

use super::{PostgresInbox, backend};

impl PostgresInbox {
    fn positions_table(&self) -> String {
        format!("\"{}\".\"{}_positions\"", self.store.schema(), self.store.table())
    }
}

/// Answers `parts` in input order from rows of (log, partition, next offset).
fn in_order(parts: &[Partition<'_>], rows: Vec<(String, i32, Option<i64>)>) -> Vec<Option<i64>> {
    let found: HashMap<(String, i32), Option<i64>> =
        rows.into_iter().map(|(l, p, o)| ((l, p), o)).collect();
    parts.iter().map(|(l, p)| found.get(&((*l).to_owned(), *p)).copied().flatten()).collect()
}

fn columns<'a>(parts: &[Partition<'a>]) -> (Vec<&'a str>, Vec<i32>) {
    parts.iter().copied().unzip()
}

/// One statement locks every row: an upsert whose conflict branch changes nothing but takes
/// the row lock, answering the stored position (a concurrent first insert is waited for).
impl TxPositions for PostgresInbox {
    async fn lock_positions(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        parts: &[Partition<'_>],
    ) -> Result<Vec<Option<i64>>, StoreError> {
        let (logs, nums) = columns(parts);
        let sql = format!(
            "INSERT INTO {} AS x (scope, log, part, next_offset) \
             SELECT $1, u.l, u.p, NULL FROM unnest($2::text[], $3::int4[]) WITH ORDINALITY AS u(l, p, n) \
             ORDER BY u.n \
             ON CONFLICT (scope, log, part) DO UPDATE SET next_offset = x.next_offset \
             RETURNING x.log, x.part, x.next_offset",
            self.positions_table()
        );
        let rows: Vec<(String, i32, Option<i64>)> = sqlx::query_as(AssertSqlSafe(sql))
            .bind(scope)
            .bind(&logs)
            .bind(&nums)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| backend("lock_positions", e))?;
        Ok(in_order(parts, rows))
    }

    async fn advance(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        positions: &[(Partition<'_>, i64)],
    ) -> Result<(), StoreError> {
        let logs: Vec<&str> = positions.iter().map(|((l, _), _)| *l).collect();
        let nums: Vec<i32> = positions.iter().map(|((_, p), _)| *p).collect();
        let offs: Vec<i64> = positions.iter().map(|(_, o)| *o).collect();
        let sql = format!(
            "UPDATE {} AS x SET next_offset = GREATEST(x.next_offset, u.o) \
             FROM unnest($2::text[], $3::int4[], $4::int8[]) AS u(l, p, o) \
             WHERE x.scope = $1 AND x.log = u.l AND x.part = u.p",
            self.positions_table()
        );
        sqlx::query(AssertSqlSafe(sql))
            .bind(scope)
            .bind(&logs)
            .bind(&nums)
            .bind(&offs)
            .execute(&mut *conn)
            .await
            .map_err(|e| backend("advance", e))?;
        Ok(())
    }

    async fn read_positions(
        &self,
        scope: &str,
        parts: &[Partition<'_>],
    ) -> Result<Vec<Option<i64>>, StoreError> {
        let (logs, nums) = columns(parts);
        let sql = format!(
            "SELECT x.log, x.part, x.next_offset FROM {} AS x \
             JOIN unnest($2::text[], $3::int4[]) AS u(l, p) ON x.log = u.l AND x.part = u.p \
             WHERE x.scope = $1",
            self.positions_table()
        );
        let rows: Vec<(String, i32, Option<i64>)> = sqlx::query_as(AssertSqlSafe(sql))
            .bind(scope)
            .bind(&logs)
            .bind(&nums)
            .fetch_all(self.pool())
            .await
            .map_err(|e| backend("read_positions", e))?;
        Ok(in_order(parts, rows))
    }
}
