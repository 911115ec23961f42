//! The per-event publisher's own NATS connection: `HPUB` out, acks in.
//!
//! Through async-nats every event cost a header map (a hash map of owned
//! names and values, built and dropped per message), a command on the
//! client's channel and a subscription hand-off for its ack. Measured by
//! `scripts/bench.sh publish-paths` on this project's box, that path costs
//! 3.45-3.70 µs of client CPU per message flat out against 1.85-1.95 for a
//! writer that puts the header block straight into its output buffer and
//! reads the acks off the socket (docs/guide/benchmarks.md). So the hot path
//! has its own connection; everything else (stream set-up, tail scans,
//! batches' commits) stays on the async-nats client.
//!
//! The link does as little as a publisher needs: the handshake (INFO,
//! optional TLS, CONNECT with the configured authentication, one wildcard
//! `SUB` for the acks, PING/PONG), `HPUB`, and reading `MSG`/`HMSG` answers.
//! It does not reconnect: a link that breaks answers nothing more, and the
//! publisher, which treats silence and a broken link as an outage, dials a
//! new one when it sends again ([`Dialer`]).
//!
//! Two small tasks serve a link. The writer writes what [`Link::publish`]
//! appended to a buffer; on the relay's one-thread runtime it runs when
//! the session has nothing left to do, so a transaction's events leave in
//! one write. The reader parses answers into a queue the session takes
//! them from, and answers the server's PINGs, busy or idle.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::{ServerAddr, StatusCode};
use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::answer::{self, Answer, CommitAnswer};
use crate::nats::NatsArgs;

/// How a message is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    /// Not at all: a batch's message before its commit (the server answers
    /// only the commit).
    None,
    /// A per-event publish: its ack, under this token.
    Ack(u64),
    /// A batch's commit: the batch's ack, under this token.
    Commit(u64),
}

/// A commit's reply subject is `<inbox>.c<token>`, an ack's `<inbox>.<token>`.
const COMMIT: u8 = b'c';

/// How long one server may take to accept and finish the handshake.
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// A control line (INFO lists a cluster's URLs) longer than this is not
/// NATS.
const MAX_LINE: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("{server}: {source}")]
    Io {
        server: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{server}: {message}")]
    Handshake { server: String, message: String },
    #[error("the connection closed")]
    Closed,
    #[error("the publish connection ended: {0}")]
    Ended(String),
    #[error("the server broke the protocol: {0}")]
    Protocol(String),
    #[error("{0}")]
    Config(String),
}

