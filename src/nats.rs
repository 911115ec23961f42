//! The NATS connection from the flags: servers, TLS (server verification and
//! mutual TLS) and one authentication method. Shared by the relay and the
//! consumer, so both connect, reconnect and report errors the same way.

use std::time::Duration;

use async_nats::jetstream;
use clap::Args;
use futures::StreamExt;

use crate::error::{redact_url, redact_urls, Error, Result};

/// NATS connection: servers, TLS and authentication. Secrets come best from
/// the environment (`NATS_PASSWORD`, `NATS_TOKEN`): `--help` never shows their
/// values, and neither do logs or errors.
#[derive(Clone, Default, Args)]
pub struct NatsArgs {
    /// NATS servers, comma-separated; `tls://` requires TLS.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    pub nats_url: String,

    /// User name for user/password authentication.
    #[arg(long, env = "NATS_USER")]
    pub nats_user: Option<String>,

    /// Password for --nats-user (prefer the environment variable).
    #[arg(long, env = "NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,

    /// Token authentication (prefer the environment variable).
    #[arg(long, env = "NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,

    /// Credentials file (user JWT and NKey seed, as `nsc` writes it).
    #[arg(long, env = "NATS_CREDS")]
    pub nats_creds: Option<std::path::PathBuf>,

    /// CA certificates (PEM) that sign the servers' certificates; implies TLS.
    #[arg(long, env = "NATS_CA")]
    pub nats_ca: Option<std::path::PathBuf>,

    /// Client certificate (PEM) for mutual TLS; needs --nats-tls-key.
    #[arg(long, env = "NATS_TLS_CERT")]
    pub nats_tls_cert: Option<std::path::PathBuf>,

    /// Client private key (PEM) for mutual TLS.
    #[arg(long, env = "NATS_TLS_KEY")]
    pub nats_tls_key: Option<std::path::PathBuf>,

    /// Require TLS even with nats:// URLs.
    #[arg(long, env = "NATS_TLS")]
    pub nats_tls: bool,

    /// TLS before anything else on every NATS connection: for servers
    /// configured with `tls { handshake_first: true }`, which send their
    /// INFO only over TLS. Implies TLS.
    #[arg(long, env = "NATS_TLS_FIRST")]
    pub nats_tls_first: bool,
}

impl std::fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |v: &Option<String>| v.as_ref().map(|_| "<set>");
        f.debug_struct("NatsArgs")
            .field("nats_url", &redact_urls(&self.nats_url))
            .field("nats_user", &self.nats_user)
            .field("nats_password", &set(&self.nats_password))
            .field("nats_token", &set(&self.nats_token))
            .field("nats_creds", &self.nats_creds)
            .field("nats_ca", &self.nats_ca)
            .field("nats_tls_cert", &self.nats_tls_cert)
            .field("nats_tls_key", &self.nats_tls_key)
            .field("nats_tls", &self.nats_tls)
            .finish()
    }
}

impl NatsArgs {
    /// `NATS_URL`: comma-separated servers (a cluster), each parsed; an entry
    /// that does not parse is named (without its credentials).
    pub fn servers(&self) -> Result<Vec<async_nats::ServerAddr>> {
        if self.nats_url.trim().is_empty() {
            return Err(Error::Config("NATS_URL is empty".into()));
        }
        self.nats_url
            .split(',')
            .map(|entry| {
                let entry = entry.trim();
                if entry.is_empty() {
                    return Err(Error::Config(format!(
                        "NATS_URL {:?} has an empty entry (a stray comma?)",
                        redact_urls(&self.nats_url)
                    )));
                }
                entry.parse().map_err(|e| {
                    Error::Config(format!(
                        "NATS_URL entry {:?}: {e} (expected comma-separated nats://host:port or tls://host:port)",
                        redact_url(entry)
                    ))
                })
            })
            .collect()
    }

