//! `idem serve`: the claim API (and push-mode consumers) over one store, until SIGTERM.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use idem::redact::Redacted;
use idem::{DedupStore, InspectStore, MySqlStore, PostgresStore, SqliteStore, sqlx};
use idem_serve::config::ServeConfig;
use tokio::sync::watch;

use crate::connect;

mod console;
mod push;

/// `idem serve --help`.
pub(crate) const ABOUT: &str = "Serve the claim API over a store, for services in any language, \
and optionally consume queues and push each new message to an application (push mode).

The configuration is a TOML file (--config or IDEM_SERVE_CONFIG); environment variables override \
it: IDEM_SERVE_LISTEN (default 127.0.0.1:7700), IDEM_STORE (a SQLite file or a postgres://, \
mysql://, redis:// URL), IDEM_SERVE_TOKENS (name:scope,scope:secret entries). Every request needs \
a token (Authorization: Bearer …) allowed its scope, unless the file sets auth.anonymous on a \
loopback listener.

Routes: /v1/claims, /v1/complete, /v1/release, /v1/fail, /v1/extend (and /batch forms), \
/v1/records, /v1/stats, /v1/purge; /healthz, /readyz, /metrics, /openapi.json (the API's OpenAPI \
3.1 document).

--console (or [console] enabled = true) adds the operator console at /console: the store's counts \
and in-doubt leases, the dead letters of each push consumer (and of [[console.dead_letters]]) \
grouped by cause with replay / discard / purge, an outbox ([console] outbox = …) and live charts. \
Operators log in with an API token and see only its scopes; [console] read_only = true allows no \
action. Logs go to stderr (RUST_LOG, default info; --log-format json for one JSON object \
per line). [limits] bounds connections, streams, requests in flight and time (header, request, \
idle, drain). SIGTERM or Ctrl-C stops accepting, lets open requests finish for up to \
limits.drain_timeout_ms (10 s), closes every connection, finishes in-flight pushes, and exits 0.";

/// Arguments of `idem serve`.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// The configuration file (TOML). Without one, everything comes from the environment.
    #[arg(long, env = "IDEM_SERVE_CONFIG")]
    config: Option<PathBuf>,
    /// `text` (default) or `json`: one JSON object per log line, for log shippers.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub(crate) log_format: String,
    /// Serve the operator console at /console (as `[console] enabled = true` does).
    #[arg(long)]
    console: bool,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

pub(crate) async fn run(args: ServeArgs, scrubber: &crate::scrub::Scrubber) -> anyhow::Result<()> {
    let mut config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the configuration {}", path.display()))?;
            ServeConfig::from_toml(&text).with_context(|| path.display().to_string())?
        }
        None => ServeConfig::empty(),
    };
    config.apply_env(env);
    // Before anything connects or logs: every secret the configuration holds or names.
    let (addresses, tokens) = config.secrets(env);
    scrubber.add(addresses.iter().map(String::as_str));
    for t in &tokens {
        scrubber.add_literal(t);
    }
    config.console.enabled |= args.console;
    let tokens = config.tokens(env)?;
    config.check_push()?;
    config.check_console()?;
    config.limits.validate()?;
    let tls = match &config.tls {
        Some(files) => {
            let read =
                |f: &str| std::fs::read(f).with_context(|| format!("reading the TLS file {f}"));
            Some(idem_serve::tls_acceptor(&read(&files.cert)?, &read(&files.key)?)?)
        }
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("listening on {}", config.listen))?;
    let metrics = if config.metrics {
        let handle = idem::prometheus::install_recorder().context("installing the metrics")?;
        let render: idem_serve::MetricsRender = Arc::new(move || handle.render());
        Some(render)
    } else {
        None
    };
    let url = config.store_url(env)?;
    let console =
        if config.console.enabled { Some(console::build(&config, env).await?) } else { None };
    let serve = Serve { config: &config, tokens, tls, listener, metrics, console };
    match url.split_once("://").map(|(scheme, _)| scheme) {
        Some("postgres" | "postgresql") => {
            let pool =
                connect::pg_pool(&url, sqlx::postgres::PgPoolOptions::new().max_connections(32))
                    .await?;
            let store = PostgresStore::new(pool)
                .with_schema(&config.store.schema)?
                .with_table_name(&config.store.table)?;
            if config.store.migrate {
                store.migrate().await.context("creating the store's table")?;
            }
            serve.run(store, &url).await
        }
        Some("mysql" | "mariadb") => {
            let pool =
                connect::mysql_pool(&url, sqlx::mysql::MySqlPoolOptions::new().max_connections(32))
                    .await?;
            let store = MySqlStore::new(pool).with_table_name(&config.store.table)?;
            if config.store.migrate {
                store.migrate().await.context("creating the store's table")?;
            }
            serve.run(store, &url).await
        }
        Some("redis" | "rediss") => {
            let prefix = config.store.prefix.clone();
            let store = connect::redis_store(&url, move |b| Ok(b.namespace(&prefix)?)).await?;
            serve.run(store, &url).await
        }
        Some(other) => bail!(
            "store {}: unknown scheme {other:?}; expected a SQLite file or a postgres://, \
             mysql://, mariadb:// or redis:// URL",
            Redacted(&url)
        ),
        None => {
            let store = sqlite(Path::new(&url), &config).await?;
            serve.run(store, &url).await
        }
    }
}

