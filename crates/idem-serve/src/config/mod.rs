//! `idem serve`'s configuration: a TOML file, then environment variables over it.
//!
//! ```toml
//! listen = "127.0.0.1:7700"          # IDEM_SERVE_LISTEN
//!
//! [store]
//! url_env = "IDEM_STORE"             # or url = "…"; a SQLite file or a postgres://, mysql://,
//!                                    # redis:// URL
//! migrate = true                     # create the table if missing (default)
//!
//! [tls]                              # optional: HTTPS on the listener
//! cert = "/etc/idem/server.pem"
//! key = "/etc/idem/server.key"
//!
//! [[auth.tokens]]
//! name = "orders-service"
//! token_env = "IDEM_TOKEN_ORDERS"    # or token = "…" (16 bytes at least)
//! scopes = ["orders"]                # "*" for all, and for purge and store-wide stats
//!
//! [[push]]                           # optional: consume a queue, POST each new message
//! name = "orders"
//! broker = "amqp://guest:guest@127.0.0.1:5672/%2f"   # or broker_env
//! source = "orders"                  # queue, stream, topic, or NATS stream
//! dead_letter = "orders.dlq"
//! scope = "orders"
//! endpoint = "http://127.0.0.1:8080/orders"
//!
//! [console]                          # optional: the operator console at /console
//! enabled = true                     # or `idem serve --console`
//! read_only = false                  # true: no action at all (every action answers 403)
//! session_minutes = 480              # how long a login lasts
//! # push_dead_letters = true         # show each [[push]]'s dead letters (default)
//! # outbox = "/var/lib/app/app.db"   # an outbox to show (SQLite file, postgres://, mysql://)
//!
//! [[console.dead_letters]]           # more dead letters to show, besides push consumers'
//! name = "payments"
//! broker = "nats://127.0.0.1:4222"   # or broker_env
//! queue = "PAYMENTS"                 # the queue, stream, subject or topic consumed
//! # dead_letter = "payments.dlq"     # where they are, when not idem's default for the queue
//!
//! [limits]                           # optional; each key at its default (see `Limits`)
//! max_connections = 1024
//! max_streams_per_connection = 100
//! max_in_flight = 512
//! header_timeout_ms = 10000
//! request_timeout_ms = 30000
//! idle_timeout_ms = 60000
//! drain_timeout_ms = 10000
//! ```
//!
//! `IDEM_SERVE_TOKENS` adds tokens without a file: entries `name:scope,scope:secret`, separated
//! by whitespace or `;` (the secret is everything after the second colon).

use std::collections::BTreeSet;

use serde::Deserialize;

use crate::auth::{Scopes, Token, TokenError, Tokens};

/// The listener's default address: loopback only (a sidecar).
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7700";

/// The whole file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ServeConfig {
    /// `host:port` to listen on (default `127.0.0.1:7700`).
    #[serde(default = "default_listen")]
    pub listen: String,
    /// HTTPS on the listener.
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// The store.
    #[serde(default)]
    pub store: StoreConfig,
    /// Who may call.
    #[serde(default)]
    pub auth: AuthConfig,
    /// Serve `/metrics` (default true).
    #[serde(default = "yes")]
    pub metrics: bool,
    /// Push-mode consumers.
    #[serde(default)]
    pub push: Vec<PushConfig>,
    /// The operator console.
    #[serde(default)]
    pub console: ConsoleConfig,
    /// What clients may hold: connections, streams, requests, time.
    #[serde(default)]
    pub limits: crate::Limits,
}

/// The operator console at `/console` (off unless `enabled`, or `idem serve --console`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct ConsoleConfig {
    /// Serve the console.
    #[serde(default)]
    pub enabled: bool,
    /// No action at all: pages only, and every action answers `403`.
    #[serde(default)]
    pub read_only: bool,
    /// How long a login lasts, in minutes (default 480; 1 to 10080).
    #[serde(default = "default_session_minutes")]
    pub session_minutes: u64,
    /// Show the dead letters of each `[[push]]` consumer, under its name (default true).
    #[serde(default = "yes")]
    pub push_dead_letters: bool,
    /// More dead letters to show.
    #[serde(default)]
    pub dead_letters: Vec<DeadLettersConfig>,
    /// An outbox to show: a SQLite file, or a `postgres://` or `mysql://` URL.
    #[serde(default)]
    pub outbox: Option<String>,
    /// The environment variable holding the outbox's URL.
    #[serde(default)]
    pub outbox_env: Option<String>,
    /// The outbox's table (default `idem_outbox`; PostgreSQL: in `store.schema`).
    #[serde(default = "default_outbox_table")]
    pub outbox_table: String,
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            read_only: false,
            session_minutes: default_session_minutes(),
            push_dead_letters: true,
            dead_letters: Vec::new(),
            outbox: None,
            outbox_env: None,
            outbox_table: default_outbox_table(),
        }
    }
}

