//! `idem bench-sql`: PostgreSQL or MySQL store throughput beside the bare SQL primitives,
//! through the same driver (sqlx), in the same run, in a schema/tables of its own.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idem::{BatchConfig, Batched, Claim, ClaimRequest, DedupKey, DedupStore, TxInbox as _};
use idem::{MySqlStore, PostgresStore};

/// Settings of a SQL benchmark run.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct BenchSqlArgs {
    /// Server URL: `postgres://…` or `mysql://…`. Or set IDEM_BENCH_URL (keeps a password out
    /// of the shell history and `ps`; never shown).
    #[arg(
        long,
        default_value = "postgres://postgres@127.0.0.1:5432/test",
        env = "IDEM_BENCH_URL",
        hide_env_values = true
    )]
    url: String,
    /// Messages per measurement.
    #[arg(long, default_value_t = 3000)]
    messages: usize,
    /// Concurrent tasks for the per-message measurements (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    concurrency: Vec<usize>,
    /// Keys per `claim_many` batch.
    #[arg(long, default_value_t = 100)]
    batch: usize,
    /// Tasks for the group-commit measurement.
    #[arg(long, default_value_t = 32)]
    group_tasks: usize,
    /// Batches in flight at once for the group-commit measurement (`BatchConfig::max_in_flight`).
    #[arg(long, default_value_t = 2)]
    in_flight: usize,
    /// Only the group-commit and batch measurements.
    #[arg(long)]
    batches_only: bool,
    /// Whether the pool pings each connection before handing it out (sqlx's default: one more
    /// round trip per statement outside a transaction). Applies to raw and idem rows alike.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    ping_before_acquire: bool,
}

struct Row {
    name: String,
    tasks: usize,
    ops: usize,
    elapsed: Duration,
}

impl Row {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

fn hash(run: &str, i: usize) -> Vec<u8> {
    DedupKey::new(run, format!("m-{i}")).map(|k| k.hash().0.to_vec()).unwrap_or_default()
}

fn req(run: &str, i: usize) -> anyhow::Result<ClaimRequest> {
    Ok(ClaimRequest::new(
        DedupKey::new(run, format!("m-{i}"))?,
        None,
        Duration::from_secs(30),
        Duration::from_secs(86_400),
    ))
}

/// Runs `f(i)` for `i in 0..n` on `c` tasks pulling from one counter; returns the row.
async fn measure<F, Fut>(name: &str, n: usize, c: usize, f: F) -> anyhow::Result<Row>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = anyhow::Result<()>> + Send,
{
    let f = Arc::new(f);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..c {
        let (f, next) = (Arc::clone(&f), Arc::clone(&next));
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    return anyhow::Ok(());
                }
                f(i).await?;
            }
        }));
    }
    for t in tasks {
        t.await??;
    }
    let row = Row { name: name.to_owned(), tasks: c, ops: n, elapsed: started.elapsed() };
    eprintln!("  {:<64} {:>3} tasks {:>9.0} /s", row.name, c, row.rate());
    Ok(row)
}

async fn claim_complete<S: DedupStore>(s: &S, run: &str, i: usize) -> anyhow::Result<()> {
    let Claim::Acquired(lease) = s.claim(&req(run, i)?).await? else {
        anyhow::bail!("{run}/{i} not acquired");
    };
    s.complete(lease, Some(b"ok"), Duration::from_secs(86_400)).await?;
    Ok(())
}

/// The store's claim + complete per message at `c` tasks.
async fn per_message<S>(store: &S, n: usize, c: usize) -> anyhow::Result<Row>
where
    S: DedupStore + Clone + 'static,
{
    let (s, run) = (store.clone(), format!("cc-{c}"));
    measure("idem: claim + complete per message", n, c, move |i| {
        let (s, run) = (s.clone(), run.clone());
        async move { claim_complete(&s, &run, i).await }
    })
    .await
}

/// Group commit through `Batched` at `--group-tasks` tasks: claim + complete, then claims only.
async fn group_commit<S>(store: &S, args: &BenchSqlArgs) -> anyhow::Result<Vec<Row>>
where
    S: DedupStore + Clone + 'static,
{
    let (g, gn) = (args.group_tasks, args.messages * 4);
    let batched = Batched::new(store.clone(), BatchConfig::default().max_in_flight(args.in_flight));
    let s = batched.clone();
    let both = measure("idem: Batched claim + complete (group commit)", gn, g, move |i| {
        let s = s.clone();
        async move { claim_complete(&s, "group", i).await }
    })
    .await?;
    let claims = measure("idem: Batched claim only (durable claims/s)", gn, g, move |i| {
        let s = batched.clone();
        async move {
            let Claim::Acquired(_lease) = s.claim(&req("group-claim", i)?).await? else {
                anyhow::bail!("not acquired");
            };
            Ok(())
        }
    })
    .await?;
    Ok(vec![both, claims])
}

