//! How records and counts are printed: a table for people, one JSON object per line for scripts.
//!
//! Scopes, ids, results and reasons come from producers and handlers: a crafted id could carry
//! terminal escape sequences (clear the screen, rewrite earlier lines with `\r`, set the
//! window title). Every such text is printed through [`clean`], and JSON lines through
//! [`json_line`], so control characters reach the terminal only as escapes.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use idem::{Counts, Record, Timestamp};
use serde_json::{Value, json};

/// The table's header line.
pub(crate) fn header() -> String {
    format!(
        "{:<24} {:<32} {:<12} {:>7} {:>10}  result",
        "scope", "id", "state", "attempt", "updated"
    )
}

/// One table row: the result or reason as text, cut at 60 characters.
pub(crate) fn row(r: &Record, now: Timestamp) -> String {
    let result = r.result.as_deref().map(String::from_utf8_lossy).unwrap_or_default();
    let mut shown: String = result.chars().take(60).collect();
    if result.chars().count() > 60 {
        shown.push('…');
    }
    format!(
        "{:<24} {:<32} {:<12} {:>7} {:>10}  {}",
        clean(&r.scope),
        clean(&r.id),
        r.state,
        r.attempt,
        format!("{} ago", age(now.since(r.updated_at))),
        clean(&shown)
    )
}

/// Whether `c` is a control character: C0 (`\0`–`\x1f`, with tab, `\r` and `\n`), DEL, or
/// C1 (`\u{80}`–`\u{9f}`, which some terminals read as ESC sequences).
fn is_control(c: char) -> bool {
    matches!(c, '\0'..='\x1f' | '\x7f'..='\u{9f}')
}

/// `s` with each control character written as a Rust escape (`\u{1b}`), so it is shown, not
/// obeyed, by a terminal; other text unchanged. A backslash before `u` is doubled, so an id
/// that spells an escape itself cannot pass for one.
pub(crate) fn clean(s: &str) -> Cow<'_, str> {
    if !s.chars().any(is_control) && !s.contains("\\u") {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if is_control(c) {
            let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
        } else if c == '\\' && chars.peek() == Some(&'u') {
            out.push_str("\\\\");
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// `v` as one line of JSON. `serde_json` escapes C0 controls but writes DEL and C1 as they
/// are; they can only be inside strings, where `\u00XX` means the same, so they are escaped.
pub(crate) fn json_line(v: &Value) -> String {
    let text = v.to_string();
    if !text.contains(is_control) {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 12);
    for c in text.chars() {
        if is_control(c) {
            let _ = write!(out, "\\u{:04x}", u32::from(c));
        } else {
            out.push(c);
        }
    }
    out
}

/// One record as a JSON object. Times are microseconds since the Unix epoch (store clock);
/// the result is text when it is UTF-8, else base64 (`result_encoding` says which).
pub(crate) fn record_json(r: &Record) -> Value {
    let (result, encoding) = match r.result.as_deref() {
        None => (Value::Null, Value::Null),
        Some(bytes) => match std::str::from_utf8(bytes) {
            Ok(text) => (json!(text), json!("utf8")),
            Err(_) => {
                (json!(base64::engine::general_purpose::STANDARD.encode(bytes)), json!("base64"))
            }
        },
    };
    json!({
        "scope": r.scope,
        "id": r.id,
        "key_hash": r.key_hash.to_string(),
        "state": r.state.as_str(),
        "attempt": r.attempt,
        "deaths": r.deaths,
        "token": r.token,
        "previous": r.previous.map(|p| p.as_str()),
        "fingerprint": r.fingerprint.map(|f| f.to_string()),
        "result": result,
        "result_encoding": encoding,
        "created_at_us": r.created_at.as_micros(),
        "updated_at_us": r.updated_at.as_micros(),
        "lease_until_us": r.lease_until.map(Timestamp::as_micros),
        "expires_at_us": r.expires_at.as_micros(),
    })
}

/// Counts as a JSON object, with the total.
pub(crate) fn counts_json(c: &Counts) -> Value {
    json!({
        "in_progress": c.in_progress,
        "completed": c.completed,
        "released": c.released,
        "failed": c.failed,
        "in_doubt": c.in_doubt,
        "total": c.total(),
        "expired": c.expired,
    })
}

/// This machine's clock. Ages shown are by it; stores on a server keep their own clock, so an
/// age is off by the skew between the two (the JSON carries the stored times).
pub(crate) fn now() -> Timestamp {
    let us = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
    Timestamp::from_micros(us)
}

/// `42s`, `17m`, `5h`, `3d`.
pub(crate) fn age(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        7200..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{age, clean, json_line};

    #[test]
    fn control_characters_are_shown_not_obeyed() {
        assert_eq!(clean("o-1"), "o-1");
        assert_eq!(
            clean("a\x1b[2Jb\rc\n\t\x7f\u{9b}é"),
            "a\\u{1b}[2Jb\\u{d}c\\u{a}\\u{9}\\u{7f}\\u{9b}é"
        );
        // A literal `\u{1b}` in an id stays distinguishable from an escaped ESC.
        assert_eq!(clean("x\\u{1b}"), "x\\\\u{1b}");
        let v = serde_json::json!({ "id": "a\x1b[2J\r\x7f\u{9b}" });
        let line = json_line(&v);
        assert_eq!(line, r#"{"id":"a\u001b[2J\r\u007f\u009b"}"#);
        assert_eq!(serde_json::from_str::<serde_json::Value>(&line).ok(), Some(v));
    }

    #[test]
    fn ages_round_down_to_one_unit() {
        assert_eq!(age(Duration::from_secs(5)), "5s");
        assert_eq!(age(Duration::from_secs(600)), "10m");
        assert_eq!(age(Duration::from_secs(3 * 3600)), "3h");
        assert_eq!(age(Duration::from_secs(5 * 86_400)), "5d");
    }
}