/// Dead letters the console shows: those of consumers reading `queue` on `broker`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct DeadLettersConfig {
    /// Names them on the pages and in URLs.
    pub name: String,
    /// The broker's URL, as for `[[push]]`.
    #[serde(default)]
    pub broker: Option<String>,
    /// The environment variable holding the broker's URL.
    #[serde(default)]
    pub broker_env: Option<String>,
    /// The queue, stream, subject or topic the consumers read.
    pub queue: String,
    /// Where the dead letters are, when not idem's default for `queue`.
    #[serde(default)]
    pub dead_letter: Option<String>,
}

/// PEM files of the listener's certificate chain and key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TlsFiles {
    /// The certificate chain, leaf first.
    pub cert: String,
    /// Its private key.
    pub key: String,
}

/// Where the records are.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct StoreConfig {
    /// A SQLite file, or a `postgres://`, `mysql://`, `mariadb://`, `redis://`, `rediss://` URL.
    #[serde(default)]
    pub url: Option<String>,
    /// The environment variable holding the URL (keeps a password out of the file).
    #[serde(default)]
    pub url_env: Option<String>,
    /// PostgreSQL schema (default `idem`).
    #[serde(default = "default_schema")]
    pub schema: String,
    /// Table name of the SQL stores (default `idem_records`).
    #[serde(default = "default_table")]
    pub table: String,
    /// Redis namespace (default `default`).
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Create the table if it is missing (default true).
    #[serde(default = "yes")]
    pub migrate: bool,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            url: None,
            url_env: None,
            schema: default_schema(),
            table: default_table(),
            prefix: default_prefix(),
            migrate: true,
        }
    }
}

/// Who may call.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct AuthConfig {
    /// No tokens at all: anyone who reaches the listener may use every scope. Only for a
    /// listener on loopback inside one pod; refused on any other address.
    #[serde(default)]
    pub anonymous: bool,
    /// The tokens.
    #[serde(default)]
    pub tokens: Vec<TokenConfig>,
}

/// One token.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct TokenConfig {
    /// Shown in logs and errors.
    pub name: String,
    /// The secret (prefer `token_env`).
    #[serde(default)]
    pub token: Option<String>,
    /// The environment variable holding the secret.
    #[serde(default)]
    pub token_env: Option<String>,
    /// Scopes it may use; `*` for all.
    pub scopes: Vec<String>,
}

impl std::fmt::Debug for TokenConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenConfig")
            .field("name", &self.name)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("token_env", &self.token_env)
            .field("scopes", &self.scopes)
            .finish()
    }
}

