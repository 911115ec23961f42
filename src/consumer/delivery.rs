//! One delivery, start to finish: inbox row (dedupe) → handler, in the
//! inbox transaction → ACK, NAK with backoff, or dead letter (SPEC §6).

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use sqlx::PgPool;
use uuid::Uuid;

use super::dead_letter::DeadLetters;
use super::handler::{Delivery, Handler, Outcome};
use super::{inbox, ConsumeConfig};
use crate::ops::metrics as m;
use crate::wire;

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

pub(super) struct Shared<H> {
    pub pool: PgPool,
    pub handler: H,
    pub dlq: DeadLetters,
    pub cfg: ConsumeConfig,
}

pub(super) fn header(msg: &jetstream::Message, name: &str) -> Option<String> {
    msg.headers
        .as_ref()
        .and_then(|h| h.get(name))
        .map(|v| v.as_str().to_owned())
}

fn count(result: &'static str) {
    metrics::counter!(m::CONSUMER_MESSAGES, "result" => result).increment(1);
}

/// One delivery, start to finish. Returns the message id when it was NAKed.
pub(super) async fn deliver<H: Handler>(
    shared: &Shared<H>,
    msg: jetstream::Message,
) -> Option<String> {
    let cfg = &shared.cfg;
    let delivered = msg.info().map(|i| i.delivered).unwrap_or(1);
    let raw_id = header(&msg, wire::MSG_ID);
    let Some(id) = raw_id.as_deref().and_then(|s| Uuid::parse_str(s).ok()) else {
        // No usable id: no inbox row is possible. Dead-letter under the
        // stream position so a redelivery dedupes.
        let pos = msg.info().map(|i| i.stream_sequence).unwrap_or_default();
        let dlq_id = format!("{}:{pos}", cfg.stream);
        let reason = match raw_id {
            None => format!("message has no {}", wire::MSG_ID),
            Some(r) => format!("{} {r:?} is not a UUID", wire::MSG_ID),
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
        event_type: header(&msg, wire::EVENT_TYPE),
        event_version: header(&msg, wire::EVENT_VERSION).and_then(|v| v.parse().ok()),
        occurred_at: header(&msg, wire::OCCURRED_AT),
        correlation_id: header(&msg, wire::CORRELATION_ID),
        causation_id: header(&msg, wire::CAUSATION_ID),
        traceparent: header(&msg, wire::TRACEPARENT),
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
            let attempt = inbox::Attempt {
                consumer: &cfg.durable,
                id,
                subject: &subject,
                error: reason,
            };
            if let Err(e) = inbox::record_attempt(&shared.pool, &attempt, false).await {
                tracing::warn!(%id, error = %e, "could not record the failed attempt");
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
    metrics::histogram!(m::CONSUMER_HANDLER_SECONDS).record(started.elapsed().as_secs_f64());
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
        let attempt = inbox::Attempt {
            consumer: &cfg.durable,
            id,
            subject: &msg.subject,
            error: reason,
        };
        if let Err(e) = inbox::record_attempt(&shared.pool, &attempt, true).await {
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
