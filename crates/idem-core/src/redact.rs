//! Secrets hidden from addresses before they are shown: one set of rules for every error,
//! `Debug` impl, log line and command-line message that names a server.
//!
//! [`Redacted`] wraps whatever a user gave as "where the server is" and displays it without
//! its secrets; [`url()`] returns the same text as a `String`; [`secrets`] lists what is hidden,
//! to scrub text that never went through [`Redacted`] (a client library's log line). The input
//! may be:
//!
//! - a **URL** (`scheme://…`), read with the [`url`](https://docs.rs/url) crate as the database
//!   and broker clients read it: the password of the user-info is shown as `***` (the user name
//!   is kept: it tells an operator which account failed), and so is the value of every secret
//!   query or fragment parameter (see [`is_secret_name`]). `scheme://user:***@host/…`.
//! - a **connection string** of `Name=value` parts separated by `;`, as Azure shows them
//!   (`Endpoint=sb://…;SharedAccessKeyName=…;SharedAccessKey=…`, Cosmos DB's `AccountKey=`,
//!   ADO.NET's `Password=`), or libpq's `host=… password=…` separated by spaces: the values of
//!   secret names are hidden; a part that is not `Name=value` is hidden whole (it could be a key
//!   pasted without its name).
//! - anything else (a SQLite path, `host:port`): shown unchanged, unless it has a
//!   `user:password@` part, whose password is hidden.
//!
//! When a URL is ambiguous, it is masked conservatively: an `@` that the URL parser does not
//! read as the end of the user-info (a password with an unencoded `/`, `?` or `#` in it, which
//! moves the parser's idea of where the host starts) hides everything between `://` and the
//! last `@`. Text without a secret comes out as it went in.
//!
//! ```
//! use idem_core::redact::{self, Redacted};
//!
//! assert_eq!(
//!     Redacted("postgres://app:hunter2@db:5432/orders?sslmode=require").to_string(),
//!     "postgres://app:***@db:5432/orders?sslmode=require"
//! );
//! assert_eq!(redact::url("redis://127.0.0.1:6379/?password=hunter2"), "redis://127.0.0.1:6379/?password=***");
//! assert_eq!(
//!     redact::url("Endpoint=sb://shop.servicebus.windows.net/;SharedAccessKeyName=listen;SharedAccessKey=c2VjcmV0"),
//!     "Endpoint=sb://shop.servicebus.windows.net/;SharedAccessKeyName=listen;SharedAccessKey=***"
//! );
//! assert_eq!(redact::url("/var/lib/app/idem.sqlite"), "/var/lib/app/idem.sqlite");
//! let message = format!("cannot connect to {}", Redacted("amqp://guest:guest@mq:5672/%2f"));
//! assert_eq!(message, "cannot connect to amqp://guest:***@mq:5672/%2f");
//! ```

use std::fmt;

use url::{Position, Url};

/// What a hidden secret is shown as.
pub const MASK: &str = "***";

/// An address (URL, connection string, path) that displays without its secrets.
///
/// Displaying it allocates only inside the URL parser; the rules are in the
/// [module docs](self).
///
/// ```
/// use idem_core::redact::Redacted;
///
/// let url = "mysql://root:s3cret@127.0.0.1:3306/test";
/// assert_eq!(format!("MySQL at {}", Redacted(url)), "MySQL at mysql://root:***@127.0.0.1:3306/test");
/// // Debug is the same text, quoted.
/// assert_eq!(format!("{:?}", Redacted(url)), "\"mysql://root:***@127.0.0.1:3306/test\"");
/// ```
#[derive(Clone, Copy)]
pub struct Redacted<'a>(pub &'a str);

impl fmt::Display for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_any(self.0, &mut Masked(f))
    }
}

impl fmt::Debug for Redacted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.to_string(), f)
    }
}

