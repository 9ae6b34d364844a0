//! Claims and completions on MySQL / MariaDB: the [`DedupStore`] calls, each one upsert (or
//! one per batch) whose row arbitrates the race.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

use idem_core::time::duration_micros;
use idem_core::{
    Claim, ClaimRequest, Completion, DedupKey, DedupStore, FailKind, Lease, Record, RecordState,
    StoreError, Timestamp,
};
use sqlx::mysql::MySqlConnection;
use sqlx::{AssertSqlSafe, Row};

use super::{MAX_ROWS, MySqlStore, backend, error_number, is_duplicate_key, nonce};
use crate::MAX_RESULT_BYTES;
use crate::row::{decode_row, fenced, i64_of, lease_of_record, lost};

impl MySqlStore {
    /// Reads `key`'s record and the server's clock (`locked`: a locking read).
    pub(super) async fn fetch(
        &self,
        conn: &mut MySqlConnection,
        key: &DedupKey,
        locked: bool,
    ) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let stmt = if locked { &self.sql.select_locked } else { &self.sql.select };
        let row = stmt
            .query(&self.binds().bytes("hash", Some(&key.hash().0)))
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| backend("get", e))?;
        let Some(row) = row else { return Ok(None) };
        let now: i64 = row.try_get(15).map_err(|e| backend("get", e))?;
        Ok(Some((decode_row(&row)?, Timestamp::from_micros(now))))
    }

    /// Claims in one transaction: rounds of one upsert per takeover flag and `MAX_ROWS` chunk
    /// (its rows stay locked until the commit: `ON DUPLICATE KEY UPDATE` locks a row it leaves
    /// as it was too), each followed by the rows read back with a locking read. Nothing lands
    /// between the upsert and the read, nor between two requests of the batch, so the batch is
    /// one atomic step. A request the round could not decide goes to the next round with the
    /// rest of its key's requests (see [`crate::row::keep_open`]); a batch still open after
    /// eight rounds is rolled back and tried again.
    async fn claim_batch(&self, reqs: &[&ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        for _ in 0..8 {
            let mut tx = self.pool.begin().await.map_err(|e| backend("claim", e))?;
            if let Some(out) = self.decide_batch(&mut tx, reqs).await? {
                tx.commit().await.map_err(|e| backend("claim", e))?;
                return Ok(out);
            }
            // Dropping the transaction rolls it back.
        }
        Err(StoreError::backend("claim", true, "records kept changing under the claim (8 tries)"))
    }

    async fn decide_batch(
        &self,
        conn: &mut MySqlConnection,
        reqs: &[&ClaimRequest],
    ) -> Result<Option<Vec<Claim>>, StoreError> {
        let mut out: Vec<Option<Claim>> = (0..reqs.len()).map(|_| None).collect();
        let mut todo: Vec<usize> = (0..reqs.len()).collect();
        for _ in 0..8 {
            let sub: Vec<&ClaimRequest> = todo.iter().map(|&n| reqs[n]).collect();
            let mut answers: Vec<Option<Claim>> = (0..sub.len()).map(|_| None).collect();
            for group in crate::row::takeover_groups(&sub) {
                for chunk in group.chunks(MAX_ROWS) {
                    let part: Vec<&ClaimRequest> = chunk.iter().map(|&j| sub[j]).collect();
                    let rows = self
                        .upsert_round(conn, &part, RecordState::InProgress, part[0].takeover)
                        .await?;
                    for ((row, req), &j) in rows.into_iter().zip(&part).zip(chunk) {
                        answers[j] = row.and_then(|(won, rec, now)| {
                            if !won {
                                return lost(rec, req.fingerprint, now, req.takeover);
                            }
                            Some(Claim::Acquired(lease_of_record(&req.key, &rec, now)))
                        });
                    }
                }
            }
            todo = crate::row::keep_open(&todo, &sub, answers, &mut out);
            if todo.is_empty() {
                return Ok(Some(out.into_iter().flatten().collect()));
            }
        }
        Ok(None)
    }

    /// One upsert of distinct keys into `state` (in progress: a claim; completed: an inbox
    /// mark), rows in key-hash order so concurrent batches lock them in one order, then the
    /// rows read back with a locking read (it sees the latest commit; the caller's transaction
    /// holds the rows locked from the upsert on). For
    /// each request: whether it won, its record and the database's now; `None` when its row is
    /// gone (purged meanwhile). `takeover`: whether a lease that ran out is taken over.
    pub(crate) async fn upsert_round(
        &self,
        conn: &mut MySqlConnection,
        reqs: &[&ClaimRequest],
        state: RecordState,
        takeover: bool,
    ) -> Result<Vec<Option<(bool, Record, Timestamp)>>, StoreError> {
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by_key(|&i| reqs[i].key.hash().0);
        let mut first: HashMap<[u8; 32], (usize, i64)> = HashMap::new();
        let skew = self.skew.micros();
        let mut unique = Vec::new();
        for &i in &order {
            let h = reqs[i].key.hash().0;
            if let std::collections::hash_map::Entry::Vacant(e) = first.entry(h) {
                e.insert((i, nonce()));
                unique.push(i);
            }
        }
        let leased = state == RecordState::InProgress;
        let mut q = sqlx::query(AssertSqlSafe(self.sql.claim_many(unique.len(), state, takeover)));
        for &i in &unique {
            let r = reqs[i];
            let (_, owner) = first[&r.key.hash().0];
            q = q
                .bind(r.key.hash().0.to_vec())
                .bind(r.key.scope().to_owned())
                .bind(r.key.id().to_owned())
                .bind(r.fingerprint.map(|f| f.0.to_vec()))
                .bind(skew)
                .bind(skew)
                .bind(skew)
                .bind(skew)
                .bind(leased.then(|| duration_micros(r.lease_for)))
                .bind(skew)
                .bind(duration_micros(r.retain_for.max(r.lease_for)))
                .bind(owner);
        }
        q.execute(&mut *conn).await.map_err(|e| backend("claim", e))?;
        let mut sel = sqlx::query(AssertSqlSafe(self.sql.select_many(unique.len()))).bind(skew);
        for &i in &unique {
            sel = sel.bind(reqs[i].key.hash().0.to_vec());
        }
        let rows = sel.fetch_all(&mut *conn).await.map_err(|e| backend("claim", e))?;
        let mut found: HashMap<[u8; 32], (Record, i64, Timestamp)> = HashMap::new();
        for row in &rows {
            let get = |e| backend("claim", e);
            let rec = decode_row(row)?;
            let owner: i64 = row.try_get(14).map_err(get)?;
            let now: i64 = row.try_get(15).map_err(get)?;
            found.insert(rec.key_hash.0, (rec, owner, Timestamp::from_micros(now)));
        }
        Ok(reqs
            .iter()
            .enumerate()
            .map(|(i, req)| {
                let h = req.key.hash().0;
                let (rec, owner, now) = found.get(&h)?;
                let (first_i, mine) = first[&h];
                let won = first_i == i && *owner == mine && rec.state == state;
                Some((won, rec.clone(), *now))
            })
            .collect())
    }

    async fn finish(
        &self,
        conn: &mut MySqlConnection,
        lease: &Lease,
        state: RecordState,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        StoreError::check_len("result", result.map_or(0, <[u8]>::len), MAX_RESULT_BYTES)?;
        let b = self
            .binds()
            .int("state", Some(i64::from(state.code())))
            .bytes("result", result)
            .int("keep", Some(duration_micros(retain_for)))
            .bytes("hash", Some(&lease.key().hash().0))
            .int("token", Some(i64_of(lease.token(), "token")?));
        let done = self
            .sql
            .finish
            .query(&b)
            .execute(&mut *conn)
            .await
            .map_err(|e| backend("complete", e))?;
        fenced(done.rows_affected(), lease)
    }
}

