//! The metrics idem emits through the [`metrics`] facade: their names, labels and meaning.
//!
//! Labels are low-cardinality by design: a consumer's scope, an outcome kind, a store
//! operation; never a key or a message id. `docs/OPERATIONS.md` lists them with the alerts
//! and the Grafana dashboard built on them.
//!
//! | name | type | labels | meaning |
//! | --- | --- | --- | --- |
//! | `idem_outcomes_total` | counter | `scope`, `outcome` | deliveries decided, by [`OutcomeKind`](crate::OutcomeKind) (`processed`, `duplicate`, `conflict`, `in_progress_elsewhere`, `failed_transient`, `failed_permanent`) |
//! | `idem_claim_duration_seconds` | histogram | `scope` | one claim, `claim_many` or inbox batch mark |
//! | `idem_complete_duration_seconds` | histogram | `scope` | one `complete` or `complete_many` (each try), or an inbox batch's commit |
//! | `idem_takeovers_total` | counter | `scope`, `policy` | claims that took over an expired lease: run again (`run`), parked in doubt (`park`) or dead-lettered at the crash-loop limit (`crash_loop`) |
//! | `idem_store_errors_total` | counter | `scope`, `op`, `retryable` | failed store calls made by the engine |
//! | `idem_complete_retries_total` | counter | `scope` | completions tried again after a retryable store error |
//! | `idem_tx_retries_total` | counter | `scope` | inbox batch transactions run again after the database aborted them to keep them serializable (`40001`, `40P01`, MySQL/Galera `1213`) |
//! | `idem_missing_key_total` | counter | `scope` | messages without a key processed without dedup |
//! | `idem_batch_size` | histogram | `scope` | messages per fetched batch (driver) |
//! | `idem_dead_letters_total` | counter | `scope`, `outcome` | dead-letter copies the broker confirmed |
//! | `idem_fetch_failures_total` | counter | `scope` | failed fetches the driver retried |
//! | `idem_source_lag_messages` | gauge | `scope` | messages the broker still holds for the consumer, where a fetch says so at no cost (NATS JetStream) |
//! | `idem_http_requests_total` | counter | `scope_prefix`, `outcome` | requests through the HTTP `Idempotency-Key` layer |
//! | `idem_outbox_published_total` | counter | | outbox rows published and marked sent |
//! | `idem_outbox_failures_total` | counter | `parked` | outbox publishes that failed; `parked="true"` once a row stops being retried |
//! | `idem_outbox_publish_seconds` | histogram | | one relay batch's publish and confirm |
//! | `idem_outbox_wal_lag_bytes` | gauge | `slot` | WAL a WAL outbox's slot holds back: `pg_current_wal_lsn() - confirmed_flush_lsn` |

use std::time::Instant;

use metrics::Unit;

use crate::StoreError;

/// Deliveries decided (`scope`, `outcome`).
pub const OUTCOMES_TOTAL: &str = "idem_outcomes_total";
/// Claim latency (`scope`).
pub(crate) const CLAIM_DURATION_SECONDS: &str = "idem_claim_duration_seconds";
/// Completion latency (`scope`).
pub(crate) const COMPLETE_DURATION_SECONDS: &str = "idem_complete_duration_seconds";
/// Expired leases taken over (`scope`, `policy`).
pub(crate) const TAKEOVERS_TOTAL: &str = "idem_takeovers_total";
/// Failed store calls (`scope`, `op`, `retryable`).
pub(crate) const STORE_ERRORS_TOTAL: &str = "idem_store_errors_total";
/// Completions tried again (`scope`).
pub(crate) const COMPLETE_RETRIES_TOTAL: &str = "idem_complete_retries_total";
/// Inbox batch transactions run again after a serialization failure (`scope`).
pub(crate) const TX_RETRIES_TOTAL: &str = "idem_tx_retries_total";
/// Keyless messages processed without dedup (`scope`).
pub(crate) const MISSING_KEY_TOTAL: &str = "idem_missing_key_total";
/// Messages per fetched batch (`scope`).
pub const BATCH_SIZE: &str = "idem_batch_size";
/// Confirmed dead-letter copies (`scope`, `outcome`).
pub const DEAD_LETTERS_TOTAL: &str = "idem_dead_letters_total";
/// Failed fetches retried (`scope`).
pub(crate) const FETCH_FAILURES_TOTAL: &str = "idem_fetch_failures_total";
/// Messages left at the broker, where the source knows (`scope`).
pub(crate) const SOURCE_LAG_MESSAGES: &str = "idem_source_lag_messages";
/// Requests through the HTTP layer (`scope_prefix`, `outcome`).
pub const HTTP_REQUESTS_TOTAL: &str = "idem_http_requests_total";
/// Outbox rows published.
pub(crate) const OUTBOX_PUBLISHED_TOTAL: &str = "idem_outbox_published_total";
/// Outbox publish failures (`parked`).
pub(crate) const OUTBOX_FAILURES_TOTAL: &str = "idem_outbox_failures_total";
/// Outbox batch publish latency.
pub(crate) const OUTBOX_PUBLISH_SECONDS: &str = "idem_outbox_publish_seconds";
/// WAL held back by a WAL outbox's replication slot, in bytes (`slot`).
pub const OUTBOX_WAL_LAG_BYTES: &str = "idem_outbox_wal_lag_bytes";