/// `claim_many` of `b` fresh keys, `batches` times, on one task; ops are counted in keys.
async fn claim_many<S>(store: &S, b: usize, batches: usize) -> anyhow::Result<Row>
where
    S: DedupStore + Clone + 'static,
{
    let s = store.clone();
    let name = format!("idem: claim_many({b}), one statement per batch");
    let mut row = measure(&name, batches, 1, move |j| {
        let s = s.clone();
        async move {
            let reqs =
                (j * b..(j + 1) * b).map(|i| req("many", i)).collect::<anyhow::Result<Vec<_>>>()?;
            let claims = s.claim_many(&reqs).await?;
            anyhow::ensure!(
                claims.iter().all(|c| matches!(c, Claim::Acquired(_))),
                "batch not acquired"
            );
            Ok(())
        }
    })
    .await?;
    row.ops = batches * b;
    Ok(row)
}

pub(crate) async fn run(args: BenchSqlArgs) -> anyhow::Result<()> {
    let rows = if args.url.starts_with("postgres") {
        postgres(&args).await?
    } else if args.url.starts_with("mysql") || args.url.starts_with("mariadb") {
        mysql(&args).await?
    } else {
        anyhow::bail!(
            "--url {}: unknown scheme; expected postgres:// or mysql://",
            idem::redact::Redacted(&args.url)
        );
    };
    let db = if args.url.starts_with("postgres") { "PostgreSQL" } else { "MySQL/MariaDB" };
    println!();
    println!(
        "| measurement ({db}, {} messages per row) | tasks | ops/s | seconds |",
        args.messages
    );
    println!("| --- | ---: | ---: | ---: |");
    for r in &rows {
        println!("| {} | {} | {:.0} | {:.2} |", r.name, r.tasks, r.rate(), r.elapsed.as_secs_f64());
    }
    println!();
    let rate = |prefix: &str, c: usize| {
        rows.iter().find(|r| r.name.starts_with(prefix) && r.tasks == c).map(Row::rate)
    };
    for &c in &args.concurrency {
        if let (Some(i), Some(r)) =
            (rate("idem: claim + complete", c), rate("raw: INSERT + UPDATE", c))
        {
            println!("claim + complete vs bare insert + update, {c} tasks: {:.2}×", i / r);
        }
        if let (Some(i), Some(r)) = (rate("idem: inbox mark", c), rate("raw: marker INSERT", c)) {
            println!(
                "inbox mark + commit vs bare marker insert + commit, {c} tasks: {:.2}×",
                i / r
            );
        }
    }
    let g = args.group_tasks;
    if let (Some(i), Some(r)) = (rate("idem: Batched claim", g), rate("idem: claim + complete", g))
    {
        println!("group commit (claim + complete) vs per message, {g} tasks: {:.2}×", i / r);
    }
    if let (Some(i), Some(r)) = (rate("idem: claim_many", 1), rate("raw: one", 1)) {
        println!("claim_many({}) vs bare {}-row insert: {:.2}×", args.batch, args.batch, i / r);
    }
    Ok(())
}

