//! Is an acked event durable? (SPEC §14.) The relay confirms the slot once
//! JetStream acked an event; after that the event lives only in the stream.
//! A one-replica file stream whose server fsyncs every `sync_interval`
//! (two minutes by default) loses what it acked since the last sync to an
//! OS crash or power loss (Jepsen, NATS 2.12.1). Three replicas survive
//! one server's crash and keep taking events (two would lose quorum);
//! one replica only with `sync_interval: always`, which the relay can read
//! from the server's monitoring port.

use std::time::Duration;

use crate::error::{Error, Result};

/// What the relay found, and why, in one line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Durability {
    pub durable: bool,
    pub why: String,
}

/// A stream as the judgement needs it: where its data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub stream: String,
    pub replicas: usize,
    /// File storage (else memory).
    pub file: bool,
    /// The server leading the stream (`cluster.leader` of its info): for
    /// one replica, the only server holding it.
    pub server: Option<String>,
}

impl Placement {
    pub fn of(info: &async_nats::jetstream::stream::Info) -> Self {
        Self {
            stream: info.config.name.clone(),
            replicas: info.config.num_replicas,
            file: info.config.storage == async_nats::jetstream::stream::StorageType::File,
            server: info.cluster.as_ref().and_then(|c| c.leader.clone()),
        }
    }
}

/// What the monitoring ports (`--nats-monitor-url`, one per server)
/// said: each server's name and whether it fsyncs every write.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Servers {
    pub read: Vec<(String, bool)>,
    /// The URLs that could not be read, with why.
    pub failed: Vec<String>,
}

impl Servers {
    /// `sync_always` is per server (review U2): the setting that counts is
    /// the one of the server holding the stream's one replica.
    fn sync_always(&self, server: Option<&str>) -> Option<bool> {
        match server {
            // Two servers read under one name (two clusters, a URL given
            // twice) that disagree: which holds the stream is unknown.
            Some(name) => {
                let mut said = self.read.iter().filter(|(n, _)| n == name).map(|(_, a)| *a);
                let first = said.next()?;
                said.all(|a| a == first).then_some(first)
            }
            // No placement known (a server that does not say): one server
            // read is the old single-server reading.
            None if self.read.len() == 1 && self.failed.is_empty() => Some(self.read[0].1),
            None => None,
        }
    }

    fn unknown_why(&self, server: Option<&str>) -> String {
        let held = server.map_or_else(|| "its server".to_owned(), |s| format!("server {s}"));
        if self.read.is_empty() && self.failed.is_empty() {
            return "the server's sync_interval is unknown (pass --nats-monitor-url)".to_owned();
        }
        let read: Vec<&str> = self.read.iter().map(|(n, _)| n.as_str()).collect();
        let mut why = format!(
            "{held} holds it, and its sync_interval is unknown: it is not among the servers --nats-monitor-url read ({})",
            if read.is_empty() { "none".to_owned() } else { read.join(", ") }
        );
        if !self.failed.is_empty() {
            why.push_str(&format!("; unread: {}", self.failed.join("; ")));
        }
        why.push_str("; give every server's monitoring URL, comma-separated");
        why
    }
}

/// Pure: is an event acked by this stream durable, given what the
/// monitoring ports said?
pub fn judge(p: &Placement, servers: &Servers) -> Durability {
    let stream = &p.stream;
    let (durable, why) = match (p.replicas, p.file) {
        (r, _) if r >= 3 => (
            true,
            format!("stream {stream} has {r} replicas: an acked event survives one server's crash"),
        ),
        (2, _) => (
            false,
            format!("stream {stream} has 2 replicas: one server's crash stops it taking events (no quorum) and one more loses what it acked; use 3"),
        ),
        (_, false) => (
            false,
            format!("stream {stream} is one replica in memory: an acked event is lost when its server stops; use 3 replicas"),
        ),
        (_, true) => match servers.sync_always(p.server.as_deref()) {
            Some(true) => (
                true,
                format!("stream {stream} is one replica on a server with sync_interval: always"),
            ),
            Some(false) => (
                false,
                format!("stream {stream} is one replica, and its server fsyncs every sync_interval (not always): events acked since the last sync are lost to an OS crash or power loss; use 3 replicas, or set jetstream {{ sync_interval: always }}"),
            ),
            None => (
                false,
                format!("stream {stream} is one replica, and {}: with the default, events acked since the last sync are lost to an OS crash or power loss; use 3 replicas, or set jetstream {{ sync_interval: always }}", servers.unknown_why(p.server.as_deref())),
            ),
        },
    };
    Durability { durable, why }
}

/// The least durable of the streams: one that loses acked events is
/// enough to lose them.
pub fn judge_all<'a>(
    first: &Placement,
    others: impl IntoIterator<Item = &'a Placement>,
    servers: &Servers,
) -> Durability {
    let mut worst = judge(first, servers);
    for p in others {
        let d = judge(p, servers);
        if worst.durable && !d.durable {
            worst = d;
        }
    }
    worst
}

