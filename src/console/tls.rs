//! The console over TLS, and client certificates (SPEC §16 "mTLS"):
//! `--admin-tls-cert`/`--admin-tls-key` serve HTTPS; `--admin-client-ca`
//! makes every connection present a certificate that CA signed (the
//! handshake refuses one without). A request without a bearer token is
//! then its certificate's: the subject's common name (`cert:<CN>` in the
//! log) with the role its organization or organizational unit values give
//! (`--admin-cert-role`, as `--oidc-role`). A bearer token, when sent,
//! decides as it does without TLS.
//!
//! Handshakes run each in a task of their own, bounded in time: one slow
//! client's handshake does not hold the others' (axum accepts one
//! connection at a time).

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use super::tokens::{Role, Token};
use crate::error::{Error, Result};
use crate::ops::listener::{Counted, Limited};

/// A handshake that takes longer is dropped.
const HANDSHAKE_TIME: Duration = Duration::from_secs(10);

/// What `outbox-relay console` is told (`--admin-tls-*`).
#[derive(Debug, Clone)]
pub struct Config {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Client certificates are required, signed by this CA.
    pub client_ca: Option<PathBuf>,
    /// A subject O or OU value and the role it gives; empty: the values
    /// `viewer`, `operator`, `admin` themselves.
    pub roles: Vec<(String, Role)>,
}

impl Config {
    /// The server's TLS configuration: its chain and key, and the client
    /// verifier when a CA is given. A file that cannot be read or used is
    /// one line naming it.
    pub fn server_config(&self) -> Result<Arc<rustls::ServerConfig>> {
        let bad = |flag: &str, path: &PathBuf, e: String| {
            Error::Config(format!("{flag} {}: {e}", path.display()))
        };
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.cert)
            .map_err(|e| bad("--admin-tls-cert", &self.cert, e.to_string()))?
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| bad("--admin-tls-cert", &self.cert, e.to_string()))?;
        if chain.is_empty() {
            return Err(bad(
                "--admin-tls-cert",
                &self.cert,
                "holds no certificate".into(),
            ));
        }
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|e| bad("--admin-tls-key", &self.key, e.to_string()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Config(format!("console TLS: {e}")))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_file_iter(ca)
                    .map_err(|e| bad("--admin-client-ca", ca, e.to_string()))?
                {
                    let cert = cert.map_err(|e| bad("--admin-client-ca", ca, e.to_string()))?;
                    roots
                        .add(cert)
                        .map_err(|e| bad("--admin-client-ca", ca, e.to_string()))?;
                }
                if roots.is_empty() {
                    return Err(bad("--admin-client-ca", ca, "holds no certificate".into()));
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|e| bad("--admin-client-ca", ca, e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| bad("--admin-tls-key", &self.key, e.to_string()))?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// A connection's peer: its address, and its client certificate's
/// subject when it presented one (the handshake verified it).
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    pub subject: Option<Subject>,
}

/// What the console reads of a client certificate's subject.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Subject {
    pub common_name: String,
    /// Its O and OU values.
    pub groups: Vec<String>,
}

impl Subject {
    /// The subject of a DER certificate; `None` when it has no common
    /// name (nothing to name it by in the log).
    pub fn of(der: &[u8]) -> Option<Subject> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let subject = cert.subject();
        let common_name = subject
            .iter_common_name()
            .find_map(|a| a.as_str().ok())?
            .to_owned();
        if common_name.is_empty()
            || common_name.len() > 255
            || common_name.chars().any(char::is_control)
        {
            return None;
        }
        let groups = subject
            .iter_organization()
            .chain(subject.iter_organizational_unit())
            .filter_map(|a| a.as_str().ok())
            .map(str::to_owned)
            .collect();
        Some(Subject {
            common_name,
            groups,
        })
    }

    /// The token the certificate stands for, or why none.
    pub fn token(&self, roles: &[(String, Role)]) -> std::result::Result<Token, String> {
        let role = self
            .groups
            .iter()
            .filter_map(|g| {
                if roles.is_empty() {
                    Role::parse(g)
                } else {
                    roles.iter().find(|(v, _)| v == g).map(|(_, r)| *r)
                }
            })
            .max()
            .ok_or_else(|| {
                format!(
                    "no token, and the client certificate of {} gives no console role (its O and OU: {:?}; --admin-cert-role maps a value to a role)",
                    self.common_name, self.groups
                )
            })?;
        Ok(Token {
            name: self.common_name.clone(),
            role,
            created_at: String::new(),
            created_by: "client certificate".into(),
            expires_at: String::new(),
            revoked_at: None,
            state: "active",
            kind: "cert",
        })
    }
}

/// TCP connections from [`Limited`], each made TLS by a task of its own;
/// axum takes the finished ones.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<Counted>, Peer)>,
    local: SocketAddr,
}

impl TlsListener {
    pub fn new(mut inner: Limited, config: Arc<rustls::ServerConfig>) -> io::Result<Self> {
        use axum::serve::Listener;
        let local = inner.local_addr()?;
        let (tx, ready) = mpsc::channel(16);
        let acceptor = TlsAcceptor::from(config);
        tokio::spawn(async move {
            loop {
                let (io, addr) = tokio::select! {
                    c = inner.accept() => c,
                    // axum is gone: stop accepting.
                    () = tx.closed() => return,
                };
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIME, acceptor.accept(io)).await {
                        Ok(Ok(tls)) => {
                            let subject = tls
                                .get_ref()
                                .1
                                .peer_certificates()
                                .and_then(|chain| chain.first())
                                .and_then(|leaf| Subject::of(leaf.as_ref()));
                            let _ = tx.send((tls, Peer { addr, subject })).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%addr, error = %e, "console: TLS handshake refused")
                        }
                        Err(_) => tracing::debug!(%addr, "console: TLS handshake too slow"),
                    }
                });
            }
        });
        Ok(TlsListener { ready, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<Counted>;
    type Addr = Peer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(conn) => conn,
            // The accepting task never ends while this lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Peer> {
        Ok(Peer {
            addr: self.local,
            subject: None,
        })
    }
}

impl Connected<IncomingStream<'_, TlsListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        stream.remote_addr().clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subject_gives_the_highest_role_its_groups_map_to() {
        let s = Subject {
            common_name: "ci-runner".into(),
            groups: vec!["Acme".into(), "operator".into(), "viewer".into()],
        };
        let t = s.token(&[]).unwrap();
        assert_eq!(
            (t.role, t.actor().as_str()),
            (Role::Operator, "cert:ci-runner")
        );
        let mapped = vec![("platform".to_owned(), Role::Admin)];
        assert!(
            s.token(&mapped).is_err(),
            "mapped: the bare names give nothing"
        );
        let s = Subject {
            common_name: "ops".into(),
            groups: vec!["platform".into()],
        };
        assert_eq!(s.token(&mapped).unwrap().role, Role::Admin);
    }

    #[test]
    fn unreadable_files_are_named() {
        let c = Config {
            cert: "/nonexistent/cert.pem".into(),
            key: "/nonexistent/key.pem".into(),
            client_ca: None,
            roles: Vec::new(),
        };
        let e = c.server_config().unwrap_err().to_string();
        assert!(e.contains("--admin-tls-cert /nonexistent/cert.pem"), "{e}");
    }
}