/// `s` without its secrets, as [`Redacted`] displays it.
///
/// ```
/// assert_eq!(
///     idem_core::redact::url("amqps://app:pw@mq.example.com/%2f?auth_token=abc&heartbeat=10"),
///     "amqps://app:***@mq.example.com/%2f?auth_token=***&heartbeat=10"
/// );
/// // libpq's key=value form, and Cosmos DB's connection string.
/// assert_eq!(idem_core::redact::url("host=db password=pw dbname=x"), "host=db password=*** dbname=x");
/// assert_eq!(
///     idem_core::redact::url("AccountEndpoint=https://x.documents.azure.com:443/;AccountKey=a2V5;"),
///     "AccountEndpoint=https://x.documents.azure.com:443/;AccountKey=***;"
/// );
/// ```
pub fn url(s: &str) -> String {
    Redacted(s).to_string()
}

/// The parts of `s` that [`Redacted`] hides, as they appear in `s` (percent-encoded where `s`
/// encodes them). For scrubbing text that did not go through [`Redacted`], such as a client
/// library's log line: look for each part, and for its percent-decoded form too.
///
/// ```
/// let url = "postgres://app:hunter2@db/orders?sslmode=require&sslpassword=p%40ss";
/// assert_eq!(idem_core::redact::secrets(url), ["hunter2", "p%40ss"]);
/// assert!(idem_core::redact::secrets("/var/lib/idem.sqlite").is_empty());
/// ```
pub fn secrets(s: &str) -> Vec<&str> {
    let mut found = Secrets(Vec::new());
    // Collecting never fails.
    let _ = write_any(s, &mut found);
    found.0
}

/// Whether a query parameter or connection-string field named `name` holds a secret.
///
/// The name is compared case-insensitively with everything but letters and digits removed
/// (`access_token`, `Access-Token` and `accesstoken` are one name). Secret: every name
/// containing `password`, `passwd`, `secret` or `token` (`sslpassword`, `sasl.password`,
/// `client_secret`, `access_token`, `SharedAccessToken`…), and `pass`, `pwd`, `sig`, `signature`,
/// `key`, `apikey`, `accesskey`, `accountkey`, `sharedaccesskey`, `sharedaccesssignature`,
/// `credential`, `credentials`, `auth` and `authorization`. Not secret: names of files that
/// hold secrets (`sslkey`, `sslcert`, `ssl.key.location`): a path is shown, so an operator can
/// see which file was used.
///
/// ```
/// use idem_core::redact::is_secret_name;
///
/// assert!(is_secret_name("Password") && is_secret_name("SharedAccessKey") && is_secret_name("sig"));
/// assert!(!is_secret_name("SharedAccessKeyName") && !is_secret_name("sslkey") && !is_secret_name("user"));
/// ```
pub fn is_secret_name(name: &str) -> bool {
    let mut norm = String::with_capacity(name.len());
    norm.extend(name.chars().filter(|c| c.is_alphanumeric()).flat_map(char::to_lowercase));
    ["password", "passwd", "secret", "token"].iter().any(|p| norm.contains(p))
        || matches!(
            norm.as_str(),
            "pass"
                | "pwd"
                | "sig"
                | "signature"
                | "key"
                | "apikey"
                | "accesskey"
                | "accountkey"
                | "sharedaccesskey"
                | "sharedaccesssignature"
                | "credential"
                | "credentials"
                | "auth"
                | "authorization"
        )
}

/// Where the rules send each piece of an address: shown as it is, or hidden.
trait Sink<'s> {
    fn text(&mut self, s: &'s str) -> fmt::Result;
    fn secret(&mut self, s: &'s str) -> fmt::Result;
}

/// Shows the text and [`MASK`] for each secret.
struct Masked<'a, 'f>(&'a mut fmt::Formatter<'f>);

impl<'s> Sink<'s> for Masked<'_, '_> {
    fn text(&mut self, s: &'s str) -> fmt::Result {
        self.0.write_str(s)
    }

    fn secret(&mut self, _: &'s str) -> fmt::Result {
        self.0.write_str(MASK)
    }
}

/// Keeps the secrets.
struct Secrets<'s>(Vec<&'s str>);

impl<'s> Sink<'s> for Secrets<'s> {
    fn text(&mut self, _: &'s str) -> fmt::Result {
        Ok(())
    }

    fn secret(&mut self, s: &'s str) -> fmt::Result {
        if !s.is_empty() {
            self.0.push(s);
        }
        Ok(())
    }
}