async fn postgres(args: &BenchSqlArgs) -> anyhow::Result<Vec<Row>> {
    use sqlx::postgres::PgPoolOptions;
    let max = args.concurrency.iter().copied().chain([args.group_tasks]).max().unwrap_or(1);
    let pool = crate::connect::pg_pool(
        &args.url,
        PgPoolOptions::new()
            .max_connections(u32::try_from(max).unwrap_or(64).max(4))
            .test_before_acquire(args.ping_before_acquire),
    )
    .await?;
    let schema = format!("idem_bench_{}", std::process::id());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema}; \
         CREATE TABLE {schema}.raw (k BYTEA PRIMARY KEY, state INT NOT NULL, result BYTEA); \
         CREATE TABLE {schema}.orders (id TEXT NOT NULL, cents BIGINT NOT NULL)"
    )))
    .execute(&pool)
    .await?;
    let store = PostgresStore::new(pool.clone()).with_schema(&schema)?;
    store.migrate().await?;
    let sync: String =
        sqlx::query_scalar("SELECT current_setting('synchronous_commit')").fetch_one(&pool).await?;
    eprintln!(
        "idem bench-sql: PostgreSQL, synchronous_commit={sync}, schema {schema}, ping before acquire: {}",
        args.ping_before_acquire
    );
    let n = args.messages;
    let mut rows = Vec::new();
    let ins = Arc::<str>::from(format!(
        "INSERT INTO {schema}.raw VALUES ($1, 0, NULL) ON CONFLICT DO NOTHING"
    ));
    let upd =
        Arc::<str>::from(format!("UPDATE {schema}.raw SET state = 1, result = $2 WHERE k = $1"));
    let order = Arc::<str>::from(format!("INSERT INTO {schema}.orders VALUES ($1, 100)"));
    let inbox = store.inbox(Duration::from_secs(86_400));
    let levels: &[usize] = if args.batches_only { &[] } else { &args.concurrency };
    for &c in levels {
        let (p, ins2, upd2) = (pool.clone(), Arc::clone(&ins), Arc::clone(&upd));
        let run = format!("raw2-{c}");
        rows.push(
            measure("raw: INSERT + UPDATE, 2 commits per message", n, c, move |i| {
                let (p, ins, upd, k) =
                    (p.clone(), Arc::clone(&ins2), Arc::clone(&upd2), hash(&run, i));
                async move {
                    sqlx::query(sqlx::AssertSqlSafe(ins)).bind(&k).execute(&p).await?;
                    sqlx::query(sqlx::AssertSqlSafe(upd))
                        .bind(&k)
                        .bind(&b"ok"[..])
                        .execute(&p)
                        .await?;
                    Ok(())
                }
            })
            .await?,
        );
        rows.push(per_message(&store, n, c).await?);
        let (p, ins2, ord) = (pool.clone(), Arc::clone(&ins), Arc::clone(&order));
        let run = format!("rawm-{c}");
        rows.push(
            measure("raw: marker INSERT + business INSERT, 1 commit", n, c, move |i| {
                let (p, ins, ord, k) =
                    (p.clone(), Arc::clone(&ins2), Arc::clone(&ord), hash(&run, i));
                async move {
                    let mut tx = p.begin().await?;
                    sqlx::query(sqlx::AssertSqlSafe(ins)).bind(&k).execute(&mut *tx).await?;
                    sqlx::query(sqlx::AssertSqlSafe(ord)).bind("x").execute(&mut *tx).await?;
                    tx.commit().await?;
                    Ok(())
                }
            })
            .await?,
        );
        let (p, ib, ord) = (pool.clone(), inbox.clone(), Arc::clone(&order));
        let run = format!("inbox-{c}");
        rows.push(
            measure("idem: inbox mark + business INSERT, 1 commit", n, c, move |i| {
                let (p, ib, ord, run) = (p.clone(), ib.clone(), Arc::clone(&ord), run.clone());
                async move {
                    let mut tx = p.begin().await?;
                    let key = DedupKey::new(&run, format!("m-{i}"))?;
                    anyhow::ensure!(matches!(
                        ib.mark(&mut tx, &key, None).await?,
                        Claim::Acquired(_)
                    ));
                    sqlx::query(sqlx::AssertSqlSafe(ord)).bind("x").execute(&mut *tx).await?;
                    tx.commit().await?;
                    Ok(())
                }
            })
            .await?,
        );
    }
    rows.extend(group_commit(&store, args).await?);
    let (b, batches) = (args.batch.max(1), (n * 4).div_ceil(args.batch.max(1)));
    let unnest = Arc::<str>::from(format!(
        "INSERT INTO {schema}.raw SELECT k, 0, NULL FROM unnest($1::bytea[]) AS k ON CONFLICT DO NOTHING"
    ));
    let p = pool.clone();
    let mut row =
        measure(&format!("raw: one {b}-row unnest INSERT per commit"), batches, 1, move |j| {
            let (p, q) = (p.clone(), Arc::clone(&unnest));
            async move {
                let keys: Vec<Vec<u8>> = (j * b..(j + 1) * b).map(|i| hash("unnest", i)).collect();
                sqlx::query(sqlx::AssertSqlSafe(q)).bind(&keys).execute(&p).await?;
                Ok(())
            }
        })
        .await?;
    row.ops = batches * b;
    rows.push(row);
    rows.push(claim_many(&store, b, batches).await?);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await?;
    Ok(rows)
}