    /// Contradictions and missing files, reported before connecting.
    pub fn validate(&self) -> Result<()> {
        self.servers()?;
        match (&self.nats_user, &self.nats_password) {
            (Some(_), None) => {
                return Err(Error::Config(
                    "--nats-user needs a password (NATS_PASSWORD)".into(),
                ))
            }
            (None, Some(_)) => {
                return Err(Error::Config(
                    "NATS_PASSWORD is set without --nats-user (NATS_USER)".into(),
                ))
            }
            _ => {}
        }
        let methods = [
            self.nats_user.is_some(),
            self.nats_token.is_some(),
            self.nats_creds.is_some(),
        ];
        if methods.iter().filter(|m| **m).count() > 1 {
            return Err(Error::Config(
                "choose one NATS authentication: user/password, token or credentials file".into(),
            ));
        }
        if self.nats_tls_cert.is_some() != self.nats_tls_key.is_some() {
            return Err(Error::Config(
                "--nats-tls-cert and --nats-tls-key go together".into(),
            ));
        }
        for (flag, path) in [
            ("--nats-creds", &self.nats_creds),
            ("--nats-ca", &self.nats_ca),
            ("--nats-tls-cert", &self.nats_tls_cert),
            ("--nats-tls-key", &self.nats_tls_key),
        ] {
            if let Some(p) = path {
                if !p.is_file() {
                    return Err(Error::Config(format!(
                        "{flag} {}: not a readable file",
                        p.display()
                    )));
                }
            }
        }
        Ok(())
    }
}

/// What a stream holds now (its info, asked once).
pub async fn stream_state(
    stream: &mut async_nats::jetstream::stream::Stream,
) -> Result<async_nats::jetstream::stream::State> {
    Ok(stream
        .info()
        .await
        .map_err(Error::nats("reading stream info"))?
        .state
        .clone())
}

/// The nats-server lines SPEC §15 supports, each tested.
pub const SUPPORTED: &str = "2.10, 2.11, 2.12, 2.14, 2.15";

/// The newest patch release of each supported line that fixed a published
/// security advisory (advisories.nats.io, read 2026-11-27), with one advisory
/// it fixed. `None`: the line got no fix for advisories published after its
/// last release, so every release of it is behind.
const SECURITY_FLOORS: &[((u32, u32), Option<u32>, &str)] = &[
    (
        (2, 10),
        None,
        "CVE-2026-33248 (NATS-2026-13), fixed in 2.11.15 and 2.12.6",
    ),
    // 2.11.16 fixed NATS-2026-16 and -18; NATS-2026-26 names no 2.11 release.
    (
        (2, 11),
        None,
        "NATS-2026-26 (MQTT replay past subscribe denies), fixed in 2.12.12 and 2.14.3",
    ),
    (
        (2, 12),
        Some(12),
        "NATS-2026-26 (MQTT replay past subscribe denies)",
    ),
    (
        (2, 14),
        Some(3),
        "NATS-2026-26 (MQTT replay past subscribe denies)",
    ),
];

/// SPEC §15: a server older than 2.10 is refused (one line naming it and
/// the range); one newer than the newest line tested is warned about
/// (`Ok(Some(warning))`), since it may well work, and so is one below its
/// line's last security fix, naming the release that has it.
pub fn check_version(version: &str) -> Result<Option<String>> {
    let mut parts = version
        .split(|c: char| !c.is_ascii_digit())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = match (parts.next(), parts.next()) {
        (Some(major), Some(minor)) => (major, minor),
        _ => {
            return Ok(Some(format!(
                "nats-server reports version {version:?}, which this relay cannot read; it is tested on {SUPPORTED}"
            )))
        }
    };
    let patch = parts.next().unwrap_or(0);
    if (major, minor) < (2, 10) {
        return Err(Error::Config(format!(
            "nats-server {version} is older than 2.10, the oldest this relay supports ({SUPPORTED}): upgrade the server"
        )));
    }
    if (major, minor) > (2, 15) {
        return Ok(Some(format!(
            "nats-server {version} is newer than the lines this relay is tested on ({SUPPORTED}); it may work"
        )));
    }
    let floor = SECURITY_FLOORS
        .iter()
        .find(|(line, _, _)| *line == (major, minor));
    Ok(match floor {
        Some((_, None, advisory)) => Some(format!(
            "nats-server {version}: the {major}.{minor} line has no fix for {advisory}; upgrade to 2.12.12, 2.14.3 or newer"
        )),
        Some((_, Some(fixed), advisory)) if patch < *fixed => Some(format!(
            "nats-server {version} is below {major}.{minor}.{fixed}, the line's last security release ({advisory}); upgrade to {major}.{minor}.{fixed} or newer"
        )),
        _ => None,
    })
}