fn write_any<'s>(s: &'s str, out: &mut dyn Sink<'s>) -> fmt::Result {
    let body = s.trim_start();
    out.text(&s[..s.len() - body.len()])?;
    if let Some(end) = scheme_end(body) {
        write_url(body, end, out)
    } else if is_key_values(body) {
        write_key_values(body, out)
    } else {
        write_plain(body, out)
    }
}

/// Where `://` starts, when `s` begins with a URL scheme (`ALPHA *(ALPHA / DIGIT / + - .)`).
fn scheme_end(s: &str) -> Option<usize> {
    let end = s.find("://")?;
    let mut scheme = s[..end].chars();
    let first = scheme.next()?;
    (first.is_ascii_alphabetic()
        && scheme.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
    .then_some(end)
}

fn write_url<'s>(s: &'s str, scheme_end: usize, out: &mut dyn Sink<'s>) -> fmt::Result {
    let (head, rest) = s.split_at(scheme_end + 3);
    // The URL parser (the one sqlx, lapin and fe2o3-amqp use) decides whether the text before
    // the last `@` is a user-info: it is unless the parser fails, or reads an `@` after the
    // host (a password with an unencoded `/`, `?` or `#` moves where it thinks the host is).
    let clear = Url::parse(s).is_ok_and(|u| !u[Position::BeforeHost..].contains('@'));
    out.text(head)?;
    write_authority_and_rest(rest, clear, out)
}

/// What follows `scheme://`, or a whole string without a scheme: a `…@` prefix is user-info,
/// up to the last `@`, so a password with an `@` in it is hidden whole. The rest is shown as
/// it was given (not in the parser's normal form), with its secret parameters hidden.
fn write_authority_and_rest<'s>(s: &'s str, clear: bool, out: &mut dyn Sink<'s>) -> fmt::Result {
    let rest = match s.rfind('@') {
        Some(at) => {
            write_user_info(&s[..at], clear, out)?;
            out.text("@")?;
            &s[at + 1..]
        }
        None => s,
    };
    write_path_and_query(rest, out)
}

/// `user:password` as `user:***`. Unless the parser read it as a user-info (`clear`), text
/// that has a `/`, `?`, `#`, backslash or space in it is hidden whole: the password may be
/// anywhere in it.
fn write_user_info<'s>(info: &'s str, clear: bool, out: &mut dyn Sink<'s>) -> fmt::Result {
    if !clear && (info.contains(['/', '?', '#', '\\']) || info.contains(char::is_whitespace)) {
        return out.secret(info);
    }
    match info.split_once(':') {
        Some((user, password)) => {
            out.text(user)?;
            out.text(":")?;
            out.secret(password)
        }
        None => out.text(info),
    }
}

/// Text up to `?` unchanged, then the query's and fragment's parameters.
fn write_path_and_query<'s>(s: &'s str, out: &mut dyn Sink<'s>) -> fmt::Result {
    let Some(q) = s.find(['?', '#']) else { return out.text(s) };
    out.text(&s[..=q])?;
    let rest = &s[q + 1..];
    match rest.find('#') {
        Some(h) if s.as_bytes()[q] == b'?' => {
            write_pairs(&rest[..h], out)?;
            out.text("#")?;
            write_pairs(&rest[h + 1..], out)
        }
        _ => write_pairs(rest, out),
    }
}

/// `a=1&password=x;b=2` as `a=1&password=***;b=2`: the value of each secret name hidden, the
/// rest as it was (names are percent-decoded to be compared, never re-encoded).
fn write_pairs<'s>(s: &'s str, out: &mut dyn Sink<'s>) -> fmt::Result {
    let mut start = 0;
    for (i, sep) in s.match_indices(['&', ';']) {
        write_pair(&s[start..i], out)?;
        out.text(sep)?;
        start = i + 1;
    }
    write_pair(&s[start..], out)
}

fn write_pair<'s>(pair: &'s str, out: &mut dyn Sink<'s>) -> fmt::Result {
    if let Some((name, value)) = pair.split_once('=') {
        let decoded = url::form_urlencoded::parse(name.as_bytes()).next().map(|(k, _)| k);
        if decoded.is_some_and(|k| is_secret_name(&k)) {
            out.text(name)?;
            out.text("=")?;
            return out.secret(value);
        }
    }
    out.text(pair)
}