async fn sqlite(path: &Path, config: &ServeConfig) -> anyhow::Result<SqliteStore> {
    if config.store.migrate {
        // Readable by the service's user only: the file holds every key and stored result.
        // SQLite gives its -wal and -shm files the database file's permissions.
        use std::os::unix::fs::OpenOptionsExt as _;
        let created =
            std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path);
        match created {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("creating the SQLite store {}", path.display()));
            }
        }
    }
    let opts = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(config.store.migrate)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(10));
    let pool =
        connect::sqlite_pool(opts, sqlx::sqlite::SqlitePoolOptions::new().max_connections(1))
            .await?;
    let store = SqliteStore::new(pool).with_table_name(&config.store.table)?;
    if config.store.migrate {
        store.migrate().await.context("creating the store's table")?;
    }
    Ok(store)
}

struct Serve<'a> {
    config: &'a ServeConfig,
    tokens: idem_serve::Tokens,
    tls: Option<idem_serve::tokio_rustls::TlsAcceptor>,
    listener: tokio::net::TcpListener,
    metrics: Option<idem_serve::MetricsRender>,
    console: Option<idem_serve::console::Console>,
}

impl Serve<'_> {
    async fn run<S: DedupStore + InspectStore + Clone>(
        self,
        store: S,
        url: &str,
    ) -> anyhow::Result<()> {
        // Before the first line that says the process is ready: see `signals::shutdown`.
        let signal = crate::signals::shutdown()?;
        let problems = store.check().await.context("checking the store")?;
        for p in &problems {
            tracing::warn!(problem = %p, "store");
        }
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut pushes = tokio::task::JoinSet::new();
        for p in &self.config.push {
            let consumer = push::start(p.clone(), store.clone(), stop_rx.clone()).await?;
            let name = p.name.clone();
            pushes.spawn(async move { (name, consumer.await) });
        }
        let addr = self.listener.local_addr()?;
        tracing::info!(
            %addr,
            tls = self.tls.is_some(),
            store = %Redacted(url),
            tokens = self.tokens.len(),
            anonymous = self.tokens.is_anonymous(),
            push = self.config.push.len(),
            console = self.console.is_some(),
            "idem serve listening"
        );
        // The line tests and supervisors wait for (stdout, flushed).
        println!("listening on {}://{addr}", if self.tls.is_some() { "https" } else { "http" });
        let app = match self.console {
            Some(console) => {
                idem_serve::router_with_console(store, self.tokens, self.metrics, console)
            }
            None => idem_serve::router(store, self.tokens, self.metrics),
        };
        let mut stop = stop_rx.clone();
        let limits = self.config.limits.clone();
        let server =
            tokio::spawn(idem_serve::serve(app, self.listener, self.tls, limits, async move {
                let _ = stop.wait_for(|s| *s).await;
            }));
        tokio::pin!(signal);
        // A push consumer that ends on its own stops the process: the sidecar is no longer
        // doing its job, and its supervisor should see it. Without push consumers, the branch
        // is disabled (no task to join) and only the signal ends the run.
        let failed = tokio::select! {
            () = &mut signal => None,
            Some(done) = pushes.join_next() => {
                let (name, result) = done.context("a push consumer panicked")?;
                Some(match result {
                    Ok(()) => anyhow::anyhow!("push consumer {name} stopped"),
                    Err(e) => e.context(format!("push consumer {name}")),
                })
            }
        };
        tracing::info!("shutting down: finishing open requests and in-flight pushes");
        let _ = stop_tx.send(true);
        while let Some(done) = pushes.join_next().await {
            if let Ok((name, Err(e))) = done {
                tracing::warn!(consumer = %name, error = %format!("{e:#}"), "push consumer");
            }
        }
        server.await.context("the server task panicked")?.context("serving")?;
        match failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