/// One push-mode consumer: a broker source whose new messages are POSTed to `endpoint`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct PushConfig {
    /// Names the consumer in logs and metrics.
    pub name: String,
    /// `amqp://`/`amqps://` (RabbitMQ), `nats://`/`tls://` (JetStream), `redis://`/`rediss://`
    /// (Streams), `kafka://` (Kafka, in builds with the `kafka` feature).
    #[serde(default)]
    pub broker: Option<String>,
    /// The environment variable holding the broker URL.
    #[serde(default)]
    pub broker_env: Option<String>,
    /// The queue (RabbitMQ), stream (Redis, NATS) or topic (Kafka).
    pub source: String,
    /// Where failed and conflicting messages go: a queue, a stream, a subject or a topic.
    pub dead_letter: String,
    /// The dedup scope of its keys.
    pub scope: String,
    /// The application's URL.
    pub endpoint: String,
    /// The key: `message_id` (default), `header:<name>` or `json:<pointer>`.
    #[serde(default = "default_key")]
    pub key: String,
    /// Conflict detection on the payload's SHA-256 (default true).
    #[serde(default = "yes")]
    pub fingerprint: bool,
    /// Per-request timeout (default 10 s); the lease is at least three times this.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Lease per message (default 60 s).
    #[serde(default = "default_lease_ms")]
    pub lease_ms: u64,
    /// Messages pushed at once (default 16).
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Consumer group (Redis Streams, Kafka) or durable consumer (NATS); default `idem-<name>`.
    #[serde(default)]
    pub group: Option<String>,
    /// Message headers copied onto the request besides `Content-Type`.
    #[serde(default)]
    pub forward_headers: Option<Vec<String>>,
    /// Deaths after which a message is dead-lettered as a crash loop instead of pushed again
    /// (default 5, the engine's). A death is a takeover of a lease that ran out (the sidecar
    /// died holding the message); a failed push gives the message back and never counts.
    #[serde(default = "default_crash_loop_limit")]
    pub crash_loop_limit: u32,
    /// An HTTP(S) proxy for the pushes (default none: pushes go straight to the endpoint and
    /// the `HTTP_PROXY`/`HTTPS_PROXY` variables are ignored).
    #[serde(default)]
    pub proxy: Option<String>,
    /// A PEM file of CA certificates trusted for an `https://` endpoint, besides the system's.
    #[serde(default)]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Largest response body read (default 65,536); a 2xx answer with a larger body is a
    /// success whose body is not stored.
    #[serde(default = "default_max_response_bytes")]
    pub max_response_bytes: usize,
}

fn default_max_response_bytes() -> usize {
    crate::DEFAULT_MAX_RESPONSE_BYTES
}

fn default_listen() -> String {
    DEFAULT_LISTEN.to_owned()
}
fn default_schema() -> String {
    "idem".to_owned()
}
fn default_table() -> String {
    "idem_records".to_owned()
}
fn default_prefix() -> String {
    "default".to_owned()
}
fn default_outbox_table() -> String {
    "idem_outbox".to_owned()
}
const fn default_session_minutes() -> u64 {
    480
}
fn default_key() -> String {
    "message_id".to_owned()
}
const fn default_timeout_ms() -> u64 {
    10_000
}
const fn default_lease_ms() -> u64 {
    60_000
}
const fn default_crash_loop_limit() -> u32 {
    idem_core::engine::DEFAULT_CRASH_LOOP_LIMIT
}
const fn default_concurrency() -> usize {
    16
}
const fn yes() -> bool {
    true
}

/// The configuration is unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file does not parse (the message names the line and the key).
    #[error("config: {0}")]
    Toml(String),
    /// A value is missing or out of range.
    #[error("config: {field}: {problem}")]
    Invalid {
        /// The key, as in the file (`store.url`, `push[0].timeout_ms`).
        field: String,
        /// What is wrong.
        problem: String,
    },
    /// A token is unusable.
    #[error("config: {0}")]
    Token(#[from] TokenError),
}

/// `IDEM_SERVE_TOKENS`'s entries, `name:scope,scope:secret` separated by whitespace or `;`, as
/// `(name, scopes, secret)`; `None` for an entry without two colons.
fn listed_tokens(list: &str) -> impl Iterator<Item = Option<(&str, &str, &str)>> {
    list.split(|c: char| c.is_whitespace() || c == ';').filter(|e| !e.is_empty()).map(|entry| {
        let mut parts = entry.splitn(3, ':');
        Some((parts.next()?, parts.next()?, parts.next()?))
    })
}

fn invalid(field: impl Into<String>, problem: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.into(), problem: problem.into() }
}

