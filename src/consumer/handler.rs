//! The service's handler: a Rust trait that runs inside the inbox
//! transaction, and the HTTP handler built on it.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::json::JsonObject;

/// One message as the handler sees it.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// The inbox key: `Nats-Msg-Id` when it is a UUID, else a UUID derived
    /// from it (`wire::message_id`).
    pub message_id: Uuid,
    /// `Nats-Msg-Id` as the handler is given it: the UUID's canonical text,
    /// or a text or integer row id as it is (SPEC §13).
    pub id: String,
    pub subject: String,
    pub event_type: Option<String>,
    pub event_version: Option<i64>,
    pub occurred_at: Option<String>,
    pub correlation_id: Option<String>,
    pub causation_id: Option<String>,
    pub traceparent: Option<String>,
    /// The message body (JSON, checked before the handler is called).
    pub payload: Bytes,
    /// 1 on the first delivery.
    pub delivered: i64,
}

/// What the handler made of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Done (HTTP 200), or already done by the service (HTTP 409).
    Processed,
    /// Will never succeed (HTTP 422): dead-letter it.
    Reject(String),
    /// May succeed later (5xx, other codes, timeout, connection error).
    Retry(String),
}

/// Messages per transaction at most. A savepoint in which the handler wrote
/// gets a subtransaction id, and past 64 of them in one transaction every
/// other session's snapshot has to look them up in `pg_subtrans`.
pub const MAX_GROUP: usize = 32;

/// A handler runs inside the inbox transaction: what it writes through `tx`
/// commits with the inbox row on [`Outcome::Processed`] and rolls back
/// otherwise, so a Rust service gets exactly-once effects.
///
/// Up to 32 messages of different aggregates share one transaction, each
/// call in a savepoint of its own: a failure (or a panic, or a statement
/// error the call swallowed) rolls back that call's writes alone and counts
/// as a failed attempt. Keep in mind:
/// - the calls of a group run one after another, so a slow call delays the
///   rest of its group (up to four groups run at once);
/// - what a call leaves in the transaction beyond its writes (row locks,
///   `SET LOCAL`, `set_config(…, true)`, temporary tables) lasts until the
///   group commits and is seen by the next calls: set what you rely on in
///   every call;
/// - locks held to the group's commit can deadlock two groups; the call
///   that gets the deadlock error fails its attempt and is retried;
/// - a group Postgres refuses (a deferred constraint at commit) runs again
///   one message per transaction, so the others' calls are repeated, their
///   writes having been rolled back.
pub trait Handler: Send + Sync + 'static {
    fn handle(
        &self,
        tx: &mut PgConnection,
        delivery: &Delivery,
    ) -> impl Future<Output = Outcome> + Send;

    /// Whether the handler needs the inbox transaction. One whose effects
    /// live elsewhere (an HTTP service) says no, and the consumer calls
    /// [`handle_detached`](Self::handle_detached) after the claim committed,
    /// holding no connection; a completion that fails to commit is retried
    /// without calling it again.
    fn in_transaction(&self) -> bool {
        true
    }

    /// Messages per shared transaction at most (1 to 32). A handler whose
    /// calls are slow, or that needs a transaction of its own, says 1: each
    /// message then gets its own transaction, and up to half the pool run at
    /// once (with sharing, up to four groups do).
    fn max_group(&self) -> usize {
        MAX_GROUP
    }

    /// The longest a call inside the inbox transaction may take; one that
    /// takes longer fails (and is retried, its writes rolled back). It also
    /// bounds how long a process frozen in a call (SIGSTOP, a VM pause)
    /// holds its inbox rows: Postgres ends a transaction that stays idle
    /// [`IDLE_MARGIN`] longer, so another process can run the message.
    /// A statement of the call is cancelled past it too. `Duration::MAX`
    /// lifts the bound (to about 24 days). A handler that blocks its thread
    /// cannot be stopped at the limit: Postgres then ends the whole group,
    /// whose messages run again.
    fn call_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(30)
    }

    /// The call for a handler that is not [`in_transaction`](Self::in_transaction).
    fn handle_detached(&self, delivery: &Delivery) -> impl Future<Output = Outcome> + Send {
        let _ = delivery;
        async { Outcome::Retry("this handler runs only inside the inbox transaction".into()) }
    }
}

/// How much longer than [`Handler::call_timeout`] a group transaction may
/// stay idle before Postgres ends it: a live process never gets there.
pub const IDLE_MARGIN: std::time::Duration = std::time::Duration::from_secs(5);

/// A call's time limit and the group transaction's idle limit from
/// [`Handler::call_timeout`]: at least 1 ms, and small enough for Postgres's
/// settings (int milliseconds); `Duration::MAX` is about 24 days.
pub fn call_limits(
    call_timeout: std::time::Duration,
) -> (std::time::Duration, std::time::Duration) {
    let most = std::time::Duration::from_millis(i32::MAX as u64) - IDLE_MARGIN;
    let limit = call_timeout.clamp(std::time::Duration::from_millis(1), most);
    (limit, limit + IDLE_MARGIN)
}

