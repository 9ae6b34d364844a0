//! The broker side of a [`Consumer`](super::Consumer): what an adapter implements.

use std::future::Future;
use std::time::Duration;

use crate::DedupKey;
use crate::engine::{OutcomeKind, Verb};
use crate::extract::Envelope;

/// A broker as the consumer sees it: fetch a batch, copy a message to the dead-letter
/// destination, settle a batch. Everything else — claiming, running handlers, committing,
/// choosing verbs, the order of verbs, shutdown — is the consumer's, written once.
///
/// # Contract
/// - `fetch` returns messages the broker will redeliver unless they are settled (manual acks).
/// - `dead_letter` returns `Ok` for a copy only once the broker has confirmed it is stored.
/// - `settle` sends the verbs in `items` and nothing else; the consumer calls it only after every
///   effect and dead-letter copy it acknowledges is durable.
/// - No method waits forever on its own: the consumer bounds each call with the consumer's broker
///   timeout, and a call that runs out ends the run (unsettled messages are redelivered).
///
/// The conformance suite in `idem-testkit` checks an implementation against a real broker.
pub trait Source: Send + Sync + Sized + 'static {
    /// One delivery as handlers and key extractors see it. Cloned into each handler: keep it
    /// cheap to clone (reference-counted).
    type Delivery: Envelope + Clone + Send + Sync + 'static;
    /// What the broker client reports.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Up to `max` messages: those ready now, or else the first to arrive within `wait`
    /// together with those ready right after it. Empty when nothing arrived.
    ///
    /// # Errors
    /// The broker's error; the consumer retries per its fetch-failure policy unless
    /// [`is_fatal`](Self::is_fatal) says the source cannot recover.
    ///
    /// # Cancel safety
    /// Need not be cancel safe: the consumer never drops a fetch in progress.
    fn fetch(
        &self,
        max: usize,
        wait: Duration,
    ) -> impl Future<Output = Result<Vec<Self::Delivery>, Self::Error>> + Send;

    /// Whether `error` means the source cannot go on (its channel or connection is gone), so
    /// the run ends at once instead of retrying. Default: no error is fatal.
    fn is_fatal(&self, error: &Self::Error) -> bool {
        let _ = error;
        false
    }

    /// Runs beside the handlers of `batch` and tells the broker, on its own beat, that they
    /// are still being worked on (JetStream's `+WPI`), so it does not redeliver them meanwhile.
    /// Never returns. Default: does nothing.
    ///
    /// # Cancel safety
    /// Must be cancel safe: the consumer drops it once the batch is decided.
    fn keep_alive<'a>(
        &'a self,
        batch: &'a [Self::Delivery],
    ) -> impl Future<Output = ()> + Send + 'a {
        let _ = batch;
        std::future::pending()
    }

    /// `Some(why)` when a retry of `msg` would exceed the broker's delivery limit, after which
    /// the broker would drop it without a trace: the consumer then dead-letters it instead.
    /// Default: no limit.
    fn give_up(&self, msg: &Self::Delivery) -> Option<String> {
        let _ = msg;
        None
    }

    /// How many messages the broker still holds for this consumer after `batch` (just
    /// fetched), when the fetch's own answer says so: recorded as the
    /// `idem_source_lag_messages` gauge. Implement it only where it costs no broker round trip
    /// (JetStream's delivery metadata carries it); a lag that needs a query per batch is
    /// better left to the broker's own exporter. Default: unknown.
    fn lag(&self, batch: &[Self::Delivery]) -> Option<u64> {
        let _ = batch;
        None
    }

    /// Copies each message to the dead-letter destination with the [`DeadLetter`] headers and
    /// the message's original location, answering per item (in order) once the broker has
    /// confirmed the copy. A failed copy is never followed by the removal of the original.
    ///
    /// # Cancel safety
    /// Need not be cancel safe: a copy made twice is harmless (dead letters are at least once).
    fn dead_letter<'a>(
        &'a self,
        items: &'a [(&'a Self::Delivery, DeadLetter)],
    ) -> impl Future<Output = Vec<Result<(), Self::Error>>> + Send + 'a;

    /// Sends each message's final verb ([`Verb`]; `DeadLetter` means the copy is confirmed:
    /// remove the original). Returns how many verbs could not be sent
    /// while the source can go on (those messages come back: the broker redelivers them).
    ///
    /// # Errors
    /// When the source cannot go on (its channel is gone); the run ends and the broker
    /// redelivers what was not acknowledged.
    ///
    /// # Cancel safety
    /// Need not be cancel safe: the consumer never drops it midway (it bounds it with the
    /// broker timeout and then ends the run).
    fn settle(
        &self,
        items: Vec<(Self::Delivery, Verb)>,
    ) -> impl Future<Output = Result<u64, Self::Error>> + Send;

    /// Called once when the run ends: gives back what the broker delivered but the consumer never
    /// fetched, makes final commits, closes channels. Returns how many messages it gave back.
    ///
    /// # Errors
    /// The broker's error (logged by the driver; the run's report is still returned).
    ///
    /// # Cancel safety
    /// Need not be cancel safe: a close cut short leaves the broker to redeliver.
    fn close(&self) -> impl Future<Output = Result<u64, Self::Error>> + Send {
        async { Ok(0) }
    }
}

