//! The consumer: JetStream pull → inbox → handler → ACK | NAK | DLQ.
//!
//! One dispatcher task owns all ordering state, so there are no locks:
//!
//! - at most `concurrency` deliveries run at once, each in its own task;
//! - deliveries of one `Outbox-Aggregate-Id` run one at a time, in stream
//!   order. A NAKed delivery blocks its aggregate until JetStream redelivers
//!   it and it finishes; later deliveries of that aggregate wait here (kept
//!   alive with in-progress acks), other aggregates keep flowing;
//! - a stream error is logged and the loop goes on; it never ends the consumer.
//!
//! Shutdown: stop pulling, let running deliveries finish (bounded), NAK what
//! waits so another instance gets it at once.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, AckKind};
use futures::StreamExt;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::dlq::DeadLetters;
use crate::error::{Error, Result};
use crate::handler::{Delivery, Handler, Outcome};
use crate::inbox;
use crate::route::{
    HDR_AGGREGATE_ID, HDR_CAUSATION_ID, HDR_CORRELATION_ID, HDR_EVENT_TYPE, HDR_EVENT_VERSION,
    HDR_MSG_ID, HDR_OCCURRED_AT,
};

use crate::endpoint::Readiness;
use crate::metrics::{CONSUMER_HANDLER_SECONDS, CONSUMER_MESSAGES, CONSUMER_PENDING};

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

/// What to do with a delivery once the handler answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Ack,
    DeadLetter(String),
    Nak(Duration),
}

/// SPEC §6's table. Pure, so the table is tested as a table.
pub fn decide(outcome: &Outcome, delivered: i64, max_deliver: i64, backoff: &[Duration]) -> Action {
    match outcome {
        Outcome::Processed => Action::Ack,
        Outcome::Reject(reason) => Action::DeadLetter(reason.clone()),
        Outcome::Retry(reason) if max_deliver > 0 && delivered >= max_deliver => {
            Action::DeadLetter(format!("last delivery ({delivered}) failed: {reason}"))
        }
        Outcome::Retry(_) => {
            let i = usize::try_from(delivered.max(1) - 1).unwrap_or(usize::MAX);
            Action::Nak(
                backoff
                    .get(i)
                    .or(backoff.last())
                    .copied()
                    .unwrap_or(Duration::from_secs(1)),
            )
        }
    }
}

struct Shared<H> {
    pool: PgPool,
    handler: H,
    dlq: DeadLetters,
    cfg: ConsumeConfig,
}

/// A finished delivery, reported to the dispatcher.
struct Done {
    key: String,
    /// Set when the delivery was NAKed: its aggregate waits for its redelivery.
    naked: Option<String>,
}

#[derive(Default)]
struct KeyState {
    running: bool,
    blocked_on: Option<String>,
    waiting: VecDeque<jetstream::Message>,
}

