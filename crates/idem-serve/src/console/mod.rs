//! The operator console: pages over the store, the dead letters and the outbox, and live
//! charts, served by the same process as the API at `/console` ([`router_with_console`]).
//!
//! Every page is rendered on the server; every value shown is HTML-escaped; the stylesheet and
//! the one script (the charts) are compiled into the binary, so the console works without any
//! network access beyond its own. The dead-letter actions apply idem's rules, written once in
//! [`Workbench`](idem_dlq::Workbench): a failed message is replayed under its key, a
//! conflict only discarded or accepted as a new message, and a dead letter is removed only once
//! its replay is confirmed.
//!
//! # Access
//! - The operator logs in by pasting an API token; the console keeps a session (a random id in
//!   an `HttpOnly`, `SameSite=Strict` cookie, mapped on the server to the token's name and
//!   scopes, expiring after [`Console::session_ttl`]). The token itself is not kept. With
//!   [`Tokens::anonymous`] (a loopback listener only), no login is asked.
//! - What a token may not use through the API it may not use here: records, counts and dead
//!   letters of other scopes are not shown, and an action on one answers `403`. Store-wide
//!   figures and the outbox's retry need scope `*`.
//! - Every action is a `POST` carrying the session's CSRF token (`403` without it, and nothing
//!   changes); a cross-origin `Origin` is refused too.
//! - [`Console::read_only`] shows no action at all, and answers `403` to every action.
//!
//! ```
//! use std::sync::Arc;
//! use idem_dlq::MemoryDeadLetters;
//! use idem_serve::console::Console;
//! use idem_serve::{Scopes, Token, Tokens};
//!
//! let tokens = Tokens::new(vec![Token::new("ops", "a-long-random-secret", Scopes::All)?])?;
//! let console = Console::new().dead_letters("orders", Arc::new(MemoryDeadLetters::new()));
//! let app: axum::Router =
//!     idem_serve::router_with_console(idem_core::MemoryStore::new(), tokens, None, console);
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use idem_core::outbox::{OutboxCounts, OutboxStore, UnsentRow};
use idem_core::{DedupStore, InspectStore, StoreError};
use idem_dlq::{DeadLetterQueue, MAX_LETTERS};

use crate::auth::Tokens;
use crate::ops::{AppState, MetricsRender};

mod charts;
mod html;
mod layout;
mod letters;
mod outbox;
mod session;
mod store;

/// How long a console session lasts by default: 8 hours.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(8 * 3600);
/// How many dead letters a page reads from each queue by default.
pub const DEFAULT_READ_LIMIT: usize = 1000;
/// The most dead letters one action may select by id.
pub const MAX_SELECTED: usize = 1000;

/// A boxed future, as [`OutboxAdmin`] returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the console needs of an outbox: its counts and unsent rows, and retrying parked rows.
/// Object safe, and implemented by every [`OutboxStore`].
pub trait OutboxAdmin: Send + Sync {
    /// Rows by state ([`OutboxStore::counts`]).
    fn counts(&self) -> BoxFuture<'_, Result<OutboxCounts, StoreError>>;

    /// Makes up to `limit` parked rows due again; returns how many ([`OutboxStore::retry_parked`]).
    fn retry_parked(&self, limit: usize) -> BoxFuture<'_, Result<u64, StoreError>>;

    /// Up to `limit` unsent rows, parked first ([`OutboxStore::unsent`]).
    fn unsent(&self, limit: usize) -> BoxFuture<'_, Result<Vec<UnsentRow>, StoreError>>;
}

impl<T: OutboxStore> OutboxAdmin for T {
    fn counts(&self) -> BoxFuture<'_, Result<OutboxCounts, StoreError>> {
        Box::pin(OutboxStore::counts(self))
    }

    fn unsent(&self, limit: usize) -> BoxFuture<'_, Result<Vec<UnsentRow>, StoreError>> {
        Box::pin(OutboxStore::unsent(self, limit))
    }

    fn retry_parked(&self, limit: usize) -> BoxFuture<'_, Result<u64, StoreError>> {
        Box::pin(OutboxStore::retry_parked(self, limit))
    }
}

/// The console's settings: what it shows besides the store, and how it may be used.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idem_dlq::MemoryDeadLetters;
/// use idem_serve::console::Console;
///
/// let console = Console::new()
///     .dead_letters("orders", Arc::new(MemoryDeadLetters::new()))
///     .read_only(true)
///     .session_ttl(Duration::from_secs(3600));
/// assert!(console.is_read_only());
/// ```
#[derive(Clone)]
#[must_use]
pub struct Console {
    read_only: bool,
    queues: Vec<(String, Arc<dyn DeadLetterQueue>)>,
    outbox: Option<Arc<dyn OutboxAdmin>>,
    secure_cookie: bool,
    session_ttl: Duration,
    read_limit: usize,
}

