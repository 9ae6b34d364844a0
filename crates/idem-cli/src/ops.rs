//! Operator verbs on a SQLite store: inspect, stats, purge, release.

use std::path::PathBuf;

use anyhow::Context as _;
use idem::sqlite::SqliteStore;
use idem::{DedupKey, DedupStore, InspectStore, ListFilter, RecordState};

/// Where the store is.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct StoreArgs {
    /// SQLite database file.
    #[arg(long)]
    store: PathBuf,
    /// Table name.
    #[arg(long, default_value = idem_table_default())]
    table: String,
}

const fn idem_table_default() -> &'static str {
    "idem_records"
}

impl StoreArgs {
    async fn open(&self) -> anyhow::Result<SqliteStore> {
        anyhow::ensure!(self.store.exists(), "no database file at {}", self.store.display());
        let store = SqliteStore::open(&self.store)
            .await
            .with_context(|| format!("opening {}", self.store.display()))?;
        Ok(store.with_table_name(&self.table)?)
    }
}

pub(crate) async fn inspect(
    s: &StoreArgs,
    scope: Option<String>,
    state: Option<String>,
    limit: usize,
) -> anyhow::Result<()> {
    let store = s.open().await?;
    let mut filter = ListFilter::new(limit);
    if let Some(scope) = scope {
        filter = filter.scope(scope);
    }
    if let Some(st) = state {
        let parsed = RecordState::parse(&st).with_context(|| {
            let names: Vec<_> = RecordState::ALL.iter().map(|s| s.as_str()).collect();
            format!("unknown state {st:?}; expected one of {}", names.join(", "))
        })?;
        filter = filter.state(parsed);
    }
    let records = store.list(&filter).await?;
    println!(
        "{:<24} {:<32} {:<12} {:>7} {:>8}  result",
        "scope", "id", "state", "attempt", "bytes"
    );
    for r in &records {
        let result = r.result.as_deref().map(String::from_utf8_lossy).unwrap_or_default();
        let mut shown: String = result.chars().take(60).collect();
        if result.chars().count() > 60 {
            shown.push('…');
        }
        println!(
            "{:<24} {:<32} {:<12} {:>7} {:>8}  {}",
            r.scope,
            r.id,
            r.state,
            r.attempt,
            r.result.as_ref().map_or(0, Vec::len),
            shown
        );
    }
    println!("{} record(s)", records.len());
    Ok(())
}

pub(crate) async fn stats(s: &StoreArgs, scope: Option<String>) -> anyhow::Result<()> {
    let store = s.open().await?;
    let c = store.count(scope.as_deref()).await?;
    println!(
        "in_progress {}\ncompleted   {}\nreleased    {}\nfailed      {}\nin_doubt    {}\ntotal       {}\nexpired     {} (awaiting purge)",
        c.in_progress,
        c.completed,
        c.released,
        c.failed,
        c.in_doubt,
        c.total(),
        c.expired
    );
    Ok(())
}

pub(crate) async fn purge(s: &StoreArgs, batch: usize) -> anyhow::Result<()> {
    anyhow::ensure!(batch > 0, "--batch must be at least 1");
    let store = s.open().await?;
    let mut total = 0;
    loop {
        let n = store.purge(batch).await?;
        total += n;
        if n < batch as u64 {
            break;
        }
    }
    println!("purged {total} expired record(s)");
    Ok(())
}

pub(crate) async fn release(s: &StoreArgs, scope: String, id: String) -> anyhow::Result<()> {
    let store = s.open().await?;
    let key = DedupKey::new(scope, id)?;
    if store.force_release(&key).await? {
        println!("released {key}: the next delivery runs the handler again");
        Ok(())
    } else {
        anyhow::bail!("no record for {key}")
    }
}
