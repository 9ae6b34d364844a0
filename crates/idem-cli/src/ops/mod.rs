//! Operator verbs on any store (SQLite, PostgreSQL, MySQL/MariaDB, Redis): inspect, stats,
//! purge, release, fail.

pub(crate) mod show;
mod store;

use std::collections::BTreeMap;

use anyhow::Context as _;
use idem::{Counts, DedupKey, ListFilter, Record, RecordState};
use serde_json::json;

pub(crate) use store::{StoreArgs, StoreOptions};

/// What `inspect` shows.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct InspectArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Only this scope (the consumer's identity: group, handler, route).
    #[arg(long)]
    scope: Option<String>,
    /// Only this state: in_progress, completed, released, failed or in_doubt.
    #[arg(long, value_parser = parse_state)]
    state: Option<RecordState>,
    /// Only the record of this key id (exact; needs --scope).
    #[arg(long, value_name = "ID", requires = "scope", conflicts_with_all = ["state", "limit"])]
    key: Option<String>,
    /// At most this many, most recently updated first.
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// One JSON object per record and line, with every stored field.
    #[arg(long)]
    json: bool,
}

/// What `stats` counts.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct StatsArgs {
    #[command(flatten)]
    store: StoreArgs,
    /// Only this scope; without it, counts are also broken down by scope.
    #[arg(long)]
    scope: Option<String>,
    /// Records read for the per-scope breakdown and the oldest in-progress lease; past it, both
    /// cover only the most recently updated records (the totals are always exact).
    #[arg(long, default_value_t = 100_000)]
    scan: usize,
    /// One JSON object.
    #[arg(long)]
    json: bool,
}

fn parse_state(s: &str) -> Result<RecordState, String> {
    RecordState::parse(s).ok_or_else(|| {
        let names: Vec<_> = RecordState::ALL.iter().map(|s| s.as_str()).collect();
        format!("unknown state {s:?}; expected one of {}", names.join(", "))
    })
}

pub(crate) async fn inspect(a: InspectArgs) -> anyhow::Result<()> {
    let store = a.store.open().await?;
    let records = match (&a.key, &a.scope) {
        (Some(id), Some(scope)) => {
            let key = DedupKey::new(scope.clone(), id.clone())?;
            match store.get(&key).await? {
                Some(r) => vec![r],
                None => anyhow::bail!("no record for {}", show::clean(&key.to_string())),
            }
        }
        _ => {
            let mut filter = ListFilter::new(a.limit);
            if let Some(scope) = &a.scope {
                filter = filter.scope(scope.clone());
            }
            if let Some(state) = a.state {
                filter = filter.state(state);
            }
            store.list(&filter).await?
        }
    };
    if a.json {
        for r in &records {
            println!("{}", show::json_line(&show::record_json(r)));
        }
        return Ok(());
    }
    let now = show::now();
    println!("{}", show::header());
    for r in &records {
        println!("{}", show::row(r, now));
    }
    println!("{} record(s)", records.len());
    Ok(())
}

