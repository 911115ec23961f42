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

/// Pure: `sync_always` is the server's setting when it could be read.
pub fn judge(stream: &str, replicas: usize, file: bool, sync_always: Option<bool>) -> Durability {
    let (durable, why) = match (replicas, file, sync_always) {
        (r, _, _) if r >= 3 => (
            true,
            format!("stream {stream} has {r} replicas: an acked event survives one server's crash"),
        ),
        (2, _, _) => (
            false,
            format!("stream {stream} has 2 replicas: one server's crash stops it taking events (no quorum) and one more loses what it acked; use 3"),
        ),
        (_, false, _) => (
            false,
            format!("stream {stream} is one replica in memory: an acked event is lost when its server stops; use 3 replicas"),
        ),
        (_, true, Some(true)) => (
            true,
            format!("stream {stream} is one replica on a server with sync_interval: always"),
        ),
        (_, true, Some(false)) => (
            false,
            format!("stream {stream} is one replica, and its server fsyncs every sync_interval (not always): events acked since the last sync are lost to an OS crash or power loss; use 3 replicas, or set jetstream {{ sync_interval: always }}"),
        ),
        (_, true, None) => (
            false,
            format!("stream {stream} is one replica, and the server's sync_interval is unknown (pass --nats-monitor-url): with the default, events acked since the last sync are lost to an OS crash or power loss; use 3 replicas, or set jetstream {{ sync_interval: always }}"),
        ),
    };
    Durability { durable, why }
}

/// The server's `jetstream.config.sync_always` from its monitoring port
/// (`/varz`).
pub async fn sync_always(monitor_url: &str) -> Result<bool> {
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
    Ok(varz["jetstream"]["config"]["sync_always"]
        .as_bool()
        .unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_monitor_url_password_never_reaches_the_error() {
        let e = sync_always("http://relay:s3cret@127.0.0.1:1")
            .await
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret") && e.contains("127.0.0.1:1"), "{e}");
    }

    #[test]
    fn replicas_or_sync_always_make_an_ack_durable() {
        assert!(judge("S", 3, true, None).durable);
        assert!(
            judge("S", 3, false, None).durable,
            "R3 in memory: one crash"
        );
        assert!(!judge("S", 2, true, None).durable, "SPEC §14: R3");
        assert!(judge("S", 1, true, Some(true)).durable);
        let d = judge("S", 1, true, Some(false));
        assert!(
            !d.durable && d.why.contains("sync_interval: always"),
            "{}",
            d.why
        );
        let d = judge("S", 1, true, None);
        assert!(
            !d.durable && d.why.contains("--nats-monitor-url"),
            "{}",
            d.why
        );
        assert!(!judge("S", 1, false, Some(true)).durable, "memory");
    }
}