/// Run one handler call, timed. A panic is an attempt that failed, counted
/// like any other: left to unwind, it would roll back the claim that counts
/// it, and the message would come back forever, never reaching
/// `--max-deliver` and the DLQ. `make` is called inside the guard too: a
/// handler's `handle` may panic before its future exists.
pub(super) async fn call<F: Future<Output = Outcome>>(make: impl FnOnce() -> F) -> Outcome {
    use futures::FutureExt;
    // Recorded however the call ends: one cut short (its future dropped)
    // is among the slowest, and the figures must not lose it.
    let _timed = Timed(std::time::Instant::now());
    let outcome = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(make)) {
        Ok(work) => std::panic::AssertUnwindSafe(work)
            .catch_unwind()
            .await
            .unwrap_or_else(|panic| panicked(&*panic)),
        Err(panic) => panicked(&*panic),
    };
    outcome
}

/// A handler call's time, into `outbox_consumer_handler_seconds` when it
/// is dropped.
struct Timed(std::time::Instant);

impl Drop for Timed {
    fn drop(&mut self) {
        metrics::histogram!(crate::metrics::CONSUMER_HANDLER_SECONDS)
            .record(self.0.elapsed().as_secs_f64());
    }
}

fn panicked(panic: &(dyn std::any::Any + Send)) -> Outcome {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    Outcome::Retry(format!("the handler panicked: {what}"))
}

/// Header names made once: a `&str` is checked and copied into a new name
/// on every request. HTTP names are case-insensitive and sent in lower
/// case either way (a test ties these to [`crate::wire`]'s).
static IDEMPOTENCY_KEY: reqwest::header::HeaderName =
    reqwest::header::HeaderName::from_static("idempotency-key");
static TRACEPARENT: reqwest::header::HeaderName =
    reqwest::header::HeaderName::from_static("traceparent");

/// `POST` the SPEC §6 JSON to a URL and map the status code.
#[derive(Clone)]
pub struct HttpHandler {
    client: reqwest::Client,
    /// Parsed once: parsing it on every call was 4% of the consumer's CPU.
    url: reqwest::Url,
    /// The URL as errors may show it: no credentials, no query, no
    /// fragment (webhook secrets live there).
    shown: String,
}

impl HttpHandler {
    pub fn new(url: &str, timeout: Duration) -> Result<Self> {
        // The value itself is never echoed: it may hold a secret.
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| Error::Config(format!("--handler-url is not a URL: {e}")))?;
        if parsed.scheme() != "http" {
            return Err(Error::Config(format!(
                "--handler-url: only http:// is supported by this build, not {}://",
                parsed.scheme()
            )));
        }
        // A redirect is an answer like any other non-2xx (a retry, with its
        // code): following one would turn the POST into a GET without body.
        // Plain HTTP only: no root store to load (the system's holds some
        // hundred certificates, a megabyte and more of memory).
        let client = reqwest::Client::builder()
            .tls_built_in_root_certs(false)
            .timeout(timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| Error::Setup {
                message: format!("cannot build the HTTP client: {e}"),
                source: Some(Box::new(e)),
            })?;
        Ok(Self {
            client,
            shown: crate::error::redact_url(parsed.as_str()),
            url: parsed,
        })
    }

    /// The handler's address as logs and errors show it.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    fn body(d: &Delivery) -> Vec<u8> {
        JsonObject::with_capacity(d.payload.len() + 256)
            .str("message_id", &d.id)
            .str("subject", &d.subject)
            .opt_str("event_type", d.event_type.as_deref())
            .opt_int("event_version", d.event_version)
            .opt_str("occurred_at", d.occurred_at.as_deref())
            .opt_str("correlation_id", d.correlation_id.as_deref())
            .opt_str("causation_id", d.causation_id.as_deref())
            .raw("payload", &d.payload)
            .finish()
    }
}

impl Handler for HttpHandler {
    async fn handle(&self, _tx: &mut PgConnection, d: &Delivery) -> Outcome {
        self.post(d).await
    }

    fn in_transaction(&self) -> bool {
        false
    }

    async fn handle_detached(&self, d: &Delivery) -> Outcome {
        self.post(d).await
    }
}