/// `Name=value;…` (names may have spaces, as ADO.NET's `User ID`), or libpq's `name=value …`
/// (the first part then has no space).
fn is_key_values(s: &str) -> bool {
    let Some((name, _)) = s.split_once('=') else { return false };
    let name_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ' ');
    let name = name.trim();
    !name.is_empty() && name.chars().all(name_char) && (s.contains(';') || !name.contains(' '))
}

fn write_key_values<'s>(s: &'s str, out: &mut dyn Sink<'s>) -> fmt::Result {
    let semicolons = s.contains(';');
    let is_sep = |c: char| if semicolons { c == ';' } else { c.is_whitespace() };
    let mut start = 0;
    for (i, c) in s.char_indices().filter(|(_, c)| is_sep(*c)) {
        write_key_value(&s[start..i], out)?;
        out.text(&s[i..i + c.len_utf8()])?;
        start = i + c.len_utf8();
    }
    write_key_value(&s[start..], out)
}

fn write_key_value<'s>(part: &'s str, out: &mut dyn Sink<'s>) -> fmt::Result {
    if part.trim().is_empty() {
        return out.text(part);
    }
    match part.split_once('=') {
        Some((name, value)) if is_secret_name(name) => {
            out.text(name)?;
            out.text("=")?;
            out.secret(value)
        }
        // A value may be an address itself (`Endpoint=sb://…`, `Server=user:pw@host`).
        Some((name, value)) => {
            out.text(name)?;
            out.text("=")?;
            write_any(value, out)
        }
        // Not `Name=value`: maybe a key pasted without its name.
        None => out.secret(part),
    }
}

