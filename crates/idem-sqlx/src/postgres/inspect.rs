//! What an operator reads and forces on PostgreSQL ([`InspectStore`]).

use std::sync::Arc;

use idem_core::{Counts, DedupKey, InspectStore, ListFilter, Record, StoreError};
use sqlx::AssertSqlSafe;

use super::{PostgresStore, backend};
use crate::MAX_RESULT_BYTES;
use crate::row::decode_row;

impl InspectStore for PostgresStore {
    async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("get", e))?;
        Ok(self.fetch(&mut conn, key).await?.map(|(r, _)| r))
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.list)))
            .bind(filter.scope.as_deref())
            .bind(filter.state.map(|s| i64::from(s.code())))
            .bind(i64::try_from(filter.limit).unwrap_or(i64::MAX))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("list", e))?;
        rows.iter().map(decode_row).collect()
    }

    async fn count(&self, scope: Option<&str>) -> Result<Counts, StoreError> {
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.count)))
            .bind(scope)
            .bind(self.skew())
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("count", e))?;
        crate::row::counts_of(&rows)
    }

    async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.force_release)))
            .bind(&key.hash().0[..])
            .bind(self.skew())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("force_release", e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn force_fail(&self, key: &DedupKey, reason: &str) -> Result<bool, StoreError> {
        StoreError::check_len("reason", reason.len(), MAX_RESULT_BYTES)?;
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.force_fail)))
            .bind(&key.hash().0[..])
            .bind(self.skew())
            .bind(reason.as_bytes())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("force_fail", e))?;
        Ok(done.rows_affected() == 1)
    }
}
