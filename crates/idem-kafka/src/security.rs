//! Refusing TLS and SASL settings this build cannot honour, before librdkafka sees them.

use rdkafka::config::ClientConfig;

use crate::error::Error;

/// Whether this build's librdkafka has TLS (the crate feature `tls`, implied by `event-hubs`).
pub(crate) const TLS_BUILT: bool = cfg!(feature = "tls");

/// Checks `security.protocol` and `sasl.mechanism(s)` against what this build can do.
///
/// librdkafka refuses `SSL`/`SASL_SSL` itself when it was built without OpenSSL, but its error
/// names its own build, not the idem feature that turns OpenSSL on; this one does. A setting
/// that asks for TLS never connects in plaintext either way.
pub(crate) fn check(config: &ClientConfig) -> Result<(), Error> {
    check_with(config, TLS_BUILT)
}

fn check_with(config: &ClientConfig, tls_built: bool) -> Result<(), Error> {
    if let Some(protocol) = config.get("security.protocol") {
        let p = protocol.to_ascii_lowercase();
        if !matches!(p.as_str(), "plaintext" | "ssl" | "sasl_plaintext" | "sasl_ssl") {
            return Err(Error::Setting {
                key: "security.protocol",
                value: protocol.to_owned(),
                why: "expected PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL",
            });
        }
        if (p == "ssl" || p == "sasl_ssl") && !tls_built {
            return Err(Error::Setting {
                key: "security.protocol",
                value: protocol.to_owned(),
                why: "this build of idem-kafka has no TLS: enable the feature `tls` of idem-kafka \
                      (`kafka-tls` of the idem facade; `event-hubs` implies it)",
            });
        }
    }
    for key in ["sasl.mechanism", "sasl.mechanisms"] {
        if let Some(m) = config.get(key)
            && m.to_ascii_uppercase().starts_with("SCRAM-")
            && !tls_built
        {
            return Err(Error::Setting {
                key: "sasl.mechanism",
                value: m.to_owned(),
                why: "SCRAM needs librdkafka's OpenSSL: enable the feature `tls` of idem-kafka \
                      (`kafka-tls` of the idem facade)",
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(pairs: &[(&str, &str)]) -> ClientConfig {
        let mut c = ClientConfig::new();
        for (k, v) in pairs {
            c.set(*k, *v);
        }
        c
    }

    #[test]
    fn a_build_without_tls_refuses_tls_and_scram_naming_the_feature() {
        for pairs in [
            &[("security.protocol", "SSL")][..],
            &[("security.protocol", "sasl_ssl")],
            &[("security.protocol", "SASL_PLAINTEXT"), ("sasl.mechanism", "SCRAM-SHA-512")],
        ] {
            let e = check_with(&config(pairs), false).err().map(|e| e.to_string());
            let e = e.unwrap_or_default();
            assert!(e.contains("feature `tls`") && e.contains("kafka-tls"), "{pairs:?}: {e}");
        }
    }

    #[test]
    fn a_build_with_tls_accepts_them_and_plaintext_is_always_fine() {
        let tls = config(&[("security.protocol", "SASL_SSL"), ("sasl.mechanism", "SCRAM-SHA-256")]);
        assert!(check_with(&tls, true).is_ok());
        assert!(check_with(&config(&[("security.protocol", "PLAINTEXT")]), false).is_ok());
        assert!(check_with(&config(&[]), false).is_ok());
    }

    #[test]
    fn an_unknown_protocol_is_refused() {
        let e = check_with(&config(&[("security.protocol", "TLS")]), true).err();
        assert!(e.map(|e| e.to_string()).unwrap_or_default().contains("SASL_SSL"));
    }
}
