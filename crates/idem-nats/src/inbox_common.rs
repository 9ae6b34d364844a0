//! What both inbox modes share.

/// The handler's writes in inbox mode: a boxed future borrowing the batch transaction's
/// connection and the delivery.
pub type InboxWrites<'c, T, E> = idem_sqlx::batch::BatchWrites<'c, T, E>;

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

    fn prepare(&self, d: &Delivery) -> idem_sqlx::batch::Prepared {
        idem_sqlx::batch::prepare(self.extractor.as_ref(), &self.scope, &self.fingerprint, d)
    }

    async fn transact<T, E, F>(&self, batch: &[Delivery], writes: F) -> Verdicts
    where
        T: Serialize,
        E: Display,
        F: for<'c> Fn(&'c mut $conn, &'c Delivery) -> InboxWrites<'c, T, E>,
    {
        let mut report = Report { fetched: batch.len() as u64, ..Report::default() };
        let items: Vec<_> = batch.iter().map(|d| (d, self.prepare(d))).collect();
        let decided = transact(&self.inbox, { let $p = &self.pool; $begin }, items, &writes).await;
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
}
    };
}

pub(crate) use inbox_consumer;
