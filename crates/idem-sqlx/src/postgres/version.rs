//! The version guard on PostgreSQL: an entity's version raised only forward, alone or inside
//! the caller's transaction ([`VersionGuard`]).

use std::sync::Arc;

use idem_core::{Advance, DedupKey, StoreError, VersionGuard};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgConnection;

use super::{PostgresStore, backend};

impl PostgresStore {
    /// Raises `entity`'s version inside the caller's transaction (apply the state and the
    /// version in one commit). See [`VersionGuard`].
    ///
    /// # Errors
    /// Backend errors.
    ///
    /// # Cancel safety
    /// Cancel safe: nothing is visible before the caller's transaction commits.
    pub async fn advance_in(
        &self,
        conn: &mut PgConnection,
        entity: &DedupKey,
        version: i64,
    ) -> Result<Advance, StoreError> {
        let hash = entity.hash();
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.advance)))
            .bind(&hash.0[..])
            .bind(entity.scope())
            .bind(entity.id())
            .bind(version)
            .bind(self.skew())
            .execute(&mut *conn)
            .await
            .map_err(|e| backend("advance", e))?;
        if done.rows_affected() == 1 {
            return Ok(Advance::Applied);
        }
        let current: i64 = sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.sql.version_of)))
            .bind(&hash.0[..])
            .fetch_one(&mut *conn)
            .await
            .map_err(|e| backend("advance", e))?;
        Ok(Advance::Stale { current })
    }
}

impl VersionGuard for PostgresStore {
    async fn advance(&self, entity: &DedupKey, version: i64) -> Result<Advance, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("advance", e))?;
        self.advance_in(&mut conn, entity, version).await
    }
}