/// How the link authenticates: what `--nats-user`/`--nats-token`/
/// `--nats-creds` say (validated to be at most one).
#[derive(Clone)]
enum Auth {
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
    servers: Vec<ServerAddr>,
    /// The server to try first: the one after the last that failed.
    next: usize,
    auth: Auth,
    /// Built when a server first needs it.
    tls: Option<Arc<rustls::ClientConfig>>,
    /// For the TLS files.
    args: NatsArgs,
    /// TLS even where neither the URL nor the server asks for it.
    require_tls: bool,
    /// TLS before the server's INFO (`handshake_first` servers).
    tls_first: bool,
    name: String,
    /// Servers the links' later INFOs announced, learned at the next dial.
    announced: Arc<Mutex<Vec<String>>>,
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
                    last = Some(LinkError::Handshake {
                        server: where_(&addr),
                        message: format!("no connection within {DIAL_TIMEOUT:?}"),
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
    fn learn(&mut self, urls: &[String]) {
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

    async fn dial_one(
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
        let shared = Arc::new(Shared::new(
            max_payload.unwrap_or(info.max_payload),
            self.announced.clone(),
        ));
        let stop = CancellationToken::new();
        tokio::spawn(write_out(shared.clone(), writer, stop.clone()));
        tokio::spawn(read_in(
            shared.clone(),
            reader,
            rbuf,
            prefix.clone(),
            stop.clone(),
        ));
        Ok((
            Link {
                shared,
                _tasks: stop.drop_guard(),
                prefix,
                sent_mark: 0,
                server,
            },
            info,
        ))
    }

    /// CONNECT, the ack subscription and two PINGs: the server sends the
    /// INFO that carries the account's or user's limits right after its
    /// first PONG, so it has come by the second.
    fn hello(
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

    async fn tls_connect(
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

    fn connect_info(
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
fn where_(addr: &ServerAddr) -> String {
    format!("{}:{}", addr.host(), addr.port())
}

type Reader = Box<dyn AsyncRead + Send + Unpin>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// The server's root certificates and our client certificate.
fn tls_config(args: &NatsArgs) -> Result<rustls::ClientConfig, LinkError> {
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
fn parse_creds(text: &str) -> Option<(String, String)> {
    let after = |marker: &str| {
        let mut lines = text.lines().map(str::trim);
        lines.find(|l| l.contains("BEGIN") && l.contains(marker))?;
        lines.find(|l| !l.is_empty()).map(str::to_owned)
    };
    Some((after("JWT")?, after("SEED")?))
}

/// The server's nonce signed by the seed, base64url without padding.
fn sign_nonce(seed: &str, nonce: &str) -> Option<String> {
    use base64::Engine as _;
    let key = nkeys::KeyPair::from_seed(seed).ok()?;
    let sig = key.sign(nonce.as_bytes()).ok()?;
    Some(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(sig))
}

/// What the session and the link's two tasks share: bytes to write, and
/// answers read.
#[derive(Default)]
struct Shared {
    out: Mutex<OutState>,
    /// The writer's: the buffer filled from empty.
    wrote: Notify,
    answers: Mutex<Answers>,
    /// The session's: an answer came in, or the link closed.
    answered: Notify,
    /// The session's: a commit's answer came in, or the link closed.
    committed: Notify,
    /// Bytes ever written to the socket.
    written: AtomicU64,
    /// The connection's `max_payload`: a larger message would make the
    /// server close it, so it is refused here instead. The server's, until
    /// the INFO it sends after CONNECT gives the account's or user's (and
    /// any later INFO a new one).
    max_payload: AtomicUsize,
    /// Nothing queued before a pause is written after it (see
    /// [`super::fence`]).
    fence: std::sync::OnceLock<super::fence::Fence>,
    /// Our PINGs not answered yet, oldest first: `true` for a barrier
    /// (see [`Link::barrier`]), `false` for a keepalive. PONGs come in
    /// order, so each answers the oldest.
    pings: Mutex<VecDeque<bool>>,
    /// Operations the reader has heard: the keepalive sees silence as no
    /// change between its ticks. A count, not a clock: reading the clock
    /// on every answer costs the hot path (tokio's clock takes a lock).
    heard: AtomicU64,
    /// The server said it is leaving (lame duck mode, INFO `ldm`).
    lame_duck: std::sync::atomic::AtomicBool,
    /// Where cluster servers the server announces later go (the dialer's).
    announced: Arc<Mutex<Vec<String>>>,
}

impl Shared {
    fn new(max_payload: usize, announced: Arc<Mutex<Vec<String>>>) -> Self {
        let s = Self {
            announced,
            ..Self::default()
        };
        s.max_payload.store(max_payload, Ordering::Relaxed);
        s
    }

    /// Queue a PING, remembering what it is for; `false` if the link is
    /// gone. The queue's lock is held while the PING is queued, so the
    /// order of the queue is the order on the wire.
    fn ping(&self, barrier: bool) -> bool {
        let Ok(mut pings) = self.pings.lock() else {
            return false;
        };
        let queued = self.push(|s| s.buf.extend_from_slice(b"PING\r\n"));
        if queued {
            pings.push_back(barrier);
        }
        queued
    }

    fn barrier_pending(&self) -> bool {
        self.pings.lock().is_ok_and(|p| p.contains(&true))
    }
}

/// What an INFO after the first may change for the link.
#[derive(Debug, Default, serde::Deserialize)]
struct InfoUpdate {
    #[serde(default)]
    max_payload: Option<usize>,
    /// Lame duck mode: the server will close its connections soon.
    #[serde(default)]
    ldm: bool,
    #[serde(default)]
    connect_urls: Vec<String>,
}

impl InfoUpdate {
    fn read(json: &[u8]) -> Self {
        serde_json::from_slice(json).unwrap_or_default()
    }
}

#[derive(Default)]
struct OutState {
    /// Bytes ever queued (what the writer's count catches up to).
    queued: u64,
    buf: Vec<u8>,
    /// Large bodies, not copied: each goes out at its offset in `buf`.
    bodies: Vec<(usize, Bytes)>,
    broken: bool,
}

/// A body at least this large is written from the message's own bytes
/// instead of being copied into the buffer: the window may hold 16 MiB of
/// them, and a copy would hold it twice.
const COPY_MAX: usize = 16 * 1024;

#[derive(Default)]
struct Answers {
    queue: VecDeque<(u64, Answer)>,
    commits: VecDeque<(u64, CommitAnswer)>,
    /// Subjects the server refused a publish to, in the order it refused
    /// them (see [`Heard::Denied`]).
    denied: VecDeque<String>,
    /// Why the link closed, once it has.
    closed: Option<String>,
}

impl Shared {
    /// Append with `fill`; `false` if the link is gone.
    fn push(&self, fill: impl FnOnce(&mut OutState)) -> bool {
        let Ok(mut s) = self.out.lock() else {
            return false;
        };
        if s.broken {
            return false;
        }
        let was_empty = s.buf.is_empty();
        let (len, bodies) = (s.buf.len(), s.bodies.len());
        fill(&mut s);
        let added = s.buf.len() - len
            + s.bodies[bodies..]
                .iter()
                .map(|(_, b)| b.len())
                .sum::<usize>();
        s.queued += added as u64;
        drop(s);
        if was_empty {
            self.wrote.notify_one();
        }
        true
    }

    fn answer(&self, token: u64, answer: Answer) {
        if let Ok(mut a) = self.answers.lock() {
            a.queue.push_back((token, answer));
        }
        self.answered.notify_one();
    }

    fn commit_answer(&self, token: u64, answer: CommitAnswer) {
        if let Ok(mut a) = self.answers.lock() {
            a.commits.push_back((token, answer));
        }
        self.committed.notify_one();
    }

    /// The server refused a publish to `subject` (it keeps the connection
    /// and never answers that message): both readers hear it.
    fn deny(&self, subject: String) {
        if let Ok(mut a) = self.answers.lock() {
            a.denied.push_back(subject);
        }
        self.answered.notify_one();
        self.committed.notify_one();
    }

    /// Nothing more goes out or comes in.
    fn close(&self, why: String) {
        if let Ok(mut s) = self.out.lock() {
            s.broken = true;
            s.buf = Vec::new();
            s.bodies = Vec::new();
        }
        if let Ok(mut a) = self.answers.lock() {
            a.closed.get_or_insert(why);
        }
        self.answered.notify_one();
        self.committed.notify_one();
    }

    fn broken(&self) -> bool {
        self.out.lock().map_or(true, |s| s.broken)
    }
}

/// Write whatever gathered, each time the buffer fills from empty, until
/// stopped or the connection fails. The buffer holds only what the
/// publisher's window lets in flight, so it is bounded in bytes and count
/// by `--max-inflight-bytes` and `--max-inflight`.
async fn write_out(shared: Arc<Shared>, mut w: Writer, stop: CancellationToken) {
    const KEEP: usize = 256 * 1024;
    let mut spare = Vec::with_capacity(64 * 1024);
    let mut bodies = Vec::new();
    let mut check = tokio::time::interval(KEEPALIVE_TICK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut quiet = Quiet::default();
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = shared.wrote.notified() => {}
            _ = check.tick() => {
                if !quiet.tick(&shared) {
                    return;
                }
                continue;
            }
        }
        loop {
            let fenced = shared
                .fence
                .get()
                .is_some_and(|f| !f.holds(tokio::time::Instant::now()));
            if fenced {
                shared.close("the relay was paused: nothing queued before it is sent".into());
                return;
            }
            match shared.out.lock() {
                Ok(mut s) if !s.buf.is_empty() => {
                    std::mem::swap(&mut s.buf, &mut spare);
                    std::mem::swap(&mut s.bodies, &mut bodies);
                }
                _ => break,
            }
            let written = tokio::select! {
                _ = stop.cancelled() => return,
                r = async {
                    let mut at = 0;
                    for (offset, body) in &bodies {
                        send_all(&mut w, &spare[at..*offset], &shared.written).await?;
                        send_all(&mut w, body, &shared.written).await?;
                        at = *offset;
                    }
                    send_all(&mut w, &spare[at..], &shared.written).await?;
                    w.flush().await
                } => r,
            };
            spare.clear();
            bodies.clear();
            // A burst of large rows must not pin its size for the session.
            spare.shrink_to(KEEP);
            if let Err(e) = written {
                shared.close(format!("writing: {e}"));
                return;
            }
        }
    }
}

/// An idle link asks the server for a PONG after this long without a word
/// from it, and takes it for dead after twice this: a black-holed path is
/// replaced before the next event needs it, not found by that event's
/// stall. (The server pings an idle client only every two minutes.)
const KEEPALIVE: Duration = Duration::from_secs(5);

const KEEPALIVE_TICK: Duration = Duration::from_millis(2_500);

/// The keepalive's count of ticks with nothing heard.
#[derive(Default)]
struct Quiet {
    heard: u64,
    ticks: u32,
}

impl Quiet {
    /// One tick: `false` once the link is closed (silent too long).
    fn tick(&mut self, shared: &Shared) -> bool {
        let heard = shared.heard.load(Ordering::Relaxed);
        if heard != self.heard {
            self.heard = heard;
            self.ticks = 0;
        } else {
            self.ticks += 1;
        }
        let silent = KEEPALIVE_TICK * self.ticks;
        if silent >= 2 * KEEPALIVE {
            let why = format!(
                "no word from the server for {silent:?}, a PING unanswered: the connection is taken for dead"
            );
            tracing::warn!("{why}; the next event goes on a new one");
            shared.close(why);
            return false;
        }
        let waiting = shared.pings.lock().is_ok_and(|p| !p.is_empty());
        if silent >= KEEPALIVE && !waiting {
            return shared.ping(false);
        }
        !shared.broken()
    }
}

/// Whether the server closes the connection after this `-ERR` (so the
/// link ends now, with the server's words as the reason). A permission
/// refusal keeps the connection; so may an error we do not know.
fn closes_connection(err: &str) -> bool {
    const CLOSING: [&str; 9] = [
        "authorization violation",
        "stale connection",
        "slow consumer",
        "maximum payload violation",
        "user authentication expired",
        "user authentication revoked",
        "account authentication expired",
        "maximum connections exceeded",
        "unknown protocol operation",
    ];
    let err = err.trim().trim_matches('\'').to_ascii_lowercase();
    CLOSING.iter().any(|c| err.starts_with(c))
}

/// `write_all`, counting each partial write: a large write in progress
/// shows as progress ([`Link::still_sending`]).
async fn send_all(w: &mut Writer, mut buf: &[u8], written: &AtomicU64) -> std::io::Result<()> {
    while !buf.is_empty() {
        let n = w.write(buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        written.fetch_add(n as u64, Ordering::Relaxed);
        buf = &buf[n..];
    }
    Ok(())
}

/// Read answers (and the server's PINGs) until stopped or the connection
/// ends. Always reading, idle or not, keeps the server from closing the
/// connection as stale and notices a closed one before the next publish.
/// Answers wait at most a window's worth (each copy sent is answered once).
async fn read_in(
    shared: Arc<Shared>,
    mut r: Reader,
    mut rbuf: BytesMut,
    prefix: String,
    stop: CancellationToken,
) {
    loop {
        let op = tokio::select! {
            _ = stop.cancelled() => return,
            op = next_op(&mut r, &mut rbuf) => op,
        };
        shared.heard.fetch_add(1, Ordering::Relaxed);
        match op {
            Ok(Op::Msg {
                subject,
                status,
                payload,
            }) => {
                let status = status.and_then(|s| StatusCode::from_u16(s).ok());
                let tail = std::str::from_utf8(&subject)
                    .ok()
                    .and_then(|s| s.strip_prefix(prefix.as_str()));
                if let Some(tail) = tail {
                    if let Some(token) = tail.strip_prefix(COMMIT as char) {
                        if let Ok(token) = token.parse() {
                            shared.commit_answer(token, answer::read_commit(status, &payload));
                        }
                    } else if let Ok(token) = tail.parse() {
                        shared.answer(token, answer::read(status, &payload));
                    }
                }
            }
            Ok(Op::Ping) => {
                shared.push(|s| s.buf.extend_from_slice(b"PONG\r\n"));
            }
            Ok(Op::Err(text)) => match denied_subject(&text) {
                // For a message sent before a barrier: forgotten since.
                Some(subject) if shared.barrier_pending() => {
                    tracing::debug!(subject, "a refusal of a forgotten copy; ignored");
                }
                // The server keeps the connection and never answers the
                // message: only this line says it went nowhere.
                Some(subject) => shared.deny(subject.to_owned()),
                None if closes_connection(&text) => {
                    tracing::warn!(error = %text, "NATS closes the publish connection; what it did not answer is sent again on a new one");
                    shared.close(format!("the server said {text}"));
                    return;
                }
                None => {
                    tracing::warn!(error = %text, "NATS refused something on the publish connection")
                }
            },
            Ok(Op::Info(json)) => {
                let info = InfoUpdate::read(&json);
                if let Some(max) = info.max_payload {
                    shared.max_payload.store(max, Ordering::Relaxed);
                }
                if !info.connect_urls.is_empty() {
                    if let Ok(mut a) = shared.announced.lock() {
                        a.extend(info.connect_urls);
                    }
                }
                if info.ldm && !shared.lame_duck.swap(true, Ordering::Relaxed) {
                    tracing::info!("the NATS server is leaving (lame duck mode): the publish connection moves to another server once its answers are in");
                }
            }
            Ok(Op::Pong) => {
                if let Ok(mut p) = shared.pings.lock() {
                    p.pop_front();
                }
            }
            Ok(Op::Ok) => {}
            Err(e) => {
                shared.close(e.to_string());
                return;
            }
        }
    }
}

/// The subject of a publish the server refused for the user's permissions
/// (`Permissions Violation for Publish to "<subject>"`; older servers leave
/// out the quotes).
pub fn denied_subject(err: &str) -> Option<&str> {
    const PREFIX: &str = "permissions violation for publish to ";
    let head = err.get(..PREFIX.len())?;
    if !head.eq_ignore_ascii_case(PREFIX) {
        return None;
    }
    let subject = err[PREFIX.len()..].trim().trim_matches('"');
    // A reply subject the user may not publish to is named after the
    // subject: `… to "s" using reply subject "r"`.
    let subject = subject.split('"').next().unwrap_or(subject).trim();
    (!subject.is_empty()).then_some(subject)
}

/// A publish the server refused for the NATS user's permissions: it will
/// refuse it again, so it is dead-lettered (SPEC §9).
#[derive(Debug, thiserror::Error)]
#[error("permissions violation: this NATS user may not publish to {0}")]
pub struct Denied(pub String);

/// What the link heard for one of its readers.
#[derive(Debug)]
pub enum Heard<T> {
    /// The answer to the message sent under this token.
    Answer(u64, T),
    /// The server refused a publish to this subject for the user's
    /// permissions; the message will never be answered. Refusals come in the
    /// order the messages were sent.
    Denied(String),
}

/// One connection's publishes and their answers.
pub struct Link {
    shared: Arc<Shared>,
    /// Stops the reader and the writer.
    _tasks: DropGuard,
    /// `<inbox>.`: a reply subject is this and a token.
    prefix: String,
    /// The writer's count at the last [`Self::still_sending`].
    sent_mark: u64,
    server: String,
}

impl Link {
    /// Queue one message, its headers followed by `extra`, answered as
    /// `reply` says. `false`: the connection is gone, nothing was queued.
    pub fn publish(
        &mut self,
        subject: &str,
        reply: Reply,
        headers: &[(Cow<'static, str>, String)],
        extra: &[(&str, &str)],
        body: &Bytes,
    ) -> bool {
        let size = header_block_len(headers, extra) + body.len();
        if size > self.max_payload() {
            if self.shared.broken() {
                return false;
            }
            let refused = || PublishError::new(PublishErrorKind::MaxPayloadExceeded);
            match reply {
                Reply::Ack(token) => self.shared.answer(token, Err(refused())),
                Reply::Commit(token) => self.shared.commit_answer(token, Err(refused())),
                // Unanswered: the batch's commit goes without it, and the
                // server refuses the batch as incomplete.
                Reply::None => {}
            }
            return true;
        }
        let prefix = &self.prefix;
        self.shared.push(|s| {
            encode_head(
                &mut s.buf,
                subject,
                prefix,
                reply,
                headers,
                extra,
                body.len(),
            );
            if body.len() < COPY_MAX {
                s.buf.extend_from_slice(body);
            } else {
                let at = s.buf.len();
                s.bodies.push((at, body.clone()));
            }
            s.buf.extend_from_slice(b"\r\n");
        })
    }

    pub fn broken(&self) -> bool {
        self.shared.broken()
    }

    /// Everything sent so far is forgotten (sent again, or abandoned with
    /// its batch): refusals of it that are still to come must not be taken
    /// for those of the copies sent next. The server answers a PING after
    /// every message sent before it, so refusals that arrive before its
    /// PONG are of forgotten copies.
    pub fn barrier(&self) {
        // Those heard already are of forgotten copies too.
        if let Ok(mut a) = self.shared.answers.lock() {
            a.denied.clear();
        }
        self.shared.ping(true);
    }

    /// The server is leaving (lame duck mode): nothing new should go on
    /// this link once what is in flight on it is answered.
    pub fn lame_duck(&self) -> bool {
        self.shared.lame_duck.load(Ordering::Relaxed)
    }

    /// The server it is connected to (`host:port`).
    pub fn server(&self) -> &str {
        &self.server
    }

    /// From now on the writer writes nothing once `fence` broke.
    pub fn set_fence(&self, fence: super::fence::Fence) {
        let _ = self.shared.fence.set(fence);
    }

    /// Whether the writer is still behind what was queued and wrote
    /// something since the last call: an answer that is late because its
    /// message has not left yet (a large batch on a slow network) is not
    /// silence. A writer that made no progress for a whole call interval
    /// (a server that stopped reading) is.
    pub fn still_sending(&mut self) -> bool {
        let written = self.shared.written.load(Ordering::Relaxed);
        let queued = self.shared.out.lock().map_or(0, |s| s.queued);
        let moving = written < queued && written > self.sent_mark;
        self.sent_mark = written;
        moving
    }

    /// The `max_payload` of the connection: the server's, or the
    /// account's or user's where smaller.
    pub fn max_payload(&self) -> usize {
        self.shared.max_payload.load(Ordering::Relaxed)
    }

    /// The next answer (a reply token and what it says), or a refusal.
    /// Cancel-safe: answers wait in the shared queue.
    pub async fn next_answer(&mut self) -> Result<Heard<Answer>, LinkError> {
        self.next_from(
            |a| match a.denied.pop_front() {
                Some(subject) => Some(Heard::Denied(subject)),
                None => a.queue.pop_front().map(|(t, x)| Heard::Answer(t, x)),
            },
            &self.shared.answered,
        )
        .await
    }

    /// The next answer to a batch's commit ([`Reply::Commit`]), or a
    /// refusal. Cancel-safe, as [`Self::next_answer`].
    pub async fn next_commit(&mut self) -> Result<Heard<CommitAnswer>, LinkError> {
        self.next_from(
            |a| match a.denied.pop_front() {
                Some(subject) => Some(Heard::Denied(subject)),
                None => a.commits.pop_front().map(|(t, x)| Heard::Answer(t, x)),
            },
            &self.shared.committed,
        )
        .await
    }

    /// What `take` finds in the answers, waiting on `wake` until there is
    /// something, or the link's end once nothing is left.
    async fn next_from<T>(
        &self,
        take: impl Fn(&mut Answers) -> Option<T>,
        wake: &Notify,
    ) -> Result<T, LinkError> {
        loop {
            {
                let mut a = self.shared.answers.lock().map_err(|_| LinkError::Closed)?;
                if let Some(answer) = take(&mut a) {
                    return Ok(answer);
                }
                if let Some(why) = &a.closed {
                    return Err(LinkError::Ended(why.clone()));
                }
            }
            // A notification sent since the check is kept as a permit.
            wake.notified().await;
        }
    }
}

/// The server's first INFO.
async fn read_info<S: AsyncRead + Unpin>(
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
async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
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
                return Err(LinkError::Handshake {
                    server: server.to_owned(),
                    message: format!("refused: {text}"),
                })
            }
            // `+OK`, a newer INFO, a PING before our PONG.
            _ => {}
        }
    }
}

/// One protocol operation off the socket, read into `rbuf` as needed.
async fn next_op<R: AsyncRead + Unpin + ?Sized>(
    reader: &mut R,
    rbuf: &mut BytesMut,
) -> Result<Op, LinkError> {
    loop {
        if let Some((op, used)) = parse(rbuf).map_err(LinkError::Protocol)? {
            rbuf.advance(used);
            return Ok(op);
        }
        if rbuf.capacity() - rbuf.len() < 16 * 1024 {
            rbuf.reserve(64 * 1024);
        }
        let n = reader
            .read_buf(rbuf)
            .await
            .map_err(|source| LinkError::Io {
                server: "publish connection".into(),
                source,
            })?;
        if n == 0 {
            return Err(LinkError::Closed);
        }
    }
}

/// A server operation; payloads are copied out (acks are small).
#[derive(Debug, PartialEq, Eq)]
pub enum Op {
    Msg {
        subject: Vec<u8>,
        /// `HMSG`'s status line code (`503`: no responders).
        status: Option<u16>,
        payload: Vec<u8>,
    },
    Info(Vec<u8>),
    Ping,
    Pong,
    Ok,
    Err(String),
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Msg { .. } => "MSG",
            Op::Info(_) => "INFO",
            Op::Ping => "PING",
            Op::Pong => "PONG",
            Op::Ok => "+OK",
            Op::Err(_) => "-ERR",
        }
    }
}

/// The first complete operation in `buf` and the bytes it takes, or
/// `None` until more arrives.
pub fn parse(buf: &[u8]) -> Result<Option<(Op, usize)>, String> {
    let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
        if buf.len() > MAX_LINE {
            return Err(format!("a control line over {MAX_LINE} bytes"));
        }
        return Ok(None);
    };
    let line = &buf[..eol];
    let after = eol + 2;
    let (verb, rest) = match line.iter().position(|&b| b == b' ' || b == b'\t') {
        Some(i) => (&line[..i], &line[i + 1..]),
        None => (line, &line[line.len()..]),
    };
    let upper = verb.to_ascii_uppercase();
    let op = match upper.as_slice() {
        b"PING" => Op::Ping,
        b"PONG" => Op::Pong,
        b"+OK" => Op::Ok,
        b"-ERR" => Op::Err(
            String::from_utf8_lossy(rest)
                .trim()
                .trim_matches('\'')
                .to_owned(),
        ),
        b"INFO" => Op::Info(rest.to_vec()),
        b"MSG" | b"HMSG" => {
            let fields: Vec<&[u8]> = rest
                .split(|&b| b == b' ' || b == b'\t')
                .filter(|f| !f.is_empty())
                .collect();
            let number = |f: &[u8]| -> Result<usize, String> {
                std::str::from_utf8(f)
                    .ok()
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| format!("bad size in {:?}", String::from_utf8_lossy(line)))
            };
            let headed = upper.as_slice() == b"HMSG";
            // MSG subject sid [reply] size; HMSG subject sid [reply] hdr total.
            let sizes = if headed { 2 } else { 1 };
            if fields.len() < 2 + sizes || fields.len() > 3 + sizes {
                return Err(format!("bad {:?}", String::from_utf8_lossy(line)));
            }
            let total = number(fields[fields.len() - 1])?;
            let header_len = if headed {
                number(fields[fields.len() - 2])?
            } else {
                0
            };
            if header_len > total {
                return Err(format!("bad sizes in {:?}", String::from_utf8_lossy(line)));
            }
            let end = after + total;
            if buf.len() < end + 2 {
                return Ok(None);
            }
            if &buf[end..end + 2] != b"\r\n" {
                return Err(format!(
                    "no CRLF after the payload of {:?}",
                    String::from_utf8_lossy(line)
                ));
            }
            let status = headed
                .then(|| status_of(&buf[after..after + header_len]))
                .flatten();
            return Ok(Some((
                Op::Msg {
                    subject: fields[0].to_vec(),
                    status,
                    payload: buf[after + header_len..end].to_vec(),
                },
                end + 2,
            )));
        }
        _ => {
            return Err(format!(
                "unknown operation {:?}",
                String::from_utf8_lossy(&line[..line.len().min(64)])
            ))
        }
    };
    Ok(Some((op, after)))
}

/// The code on a header block's `NATS/1.0 <code> [text]` line.
fn status_of(block: &[u8]) -> Option<u16> {
    let first = block.split(|&b| b == b'\r').next()?;
    let rest = first.strip_prefix(b"NATS/1.0")?;
    let code = rest.split(|&b| b == b' ').find(|f| !f.is_empty())?;
    std::str::from_utf8(code).ok()?.parse().ok()
}

/// "NATS/1.0\r\n", "name: value\r\n" each, "\r\n".
fn header_block_len(headers: &[(Cow<'static, str>, String)], extra: &[(&str, &str)]) -> usize {
    let line = |k: &str, v: &str| k.len() + v.len() + 4;
    10 + headers.iter().map(|(k, v)| line(k, v)).sum::<usize>()
        + extra.iter().map(|(k, v)| line(k, v)).sum::<usize>()
        + 2
}

/// `HPUB <subject> [<reply>] <header bytes> <total bytes>` and the header
/// block (the message's headers, then `extra`); the body and a CRLF
/// follow. Names and values were checked for CR/LF when routed.
fn encode_head(
    out: &mut Vec<u8>,
    subject: &str,
    prefix: &str,
    reply: Reply,
    headers: &[(Cow<'static, str>, String)],
    extra: &[(&str, &str)],
    body_len: usize,
) {
    let block = header_block_len(headers, extra);
    out.reserve(subject.len() + prefix.len() + 64 + block + body_len.min(COPY_MAX));
    out.extend_from_slice(b"HPUB ");
    out.extend_from_slice(subject.as_bytes());
    out.push(b' ');
    match reply {
        Reply::None => {}
        Reply::Ack(token) | Reply::Commit(token) => {
            out.extend_from_slice(prefix.as_bytes());
            if matches!(reply, Reply::Commit(_)) {
                out.push(COMMIT);
            }
            push_decimal(out, token as usize);
            out.push(b' ');
        }
    }
    push_decimal(out, block);
    out.push(b' ');
    push_decimal(out, block + body_len);
    out.extend_from_slice(b"\r\nNATS/1.0\r\n");
    let mut line = |k: &str, v: &str| {
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v.as_bytes());
        out.extend_from_slice(b"\r\n");
    };
    for (k, v) in headers {
        line(k, v);
    }
    for (k, v) in extra {
        line(k, v);
    }
    out.extend_from_slice(b"\r\n");
}

/// One per-event message as the link writes it (for the per-event bench).
#[cfg(any(test, feature = "testing"))]
pub fn encode_message(out: &mut Vec<u8>, msg: &super::route::OutMessage, chain: Option<&str>) {
    let chain = chain.map(|id| (crate::wire::EXPECTED_LAST_MSG_ID, id));
    encode_head(
        out,
        &msg.subject,
        "_INBOX.0123456789abcdef0123456789abcdef.",
        Reply::Ack(1_000_000),
        &msg.headers,
        chain.as_slice(),
        msg.body.len(),
    );
    out.extend_from_slice(&msg.body);
    out.extend_from_slice(b"\r\n");
}

fn push_decimal(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn headers() -> Vec<(Cow<'static, str>, String)> {
        vec![
            (Cow::Borrowed("Nats-Msg-Id"), "e1".to_owned()),
            (
                Cow::Owned("Outbox-Event-Type".to_owned()),
                "tick".to_owned(),
            ),
        ]
    }

    #[test]
    fn an_hpub_carries_its_header_block_and_body_with_their_sizes() {
        let mut out = Vec::new();
        encode_head(
            &mut out,
            "ctx.load",
            "_INBOX.x.",
            Reply::Ack(42),
            &headers(),
            &[("Nats-Expected-Last-Msg-Id", "e0")],
            2,
        );
        out.extend_from_slice(b"{}\r\n");
        let block = "NATS/1.0\r\nNats-Msg-Id: e1\r\nOutbox-Event-Type: tick\r\nNats-Expected-Last-Msg-Id: e0\r\n\r\n";
        let want = format!(
            "HPUB ctx.load _INBOX.x.42 {} {}\r\n{block}{{}}\r\n",
            block.len(),
            block.len() + 2
        );
        assert_eq!(String::from_utf8(out).unwrap(), want);
        assert_eq!(
            header_block_len(&headers(), &[("Nats-Expected-Last-Msg-Id", "e0")]),
            block.len()
        );
    }

    /// Small bodies are copied into the buffer, large ones written from
    /// their own bytes at their place: the stream is the same.
    #[tokio::test]
    async fn the_writer_puts_large_bodies_in_their_place() {
        let shared = Arc::new(Shared::new(1 << 20, Arc::default()));
        let (ours, mut theirs) = tokio::io::duplex(1 << 20);
        let stop = CancellationToken::new();
        tokio::spawn(write_out(shared.clone(), Box::new(ours), stop.clone()));
        let big = Bytes::from(vec![b'b'; COPY_MAX + 1]);
        let mut link = Link {
            shared: shared.clone(),
            _tasks: stop.drop_guard(),
            prefix: "_I.".into(),
            sent_mark: 0,
            server: "test".into(),
        };
        let mut want = Vec::new();
        let extra = [("Nats-Batch-Id", "b1")];
        for (reply, body) in [
            (Reply::Ack(1), Bytes::from_static(b"s1")),
            (Reply::None, big.clone()),
            (Reply::Commit(3), Bytes::from_static(b"s3")),
        ] {
            assert!(link.publish("a.b", reply, &headers(), &extra, &body));
            encode_head(
                &mut want,
                "a.b",
                "_I.",
                reply,
                &headers(),
                &extra,
                body.len(),
            );
            want.extend_from_slice(&body);
            want.extend_from_slice(b"\r\n");
        }
        let mut got = vec![0; want.len()];
        theirs.read_exact(&mut got).await.unwrap();
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HPUB a.b _I.1 "), "{text:.40}");
        assert!(
            text.contains("HPUB a.b 73 16458\r\n"),
            "a batch's message has no reply subject"
        );
        assert!(text.contains("HPUB a.b _I.c3 "), "a commit's reply subject");
        assert!(
            got == want,
            "the bytes written differ from the messages encoded"
        );
        // Too large for the server: answered here, never written.
        let huge = Bytes::from(vec![b'h'; 1 << 20]);
        assert!(link.publish("a.b", Reply::Ack(4), &headers(), &[], &huge));
        let Heard::Answer(token, answer) = link.next_answer().await.unwrap() else {
            panic!("an answer")
        };
        assert_eq!(token, 4);
        assert_eq!(
            answer.unwrap_err().kind(),
            PublishErrorKind::MaxPayloadExceeded
        );
        // The other end gone: the link says so, and takes nothing more.
        drop(theirs);
        assert!(link.publish(
            "a.b",
            Reply::Ack(5),
            &headers(),
            &[],
            &Bytes::from_static(b"x")
        ));
        tokio::time::timeout(Duration::from_secs(5), async {
            while !link.broken() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the writer notices");
        assert!(!link.publish(
            "a.b",
            Reply::Ack(6),
            &headers(),
            &[],
            &Bytes::from_static(b"x")
        ));
    }

    /// Acks and commits' answers go to their own queues, whatever comes
    /// between them; a PING is answered; the end of the connection ends
    /// both queues once they are drained.
    #[tokio::test]
    async fn the_reader_sorts_answers_and_answers_pings() {
        let (mut link, mut theirs) = piped(Arc::default());
        let ack = br#"{"stream":"S","seq":1}"#;
        let commit = br#"{"stream":"S","seq":3,"batch":"b1","count":2}"#;
        let mut wire = format!("MSG _I.c9 1 {}\r\n", commit.len()).into_bytes();
        wire.extend_from_slice(commit);
        wire.extend_from_slice(b"\r\nPING\r\nMSG _OTHER.1 1 2\r\n{}\r\n");
        wire.extend_from_slice(format!("MSG _I.7 1 {}\r\n", ack.len()).as_bytes());
        wire.extend_from_slice(ack);
        wire.extend_from_slice(b"\r\n");
        theirs.write_all(&wire).await.unwrap();
        let Heard::Answer(token, answer) = link.next_answer().await.unwrap() else {
            panic!("an answer")
        };
        assert_eq!((token, answer.ok()), (7, Some(false)));
        let Heard::Answer(token, answer) = link.next_commit().await.unwrap() else {
            panic!("a commit's answer")
        };
        assert_eq!(token, 9);
        assert_eq!(answer.unwrap().batch.as_deref(), Some("b1"));
        theirs
            .write_all(b"-ERR 'Permissions Violation for Publish to \"a.b\"'\r\n")
            .await
            .unwrap();
        assert!(matches!(link.next_answer().await.unwrap(), Heard::Denied(s) if s == "a.b"));
        let mut pong = [0; 6];
        theirs.read_exact(&mut pong).await.unwrap();
        assert_eq!(&pong, b"PONG\r\n");
        // A barrier: refusals before its PONG are of forgotten copies.
        link.barrier();
        let mut ping = [0; 6];
        theirs.read_exact(&mut ping).await.unwrap();
        assert_eq!(&ping, b"PING\r\n");
        theirs
            .write_all(b"-ERR 'Permissions Violation for Publish to \"a.old\"'\r\nPONG\r\n-ERR 'Permissions Violation for Publish to \"a.new\"'\r\n")
            .await
            .unwrap();
        assert!(
            matches!(link.next_answer().await.unwrap(), Heard::Denied(s) if s == "a.new"),
            "the refusal before the barrier's PONG is dropped"
        );
        // A later INFO may lower the connection's max_payload.
        theirs
            .write_all(b"INFO {\"max_payload\":4096}\r\nPING\r\n")
            .await
            .unwrap();
        theirs.read_exact(&mut pong).await.unwrap();
        assert_eq!(link.max_payload(), 4096);
        drop(theirs);
        assert!(link.next_answer().await.is_err());
        assert!(link.next_commit().await.is_err());
        assert!(link.broken());
    }

    /// A link over a duplex pipe; the test plays the server on `theirs`.
    fn piped(announced: Arc<Mutex<Vec<String>>>) -> (Link, tokio::io::DuplexStream) {
        let shared = Arc::new(Shared::new(1 << 20, announced));
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        let (r, w) = tokio::io::split(ours);
        let stop = CancellationToken::new();
        tokio::spawn(write_out(shared.clone(), Box::new(w), stop.clone()));
        tokio::spawn(read_in(
            shared.clone(),
            Box::new(r),
            BytesMut::new(),
            "_I.".into(),
            stop.clone(),
        ));
        let link = Link {
            shared,
            _tasks: stop.drop_guard(),
            prefix: "_I.".into(),
            sent_mark: 0,
            server: "test".into(),
        };
        (link, theirs)
    }

    /// Each `-ERR` after which nats-server closes the connection ends the
    /// link at once, with the server's words as the reason; one it keeps
    /// the connection after (one we do not know) is only logged.
    #[tokio::test]
    async fn an_error_the_server_closes_after_ends_the_link_with_its_words() {
        for err in [
            "'Authorization Violation'",
            "'Stale Connection'",
            "'Slow Consumer'",
            "'Maximum Payload Violation'",
            "'User Authentication Expired'",
        ] {
            let (mut link, mut theirs) = piped(Arc::default());
            theirs
                .write_all(format!("-ERR {err}\r\n").as_bytes())
                .await
                .unwrap();
            let e = link.next_answer().await.expect_err(err).to_string();
            assert!(e.contains(err.trim_matches('\'')), "{err}: {e}");
            assert!(link.broken(), "{err}");
        }
        let (link, mut theirs) = piped(Arc::default());
        theirs
            .write_all(b"-ERR 'Something New'\r\nPING\r\n")
            .await
            .unwrap();
        let mut pong = [0; 6];
        theirs.read_exact(&mut pong).await.unwrap();
        assert!(!link.broken());
    }

    /// A later INFO in lame duck mode marks the link as leaving; the
    /// servers it announces reach the dialer.
    #[tokio::test]
    async fn a_lame_duck_info_marks_the_link_and_announces_servers() {
        let announced = Arc::default();
        let (link, mut theirs) = piped(Arc::clone(&announced));
        assert!(!link.lame_duck());
        theirs
            .write_all(b"INFO {\"ldm\":true,\"connect_urls\":[\"127.0.0.1:4223\"]}\r\nPING\r\n")
            .await
            .unwrap();
        let mut pong = [0; 6];
        theirs.read_exact(&mut pong).await.unwrap();
        assert!(link.lame_duck());
        assert!(!link.broken(), "what is in flight is still answered");
        assert_eq!(
            *announced.lock().unwrap(),
            vec!["127.0.0.1:4223".to_owned()]
        );
    }

    /// An idle link whose server says nothing asks with a PING after
    /// [`KEEPALIVE`], and ends after twice that with no answer; one that
    /// answers stays. A keepalive's PONG is not taken for a barrier's.
    #[tokio::test(start_paused = true)]
    async fn a_silent_idle_link_pings_and_is_given_up_without_a_pong() {
        let (mut link, mut theirs) = piped(Arc::default());
        let mut ping = [0; 6];
        theirs.read_exact(&mut ping).await.unwrap();
        assert_eq!(&ping, b"PING\r\n");
        link.barrier();
        theirs.read_exact(&mut ping).await.unwrap();
        // The keepalive's PONG: the barrier's is still to come.
        theirs.write_all(b"PONG\r\n").await.unwrap();
        theirs
            .write_all(b"-ERR 'Permissions Violation for Publish to \"a.old\"'\r\nPONG\r\n-ERR 'Permissions Violation for Publish to \"a.new\"'\r\n")
            .await
            .unwrap();
        assert!(
            matches!(link.next_answer().await.unwrap(), Heard::Denied(s) if s == "a.new"),
            "the refusal before the barrier's PONG is dropped"
        );
        tokio::time::sleep(KEEPALIVE).await;
        assert!(!link.broken(), "it answered");
        // Now silent: a PING, then the end.
        theirs.read_exact(&mut ping).await.unwrap();
        assert_eq!(&ping, b"PING\r\n");
        let e = link.next_answer().await.expect_err("given up").to_string();
        assert!(e.contains("taken for dead"), "{e}");
        assert!(link.broken());
    }

    /// Bytes still leaving, slowly, are not silence; a writer stuck since
    /// the last look, or done, is.
    #[tokio::test]
    async fn a_link_still_sending_is_told_from_a_silent_one() {
        let shared = Arc::new(Shared::new(1 << 20, Arc::default()));
        let (ours, mut theirs) = tokio::io::duplex(256);
        let stop = CancellationToken::new();
        tokio::spawn(write_out(shared.clone(), Box::new(ours), stop.clone()));
        let mut link = Link {
            shared: shared.clone(),
            _tasks: stop.drop_guard(),
            prefix: "_I.".into(),
            sent_mark: 0,
            server: "test".into(),
        };
        let written = || shared.written.load(Ordering::Relaxed);
        async fn until(what: &str, done: impl Fn() -> bool) {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while !done() {
                assert!(std::time::Instant::now() < deadline, "timed out: {what}");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let body = Bytes::from(vec![b'x'; 4096]);
        assert!(link.publish("a.b", Reply::Ack(1), &headers(), &[], &body));
        // The pipe holds 256 bytes: the writer is stuck behind them.
        until("the pipe full", || written() == 256).await;
        assert!(link.still_sending(), "it wrote since the last look");
        assert!(!link.still_sending(), "no progress since the last look");
        let mut chunk = [0u8; 1024];
        theirs.read_exact(&mut chunk).await.unwrap();
        until("more written", || written() > 256).await;
        assert!(link.still_sending(), "it wrote since the last look");
        let mut head = Vec::new();
        encode_head(
            &mut head,
            "a.b",
            "_I.",
            Reply::Ack(1),
            &headers(),
            &[],
            body.len(),
        );
        let total = head.len() + body.len() + 2;
        let mut rest = vec![0u8; total - chunk.len()];
        theirs.read_exact(&mut rest).await.unwrap();
        until("all written", || written() == total as u64).await;
        assert!(!link.still_sending(), "everything left");
    }

    #[test]
    fn decimals() {
        for n in [0usize, 7, 10, 99, 1234567890, usize::MAX] {
            let mut out = Vec::new();
            push_decimal(&mut out, n);
            assert_eq!(String::from_utf8(out).unwrap(), n.to_string());
        }
    }

    #[test]
    fn a_permission_refusal_names_its_subject() {
        for (err, subject) in [
            (
                r#"Permissions Violation for Publish to "orders.x""#,
                Some("orders.x"),
            ),
            (
                "Permissions Violation for Publish to orders.x",
                Some("orders.x"),
            ),
            (
                r#"Permissions Violation for Publish to "a.b" using reply subject "_I.7""#,
                Some("a.b"),
            ),
            (r#"Permissions Violation for Subscription to "_I.>""#, None),
            ("Authorization Violation", None),
            ("Permissions Violation for Publish to ", None),
        ] {
            assert_eq!(denied_subject(err), subject, "{err}");
        }
    }

    #[test]
    fn server_operations() {
        let ops = b"INFO {\"max_payload\":1}\r\nPING\r\n+OK\r\n-ERR 'Permissions Violation for Publish to x'\r\nMSG _INBOX.a.7 1 5\r\nhello\r\nHMSG _INBOX.a.8 1 16 16\r\nNATS/1.0 503\r\n\r\n\r\nhmsg _INBOX.a.9 1 _R 12 14\r\nNATS/1.0\r\n\r\nok\r\nPONG\r\n";
        let mut at = 0;
        let mut got = Vec::new();
        while let Some((op, used)) = parse(&ops[at..]).unwrap() {
            got.push(op);
            at += used;
        }
        assert_eq!(at, ops.len());
        assert_eq!(
            got,
            vec![
                Op::Info(b"{\"max_payload\":1}".to_vec()),
                Op::Ping,
                Op::Ok,
                Op::Err("Permissions Violation for Publish to x".into()),
                Op::Msg {
                    subject: b"_INBOX.a.7".to_vec(),
                    status: None,
                    payload: b"hello".to_vec()
                },
                Op::Msg {
                    subject: b"_INBOX.a.8".to_vec(),
                    status: Some(503),
                    payload: vec![]
                },
                Op::Msg {
                    subject: b"_INBOX.a.9".to_vec(),
                    status: None,
                    payload: b"ok".to_vec()
                },
                Op::Pong,
            ]
        );
    }

    #[test]
    fn what_is_not_nats_is_an_error() {
        assert!(parse(b"HELLO\r\n").is_err());
        assert!(parse(b"MSG a 1 x\r\n").is_err());
        assert!(parse(b"MSG a 1 2\r\nabcd\r\n").is_err());
        assert!(parse(b"HMSG a 1 9 2\r\n").is_err());
        assert_eq!(parse(&[b'x'; 100]).unwrap(), None);
        assert!(parse(&vec![b'x'; MAX_LINE + 1]).is_err());
    }

    #[test]
    fn creds_files_give_their_jwt_and_seed() {
        let text = "-----BEGIN NATS USER JWT-----\neyJhbGciOi.x.y\n------END NATS USER JWT------\n\n************************* IMPORTANT *************************\nNKEY Seed printed below can be used to sign and prove identity.\n\n-----BEGIN USER NKEY SEED-----\nSUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PEJUA44CNHTC4\n------END USER NKEY SEED------\n";
        assert_eq!(
            parse_creds(text),
            Some((
                "eyJhbGciOi.x.y".to_owned(),
                "SUAIBDPBAUTWCWBKIO6XHQNINK5FWJW4OHLXC3HQ2KFE4PEJUA44CNHTC4".to_owned()
            ))
        );
        assert_eq!(parse_creds("-----BEGIN NATS USER JWT-----\nx\n"), None);
    }

    #[test]
    fn a_nonce_is_signed_by_the_seed() {
        use base64::Engine as _;
        let user = nkeys::KeyPair::new_user();
        let seed = user.seed().unwrap();
        let sig = sign_nonce(&seed, "nonce-1").unwrap();
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(sig)
            .unwrap();
        user.verify(b"nonce-1", &raw).unwrap();
        assert_eq!(sign_nonce("not a seed", "n"), None);
    }

    proptest! {
        /// However the socket cuts the bytes, the same operations come out.
        #[test]
        fn operations_survive_any_split(cuts in proptest::collection::vec(0usize..120, 0..6)) {
            let ops: &[u8] = b"PING\r\nMSG _INBOX.a.1 1 9\r\n{\"seq\":1}\r\nHMSG _INBOX.a.2 1 16 20\r\nNATS/1.0 503\r\n\r\nabcd\r\nPONG\r\n";
            let whole = {
                let mut at = 0;
                let mut v = Vec::new();
                while let Some((op, used)) = parse(&ops[at..]).unwrap() { v.push(op); at += used; }
                v
            };
            prop_assert_eq!(whole.len(), 4);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(ops.len())).collect();
            cuts.sort_unstable();
            cuts.push(ops.len());
            let mut buf = Vec::new();
            let mut got = Vec::new();
            let mut fed = 0;
            for c in cuts {
                buf.extend_from_slice(&ops[fed..c]);
                fed = c;
                while let Some((op, used)) = parse(&buf).unwrap() {
                    got.push(op);
                    buf.drain(..used);
                }
            }
            prop_assert_eq!(got, whole);
        }
    }
}
