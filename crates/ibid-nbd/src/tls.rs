//! TLS for `NBD_OPT_STARTTLS`: X.509 server certificates with rustls (ring provider), or
//! pre-shared keys with OpenSSL.
//!
//! PSK goes through OpenSSL because rustls has no external pre-shared-key support. The keys
//! file is the one qemu (`tls-creds-psk`: `DIR/keys.psk`), nbdkit (`--tls-psk`) and libnbd
//! (`tls-psk-file`) read, as GnuTLS's `psktool` writes it: one `identity:hexkey` per line.
//! TLS 1.3 (external PSK with ephemeral key exchange) and TLS 1.2 (`ECDHE-PSK`, `PSK`
//! suites) are offered.

use crate::BoxStream;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

/// The server's TLS credentials, and whether TLS is mandatory.
#[derive(Debug, Clone)]
pub struct TlsConfig {
    /// Certificates or pre-shared keys.
    pub credentials: TlsCredentials,
    /// FORCEDTLS mode: every option except `STARTTLS` and `ABORT` is refused with
    /// `NBD_REP_ERR_TLS_REQD` until TLS is up. Otherwise TLS is offered, not required.
    pub required: bool,
}

/// How the server proves itself (and, optionally, checks clients).
#[derive(Debug, Clone)]
pub enum TlsCredentials {
    /// An X.509 certificate (rustls).
    X509 {
        /// PEM file with the server certificate chain (leaf first).
        cert_chain_pem: PathBuf,
        /// PEM file with the server's private key (PKCS#8, PKCS#1 or SEC1).
        private_key_pem: PathBuf,
        /// PEM file of CA certificates; when set, clients must present a certificate it
        /// signed.
        client_ca_pem: Option<PathBuf>,
    },
    /// Pre-shared keys (OpenSSL): a client must know the key of an identity in the file.
    Psk {
        /// `identity:hexkey` lines (GnuTLS `psktool` format).
        keys_file: PathBuf,
    },
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
    /// The PSK keys file could not be read.
    #[error("read PSK keys file {path}: {source}")]
    PskRead {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A line of the PSK keys file is not `identity:hexkey`.
    #[error("PSK keys file {path}, line {line}: {reason}")]
    PskFormat {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// OpenSSL refused the PSK configuration.
    #[error("build TLS-PSK configuration: {0}")]
    OpenSsl(String),
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

/// Accepts TLS on a connection that asked for `STARTTLS`.
#[derive(Clone)]
pub(crate) enum Acceptor {
    X509(tokio_rustls::TlsAcceptor),
    Psk(Arc<openssl::ssl::SslContext>),
}

impl Acceptor {
    /// Runs the server side of the TLS handshake over `stream`.
    pub(crate) async fn accept(&self, stream: BoxStream) -> std::io::Result<BoxStream> {
        match self {
            Acceptor::X509(a) => Ok(Box::new(a.accept(stream).await?)),
            Acceptor::Psk(ctx) => {
                let ssl = openssl::ssl::Ssl::new(ctx).map_err(std::io::Error::other)?;
                let mut tls =
                    tokio_openssl::SslStream::new(ssl, stream).map_err(std::io::Error::other)?;
                std::pin::Pin::new(&mut tls)
                    .accept()
                    .await
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::PermissionDenied, e))?;
                Ok(Box::new(tls))
            }
        }
    }
}

impl TlsConfig {
    /// Loads the files and builds the acceptor.
    pub(crate) fn acceptor(&self) -> Result<Acceptor, TlsConfigError> {
        match &self.credentials {
            TlsCredentials::X509 {
                cert_chain_pem,
                private_key_pem,
                client_ca_pem,
            } => x509_acceptor(cert_chain_pem, private_key_pem, client_ca_pem.as_deref())
                .map(Acceptor::X509),
            TlsCredentials::Psk { keys_file } => {
                psk_context(load_psk_keys(keys_file)?).map(|c| Acceptor::Psk(Arc::new(c)))
            }
        }
    }

