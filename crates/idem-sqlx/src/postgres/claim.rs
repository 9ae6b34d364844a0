//! Claims and completions on PostgreSQL: the [`DedupStore`] calls, each one statement (or
//! one per batch) whose row lock arbitrates the race.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use idem_core::time::duration_micros;
use idem_core::{
    Claim, ClaimRequest, Completion, DedupKey, DedupStore, FailKind, Lease, Record, RecordState,
    StoreError, Timestamp,
};
use sqlx::postgres::{PgConnection, PgRow};
use sqlx::{AssertSqlSafe, Row};

use super::{PostgresStore, backend};
use crate::MAX_RESULT_BYTES;
use crate::row::{
    Won, decode_row, decode_row_at, fenced, i64_of, lease_from_parts, lease_of_record, lost,
    nullable, required,
};

impl PostgresStore {
    pub(super) async fn upsert(
        &self,
        conn: &mut PgConnection,
        stmt: &Arc<str>,
        req: &ClaimRequest,
        lease_for: Option<Duration>,
    ) -> Result<Option<PgRow>, StoreError> {
        let q = sqlx::query(AssertSqlSafe(Arc::clone(stmt)))
            .bind(&req.key.hash().0[..])
            .bind(req.key.scope())
            .bind(req.key.id())
            .bind(req.fingerprint.as_ref().map(|f| &f.0[..]))
            .bind(self.skew())
            .bind(lease_for.map(duration_micros))
            .bind(duration_micros(req.retain_for.max(lease_for.unwrap_or_default())));
        // A claim (with a lease) says whether it takes over; a mark always may.
        let q = if lease_for.is_some() { q.bind(req.takeover) } else { q };
        q.fetch_optional(&mut *conn).await.map_err(|e| backend("claim", e))
    }

    /// Claims on one connection outside a transaction: the upsert, then — only if it lost — a
    /// read that explains why. Each statement commits on its own, so one the database aborted to
    /// stay serializable (`SERIALIZABLE` connections: an upsert whose snapshot missed a
    /// concurrent claim of the key) changed nothing, and the claim decides again.
    async fn claim_on(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
    ) -> Result<Claim, StoreError> {
        let again = |e: &StoreError| crate::serialization::store_error_is_serialization_failure(e);
        for _ in 0..8 {
            match self.upsert(conn, &self.sql.claim, req, Some(req.lease_for)).await {
                Ok(Some(row)) => return lease_of(&req.key, &row).map(Claim::Acquired),
                Ok(None) => {}
                Err(e) if again(&e) => continue,
                Err(e) => return Err(e),
            }
            let (rec, now) = match self.fetch(conn, &req.key).await {
                Ok(Some(found)) => found,
                Ok(None) => continue,
                Err(e) if again(&e) => continue,
                Err(e) => return Err(e),
            };
            if let Some(claim) = lost(rec, req.fingerprint, now, req.takeover) {
                return Ok(claim);
            }
        }
        Err(StoreError::backend(
            "claim",
            true,
            "record kept changing under the claim (8 tries); try again",
        ))
    }