/// Read every monitoring URL (`/varz`): the server's name and its
/// `jetstream.config.sync_always`. A URL that cannot be read is kept
/// with why, not an error: unknown is not "not durable".
pub async fn read_servers(urls: &[String]) -> Servers {
    let mut servers = Servers::default();
    for url in urls {
        match read_varz(url).await {
            Ok(one) => servers.read.push(one),
            Err(e) => servers.failed.push(e.to_string()),
        }
    }
    servers
}

async fn read_varz(monitor_url: &str) -> Result<(String, bool)> {
    let url = format!("{}/varz", monitor_url.trim_end_matches('/'));
    // Logged at every session start while the port is down: never with
    // the URL's password (reqwest's errors carry the URL, so without it).
    let shown = crate::error::redact_url(&url);
    let failed = |e: String| Error::setup(format!("--nats-monitor-url: reading {shown}: {e}"));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| failed(e.to_string()))?;
    let body = client
        .get(&url)
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| failed(e.without_url().to_string()))?
        .bytes()
        .await
        .map_err(|e| failed(e.without_url().to_string()))?;
    let varz: serde_json::Value =
        serde_json::from_slice(&body).map_err(|e| failed(format!("not JSON: {e}")))?;
    let name = varz["server_name"]
        .as_str()
        .or_else(|| varz["server_id"].as_str())
        .unwrap_or_default()
        .to_owned();
    // A server still starting says no JetStream section yet: unknown, not
    // "fsyncs every interval" (the setting is left out when false).
    let config = &varz["jetstream"]["config"];
    if !config.is_object() {
        return Err(failed(
            "no JetStream configuration in /varz (is JetStream on, the server started?)".into(),
        ));
    }
    Ok((name, config["sync_always"].as_bool().unwrap_or(false)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placed(replicas: usize, file: bool, server: Option<&str>) -> Placement {
        Placement {
            stream: "S".into(),
            replicas,
            file,
            server: server.map(str::to_owned),
        }
    }

    fn servers(read: &[(&str, bool)]) -> Servers {
        Servers {
            read: read.iter().map(|(n, a)| ((*n).to_owned(), *a)).collect(),
            failed: Vec::new(),
        }
    }

    #[tokio::test]
    async fn a_monitor_url_password_never_reaches_the_error() {
        let s = read_servers(&["http://relay:s3cret@127.0.0.1:1".to_owned()]).await;
        let e = s.failed.join("; ");
        assert!(!e.contains("s3cret") && e.contains("127.0.0.1:1"), "{e}");
    }

    #[test]
    fn replicas_or_sync_always_make_an_ack_durable() {
        let none = Servers::default();
        assert!(judge(&placed(3, true, None), &none).durable);
        assert!(
            judge(&placed(3, false, None), &none).durable,
            "R3 in memory: one crash"
        );
        assert!(
            !judge(&placed(2, true, None), &none).durable,
            "SPEC §14: R3"
        );
        let a_always = servers(&[("A", true)]);
        assert!(judge(&placed(1, true, Some("A")), &a_always).durable);
        assert!(judge(&placed(1, true, None), &a_always).durable);
        let d = judge(&placed(1, true, Some("A")), &servers(&[("A", false)]));
        assert!(
            !d.durable && d.why.contains("sync_interval: always"),
            "{}",
            d.why
        );
        let d = judge(&placed(1, true, None), &none);
        assert!(
            !d.durable && d.why.contains("--nats-monitor-url"),
            "{}",
            d.why
        );
        assert!(
            !judge(&placed(1, false, Some("A")), &a_always).durable,
            "memory"
        );
    }

    /// Review U2: the setting read must be the one of the server holding
    /// the one replica.
    #[test]
    fn sync_always_counts_only_on_the_server_holding_the_replica() {
        let d = judge(&placed(1, true, Some("B")), &servers(&[("A", true)]));
        assert!(
            !d.durable
                && d.why.contains("server B")
                && d.why.contains("not among")
                && d.why.contains("(A)"),
            "{}",
            d.why
        );
        let both = servers(&[("A", true), ("B", false)]);
        assert!(!judge(&placed(1, true, Some("B")), &both).durable);
        assert!(judge(&placed(1, true, Some("A")), &both).durable);
        // Two servers read and no placement: which one is unknown.
        assert!(!judge(&placed(1, true, None), &both).durable);
        // One name, two answers: unknown, whatever the order.
        for read in [[("A", true), ("A", false)], [("A", false), ("A", true)]] {
            assert!(!judge(&placed(1, true, Some("A")), &servers(&read)).durable);
        }
        let unread = Servers {
            read: Vec::new(),
            failed: vec!["--nats-monitor-url: reading http://b/varz: refused".into()],
        };
        let d = judge(&placed(1, true, Some("B")), &unread);
        assert!(!d.durable && d.why.contains("refused"), "{}", d.why);
    }

    #[test]
    fn the_least_durable_stream_is_the_verdict() {
        let a = servers(&[("A", true)]);
        let r3 = placed(3, true, None);
        let mem = Placement {
            stream: "MEM".into(),
            ..placed(1, false, Some("A"))
        };
        let d = judge_all(&r3, [&mem], &a);
        assert!(!d.durable && d.why.contains("MEM"), "{}", d.why);
        assert!(!judge_all(&mem, [&r3], &a).durable);
        assert!(judge_all(&r3, [], &a).durable);
    }
}