impl HttpHandler {
    /// The call itself; needs no connection.
    pub async fn post(&self, d: &Delivery) -> Outcome {
        use reqwest::header::{HeaderValue, CONTENT_TYPE};
        let mut req = self
            .client
            .post(self.url.clone())
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .header(IDEMPOTENCY_KEY.clone(), d.id.as_str())
            .body(Self::body(d));
        if let Some(tp) = &d.traceparent {
            req = req.header(TRACEPARENT.clone(), tp);
        }
        match req.send().await {
            Ok(resp) => match resp.status().as_u16() {
                200 | 409 => Outcome::Processed,
                422 => Outcome::Reject(format!("handler answered 422: {}", snippet(resp).await)),
                code => Outcome::Retry(format!("handler answered {code}: {}", snippet(resp).await)),
            },
            Err(e) if e.is_timeout() => Outcome::Retry("handler timed out".into()),
            Err(e) => Outcome::Retry(format!(
                "handler unreachable ({}): {}",
                self.shown,
                causes(&e.without_url())
            )),
        }
    }
}

/// An error and its causes, one line (reqwest's own text is terse: "error
/// sending request"; the cause says refused, reset, DNS…).
fn causes(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// How much of an error body `last_error` keeps.
const SNIPPET: usize = 200;

/// The start of a response body, for `last_error`: read only that far (a
/// body may be huge, or never end), control characters made spaces.
async fn snippet(mut resp: reqwest::Response) -> String {
    let mut body = Vec::with_capacity(SNIPPET);
    while body.len() < SNIPPET {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                body.extend_from_slice(&chunk[..chunk.len().min(SNIPPET - body.len())])
            }
            _ => break,
        }
    }
    String::from_utf8_lossy(&body)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_http_header_names_are_the_wire_names() {
        use reqwest::header::HeaderName;
        assert_eq!(
            super::IDEMPOTENCY_KEY,
            HeaderName::try_from(crate::wire::IDEMPOTENCY_KEY).unwrap()
        );
        assert_eq!(
            super::TRACEPARENT,
            HeaderName::try_from(crate::wire::TRACEPARENT).unwrap()
        );
    }

    use super::*;

    #[test]
    fn call_limits_stay_within_what_postgres_takes() {
        use std::time::Duration;
        assert_eq!(
            call_limits(Duration::from_secs(30)),
            (Duration::from_secs(30), Duration::from_secs(35))
        );
        assert_eq!(call_limits(Duration::ZERO).0, Duration::from_millis(1));
        let (limit, idle) = call_limits(Duration::MAX);
        assert_eq!(idle.as_millis(), i32::MAX as u128);
        assert!(limit < idle);
    }

    #[test]
    fn body_is_the_spec_json_with_raw_payload() {
        let d = Delivery {
            message_id: Uuid::nil(),
            id: Uuid::nil().to_string(),
            subject: "a.b".into(),
            event_type: Some("placed".into()),
            event_version: Some(2),
            occurred_at: None,
            correlation_id: Some("c\"1".into()),
            causation_id: None,
            traceparent: None,
            payload: Bytes::from_static(br#"{"x": [1]}"#),
            delivered: 1,
        };
        let v: serde_json::Value = serde_json::from_slice(&HttpHandler::body(&d)).unwrap();
        assert_eq!(v["message_id"], Uuid::nil().to_string());
        assert_eq!(v["event_version"], 2);
        assert_eq!(v["correlation_id"], "c\"1");
        assert!(v["occurred_at"].is_null());
        assert_eq!(v["payload"]["x"][0], 1);
    }

    #[test]
    fn the_shown_url_keeps_no_secret() {
        let h = HttpHandler::new(
            "http://u:pw@127.0.0.1:9/hook?token=abc#frag",
            Duration::from_secs(1),
        )
        .unwrap();
        assert_eq!(h.shown(), "http://***@127.0.0.1:9/hook");
        let Err(e) = HttpHandler::new("ftp://u:pw@x/?token=abc", Duration::from_secs(1)) else {
            panic!("ftp accepted");
        };
        assert!(
            !e.to_string().contains("abc") && !e.to_string().contains("pw"),
            "{e}"
        );
    }

    #[test]
    fn only_http_urls() {
        assert!(HttpHandler::new("http://127.0.0.1:1/h", Duration::from_secs(1)).is_ok());
        assert!(HttpHandler::new("ftp://x", Duration::from_secs(1)).is_err());
        assert!(HttpHandler::new("not a url", Duration::from_secs(1)).is_err());
    }

    /// Found in review: a `handle` that panics before its future exists
    /// killed the group writer that called it.
    #[tokio::test]
    async fn a_panic_before_or_inside_the_call_is_a_failed_attempt() {
        let before = call(|| -> std::future::Ready<Outcome> { panic!("before the future") }).await;
        assert_eq!(
            before,
            Outcome::Retry("the handler panicked: before the future".into())
        );
        let inside = call(|| async { panic!("inside the future") }).await;
        assert_eq!(
            inside,
            Outcome::Retry("the handler panicked: inside the future".into())
        );
        assert_eq!(
            call(|| async { Outcome::Processed }).await,
            Outcome::Processed
        );
    }
}
