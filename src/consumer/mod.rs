//! The consumer: JetStream pull → [`inbox`] → [`handler`] → ACK | NAK |
//! [`dead_letter`].
//!
//! One dispatcher task owns all ordering state ([`scheduler`], pure), so
//! there are no locks; each delivery ([`delivery`]) runs in its own task.
//! Waiting deliveries are kept alive with in-progress acks. A pull stream
//! that ends or fails, or whose client reconnected to another server, is
//! rebuilt (with backoff while that fails); nothing but shutdown ends the
//! consumer once it runs.
//!
//! Shutdown: stop pulling, let running deliveries finish (bounded), NAK what
//! waits so another instance gets it at once.

mod dead_letter;
mod delivery;
pub mod handler;
mod inbox;
mod scheduler;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures::StreamExt;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::ops::endpoint::Readiness;
use crate::ops::metrics as m;
use crate::wire;
use dead_letter::DeadLetters;
use delivery::Shared;
pub use handler::{Delivery, Handler, HttpHandler, Outcome};
use scheduler::Scheduler;

/// Validated consumer settings.
#[derive(Debug, Clone)]
pub struct ConsumeConfig {
    pub stream: String,
    pub durable: String,
    pub filter: Option<String>,
    pub ack_wait: Duration,
    pub max_deliver: i64,
    pub max_ack_pending: i64,
    pub concurrency: usize,
    /// NAK delay for delivery n is `backoff[min(n, len) - 1]`.
    pub backoff: Vec<Duration>,
    pub dlq_prefix: String,
    pub dlq_replicas: u8,
    pub shutdown_timeout: Duration,
}

/// A finished delivery, reported to the dispatcher.
struct Done {
    key: String,
    /// Set when the delivery was NAKed: its aggregate waits for its redelivery.
    naked: Option<String>,
}

/// The longest pause between attempts to rebuild a failed pull stream.
const MAX_RESUBSCRIBE_BACKOFF: Duration = Duration::from_secs(1);

const PULL_HEARTBEAT: Duration = Duration::from_millis(500);
const PULL_EXPIRES: Duration = Duration::from_secs(5);

/// How often the consumer looks whether its NATS client reconnected.
const RECONNECT_CHECK: Duration = Duration::from_millis(100);

