//! Dialing: the servers in turn (and those a cluster announces), TLS
//! (first, or after INFO), the handshake with the configured
//! authentication (user and password, token, or a `.creds` file's JWT and
//! nonce signature), and the link it opens.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::ServerAddr;
use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use super::error::LinkError;
use super::handle::Link;
use super::queues::{InfoUpdate, Shared};
use super::reader::{next_op, Op, Reader};
use super::writer::Writer;
use crate::nats::NatsArgs;

/// How long one server may take to accept and finish the handshake.
pub(super) const DIAL_TIMEOUT: Duration = Duration::from_secs(5);

/// How the link authenticates: what `--nats-user`/`--nats-token`/
/// `--nats-creds` say (validated to be at most one).
#[derive(Clone)]
pub(super) enum Auth {
    None,
    UserPass(String, String),
    Token(String),
    /// A user JWT and the seed that signs the server's nonce.
    Creds {
        jwt: String,
        seed: String,
    },
}

/// Opens links to the configured servers, in turn, plus the servers a
/// cluster announces.
pub struct Dialer {
    pub(super) servers: Vec<ServerAddr>,
    /// The server to try first: the one after the last that failed.
    pub(super) next: usize,
    pub(super) auth: Auth,
    /// Built when a server first needs it.
    pub(super) tls: Option<Arc<rustls::ClientConfig>>,
    /// For the TLS files.
    pub(super) args: NatsArgs,
    /// TLS even where neither the URL nor the server asks for it.
    pub(super) require_tls: bool,
    /// TLS before the server's INFO (`handshake_first` servers).
    pub(super) tls_first: bool,
    pub(super) name: String,
    /// Servers the links' later INFOs announced, learned at the next dial.
    pub(super) announced: Arc<Mutex<Vec<String>>>,
}

impl Dialer {
    /// From settings that passed [`NatsArgs::validate`]; the files they
    /// name are read here.
    pub fn new(args: &NatsArgs, name: String) -> Result<Self, LinkError> {
        let servers = args
            .servers()
            .map_err(|e| LinkError::Config(e.to_string()))?;
        let auth = match (&args.nats_user, &args.nats_password, &args.nats_token) {
            (Some(u), Some(p), _) => Auth::UserPass(u.clone(), p.clone()),
            (_, _, Some(t)) => Auth::Token(t.clone()),
            _ => match &args.nats_creds {
                Some(path) => {
                    let text = std::fs::read_to_string(path).map_err(|e| {
                        LinkError::Config(format!("--nats-creds {}: {e}", path.display()))
                    })?;
                    let (jwt, seed) = parse_creds(&text).ok_or_else(|| {
                        LinkError::Config(format!(
                            "--nats-creds {}: no user JWT and seed in it",
                            path.display()
                        ))
                    })?;
                    Auth::Creds { jwt, seed }
                }
                None => Auth::None,
            },
        };
        Ok(Self {
            servers,
            next: 0,
            auth,
            tls: None,
            args: args.clone(),
            require_tls: args.nats_tls || args.nats_ca.is_some() || args.nats_tls_first,
            tls_first: args.nats_tls_first,
            name,
            announced: Arc::default(),
        })
    }

