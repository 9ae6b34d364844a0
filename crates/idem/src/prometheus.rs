//! A Prometheus endpoint for idem's metrics in one call (feature `prometheus`).
//!
//! [`install`] makes a Prometheus recorder the process's global `metrics` recorder, serves the
//! text exposition format over HTTP, registers the HELP text and units of every idem metric
//! ([`describe_metrics`](crate::describe_metrics)) and gives the latency and batch-size
//! histograms buckets, so they are exported as Prometheus histograms (with `_bucket`, `_sum`,
//! `_count`) that `histogram_quantile` can aggregate across consumers. The metric list, the
//! alerts worth having and a Grafana dashboard are in `docs/OPERATIONS.md`.
//!
//! ```no_run
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Serves http://0.0.0.0:9000/metrics for as long as the process runs.
//! let handle = idem::prometheus::install(([0, 0, 0, 0], 9000).into())?;
//! // ... build and run consumers; every one of them is counted ...
//! // The handle renders the same text without HTTP (for a health page, a test):
//! assert!(handle.render().is_empty() || handle.render().contains("# TYPE"));
//! # Ok(()) }
//! ```

use std::net::SocketAddr;

pub use metrics_exporter_prometheus::{BuildError, PrometheusHandle};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

use crate::telemetry;

/// Bucket bounds of the `_seconds` histograms (claim, completion, outbox publish): 0.5 ms to
/// 10 s, finer below 100 ms where stores answer.
pub const SECONDS_BUCKETS: [f64; 14] =
    [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Bucket bounds of `idem_batch_size`, in messages.
pub const BATCH_SIZE_BUCKETS: [f64; 11] =
    [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0];

fn with_buckets(b: PrometheusBuilder) -> Result<PrometheusBuilder, BuildError> {
    b.set_buckets_for_metric(Matcher::Suffix("_seconds".to_owned()), &SECONDS_BUCKETS).and_then(
        |b| {
            b.set_buckets_for_metric(
                Matcher::Full(telemetry::BATCH_SIZE.to_owned()),
                &BATCH_SIZE_BUCKETS,
            )
        },
    )
}

/// Installs the Prometheus recorder (same buckets as [`install`]) without a listener, for a
/// server that answers `/metrics` itself with [`PrometheusHandle::render`]. Call it inside a
/// Tokio runtime (the recorder's upkeep task runs on it), once per process.
///
/// # Errors
/// [`BuildError`] when a global recorder is installed already.
pub fn install_recorder() -> Result<PrometheusHandle, BuildError> {
    let handle = with_buckets(PrometheusBuilder::new())?.install_recorder()?;
    crate::describe_metrics();
    Ok(handle)
}

/// Installs the Prometheus recorder and serves its metrics on `addr` (every `GET` path
/// answers; scrape `/metrics`). Returns a handle that renders the same text.
///
/// Called inside a Tokio runtime, the listener runs on that runtime; outside one, on a
/// background thread with its own single-threaded runtime. The recorder is global: call this
/// once per process.
///
/// # Errors
/// [`Error`] when `addr` cannot be bound or a global recorder is installed already.
pub fn install(addr: SocketAddr) -> Result<PrometheusHandle, Error> {
    let fail = |source| Error { addr, source };
    let builder = with_buckets(PrometheusBuilder::new().with_http_listener(addr)).map_err(fail)?;
    // Built inside a runtime (the builder spawns its upkeep task and binds the listener), and
    // the listener started only once the recorder is the global one: a second install fails
    // without leaving a listener that serves nothing.
    let background = match tokio::runtime::Handle::try_current() {
        Ok(_) => None,
        Err(_) => Some(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| fail(BuildError::FailedToCreateRuntime(e.to_string())))?,
        ),
    };
    let rt =
        background.as_ref().map_or_else(tokio::runtime::Handle::current, |r| r.handle().clone());
    let (recorder, exporter) = {
        let _entered = rt.enter();
        builder.build().map_err(fail)?
    };
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder)
        .map_err(|e| fail(BuildError::FailedToSetGlobalRecorder(e)))?;
    match background {
        None => drop(rt.spawn(exporter)),
        Some(own) => {
            std::thread::Builder::new()
                .name("idem-prometheus".to_owned())
                .spawn(move || own.block_on(exporter))
                .map_err(|e| fail(BuildError::FailedToCreateRuntime(e.to_string())))?;
        }
    }
    crate::describe_metrics();
    Ok(handle)
}

/// The Prometheus endpoint could not be installed.
#[derive(Debug, thiserror::Error)]
#[error("could not install the Prometheus exporter on {addr}")]
pub struct Error {
    addr: SocketAddr,
    #[source]
    source: BuildError,
}

impl Error {
    /// The address it was to listen on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}