/// Run until `shutdown`. The consumer is created, or updated to these settings.
/// `ready` is told when pulling has started (and when it stops).
pub async fn run<H: Handler>(
    cfg: ConsumeConfig,
    pool: PgPool,
    js: jetstream::Context,
    handler: H,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> Result<()> {
    crate::metrics::register_consumer();
    readiness.not_ready(format!(
        "not consuming yet: creating consumer {} on stream {}",
        cfg.durable, cfg.stream
    ));
    let stream = js
        .get_stream(&cfg.stream)
        .await
        .map_err(|e| Error::Config(format!("stream {}: {e}", cfg.stream)))?;
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
    let mut messages = consumer
        .stream()
        .max_messages_per_batch(cfg.concurrency.max(1) * 2)
        .heartbeat(Duration::from_secs(5))
        .expires(Duration::from_secs(30))
        .messages()
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
    let mut keys: HashMap<String, KeyState> = HashMap::new();
    let mut ready: VecDeque<String> = VecDeque::new();
    let mut running = 0usize;
    let mut progress = tokio::time::interval((cfg.ack_wait / 3).max(Duration::from_millis(100)));
    let pending = metrics::gauge!(CONSUMER_PENDING);
    pending.set(consumer.cached_info().num_pending as f64);

    let start = |msg: jetstream::Message, key: String, running: &mut usize| {
        *running += 1;
        let shared = shared.clone();
        let done_tx = done_tx.clone();
        tokio::spawn(async move {
            let naked = deliver(&shared, msg).await;
            let _ = done_tx.send(Done { key, naked }).await;
        });
    };

    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            Some(done) = done_rx.recv() => {
                running -= 1;
                if let Some(state) = keys.get_mut(&done.key) {
                    state.running = false;
                    state.blocked_on = done.naked;
                    if state.blocked_on.is_none() && !state.waiting.is_empty() {
                        ready.push_back(done.key.clone());
                    } else if state.blocked_on.is_none() {
                        keys.remove(&done.key);
                    }
                }
                while running < cfg.concurrency {
                    let Some(key) = ready.pop_front() else { break };
                    let Some(state) = keys.get_mut(&key) else { continue };
                    if let Some(msg) = state.waiting.pop_front() {
                        state.running = true;
                        start(msg, key, &mut running);
                    }
                }
            }
            _ = progress.tick() => {
                // Waiting deliveries must not pass ack_wait, or they come back
                // as duplicates out of order.
                for state in keys.values() {
                    for msg in &state.waiting {
                        let _ = msg.ack_with(AckKind::Progress).await;
                    }
                }
                if let Ok(info) = consumer.clone().info().await {
                    pending.set(info.num_pending as f64);
                }
            }
            next = messages.next(), if running < cfg.concurrency && ready.is_empty() => {
                let msg = match next {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "pull stream error; continuing");
                        continue;
                    }
                    None => {
                        tracing::warn!("pull stream ended; resubscribing");
                        readiness.not_ready("pull subscription ended; resubscribing");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        messages = consumer
                            .stream()
                            .max_messages_per_batch(cfg.concurrency.max(1) * 2)
                            .messages()
                            .await
                            .map_err(Error::nats("restarting the pull subscription"))?;
                        readiness.ready();
                        continue;
                    }
                };
                let key = aggregate_key(&msg);
                let id = header(&msg, HDR_MSG_ID);
                let state = keys.entry(key.clone()).or_default();
                let is_retry = state.blocked_on.is_some() && state.blocked_on == id;
                if is_retry || (!state.running && state.blocked_on.is_none() && state.waiting.is_empty()) {
                    state.blocked_on = None;
                    state.running = true;
                    start(msg, key, &mut running);
                } else {
                    state.waiting.push_back(msg);
                }
            }
        }
    }

    // Shutdown: no more pulls; finish what runs, NAK what waits.
    readiness.not_ready("shutting down");
    drop(messages);
    let deadline = Instant::now() + cfg.shutdown_timeout;
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
    for state in keys.values() {
        for msg in &state.waiting {
            let _ = msg.ack_with(AckKind::Nak(None)).await;
        }
    }
    tracing::info!("consumer stopped");
    Ok(())
}

/// Messages of one aggregate are ordered; without the header, none are.
fn aggregate_key(msg: &jetstream::Message) -> String {
    match header(msg, HDR_AGGREGATE_ID) {
        Some(a) => format!("a:{a}"),
        None => format!(
            "s:{}",
            msg.info().map(|i| i.stream_sequence).unwrap_or_default()
        ),
    }
}

fn header(msg: &jetstream::Message, name: &str) -> Option<String> {
    msg.headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(|v| v.as_str().to_owned())
}

fn count(result: &'static str) {
    metrics::counter!(CONSUMER_MESSAGES, "result" => result).increment(1);
}