async fn mysql(args: &BenchSqlArgs) -> anyhow::Result<Vec<Row>> {
    use sqlx::mysql::MySqlPoolOptions;
    let max = args.concurrency.iter().copied().chain([args.group_tasks]).max().unwrap_or(1);
    let pool = crate::connect::mysql_pool(
        &args.url,
        MySqlPoolOptions::new()
            .max_connections(u32::try_from(max).unwrap_or(64).max(4))
            .test_before_acquire(args.ping_before_acquire),
    )
    .await?;
    let t = format!("idem_bench_{}", std::process::id());
    for stmt in [
        format!("DROP TABLE IF EXISTS {t}, {t}_raw, {t}_orders"),
        format!("CREATE TABLE {t}_raw (k BINARY(32) PRIMARY KEY, state INT NOT NULL, result BLOB)"),
        format!("CREATE TABLE {t}_orders (id VARCHAR(32) NOT NULL, cents BIGINT NOT NULL)"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(stmt)).execute(&pool).await?;
    }
    let store = MySqlStore::new(pool.clone()).with_table_name(&t)?;
    store.migrate().await?;
    eprintln!("idem bench-sql: MySQL/MariaDB, tables {t}*");
    let n = args.messages;
    let mut rows = Vec::new();
    let ins = Arc::<str>::from(format!("INSERT INTO {t}_raw VALUES (?, 0, NULL)"));
    let upd = Arc::<str>::from(format!("UPDATE {t}_raw SET state = 1, result = ? WHERE k = ?"));
    let order = Arc::<str>::from(format!("INSERT INTO {t}_orders VALUES (?, 100)"));
    let inbox = store.inbox(Duration::from_secs(86_400));
    let levels: &[usize] = if args.batches_only { &[] } else { &args.concurrency };
    for &c in levels {
        let (p, ins2, upd2) = (pool.clone(), Arc::clone(&ins), Arc::clone(&upd));
        let run = format!("raw2-{c}");
        rows.push(
            measure("raw: INSERT + UPDATE, 2 commits per message", n, c, move |i| {
                let (p, ins, upd, k) =
                    (p.clone(), Arc::clone(&ins2), Arc::clone(&upd2), hash(&run, i));
                async move {
                    sqlx::query(sqlx::AssertSqlSafe(ins)).bind(&k).execute(&p).await?;
                    sqlx::query(sqlx::AssertSqlSafe(upd))
                        .bind(&b"ok"[..])
                        .bind(&k)
                        .execute(&p)
                        .await?;
                    Ok(())
                }
            })
            .await?,
        );
        rows.push(per_message(&store, n, c).await?);
        let (p, ins2, ord) = (pool.clone(), Arc::clone(&ins), Arc::clone(&order));
        let run = format!("rawm-{c}");
        rows.push(
            measure("raw: marker INSERT + business INSERT, 1 commit", n, c, move |i| {
                let (p, ins, ord, k) =
                    (p.clone(), Arc::clone(&ins2), Arc::clone(&ord), hash(&run, i));
                async move {
                    let mut tx = p.begin().await?;
                    sqlx::query(sqlx::AssertSqlSafe(ins)).bind(&k).execute(&mut *tx).await?;
                    sqlx::query(sqlx::AssertSqlSafe(ord)).bind("x").execute(&mut *tx).await?;
                    tx.commit().await?;
                    Ok(())
                }
            })
            .await?,
        );
        let (p, ib, ord) = (pool.clone(), inbox.clone(), Arc::clone(&order));
        let run = format!("inbox-{c}");
        rows.push(
            measure("idem: inbox mark + business INSERT, 1 commit", n, c, move |i| {
                let (p, ib, ord, run) = (p.clone(), ib.clone(), Arc::clone(&ord), run.clone());
                async move {
                    let mut tx = p.begin().await?;
                    let key = DedupKey::new(&run, format!("m-{i}"))?;
                    anyhow::ensure!(matches!(
                        ib.mark(&mut tx, &key, None).await?,
                        Claim::Acquired(_)
                    ));
                    sqlx::query(sqlx::AssertSqlSafe(ord)).bind("x").execute(&mut *tx).await?;
                    tx.commit().await?;
                    Ok(())
                }
            })
            .await?,
        );
    }
    rows.extend(group_commit(&store, args).await?);
    let b = args.batch.max(1);
    let batches = (n * 4).div_ceil(b);
    let multi = Arc::<str>::from(format!(
        "INSERT INTO {t}_raw VALUES {}",
        vec!["(?, 0, NULL)"; b].join(", ")
    ));
    let p = pool.clone();
    let mut row = measure(&format!("raw: one {b}-row INSERT per commit"), batches, 1, move |j| {
        let (p, q) = (p.clone(), Arc::clone(&multi));
        async move {
            let mut q = sqlx::query(sqlx::AssertSqlSafe(q));
            for i in j * b..(j + 1) * b {
                q = q.bind(hash("multi", i));
            }
            q.execute(&p).await?;
            Ok(())
        }
    })
    .await?;
    row.ops = batches * b;
    rows.push(row);
    rows.push(claim_many(&store, b, batches).await?);
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {t}, {t}_raw, {t}_orders")))
        .execute(&pool)
        .await?;
    Ok(rows)
}
