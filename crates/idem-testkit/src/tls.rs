//! The throw-away PKI and TLS listeners `.ci/services.sh up` makes, for TLS tests.
//!
//! The directory comes from `IDEM_TEST_TLS_DIR` (default `/tmp/idem-ci/tls`) and holds `ca.pem`
//! (the CA every listener's certificate chains to), `client.pem` / `client.key` (a client
//! certificate signed by it, CN `idem-client`) and `wrong-ca.pem` (an unrelated CA). Server
//! certificates name `localhost` and `127.0.0.1`; every listener also answers on [`WRONG_HOST`],
//! which they do not name.

use std::path::{Path, PathBuf};

use crate::service;

/// An address every TLS listener answers on but no server certificate names: connecting to it
/// with host-name verification must fail.
pub const WRONG_HOST: &str = "127.0.0.2";

/// The PKI of the TLS listeners.
#[derive(Debug, Clone)]
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// The PKI, if its files exist; `None` (printing `skipped`) when they do not, or a panic
    /// under `CI=true`.
    ///
    /// # Panics
    /// When the files are missing and the environment has `CI=true`.
    pub fn require() -> Option<Self> {
        let dir = std::env::var("IDEM_TEST_TLS_DIR").unwrap_or_else(|_| "/tmp/idem-ci/tls".into());
        let pki = Self { dir: dir.into() };
        if ["ca.pem", "client.pem", "client.key", "wrong-ca.pem"]
            .iter()
            .all(|f| pki.dir.join(f).is_file())
        {
            return Some(pki);
        }
        if service::in_ci() {
            panic!(
                "TLS test PKI missing in {} (from IDEM_TEST_TLS_DIR) and CI=true: run .ci/services.sh up",
                pki.dir.display()
            );
        }
        eprintln!(
            "skipped: TLS test PKI missing in {} (run .ci/services.sh up)",
            pki.dir.display()
        );
        None
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA's certificate (PEM file).
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// An unrelated CA's certificate: a server verified against it must be refused.
    pub fn wrong_ca(&self) -> PathBuf {
        self.dir.join("wrong-ca.pem")
    }

    /// The listeners' certificate (PEM; names `localhost` and `127.0.0.1`), for a test's own
    /// TLS server.
    pub fn server_cert(&self) -> PathBuf {
        self.dir.join("server.pem")
    }

    /// The listeners' private key (PKCS#8 PEM).
    pub fn server_key(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    /// The client certificate (PEM, CN `idem-client`).
    pub fn client_cert(&self) -> PathBuf {
        self.dir.join("client.pem")
    }

    /// The client certificate's private key (PKCS#8 PEM).
    pub fn client_key(&self) -> PathBuf {
        self.dir.join("client.key")
    }

    /// The contents of a file of the PKI.
    ///
    /// # Panics
    /// When it cannot be read (the PKI was checked by [`require`](Self::require)).
    pub fn read(&self, path: &Path) -> Vec<u8> {
        std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
    }
}