pub(crate) async fn stats(a: StatsArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.scan > 0, "--scan must be at least 1");
    let store = a.store.open().await?;
    let counts = store.count(a.scope.as_deref()).await?;

    let mut in_progress = ListFilter::new(a.scan).state(RecordState::InProgress);
    if let Some(scope) = &a.scope {
        in_progress = in_progress.scope(scope.clone());
    }
    let leased = store.list(&in_progress).await?;
    let oldest = leased.iter().min_by_key(|r| r.updated_at);
    let by_scope = match a.scope {
        Some(_) => None,
        None => {
            let all = store.list(&ListFilter::new(a.scan)).await?;
            let mut m: BTreeMap<String, Counts> = BTreeMap::new();
            for r in &all {
                m.entry(r.scope.clone()).or_default().add(r.state, 1);
            }
            Some((m, all.len() < a.scan))
        }
    };

    let now = show::now();
    if a.json {
        let oldest = oldest.map(|r| oldest_json(r, now));
        let mut out = json!({ "counts": show::counts_json(&counts), "oldest_in_progress": oldest });
        if let Some((m, complete)) = &by_scope {
            let per: serde_json::Map<_, _> =
                m.iter().map(|(s, c)| (s.clone(), show::counts_json(c))).collect();
            out["by_scope"] = json!(per);
            out["by_scope_complete"] = json!(complete);
        }
        println!("{}", show::json_line(&out));
        return Ok(());
    }
    println!(
        "in_progress {}\ncompleted   {}\nreleased    {}\nfailed      {}\nin_doubt    {}\ntotal       {}\nexpired     {} (awaiting purge)",
        counts.in_progress,
        counts.completed,
        counts.released,
        counts.failed,
        counts.in_doubt,
        counts.total(),
        counts.expired
    );
    match oldest {
        Some(r) => println!(
            "oldest in-progress lease: {}/{} claimed {} ago, {}",
            show::clean(&r.scope),
            show::clean(&r.id),
            show::age(now.since(r.updated_at)),
            match r.lease_until {
                Some(u) if u > now => format!("lease ends in {}", show::age(u.since(now))),
                _ => "lease ran out (the next delivery takes it over)".to_owned(),
            }
        ),
        None => println!("oldest in-progress lease: none"),
    }
    if let Some((m, complete)) = by_scope {
        println!();
        println!(
            "{:<32} {:>11} {:>9} {:>8} {:>6} {:>8} {:>7}",
            "scope", "in_progress", "completed", "released", "failed", "in_doubt", "total"
        );
        for (scope, c) in &m {
            println!(
                "{:<32} {:>11} {:>9} {:>8} {:>6} {:>8} {:>7}",
                show::clean(scope),
                c.in_progress,
                c.completed,
                c.released,
                c.failed,
                c.in_doubt,
                c.total()
            );
        }
        if !complete {
            println!("(by scope: the {} most recently updated records only; see --scan)", a.scan);
        }
    }
    Ok(())
}

fn oldest_json(r: &Record, now: idem::Timestamp) -> serde_json::Value {
    json!({
        "scope": r.scope,
        "id": r.id,
        "attempt": r.attempt,
        "age_secs": now.since(r.updated_at).as_secs(),
        "lease_until_us": r.lease_until.map(idem::Timestamp::as_micros),
        "lease_live": r.lease_until.is_some_and(|u| u > now),
    })
}

pub(crate) async fn purge(s: &StoreArgs, batch: usize, max: Option<u64>) -> anyhow::Result<()> {
    anyhow::ensure!(batch > 0, "--batch must be at least 1");
    let store = s.open().await?;
    // Drawn on stderr only when it is a terminal; scripts see the summary line alone.
    let progress = indicatif::ProgressBar::new_spinner();
    progress.set_message("purging expired records");
    let (mut total, mut batches) = (0u64, 0u64);
    loop {
        let left = max.map_or(u64::MAX, |m| m.saturating_sub(total));
        let limit = usize::try_from(left).map_or(batch, |l| l.min(batch));
        if limit == 0 {
            break;
        }
        let n = store.purge(limit).await.with_context(|| format!("after purging {total}"))?;
        total += n;
        batches += 1;
        progress.set_message(format!("purged {total} in {batches} batch(es)"));
        progress.tick();
        if n < limit as u64 {
            break;
        }
    }
    progress.finish_and_clear();
    println!("purged {total} expired record(s) in {batches} batch(es)");
    Ok(())
}

pub(crate) async fn release(s: &StoreArgs, scope: String, id: String) -> anyhow::Result<()> {
    let store = s.open().await?;
    let key = DedupKey::new(scope, id)?;
    let shown = show::clean(&key.to_string()).into_owned();
    if store.force_release(&key).await? {
        println!("released {shown}: the next delivery runs the handler again");
        Ok(())
    } else {
        anyhow::bail!("no record for {shown}")
    }
}

pub(crate) async fn fail(
    s: &StoreArgs,
    scope: String,
    id: String,
    reason: String,
) -> anyhow::Result<()> {
    let store = s.open().await?;
    let key = DedupKey::new(scope, id)?;
    let shown = show::clean(&key.to_string()).into_owned();
    let before = store.get(&key).await?.map(|r| r.state);
    // The store decides in one write: a completed record is left alone (its effect happened;
    // failing it would let a resubmission run it twice; `release` is the explicit way).
    if store.force_fail(&key, &reason).await? {
        let was = before.map_or_else(|| "unknown".to_owned(), |s| s.to_string());
        println!("failed {shown} (was {was}): a resubmitted message runs the handler again");
        return Ok(());
    }
    match store.get(&key).await?.map(|r| r.state) {
        Some(RecordState::Completed) => anyhow::bail!(
            "{shown} is completed; `idem fail` is for records in doubt (or stuck in progress)"
        ),
        _ => anyhow::bail!("no record for {shown}"),
    }
}