    /// `claim_many` as one atomic step: one transaction whose upsert locks every row of the
    /// batch (`ON CONFLICT DO UPDATE` locks the rows it does not change too) until its commit, so
    /// the read of the rows it did not win sees them as the upsert found them and no other
    /// writer — a claim, an operator's `force_*`, a purge — lands between two requests. A batch
    /// in which a record turned claimable between the upsert and that read (a lease ran out in
    /// between, eight rounds in a row) is rolled back and decided again; so is one the
    /// database aborted to stay serializable.
    async fn claim_batch(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        let again = |e: &StoreError| crate::serialization::store_error_is_serialization_failure(e);
        for _ in 0..8 {
            let mut tx = self.pool.begin().await.map_err(|e| backend("claim_many", e))?;
            let decided = match self.decide_batch(&mut tx, reqs).await {
                Ok(Some(out)) => {
                    tx.commit().await.map_err(|e| backend("claim_many", e)).map(|()| out)
                }
                // Dropping the transaction rolls it back.
                Ok(None) => continue,
                Err(e) => Err(e),
            };
            match decided {
                Ok(out) => return Ok(out),
                Err(e) if again(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::backend(
            "claim_many",
            true,
            "records kept changing under the batch (8 tries); try again",
        ))
    }

    /// The batch's statements inside its transaction, in rounds: per takeover flag one upsert
    /// and (only when some key was taken) one read. A request a round could not decide goes to
    /// the next with the rest of its key's requests ([`crate::row::keep_open`]); `None` when
    /// the batch is still open after eight rounds.
    async fn decide_batch(
        &self,
        conn: &mut PgConnection,
        reqs: &[ClaimRequest],
    ) -> Result<Option<Vec<Claim>>, StoreError> {
        let mut out: Vec<Option<Claim>> = (0..reqs.len()).map(|_| None).collect();
        let mut todo: Vec<usize> = (0..reqs.len()).collect();
        for _ in 0..8 {
            let sub: Vec<&ClaimRequest> = todo.iter().map(|&n| &reqs[n]).collect();
            let mut answers: Vec<Option<Claim>> = (0..sub.len()).map(|_| None).collect();
            for group in crate::row::takeover_groups(&sub) {
                let part: Vec<&ClaimRequest> = group.iter().map(|&j| sub[j]).collect();
                let round = self.claim_round(conn, &part).await?;
                for (answer, &j) in round.into_iter().zip(&group) {
                    answers[j] = answer;
                }
            }
            todo = crate::row::keep_open(&todo, &sub, answers, &mut out);
            if todo.is_empty() {
                return Ok(Some(out.into_iter().flatten().collect()));
            }
        }
        Ok(None)
    }

    /// One upsert of `reqs` (one takeover flag) and the read of what it lost: each request's
    /// answer, `None` when its record was claimable as read back.
    async fn claim_round(
        &self,
        conn: &mut PgConnection,
        reqs: &[&ClaimRequest],
    ) -> Result<Vec<Option<Claim>>, StoreError> {
        let (first, found) = self.upsert_many(conn, reqs, reqs[0].takeover).await?;
        let mut out = Vec::with_capacity(reqs.len());
        for (j, req) in reqs.iter().enumerate() {
            let hash = req.key.hash().0;
            out.push(match found.get(&hash) {
                Some((true, rec, _)) if first.get(&hash) == Some(&j) => {
                    Some(Claim::Acquired(lease_of_record(&req.key, rec, Timestamp::from_micros(0))))
                }
                // A repeat of a key this round won is answered from the record it wrote.
                Some((_, rec, now)) => lost(rec.clone(), req.fingerprint, *now, req.takeover),
                None => None,
            });
        }
        Ok(out)
    }

    /// Reads `key`'s record and the database's clock.
    pub(super) async fn fetch(
        &self,
        conn: &mut PgConnection,
        key: &DedupKey,
    ) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.select)))
            .bind(&key.hash().0[..])
            .bind(self.skew())
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| backend("get", e))?;
        let Some(row) = row else { return Ok(None) };
        let now: i64 = row.try_get(14).map_err(|e| backend("get", e))?;
        Ok(Some((decode_row(&row)?, Timestamp::from_micros(now))))
    }

    /// One upsert statement for a batch (`stmt`: the claim or the mark), then — only when some
    /// key was taken — one read of the losers. A key that repeats goes in once (its first
    /// occurrence), since one upsert cannot touch a row twice; rows go in key-hash order, so
    /// concurrent batches lock shared keys in one order (no deadlock). Answers: each distinct
    /// hash's first index, and each hash's row (won?, record, database now). `takeover` is
    /// every request's flag (the caller splits a batch that mixes them).
    #[allow(clippy::type_complexity)]
    async fn upsert_many(
        &self,
        conn: &mut PgConnection,
        reqs: &[&ClaimRequest],
        takeover: bool,
    ) -> Result<(HashMap<[u8; 32], usize>, HashMap<[u8; 32], (bool, Record, Timestamp)>), StoreError>
    {
        let mut first: HashMap<[u8; 32], usize> = HashMap::with_capacity(reqs.len());
        let (mut h, mut s, mut i, mut fp, mut lease, mut keep) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by_key(|&n| (reqs[n].key.hash().0, n));
        for n in order {
            let r = reqs[n];
            let hash = r.key.hash().0;
            if first.contains_key(&hash) {
                continue;
            }
            first.insert(hash, n);
            h.push(hash.to_vec());
            s.push(r.key.scope().to_owned());
            i.push(r.key.id().to_owned());
            fp.push(r.fingerprint.map(|f| f.0.to_vec()));
            lease.push(duration_micros(r.lease_for));
            keep.push(duration_micros(r.retain_for.max(r.lease_for)));
        }
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.claim_many)))
            .bind(&h)
            .bind(&s)
            .bind(&i)
            .bind(&fp)
            .bind(self.skew())
            .bind(&lease)
            .bind(&keep)
            .bind(takeover)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| backend("claim_many", e))?;
        let mut found: HashMap<[u8; 32], (bool, Record, Timestamp)> = HashMap::new();
        decode_claimed(&rows, &mut found)?;
        let taken: Vec<&[u8; 32]> = first.keys().filter(|k| !found.contains_key(*k)).collect();
        self.read_losers(conn, &taken, &mut found).await?;
        Ok((first, found))
    }

    /// Reads the records of keys an upsert did not win (a second round trip, only when some).
    /// Run unprepared, so it is planned with its array every time: as a cached generic plan made
    /// while the table was tiny it scanned the whole table once grown.
    pub(crate) async fn read_losers(
        &self,
        conn: &mut PgConnection,
        losers: &[&[u8; 32]],
        found: &mut HashMap<[u8; 32], (bool, Record, Timestamp)>,
    ) -> Result<(), StoreError> {
        if losers.is_empty() {
            return Ok(());
        }
        let losers: Vec<&[u8]> = losers.iter().map(|k| &k[..]).collect();
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.claim_many_losers)))
            .bind(&losers)
            .bind(self.skew())
            .persistent(false)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| backend("claim_many", e))?;
        decode_claimed(&rows, found)
    }

    async fn finish(
        &self,
        lease: &Lease,
        state: RecordState,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        StoreError::check_len("result", result.map_or(0, <[u8]>::len), MAX_RESULT_BYTES)?;
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.finish)))
            .bind(&lease.key().hash().0[..])
            .bind(i64_of(lease.token(), "token")?)
            .bind(i64::from(state.code()))
            .bind(result)
            .bind(self.skew())
            .bind(duration_micros(retain_for))
            .execute(&self.pool)
            .await
            .map_err(|e| backend("complete", e))?;
        fenced(done.rows_affected(), lease)
    }
}