impl ServeConfig {
    /// Parses a file's text.
    ///
    /// # Errors
    /// [`ConfigError::Toml`] naming the line and key.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Toml(e.to_string()))
    }

    /// The defaults (listen on loopback, no store, no token).
    pub fn empty() -> Self {
        Self::from_toml("").unwrap_or_else(|_| unreachable!("the empty file parses"))
    }

    /// Applies `IDEM_SERVE_LISTEN` and `IDEM_STORE` (over the file) as `env` returns them.
    pub fn apply_env(&mut self, env: impl Fn(&str) -> Option<String>) {
        if let Some(l) = env("IDEM_SERVE_LISTEN") {
            self.listen = l;
        }
        if let Some(u) = env("IDEM_STORE") {
            self.store.url = Some(u);
        }
    }

    /// The store URL (from `url`, `url_env` or `IDEM_STORE`).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] when none is given or the variable is unset.
    pub fn store_url(&self, env: impl Fn(&str) -> Option<String>) -> Result<String, ConfigError> {
        if let Some(u) = &self.store.url {
            return Ok(u.clone());
        }
        match &self.store.url_env {
            Some(var) => env(var).ok_or_else(|| {
                invalid("store.url_env", format!("the environment variable {var} is not set"))
            }),
            None => Err(invalid(
                "store.url",
                "no store: set store.url or store.url_env in the file, or IDEM_STORE",
            )),
        }
    }

    /// Every secret this configuration holds or names, for a log scrubber: the addresses (the
    /// store, push brokers, endpoints and proxies, the console's brokers and outbox, directly
    /// or through the `*_env` variables named), whose passwords and keys are in them; and the
    /// API tokens (in the file, in `token_env` variables, in `IDEM_SERVE_TOKENS`).
    pub fn secrets(&self, env: impl Fn(&str) -> Option<String>) -> (Vec<String>, Vec<String>) {
        let mut addresses = Vec::new();
        let mut given = |value: &Option<String>, var: &Option<String>| {
            addresses.extend(value.clone());
            addresses.extend(var.as_deref().and_then(&env));
        };
        given(&self.store.url, &self.store.url_env);
        for p in &self.push {
            given(&p.broker, &p.broker_env);
            given(&Some(p.endpoint.clone()), &None);
            given(&p.proxy, &None);
        }
        for d in &self.console.dead_letters {
            given(&d.broker, &d.broker_env);
        }
        given(&self.console.outbox, &self.console.outbox_env);
        let mut tokens = Vec::new();
        for t in &self.auth.tokens {
            tokens.extend(t.token.clone());
            tokens.extend(t.token_env.as_deref().and_then(&env));
        }
        if let Some(list) = env("IDEM_SERVE_TOKENS") {
            tokens.extend(listed_tokens(&list).flatten().map(|(_, _, secret)| secret.to_owned()));
        }
        (addresses, tokens)
    }

    /// The tokens of the file and of `IDEM_SERVE_TOKENS`, or anonymous access when the file
    /// asks for it (only on a loopback listener).
    ///
    /// # Errors
    /// [`ConfigError`] when a token is unusable, none is configured without `anonymous`, or
    /// `anonymous` is asked for on a listener other than loopback.
    pub fn tokens(&self, env: impl Fn(&str) -> Option<String>) -> Result<Tokens, ConfigError> {
        let mut tokens = Vec::new();
        for (i, t) in self.auth.tokens.iter().enumerate() {
            let secret = match (&t.token, &t.token_env) {
                (Some(s), None) => s.clone(),
                (None, Some(var)) => env(var).ok_or_else(|| {
                    invalid(
                        format!("auth.tokens[{i}].token_env"),
                        format!("the environment variable {var} is not set"),
                    )
                })?,
                _ => {
                    return Err(invalid(
                        format!("auth.tokens[{i}]"),
                        "give exactly one of token and token_env",
                    ));
                }
            };
            tokens.push(Token::new(&t.name, &secret, Scopes::from_list(t.scopes.clone()))?);
        }
        if let Some(list) = env("IDEM_SERVE_TOKENS") {
            for entry in listed_tokens(&list) {
                let Some((name, scopes, secret)) = entry else {
                    return Err(invalid(
                        "IDEM_SERVE_TOKENS",
                        "each entry is name:scope,scope:secret",
                    ));
                };
                let scopes: BTreeSet<&str> = scopes.split(',').filter(|s| !s.is_empty()).collect();
                tokens.push(Token::new(name, secret, Scopes::from_list(scopes))?);
            }
        }
        if self.auth.anonymous {
            if !tokens.is_empty() {
                return Err(invalid("auth.anonymous", "true, but tokens are configured too"));
            }
            let loopback = self
                .listen
                .rsplit_once(':')
                .map(|(host, _)| host.trim_matches(['[', ']']))
                .and_then(|h| h.parse::<std::net::IpAddr>().ok())
                .is_some_and(|ip| ip.is_loopback());
            if !loopback {
                return Err(invalid(
                    "auth.anonymous",
                    format!("only on a loopback listener, not {}", self.listen),
                ));
            }
            return Ok(Tokens::anonymous());
        }
        if tokens.is_empty() {
            return Err(invalid(
                "auth.tokens",
                "no token: add [[auth.tokens]] or IDEM_SERVE_TOKENS (or auth.anonymous = true \
                 on a loopback listener)",
            ));
        }
        Ok(Tokens::new(tokens)?)
    }

    /// The console's outbox URL (from `console.outbox` or `console.outbox_env`), if any.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] when the variable is unset.
    pub fn console_outbox_url(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<String>, ConfigError> {
        match (&self.console.outbox, &self.console.outbox_env) {
            (Some(u), _) => Ok(Some(u.clone())),
            (None, Some(var)) => env(var).map(Some).ok_or_else(|| {
                invalid("console.outbox_env", format!("the environment variable {var} is not set"))
            }),
            (None, None) => Ok(None),
        }
    }

    /// Checks the console's settings.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad field.
    pub fn check_console(&self) -> Result<(), ConfigError> {
        let c = &self.console;
        if c.session_minutes == 0 || c.session_minutes > 10_080 {
            return Err(invalid("console.session_minutes", "must be 1 to 10080 (a week)"));
        }
        if c.outbox.is_some() && c.outbox_env.is_some() {
            return Err(invalid("console.outbox", "give at most one of outbox and outbox_env"));
        }
        let mut names: BTreeSet<&str> = BTreeSet::new();
        if c.push_dead_letters {
            names.extend(self.push.iter().map(|p| p.name.as_str()));
        }
        for (i, d) in c.dead_letters.iter().enumerate() {
            let at = |f: &str| format!("console.dead_letters[{i}].{f}");
            if d.name.is_empty() || d.name.len() > 100 || d.name.chars().any(char::is_control) {
                return Err(invalid(at("name"), "must be 1 to 100 printable characters"));
            }
            if !names.insert(d.name.as_str()) {
                return Err(invalid(
                    at("name"),
                    format!(
                        "{:?} is used twice (push consumers' dead letters go by their name)",
                        d.name
                    ),
                ));
            }
            if d.broker.is_some() == d.broker_env.is_some() {
                return Err(invalid(at("broker"), "give exactly one of broker and broker_env"));
            }
            if d.queue.is_empty() {
                return Err(invalid(at("queue"), "must not be empty"));
            }
        }
        Ok(())
    }

    /// Checks the push consumers' settings.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad field.
    pub fn check_push(&self) -> Result<(), ConfigError> {
        let mut names = BTreeSet::new();
        for (i, p) in self.push.iter().enumerate() {
            let at = |f: &str| format!("push[{i}].{f}");
            if !names.insert(p.name.as_str()) {
                return Err(invalid(at("name"), format!("{:?} is used twice", p.name)));
            }
            if p.broker.is_some() == p.broker_env.is_some() {
                return Err(invalid(at("broker"), "give exactly one of broker and broker_env"));
            }
            if !(p.endpoint.starts_with("http://") || p.endpoint.starts_with("https://")) {
                return Err(invalid(at("endpoint"), "must be an http:// or https:// URL"));
            }
            if p.timeout_ms == 0 || p.timeout_ms > 600_000 {
                return Err(invalid(at("timeout_ms"), "must be 1 to 600000"));
            }
            if p.lease_ms < 3 * p.timeout_ms {
                return Err(invalid(
                    at("lease_ms"),
                    format!("must be at least 3 × timeout_ms ({})", 3 * p.timeout_ms),
                ));
            }
            if p.crash_loop_limit == 0 {
                return Err(invalid(at("crash_loop_limit"), "must be at least 1"));
            }
            if p.concurrency == 0 || p.concurrency > 1024 {
                return Err(invalid(at("concurrency"), "must be 1 to 1024"));
            }
            let key_ok = p.key == "message_id"
                || p.key.strip_prefix("header:").is_some_and(|h| !h.is_empty())
                || p.key.strip_prefix("json:").is_some_and(|j| j.starts_with('/'));
            if !key_ok {
                return Err(invalid(
                    at("key"),
                    "must be message_id, header:<name> or json:/<pointer>",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
