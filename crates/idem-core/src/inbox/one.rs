//! One message in its own transaction, outside any batch: what [`TxInbox::process`] does for
//! a caller with a key of its own.

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::tx::{Lender, kept};
use super::{Tx, TxInbox, WrongCount};
use crate::answer::{Answer, outcome_of};
use crate::outcome::{Cause, FailureKind, HandlerError, Outcome};
use crate::{Claim, ClaimRequest, DedupKey, Fingerprint, StoreError};

/// One message in its own transaction: what [`TxInbox::process`] does.
pub(super) async fn process_one<I, T, E, F, Fut>(
    inbox: &I,
    key: &DedupKey,
    fingerprint: Option<Fingerprint>,
    writes: F,
) -> Outcome<T, E>
where
    I: TxInbox,
    T: Serialize + DeserializeOwned,
    F: FnOnce(Tx<I>) -> Fut,
    Fut: Future<Output = Result<T, HandlerError<E>>>,
{
    let req = ClaimRequest::new(key.clone(), fingerprint, Duration::ZERO, inbox.retention());
    let mut tx = match inbox.begin().await {
        Ok(tx) => tx,
        Err(e) => return Outcome::transient(e),
    };
    let item = [(key.clone(), fingerprint)];
    let claim = inbox
        .mark_many(I::connection(&mut tx), &item)
        .await
        .and_then(|mut c| c.pop().ok_or_else(|| StoreError::backend("mark", true, WrongCount)));
    if let Answer::Settled(outcome, _) = outcome_of(claim, &req) {
        // Nothing was written: dropping the transaction rolls back its mark.
        let _ = inbox.rollback(tx).await;
        return outcome;
    }
    let lender = Lender::<I>::new(tx);
    let Some(lent) = lender.lend(Some(key.clone())) else {
        return Outcome::transient(kept("inbox"));
    };
    let value = match writes(lent).await {
        Ok(v) => v,
        Err(e) => {
            if let Some(tx) = lender.take() {
                let _ = inbox.rollback(tx).await;
            }
            return Outcome::from_handler_error(e);
        }
    };
    let Some(mut tx) = lender.take() else { return Outcome::transient(kept("inbox")) };
    if let Ok(bytes) = serde_json::to_vec(&value)
        && bytes != b"null"
    {
        match inbox.set_results(I::connection(&mut tx), &[(key.clone(), bytes)]).await {
            Ok(()) => {}
            // Too large to keep: committed without it, duplicates carry no result.
            Err(StoreError::TooLarge { .. }) => {}
            Err(e) => return Outcome::transient(e),
        }
    }
    match inbox.commit(tx).await {
        Ok(None) => Outcome::Processed(value),
        Ok(Some(mut answers)) => match answers.pop() {
            Some(Claim::Acquired(_)) | None => Outcome::Processed(value),
            Some(other) => match outcome_of(Ok(other), &req) {
                Answer::Settled(outcome, _) => outcome,
                Answer::Run(_) => Outcome::Processed(value),
            },
        },
        Err(e) if I::is_permanent(&e) => Outcome::failed(FailureKind::Permanent, Cause::Store(e)),
        Err(e) => Outcome::transient(e),
    }
}