    /// The servers it dials, `host:port` each (no credentials).
    pub fn servers(&self) -> String {
        self.servers
            .iter()
            .map(where_)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A link to the first server that takes one, trying each once.
    pub async fn dial(&mut self) -> Result<Link, LinkError> {
        let announced = self
            .announced
            .lock()
            .map(|mut a| std::mem::take(&mut *a))
            .unwrap_or_default();
        self.learn(&announced);
        let mut last = None;
        for _ in 0..self.servers.len() {
            let i = self.next % self.servers.len();
            let addr = self.servers[i].clone();
            match tokio::time::timeout(DIAL_TIMEOUT, self.dial_one(&addr)).await {
                Ok(Ok((link, info))) => {
                    self.learn(&info.connect_urls);
                    // The next dial (this link broke or went silent) tries
                    // another server first.
                    self.next = i + 1;
                    return Ok(link);
                }
                Ok(Err(e)) => last = Some(e),
                Err(_) => {
                    last = Some(LinkError::TimedOut {
                        server: where_(&addr),
                        after: DIAL_TIMEOUT,
                    })
                }
            }
            self.next = i + 1;
        }
        Err(last.unwrap_or(LinkError::Config("no NATS server to dial".into())))
    }

    /// Servers a cluster announces (INFO `connect_urls`) join the list, as
    /// the async-nats client adds them: a relay given one URL of a cluster
    /// still finds the others when that one dies.
    pub(super) fn learn(&mut self, urls: &[String]) {
        let scheme = if self.require_tls { "tls" } else { "nats" };
        for url in urls {
            let Ok(addr) = format!("{scheme}://{url}").parse::<ServerAddr>() else {
                continue;
            };
            if !self
                .servers
                .iter()
                .any(|s| s.host() == addr.host() && s.port() == addr.port())
            {
                self.servers.push(addr);
            }
        }
    }

    pub(super) async fn dial_one(
        &mut self,
        addr: &ServerAddr,
    ) -> Result<(Link, async_nats::ServerInfo), LinkError> {
        let server = where_(addr);
        let io = |source| LinkError::Io {
            server: server.clone(),
            source,
        };
        let mut tcp = tokio::net::TcpStream::connect((addr.host(), addr.port()))
            .await
            .map_err(io)?;
        tcp.set_nodelay(true).map_err(io)?;
        // Dropped, the link resets the connection: bytes it could not send
        // are discarded, never delivered minutes later (after a partition)
        // behind what a newer link sent.
        tcp.set_zero_linger().map_err(io)?;
        let mut rbuf = BytesMut::with_capacity(64 * 1024);
        let prefix = format!("_INBOX.{}.", uuid::Uuid::new_v4().simple());
        let (info, max_payload, reader, writer): (_, _, Reader, Writer) = if self.tls_first {
            // The server waits for our TLS handshake before its INFO.
            let mut tls = self.tls_connect(addr, tcp, &server).await?;
            let info = read_info(&mut tls, &mut rbuf, &server).await?;
            let hello = self.hello(&info, addr, &prefix, &server)?;
            let max_payload = greet(&mut tls, &mut rbuf, &hello, &server).await?;
            let (r, w) = tokio::io::split(tls);
            (info, max_payload, Box::new(r), Box::new(w))
        } else {
            let info = read_info(&mut tcp, &mut rbuf, &server).await?;
            let hello = self.hello(&info, addr, &prefix, &server)?;
            // Nothing follows INFO until the client speaks, so no byte of a
            // TLS stream can sit in `rbuf` yet.
            if self.require_tls || addr.tls_required() || info.tls_required {
                let mut tls = self.tls_connect(addr, tcp, &server).await?;
                let max_payload = greet(&mut tls, &mut rbuf, &hello, &server).await?;
                let (r, w) = tokio::io::split(tls);
                (info, max_payload, Box::new(r), Box::new(w))
            } else {
                let max_payload = greet(&mut tcp, &mut rbuf, &hello, &server).await?;
                let (r, w) = tcp.into_split();
                (info, max_payload, Box::new(r), Box::new(w))
            }
        };
        let link = Link::start(
            Shared::new(
                max_payload.unwrap_or(info.max_payload),
                self.announced.clone(),
            ),
            (reader, rbuf),
            writer,
            prefix,
            server,
        );
        Ok((link, info))
    }

    /// CONNECT, the ack subscription and two PINGs: the server sends the
    /// INFO that carries the account's or user's limits right after its
    /// first PONG, so it has come by the second.
    pub(super) fn hello(
        &self,
        info: &async_nats::ServerInfo,
        addr: &ServerAddr,
        prefix: &str,
        server: &str,
    ) -> Result<Vec<u8>, LinkError> {
        let mut hello = b"CONNECT ".to_vec();
        let connect = self.connect_info(info, addr)?;
        serde_json::to_writer(&mut hello, &connect).map_err(|e| LinkError::Handshake {
            server: server.to_owned(),
            message: format!("CONNECT: {e}"),
        })?;
        hello.extend_from_slice(format!("\r\nSUB {prefix}* 1\r\nPING\r\nPING\r\n").as_bytes());
        Ok(hello)
    }

    pub(super) async fn tls_connect(
        &mut self,
        addr: &ServerAddr,
        tcp: tokio::net::TcpStream,
        server: &str,
    ) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, LinkError> {
        let config = match &self.tls {
            Some(c) => c.clone(),
            None => {
                let c = Arc::new(tls_config(&self.args)?);
                self.tls = Some(c.clone());
                c
            }
        };
        let name =
            rustls::pki_types::ServerName::try_from(addr.host().to_owned()).map_err(|e| {
                LinkError::Handshake {
                    server: server.to_owned(),
                    message: format!("not a TLS server name: {e}"),
                }
            })?;
        tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|e| LinkError::Handshake {
                server: server.to_owned(),
                message: format!("TLS: {e}"),
            })
    }

