//! Whether the dedup records outlive the consumed topics' logs.

use std::fmt;
use std::time::Duration;

use idem_core::retention::human;

/// A consumed topic that keeps its messages longer than idem keeps their dedup records.
///
/// Kafka redelivers nothing on a timer, but a consumer that starts again from an old offset
/// (an `auto.offset.reset` after the group's offsets expired, an operator's reset, a new group)
/// replays every message the log still holds; one whose record was purged runs its effect again.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionGap {
    /// The topic.
    pub topic: String,
    /// Its `retention.ms`; `None` when it keeps messages forever (`-1`).
    pub log_retention: Option<Duration>,
    /// How long the dedup records (or inbox markers) are kept.
    pub dedup_retention: Duration,
}

impl fmt::Display for RetentionGap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let log = match self.log_retention {
            Some(d) => format!("for {}", human(d)),
            None => "forever".to_owned(),
        };
        write!(
            f,
            "topic `{}` keeps messages {log} (retention.ms) but dedup records are kept for {}: \
             a replay from an older offset (offset reset, expired group offsets) would run \
             their effects again; retain records at least as long as the topic keeps messages",
            self.topic,
            human(self.dedup_retention)
        )
    }
}

/// The topics of `logs` (name, `retention.ms`) that outlive `retain`.
pub(crate) fn gaps(logs: Vec<(String, Option<Duration>)>, retain: Duration) -> Vec<RetentionGap> {
    logs.into_iter()
        .filter(|(_, log)| log.is_none_or(|l| l > retain))
        .map(|(topic, log_retention)| RetentionGap {
            topic,
            log_retention,
            dedup_retention: retain,
        })
        .collect()
}

/// Parses a `retention.ms` value: negative means forever.
pub(crate) fn parse_ms(topic: &str, v: &str) -> Result<Option<Duration>, String> {
    let ms: i64 = v
        .trim()
        .parse()
        .map_err(|_| format!("topic `{topic}`: retention.ms `{v}` is not a number"))?;
    Ok(u64::try_from(ms).ok().map(Duration::from_millis))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn a_log_longer_than_the_records_or_kept_forever_is_a_gap() {
        let logs = vec![
            ("week".to_owned(), Some(DAY * 7)),
            ("hour".to_owned(), Some(Duration::from_secs(3600))),
            ("day".to_owned(), Some(DAY)),
            ("forever".to_owned(), None),
        ];
        let got: Vec<String> = gaps(logs, DAY).into_iter().map(|g| g.topic).collect();
        assert_eq!(got, ["week", "forever"]);
    }

    #[test]
    fn retention_ms_parses_negative_as_forever_and_names_the_topic_on_garbage() {
        assert_eq!(parse_ms("t", "604800000"), Ok(Some(DAY * 7)));
        assert_eq!(parse_ms("t", "-1"), Ok(None));
        let e = parse_ms("orders", "soon").unwrap_err();
        assert!(e.contains("orders") && e.contains("soon"), "{e}");
    }

    #[test]
    fn the_message_says_both_durations_and_what_to_do() {
        let g =
            RetentionGap { topic: "orders".to_owned(), log_retention: None, dedup_retention: DAY };
        let s = g.to_string();
        assert!(
            s.contains("`orders` keeps messages forever") && s.contains("retain records"),
            "{s}"
        );
    }
}
