//! Counts of what the adapter did.

use std::ops::AddAssign;

/// What happened to the messages of one batch (or, summed, of a whole run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Messages polled (new ones and retries).
    pub fetched: u64,
    /// Handlers that ran and committed.
    pub processed: u64,
    /// Deliveries found already done.
    pub duplicates: u64,
    /// Same key, different payload (dead-lettered).
    pub conflicts: u64,
    /// Deliveries of a key another consumer holds (retried after the lease's remaining time).
    pub in_progress: u64,
    /// Failures: transient (retried) and permanent (dead-lettered).
    pub failed: u64,
    /// Retries scheduled (the message's partition is paused until they settle).
    pub retried: u64,
    /// Produced to the dead-letter topic (acknowledged by the broker).
    pub dead_lettered: u64,
    /// Dead-letter produces that failed (the message is retried instead).
    pub dead_letter_failures: u64,
    /// Offset commits that failed (the offsets are committed with a later batch).
    pub commit_failures: u64,
}

impl Report {
    pub(crate) fn count(&mut self, label: &str) {
        match label {
            "processed" => self.processed += 1,
            "duplicate" => self.duplicates += 1,
            "conflict" => self.conflicts += 1,
            "in_progress_elsewhere" => self.in_progress += 1,
            _ => self.failed += 1,
        }
    }
}

impl AddAssign for Report {
    fn add_assign(&mut self, o: Self) {
        self.fetched += o.fetched;
        self.processed += o.processed;
        self.duplicates += o.duplicates;
        self.conflicts += o.conflicts;
        self.in_progress += o.in_progress;
        self.failed += o.failed;
        self.retried += o.retried;
        self.dead_lettered += o.dead_lettered;
        self.dead_letter_failures += o.dead_letter_failures;
        self.commit_failures += o.commit_failures;
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fetched {}: processed {}, duplicates {}, conflicts {}, in progress elsewhere {}, failed {}; retried {}, dead-lettered {}",
            self.fetched,
            self.processed,
            self.duplicates,
            self.conflicts,
            self.in_progress,
            self.failed,
            self.retried,
            self.dead_lettered
        )?;
        if self.dead_letter_failures + self.commit_failures > 0 {
            write!(
                f,
                " ({} dead-letter and {} commit failures)",
                self.dead_letter_failures, self.commit_failures
            )?;
        }
        Ok(())
    }
}
