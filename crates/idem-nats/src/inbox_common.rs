//! What both inbox modes share.

use std::future::Future;
use std::pin::Pin;

use idem_core::consumer::HandlerError;

/// The handler's writes in inbox mode: a boxed future borrowing the batch transaction's
/// connection and the delivery.
pub type InboxWrites<'c, T, E> =
    Pin<Box<dyn Future<Output = Result<T, HandlerError<E>>> + Send + 'c>>;

/// Largest handler result stored with a marker.
pub(crate) const MAX_STORED_RESULT: usize = 64 * 1024;

/// The inbox consumer for one database: `$name` over `$inbox` of `$store`, whose transactions
/// run on `$conn` from `$pool` and begin with `$begin`. Both inbox modes are this one
/// body; only the driver types and how a batch transaction begins differ.
macro_rules! inbox_consumer {
    (
        $(#[$doc:meta])*
        $name:ident, inbox: $inbox:ty, store: $store:ty, conn: $conn:ty, pool: $pool:ty,
        begin: |$p:ident| $begin:expr $(,)?
    ) => {
        $(#[$doc])*
pub struct $name {
    source: Source,
    inbox: $inbox,
    pool: $pool,
    scope: String,
    extractor: Box<dyn KeyExtractor>,
    fingerprint: FingerprintSpec,
}

impl std::fmt::Debug for $name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(stringify!($name)).field("scope", &self.scope).finish_non_exhaustive()
    }
}

impl $name {
    /// Wraps a pull consumer over `store`'s inbox, keeping markers for `retain`. Makes the same
    /// startup checks as [`JetStreamConsumer::new`](crate::JetStreamConsumer::new); keys come
    /// from `Nats-Msg-Id` and fingerprints from the canonical JSON payload until
    /// [`with_key`](Self::with_key) / [`with_fingerprint`](Self::with_fingerprint) say otherwise.
    ///
    /// # Errors
    /// [`Error`] naming the failed check; [`Error::InvalidScope`] for a bad scope.
    pub async fn new(
        js: JetStream,
        consumer: PullConsumer,
        store: &$store,
        scope: impl Into<String>,
        retain: Duration,
        settings: Settings,
    ) -> Result<Self, Error> {
        let scope = scope.into();
        DedupKey::new(scope.clone(), "x").map_err(Error::InvalidScope)?;
        // The inbox holds no leases; a `Nak` waits at most the retry delay.
        let source = Source::open(js, consumer, settings, Duration::ZERO, retain, None).await?;
        Ok(Self {
            source,
            inbox: store.inbox(retain),
            pool: store.pool().clone(),
            scope,
            extractor: Box::new(MessageId),
            fingerprint: FingerprintSpec::default(),
        })
    }

    /// Takes keys from `extractor` instead of `Nats-Msg-Id`.
    #[must_use]
    pub fn with_key(mut self, extractor: impl KeyExtractor) -> Self {
        self.extractor = Box::new(extractor);
        self
    }

    /// Fingerprints payloads by `spec`.
    #[must_use]
    pub fn with_fingerprint(mut self, spec: FingerprintSpec) -> Self {
        self.fingerprint = spec;
        self
    }

    /// The redelivery window the retention was checked against.
    pub fn redelivery_window(&self) -> RetentionWindow {
        self.source.window
    }

    /// As [`JetStreamConsumer::fetch`](crate::JetStreamConsumer::fetch).
    ///
    /// # Errors
    /// [`Error::JetStream`] when the pull fails.
    pub async fn fetch(&self) -> Result<Vec<Delivery>, Error> {
        self.source.fetch().await
    }

    /// Marks, writes and commits the batch in one transaction (sending `Progress` meanwhile).
    /// Nothing is acked yet: pass the result to [`settle`](Self::settle).
    pub async fn process<T, E, F>(&self, batch: &[Delivery], writes: F) -> Verdicts
    where
        T: Serialize,
        E: Display,
        F: for<'c> Fn(&'c mut $conn, &'c Delivery) -> InboxWrites<'c, T, E>,
    {
        self.source.with_progress(batch, self.transact(batch, writes)).await
    }

    /// As [`JetStreamConsumer::settle`](crate::JetStreamConsumer::settle).
    pub async fn settle(&self, batch: Vec<Delivery>, verdicts: Verdicts) -> Report {
        settle(&self.source, batch, verdicts).await
    }

    /// Fetch, process, settle until `shutdown` completes (a batch in flight is finished first).
    ///
    /// # Errors
    /// [`Error::JetStream`] after 10 fetches in a row failed.
    pub async fn run<T, E, F>(
        &self,
        writes: F,
        shutdown: impl Future<Output = ()>,
    ) -> Result<Report, Error>
    where
        T: Serialize,
        E: Display,
        F: for<'c> Fn(&'c mut $conn, &'c Delivery) -> InboxWrites<'c, T, E>,
    {
        let mut total = Report::default();
        let mut shutdown = std::pin::pin!(shutdown);
        let mut failures = 0u32;
        loop {
            let batch = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(total),
                b = self.fetch() => b,
            };
            let batch = match batch {
                Ok(b) => {
                    failures = 0;
                    b
                }
                Err(e) => {
                    failures += 1;
                    if failures >= 10 {
                        return Err(e);
                    }
                    tracing::warn!(target: "idem", error = %e, "fetch failed; retrying");
                    tokio::select! {
                        () = &mut shutdown => return Ok(total),
                        () = tokio::time::sleep(self.source.settings.retry_delay) => continue,
                    }
                }
            };
            if batch.is_empty() {
                continue;
            }
            let v = self.process(&batch, &writes).await;
            total += self.settle(batch, v).await;
        }
    }

    fn prepare(&self, d: &Delivery) -> Result<(DedupKey, Option<Fingerprint>), String> {
        let id = self.extractor.extract(d as &dyn Envelope).map_err(|e| e.to_string())?;
        let key = DedupKey::with_limit(self.scope.clone(), id, DEFAULT_MAX_KEY_BYTES)
            .map_err(|e| format!("invalid dedup key: {e}"))?;
        let fp = self
            .fingerprint
            .fingerprint(d.payload())
            .map_err(|e| format!("payload is not JSON: {e}"))?;
        Ok((key, fp))
    }

    async fn transact<T, E, F>(&self, batch: &[Delivery], writes: F) -> Verdicts
    where
        T: Serialize,
        E: Display,
        F: for<'c> Fn(&'c mut $conn, &'c Delivery) -> InboxWrites<'c, T, E>,
    {
        let mut report = Report { fetched: batch.len() as u64, ..Report::default() };
        let mut decided: Vec<(&'static str, Disposition)> = Vec::with_capacity(batch.len());
        let retry = Disposition::Retry { after: None };
        match { let $p = &self.pool; $begin }.await {
            Err(e) => {
                tracing::warn!(target: "idem", error = %e, "could not begin the inbox transaction");
                decided.extend(batch.iter().map(|_| ("failed_transient", retry.clone())));
            }
            Ok(mut tx) => {
                let mut broken = false;
                for d in batch {
                    let one = match self.prepare(d) {
                        Err(reason) => Ok(("failed_permanent", Disposition::DeadLetter { reason })),
                        Ok((key, fp)) => self.one(&mut tx, d, &key, fp, &writes).await,
                    };
                    match one {
                        Ok(x) => decided.push(x),
                        Err(e) => {
                            tracing::warn!(target: "idem", error = %e,
                                "inbox savepoint failed; rolling the whole batch back");
                            broken = true;
                            break;
                        }
                    }
                }
                let committed = !broken
                    && match tx.commit().await {
                        Ok(()) => true,
                        Err(e) => {
                            tracing::warn!(target: "idem", error = %e, "inbox commit failed; nothing of the batch is acked");
                            false
                        }
                    };
                if !committed {
                    // Nothing was written: every message comes back, except those whose key
                    // could never be read (they dead-letter whatever the database says).
                    decided.resize(batch.len(), ("failed_transient", retry.clone()));
                    for x in &mut decided {
                        if !matches!(x.1, Disposition::DeadLetter { .. }) || x.0 == "conflict" {
                            *x = ("failed_transient", retry.clone());
                        }
                    }
                }
            }
        }
        let verdicts = batch
            .iter()
            .zip(decided)
            .map(|(d, (label, disp))| {
                report.count(label);
                metrics::counter!("idem_outcomes_total", "scope" => self.scope.clone(), "outcome" => label)
                    .increment(1);
                tracing::debug!(target: "idem", scope = %self.scope, key = d.message_id().unwrap_or(""),
                    outcome = label, seq = d.stream_sequence(), "delivery finished");
                self.source.verdict(d, disp, label)
            })
            .collect::<Vec<Verdict>>();
        Verdicts { verdicts, report }
    }

    /// One message inside its savepoint. `Err` only when the savepoint itself fails (the
    /// transaction is then not trusted).
    async fn one<T, E, F>(
        &self,
        tx: &mut $conn,
        d: &Delivery,
        key: &DedupKey,
        fp: Option<Fingerprint>,
        writes: &F,
    ) -> Result<(&'static str, Disposition), sqlx::Error>
    where
        T: Serialize,
        E: Display,
        F: for<'c> Fn(&'c mut $conn, &'c Delivery) -> InboxWrites<'c, T, E>,
    {
        sqlx::query("SAVEPOINT idem_msg").execute(&mut *tx).await?;
        let retry = Disposition::Retry { after: None };
        let (keep, out) = match self.inbox.mark(tx, key, fp).await {
            Err(e) => {
                tracing::warn!(target: "idem", %key, error = %e, "inbox mark failed");
                (false, ("failed_transient", retry))
            }
            Ok(Mark::First) => match writes(tx, d).await {
                Ok(v) => {
                    let stored =
                        serde_json::to_vec(&v).ok().filter(|b| b.len() <= MAX_STORED_RESULT);
                    match stored {
                        Some(b) => match self.inbox.set_result(tx, key, &b).await {
                            Ok(()) => (true, ("processed", Disposition::Ack)),
                            Err(e) => {
                                tracing::warn!(target: "idem", %key, error = %e, "storing the result failed");
                                (false, ("failed_transient", retry))
                            }
                        },
                        None => (true, ("processed", Disposition::Ack)),
                    }
                }
                Err(HandlerError::Transient(e)) => {
                    tracing::warn!(target: "idem", %key, error = %e, "handler failed (transient)");
                    (false, ("failed_transient", retry))
                }
                Err(HandlerError::Permanent(e)) => (
                    false,
                    (
                        "failed_permanent",
                        Disposition::DeadLetter { reason: format!("handler failed: {e}") },
                    ),
                ),
            },
            Ok(Mark::Duplicate(_)) => (true, ("duplicate", Disposition::Ack)),
            Ok(Mark::Conflict(rec)) => {
                let c = Conflict {
                    key: key.clone(),
                    stored: rec.fingerprint,
                    incoming: fp,
                    stored_state: rec.state,
                };
                (true, ("conflict", Disposition::DeadLetter { reason: format!("conflict: {c}") }))
            }
            Ok(Mark::InProgress(_)) => (true, ("in_progress_elsewhere", retry)),
            Ok(_) => (true, ("failed_transient", retry)),
        };
        if !keep {
            sqlx::query("ROLLBACK TO idem_msg").execute(&mut *tx).await?;
        }
        sqlx::query("RELEASE idem_msg").execute(&mut *tx).await?;
        Ok(out)
    }
}
    };
}

pub(crate) use inbox_consumer;
