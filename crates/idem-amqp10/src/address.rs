//! What an AMQP 1.0 address reaches, as far as the address itself shows, for the check that
//! dead letters sent to an address never come back to the receiver's source.
//!
//! RabbitMQ names the same queue in several ways: `/amq/queue/q`, `/queue/q` and a bare `q`
//! (its 3.x address format), `/queues/q` (4.x, percent-encoded), and, as a target, the default
//! exchange with the queue's name as routing key (`/exchange/amq.default/q`,
//! `/exchanges/amq.default/q`). A source on an exchange (`/exchange/x/key`, `/topic/key`)
//! receives what that exchange routes to its binding key. Other brokers' addresses are compared
//! as they are written.

/// How a copy sent to `target` would reach the receiver of `source`; `None` when the addresses
/// do not show that it would.
pub(crate) fn loop_between(source: &str, target: &str) -> Option<String> {
    if source == target {
        return Some("it is the source address".to_owned());
    }
    if let (Some(q), Some(t)) = (source_queue(source), target_queue(target))
        && q == t
    {
        return Some(format!("both name queue `{q}`"));
    }
    if let (Some((x, binding)), Some((tx, key))) = (source_binding(source), target_route(target))
        && x == tx
        && (binding == key || topic_matches(&binding, &key))
    {
        return Some(format!(
            "exchange `{x}` routes routing key `{key}` to the source's binding `{binding}`"
        ));
    }
    None
}

/// The queue a receiver of `address` consumes from, when the address names one.
fn source_queue(address: &str) -> Option<String> {
    if let Some(q) = address.strip_prefix("/amq/queue/").or_else(|| address.strip_prefix("/queue/"))
    {
        return Some(q.to_owned());
    }
    if let Some(q) = address.strip_prefix("/queues/") {
        return Some(percent_decoded(q));
    }
    bare(address)
}

/// The queue a message sent to `address` lands in, when the address alone says so.
fn target_queue(address: &str) -> Option<String> {
    if let Some(q) = source_queue(address) {
        return Some(q);
    }
    match target_route(address) {
        Some((x, key)) if x.is_empty() || x == "amq.default" => Some(key),
        _ => None,
    }
}

/// A source on an exchange: (exchange, binding key).
fn source_binding(address: &str) -> Option<(String, String)> {
    if let Some(key) = address.strip_prefix("/topic/") {
        return Some(("amq.topic".to_owned(), key.to_owned()));
    }
    let rest = address.strip_prefix("/exchange/")?;
    let (x, key) = rest.split_once('/')?;
    Some((x.to_owned(), key.to_owned()))
}

/// A target on an exchange with a routing key: (exchange, routing key).
fn target_route(address: &str) -> Option<(String, String)> {
    if let Some(rest) = address.strip_prefix("/exchanges/") {
        let (x, key) = rest.split_once('/')?;
        return Some((percent_decoded(x), percent_decoded(key)));
    }
    source_binding(address)
}

/// A bare name (RabbitMQ 3.x: a queue of that name).
fn bare(address: &str) -> Option<String> {
    (!address.is_empty() && !address.starts_with('/')).then(|| address.to_owned())
}

/// Whether a topic exchange routes `key` to `binding`: words separated by `.`, `*` one word,
/// `#` zero or more.
fn topic_matches(binding: &str, key: &str) -> bool {
    fn go(b: &[&str], k: &[&str]) -> bool {
        match (b.first(), k.first()) {
            (None, None) => true,
            (Some(&"#"), _) => go(&b[1..], k) || (!k.is_empty() && go(b, &k[1..])),
            (Some(&"*"), Some(_)) => go(&b[1..], &k[1..]),
            (Some(w), Some(v)) if w == v => go(&b[1..], &k[1..]),
            _ => false,
        }
    }
    let b: Vec<&str> = binding.split('.').collect();
    let k: Vec<&str> = key.split('.').collect();
    go(&b, &k)
}

/// `%XX` sequences decoded (RabbitMQ 4's address format); anything malformed kept as it is.
fn percent_decoded(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
        match (bytes[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_of_one_queue_is_the_same_queue() {
        for target in [
            "/amq/queue/orders",
            "/queue/orders",
            "orders",
            "/queues/orders",
            "/exchange/amq.default/orders",
            "/exchanges/amq.default/orders",
        ] {
            let why = loop_between("/amq/queue/orders", target).unwrap_or_default();
            assert!(why.contains("queue `orders`") || why.contains("source address"), "{target}");
        }
        assert!(loop_between("/queues/my%2Forders", "/queue/my/orders").is_some());
        assert!(loop_between("orders", "/amq/queue/orders").is_some());
    }

    #[test]
    fn other_queues_and_exchanges_are_not_a_loop() {
        for target in [
            "/amq/queue/orders.dlq",
            "/queue/Orders",
            "/exchange/dlx/orders",
            "/exchanges/dlx/orders",
            "/topic/orders",
        ] {
            assert_eq!(loop_between("/amq/queue/orders", target), None, "{target}");
        }
    }

    #[test]
    fn a_source_bound_to_an_exchange_gets_what_the_exchange_routes_to_it() {
        let why = loop_between("/topic/orders.#", "/topic/orders.dlq").expect("a loop");
        assert!(why.contains("`amq.topic`") && why.contains("`orders.#`"), "{why}");
        assert!(loop_between("/topic/orders.*", "/exchange/amq.topic/orders.dlq").is_some());
        assert!(loop_between("/exchange/events/orders", "/exchanges/events/orders").is_some());
        assert_eq!(loop_between("/topic/orders.*", "/topic/orders.eu.dlq"), None);
        assert_eq!(loop_between("/topic/orders.#", "/topic/dlq.orders"), None);
        assert_eq!(loop_between("/exchange/events/orders", "/exchange/other/orders"), None);
    }

    #[test]
    fn topic_wildcards() {
        assert!(topic_matches("#", "a.b.c"));
        assert!(topic_matches("a.#", "a"));
        assert!(topic_matches("a.#.c", "a.c"));
        assert!(topic_matches("a.#.c", "a.b.b.c"));
        assert!(topic_matches("*.b", "a.b"));
        assert!(!topic_matches("*.b", "b"));
        assert!(!topic_matches("a.*", "a.b.c"));
    }
}
