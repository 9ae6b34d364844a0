//! Counts of what the adapter did.

use std::ops::AddAssign;

/// What happened to the messages of one batch (or, summed, of a whole run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Report {
    /// Messages fetched.
    pub fetched: u64,
    /// Handlers that ran and committed.
    pub processed: u64,
    /// Deliveries found already done.
    pub duplicates: u64,
    /// Same key, different payload (dead-lettered).
    pub conflicts: u64,
    /// Deliveries of a key another consumer holds (nak'd with the lease's remaining time).
    pub in_progress: u64,
    /// Failures: transient (nak'd) and permanent (dead-lettered).
    pub failed: u64,
    /// Acked.
    pub acked: u64,
    /// Nak'd for redelivery.
    pub retried: u64,
    /// Published to the dead-letter subject (confirmed), then terminated.
    pub dead_lettered: u64,
    /// Dead-letter publishes that failed (the message was nak'd instead).
    pub dead_letter_failures: u64,
    /// Acks or naks that could not be sent (the message comes back after `ack_wait`).
    pub reply_failures: u64,
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
        self.acked += o.acked;
        self.retried += o.retried;
        self.dead_lettered += o.dead_lettered;
        self.dead_letter_failures += o.dead_letter_failures;
        self.reply_failures += o.reply_failures;
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fetched {}: processed {}, duplicates {}, conflicts {}, in progress elsewhere {}, failed {}; acked {}, retried {}, dead-lettered {}",
            self.fetched,
            self.processed,
            self.duplicates,
            self.conflicts,
            self.in_progress,
            self.failed,
            self.acked,
            self.retried,
            self.dead_lettered
        )?;
        if self.dead_letter_failures + self.reply_failures > 0 {
            write!(
                f,
                " ({} dead-letter and {} reply failures)",
                self.dead_letter_failures, self.reply_failures
            )?;
        }
        Ok(())
    }
}
