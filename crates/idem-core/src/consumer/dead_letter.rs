//! The verbs of a decided batch: each outcome's, with the dead-letter copies made first, so
//! a message leaves its queue only once its copy is safely elsewhere.

use std::fmt::Display;

use super::{Consumer, DeadLetter, Error, Report, Source};
use crate::engine::{Backend, Outcome, Verb};
use crate::telemetry::DEAD_LETTERS_TOTAL;

impl<S: Source, B: Backend> Consumer<S, B> {
    /// The verb for each message of `batch` by its outcome (counted in `report`), `None` for
    /// a dead letter — the outcome's, or a retry the source gives up on — with its copy to
    /// make ([`copy_dead_letters`](Self::copy_dead_letters)).
    pub(super) fn verbs<T, E: Display>(
        &self,
        batch: &[S::Delivery],
        outcomes: &[Outcome<T, E>],
        report: &mut Report,
    ) -> (Vec<Option<Verb>>, Vec<(usize, DeadLetter)>) {
        let mut verbs: Vec<Option<Verb>> = Vec::with_capacity(batch.len());
        let mut dead = Vec::new();
        for (i, (m, o)) in batch.iter().zip(outcomes).enumerate() {
            report.count_outcome(o.kind());
            let verb = match o.verb() {
                Verb::DeadLetter { reason } => {
                    dead.push((i, self.dead_letter_of(m, o, reason)));
                    None
                }
                Verb::Retry { after } => match self.source.give_up(m) {
                    Some(why) => {
                        let reason = format!("{why}; last outcome {}: {}", o.kind(), describe(o));
                        dead.push((i, self.dead_letter_of(m, o, reason)));
                        None
                    }
                    None => Some(Verb::Retry { after }),
                },
                verb => Some(verb),
            };
            verbs.push(verb);
        }
        (verbs, dead)
    }

    /// Makes the dead-letter copies of `dead` and completes `verbs` with them: a copy made is
    /// the message's dead letter, a copy that failed a retry (counted in `report`).
    ///
    /// # Errors
    /// [`Error::BrokerTimeout`] when the dead-letter copies hang.
    pub(super) async fn copy_dead_letters(
        &self,
        batch: &[S::Delivery],
        mut verbs: Vec<Option<Verb>>,
        dead: Vec<(usize, DeadLetter)>,
        report: &mut Report,
    ) -> Result<Vec<Verb>, Error<S::Error>> {
        if !dead.is_empty() {
            let items: Vec<(&S::Delivery, _)> =
                dead.iter().map(|(i, dl)| (&batch[*i], dl.clone())).collect();
            let copied =
                self.bounded("the dead-letter copies", self.source.dead_letter(&items)).await?;
            let mut copied = copied.into_iter();
            for (i, dl) in dead {
                verbs[i] = Some(match copied.next() {
                    Some(Ok(())) => {
                        metrics::counter!(DEAD_LETTERS_TOTAL, "scope" => dl.scope.clone(),
                            "outcome" => dl.outcome.as_str())
                        .increment(1);
                        Verb::DeadLetter { reason: dl.reason }
                    }
                    failed => {
                        report.dead_letter_failures += 1;
                        let error = failed.and_then(Result::err).map(|e| e.to_string());
                        // Never remove what is not safely elsewhere: let it come back instead.
                        tracing::error!(target: "idem", error = error.as_deref().unwrap_or("no answer"),
                            reason = %dl.reason, "dead-letter copy failed; retrying the message instead");
                        Verb::Retry { after: None }
                    }
                });
            }
        }
        // Every dead letter's copy was answered above, or counted as failed.
        Ok(verbs.into_iter().map(|v| v.unwrap_or(Verb::Retry { after: None })).collect())
    }

    fn dead_letter_of<T, E>(
        &self,
        m: &S::Delivery,
        o: &Outcome<T, E>,
        reason: String,
    ) -> DeadLetter {
        let dl = DeadLetter::new(o.kind(), reason, self.engine.scope());
        match self.engine.key_of(m) {
            Ok(key) => dl.with_key(key.id()),
            Err(_) => dl,
        }
    }
}

/// An outcome's cause in words, for a dead letter made of a retry.
fn describe<T, E: Display>(o: &Outcome<T, E>) -> String {
    match o {
        Outcome::Failed(f) => f.cause.to_string(),
        Outcome::InProgressElsewhere { retry_after } => {
            format!("another consumer holds the key for {retry_after:?} more")
        }
        other => other.kind().to_string(),
    }
}
