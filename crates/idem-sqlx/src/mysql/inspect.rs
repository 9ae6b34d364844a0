//! What an operator reads and forces on MySQL / MariaDB ([`InspectStore`]).

use idem_core::{Counts, DedupKey, InspectStore, ListFilter, Record, StoreError};
use sqlx::mysql::MySqlRow;

use super::{MySqlStore, backend};
use crate::MAX_RESULT_BYTES;
use crate::row::decode_row;

impl InspectStore for MySqlStore {
    async fn get(&self, key: &DedupKey) -> Result<Option<Record>, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("get", e))?;
        Ok(self.fetch(&mut conn, key, false).await?.map(|(r, _)| r))
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        let mut b = self
            .binds()
            .int("list_state", filter.state.map(|s| i64::from(s.code())))
            .int("limit", Some(i64::try_from(filter.limit).unwrap_or(i64::MAX)));
        if let Some(scope) = &filter.scope {
            b = b.text("scope", scope);
        }
        let rows: Vec<MySqlRow> =
            self.sql.list.query(&b).fetch_all(&self.pool).await.map_err(|e| backend("list", e))?;
        rows.iter().map(decode_row).collect()
    }

    async fn count(&self, scope: Option<&str>) -> Result<Counts, StoreError> {
        let mut b = self.binds();
        if let Some(scope) = scope {
            b = b.text("scope", scope);
        }
        let rows = self
            .sql
            .count
            .query(&b)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("count", e))?;
        crate::row::counts_of(&rows)
    }

    async fn force_release(&self, key: &DedupKey) -> Result<bool, StoreError> {
        let b = self.binds().bytes("hash", Some(&key.hash().0));
        let done = self
            .sql
            .force_release
            .query(&b)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("force_release", e))?;
        Ok(done.rows_affected() == 1)
    }

    async fn force_fail(&self, key: &DedupKey, reason: &str) -> Result<bool, StoreError> {
        StoreError::check_len("reason", reason.len(), MAX_RESULT_BYTES)?;
        let b = self
            .binds()
            .bytes("hash", Some(&key.hash().0))
            .bytes("result", Some(reason.as_bytes()));
        let done = self
            .sql
            .force_fail
            .query(&b)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("force_fail", e))?;
        Ok(done.rows_affected() == 1)
    }
}
