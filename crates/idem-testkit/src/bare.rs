//! The hand-written durable loop, for benchmarks: what a user would write without idem to get
//! the same guarantee as its inbox — fetch a batch, `BEGIN`, one multi-row `INSERT … ON
//! CONFLICT DO NOTHING` of the batch's keys, `COMMIT`, ack — so an adapter's figures can be
//! put beside it as a ratio.
//!
//! The broker side is the bench's own raw client code ([`BareBroker`]); the database side is
//! [`BareMarks`] on PostgreSQL, MariaDB/MySQL or SQLite. [`durable_lane`] runs one lane of the
//! loop, optionally pipelined as idem's lanes are: batch k's transaction overlaps the fetch of
//! batch k + 1 and the acks of batch k − 1, and no batch is acked before its commit.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

use sqlx::{MySqlPool, PgPool, SqlitePool};

type BoxErr = Box<dyn std::error::Error + Send + Sync>;

/// Whether the benchmark pipelines its lanes, idem's and the bare loop's alike:
/// `IDEM_BENCH_PIPELINE=0` turns it off on both sides.
#[must_use]
pub fn pipelined() -> bool {
    std::env::var("IDEM_BENCH_PIPELINE").map_or(true, |v| v != "0")
}

/// A broker as the bench's raw client drives it.
pub trait BareBroker: Sync {
    /// One fetched message, with what its ack needs.
    type Msg: Send;

    /// Up to one batch (empty when none came within the bench's wait).
    fn fetch(&self) -> impl Future<Output = Result<Vec<Self::Msg>, BoxErr>> + Send;

    /// The message's dedup key (its message id).
    fn key(msg: &Self::Msg) -> String;

    /// Acknowledges a batch.
    fn ack(&self, msgs: Vec<Self::Msg>) -> impl Future<Output = Result<(), BoxErr>> + Send;
}

/// A table of seen keys (`k` text primary key) in one of the SQL databases; the table is the
/// bench's own (create it with [`create`](Self::create), drop it with [`drop_table`](Self::drop_table)).
#[derive(Debug, Clone)]
pub enum BareMarks {
    /// PostgreSQL: `INSERT … SELECT unnest($1) ON CONFLICT DO NOTHING`.
    Postgres(PgPool, String),
    /// MariaDB / MySQL: `INSERT … VALUES (?), … ON DUPLICATE KEY UPDATE k = k`.
    MySql(MySqlPool, String),
    /// SQLite: `INSERT … VALUES (?), … ON CONFLICT DO NOTHING`.
    Sqlite(SqlitePool, String),
}

impl BareMarks {
    fn table(&self) -> &str {
        match self {
            Self::Postgres(_, t) | Self::MySql(_, t) | Self::Sqlite(_, t) => t,
        }
    }

