//! An Event Hubs connection string, parsed and checked, its key never shown.

use std::fmt;

/// What is wrong with an Event Hubs connection string. The messages name the field and never
/// repeat a value that could be the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A required field is absent or empty.
    #[error("Event Hubs connection string: `{field}` is missing or empty")]
    Missing {
        /// The field (`Endpoint`, `SharedAccessKeyName`, `SharedAccessKey`).
        field: &'static str,
    },
    /// A field appears twice.
    #[error("Event Hubs connection string: `{field}` is given twice")]
    Duplicate {
        /// The field.
        field: &'static str,
    },
    /// The endpoint is not `sb://<namespace host>/`.
    #[error(
        "Event Hubs connection string: `Endpoint` {why} (expected `sb://<namespace>.servicebus.windows.net/`)"
    )]
    Endpoint {
        /// What is wrong with it.
        why: &'static str,
    },
    /// A `;`-separated part has no `=` (its text is not shown: it could be part of the key).
    #[error("Event Hubs connection string: part {index} is not `Name=value`")]
    Malformed {
        /// Its position, counting from 1.
        index: usize,
    },
}

/// A parsed `Endpoint=sb://<ns>.servicebus.windows.net/;SharedAccessKeyName=…;SharedAccessKey=…`
/// string, optionally with `;EntityPath=<event hub>`. Field names are matched without regard to
/// case, as the Azure SDKs do; other fields are kept in the string and otherwise ignored.
///
/// `Debug` shows the namespace, key name and entity path, never the key.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct ConnectionString {
    raw: String,
    host: String,
    key_name: String,
    entity_path: Option<String>,
}

impl ConnectionString {
    pub(crate) fn parse(raw: &str) -> Result<Self, Error> {
        let raw = raw.trim();
        let mut endpoint = None;
        let mut key_name = None;
        let mut key = None;
        let mut entity_path = None;
        // A trailing `;` (the portal's strings have none, hand-written ones often do) makes an
        // empty part: skipped.
        for (i, part) in raw.split(';').enumerate().filter(|(_, p)| !p.trim().is_empty()) {
            // The key is base64 and may end in `=`: split at the first one only.
            let (name, value) = part.split_once('=').ok_or(Error::Malformed { index: i + 1 })?;
            let (name, value) = (name.trim(), value.trim());
            let slot = match () {
                () if name.eq_ignore_ascii_case("Endpoint") => Some(("Endpoint", &mut endpoint)),
                () if name.eq_ignore_ascii_case("SharedAccessKeyName") => {
                    Some(("SharedAccessKeyName", &mut key_name))
                }
                () if name.eq_ignore_ascii_case("SharedAccessKey") => {
                    Some(("SharedAccessKey", &mut key))
                }
                () if name.eq_ignore_ascii_case("EntityPath") => {
                    Some(("EntityPath", &mut entity_path))
                }
                () => None,
            };
            if let Some((field, slot)) = slot {
                if slot.is_some() {
                    return Err(Error::Duplicate { field });
                }
                *slot = Some(value);
            }
        }
        let present = |field: &'static str, v: Option<&str>| {
            v.filter(|v| !v.is_empty()).map(str::to_owned).ok_or(Error::Missing { field })
        };
        let host = host(&present("Endpoint", endpoint)?)?;
        let key_name = present("SharedAccessKeyName", key_name)?;
        present("SharedAccessKey", key)?;
        let entity_path = entity_path.filter(|p| !p.is_empty()).map(str::to_owned);
        Ok(Self { raw: raw.to_owned(), host, key_name, entity_path })
    }

    /// The whole string, key included: the SASL password.
    pub(crate) fn as_secret(&self) -> &str {
        &self.raw
    }

    /// The namespace's host name (`<ns>.servicebus.windows.net`).
    pub(crate) fn host(&self) -> &str {
        &self.host
    }

    /// The event hub the string is scoped to, if any.
    pub(crate) fn entity_path(&self) -> Option<&str> {
        self.entity_path.as_deref()
    }
}

