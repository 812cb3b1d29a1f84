//! Outbound TLS: which servers Baton trusts when it calls an agent, fetches
//! a card or posts a push notification over `https`. Baton trusts the public
//! web PKI (Mozilla's roots, built into the binary, so a container without a
//! CA bundle still verifies) and any extra roots the operator names with
//! `--tls-ca`, such as a private CA. Certificates are always verified.

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// A CA file that cannot serve as roots.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("cannot read the TLS CA file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds no PEM certificate, or one that does not parse.
    #[error("the TLS CA file {path} {problem}")]
    Certificates {
        /// The file.
        path: PathBuf,
        /// What is wrong, as a predicate.
        problem: String,
    },
}

/// The TLS settings shared by every outbound client of one Baton.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
    extra_roots: usize,
}

impl ClientTls {
    /// Trusts the web PKI and the PEM certificates in `path` besides.
    pub fn with_ca_file(path: &Path) -> Result<Self, TlsError> {
        let pem = std::fs::read(path).map_err(|source| TlsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::with_ca_pem(&pem).map_err(|problem| TlsError::Certificates {
            path: path.to_path_buf(),
            problem,
        })
    }

    /// Trusts the web PKI and the PEM certificates in `pem` besides; the
    /// error says what is wrong with them.
    pub fn with_ca_pem(pem: &[u8]) -> Result<Self, String> {
        let (roots, extra_roots) = roots_with(pem)?;
        Ok(Self {
            config: Arc::new(config_with(roots)),
            extra_roots,
        })
    }

    /// The rustls configuration, for a connector.
    pub fn config(&self) -> Arc<rustls::ClientConfig> {
        self.config.clone()
    }

    /// `builder`, verifying servers with these roots.
    pub fn apply(&self, builder: reqwest::ClientBuilder) -> reqwest::ClientBuilder {
        builder.use_preconfigured_tls(rustls::ClientConfig::clone(&self.config))
    }
}

impl Default for ClientTls {
    /// The web PKI alone, built once per process.
    fn default() -> Self {
        static WEB_PKI: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();
        let config = WEB_PKI
            .get_or_init(|| Arc::new(config_with(web_pki_roots())))
            .clone();
        Self {
            config,
            extra_roots: 0,
        }
    }
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("extra_roots", &self.extra_roots)
            .finish()
    }
}

/// The web PKI's roots and the PEM certificates in `pem`, and how many
/// those were.
fn roots_with(pem: &[u8]) -> Result<(rustls::RootCertStore, usize), String> {
    let extra = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| format!("holds a PEM block that does not parse: {err}"))?;
    if extra.is_empty() {
        return Err("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into());
    }
    let count = extra.len();
    let mut roots = web_pki_roots();
    for certificate in extra {
        roots
            .add(certificate)
            .map_err(|err| format!("holds a certificate that is not a usable root: {err}"))?;
    }
    Ok((roots, count))
}

fn web_pki_roots() -> rustls::RootCertStore {
    rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    }
}

/// TLS 1.2 and 1.3 with ring's safe defaults, verifying against `roots`.
fn config_with(roots: rustls::RootCertStore) -> rustls::ClientConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots)
        .with_no_client_auth()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca_pem() -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.self_signed(&key).unwrap().pem()
    }

    #[test]
    fn extra_roots_join_the_web_pki() {
        let tls = ClientTls::with_ca_pem(ca_pem().as_bytes()).unwrap();
        assert_eq!(tls.extra_roots, 1);
        let web_pki = webpki_roots::TLS_SERVER_ROOTS.len();
        assert_eq!(ClientTls::default().extra_roots, 0);
        assert!(web_pki > 100, "Mozilla's roots are built in");
        let (roots, _) = roots_with(ca_pem().as_bytes()).unwrap();
        assert_eq!(roots.len(), web_pki + 1, "the web PKI and the CA");
    }

    #[test]
    fn a_ca_file_without_certificates_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let err = ClientTls::with_ca_file(&empty).unwrap_err().to_string();
        assert!(err.contains("empty.pem"), "{err}");
        assert!(err.contains("holds no PEM certificate"), "{err}");

        let missing = dir.path().join("missing.pem");
        let err = ClientTls::with_ca_file(&missing).unwrap_err().to_string();
        assert!(err.starts_with("cannot read the TLS CA file"), "{err}");

        let torn = dir.path().join("torn.pem");
        let pem = ca_pem();
        std::fs::write(&torn, &pem[..pem.len() / 2]).unwrap();
        let err = ClientTls::with_ca_file(&torn).unwrap_err().to_string();
        assert!(err.contains("torn.pem"), "{err}");
    }
}
