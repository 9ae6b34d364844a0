//! Connection options that refuse TLS settings a build without TLS cannot honour.
//!
//! sqlx refuses them too, but its error names its own features; these name idem's, and they
//! apply before any socket is opened. Without TLS, `sslmode=prefer` (PostgreSQL's default) and
//! MySQL's `PREFERRED` connect in plaintext, as libpq does; anything stricter fails.

use idem_core::StoreError;

/// Whether this build can speak TLS to the database.
pub(crate) const TLS_BUILT: bool = cfg!(any(feature = "rustls", feature = "rustls-webpki-roots"));

/// A URL or option asked for TLS that this build lacks.
#[derive(Debug, thiserror::Error)]
#[error(
    "`{setting}` asks for TLS, which this build of idem-sqlx lacks: enable its feature `rustls` \
     (`rustls` of the idem facade)"
)]
pub struct TlsUnavailable {
    setting: String,
}

fn refuse(setting: String) -> StoreError {
    StoreError::backend("connect", false, TlsUnavailable { setting })
}

/// The options of a `postgres://` URL, refusing `sslmode=require` and stricter without TLS.
#[cfg(feature = "postgres")]
pub(crate) fn pg_options(url: &str) -> Result<sqlx::postgres::PgConnectOptions, StoreError> {
    let opts: sqlx::postgres::PgConnectOptions =
        url.parse().map_err(|e| crate::postgres::backend("connect", e))?;
    check_pg(&opts, TLS_BUILT)?;
    Ok(opts)
}

#[cfg(feature = "postgres")]
fn check_pg(opts: &sqlx::postgres::PgConnectOptions, tls: bool) -> Result<(), StoreError> {
    use sqlx::postgres::PgSslMode::{Require, VerifyCa, VerifyFull};
    let mode = opts.get_ssl_mode();
    match mode {
        Require | VerifyCa | VerifyFull if !tls => Err(refuse(format!("sslmode={mode:?}"))),
        _ => Ok(()),
    }
}

/// The options of a `mysql://` URL, refusing `ssl-mode=REQUIRED` and stricter without TLS.
#[cfg(feature = "mysql")]
pub(crate) fn mysql_options(url: &str) -> Result<sqlx::mysql::MySqlConnectOptions, StoreError> {
    let opts: sqlx::mysql::MySqlConnectOptions =
        url.parse().map_err(|e| crate::mysql::backend("connect", e))?;
    check_mysql(&opts, TLS_BUILT)?;
    Ok(opts)
}

#[cfg(feature = "mysql")]
fn check_mysql(opts: &sqlx::mysql::MySqlConnectOptions, tls: bool) -> Result<(), StoreError> {
    use sqlx::mysql::MySqlSslMode::{Required, VerifyCa, VerifyIdentity};
    let mode = opts.get_ssl_mode();
    match mode {
        Required | VerifyCa | VerifyIdentity if !tls => Err(refuse(format!("ssl-mode={mode:?}"))),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    /// An error and its causes, joined by `: ` (what a report prints).
    fn chain(e: &dyn std::error::Error) -> String {
        idem_core::ErrorChain(e).to_string()
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn postgres_without_tls_refuses_require_and_stricter_naming_the_feature() {
        for mode in ["require", "verify-ca", "verify-full"] {
            let url = format!("postgres://u@db.example/app?sslmode={mode}");
            let opts = url.parse().expect("url");
            let e = super::check_pg(&opts, false).err().map(|e| chain(&e));
            let e = e.unwrap_or_default();
            assert!(e.contains("feature `rustls`") && e.contains("sslmode"), "{mode}: {e}");
            assert!(super::check_pg(&opts, true).is_ok());
        }
        for mode in ["disable", "prefer", "allow"] {
            let url = format!("postgres://u@db.example/app?sslmode={mode}");
            assert!(super::check_pg(&url.parse().expect("url"), false).is_ok(), "{mode}");
        }
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn mysql_without_tls_refuses_required_and_stricter_naming_the_feature() {
        for mode in ["REQUIRED", "VERIFY_CA", "VERIFY_IDENTITY"] {
            let url = format!("mysql://u@db.example/app?ssl-mode={mode}");
            let opts = url.parse().expect("url");
            let e = super::check_mysql(&opts, false).err().map(|e| chain(&e));
            assert!(e.unwrap_or_default().contains("feature `rustls`"), "{mode}");
            assert!(super::check_mysql(&opts, true).is_ok());
        }
        let opts = "mysql://u@db.example/app?ssl-mode=PREFERRED".parse().expect("url");
        assert!(super::check_mysql(&opts, false).is_ok());
    }
}