/// The host of `sb://<host>[/]`: a DNS name, no port (the Kafka endpoint's port is always 9093),
/// no path.
fn host(endpoint: &str) -> Result<String, Error> {
    let scheme = endpoint.get(..5).filter(|s| s.eq_ignore_ascii_case("sb://"));
    if scheme.is_none() {
        return Err(Error::Endpoint { why: "does not start with `sb://`" });
    }
    let rest = &endpoint[5..];
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    if host.is_empty() {
        return Err(Error::Endpoint { why: "has no host" });
    }
    if !path.is_empty() {
        return Err(Error::Endpoint { why: "has a path (the event hub goes in `EntityPath`)" });
    }
    if !host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.') {
        return Err(Error::Endpoint {
            why: "has a host that is not a DNS name (no port: the Kafka endpoint is always 9093)",
        });
    }
    Ok(host.to_ascii_lowercase())
}

impl fmt::Debug for ConnectionString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnectionString")
            .field("host", &self.host)
            .field("key_name", &self.key_name)
            .field("key", &"<redacted>")
            .field("entity_path", &self.entity_path)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "c2VjcmV0LWtleS1kby1ub3Qtc2hvdw==";

    fn cs(s: &str) -> Result<ConnectionString, Error> {
        ConnectionString::parse(s)
    }

    #[test]
    fn the_portal_string_gives_host_and_entity_path_and_keeps_the_key_with_its_padding() {
        let s = format!(
            "Endpoint=sb://idem-ns.servicebus.windows.net/;SharedAccessKeyName=listen;SharedAccessKey={KEY};EntityPath=orders"
        );
        let c = cs(&s).unwrap();
        assert_eq!(c.host(), "idem-ns.servicebus.windows.net");
        assert_eq!(c.entity_path(), Some("orders"));
        assert_eq!(c.as_secret(), s);
    }

    #[test]
    fn names_are_case_insensitive_and_a_trailing_semicolon_or_spaces_are_fine() {
        let s = format!(
            " endpoint=SB://Idem-NS.servicebus.windows.net;sharedaccesskeyname=k; SharedAccessKey={KEY}; "
        );
        let c = cs(&s).unwrap();
        assert_eq!(c.host(), "idem-ns.servicebus.windows.net");
        assert_eq!(c.entity_path(), None);
    }

    #[test]
    fn each_missing_field_is_named() {
        let ep = "Endpoint=sb://ns.servicebus.windows.net/";
        for (s, field) in [
            (format!("SharedAccessKeyName=k;SharedAccessKey={KEY}"), "Endpoint"),
            (format!("Endpoint=;SharedAccessKeyName=k;SharedAccessKey={KEY}"), "Endpoint"),
            (format!("{ep};SharedAccessKey={KEY}"), "SharedAccessKeyName"),
            (format!("{ep};SharedAccessKeyName=k"), "SharedAccessKey"),
            (format!("{ep};SharedAccessKeyName=k;SharedAccessKey="), "SharedAccessKey"),
        ] {
            let e = cs(&s).unwrap_err();
            assert_eq!(e, Error::Missing { field }, "{s}");
            assert!(e.to_string().contains(&format!("`{field}`")), "{e}");
        }
    }

    #[test]
    fn a_bad_endpoint_says_what_is_wrong() {
        for (endpoint, says) in [
            ("https://ns.servicebus.windows.net/", "sb://"),
            ("sb:///", "no host"),
            ("sb://ns.servicebus.windows.net/orders", "EntityPath"),
            ("sb://ns.servicebus.windows.net:9093/", "no port"),
        ] {
            let s = format!("Endpoint={endpoint};SharedAccessKeyName=k;SharedAccessKey={KEY}");
            let e = cs(&s).unwrap_err();
            assert!(matches!(e, Error::Endpoint { .. }), "{endpoint}: {e:?}");
            assert!(e.to_string().contains(says), "{endpoint}: {e}");
        }
    }

    #[test]
    fn duplicates_and_malformed_parts_are_errors_that_never_show_the_key() {
        let ep = "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=k";
        let e = cs(&format!("{ep};SharedAccessKey={KEY};sharedaccesskey={KEY}")).unwrap_err();
        assert_eq!(e, Error::Duplicate { field: "SharedAccessKey" });
        // A key pasted without its name: the part is reported by position only.
        let e = cs(&format!("{ep};{}", KEY.trim_end_matches('='))).unwrap_err();
        assert_eq!(e, Error::Malformed { index: 3 });
        assert!(!e.to_string().contains(KEY.trim_end_matches('=')), "{e}");
    }

    #[test]
    fn debug_redacts_the_key() {
        let c = cs(&format!(
            "Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey={KEY}"
        ))
        .unwrap();
        let d = format!("{c:?}");
        assert!(!d.contains(KEY) && d.contains("<redacted>") && d.contains("ns.servicebus"), "{d}");
    }
}
