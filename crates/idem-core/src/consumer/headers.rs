//! The names every broker adapter gives its dead-letter copies' headers (AMQP headers, NATS
//! headers, Kafka record headers, Redis stream fields), so one tool reads all of them.

/// Why the message was dead-lettered (one line, at most 1 KiB).
pub const REASON: &str = "idem-reason";
/// The outcome that dead-lettered it (`conflict`, `failed_permanent`, …).
pub const OUTCOME: &str = "idem-outcome";
/// The consumer scope that dead-lettered it.
pub const SCOPE: &str = "idem-scope";
/// The message's dedup key within that scope, when it had a usable one.
pub const KEY: &str = "idem-key";
/// Where it was consumed from: queue, subject, topic or stream.
pub const SOURCE: &str = "idem-source";
/// Where in that source: stream sequence, `partition:offset`, entry id.
pub const POSITION: &str = "idem-source-position";
/// How many times the broker had delivered it, where the broker counts.
pub const DELIVERED: &str = "idem-delivered";
/// The original message id, where the adapter must rename it (a dead-letter stream with its own
/// duplicate window would otherwise merge two different messages that reused one id).
pub const ORIGINAL_MESSAGE_ID: &str = "idem-original-message-id";

/// Makes `s` a valid header value: control characters become spaces, and it is cut at 1 KiB
/// on a character boundary.
///
/// ```
/// use idem_core::consumer::headers::header_safe;
///
/// assert_eq!(header_safe("a\r\nb"), "a  b");
/// assert_eq!(header_safe(&"é".repeat(1000)).len(), 1024);
/// ```
pub fn header_safe(s: &str) -> String {
    let mut out: String = s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    if out.len() > 1024 {
        let mut cut = 1024;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
    }
    out
}
