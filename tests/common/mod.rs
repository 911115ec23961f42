//! Test harness: the real stack from `scripts/stack.sh` (started by
//! `scripts/test.sh`), one fresh database, slot, publication and stream per
//! test, the relay as a real child process.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use outbox_relay::wire;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;

pub const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

pub struct Stack {
    pub admin_url: String,
    pub nats_url: String,
    pub nats_bin: String,
}

pub fn stack() -> Stack {
    let get = |k: &str| {
        std::env::var(k).unwrap_or_else(|_| {
            panic!("{k} is not set: run the integration tests through scripts/test.sh, which starts Postgres and NATS")
        })
    };
    Stack {
        admin_url: get("DATABASE_URL"),
        nats_url: get("NATS_URL"),
        nats_bin: get("NATS_SERVER_BIN"),
    }
}

/// The PostgreSQL major this run tests: `STACK_PG_MAJOR` in a matrix run
/// of `scripts/test.sh`, else Debian 12's 15.
pub fn pg_major() -> u32 {
    std::env::var("STACK_PG_MAJOR")
        .ok()
        .and_then(|m| m.parse().ok())
        .unwrap_or(15)
}

/// The path `scripts/stack.sh TOOL` prints (installing the tool on first
/// use), with `env` set and the stack's own nats-server binary unset.
pub fn stack_tool(tool: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new(STACK_SH)
        .arg(tool)
        .envs(env.iter().copied())
        .env_remove("NATS_SERVER_BIN")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stack.sh {tool} {env:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Block until something listens on 127.0.0.1:`port` (10 s at most, then
/// a panic with `why()`).
pub fn wait_listening(port: u16, why: impl Fn() -> String) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "{}", why());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A URL for database `name` on the stack's server.
pub fn db_url(admin: &str, name: &str) -> String {
    let base = admin.rsplit_once('/').map_or(admin, |(b, _)| b);
    format!("{base}/{name}")
}

/// A fresh database with the migrations applied (by the real binary).
pub async fn fresh_db(stack: &Stack, name: &str) -> (String, PgPool) {
    let (url, pool) = empty_db(stack, name).await;
    migrate(&url);
    (url, pool)
}

/// A fresh database with nothing in it: what a team's own database looks
/// like to a relay on its own outbox table (SPEC §13: no migration).
pub async fn empty_db(stack: &Stack, name: &str) -> (String, PgPool) {
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&stack.admin_url)
        .await
        .unwrap();
    // A slot left by an earlier run pins the database; drop those first.
    sqlx::query("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active")
        .bind(name)
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
    )))
    .execute(&admin)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .unwrap();
    let url = db_url(&stack.admin_url, name);
    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&url)
        .await
        .unwrap();
    (url, pool)
}