impl Default for Console {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for Console {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let queues: Vec<String> =
            self.queues.iter().map(|(n, q)| format!("{n}: {}", q.describe())).collect();
        f.debug_struct("Console")
            .field("read_only", &self.read_only)
            .field("queues", &queues)
            .field("outbox", &self.outbox.is_some())
            .field("secure_cookie", &self.secure_cookie)
            .field("session_ttl", &self.session_ttl)
            .field("read_limit", &self.read_limit)
            .finish()
    }
}

impl Console {
    /// The store pages and the charts; actions allowed; no dead letters, no outbox.
    pub fn new() -> Self {
        Self {
            read_only: false,
            queues: Vec::new(),
            outbox: None,
            secure_cookie: false,
            session_ttl: DEFAULT_SESSION_TTL,
            read_limit: DEFAULT_READ_LIMIT,
        }
    }

    /// Read-only: no action is shown, and every action answers `403`.
    pub fn read_only(mut self, yes: bool) -> Self {
        self.read_only = yes;
        self
    }

    /// Whether it is read-only.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Shows the dead letters of `queue` under `name` (a name given again replaces the first).
    pub fn dead_letters(
        mut self,
        name: impl Into<String>,
        queue: Arc<dyn DeadLetterQueue>,
    ) -> Self {
        let name = name.into();
        self.queues.retain(|(n, _)| *n != name);
        self.queues.push((name, queue));
        self
    }

    /// Shows an outbox's counts, and lets a token with scope `*` retry its parked rows.
    pub fn outbox(mut self, outbox: Arc<dyn OutboxAdmin>) -> Self {
        self.outbox = Some(outbox);
        self
    }

    /// Marks the session cookie `Secure` (set it when the listener is HTTPS).
    pub fn secure_cookie(mut self, yes: bool) -> Self {
        self.secure_cookie = yes;
        self
    }

    /// How long a session lasts from login (default [`DEFAULT_SESSION_TTL`]; at least a
    /// minute).
    pub fn session_ttl(mut self, ttl: Duration) -> Self {
        self.session_ttl = ttl.max(Duration::from_secs(60));
        self
    }

    /// How many dead letters a page or an action reads from each queue, oldest first (default
    /// [`DEFAULT_READ_LIMIT`], 1 to [`MAX_LETTERS`]). Letters past it are acted on once the
    /// ones before them are gone.
    pub fn read_limit(mut self, n: usize) -> Self {
        self.read_limit = n.clamp(1, MAX_LETTERS);
        self
    }
}

/// The claim API of [`router`](crate::router) with the console mounted at `/console`.
///
/// See the [module docs](self) for what it shows and who may do what.
pub fn router_with_console<S: DedupStore + InspectStore>(
    store: S,
    tokens: Tokens,
    metrics: Option<MetricsRender>,
    console: Console,
) -> Router {
    let app = AppState { store: Arc::new(store), tokens: Arc::new(tokens), metrics };
    crate::server::assemble(app.clone(), Some(routes(app, console)))
}

/// What every console handler gets.
#[derive(Clone)]
pub(crate) struct ConsoleState {
    pub(crate) app: AppState,
    pub(crate) console: Arc<Console>,
    pub(crate) sessions: Arc<session::Sessions>,
}

impl ConsoleState {
    /// The dead-letter queue called `name`.
    pub(crate) fn queue(&self, name: &str) -> Option<&Arc<dyn DeadLetterQueue>> {
        self.console.queues.iter().find(|(n, _)| n == name).map(|(_, q)| q)
    }
}

fn routes(app: AppState, console: Console) -> Router {
    let state = ConsoleState {
        app,
        console: Arc::new(console),
        sessions: Arc::new(session::Sessions::default()),
    };
    Router::new()
        .route("/console", get(store::overview))
        .route("/console/", get(store::overview))
        .route("/console/login", get(session::login_page).post(session::login))
        .route("/console/logout", post(session::logout))
        .route("/console/assets/{file}", get(html::asset))
        .route("/console/store/release", post(store::release))
        .route("/console/store/fail", post(store::fail))
        .route("/console/dead-letters", get(letters::index))
        .route("/console/dead-letters/{queue}", get(letters::queue))
        .route("/console/dead-letters/{queue}/letter", get(letters::letter))
        .route(
            "/console/dead-letters/{queue}/groups/{group}",
            get(letters::group_page).post(letters::act),
        )
        .route("/console/outbox", get(outbox::page))
        .route("/console/outbox/retry", post(outbox::retry))
        .route("/console/charts", get(charts::page))
        .route("/console/metrics.json", get(charts::json))
        .with_state(state)
}
