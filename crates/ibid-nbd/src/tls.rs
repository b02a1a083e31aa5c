//! TLS for `NBD_OPT_STARTTLS`: X.509 server certificates with rustls (ring provider).
//!
//! PSK is not offered: rustls has no external pre-shared-key support, so clients configured
//! with `tls-creds-psk` (qemu) or `tls-psk-file` (libnbd) cannot connect.

use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

/// Where the server's TLS material lives, and whether TLS is mandatory.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// PEM file with the server certificate chain (leaf first).
    pub cert_chain_pem: PathBuf,
    /// PEM file with the server's private key (PKCS#8, PKCS#1 or SEC1).
    pub private_key_pem: PathBuf,
    /// PEM file of CA certificates; when set, clients must present a certificate it signed.
    pub client_ca_pem: Option<PathBuf>,
    /// FORCEDTLS mode: every option except `STARTTLS` and `ABORT` is refused with
    /// `NBD_REP_ERR_TLS_REQD` until TLS is up. Otherwise TLS is offered, not required.
    pub required: bool,
}

/// Why the TLS configuration could not be loaded.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TlsConfigError {
    /// A PEM file could not be read or parsed.
    #[error("read PEM file {path}: {source}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: rustls_pki_types::pem::Error,
    },
    /// rustls refused the certificate, key or CA.
    #[error("build TLS configuration: {0}")]
    Rustls(String),
}

fn pem_err(path: &Path) -> impl FnOnce(rustls_pki_types::pem::Error) -> TlsConfigError + '_ {
    move |source| TlsConfigError::Pem {
        path: path.to_path_buf(),
        source,
    }
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    CertificateDer::pem_file_iter(path)
        .map_err(pem_err(path))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_err(path))
}

impl TlsConfig {
    /// Loads the files and builds the rustls acceptor.
    pub fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, TlsConfigError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certs = load_certs(&self.cert_chain_pem)?;
        let key = PrivateKeyDer::from_pem_file(&self.private_key_pem)
            .map_err(pem_err(&self.private_key_pem))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsConfigError::Rustls(e.to_string()))?;
        let builder = match &self.client_ca_pem {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in load_certs(ca)? {
                    roots
                        .add(cert)
                        .map_err(|e| TlsConfigError::Rustls(e.to_string()))?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .build()
                    .map_err(|e| TlsConfigError::Rustls(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let config = builder
            .with_single_cert(certs, key)
            .map_err(|e| TlsConfigError::Rustls(e.to_string()))?;
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}
