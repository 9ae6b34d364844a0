//! The last line of defence: secrets scrubbed from everything the CLI writes to stderr.
//!
//! The CLI's own messages show addresses through [`idem::redact::Redacted`]. Log lines of the
//! client libraries (`RUST_LOG=debug`) and the causes in an error chain are not written by
//! idem; a client that prints its configuration would print the password. So every secret
//! found in the command line and the `IDEM_*` variables (as given, and percent-decoded, as a
//! client holds it) is replaced by `***` in each log line and in the final error; `idem serve`
//! adds the secrets of every address and token its configuration holds ([`Scrubber::add`],
//! [`Scrubber::add_literal`]) before it connects to anything. Secrets
//! shorter than [`MIN_LEN`] characters are left alone: replacing them would garble every line,
//! and they are not worth guessing less than the rest of the line tells anyway.

use std::borrow::Cow;
use std::io::Write;
use std::sync::{Arc, PoisonError, RwLock};

use idem::redact::{self, MASK};

/// Secrets shorter than this are not scrubbed from other text.
const MIN_LEN: usize = 4;

/// The variables the CLI reads addresses from.
pub(crate) const ADDRESS_VARS: [&str; 6] = [
    "IDEM_STORE",
    "IDEM_OUTBOX",
    "IDEM_TO",
    "IDEM_CHAOS_BROKER",
    "IDEM_CHAOS_STORE",
    "IDEM_BENCH_URL",
];

/// The secrets to look for, longest first (so a secret containing another goes whole).
#[derive(Debug, Default)]
pub(crate) struct Scrubber {
    secrets: RwLock<Vec<String>>,
}

impl Scrubber {
    /// The secrets of `addresses` (each argument and address variable of the process).
    pub(crate) fn new<'a>(addresses: impl IntoIterator<Item = &'a str>) -> Self {
        let s = Self::default();
        s.add(addresses);
        s
    }

    /// Adds the secrets of `addresses` (their passwords, tokens and keys, as given and
    /// percent-decoded).
    pub(crate) fn add<'a>(&self, addresses: impl IntoIterator<Item = &'a str>) {
        let mut found = Vec::new();
        for address in addresses {
            for s in redact::secrets(address) {
                found.push(s.to_owned());
                if let Some(decoded) = decode(s) {
                    found.push(decoded);
                }
            }
        }
        self.extend(found);
    }

    /// Adds `secret` itself (an API token), and its percent-decoded form.
    pub(crate) fn add_literal(&self, secret: &str) {
        let mut found = vec![secret.to_owned()];
        found.extend(decode(secret));
        self.extend(found);
    }

    fn extend(&self, found: Vec<String>) {
        let mut secrets = self.secrets.write().unwrap_or_else(PoisonError::into_inner);
        secrets.extend(found.into_iter().filter(|s| s.chars().count() >= MIN_LEN));
        secrets.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        secrets.dedup();
    }

    /// The process's own: its arguments and address variables.
    pub(crate) fn from_process() -> Self {
        let args: Vec<String> = std::env::args().collect();
        let vars: Vec<String> = ADDRESS_VARS.iter().filter_map(|v| std::env::var(v).ok()).collect();
        Self::new(args.iter().chain(&vars).map(String::as_str))
    }

    /// `text` with every secret replaced by `***`.
    pub(crate) fn scrub<'t>(&self, text: &'t str) -> Cow<'t, str> {
        let mut out = Cow::Borrowed(text);
        let secrets = self.secrets.read().unwrap_or_else(PoisonError::into_inner);
        for s in secrets.iter() {
            if out.contains(s.as_str()) {
                out = Cow::Owned(out.replace(s.as_str(), MASK));
            }
        }
        out
    }
}

/// The percent-decoded form, when it differs (`+` is left alone: it is a plus in a user-info).
fn decode(s: &str) -> Option<String> {
    let decoded = percent_encoding::percent_decode_str(s).decode_utf8().ok()?;
    (decoded != s).then(|| decoded.into_owned())
}

/// A `tracing` writer to stderr that scrubs each event, written whole when it is dropped.
#[derive(Clone)]
pub(crate) struct Stderr(pub(crate) Arc<Scrubber>);

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Stderr {
    type Writer = Event;

    fn make_writer(&'a self) -> Event {
        Event { scrubber: Arc::clone(&self.0), buf: Vec::new() }
    }
}

/// One log event being formatted.
pub(crate) struct Event {
    scrubber: Arc<Scrubber>,
    buf: Vec<u8>,
}

impl Write for Event {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let text = String::from_utf8_lossy(&self.buf);
        let mut err = std::io::stderr().lock();
        err.write_all(self.scrubber.scrub(&text).as_bytes())?;
        self.buf.clear();
        err.flush()
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // Nowhere to report a failed write to stderr.
        let _ = self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrubs_each_secret_as_given_and_decoded() {
        let s = Scrubber::new([
            "--store",
            "postgres://u:p%40ssword@h/db?sslpassword=k3y-Pass",
            "amqp://guest:pw@h",
            "orders",
        ]);
        let line =
            "ServerAddr { password: Some(\"p@ssword\") } sent p%40ssword, k3y-Pass, pw, orders";
        assert_eq!(
            s.scrub(line),
            "ServerAddr { password: Some(\"***\") } sent ***, ***, pw, orders"
        );
        assert!(matches!(s.scrub("nothing here"), Cow::Borrowed(_)));
    }

    #[test]
    fn decodes_only_what_is_encoded() {
        assert_eq!(decode("a%2Fb").as_deref(), Some("a/b"));
        assert_eq!(decode("plain"), None);
        assert_eq!(decode("100%"), None);
    }
}