impl MySqlStore {
    /// The fresh-key fast path: a plain `INSERT … RETURNING`. `None` when the key exists (or the
    /// server has no `RETURNING`): decide it with the upsert.
    async fn try_insert(&self, req: &ClaimRequest) -> Result<Option<Lease>, StoreError> {
        if !self.returning.load(Ordering::Relaxed) {
            return Ok(None);
        }
        let b = self
            .binds()
            .bytes("hash", Some(&req.key.hash().0))
            .text("scope", req.key.scope())
            .text("id", req.key.id())
            .bytes("fp", req.fingerprint.as_ref().map(|f| &f.0[..]))
            .int("lease", Some(duration_micros(req.lease_for)))
            .int("keep", Some(duration_micros(req.retain_for.max(req.lease_for))))
            .int("owner", Some(nonce()));
        // The whole reply, not its first row: the row is sent before the statement commits, and
        // a commit that fails (on Galera: certification lost to the same key inserted through
        // another node) is reported after it. `fetch_one` returned that row as a won claim.
        match self.sql.insert_claim.query(&b).fetch_all(&self.pool).await {
            Ok(rows) => {
                let [row] = &rows[..] else {
                    let what = format!("INSERT … RETURNING gave {} rows, not 1", rows.len());
                    return Err(StoreError::Corrupt { what });
                };
                let get = |e| backend("claim", e);
                let token: i64 = row.try_get(0).map_err(get)?;
                let until: Option<i64> = row.try_get(1).map_err(get)?;
                Ok(Some(Lease::new(
                    req.key.clone(),
                    req.fingerprint,
                    u64::try_from(token)
                        .map_err(|_| StoreError::Corrupt { what: format!("token {token}") })?,
                    1,
                    Timestamp::from_micros(until.unwrap_or_default()),
                    None,
                )))
            }
            Err(e) if is_duplicate_key(&e) => Ok(None),
            // 1064: a server without INSERT … RETURNING (MySQL): use the upsert from now on.
            Err(e) if error_number(&e) == Some(1064) => {
                self.returning.store(false, Ordering::Relaxed);
                Ok(None)
            }
            Err(e) => Err(backend("claim", e)),
        }
    }
}