/// One delivery, start to finish. Returns the message id when it was NAKed.
async fn deliver<H: Handler>(shared: &Shared<H>, msg: jetstream::Message) -> Option<String> {
    let cfg = &shared.cfg;
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
    let raw_id = header(&msg, HDR_MSG_ID);
    let Some(id) = raw_id.as_deref().and_then(|s| Uuid::parse_str(s).ok()) else {
        // No usable id: no inbox row is possible. Dead-letter under the
        // stream position so a redelivery dedupes.
        let pos = msg.info().map(|i| i.stream_sequence).unwrap_or_default();
        let dlq_id = format!("{}:{pos}", cfg.stream);
        let reason = match raw_id {
            None => "message has no Nats-Msg-Id".to_owned(),
            Some(r) => format!("Nats-Msg-Id {r:?} is not a UUID"),
        };
        return dead_letter_and_ack(shared, &msg, &dlq_id, None, &reason, delivered).await;
    };
    if serde_json::from_slice::<serde::de::IgnoredAny>(&msg.payload).is_err() {
        return dead_letter_and_ack(
            shared,
            &msg,
            &id.to_string(),
            Some(id),
            "body is not JSON",
            delivered,
        )
        .await;
    }

    let subject = msg.subject.to_string();
    let delivery = Delivery {
        message_id: id,
        subject: subject.clone(),
        event_type: header(&msg, HDR_EVENT_TYPE),
        event_version: header(&msg, HDR_EVENT_VERSION).and_then(|v| v.parse().ok()),
        occurred_at: header(&msg, HDR_OCCURRED_AT),
        correlation_id: header(&msg, HDR_CORRELATION_ID),
        causation_id: header(&msg, HDR_CAUSATION_ID),
        traceparent: header(&msg, "traceparent"),
        payload: msg.payload.clone(),
        delivered,
    };

    let outcome = match handle_in_transaction(shared, &msg, &delivery).await {
        Ok(Some(outcome)) => outcome,
        Ok(None) => {
            count("duplicate");
            ack(&msg).await;
            return None;
        }
        Err(e) if cfg.max_deliver > 0 && delivered >= cfg.max_deliver => {
            // JetStream will not deliver it again: a NAK would strand it.
            let reason = format!("inbox unavailable on the last delivery ({delivered}): {e}");
            return dead_letter_and_ack(
                shared,
                &msg,
                &id.to_string(),
                Some(id),
                &reason,
                delivered,
            )
            .await;
        }
        Err(e) => {
            // The database failed, not the handler: try again later, without
            // spending the message's deliveries faster than the backoff.
            tracing::warn!(%id, error = %e, "inbox unavailable; NAK");
            count("retried");
            let delay = cfg
                .backoff
                .first()
                .copied()
                .unwrap_or(Duration::from_secs(1));
            let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
            return Some(id.to_string());
        }
    };
    match decide(&outcome, delivered, cfg.max_deliver, &cfg.backoff) {
        Action::Ack => {
            count("processed");
            ack(&msg).await;
            None
        }
        Action::DeadLetter(reason) => {
            dead_letter_and_ack(shared, &msg, &id.to_string(), Some(id), &reason, delivered).await
        }
        Action::Nak(delay) => {
            let reason = match &outcome {
                Outcome::Retry(r) => r.as_str(),
                _ => "",
            };
            if let Ok(mut conn) = shared.pool.acquire().await {
                if let Err(e) =
                    inbox::record_failure(&mut conn, &cfg.durable, id, &subject, reason).await
                {
                    tracing::warn!(%id, error = %e, "could not record the failed attempt");
                }
            }
            tracing::info!(%id, delivered, ?delay, reason, "handler failed; NAK");
            count("retried");
            let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
            Some(id.to_string())
        }
    }
}