/// The lease in a winning upsert's
/// `RETURNING attempt, token, prev_state, fingerprint, lease_until, deaths`.
fn lease_of(key: &DedupKey, row: &PgRow) -> Result<Lease, StoreError> {
    let attempt = required(row, 0, "attempt")?;
    let token = required(row, 1, "token")?;
    let prev = nullable(row, 2, "prev_state")?;
    let fp = nullable(row, 3, "fingerprint")?;
    // A claim always sets the lease end: a NULL is corrupt, not a lease that ended in 1970.
    let until = required(row, 4, "lease_until")?;
    let deaths = required(row, 5, "deaths")?;
    lease_from_parts(key, Won { attempt, token, prev, fp, deaths, until })
}

impl DedupStore for PostgresStore {
    async fn claim(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let mut conn = self.pool.acquire().await.map_err(|e| backend("claim", e))?;
        self.claim_on(&mut conn, req).await
    }

    async fn claim_many(&self, reqs: &[ClaimRequest]) -> Result<Vec<Claim>, StoreError> {
        if reqs.is_empty() {
            return Ok(Vec::new());
        }
        self.claim_batch(reqs).await
    }

    async fn complete(
        &self,
        lease: Lease,
        result: Option<&[u8]>,
        retain_for: Duration,
    ) -> Result<(), StoreError> {
        self.finish(&lease, RecordState::Completed, result, retain_for).await
    }

