//! Which topics a subscription takes, for the check that a consumer never reads its own dead
//! letters.

use crate::Error;

/// Fails when `subscription` (topic names, and patterns starting with `^`) takes the
/// dead-letter topic: every dead letter would come back to the consumer as a new message.
///
/// A pattern is matched as librdkafka matches it: a POSIX extended regular expression searched
/// in the topic name (its leading `^` anchors it at the start; without a trailing `$` it may
/// end anywhere, so `^orders.*` takes `orders.dlq` and `^orders` takes `orders-dlq`). It is read
/// here with the `regex` crate, whose syntax agrees with POSIX on the usual patterns; one it
/// cannot read is refused ([`Error::Pattern`]) rather than left unchecked.
pub(crate) fn check(subscription: &[String], dead_letter: &str) -> Result<(), Error> {
    for entry in subscription {
        let takes = if entry.starts_with('^') {
            regex::Regex::new(entry)
                .map_err(|e| Error::Pattern { pattern: entry.clone(), source: Box::new(e) })?
                .is_match(dead_letter)
        } else {
            entry == dead_letter
        };
        if takes {
            return Err(Error::DeadLetterLoop {
                dead_letter: dead_letter.to_owned(),
                subscription: entry.clone(),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_one(entry: &str, dead_letter: &str) -> Result<(), Error> {
        check(&[entry.to_owned()], dead_letter)
    }

    #[test]
    fn a_subscribed_name_or_a_matching_pattern_is_a_loop() {
        assert!(matches!(check_one("orders", "orders"), Err(Error::DeadLetterLoop { .. })));
        assert!(check_one("orders", "orders.dlq").is_ok(), "names are exact");
        for pattern in ["^orders.*", "^orders\\..*", "^orders", "^(orders|payments)\\.dlq$", "^.*"]
        {
            let e = check_one(pattern, "orders.dlq").expect_err(pattern);
            assert!(matches!(e, Error::DeadLetterLoop { .. }), "{pattern}: {e}");
        }
    }

    #[test]
    fn a_pattern_that_does_not_take_the_topic_passes() {
        for pattern in ["^orders\\.[0-9]+$", "^orders$", "^dlq\\..*", "^payments.*"] {
            assert!(check_one(pattern, "orders.dlq").is_ok(), "{pattern}");
        }
        let subscription = ["orders".to_owned(), "^payments\\..*".to_owned()];
        assert!(check(&subscription, "dlq.orders").is_ok());
    }

    #[test]
    fn the_error_names_the_topic_and_the_entry_that_takes_it() {
        let subscription = ["payments".to_owned(), "^orders.*".to_owned()];
        let e = check(&subscription, "orders.dlq").expect_err("a loop").to_string();
        assert!(e.contains("`orders.dlq`") && e.contains("`^orders.*`"), "{e}");
    }

    #[test]
    fn a_pattern_that_cannot_be_read_is_refused() {
        let e = check_one("^orders(", "dlq").expect_err("unreadable");
        assert!(matches!(e, Error::Pattern { .. }) && e.to_string().contains("`^orders(`"), "{e}");
    }
}