    pub(super) fn connect_info(
        &self,
        info: &async_nats::ServerInfo,
        addr: &ServerAddr,
    ) -> Result<async_nats::ConnectInfo, LinkError> {
        let mut c = async_nats::ConnectInfo {
            verbose: false,
            pedantic: false,
            user_jwt: None,
            nkey: None,
            signature: None,
            name: Some(self.name.clone()),
            echo: false,
            lang: "rust".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            protocol: async_nats::Protocol::Dynamic,
            tls_required: self.require_tls || addr.tls_required(),
            user: None,
            pass: None,
            auth_token: None,
            headers: true,
            no_responders: true,
        };
        match &self.auth {
            Auth::None => {}
            Auth::UserPass(u, p) => {
                c.user = Some(u.clone());
                c.pass = Some(p.clone());
            }
            Auth::Token(t) => c.auth_token = Some(t.clone()),
            Auth::Creds { jwt, seed } => {
                c.user_jwt = Some(jwt.clone());
                c.signature = Some(sign_nonce(seed, &info.nonce).ok_or_else(|| {
                    LinkError::Config("--nats-creds: the seed in the file does not sign".into())
                })?);
            }
        }
        Ok(c)
    }
}

/// `host:port`, never a URL's credentials.
pub(super) fn where_(addr: &ServerAddr) -> String {
    format!("{}:{}", addr.host(), addr.port())
}

/// The server's root certificates and our client certificate.
pub(super) fn tls_config(args: &NatsArgs) -> Result<rustls::ClientConfig, LinkError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    match &args.nats_ca {
        Some(ca) => {
            for cert in CertificateDer::pem_file_iter(ca)
                .map_err(|e| LinkError::Config(format!("--nats-ca {}: {e}", ca.display())))?
            {
                let cert = cert
                    .map_err(|e| LinkError::Config(format!("--nats-ca {}: {e}", ca.display())))?;
                roots
                    .add(cert)
                    .map_err(|e| LinkError::Config(format!("--nats-ca {}: {e}", ca.display())))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(native.certs);
        }
    }
    let builder = rustls::ClientConfig::builder().with_root_certificates(roots);
    match (&args.nats_tls_cert, &args.nats_tls_key) {
        (Some(cert), Some(key)) => {
            let certs = CertificateDer::pem_file_iter(cert)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|e| {
                    LinkError::Config(format!("--nats-tls-cert {}: {e}", cert.display()))
                })?;
            let key = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| LinkError::Config(format!("--nats-tls-key {}: {e}", key.display())))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| LinkError::Config(format!("--nats-tls-cert/--nats-tls-key: {e}")))
        }
        _ => Ok(builder.with_no_client_auth()),
    }
}

/// The user JWT and nkey seed of a `.creds` file: each is the first
/// non-empty line after its `BEGIN` marker.
pub(super) fn parse_creds(text: &str) -> Option<(String, String)> {
    let after = |marker: &str| {
        let mut lines = text.lines().map(str::trim);
        lines.find(|l| l.contains("BEGIN") && l.contains(marker))?;
        lines.find(|l| !l.is_empty()).map(str::to_owned)
    };
    Some((after("JWT")?, after("SEED")?))
}

/// The server's nonce signed by the seed, base64url without padding.
pub(super) fn sign_nonce(seed: &str, nonce: &str) -> Option<String> {
    use base64::Engine as _;
    let key = nkeys::KeyPair::from_seed(seed).ok()?;
    let sig = key.sign(nonce.as_bytes()).ok()?;
    Some(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sig))
}

/// The server's first INFO.
pub(super) async fn read_info<S: AsyncRead + Unpin>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    server: &str,
) -> Result<async_nats::ServerInfo, LinkError> {
    match next_op(stream, rbuf).await? {
        Op::Info(json) => serde_json::from_slice(&json).map_err(|e| LinkError::Handshake {
            server: server.to_owned(),
            message: format!("unreadable INFO: {e}"),
        }),
        other => Err(LinkError::Handshake {
            server: server.to_owned(),
            message: format!("expected INFO, got {}", other.name()),
        }),
    }
}

/// CONNECT, the ack subscription and two PINGs; the PONGs say the server
/// took them (an authentication failure answers `-ERR` instead). Returns
/// the `max_payload` of an INFO that came meanwhile (the account's or
/// user's).
pub(super) async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    hello: &[u8],
    server: &str,
) -> Result<Option<usize>, LinkError> {
    let io = |source| LinkError::Io {
        server: server.to_owned(),
        source,
    };
    stream.write_all(hello).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let (mut pongs, mut max_payload) = (0, None);
    loop {
        match next_op(stream, rbuf).await? {
            Op::Pong if pongs == 1 => return Ok(max_payload),
            Op::Pong => pongs += 1,
            Op::Info(json) => max_payload = InfoUpdate::read(&json).max_payload.or(max_payload),
            Op::Err(text) => {
                return Err(LinkError::Refused {
                    server: server.to_owned(),
                    message: text,
                })
            }
            // `+OK`, a newer INFO, a PING before our PONG.
            _ => {}
        }
    }
}
