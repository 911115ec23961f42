//! A Rust service consuming outbox events with exactly-once effects: the
//! handler's writes and the inbox row commit in one transaction.
//!
//! ```sh
//! DATABASE_URL=… NATS_URL=… cargo run --example rust_handler
//! ```

use std::time::Duration;

use outbox_relay::consumer::{self, ConsumeConfig};
use outbox_relay::consumer::{Delivery, Handler, Outcome};
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;

/// Keeps a running total per aggregate; a replay cannot count an event twice.
struct Totals;

impl Handler for Totals {
    async fn handle(&self, tx: &mut PgConnection, d: &Delivery) -> Outcome {
        let amount = serde_json::from_slice::<serde_json::Value>(&d.payload)
            .ok()
            .and_then(|v| v["amount"].as_f64());
        let Some(amount) = amount else {
            return Outcome::Reject("payload has no numeric amount".into());
        };
        let written = sqlx::query(
            "INSERT INTO totals (subject, total) VALUES ($1, $2) \
             ON CONFLICT (subject) DO UPDATE SET total = totals.total + excluded.total",
        )
        .bind(&d.subject)
        .bind(amount)
        .execute(&mut *tx)
        .await;
        match written {
            Ok(_) => Outcome::Processed,
            Err(e) => Outcome::Retry(e.to_string()),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = sqlx::PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS totals (subject text PRIMARY KEY, total float8 NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let js = async_nats::jetstream::new(async_nats::connect(std::env::var("NATS_URL")?).await?);
    let cfg = ConsumeConfig {
        stream: "OUTBOX_EVENTS".into(),
        durable: "totals".into(),
        filter: None,
        ack_wait: Duration::from_secs(120),
        max_deliver: 20,
        max_ack_pending: 50,
        concurrency: 8,
        backoff: vec![Duration::from_secs(1), Duration::from_secs(30)],
        max_parked_keys: 100_000,
        dlq_prefix: "dlq.outbox".into(),
        dlq_replicas: 1,
        nats_monitor_url: Vec::new(),
        require_durable: false,
        shutdown_timeout: Duration::from_secs(30),
        // Or `Some(Arc::new(Registry::load(dir, Missing::Allow)?))`: payloads
        // that fail their JSON Schema are dead-lettered before `handle`.
        schemas: None,
    };
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    // A Rust service would serve `ready` on its own health endpoint.
    let ready = outbox_relay::Readiness::default();
    consumer::run(cfg, pool, js, Totals, ready, shutdown).await?;
    Ok(())
}