/// Run until `shutdown`. The consumer is created, or updated to these settings.
/// `readiness` is told when pulling has started (and when it stops).
pub async fn run<H: Handler>(
    cfg: ConsumeConfig,
    pool: PgPool,
    js: jetstream::Context,
    handler: H,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> Result<()> {
    m::register_consumer();
    readiness.not_ready(format!(
        "not consuming yet: creating consumer {} on stream {}",
        cfg.durable, cfg.stream
    ));
    let stream = js
        .get_stream(&cfg.stream)
        .await
        .map_err(Error::nats(format!("looking up stream {}", cfg.stream)))?;
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(cfg.durable.clone()),
            filter_subject: cfg.filter.clone().unwrap_or_default(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ack_wait: cfg.ack_wait,
            max_deliver: cfg.max_deliver,
            max_ack_pending: cfg.max_ack_pending,
            ..Default::default()
        })
        .await
        .map_err(Error::nats(format!("creating consumer {}", cfg.durable)))?;
    let dlq = DeadLetters::new(js.clone(), &cfg.dlq_prefix, &cfg.durable, cfg.dlq_replicas).await?;
    let mut messages = pull_stream(&consumer, &cfg)
        .await
        .map_err(Error::nats("starting the pull subscription"))?;
    tracing::info!(stream = %cfg.stream, durable = %cfg.durable, "consuming");
    readiness.ready();

    let shared = Arc::new(Shared {
        pool,
        handler,
        dlq,
        cfg: cfg.clone(),
    });
    let (done_tx, mut done_rx) = mpsc::channel::<Done>(cfg.concurrency * 2 + 8);
    let mut scheduler = Scheduler::new(cfg.concurrency);
    let mut progress = tokio::time::interval((cfg.ack_wait / 3).max(Duration::from_millis(100)));
    let pending = metrics::gauge!(m::CONSUMER_PENDING);
    pending.set(consumer.cached_info().num_pending as f64);

    // A pull subscription does not survive its client moving to another
    // server (a NATS node died): async-nats resubscribes the inbox but the
    // outstanding pull request is gone, and the stream goes quiet without
    // an error. Each new connection gets a new pull subscription.
    let stats = js.client().statistics();
    let mut connects = stats.connects.load(Ordering::Relaxed);
    let mut reconnect_check = tokio::time::interval(RECONNECT_CHECK);

    let start = |key: String, msg: jetstream::Message| {
        let shared = shared.clone();
        let done_tx = done_tx.clone();
        tokio::spawn(async move {
            let naked = delivery::deliver(&shared, msg).await;
            let _ = done_tx.send(Done { key, naked }).await;
        });
    };

    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            Some(done) = done_rx.recv() => {
                for (key, msg) in scheduler.finish(&done.key, done.naked) {
                    start(key, msg);
                }
            }
            _ = reconnect_check.tick() => {
                let now = stats.connects.load(Ordering::Relaxed);
                if now != connects {
                    connects = now;
                    tracing::info!("NATS reconnected; renewing the pull subscription");
                    match resubscribe(&consumer, &cfg, &shutdown).await {
                        Some(m) => messages = m,
                        None => break,
                    }
                }
            }
            _ = progress.tick() => {
                // Waiting deliveries must not pass ack_wait, or they come back
                // as duplicates out of order.
                for msg in scheduler.waiting() {
                    let _ = msg.ack_with(AckKind::Progress).await;
                }
                if let Ok(info) = consumer.clone().info().await {
                    pending.set(info.num_pending as f64);
                }
            }
            next = messages.next(), if scheduler.can_pull() => {
                let msg = match next {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        // Missed heartbeats, no responders: the pull request
                        // is gone with a consumer leader. A new subscription
                        // asks the current one.
                        tracing::warn!(error = %e, "pull stream error; renewing the pull subscription");
                        match resubscribe(&consumer, &cfg, &shutdown).await {
                            Some(m) => messages = m,
                            None => break,
                        }
                        continue;
                    }
                    None => {
                        tracing::warn!("pull stream ended; resubscribing");
                        readiness.not_ready("pull subscription ended; resubscribing");
                        match resubscribe(&consumer, &cfg, &shutdown).await {
                            Some(m) => messages = m,
                            None => break,
                        }
                        readiness.ready();
                        continue;
                    }
                };
                let key = aggregate_key(&msg);
                let id = delivery::header(&msg, wire::MSG_ID);
                if let Some(msg) = scheduler.arrive(key.clone(), id.as_deref(), msg) {
                    start(key, msg);
                }
            }
        }
    }

    // Shutdown: no more pulls; finish what runs, NAK what waits.
    readiness.not_ready("shutting down");
    drop(messages);
    let deadline = Instant::now() + cfg.shutdown_timeout;
    let mut running = scheduler.running();
    while running > 0 {
        match tokio::time::timeout_at(deadline.into(), done_rx.recv()).await {
            Ok(Some(_)) => running -= 1,
            _ => {
                tracing::warn!(
                    running,
                    "shutdown timeout: unfinished deliveries will be redelivered"
                );
                break;
            }
        }
    }
    for msg in scheduler.take_waiting() {
        let _ = msg.ack_with(AckKind::Nak(None)).await;
    }
    tracing::info!("consumer stopped");
    Ok(())
}

type Messages = pull::Stream;

/// The pull subscription, built the same way at start and on every rebuild.
async fn pull_stream(
    consumer: &jetstream::consumer::Consumer<pull::Config>,
    cfg: &ConsumeConfig,
) -> std::result::Result<Messages, jetstream::consumer::StreamError> {
    // A pull request lives at the consumer's leader: when that node dies,
    // only a missed heartbeat (two intervals) or the request's expiry tells.
    // Short ones keep a failover to seconds; an idle heartbeat is cheap.
    consumer
        .stream()
        .max_messages_per_batch(cfg.concurrency.max(1) * 2)
        .heartbeat(PULL_HEARTBEAT)
        .expires(PULL_EXPIRES)
        .messages()
        .await
}

/// Rebuild the pull stream, retrying with backoff until it works or
/// `shutdown` (then `None`).
async fn resubscribe(
    consumer: &jetstream::consumer::Consumer<pull::Config>,
    cfg: &ConsumeConfig,
    shutdown: &CancellationToken,
) -> Option<Messages> {
    let mut backoff = Duration::from_millis(100);
    loop {
        match pull_stream(consumer, cfg).await {
            Ok(m) => return Some(m),
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "cannot restart the pull subscription");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_RESUBSCRIBE_BACKOFF);
    }
}

/// Messages of one aggregate are ordered; without the header, none are.
fn aggregate_key(msg: &jetstream::Message) -> String {
    match delivery::header(msg, wire::AGGREGATE_ID) {
        Some(a) => format!("a:{a}"),
        None => format!(
            "s:{}",
            msg.info().map(|i| i.stream_sequence).unwrap_or_default()
        ),
    }
}
