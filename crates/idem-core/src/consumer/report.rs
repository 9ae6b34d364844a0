//! Counts of what a run did.

use std::ops::AddAssign;

use crate::engine::{OutcomeKind, Verb};

/// What happened to the messages of a batch, or, summed, of a whole run: the same counts for
/// every broker, and the first store error met, so that a consumer whose every message fails
/// on its store (a table never created) says why even where no log is collected.
///
/// ```
/// use idem_core::consumer::Report;
/// use idem_core::OutcomeKind;
///
/// let r = Report::default();
/// assert_eq!(r.outcome(OutcomeKind::Duplicate), 0);
/// assert_eq!(r.to_string(), "fetched 0: processed 0, duplicates 0, conflicts 0, in progress elsewhere 0, failed 0 (transient 0, permanent 0); acked 0, retried 0, dead-lettered 0, released 0");
///
/// let mut failing = Report::default();
/// failing.first_store_error = Some("relation \"idem\".\"idem_records\" does not exist".into());
/// assert!(failing.to_string().ends_with("; first store error: relation \"idem\".\"idem_records\" does not exist"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Batches decided (fetches that brought something).
    pub batches: u64,
    /// Messages fetched.
    pub fetched: u64,
    /// Handlers that ran and committed.
    pub processed: u64,
    /// Deliveries found already done.
    pub duplicates: u64,
    /// Same key, different payload (dead-lettered).
    pub conflicts: u64,
    /// Deliveries of a key another consumer holds (retried).
    pub in_progress: u64,
    /// Transient failures (retried).
    pub failed_transient: u64,
    /// Permanent failures (dead-lettered).
    pub failed_permanent: u64,
    /// Acknowledged (processed or duplicate).
    pub acked: u64,
    /// Sent back for redelivery.
    pub retried: u64,
    /// Copied to the dead-letter destination (confirmed), then removed.
    pub dead_lettered: u64,
    /// Given back untouched at shutdown.
    pub released: u64,
    /// Dead-letter copies that failed (those messages were retried instead).
    pub dead_letter_failures: u64,
    /// Verbs that could not be sent (the broker redelivers those messages).
    pub settle_failures: u64,
    /// Fetches that failed and were retried.
    pub fetch_failures: u64,
    /// The first failure of a delivery on the store (its message and causes), if any: shown by
    /// the report's `Display`.
    pub first_store_error: Option<String>,
}

impl Report {
    /// How many deliveries had `kind`.
    pub fn outcome(&self, kind: OutcomeKind) -> u64 {
        match kind {
            OutcomeKind::Processed => self.processed,
            OutcomeKind::Duplicate => self.duplicates,
            OutcomeKind::Conflict => self.conflicts,
            OutcomeKind::InProgressElsewhere => self.in_progress,
            OutcomeKind::FailedTransient => self.failed_transient,
            OutcomeKind::FailedPermanent => self.failed_permanent,
        }
    }

    /// Counts one delivery with outcome `kind`.
    pub fn count_outcome(&mut self, kind: OutcomeKind) {
        let n = match kind {
            OutcomeKind::Processed => &mut self.processed,
            OutcomeKind::Duplicate => &mut self.duplicates,
            OutcomeKind::Conflict => &mut self.conflicts,
            OutcomeKind::InProgressElsewhere => &mut self.in_progress,
            OutcomeKind::FailedTransient => &mut self.failed_transient,
            OutcomeKind::FailedPermanent => &mut self.failed_permanent,
        };
        *n += 1;
    }

    /// Counts one verb.
    pub(crate) fn count_verb(&mut self, verb: &Verb) {
        match verb {
            Verb::Ack => self.acked += 1,
            Verb::DeadLetter { .. } => self.dead_lettered += 1,
            Verb::Retry { .. } => self.retried += 1,
            Verb::Release => self.released += 1,
        }
    }

    /// All failures, transient and permanent.
    pub fn failed(&self) -> u64 {
        self.failed_transient + self.failed_permanent
    }
}

impl AddAssign for Report {
    fn add_assign(&mut self, o: Self) {
        self.batches += o.batches;
        self.fetched += o.fetched;
        self.processed += o.processed;
        self.duplicates += o.duplicates;
        self.conflicts += o.conflicts;
        self.in_progress += o.in_progress;
        self.failed_transient += o.failed_transient;
        self.failed_permanent += o.failed_permanent;
        self.acked += o.acked;
        self.retried += o.retried;
        self.dead_lettered += o.dead_lettered;
        self.released += o.released;
        self.dead_letter_failures += o.dead_letter_failures;
        self.settle_failures += o.settle_failures;
        self.fetch_failures += o.fetch_failures;
        if self.first_store_error.is_none() {
            self.first_store_error = o.first_store_error;
        }
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fetched {}: processed {}, duplicates {}, conflicts {}, in progress elsewhere {}, \
             failed {} (transient {}, permanent {}); acked {}, retried {}, dead-lettered {}, released {}",
            self.fetched,
            self.processed,
            self.duplicates,
            self.conflicts,
            self.in_progress,
            self.failed(),
            self.failed_transient,
            self.failed_permanent,
            self.acked,
            self.retried,
            self.dead_lettered,
            self.released,
        )?;
        let troubles = self.dead_letter_failures + self.settle_failures + self.fetch_failures;
        if troubles > 0 {
            write!(
                f,
                " ({} dead-letter, {} settle and {} fetch failures)",
                self.dead_letter_failures, self.settle_failures, self.fetch_failures
            )?;
        }
        if let Some(e) = &self.first_store_error {
            write!(f, "; first store error: {e}")?;
        }
        Ok(())
    }
}