/// The inbox transaction around the handler. `None`: already processed.
async fn handle_in_transaction<H: Handler>(
    shared: &Shared<H>,
    msg: &jetstream::Message,
    delivery: &Delivery,
) -> std::result::Result<Option<Outcome>, sqlx::Error> {
    let cfg = &shared.cfg;
    let mut tx = shared.pool.begin().await?;
    if inbox::begin_delivery(
        &mut tx,
        &cfg.durable,
        delivery.message_id,
        &delivery.subject,
    )
    .await?
    {
        tx.commit().await?;
        return Ok(None);
    }
    let started = Instant::now();
    let outcome = {
        let call = shared.handler.handle(&mut tx, delivery);
        tokio::pin!(call);
        // A slow handler keeps its delivery: in-progress acks reset ack_wait.
        let mut keepalive =
            tokio::time::interval((cfg.ack_wait / 3).max(Duration::from_millis(100)));
        keepalive.tick().await;
        loop {
            tokio::select! {
                outcome = &mut call => break outcome,
                _ = keepalive.tick() => { let _ = msg.ack_with(AckKind::Progress).await; }
            }
        }
    };
    metrics::histogram!(CONSUMER_HANDLER_SECONDS).record(started.elapsed().as_secs_f64());
    if outcome == Outcome::Processed {
        inbox::mark_processed(&mut tx, &cfg.durable, delivery.message_id).await?;
        tx.commit().await?;
    } else {
        tx.rollback().await?;
    }
    Ok(Some(outcome))
}

async fn dead_letter_and_ack<H: Handler>(
    shared: &Shared<H>,
    msg: &jetstream::Message,
    dlq_id: &str,
    inbox_id: Option<Uuid>,
    reason: &str,
    delivered: i64,
) -> Option<String> {
    let cfg = &shared.cfg;
    if let Err(e) = shared.dlq.publish(msg, dlq_id, reason, delivered).await {
        // Not stored in the DLQ: keep the original, try again later.
        tracing::warn!(id = dlq_id, error = %e, "dead-letter publish failed; NAK");
        count("retried");
        let _ = msg
            .ack_with(AckKind::Nak(cfg.backoff.first().copied()))
            .await;
        return Some(dlq_id.to_owned());
    }
    if let Some(id) = inbox_id {
        let recorded = match shared.pool.acquire().await {
            Ok(mut conn) => {
                inbox::finish_dead_lettered(&mut conn, &cfg.durable, id, &msg.subject, reason).await
            }
            Err(e) => Err(e),
        };
        if let Err(e) = recorded {
            tracing::warn!(%id, error = %e, "dead-lettered, but the inbox row was not updated");
        }
    }
    tracing::warn!(id = dlq_id, reason, "dead-lettered");
    count("dead_lettered");
    ack(msg).await;
    None
}

async fn ack(msg: &jetstream::Message) {
    // A lost ack means a redelivery, which the inbox turns into a duplicate.
    if let Err(e) = msg.ack().await {
        tracing::warn!(error = %e, "ack failed; the message will be redelivered");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: [Duration; 3] = [
        Duration::from_secs(1),
        Duration::from_secs(5),
        Duration::from_secs(30),
    ];

    #[test]
    fn spec_table() {
        assert_eq!(decide(&Outcome::Processed, 1, 20, &B), Action::Ack);
        assert_eq!(
            decide(&Outcome::Reject("bad".into()), 1, 20, &B),
            Action::DeadLetter("bad".into())
        );
        assert_eq!(
            decide(&Outcome::Retry("500".into()), 1, 20, &B),
            Action::Nak(B[0])
        );
        assert_eq!(
            decide(&Outcome::Retry("500".into()), 2, 20, &B),
            Action::Nak(B[1])
        );
        assert_eq!(
            decide(&Outcome::Retry("500".into()), 9, 20, &B),
            Action::Nak(B[2])
        );
        assert!(matches!(
            decide(&Outcome::Retry("500".into()), 20, 20, &B),
            Action::DeadLetter(r) if r.contains("last delivery")
        ));
        assert_eq!(
            decide(&Outcome::Retry("x".into()), 99, -1, &B),
            Action::Nak(B[2]),
            "unlimited"
        );
        assert_eq!(
            decide(&Outcome::Processed, 20, 20, &B),
            Action::Ack,
            "success on the last try"
        );
    }
}