/// The client pings a server it has not heard from for this long, and
/// leaves the connection for a new one when the third ping goes
/// unanswered: a path gone silent without a reset (a vanished host, a
/// dropped route) is left after about 18 s, where async-nats' default
/// (60 s) took three minutes and stalled every request meanwhile.
const PING_INTERVAL: Duration = Duration::from_secs(6);

/// Connect (reconnecting forever afterwards) with settings that passed
/// [`NatsArgs::validate`] (the commands' `validate` runs it). `name` shows in
/// the server's connection list. Errors name the servers without credentials.
pub async fn connect(args: &NatsArgs, name: String) -> Result<async_nats::Client> {
    let servers = redact_urls(&args.nats_url);
    let mut opts = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .ping_interval(PING_INTERVAL)
        .max_reconnects(None);
    if let Some(ca) = &args.nats_ca {
        opts = opts.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let (Some(cert), Some(key)) = (&args.nats_tls_cert, &args.nats_tls_key) {
        opts = opts.add_client_certificate(cert.clone(), key.clone());
    }
    if args.nats_tls {
        opts = opts.require_tls(true);
    }
    if args.nats_tls_first {
        opts = opts.require_tls(true).tls_first();
    }
    if let (Some(user), Some(pass)) = (&args.nats_user, &args.nats_password) {
        opts = opts.user_and_password(user.clone(), pass.clone());
    }
    if let Some(token) = &args.nats_token {
        opts = opts.token(token.clone());
    }
    if let Some(creds) = &args.nats_creds {
        opts = opts
            .credentials_file(creds)
            .await
            .map_err(|e| Error::Config(format!("--nats-creds {}: {e}", creds.display())))?;
    }
    opts.connect(args.servers()?).await.map_err(|e| {
        // The library's error may echo what it was given: only its redacted
        // text travels on, never the error itself.
        let text = redact_text(&e.to_string(), args);
        Error::NatsConnect {
            servers,
            source: Box::new(std::io::Error::other(text)),
        }
    })
}

/// How long a process on its way out waits for NATS to take what it wrote.
const FLUSH_ON_EXIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Flush before exiting, bounded: with the server gone, async-nats' flush
/// waits for a reconnect that may never come, and a SIGTERM must still end
/// the process. Nothing a guarantee rests on waits here: what was not acked
/// is published again (relay) or delivered again (consumer).
pub async fn flush_on_exit(client: &async_nats::Client) {
    if tokio::time::timeout(FLUSH_ON_EXIT, client.flush())
        .await
        .is_err()
    {
        tracing::warn!("NATS did not answer the last flush; exiting without it");
    }
}

/// An error text with any configured secret blanked out, in case a library
/// echoes what it was given.
fn redact_text(text: &str, args: &NatsArgs) -> String {
    let mut out = text.to_owned();
    for secret in [&args.nats_password, &args.nats_token]
        .into_iter()
        .flatten()
    {
        if !secret.is_empty() {
            out = out.replace(secret.as_str(), "***");
        }
    }
    out
}

/// The header block's size on the wire ([`crate::wire::header_block_size`]).
pub fn header_size(headers: &async_nats::HeaderMap) -> usize {
    crate::wire::header_block_size(
        headers
            .iter()
            .flat_map(|(k, vs)| vs.iter().map(move |v| (k.as_ref(), v.as_str()))),
    )
}

/// Whether the server resets a consumer in place (ADR-60, nats-server
/// 2.14 and later).
pub fn resets_consumers(client: &async_nats::Client) -> bool {
    let version = client.server_info().version;
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (2, 14)
}

/// How many messages `stream` holds on `subjects` (a filter): a dead-letter
/// stream's depth. A stream made for the filter alone answers from its
/// state; one that captures more counts the filter's subjects.
pub async fn depth(js: &jetstream::Context, stream: &str, subjects: &str) -> Result<u64> {
    let s = js
        .get_stream(stream)
        .await
        .map_err(Error::nats(format!("looking up stream {stream}")))?;
    let info = s.cached_info();
    if info.config.subjects.len() == 1 && info.config.subjects[0] == subjects {
        return Ok(info.state.messages);
    }
    let mut counts = s
        .info_with_subjects(subjects)
        .await
        .map_err(Error::nats(format!("counting {subjects} in {stream}")))?;
    let mut n = 0u64;
    while let Some(c) = counts.next().await {
        let (_, count) = c.map_err(Error::nats(format!("counting {subjects} in {stream}")))?;
        n += count as u64;
    }
    Ok(n)
}

/// How often a dead-letter stream's depth is counted.
const DEPTH_TICK: Duration = Duration::from_secs(5);

/// Keep `outbox_dlq_messages{stream, subject}` current until `stop`. A
/// failed count leaves the last figure (the gauge says what was last
/// known; `up` and the process's own alerts say it is unreachable).
pub async fn watch_depth(
    js: jetstream::Context,
    stream: String,
    subjects: String,
    stop: tokio_util::sync::CancellationToken,
) {
    let gauge = metrics::gauge!(
        crate::metrics::DLQ_MESSAGES,
        "stream" => stream.clone(),
        "subject" => subjects.clone()
    );
    let mut tick = tokio::time::interval(DEPTH_TICK);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match tokio::time::timeout(Duration::from_secs(5), depth(&js, &stream, &subjects)).await {
            Ok(Ok(n)) => {
                gauge.set(n as f64);
                failing = false;
            }
            Ok(Err(e)) if !failing => {
                tracing::warn!(%stream, %subjects, error = %e, "cannot count dead letters");
                failing = true;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod version_tests {
    use super::check_version;

    #[test]
    fn old_servers_are_refused_and_newer_ones_warned_about() {
        for ok in ["2.12.12", "2.14.3", "2.14.6", "2.15.0", "2.15.1"] {
            assert_eq!(check_version(ok).unwrap(), None, "{ok}");
        }
        let e = check_version("2.9.25").unwrap_err().to_string();
        assert!(e.contains("2.9.25") && e.contains("2.10, 2.11"), "{e}");
        assert!(check_version("1.4.0").is_err());
        assert!(check_version("2.16.0")
            .unwrap()
            .unwrap()
            .contains("may work"));
        assert!(check_version("3.0.0").unwrap().unwrap().contains("newer"));
        assert!(check_version("dev").unwrap().is_some());
    }

    #[test]
    fn a_release_below_its_lines_last_security_fix_is_warned_about_naming_it() {
        let w = |v: &str| check_version(v).unwrap().unwrap_or_default();
        for v in ["2.11.11", "2.11.16"] {
            assert!(w(v).contains("2.11 line has no fix"), "{}", w(v));
            assert!(w(v).contains("upgrade to 2.12.12, 2.14.3"), "{}", w(v));
        }
        assert!(
            w("2.12.8").contains("upgrade to 2.12.12"),
            "{}",
            w("2.12.8")
        );
        assert!(w("2.14.2").contains("2.14.3"), "{}", w("2.14.2"));
        assert!(w("v2.14.0-beta").contains("2.14.3"));
        for old in ["2.10.0", "2.10.26", "2.10.99"] {
            assert!(w(old).contains("2.10 line has no fix"), "{}", w(old));
        }
    }
}