/// A string without a scheme: a path or `host:port` unchanged; `user:password@…` hidden.
fn write_plain<'s>(s: &'s str, out: &mut dyn Sink<'s>) -> fmt::Result {
    match s.rfind('@') {
        Some(at) if s[..at].contains(':') => write_authority_and_rest(s, false, out),
        _ => write_path_and_query(s, out),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn hides_user_info_passwords_and_keeps_the_user() {
        for (input, shown) in [
            ("postgres://u:pw@h:5432/db", "postgres://u:***@h:5432/db"),
            ("postgresql://u:pw@h/db", "postgresql://u:***@h/db"),
            ("mysql://root:pw@127.0.0.1:3306/test", "mysql://root:***@127.0.0.1:3306/test"),
            ("redis://:pw@127.0.0.1:6379", "redis://:***@127.0.0.1:6379"),
            ("amqp://guest:guest@127.0.0.1:5672/%2f", "amqp://guest:***@127.0.0.1:5672/%2f"),
            ("nats://u:p%40ss@n:4222", "nats://u:***@n:4222"),
            ("postgres://u:p@ss@h/db", "postgres://u:***@h/db"),
            ("postgres://postgres@127.0.0.1:5432/test", "postgres://postgres@127.0.0.1:5432/test"),
            // An empty password is hidden too: whether it is empty is not for the log to say.
            ("postgres://u:@h/db", "postgres://u:***@h/db"),
            ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
            ("mysql:///test", "mysql:///test"),
        ] {
            assert_eq!(url(input), shown, "{input}");
        }
    }

    #[test]
    fn hides_secret_query_and_fragment_parameters() {
        for (input, shown) in [
            ("postgres://h/db?password=pw", "postgres://h/db?password=***"),
            (
                "postgres://h/db?sslmode=require&Password=pw&sslkey=/k.pem",
                "postgres://h/db?sslmode=require&Password=***&sslkey=/k.pem",
            ),
            ("redis://h/?pass%77ord=pw", "redis://h/?pass%77ord=***"),
            (
                "https://a.blob.core.windows.net/c?sv=1&sig=abc%3D",
                "https://a.blob.core.windows.net/c?sv=1&sig=***",
            ),
            ("https://h/cb#access_token=t&x=1", "https://h/cb#access_token=***&x=1"),
            (
                "kafka://h1:9092,h2:9092?sasl.password=pw",
                "kafka://h1:9092,h2:9092?sasl.password=***",
            ),
            ("http://h/?flag&key=k;pwd=p", "http://h/?flag&key=***;pwd=***"),
        ] {
            assert_eq!(url(input), shown, "{input}");
        }
    }

    #[test]
    fn ambiguous_or_unparsable_urls_are_masked_up_to_the_last_at() {
        for (input, shown) in [
            // A `/` or `?` in the password ends the authority for the parser.
            ("amqp://u:pa/ss@h/vhost", "amqp://***@h/vhost"),
            ("redis://u:12?ss@h/", "redis://***@h/"),
            ("postgres://u:pw#x@h/db", "postgres://***@h/db"),
            // Several hosts: not one URL for the parser.
            ("postgres://u:pw@h1:5432,h2:5432/db", "postgres://u:***@h1:5432,h2:5432/db"),
            // An `@` in the query: over-masked rather than risk it.
            ("http://h/p?email=a@b", "http://***@b"),
        ] {
            assert_eq!(url(input), shown, "{input}");
        }
    }

    #[test]
    fn connection_strings_hide_secret_fields_and_nameless_parts() {
        for (input, shown) in [
            (
                "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=listen;SharedAccessKey=a2V5=;EntityPath=orders",
                "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=listen;SharedAccessKey=***;EntityPath=orders",
            ),
            (
                "endpoint=sb://ns/;sharedaccesssignature=SharedAccessSignature sr=x&sig=y&se=1",
                "endpoint=sb://ns/;sharedaccesssignature=***",
            ),
            (
                "AccountEndpoint=https://x.documents.azure.com:443/;AccountKey=a2V5==;",
                "AccountEndpoint=https://x.documents.azure.com:443/;AccountKey=***;",
            ),
            ("Server=db;User ID=sa;Password=pw;", "Server=db;User ID=sa;Password=***;"),
            ("Endpoint=sb://ns/;a2V5", "Endpoint=sb://ns/;***"),
            ("Endpoint=amqp://u:pw@h/;X=1", "Endpoint=amqp://u:***@h/;X=1"),
            ("host=db user=u password=pw dbname=x", "host=db user=u password=*** dbname=x"),
            ("host=db password='a b' dbname=x", "host=db password=*** *** dbname=x"),
        ] {
            assert_eq!(url(input), shown, "{input}");
        }
    }

    #[test]
    fn text_without_a_secret_passes_unchanged() {
        for s in [
            "/var/lib/idem.sqlite",
            "./a=b.db",
            "idem.sqlite",
            "127.0.0.1:6379",
            "h1:9092,h2:9092",
            "C:\\data\\idem.sqlite",
            "my file=1.db",
            "",
            "  postgres://h/db",
            "ops@example.com",
        ] {
            assert_eq!(url(s), s);
        }
    }

    #[test]
    fn plain_user_password_at_host_is_masked() {
        assert_eq!(url("u:pw@h:5432/db"), "u:***@h:5432/db");
        assert_eq!(url("host:5432?password=pw"), "host:5432?password=***");
        assert_eq!(url("C:\\x:y@h"), "***@h");
    }

    #[test]
    fn secret_names() {
        for n in ["password", "PASSWORD", "sslpassword", "sasl.password", "client_secret", "pwd"] {
            assert!(is_secret_name(n), "{n}");
        }
        for n in ["access_token", "Access-Token", "AccountKey", "SharedAccessSignature", "key"] {
            assert!(is_secret_name(n), "{n}");
        }
        for n in ["user", "sslkey", "sslcert", "ssl.key.location", "SharedAccessKeyName", "host"] {
            assert!(!is_secret_name(n), "{n}");
        }
    }

    /// Percent-encodes everything but letters and digits, as a careful user would.
    fn encode(s: &str) -> String {
        s.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() {
                    (b as char).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect()
    }

    /// A password: a marker no template contains, then letters, digits and URL delimiters.
    fn password() -> impl Strategy<Value = String> {
        "[A-Za-z0-9!$&'()*+,;=:@/?#\\[\\]%~._-]{1,24}".prop_map(|s| format!("Zq{s}"))
    }

    fn base64ish() -> impl Strategy<Value = String> {
        "[A-Za-z0-9+/]{8,44}={0,2}".prop_map(|s| format!("Zq{s}"))
    }

    fn scheme() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "postgres",
            "postgresql",
            "mysql",
            "mariadb",
            "redis",
            "rediss",
            "amqp",
            "amqps",
            "nats",
            "kafka",
            "http",
            "https",
            "sb",
        ])
    }

    fn secret_param() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "password",
            "Password",
            "PASS",
            "pwd",
            "sig",
            "token",
            "access_token",
            "secret",
            "sslpassword",
            "SharedAccessKey",
            "auth_token",
        ])
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// A password in the user-info, encoded or not (an unencoded one makes the URL
        /// ambiguous, or unparsable), never shows.
        #[test]
        fn user_info_passwords_never_show(
            scheme in scheme(), pw in password(), encoded in any::<bool>(),
            tail in prop::sample::select(vec!["", "/", "/db", "/%2f?heartbeat=10", ":5432/db?sslmode=disable"]),
        ) {
            let planted = if encoded { encode(&pw) } else { pw.clone() };
            let input = format!("{scheme}://user:{planted}@host{tail}");
            let out = url(&input);
            prop_assert!(!out.contains(&pw) && !out.contains(&planted), "{} -> {}", input, out);
            // What is hidden is reported: the planted text is inside one of the secrets.
            let hidden = secrets(&input);
            prop_assert!(hidden.iter().any(|h| h.contains(&planted)), "{} -> {:?}", input, hidden);
        }

        /// A secret query parameter's value, percent-encoded, in any position of the query.
        #[test]
        fn secret_query_parameters_never_show(
            scheme in scheme(), name in secret_param(), pw in password(),
            before in any::<bool>(), after in any::<bool>(),
        ) {
            let planted = encode(&pw);
            let mut query = vec![format!("{name}={planted}")];
            if before { query.insert(0, "sslmode=require".to_owned()); }
            if after { query.push("application_name=idem".to_owned()); }
            let input = format!("{scheme}://u@host:1/db?{}", query.join("&"));
            let out = url(&input);
            prop_assert!(!out.contains(&pw) && !out.contains(&planted), "{} -> {}", input, out);
            prop_assert_eq!(secrets(&input), [planted.as_str()]);
        }

        /// Azure's connection strings (Service Bus, Event Hubs, Cosmos DB), any case, any
        /// order, with or without a trailing `;`.
        #[test]
        fn connection_string_keys_never_show(
            key in base64ish(),
            name in prop::sample::select(vec!["SharedAccessKey", "sharedaccesskey", "AccountKey", "SharedAccessSignature"]),
            first in any::<bool>(), trailing in any::<bool>(),
        ) {
            let secret = format!("{name}={key}");
            let parts = if first {
                vec![secret.as_str(), "Endpoint=sb://ns.servicebus.windows.net/", "SharedAccessKeyName=listen"]
            } else {
                vec!["Endpoint=sb://ns.servicebus.windows.net/", "SharedAccessKeyName=listen", secret.as_str()]
            };
            let input = parts.join(";") + if trailing { ";" } else { "" };
            let out = url(&input);
            prop_assert!(!out.contains(&key), "{} -> {}", input, out);
            prop_assert!(out.contains("SharedAccessKeyName=listen"), "{}", out);
        }

        /// libpq's `key=value` form and `user:password@host` without a scheme.
        #[test]
        fn key_value_and_schemeless_passwords_never_show(
            pw in "[A-Za-z0-9!$%&()*+,:/?#._-]{1,24}".prop_map(|s| format!("Zq{s}")),
        ) {
            for input in [
                format!("host=db user=u password={pw} dbname=x"),
                format!("user:{pw}@db:5432/x"),
            ] {
                let out = url(&input);
                prop_assert!(!out.contains(&pw), "{} -> {}", input, out);
            }
        }

        /// Text with no secret in it comes out as it went in.
        #[test]
        fn paths_and_addresses_pass_unchanged(s in "[A-Za-z0-9/._-]{0,40}(:[0-9]{1,5})?") {
            prop_assert_eq!(url(&s), s);
        }
    }
}