impl DedupStore for MySqlStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        if let Some(lease) = self.try_insert(req).await? {
            return Ok(Claim::Acquired(lease));
        }
        let mut answers = self.claim_batch(&[req]).await?;
        answers.pop().ok_or_else(|| StoreError::Corrupt { what: "claim without an answer".into() })
    }

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        let refs: Vec<&ClaimRequest> = reqs.iter().collect();
        self.claim_batch(&refs).await
    }

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("complete", e))?;
        self.finish(&mut conn, &lease, RecordState::Completed, result, retain_for).await
    }

    /// One statement (one commit) for the batch; a second read only when some did not apply.
    async fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut out: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(items.len());
        let mut todo = Vec::new();
        for (i, c) in items.iter().enumerate() {
            let len = c.result.as_ref().map_or(0, Vec::len);
            match StoreError::check_len("result", len, MAX_RESULT_BYTES) {
                Err(e) => out.push(Some(Err(e))),
                Ok(()) => {
                    out.push(None);
                    todo.push(i);
                }
            }
        }
        let skew = self.skew.micros();
        for chunk in todo.chunks(MAX_ROWS) {
            let mut q = sqlx::query(AssertSqlSafe(self.sql.complete_many(chunk.len())));
            for &i in chunk {
                let c = &items[i];
                q = q
                    .bind(c.lease.key().hash().0.to_vec())
                    .bind(i64_of(c.lease.token(), "token")?)
                    .bind(c.result.clone())
                    .bind(duration_micros(c.retain_for));
            }
            let done = q
                .bind(skew)
                .bind(skew)
                .execute(&self.pool)
                .await
                .map_err(|e| backend("complete_many", e))?;
            let applied = usize::try_from(done.rows_affected()).unwrap_or(0);
            if applied == chunk.len() {
                for &i in chunk {
                    out[i] = Some(Ok(()));
                }
                continue;
            }
            // Some leases were stale. A row completed with the lease's token was completed by
            // this statement, or by an earlier completion of the same lease (a repeat, which
            // must answer `LeaseLost`): the statement gave every row it changed one
            // `updated_at` (its `NOW(6)`), later than any earlier completion's.
            let mut sel = sqlx::query(AssertSqlSafe(self.sql.tokens_of(chunk.len())));
            for &i in chunk {
                sel = sel.bind(items[i].lease.key().hash().0.to_vec());
            }
            let rows = sel.fetch_all(&self.pool).await.map_err(|e| backend("complete_many", e))?;
            let mine = |i: usize| {
                let l = &items[i].lease;
                (l.key().hash().0.to_vec(), i64::try_from(l.token()).unwrap_or(-1))
            };
            let leases: std::collections::HashSet<(Vec<u8>, i64)> =
                chunk.iter().map(|&i| mine(i)).collect();
            let mut completed = std::collections::HashMap::new();
            for row in &rows {
                let get = |e| backend("complete_many", e);
                let (h, tok, state, at): (Vec<u8>, i64, i64, i64) = (
                    row.try_get(0).map_err(get)?,
                    row.try_get(1).map_err(get)?,
                    row.try_get(2).map_err(get)?,
                    row.try_get(3).map_err(get)?,
                );
                let lease = (h, tok);
                if state == i64::from(RecordState::Completed.code()) && leases.contains(&lease) {
                    completed.insert(lease, at);
                }
            }
            let now = completed.values().copied().max();
            let mut ours: std::collections::HashSet<(Vec<u8>, i64)> = completed
                .into_iter()
                .filter(|(_, at)| applied > 0 && Some(*at) == now)
                .map(|(k, _)| k)
                .collect();
            for &i in chunk {
                // `remove`: the same lease twice in one batch completes once.
                out[i] = Some(if ours.remove(&mine(i)) {
                    Ok(())
                } else {
                    Err(StoreError::LeaseLost { key: items[i].lease.key().to_string() })
                });
            }
        }
        Ok(out
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| Err(StoreError::backend("complete_many", false, "not decided")))
            })
            .collect())
    }

    async fn fail(
        &self,
        lease: Lease,
        kind: FailKind,
        reason: &str,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("fail", e))?;
        self.finish(&mut conn, &lease, kind.state(), Some(reason.as_bytes()), retain_for).await
    }

    async fn release(&self, lease: Lease) -> Result<(), StoreError> {
        let b = self
            .binds()
            .bytes("hash", Some(&lease.key().hash().0))
            .int("token", Some(i64_of(lease.token(), "token")?));
        let done = self
            .sql
            .release
            .query(&b)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("release", e))?;
        fenced(done.rows_affected(), &lease)
    }

    async fn extend(&self, lease: &mut Lease, by: Duration) -> Result<(), StoreError> {
        let b = self
            .binds()
            .int("by", Some(duration_micros(by)))
            .bytes("hash", Some(&lease.key().hash().0))
            .int("token", Some(i64_of(lease.token(), "token")?));
        let done = self
            .sql
            .extend
            .query(&b)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("extend", e))?;
        fenced(done.rows_affected(), lease)?;
        let until: Option<i64> = self
            .sql
            .lease_until
            .query(&b)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| backend("extend", e))?
            .map(|r| r.try_get::<Option<i64>, _>(0))
            .transpose()
            .map_err(|e| backend("extend", e))?
            .flatten();
        let Some(until) = until else {
            return Err(StoreError::LeaseLost { key: lease.key().to_string() });
        };
        lease.set_until(Timestamp::from_micros(until));
        Ok(())
    }

    async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        let b = self.binds().int("limit", Some(i64::try_from(limit).unwrap_or(i64::MAX)));
        let done =
            self.sql.purge.query(&b).execute(&self.pool).await.map_err(|e| backend("purge", e))?;
        Ok(done.rows_affected())
    }

    async fn check(&self) -> Result<Vec<String>, StoreError> {
        MySqlStore::check(self).await
    }
}
