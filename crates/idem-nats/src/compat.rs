//! Server compatibility and JetStream's redelivery window.
//!
//! # NATS server 2.9
//! The adapter is built on `async-nats` without its `server_2_10`+ features: those add consumer
//! and stream fields (`filter_subjects`, `metadata`, compression, pause, priority groups) that
//! a 2.9 server does not know. Everything the adapter uses exists since 2.9: pull consumers with
//! explicit acks, `Nak` with a delay, `Term`, `Progress` (`+WPI`), `Nats-Msg-Id` publish dedup,
//! the publish ack, and stream lookup by subject. KV buckets are not used (async-nats 0.51's
//! `create_key_value` fails on 2.9).

use std::time::Duration;

use async_nats::jetstream::consumer;
use idem_core::RedeliveryWindow;

use crate::Error;

/// Fails for a server older than 2.9 (or a version string that does not parse).
pub(crate) fn check_server(version: &str) -> Result<(), Error> {
    let mut parts = version.trim_start_matches('v').split(['.', '-']);
    let major = parts.next().and_then(|p| p.parse::<u32>().ok());
    let minor = parts.next().and_then(|p| p.parse::<u32>().ok());
    match (major, minor) {
        (Some(ma), Some(mi)) if (ma, mi) >= (2, 9) => Ok(()),
        _ => Err(Error::ServerTooOld { version: version.to_owned() }),
    }
}

/// JetStream's redelivery window for a pull consumer: `max_deliver` deliveries, each at most
/// the longest of `ack_wait`, the longest `backoff` step and the longest `Nak` delay the adapter
/// sends, after the message waited up to the stream's `max_age`. A `max_age` of 0 (unlimited)
/// adds nothing here, but a producer's late duplicate may then wait in the stream for ever:
/// the consumer refuses such a stream unless told how long to assume
/// ([`JetStreamConfig::assume_max_age`](crate::JetStreamConfig::assume_max_age)).
///
/// ```
/// use std::time::Duration;
/// use async_nats::jetstream::consumer;
///
/// let cfg = consumer::Config { ack_wait: Duration::from_secs(30), max_deliver: 5, ..Default::default() };
/// let w = idem_nats::redelivery_window(&cfg, Duration::from_secs(3600), Duration::from_secs(1));
/// assert_eq!(w.minimum(), Duration::from_secs(5 * 30 + 3600));
/// ```
pub fn redelivery_window(
    cfg: &consumer::Config,
    stream_max_age: Duration,
    longest_nak: Duration,
) -> RedeliveryWindow {
    let step = cfg.backoff.iter().copied().fold(cfg.ack_wait.max(longest_nak), Duration::max);
    let deliveries = u32::try_from(cfg.max_deliver).unwrap_or(u32::MAX);
    RedeliveryWindow::new(deliveries, step).message_ttl(stream_max_age)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions() {
        assert!(check_server("2.9.10").is_ok());
        assert!(check_server("v2.11.0-beta.1").is_ok());
        assert!(check_server("3.0.0").is_ok());
        assert!(check_server("2.8.4").is_err());
        assert!(check_server("nonsense").is_err());
    }

    #[test]
    fn window_takes_the_longest_step() {
        let cfg = consumer::Config {
            ack_wait: Duration::from_secs(10),
            max_deliver: 3,
            backoff: vec![Duration::from_secs(1), Duration::from_secs(60)],
            ..Default::default()
        };
        assert_eq!(
            redelivery_window(&cfg, Duration::ZERO, Duration::from_secs(2)).minimum(),
            Duration::from_secs(180)
        );
    }
}