/// `outbox-relay migrate` against `url`, by the real binary.
pub fn migrate(url: &str) {
    let out = Command::new(BIN)
        .args(["migrate", "--database-url", url])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "migrate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn log_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("relay-logs");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The binary (relay or consumer) as a child process; killed on drop.
/// Its endpoint listens on a port chosen here, so readiness and metrics are
/// read from `/readyz` and `/metrics`, never from log text.
pub struct Service {
    pub child: Child,
    pub log: PathBuf,
    args: Vec<String>,
    name: String,
    rust_log: String,
    metrics_addr: String,
    /// Environment variables of this process alone (tests run in parallel:
    /// the test process's own environment is everyone's).
    envs: Vec<(String, String)>,
}

/// Serve a test's handler `app` on a free loopback port: the URL of its
/// `/handle` route.
pub async fn serve_handler(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/handle", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// A loopback port that was free a moment ago, below the kernel's
/// ephemeral range: one the kernel hands out (port 0) may be taken, before
/// the server binds it, as the source port of any outgoing connection.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        .unwrap_or(32768);
    let base = (low / 2).max(1024);
    let span = low.saturating_sub(base).max(1);
    // Spread by process and counter: tests and the scripts pick at once.
    let seed =
        u64::from(std::process::id()) * 7919 + NEXT.fetch_add(1, Ordering::Relaxed) * 104_729;
    for i in 0..span {
        let port = u16::try_from(base + (seed + i * 7) % span).unwrap_or(0);
        if port != 0 && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Service {
    pub fn relay(db_url: &str, nats_url: &str, context: &str, extra: &[&str]) -> Service {
        let args = relay_args(db_url, nats_url, context, extra);
        Self::start(args, context)
    }

    /// The relay started and answering `/healthz`, but not waited for
    /// (to watch it become ready).
    pub fn relay_starting(db_url: &str, nats_url: &str, context: &str, extra: &[&str]) -> Service {
        let args = relay_args(db_url, nats_url, context, extra);
        let _ = std::fs::remove_file(log_dir().join(format!("{context}.log")));
        let mut service = Self::spawn(args, context);
        service.wait_until("/healthz");
        service
    }

    /// `outbox-relay consume` for durable `durable` (log named after it).
    pub fn consumer(
        db_url: &str,
        nats_url: &str,
        stream: &str,
        durable: &str,
        handler_url: &str,
        extra: &[&str],
    ) -> Service {
        let args = consume_args(db_url, nats_url, stream, durable, handler_url, extra);
        Self::start(args, durable)
    }

    /// A further instance of durable `durable`, logging to `{name}.log`;
    /// waits only for `/healthz` (it may well be standby).
    #[allow(clippy::too_many_arguments)]
    pub fn consumer_named(
        db_url: &str,
        nats_url: &str,
        stream: &str,
        durable: &str,
        name: &str,
        handler_url: &str,
        extra: &[&str],
    ) -> Service {
        let args = consume_args(db_url, nats_url, stream, durable, handler_url, extra);
        let _ = std::fs::remove_file(log_dir().join(format!("{name}.log")));
        let mut service = Self::spawn(args, name);
        service.wait_until("/healthz");
        service
    }

    /// `outbox-relay console` on `admin_addr`, ready.
    pub fn console(
        db_url: &str,
        nats_url: &str,
        admin_addr: &str,
        name: &str,
        extra: &[&str],
    ) -> Service {
        let mut args: Vec<String> = vec![
            "console".into(),
            "--database-url".into(),
            db_url.into(),
            "--nats-url".into(),
            nats_url.into(),
            "--admin-addr".into(),
            admin_addr.into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::start(args, name)
    }

    fn start(args: Vec<String>, name: &str) -> Service {
        let _ = std::fs::remove_file(log_dir().join(format!("{name}.log")));
        let mut service = Self::spawn(args, name);
        service.wait_ready();
        service
    }

    /// Block until `/readyz` answers 200. For the relay that is when it
    /// streams from its slot; for the consumer, when it pulls.
    pub fn wait_ready(&mut self) {
        self.wait_until("/readyz");
    }

    /// Block until `path` answers 200 (or the service exits: a panic with its log).
    fn wait_until(&mut self, path: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if http_get_blocking(&self.metrics_addr, path).is_some_and(|(s, _)| s == 200) {
                return;
            }
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!(
                    "service exited with {st} before {path} answered 200:\n{}",
                    self.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "service: no 200 on {path} after 60s:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn spawn(args: Vec<String>, name: &str) -> Service {
        Self::spawn_logged(args, name, "info,outbox_relay=debug".to_owned())
    }

    /// The relay logging at every level of every crate (`RUST_LOG=trace`).
    /// [`relay_starting`](Self::relay_starting) for another relay of the
    /// same context, its log named `name`.
    pub fn relay_starting_named(
        db_url: &str,
        nats_url: &str,
        context: &str,
        name: &str,
        extra: &[&str],
    ) -> Service {
        let args = relay_args(db_url, nats_url, context, extra);
        let _ = std::fs::remove_file(log_dir().join(format!("{name}.log")));
        let mut service = Self::spawn(args, name);
        service.wait_until("/healthz");
        service
    }

    pub fn relay_traced(db_url: &str, nats_url: &str, context: &str, extra: &[&str]) -> Service {
        let args = relay_args(db_url, nats_url, context, extra);
        let _ = std::fs::remove_file(log_dir().join(format!("{context}.log")));
        let mut s = Self::spawn_logged(args, context, "trace".to_owned());
        s.wait_ready();
        s
    }

    /// [`relay`](Self::relay) with environment variables of its own (its
    /// log `{context}-env`).
    pub fn relay_env(
        db_url: &str,
        nats_url: &str,
        context: &str,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> Service {
        let args = relay_args(db_url, nats_url, context, extra);
        let name = format!("{context}-env");
        let _ = std::fs::remove_file(log_dir().join(format!("{name}.log")));
        let envs = envs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let mut s = Self::spawn_env(args, &name, "info,outbox_relay=debug".to_owned(), envs);
        s.wait_ready();
        s
    }

    fn spawn_logged(args: Vec<String>, name: &str, rust_log: String) -> Service {
        Self::spawn_env(args, name, rust_log, Vec::new())
    }

    fn spawn_env(
        mut args: Vec<String>,
        name: &str,
        rust_log: String,
        envs: Vec<(String, String)>,
    ) -> Service {
        let log = log_dir().join(format!("{name}.log"));
        // The same address across restarts (the caller may have chosen one).
        let metrics_addr = match args.iter().position(|a| a == "--metrics-addr") {
            Some(i) => args[i + 1].clone(),
            None => {
                let addr = format!("127.0.0.1:{}", free_port());
                args.extend(["--metrics-addr".to_owned(), addr.clone()]);
                addr
            }
        };
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = Command::new(BIN)
            .args(&args)
            .env("RUST_LOG", &rust_log)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap();
        Service {
            child,
            log,
            args,
            name: name.to_owned(),
            rust_log,
            metrics_addr,
            envs,
        }
    }

    /// Start again with the same arguments (after a kill); waits only until
    /// its endpoint answers `/healthz`, not until it is ready.
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        *self = Self::spawn_env(
            self.args.clone(),
            &self.name.clone(),
            self.rust_log.clone(),
            self.envs.clone(),
        );
        self.wait_until("/healthz");
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status, once it has exited by itself.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().unwrap()
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait (bounded) for the exit status.
    pub fn term(&mut self, timeout: Duration) -> ExitStatus {
        signal(self.child.id(), "TERM");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                Instant::now() < deadline,
                "relay did not stop within {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Peak resident memory of the process (VmHWM), in KiB.
    pub fn peak_rss_kib(&self) -> Option<u64> {
        self.status_kib("VmHWM:")
    }

    /// Resident memory now (VmRSS), in KiB.
    pub fn rss_kib(&self) -> Option<u64> {
        self.status_kib("VmRSS:")
    }

    fn status_kib(&self, field: &str) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        status
            .lines()
            .find(|l| l.starts_with(field))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    }

    /// Where the service serves `/metrics`, `/healthz` and `/readyz`.
    pub fn metrics_addr(&self) -> &str {
        &self.metrics_addr
    }

    /// GET `path` on the metrics endpoint: (status, body).
    pub async fn http_get(&self, path: &str) -> (u16, String) {
        let url = format!("http://{}{path}", self.metrics_addr());
        // Bounded: a process that stops answering fails the test, with its
        // log, instead of holding the suite until its time limit.
        let resp = reqwest::Client::new()
            .get(&url)
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .unwrap_or_else(|e| panic!("GET {url}: {e}"));
        let status = resp.status().as_u16();
        (status, resp.text().await.unwrap_or_default())
    }

    pub async fn scrape(&self) -> Scrape {
        let (status, body) = self.http_get("/metrics").await;
        assert_eq!(status, 200, "/metrics answered {status}: {body}");
        Scrape(body)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A failed test shows what its processes said: a flake on CI is
        // diagnosed from the run's own output, not rerun in the hope of it.
        // OUTBOX_TEST_LOGS=1 shows them for a test that passed too.
        if std::thread::panicking() || std::env::var_os("OUTBOX_TEST_LOGS").is_some() {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(LOG_TAIL)..];
            eprintln!(
                "--- last {} lines of {} ---",
                tail.len(),
                self.log.display()
            );
            for line in tail {
                eprintln!("{line}");
            }
        }
    }
}

/// How much of a process's log a failed test prints.
const LOG_TAIL: usize = 120;

/// `outbox-relay slot drop` of `context`'s slot, which must succeed: a lost
/// slot, as the tests of one make it.
pub fn drop_slot(url: &str, context: &str) {
    let (code, err) = run_bounded(
        &[
            "slot",
            "drop",
            "--yes",
            "--database-url",
            url,
            "--context",
            context,
        ],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{err}");
}

/// A relay for `context` that finds no slot but this database's events in
/// its stream: it exits 1 with one `error:` line, returned.
pub fn lost_slot_refusal(url: &str, nats_url: &str, context: &str) -> String {
    let (code, err) = run_relay_bounded(url, nats_url, context, &[]);
    assert_eq!(code, Some(1), "a lost slot is refused: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    lines[0].to_owned()
}

/// `outbox-relay relay` for context `context`, expected to refuse at start:
/// (exit code, stderr) within 30 s (see [`run_bounded`]).
pub fn run_relay_bounded(
    db_url: &str,
    nats_url: &str,
    context: &str,
    extra: &[&str],
) -> (Option<i32>, String) {
    let mut args = relay_args(db_url, nats_url, context, extra);
    args.extend([
        "--metrics-addr".into(),
        format!("127.0.0.1:{}", free_port()),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_bounded(&args, Duration::from_secs(30))
}

/// Run the binary with `args` for at most `timeout`: (exit code, stderr).
/// A command that does not exit by then is killed and reported as `None`,
/// so a test of "refuses at start" cannot hang on a relay that streams.
pub fn run_bounded(args: &[&str], timeout: Duration) -> (Option<i32>, String) {
    run_capped(args, timeout, false)
}

/// `outbox-relay ARGS`, bounded in time: exit code, then stdout and stderr
/// together (for commands whose answer is on stdout; keep it small).
pub fn run_output_bounded(args: &[&str], timeout: Duration) -> (Option<i32>, String) {
    run_capped(args, timeout, true)
}

fn run_capped(args: &[&str], timeout: Duration, stdout: bool) -> (Option<i32>, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdout(if stdout {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + timeout;
    let code = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st.code();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut text = String::new();
    use std::io::Read;
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut text);
    }
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut text);
    }
    (code, text)
}

pub fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .unwrap();
    assert!(st.success(), "kill -{sig} {pid} failed");
}

fn relay_args(db_url: &str, nats_url: &str, context: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = vec![
        "relay".into(),
        "--database-url".into(),
        db_url.into(),
        "--nats-url".into(),
        nats_url.into(),
        "--context".into(),
        context.into(),
        "--max-backoff".into(),
        "1s".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// `GET path` on `addr` over a plain socket (the harness's sync code
/// waits with it): `(status, body)`, or `None` when nothing answers.
pub fn http_get_blocking(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Some((status, body.to_owned()))
}

/// One `/metrics` response.
#[derive(Debug, Clone)]
pub struct Scrape(pub String);

impl Scrape {
    /// The value of one series, written as rendered: `name` or `name{l="v"}`.
    pub fn value(&self, series: &str) -> Option<f64> {
        self.0
            .lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (s, v) = l.rsplit_once(' ')?;
                (s == series).then(|| v.parse().ok()).flatten()
            })
    }

    /// Whether any sample of metric `name` is present (histograms by base name).
    pub fn has(&self, name: &str) -> bool {
        self.0.lines().filter(|l| !l.starts_with('#')).any(|l| {
            let sample = l.split(['{', ' ']).next().unwrap_or_default();
            sample == name
                || ["_bucket", "_sum", "_count"]
                    .iter()
                    .any(|s| sample.strip_suffix(s) == Some(name))
        })
    }
}

/// A message as read back from the stream.
#[derive(Debug, Clone)]
pub struct Got {
    pub subject: String,
    pub headers: HashMap<String, String>,
    pub payload: Vec<u8>,
}

impl Got {
    pub fn h(&self, k: &str) -> Option<&str> {
        self.headers.get(k).map(String::as_str)
    }
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.payload).unwrap_or(serde_json::Value::Null)
    }
}

/// How many messages the stream holds now.
pub async fn stream_messages(nats_url: &str, stream: &str) -> u64 {
    let js = jetstream::new(async_nats::connect(nats_url).await.unwrap());
    let mut s = js.get_stream(stream).await.unwrap();
    s.info().await.unwrap().state.messages
}

/// Wait until the stream holds `expected` messages (or `timeout`) and its
/// count has stopped changing (so duplicates would show), then read it in order.
pub async fn read_stream(
    nats_url: &str,
    stream: &str,
    expected: u64,
    timeout: Duration,
) -> Vec<Got> {
    let client = async_nats::connect(nats_url).await.unwrap();
    read_stream_with(client, stream, expected, timeout).await
}

/// [`read_stream`] over a client the test connected itself (TLS, auth).
pub async fn read_stream_with(
    client: async_nats::Client,
    stream: &str,
    expected: u64,
    timeout: Duration,
) -> Vec<Got> {
    let js = jetstream::new(client);
    let deadline = Instant::now() + timeout;
    // The count must then hold still this long: a replay republishes from the
    // slot's position forward, so its duplicates are stored before anything
    // newer, and once every expected event is in, a short calm shows them.
    const QUIET: Duration = Duration::from_millis(500);
    let mut last: Option<(u64, Instant)> = None;
    loop {
        if let Ok(mut s) = js.get_stream(stream).await {
            let count = s.info().await.unwrap().state.messages;
            match last {
                Some((c, since)) if c == count => {
                    if count >= expected && since.elapsed() >= QUIET {
                        break;
                    }
                }
                _ => last = Some((count, Instant::now())),
            }
        }
        if Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut s = js.get_stream(stream).await.unwrap();
    let total = s.info().await.unwrap().state.messages;
    if total == 0 {
        return Vec::new();
    }
    let consumer = s
        .create_consumer(consumer::pull::OrderedConfig::default())
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::with_capacity(total as usize);
    while (out.len() as u64) < total {
        let m = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .expect("stream read stalled")
            .unwrap()
            .unwrap();
        let headers = m
            .headers
            .as_ref()
            .map(|h| {
                h.iter()
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            v.first().map(|v| v.to_string()).unwrap_or_default(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.push(Got {
            subject: m.subject.to_string(),
            headers,
            payload: m.payload.to_vec(),
        });
    }
    out
}

/// Insert `n` events in one transaction for `producer`, numbered from `seq`.
pub async fn insert_txn(
    pool: &PgPool,
    producer: u32,
    seq: u64,
    n: u64,
    pad: usize,
) -> Vec<uuid::Uuid> {
    try_insert_txn(pool, producer, seq, n, pad).await.unwrap()
}

/// Like [`insert_txn`], but a failed commit is the caller's to handle.
pub async fn try_insert_txn(
    pool: &PgPool,
    producer: u32,
    seq: u64,
    n: u64,
    pad: usize,
) -> Result<Vec<uuid::Uuid>, sqlx::Error> {
    let ids: Vec<uuid::Uuid> = (0..n).map(|_| uuid::Uuid::new_v4()).collect();
    let mut tx = pool.begin().await?;
    // One multi-row statement: rows keep their order inside the transaction.
    let mut q = sqlx::QueryBuilder::new(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) ",
    );
    let padding = "x".repeat(pad);
    q.push_values(ids.iter().enumerate(), |mut b, (i, id)| {
        let s = seq + i as u64;
        b.push_bind(*id)
            .push_bind("order")
            .push_bind(format!("p{producer}-{}", s % 50))
            .push_bind("placed")
            .push_bind(serde_json::json!({"p": producer, "s": s, "pad": padding}));
    });
    q.build().execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(ids)
}

/// Producer inserting `total` events in transactions of 10 at about `rate`/s until done or stopped.
pub fn spawn_producer(
    pool: sqlx::PgPool,
    total: u64,
    rate: u64,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinHandle<HashSet<uuid::Uuid>> {
    tokio::spawn(async move {
        let mut sent = HashSet::new();
        let mut seq = 0;
        let per_txn = 10;
        let interval = Duration::from_micros(1_000_000 * per_txn / rate);
        let mut tick = tokio::time::interval(interval);
        while seq < total && !stop.load(std::sync::atomic::Ordering::Relaxed) {
            tick.tick().await;
            sent.extend(insert_txn(&pool, 0, seq, per_txn, 32).await);
            seq += per_txn;
        }
        sent
    })
}

/// The stream's first `total` messages, read one by one by sequence, each
/// read retried until `timeout` (a cluster still settling after a node
/// restart, where an ordered consumer can stall for good).
pub async fn read_stream_by_seq(
    js: &jetstream::Context,
    stream: &str,
    total: u64,
    timeout: Duration,
) -> Vec<Got> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::with_capacity(total as usize);
    for seq in 1..=total {
        let m = loop {
            let read = async {
                js.get_stream(stream)
                    .await
                    .ok()?
                    .get_raw_message(seq)
                    .await
                    .ok()
            };
            match read.await {
                Some(m) => break m,
                None if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
                None => panic!("message {seq} of {stream} not readable within {timeout:?}"),
            }
        };
        got.push(Got {
            subject: m.subject.to_string(),
            headers: m
                .headers
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        v.first().map(|v| v.to_string()).unwrap_or_default(),
                    )
                })
                .collect(),
            payload: m.payload.to_vec(),
        });
    }
    got
}

/// Every id exactly once, commit order (LSN non-decreasing, index 0.. in a
/// transaction) and per-producer sequence increasing.
pub fn assert_exactly_once_in_order(got: &[Got], sent: &HashSet<uuid::Uuid>) {
    let mut seen = HashSet::new();
    for g in got {
        let id = g.h(wire::MSG_ID).expect(wire::MSG_ID);
        let id = uuid::Uuid::parse_str(id).unwrap();
        assert!(seen.insert(id), "duplicate event {id} in the stream");
    }
    let missing = sent.difference(&seen).count();
    let extra = seen.difference(sent).count();
    assert_eq!(
        (missing, extra),
        (0, 0),
        "{missing} events missing, {extra} unexpected"
    );

    let mut last_pos: Option<(u64, u32)> = None;
    let mut last_seq: HashMap<u64, u64> = HashMap::new();
    // Where an order check fails: the messages around it, by stream position.
    let around = |at: usize| -> String {
        got.iter()
            .enumerate()
            .skip(at.saturating_sub(3))
            .take(6)
            .map(|(n, g)| {
                format!(
                    "\n  #{} {} {}#{}",
                    n + 1,
                    g.h(wire::MSG_ID).unwrap_or("?"),
                    g.h(wire::COMMIT_LSN).unwrap_or("?"),
                    g.h(wire::TXN_INDEX).unwrap_or("?")
                )
            })
            .collect()
    };
    for (n, g) in got.iter().enumerate() {
        let lsn = lsn(g.h(wire::COMMIT_LSN).unwrap());
        let idx: u32 = g.h(wire::TXN_INDEX).unwrap().parse().unwrap();
        match last_pos {
            Some((l, i)) if l == lsn => assert_eq!(
                idx,
                i + 1,
                "transaction split or reordered at {lsn:x}:{}",
                around(n)
            ),
            Some((l, _)) => {
                assert!(
                    lsn > l,
                    "commit order broken: {lsn:x} after {l:x}:{}",
                    around(n)
                );
                assert_eq!(
                    idx,
                    0,
                    "transaction does not start at index 0:{}",
                    around(n)
                );
            }
            None => {}
        }
        last_pos = Some((lsn, idx));
        let v = g.json();
        if let (Some(p), Some(s)) = (v["p"].as_u64(), v["s"].as_u64()) {
            if let Some(prev) = last_seq.insert(p, s) {
                assert!(s > prev, "producer {p}: seq {s} after {prev}");
            }
        }
    }
}

/// `16/B374D848` as a number, with the crate's own parser.
pub fn lsn(s: &str) -> u64 {
    pgwire_replication::Lsn::parse(s).unwrap().as_u64()
}

pub async fn slot_confirmed(pool: &PgPool, slot: &str) -> Option<u64> {
    let s: Option<String> = sqlx::query_scalar(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .unwrap()
    .flatten();
    s.as_deref().map(lsn)
}

/// Wait for a condition, polling; panics with `what` after `timeout`.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A nats-server of the test's own (for restart tests), on a free port.
pub struct OwnNats {
    pub child: Option<Child>,
    pub url: String,
    port: u16,
    dir: PathBuf,
    bin: String,
    extra: Vec<String>,
}

impl OwnNats {
    pub fn start(stack: &Stack, name: &str) -> OwnNats {
        Self::start_with(stack, name, &[])
    }

    /// A nats-server of release `version`, installed by `stack.sh nats-bin`
    /// like the stack's own.
    pub fn start_version(stack: &Stack, name: &str, version: &str) -> OwnNats {
        let bin = stack_tool("nats-bin", &[("NATS_SERVER_VERSION", version)]);
        Self::start_bin(stack, name, &bin)
    }

    /// The nats-server binary at `bin`.
    pub fn start_bin(stack: &Stack, name: &str, bin: &str) -> OwnNats {
        let mut n = Self::start_with(stack, name, &[]);
        n.down();
        n.bin = bin.to_owned();
        n.up();
        n
    }

    /// With extra nats-server arguments (authentication, say).
    pub fn start_with(stack: &Stack, name: &str, extra: &[&str]) -> OwnNats {
        let port = free_port();
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("nats-{name}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut n = OwnNats {
            child: None,
            url: format!("nats://127.0.0.1:{port}"),
            port,
            dir,
            bin: stack.nats_bin.clone(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        n.up();
        n
    }

    pub fn up(&mut self) {
        let child = Command::new(&self.bin)
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string(), "-js"])
            .args(&self.extra)
            .arg("-sd")
            .arg(self.dir.join("store"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        wait_listening(self.port, || "own nats-server did not start".into());
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// Where JetStream keeps its files (`-sd`).
    pub fn store(&self) -> PathBuf {
        self.dir.join("store")
    }

    /// Stop it (SIGTERM, as an orchestrator would) and wait.
    pub fn down(&mut self) {
        if let Some(mut c) = self.child.take() {
            signal(c.id(), "TERM");
            let _ = c.wait();
        }
    }
}

impl Drop for OwnNats {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `stack.sh {up} DIR` on a fresh DIR (what an earlier run left there is
/// stopped with `{down}` and removed), with `env` set; then DIR/env's exports.
fn stack_sh_up(
    up: &str,
    down: &str,
    dir: &std::path::Path,
    env: &[(&str, String)],
) -> HashMap<String, String> {
    let _ = Command::new(STACK_SH).arg(down).arg(dir).status();
    let _ = std::fs::remove_dir_all(dir);
    let out = Command::new(STACK_SH)
        .arg(up)
        .arg(dir)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "stack.sh {up} {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read_to_string(dir.join("env"))
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.trim_matches('\'').to_owned()))
        .collect()
}

/// A Postgres + NATS stack of the test's own from `scripts/stack.sh up`
/// (with `tls`, `STACK_TLS=1`), for tests that restart or reconfigure it.
/// Stopped on drop.
pub struct OwnStack {
    dir: PathBuf,
    env: HashMap<String, String>,
}

impl OwnStack {
    pub fn up(name: &str, tls: bool) -> Self {
        Self::up_with(name, &[("STACK_TLS", if tls { "1" } else { "0" })])
    }

    /// With `stack.sh up`'s settings (`STACK_PG_MAJOR`, say) in `env`.
    pub fn up_with(name: &str, env: &[(&str, &str)]) -> Self {
        // Outside the checkout: run as root, Postgres runs as an unprivileged
        // user, who cannot enter a private (0700) checkout.
        let dir = std::env::temp_dir().join(format!("outbox-relay-{name}-{}", std::process::id()));
        let mut settings = vec![
            // The main stack's nats-server, already installed.
            ("NATS_SERVER_BIN", stack().nats_bin),
        ];
        settings.extend(env.iter().map(|(k, v)| (*k, v.to_string())));
        let env = stack_sh_up("up", "down", &dir, &settings);
        OwnStack { dir, env }
    }

    pub fn get(&self, k: &str) -> &str {
        &self.env[k]
    }

    /// Restart its Postgres; `immediate` is a crash with recovery on start.
    pub fn pg_restart(&self, mode: &str) {
        let st = Command::new(STACK_SH)
            .arg("pg-restart")
            .arg(&self.dir)
            .arg(mode)
            .status()
            .unwrap();
        assert!(st.success(), "pg-restart {mode} failed");
    }
}

impl OwnStack {
    /// Stop (`pg-stop`) or start (`pg-start`) its Postgres.
    pub fn pg_power(&self, action: &str) {
        self.pg_power_mode(action, "fast");
    }

    /// [`pg_power`](Self::pg_power) with `pg_ctl`'s stop mode (`immediate`:
    /// a crash, as a failover sees the old primary).
    pub fn pg_power_mode(&self, action: &str, mode: &str) {
        let st = Command::new(STACK_SH)
            .arg(action)
            .arg(&self.dir)
            .arg(mode)
            .status()
            .unwrap();
        assert!(st.success(), "{action} {mode} failed");
    }

    /// A cold copy of its Postgres data directory (`save`), or that copy put
    /// back (`restore`): what a VM or storage snapshot restore does.
    pub fn pg_snapshot(&self, action: &str) {
        let st = Command::new(STACK_SH)
            .arg("pg-snapshot")
            .arg(&self.dir)
            .arg(action)
            .status()
            .unwrap();
        assert!(st.success(), "pg-snapshot {action} failed");
    }
}

impl Drop for OwnStack {
    fn drop(&mut self) {
        let _ = Command::new(STACK_SH).arg("down").arg(&self.dir).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A PostgreSQL primary and a streaming standby (`scripts/stack.sh
/// pg-pair-up`), on 17 or newer one that synchronizes failover slots.
/// Stopped on drop.
pub struct OwnPgPair {
    dir: PathBuf,
    pub primary_url: String,
    pub standby_url: String,
}

impl OwnPgPair {
    /// The run's PostgreSQL major (`STACK_PG_MAJOR` in a matrix run), or
    /// `min_major` where that is older.
    pub fn up(name: &str, min_major: u32) -> Self {
        Self::up_with(name, pg_major().max(min_major), &[])
    }

    /// PostgreSQL `major`, with `stack.sh pg-pair-up`'s settings in `env`.
    pub fn up_with(name: &str, major: u32, env: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(format!("outbox-relay-{name}-{}", std::process::id()));
        let mut settings = vec![("STACK_PG_MAJOR", major.to_string())];
        settings.extend(env.iter().map(|(k, v)| (*k, v.to_string())));
        let env = stack_sh_up("pg-pair-up", "pg-pair-down", &dir, &settings);
        OwnPgPair {
            primary_url: env["PRIMARY_URL"].clone(),
            standby_url: env["STANDBY_URL"].clone(),
            dir,
        }
    }

    /// Crash the primary and promote the standby.
    pub fn failover(&self) {
        let out = Command::new(STACK_SH)
            .arg("pg-failover")
            .arg(&self.dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "failover failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for OwnPgPair {
    fn drop(&mut self) {
        let _ = Command::new(STACK_SH)
            .arg("pg-pair-down")
            .arg(&self.dir)
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `outbox-relay consume` for durable `durable`, then `extra`.
pub fn consume_args(
    db_url: &str,
    nats_url: &str,
    stream: &str,
    durable: &str,
    handler_url: &str,
    extra: &[&str],
) -> Vec<String> {
    [
        "consume",
        "--database-url",
        db_url,
        "--nats-url",
        nats_url,
        "--stream",
        stream,
        "--durable",
        durable,
        "--handler-url",
        handler_url,
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect()
}

const STACK_SH: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack.sh");

/// A 3-node JetStream cluster of the test's own (`scripts/stack.sh
/// nats-cluster-up`), for leader-failure tests. Stopped on drop.
pub struct OwnCluster {
    dir: PathBuf,
    pub url: String,
    /// Per node, the "last msgid mismatch" errors already answered by a
    /// restart (see [`OwnCluster::wait_healthy`]).
    handled_errors: std::sync::Mutex<[usize; 3]>,
}

impl OwnCluster {
    pub fn up(name: &str) -> Self {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
        let env = stack_sh_up(
            "nats-cluster-up",
            "nats-cluster-down",
            &dir,
            &[("NATS_SERVER_BIN", stack().nats_bin)],
        );
        let url = env["NATS_CLUSTER_URL"].clone();
        OwnCluster {
            dir,
            url,
            handled_errors: std::sync::Mutex::new([0; 3]),
        }
    }

    /// A client of all three nodes.
    pub async fn client(&self) -> async_nats::Client {
        let servers: Vec<async_nats::ServerAddr> =
            self.url.split(',').map(|u| u.parse().unwrap()).collect();
        async_nats::ConnectOptions::new()
            .connect(servers)
            .await
            .unwrap()
    }

    /// `kill -9` node `n` (1..=3), or start it again.
    pub fn node(&self, n: usize, action: &str) {
        let st = Command::new(STACK_SH)
            .arg("nats-node")
            .arg(&self.dir)
            .arg(n.to_string())
            .arg(action)
            .env("NATS_SERVER_BIN", stack().nats_bin)
            .status()
            .unwrap();
        assert!(st.success(), "nats-node {n} {action} failed");
    }

    /// Send node `n`'s process a signal (`STOP`, `CONT`).
    pub fn signal(&self, n: usize, sig: &str) {
        let pid: u32 = std::fs::read_to_string(self.dir.join(format!("n{n}.pid")))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        signal(pid, sig);
    }

    /// The node leading `stream`, once it has one (panics after `timeout`).
    pub async fn wait_leader(
        &self,
        js: &jetstream::Context,
        stream: &str,
        timeout: Duration,
    ) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(n) = self.leader(js, stream).await {
                return n;
            }
            assert!(Instant::now() < deadline, "stream {stream} has no leader");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Whether `stream` has a leader and both followers are current: what
    /// an operator waits for before taking another node down.
    pub async fn healthy(&self, js: &jetstream::Context, stream: &str) -> bool {
        let Ok(mut s) = js.get_stream(stream).await else {
            return false;
        };
        let Ok(info) = s.info().await else {
            return false;
        };
        info.cluster.as_ref().is_some_and(|c| {
            c.leader.is_some()
                && c.replicas.len() == 2
                && c.replicas.iter().all(|r| r.current && !r.offline)
        })
    }

    /// Wait until [`healthy`](Self::healthy); on timeout, fail with each
    /// replica's state and the tail of every node's log.
    ///
    /// nats-server 2.15 can leave a restarted replica unable to apply the
    /// relay's `Nats-Expected-Last-Msg-Id` publishes after a snapshot catchup
    /// ("critical write error: last msgid mismatch": the follower re-checks
    /// the header against a last id the catchup did not restore). It then
    /// never becomes current. The operator's remedy, restarting that node,
    /// is applied here once per node, and said.
    pub async fn wait_healthy(&self, js: &jetstream::Context, stream: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let errors = |n: usize| {
            std::fs::read_to_string(self.dir.join(format!("n{n}.log")))
                .unwrap_or_default()
                .matches("last msgid mismatch")
                .count()
        };
        while !self.healthy(js, stream).await {
            for n in 1..=3 {
                let now = errors(n);
                let mut handled = self.handled_errors.lock().unwrap();
                if now > handled[n - 1] {
                    handled[n - 1] = now;
                    drop(handled);
                    println!(
                        "n{n} cannot apply the stream after its catchup (nats-server: last msgid mismatch); restarting it"
                    );
                    self.node(n, "kill");
                    self.node(n, "start");
                }
            }
            if Instant::now() > deadline {
                let state = async {
                    let mut s = js.get_stream(stream).await.ok()?;
                    Some(format!("{:?}", s.info().await.ok()?.cluster))
                }
                .await;
                let logs: String = (1..=3)
                    .map(|n| {
                        let log = std::fs::read_to_string(self.dir.join(format!("n{n}.log")))
                            .unwrap_or_default();
                        let tail: Vec<&str> = log.lines().rev().take(15).collect();
                        format!(
                            "\n--- n{n}.log (last lines, newest first)\n{}",
                            tail.join("\n")
                        )
                    })
                    .collect();
                panic!("stream {stream} not healthy after {timeout:?}: {state:?}{logs}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The node that leads `stream` now (its server name is `n1`..`n3`).
    pub async fn leader(&self, js: &jetstream::Context, stream: &str) -> Option<usize> {
        let mut s = js.get_stream(stream).await.ok()?;
        let info = s.info().await.ok()?;
        let name = info.cluster.as_ref()?.leader.clone()?;
        name.strip_prefix('n')?.parse().ok()
    }
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        let _ = Command::new(STACK_SH)
            .arg("nats-cluster-down")
            .arg(&self.dir)
            .status();
    }
}

/// Publish `payload` to `subject` with these headers and wait for the ack,
/// as another writer (or the relay) would.
pub async fn publish_with(
    js: &async_nats::jetstream::Context,
    subject: &str,
    headers: &[(&str, &str)],
    payload: &[u8],
) -> async_nats::jetstream::publish::PublishAck {
    let mut h = async_nats::HeaderMap::new();
    for (k, v) in headers {
        h.insert(*k, *v);
    }
    js.send_publish(
        subject.to_owned(),
        async_nats::jetstream::message::PublishMessage::build()
            .payload(payload.to_vec().into())
            .headers(h),
    )
    .await
    .unwrap()
    .await
    .unwrap()
}

/// A schema folder of the test's own: `files` are (path, text).
pub fn schema_dir(name: &str, files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "outbox-relay-schemas-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    for (path, text) in files {
        let p = dir.join(path);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }
    dir
}

/// A TCP proxy on a free loopback port in front of `target` ("host:port"):
/// the way to partition one process from a server while everything else
/// keeps it. [`cut`](Proxy::cut) closes every connection through it and
/// refuses new ones (a peer that says it is gone); [`freeze`](Proxy::freeze)
/// keeps every connection open and lets nothing through (a network that
/// drops packets). [`heal`](Proxy::heal) lets new connections through again.
/// [`delay`](Proxy::delay) holds what the server sends back for a while (a
/// slow but healthy path). [`pause`](Proxy::pause) holds every byte both
/// ways until [`resume`](Proxy::resume), connections kept: a path that
/// stalls for seconds and then carries on, as TCP does after a brief loss.
pub struct Proxy {
    pub port: u16,
    mode: std::sync::Arc<std::sync::atomic::AtomicU8>,
    paused: tokio::sync::watch::Sender<bool>,
    changes: tokio::sync::watch::Sender<u64>,
    /// Milliseconds each chunk from the server waits before it is passed on.
    latency: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Black holes made so far: a connection accepted before the latest
    /// is held silent.
    holes: std::sync::Arc<std::sync::atomic::AtomicU64>,
    trip: Trip,
}

/// Bytes passed from the server so far, and the count at which the proxy
/// pauses itself (`u64::MAX`: never): a pause at a point of a transfer,
/// not of the clock.
#[derive(Clone)]
struct Trip {
    passed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    at: std::sync::Arc<std::sync::atomic::AtomicU64>,
    pauses: tokio::sync::watch::Sender<bool>,
}

impl Trip {
    fn passed(&self, n: usize) {
        use std::sync::atomic::Ordering;
        let total = self.passed.fetch_add(n as u64, Ordering::SeqCst) + n as u64;
        if total >= self.at.load(Ordering::SeqCst) {
            self.at.store(u64::MAX, Ordering::SeqCst);
            self.pauses.send_replace(true);
        }
    }
}

/// Wait while the proxy is paused.
async fn unpaused(paused: &mut tokio::sync::watch::Receiver<bool>) {
    while *paused.borrow_and_update() {
        if paused.changed().await.is_err() {
            return;
        }
    }
}

/// Copy `from` to `to`, nothing passed on while paused.
async fn pausable_copy<R, W>(
    from: &mut R,
    to: &mut W,
    mut paused: tokio::sync::watch::Receiver<bool>,
) where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        unpaused(&mut paused).await;
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
    unpaused(&mut paused).await;
    let _ = to.shutdown().await;
}

/// Copy `from` to `to`, each chunk passed on `latency` ms after it came
/// (and not while paused).
async fn delayed_copy<R, W>(
    from: &mut R,
    to: &mut W,
    latency: &std::sync::atomic::AtomicU64,
    mut paused: tokio::sync::watch::Receiver<bool>,
    trip: &Trip,
) where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut queue: std::collections::VecDeque<(tokio::time::Instant, Vec<u8>)> =
        std::collections::VecDeque::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut open = true;
    loop {
        let due = queue.front().map(|(at, _)| *at);
        tokio::select! {
            n = from.read(&mut buf), if open => match n {
                Ok(0) | Err(_) => open = false,
                Ok(n) => {
                    let wait = Duration::from_millis(latency.load(std::sync::atomic::Ordering::SeqCst));
                    queue.push_back((tokio::time::Instant::now() + wait, buf[..n].to_vec()));
                }
            },
            _ = tokio::time::sleep_until(due.unwrap_or_else(tokio::time::Instant::now)), if due.is_some() => {
                unpaused(&mut paused).await;
                if let Some((_, chunk)) = queue.pop_front() {
                    if to.write_all(&chunk).await.is_err() {
                        return;
                    }
                    trip.passed(chunk.len());
                }
            }
        }
        if !open && queue.is_empty() {
            unpaused(&mut paused).await;
            let _ = to.shutdown().await;
            return;
        }
    }
}

const OPEN: u8 = 0;
const CUT: u8 = 1;
const FROZEN: u8 = 2;

impl Proxy {
    pub async fn start(target: &str) -> Proxy {
        use std::sync::atomic::Ordering;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mode = std::sync::Arc::new(std::sync::atomic::AtomicU8::new(OPEN));
        let latency = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (changes, _) = tokio::sync::watch::channel(0u64);
        let (paused, _) = tokio::sync::watch::channel(false);
        let pauses = paused.clone();
        let (flag, watch, target) = (mode.clone(), changes.clone(), target.to_owned());
        let lag = latency.clone();
        let holes = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let holed = holes.clone();
        let trip = Trip {
            passed: std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0)),
            at: std::sync::Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX)),
            pauses: paused.clone(),
        };
        let tripping = trip.clone();
        // Frozen connections are kept here, open, until the test ends.
        let held = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                match flag.load(Ordering::SeqCst) {
                    CUT => continue,
                    FROZEN => {
                        held.lock().unwrap().push(inbound);
                        continue;
                    }
                    _ => {}
                }
                // Before subscribing: a black hole made between the two is
                // then both seen and newer than the connection.
                let born = holed.load(Ordering::SeqCst);
                let mut changed = watch.subscribe();
                let (target, flag, held, lag, holes, trip) = (
                    target.clone(),
                    flag.clone(),
                    held.clone(),
                    lag.clone(),
                    holed.clone(),
                    tripping.clone(),
                );
                let (up_paused, down_paused) = (pauses.subscribe(), pauses.subscribe());
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    {
                        let (mut in_r, mut in_w) = inbound.split();
                        let (mut out_r, mut out_w) = outbound.split();
                        let up = pausable_copy(&mut in_r, &mut out_w, up_paused);
                        let down = delayed_copy(&mut out_r, &mut in_w, &lag, down_paused, &trip);
                        tokio::select! {
                            _ = async { tokio::join!(up, down) } => return,
                            _ = changed.changed() => {}
                        }
                    }
                    if flag.load(Ordering::SeqCst) == FROZEN || holes.load(Ordering::SeqCst) > born
                    {
                        let mut held = held.lock().unwrap();
                        held.push(inbound);
                        held.push(outbound);
                    }
                });
            }
        });
        Proxy {
            port,
            mode,
            paused,
            changes,
            latency,
            holes,
            trip,
        }
    }

    /// Pause (as [`Proxy::pause`]) once `bytes` more have passed from the
    /// server.
    pub fn pause_after(&self, bytes: u64) {
        use std::sync::atomic::Ordering;
        let now = self.trip.passed.load(Ordering::SeqCst);
        self.trip.at.store(now + bytes, Ordering::SeqCst);
    }

    /// Whether the proxy is paused now.
    pub fn is_paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// The connections open now go silent for ever (held open, no byte
    /// passed either way, no reset: a vanished host); new ones pass.
    pub fn black_hole(&self) {
        self.holes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.changes.send_modify(|n| *n += 1);
    }

    /// `nats://` URL through the proxy.
    pub fn nats_url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// `url` (a Postgres URL on 127.0.0.1) through the proxy instead.
    pub fn pg_url(&self, url: &str) -> String {
        url.replace(&pg_target(url), &format!("127.0.0.1:{}", self.port))
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, std::sync::atomic::Ordering::SeqCst);
        self.changes.send_modify(|n| *n += 1);
    }

    pub fn cut(&self) {
        self.set(CUT);
    }

    pub fn freeze(&self) {
        self.set(FROZEN);
    }

    pub fn heal(&self) {
        self.mode.store(OPEN, std::sync::atomic::Ordering::SeqCst);
    }

    /// Hold every byte, both ways, on every connection, until
    /// [`resume`](Proxy::resume).
    pub fn pause(&self) {
        self.paused.send_replace(true);
    }

    pub fn resume(&self) {
        self.paused.send_replace(false);
    }

    /// From now on, what the server sends waits `latency` before it is
    /// passed on (zero: at once again).
    pub fn delay(&self, latency: Duration) {
        let ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        self.latency.store(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The "127.0.0.1:port" of a Postgres URL.
pub fn pg_target(url: &str) -> String {
    let at = url.find("127.0.0.1:").expect("a Postgres URL on 127.0.0.1");
    let port: String = url[at + 10..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    format!("127.0.0.1:{port}")
}