    /// Checks that the files load (for a front end that wants to fail before it listens).
    pub fn validate(&self) -> Result<(), TlsConfigError> {
        self.acceptor().map(|_| ())
    }
}

fn x509_acceptor(
    cert_chain_pem: &Path,
    private_key_pem: &Path,
    client_ca_pem: Option<&Path>,
) -> Result<tokio_rustls::TlsAcceptor, TlsConfigError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs = load_certs(cert_chain_pem)?;
    let key = PrivateKeyDer::from_pem_file(private_key_pem).map_err(pem_err(private_key_pem))?;
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsConfigError::Rustls(e.to_string()))?;
    let builder = match client_ca_pem {
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

/// Longest PSK identity accepted (the TLS limit is 2^16 - 1; GnuTLS and OpenSSL use less).
const PSK_IDENTITY_MAX: usize = 128;
/// Longest key accepted, in bytes (OpenSSL's `PSK_MAX_PSK_LEN`).
const PSK_KEY_MAX: usize = 256;

/// Parses a PSK keys file: `identity:hexkey` per line; blank lines are skipped.
pub(crate) fn parse_psk_keys(text: &str) -> Result<HashMap<Vec<u8>, Vec<u8>>, (usize, String)> {
    let mut keys = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.trim().is_empty() {
            continue;
        }
        let fail = |reason: &str| (i + 1, reason.to_string());
        let (identity, hex) = line
            .rsplit_once(':')
            .ok_or_else(|| fail("expected identity:hexkey"))?;
        if identity.is_empty() || identity.len() > PSK_IDENTITY_MAX {
            return Err(fail(&format!(
                "identity must be 1 to {PSK_IDENTITY_MAX} bytes"
            )));
        }
        if hex.is_empty() || hex.len() % 2 != 0 || hex.len() / 2 > PSK_KEY_MAX {
            return Err(fail(&format!(
                "key must be an even number of hex digits, at most {PSK_KEY_MAX} bytes"
            )));
        }
        let key = (0..hex.len())
            .step_by(2)
            .map(|j| u8::from_str_radix(&hex[j..j + 2], 16))
            .collect::<Result<Vec<u8>, _>>()
            .map_err(|_| fail("key is not hexadecimal"))?;
        if keys.insert(identity.as_bytes().to_vec(), key).is_some() {
            return Err(fail(&format!("identity {identity:?} appears twice")));
        }
    }
    if keys.is_empty() {
        return Err((0, "no keys".into()));
    }
    Ok(keys)
}

fn load_psk_keys(path: &Path) -> Result<HashMap<Vec<u8>, Vec<u8>>, TlsConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| TlsConfigError::PskRead {
        path: path.to_path_buf(),
        source,
    })?;
    parse_psk_keys(&text).map_err(|(line, reason)| TlsConfigError::PskFormat {
        path: path.to_path_buf(),
        line,
        reason,
    })
}

fn psk_context(
    keys: HashMap<Vec<u8>, Vec<u8>>,
) -> Result<openssl::ssl::SslContext, TlsConfigError> {
    use openssl::ssl::{SslContextBuilder, SslMethod, SslVersion};
    let err = |e: openssl::error::ErrorStack| TlsConfigError::OpenSsl(e.to_string());
    let mut b = SslContextBuilder::new(SslMethod::tls_server()).map_err(err)?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(err)?;
    // TLS 1.2: PSK suites only (no certificate to offer); TLS 1.3 uses its default suites.
    b.set_cipher_list("ECDHE-PSK:PSK:!kRSAPSK:!kDHEPSK:!eNULL:!aNULL")
        .map_err(err)?;
    b.set_psk_server_callback(move |_ssl, identity, out| {
        // An unknown identity gets no key: the handshake fails.
        match identity.and_then(|id| keys.get(id)) {
            Some(key) if key.len() <= out.len() => {
                out[..key.len()].copy_from_slice(key);
                Ok(key.len())
            }
            _ => Ok(0),
        }
    });
    Ok(b.build())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_keys_parse_and_bad_lines_are_named() {
        let keys = parse_psk_keys("alice:0a0B\n\nbob:ff00ff\r\n").expect("parse");
        assert_eq!(keys[b"alice".as_slice()], vec![0x0a, 0x0b]);
        assert_eq!(keys[b"bob".as_slice()], vec![0xff, 0x00, 0xff]);
        // An identity may contain ':'; the key is after the last one.
        assert_eq!(
            parse_psk_keys("a:b:01").expect("parse")[b"a:b".as_slice()],
            vec![1]
        );
        for (text, line) in [
            ("alice", 1),
            ("alice:0g", 1),
            ("alice:abc", 1),
            (":00", 1),
            ("a:00\nb:", 2),
            ("a:00\na:01", 2),
            ("", 0),
        ] {
            assert_eq!(
                parse_psk_keys(text).map(|_| ()).expect_err("must fail").0,
                line,
                "{text:?}"
            );
        }
    }
}