/// Every metric above, for exporters and for the test that keeps `docs/OPERATIONS.md` and the
/// Grafana dashboard in step with this list.
pub const ALL: [&str; 17] = [
    OUTCOMES_TOTAL,
    CLAIM_DURATION_SECONDS,
    COMPLETE_DURATION_SECONDS,
    TAKEOVERS_TOTAL,
    STORE_ERRORS_TOTAL,
    COMPLETE_RETRIES_TOTAL,
    TX_RETRIES_TOTAL,
    MISSING_KEY_TOTAL,
    BATCH_SIZE,
    DEAD_LETTERS_TOTAL,
    FETCH_FAILURES_TOTAL,
    SOURCE_LAG_MESSAGES,
    HTTP_REQUESTS_TOTAL,
    OUTBOX_PUBLISHED_TOTAL,
    OUTBOX_FAILURES_TOTAL,
    OUTBOX_PUBLISH_SECONDS,
    OUTBOX_WAL_LAG_BYTES,
];

/// Registers the HELP text and unit of every metric above with the installed recorder, so an
/// exporter shows them. Call it once, after installing a recorder (`idem::prometheus::install`
/// does); calling it again is harmless.
///
/// ```
/// idem_core::describe_metrics(); // no recorder installed: does nothing
/// ```
pub fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        OUTCOMES_TOTAL,
        Unit::Count,
        "Deliveries decided, by outcome: processed, duplicate, conflict, in_progress_elsewhere, \
         failed_transient, failed_permanent."
    );
    describe_histogram!(
        CLAIM_DURATION_SECONDS,
        Unit::Seconds,
        "Time of one claim, claim_many or inbox batch mark."
    );
    describe_histogram!(
        COMPLETE_DURATION_SECONDS,
        Unit::Seconds,
        "Time of one complete or complete_many call (each try), or of an inbox batch's commit."
    );
    describe_counter!(
        TAKEOVERS_TOTAL,
        Unit::Count,
        "Claims that took over an expired lease (its holder crashed or outlived the lease); \
         policy run = handler ran again, park = recorded in doubt."
    );
    describe_counter!(
        STORE_ERRORS_TOTAL,
        Unit::Count,
        "Store calls that failed, by operation and whether a retry may succeed."
    );
    describe_counter!(
        COMPLETE_RETRIES_TOTAL,
        Unit::Count,
        "Completions tried again after a retryable store error."
    );
    describe_counter!(
        TX_RETRIES_TOTAL,
        Unit::Count,
        "Inbox batch transactions run again after the database aborted them to keep them \
         serializable (SQLSTATE 40001 or 40P01, MySQL/Galera 1213)."
    );
    describe_counter!(
        MISSING_KEY_TOTAL,
        Unit::Count,
        "Messages without a dedup key processed without dedup (missing-key policy)."
    );
    describe_histogram!(BATCH_SIZE, Unit::Count, "Messages per batch fetched by the driver.");
    describe_counter!(
        DEAD_LETTERS_TOTAL,
        Unit::Count,
        "Dead-letter copies confirmed by the broker, by the outcome that caused them."
    );
    describe_counter!(
        FETCH_FAILURES_TOTAL,
        Unit::Count,
        "Failed broker fetches that the driver retried."
    );
    describe_gauge!(
        SOURCE_LAG_MESSAGES,
        Unit::Count,
        "Messages the broker still holds for this consumer, as of the last batch (sources \
         that learn it with the fetch only: NATS JetStream)."
    );
    describe_counter!(
        HTTP_REQUESTS_TOTAL,
        Unit::Count,
        "Requests through the HTTP Idempotency-Key layer, by outcome."
    );
    describe_counter!(
        OUTBOX_PUBLISHED_TOTAL,
        Unit::Count,
        "Outbox rows published and marked sent by the relay."
    );
    describe_counter!(
        OUTBOX_FAILURES_TOTAL,
        Unit::Count,
        "Outbox publishes that failed; parked=true once a row is no longer retried."
    );
    describe_histogram!(
        OUTBOX_PUBLISH_SECONDS,
        Unit::Seconds,
        "Time to publish one relay batch and get the broker's confirmations."
    );
    describe_gauge!(
        OUTBOX_WAL_LAG_BYTES,
        Unit::Bytes,
        "WAL a WAL outbox's replication slot holds back (pg_current_wal_lsn() - \
         confirmed_flush_lsn): unrelayed messages, and WAL the server cannot recycle meanwhile."
    );
}

/// Records `started.elapsed()` in the histogram `name` of `scope`.
pub(crate) fn observe_duration(name: &'static str, scope: &str, started: Instant) {
    metrics::histogram!(name, "scope" => scope.to_owned()).record(started.elapsed().as_secs_f64());
}

/// Counts one failed store call: `op` is the engine's call (`claim`, `complete_many`, …).
pub(crate) fn store_error(scope: &str, op: &'static str, e: &StoreError) {
    let retryable = if e.is_retryable() { "true" } else { "false" };
    metrics::counter!(STORE_ERRORS_TOTAL, "scope" => scope.to_owned(), "op" => op,
        "retryable" => retryable)
    .increment(1);
}
