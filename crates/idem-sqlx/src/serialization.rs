//! Serialization failures: the database gave up on a transaction to keep it serializable.

use idem_core::StoreError;

/// Whether `e` is the database aborting a transaction so that it stays serializable:
/// SQLSTATE `40001` (PostgreSQL's serialization failure under `SERIALIZABLE`; MySQL's and
/// MariaDB's error 1213, which Galera also raises when a transaction fails certification at
/// `COMMIT`) or `40P01` (PostgreSQL's deadlock). Nothing of the transaction is committed and the
/// whole transaction may run again.
///
/// The inbox engine runs a batch again by itself when its own statements (markers, results,
/// savepoints, the commit) fail so. A handler whose own statement fails so returns it as
/// [`HandlerError::Transient`](idem_core::engine::HandlerError::Transient): its message is
/// rolled back alone and retried, the rest of its batch commits.
///
/// ```
/// assert!(!idem_sqlx::is_serialization_failure(&idem_sqlx::sqlx::Error::RowNotFound));
/// ```
pub fn is_serialization_failure(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => {
            db.code().is_some_and(|c| matches!(c.as_ref(), "40001" | "40P01"))
        }
        _ => false,
    }
}

/// [`is_serialization_failure`] for a store error: its driver error, wherever in its chain.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) fn store_error_is_serialization_failure(e: &StoreError) -> bool {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = next {
        if let Some(sqlx) = err.downcast_ref::<sqlx::Error>() {
            return is_serialization_failure(sqlx);
        }
        next = err.source();
    }
    false
}