/// How a [`Source`] is created: its settings, opened once the consumer's retention is known
/// (for the broker-specific redelivery-window checks).
pub trait SourceConfig: Send + Sized {
    /// The source it opens.
    type Source: Source;

    /// Connects, checks the broker's configuration against `opening`, declares what the
    /// source needs.
    ///
    /// # Errors
    /// The source's error, naming the check or the broker call that failed.
    ///
    /// # Cancel safety
    /// Need not be cancel safe: a dropped open leaves nothing but what it declared.
    fn open(
        self,
        opening: Opening<'_>,
    ) -> impl Future<Output = Result<Self::Source, <Self::Source as Source>::Error>> + Send;
}

/// What a source is told when it opens.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Opening<'a> {
    /// The consumer's scope.
    pub scope: &'a str,
    /// How long dedup records are kept: must cover the broker's redelivery window.
    pub retention: Duration,
    /// The longest a key stays in progress under a lease (`None` in inbox mode).
    pub lease: Option<Duration>,
    /// The engine's lease heartbeat, for a source that keeps deliveries alive on the same beat.
    pub heartbeat: Option<Duration>,
    /// The most messages the consumer fetches at once.
    pub batch: usize,
    /// How many batches the consumer keeps in flight at once (a source with a prefetch wants
    /// room for `batch × concurrency` unsettled messages).
    pub concurrency: usize,
}

/// What a dead-letter copy carries beside the message itself.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetter {
    /// The outcome that dead-lettered it (`conflict`, `failed_permanent`; the last outcome
    /// when the broker's delivery limit was reached).
    pub outcome: OutcomeKind,
    /// Why, in words.
    pub reason: String,
    /// The consumer's scope.
    pub scope: String,
    /// The message's dedup key (its id within the scope), when it had a usable one.
    pub key: Option<String>,
}

impl DeadLetter {
    /// The [`headers`](super::headers) every broker puts on the copy — reason (one line, at
    /// most 1 KiB), outcome, scope and, when the message had one, its key — beside its own
    /// location headers.
    ///
    /// ```
    /// use idem_core::consumer::{DeadLetter, headers};
    /// use idem_core::OutcomeKind;
    ///
    /// let dl = DeadLetter::new(OutcomeKind::Conflict, "key o-7 reused\nwith other content", "billing");
    /// let h = dl.headers();
    /// assert_eq!(h[0], (headers::REASON, "key o-7 reused with other content".to_owned()));
    /// assert_eq!(h[1], (headers::OUTCOME, "conflict".to_owned()));
    /// assert_eq!(h.len(), 3);
    /// assert_eq!(dl.with_key("o-7").headers()[3], (headers::KEY, "o-7".to_owned()));
    /// ```
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        let mut h = vec![
            (super::headers::REASON, super::headers::header_safe(&self.reason)),
            (super::headers::OUTCOME, self.outcome.as_str().to_owned()),
            (super::headers::SCOPE, super::headers::header_safe(&self.scope)),
        ];
        // A key is at most 512 bytes, but may hold any character: a key a header cannot
        // carry exactly is left out rather than changed.
        if let Some(key) = self.key.as_deref().filter(|k| super::headers::header_safe(k) == *k) {
            h.push((super::headers::KEY, key.to_owned()));
        }
        h
    }

    /// A dead letter for `outcome` with `reason`, in `scope`.
    pub fn new(outcome: OutcomeKind, reason: impl Into<String>, scope: impl Into<String>) -> Self {
        Self { outcome, reason: reason.into(), scope: scope.into(), key: None }
    }

    /// The same, naming the message's dedup key.
    #[must_use]
    pub fn with_key(mut self, key: impl Into<String>) -> Self {
        self.key = Some(key.into());
        self
    }
}

/// One message's fate, shown to the [`on_settle`](super::Builder::on_settle) hook after its
/// outcome (and any dead-letter copy) is durable and before the broker is told.
#[derive(Debug)]
#[non_exhaustive]
pub struct Settlement<'a, M> {
    /// The message.
    pub message: &'a M,
    /// Its dedup key, when it has a usable one.
    pub key: Option<&'a DedupKey>,
    /// Its outcome.
    pub outcome: OutcomeKind,
    /// The verb about to be sent.
    pub verb: &'a Verb,
}

/// The delay to use for a retry: the suggestion clamped to `[min, max]`, or `default`.
///
/// ```
/// use std::time::Duration;
/// use idem_core::consumer::retry_delay;
///
/// let s = Duration::from_secs;
/// assert_eq!(retry_delay(Some(s(900)), s(1), s(1), s(300)), s(300));
/// assert_eq!(retry_delay(None, s(5), s(1), s(300)), s(5));
/// ```
pub fn retry_delay(
    after: Option<Duration>,
    default: Duration,
    min: Duration,
    max: Duration,
) -> Duration {
    after.map_or(default, |d| d.clamp(min, max.max(min)))
}