    fn checked(&self) -> Result<&str, BoxErr> {
        let t = self.table();
        if t.is_empty() || !t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(format!("bare marks table name {t:?}: use [A-Za-z0-9_]").into());
        }
        Ok(t)
    }

    /// Creates the table (if missing).
    ///
    /// # Errors
    /// The database's.
    pub async fn create(&self) -> Result<(), BoxErr> {
        let t = self.checked()?;
        let sql = match self {
            Self::MySql(..) => {
                format!("CREATE TABLE IF NOT EXISTS {t} (k VARCHAR(255) PRIMARY KEY)")
            }
            _ => format!("CREATE TABLE IF NOT EXISTS {t} (k TEXT PRIMARY KEY)"),
        };
        self.run(&sql).await
    }

    /// Drops the table.
    ///
    /// # Errors
    /// The database's.
    pub async fn drop_table(&self) -> Result<(), BoxErr> {
        let t = self.checked()?;
        self.run(&format!("DROP TABLE IF EXISTS {t}")).await
    }

    async fn run(&self, sql: &str) -> Result<(), BoxErr> {
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        match self {
            Self::Postgres(p, _) => {
                sqlx::raw_sql(sql).execute(p).await?;
            }
            Self::MySql(p, _) => {
                sqlx::raw_sql(sql).execute(p).await?;
            }
            Self::Sqlite(p, _) => {
                sqlx::raw_sql(sql).execute(p).await?;
            }
        }
        Ok(())
    }

    /// One transaction: `BEGIN`, one multi-row insert of `keys` ignoring those present,
    /// `COMMIT`. Returns how many were new.
    ///
    /// # Errors
    /// The database's.
    pub async fn mark(&self, keys: &[String]) -> Result<u64, BoxErr> {
        if keys.is_empty() {
            return Ok(0);
        }
        let t = self.checked()?;
        let values = || vec!["(?)"; keys.len()].join(", ");
        Ok(match self {
            Self::Postgres(p, _) => {
                let sql =
                    format!("INSERT INTO {t} (k) SELECT unnest($1::text[]) ON CONFLICT DO NOTHING");
                let mut tx = p.begin().await?;
                let n = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(keys).execute(&mut *tx).await?;
                tx.commit().await?;
                n.rows_affected()
            }
            Self::MySql(p, _) => {
                let sql = format!(
                    "INSERT INTO {t} (k) VALUES {} ON DUPLICATE KEY UPDATE k = k",
                    values()
                );
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
                for k in keys {
                    q = q.bind(k);
                }
                let mut tx = p.begin().await?;
                let n = q.execute(&mut *tx).await?;
                tx.commit().await?;
                n.rows_affected()
            }
            Self::Sqlite(p, _) => {
                let sql = format!("INSERT INTO {t} (k) VALUES {} ON CONFLICT DO NOTHING", values());
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
                for k in keys {
                    q = q.bind(k);
                }
                let mut tx = p.begin().await?;
                let n = q.execute(&mut *tx).await?;
                tx.commit().await?;
                n.rows_affected()
            }
        })
    }
}

/// One lane of the durable loop, until `done` (shared by the lanes, counted at the ack)
/// reaches `n`. Pipelined, each step joins batch k's transaction with the fetch of batch k + 1
/// and the acks of batch k − 1 (committed in the step before).
///
/// # Errors
/// The broker's or the database's first error.
pub async fn durable_lane<B: BareBroker>(
    broker: &B,
    marks: &BareMarks,
    n: usize,
    done: &AtomicUsize,
    pipelined: bool,
) -> Result<(), BoxErr> {
    let keys = |batch: &[B::Msg]| batch.iter().map(B::key).collect::<Vec<_>>();
    if !pipelined {
        while done.load(Ordering::SeqCst) < n {
            let batch = broker.fetch().await?;
            marks.mark(&keys(&batch)).await?;
            let got = batch.len();
            if got > 0 {
                broker.ack(batch).await?;
            }
            done.fetch_add(got, Ordering::SeqCst);
        }
        return Ok(());
    }
    let mut current = broker.fetch().await?;
    let mut committed: Vec<B::Msg> = Vec::new();
    loop {
        let acked = committed.len();
        let ack = async {
            if committed.is_empty() {
                Ok(())
            } else {
                broker.ack(std::mem::take(&mut committed)).await
            }
        };
        let finished = done.load(Ordering::SeqCst) + acked + current.len() >= n;
        let fetch = async { if finished { Ok(Vec::new()) } else { broker.fetch().await } };
        let batch_keys = keys(&current);
        let (marked, next, ack) = tokio::join!(marks.mark(&batch_keys), fetch, ack);
        marked?;
        ack?;
        done.fetch_add(acked, Ordering::SeqCst);
        committed = std::mem::replace(&mut current, next?);
        if committed.is_empty() && current.is_empty() && done.load(Ordering::SeqCst) >= n {
            return Ok(());
        }
        if committed.is_empty() && current.is_empty() {
            current = broker.fetch().await?;
        }
    }
}
