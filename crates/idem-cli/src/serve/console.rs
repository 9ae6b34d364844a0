//! `idem serve --console`: the console's dead-letter queues and outbox, opened from the
//! configuration's `[console]` section (and each `[[push]]` consumer's dead letters).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use idem::redact::Redacted;
use idem::sqlx;
use idem_serve::config::ServeConfig;
use idem_serve::console::{Console, OutboxAdmin};

use crate::connect;

/// The broker URL of a `broker` / `broker_env` pair.
fn broker(url: Option<&str>, var: Option<&str>, what: &str) -> anyhow::Result<String> {
    match (url, var) {
        (Some(u), _) => Ok(u.to_owned()),
        (None, Some(var)) => std::env::var(var)
            .with_context(|| format!("{what}: the environment variable {var} is not set")),
        (None, None) => bail!("{what}: no broker"),
    }
}

/// The console `config` asks for, its queues and outbox connected.
pub(crate) async fn build(
    config: &ServeConfig,
    env: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<Console> {
    let c = &config.console;
    let mut console = Console::new()
        .read_only(c.read_only)
        .secure_cookie(config.tls.is_some())
        .session_ttl(Duration::from_secs(c.session_minutes.saturating_mul(60)));
    if c.push_dead_letters {
        for p in &config.push {
            let what = format!("console: push {}'s dead letters", p.name);
            let url = broker(p.broker.as_deref(), p.broker_env.as_deref(), &what)?;
            let q = crate::dlq::open_queue(&url, &p.source, Some(&p.dead_letter))
                .await
                .with_context(|| format!("{what} on {}", Redacted(&url)))?;
            console = console.dead_letters(p.name.clone(), q);
        }
    }
    for d in &c.dead_letters {
        let what = format!("console: dead letters {}", d.name);
        let url = broker(d.broker.as_deref(), d.broker_env.as_deref(), &what)?;
        let q = crate::dlq::open_queue(&url, &d.queue, d.dead_letter.as_deref())
            .await
            .with_context(|| format!("{what} on {}", Redacted(&url)))?;
        console = console.dead_letters(d.name.clone(), q);
    }
    if let Some(url) = config.console_outbox_url(env)? {
        let outbox = outbox(&url, config)
            .await
            .with_context(|| format!("console: the outbox {}", Redacted(&url)))?;
        console = console.outbox(outbox);
    }
    Ok(console)
}

/// The outbox at `url`, as the console reads it (its table is not created: the application's
/// outbox already exists, or the page says the table is missing).
async fn outbox(url: &str, config: &ServeConfig) -> anyhow::Result<Arc<dyn OutboxAdmin>> {
    let table = &config.console.outbox_table;
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool =
            connect::pg_pool(url, sqlx::postgres::PgPoolOptions::new().max_connections(2)).await?;
        let store = idem::PostgresStore::new(pool).with_schema(&config.store.schema)?;
        Ok(Arc::new(store.outbox().with_table_name(table)?))
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let pool =
            connect::mysql_pool(url, sqlx::mysql::MySqlPoolOptions::new().max_connections(2))
                .await?;
        Ok(Arc::new(idem::MySqlStore::new(pool).outbox().with_table_name(table)?))
    } else if url.contains("://") {
        bail!("unknown scheme; expected a SQLite file, postgres:// or mysql://")
    } else {
        anyhow::ensure!(Path::new(url).exists(), "no database file there");
        let store = idem::SqliteStore::open(url).await?;
        Ok(Arc::new(store.outbox().with_table_name(table)?))
    }
}
