//! NATS subject matching, for the startup check that a consumer would not receive its own dead
//! letters.
//!
//! Subjects are tokens separated by `.`. In a pattern (a stream's subjects, a consumer's filter)
//! a token that is exactly `*` matches any one token, and a last token that is exactly `>`
//! matches one or more tokens; any other token, `orders*` included, matches only itself.

use async_nats::jetstream::stream;

/// How a consumer's stream (configured as `stream`, the consumer filtered by `filter`, empty for
/// none) would hand it back the dead letters it publishes to `subject`, which the server says
/// the stream `dead_letter_stream` captures; `None` when it would not.
pub(crate) fn loop_through(
    stream: &stream::Config,
    dead_letter_stream: &str,
    filter: &str,
    subject: &str,
) -> Option<String> {
    let consumer = if filter.is_empty() {
        "the consumer has no filter subject".to_owned()
    } else if matches(filter, subject) {
        format!("the consumer's filter subject `{filter}` matches it")
    } else {
        return None;
    };
    if let Some(p) = stream.subjects.iter().find(|p| matches(p, subject)) {
        return Some(format!("the stream's subject `{p}` captures it and {consumer}"));
    }
    if stream.name == dead_letter_stream {
        return Some(format!("the server says the stream captures it and {consumer}"));
    }
    let mirror = stream.mirror.iter().map(|s| ("mirrors", s));
    let sources = stream.sources.iter().flatten().map(|s| ("sources", s));
    mirror.chain(sources).find_map(|(verb, s)| {
        let passes =
            s.filter_subject.as_deref().is_none_or(|f| f.is_empty() || matches(f, subject));
        (s.external.is_none() && s.name == dead_letter_stream && passes).then(|| {
            format!("the stream {verb} stream `{}`, which captures it, and {consumer}", s.name)
        })
    })
}

/// Whether `pattern` matches the plain subject `subject`.
///
/// `orders.>` matches `orders.dlq` and `orders.eu.dlq` but not `orders`; `orders.*` matches
/// `orders.dlq` but not `orders.eu.dlq`.
pub(crate) fn matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Why `subject` cannot be published to as it is (`None`: it can): empty, with an empty token
/// (`orders..dlq`, `.dlq`), with a wildcard token (`*`, `>`), or with whitespace.
pub(crate) fn publish_problem(subject: &str) -> Option<&'static str> {
    if subject.is_empty() {
        return Some("is empty");
    }
    if subject.chars().any(char::is_whitespace) {
        return Some("contains whitespace");
    }
    for token in subject.split('.') {
        match token {
            "" => return Some("has an empty token (two dots in a row, or a dot at an end)"),
            "*" | ">" => {
                return Some("has a wildcard token (`*` or `>`): publish subjects are plain");
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_wildcard_takes_one_token_or_more() {
        assert!(matches("orders.>", "orders.dlq"));
        assert!(matches("orders.>", "orders.eu.dlq"));
        assert!(!matches("orders.>", "orders"));
        assert!(matches(">", "orders"));
        assert!(matches(">", "orders.dlq"));
        assert!(!matches("orders.>", "dlq.orders"));
    }

    #[test]
    fn a_token_wildcard_takes_exactly_one_token() {
        assert!(matches("orders.*", "orders.dlq"));
        assert!(!matches("orders.*", "orders.eu.dlq"));
        assert!(!matches("orders.*", "orders"));
        assert!(matches("*.dlq", "orders.dlq"));
        assert!(matches("orders.*.dlq", "orders.eu.dlq"));
        assert!(!matches("orders.*.dlq", "orders.eu.us.dlq"));
        assert!(matches("*.*.>", "a.b.c"));
        assert!(!matches("*.*.>", "a.b"));
    }

    #[test]
    fn literal_tokens_match_only_themselves() {
        assert!(matches("orders.dlq", "orders.dlq"));
        assert!(!matches("orders.dlq", "orders.dlq.x"));
        assert!(!matches("orders.dlq.x", "orders.dlq"));
        assert!(!matches("orders", "Orders"), "subjects are case sensitive");
        // A star inside a token is a literal character, not a wildcard.
        assert!(!matches("orders*", "orders.dlq"));
        assert!(!matches("orders.dl*", "orders.dlq"));
        assert!(matches("orders.dl*", "orders.dl*"));
        assert!(!matches("orders.>x", "orders.dlq"));
    }

    fn stream(subjects: &[&str]) -> stream::Config {
        stream::Config {
            name: "ORDERS".into(),
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_stream_that_captures_the_dead_letters_loops_unless_the_filter_excludes_them() {
        let orders = stream(&["orders.>"]);
        let why = loop_through(&orders, "ORDERS", "", "orders.dlq").expect("a loop");
        assert!(why.contains("`orders.>`") && why.contains("no filter subject"), "{why}");
        let why = loop_through(&orders, "ORDERS", "orders.*", "orders.dlq").expect("a loop");
        assert!(why.contains("filter subject `orders.*` matches"), "{why}");
        assert_eq!(loop_through(&orders, "ORDERS", "orders.placed", "orders.dlq"), None);
        assert_eq!(loop_through(&orders, "DLQ", "", "dlq.orders"), None);
        // The server's word when no subject matches here (a transform, say).
        assert!(loop_through(&stream(&["x"]), "ORDERS", "", "orders.dlq").is_some());
    }

    #[test]
    fn a_stream_that_sources_the_dead_letter_stream_loops_too() {
        let mut agg = stream(&[]);
        agg.sources = Some(vec![stream::Source { name: "DLQ".into(), ..Default::default() }]);
        let why = loop_through(&agg, "DLQ", "", "dlq.orders").expect("a loop");
        assert!(why.contains("sources stream `DLQ`"), "{why}");
        agg.sources = Some(vec![stream::Source {
            name: "DLQ".into(),
            filter_subject: Some("dlq.payments".into()),
            ..Default::default()
        }]);
        assert_eq!(loop_through(&agg, "DLQ", "", "dlq.orders"), None);
        let mut mirror = stream(&[]);
        mirror.mirror = Some(stream::Source { name: "DLQ".into(), ..Default::default() });
        assert!(loop_through(&mirror, "DLQ", "", "dlq.orders").is_some());
        assert_eq!(loop_through(&mirror, "OTHER", "", "dlq.orders"), None);
    }

    #[test]
    fn publish_subjects_must_be_plain() {
        assert_eq!(publish_problem("dlq.orders"), None);
        assert_eq!(publish_problem("orders-dlq"), None);
        for bad in ["", "orders..dlq", ".dlq", "dlq.", "dlq.*", "dlq.>", ">", "dlq orders"] {
            assert!(publish_problem(bad).is_some(), "{bad:?} accepted");
        }
    }
}