    async fn complete_many(
        &self,
        items: Vec<Completion>,
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let mut out: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(items.len());
        let (mut h, mut tok, mut res, mut keep) = (vec![], vec![], vec![], vec![]);
        for c in &items {
            if let Err(e) = StoreError::check_len(
                "result",
                c.result.as_ref().map_or(0, Vec::len),
                MAX_RESULT_BYTES,
            ) {
                out.push(Some(Err(e)));
                continue;
            }
            out.push(None);
            h.push(c.lease.key().hash().0.to_vec());
            tok.push(i64_of(c.lease.token(), "token")?);
            res.push(c.result.clone());
            keep.push(duration_micros(c.retain_for));
        }
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.complete_many)))
            .bind(&h)
            .bind(&tok)
            .bind(&res)
            .bind(&keep)
            .bind(self.skew())
            // Planned with its arrays on every run: a cached generic plan chosen while the
            // table was tiny (sequential scan, hash join) would read the whole table per batch
            // once it has grown (test: batch_statements_stay_index_lookups_as_the_table_grows).
            .persistent(false)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| backend("complete_many", e))?;
        let mut done = std::collections::HashSet::with_capacity(rows.len());
        for row in &rows {
            let get = |e| backend("complete_many", e);
            let hash: Vec<u8> = row.try_get(0).map_err(get)?;
            let token: i64 = row.try_get(1).map_err(get)?;
            done.insert((hash, token));
        }
        Ok(items
            .iter()
            .zip(out)
            .map(|(c, pre)| {
                pre.unwrap_or_else(|| {
                    let token = i64::try_from(c.lease.token()).unwrap_or(-1);
                    // `remove`: a lease twice in the batch completed once, for the first.
                    if done.remove(&(c.lease.key().hash().0.to_vec(), token)) {
                        Ok(())
                    } else {
                        Err(StoreError::LeaseLost { key: c.lease.key().to_string() })
                    }
                })
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
        self.finish(&lease, kind.state(), Some(reason.as_bytes()), retain_for).await
    }

    async fn release(&self, lease: Lease) -> Result<(), StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.release)))
            .bind(&lease.key().hash().0[..])
            .bind(i64_of(lease.token(), "token")?)
            .bind(self.skew())
            .execute(&self.pool)
            .await
            .map_err(|e| backend("release", e))?;
        fenced(done.rows_affected(), &lease)
    }

    async fn extend(&self, lease: &mut Lease, by: Duration) -> Result<(), StoreError> {
        let until: Option<Option<i64>> =
            sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.sql.extend)))
                .bind(&lease.key().hash().0[..])
                .bind(i64_of(lease.token(), "token")?)
                .bind(self.skew())
                .bind(duration_micros(by))
                .fetch_optional(&self.pool)
                .await
                .map_err(|e| backend("extend", e))?;
        let Some(Some(until)) = until else {
            return Err(StoreError::LeaseLost { key: lease.key().to_string() });
        };
        lease.set_until(Timestamp::from_micros(until));
        Ok(())
    }

    async fn purge(&self, limit: usize) -> Result<u64, StoreError> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.sql.purge)))
            .bind(self.skew())
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            // Planned each time, as `complete_many` (a plan cached on a tiny table scans it all).
            .persistent(false)
            .execute(&self.pool)
            .await
            .map_err(|e| backend("purge", e))?;
        Ok(done.rows_affected())
    }

    async fn check(&self) -> Result<Vec<String>, StoreError> {
        PostgresStore::check(self).await
    }
}

/// Adds `claim_many`'s rows (winners or losers) to `found`, by key hash.
fn decode_claimed(
    rows: &[PgRow],
    found: &mut HashMap<[u8; 32], (bool, Record, Timestamp)>,
) -> Result<(), StoreError> {
    for row in rows {
        let get = |e| backend("claim_many", e);
        let won: bool = row.try_get(0).map_err(get)?;
        // The record columns follow the leading `won` flag.
        let raw = decode_row_at(row, 1)?;
        let now: i64 = row.try_get(15).map_err(get)?;
        found.insert(raw.key_hash.0, (won, raw, Timestamp::from_micros(now)));
    }
    Ok(())
}
