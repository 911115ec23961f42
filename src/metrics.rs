//! Metric names, defined once (SPEC §7). Prometheus naming: `_total` for
//! counters, base units in the name, low-cardinality labels only.

pub const EVENTS_PUBLISHED: &str = "outbox_relay_events_published_total";
pub const EVENTS_DEAD_LETTERED: &str = "outbox_relay_events_dead_lettered_total";
pub const PUBLISH_ERRORS: &str = "outbox_relay_publish_errors_total";
pub const INFLIGHT_EVENTS: &str = "outbox_relay_inflight_events";
pub const COMMIT_TO_ACK_SECONDS: &str = "outbox_relay_commit_to_ack_seconds";
pub const CONFIRMED_LSN: &str = "outbox_relay_confirmed_lsn";
/// Replayed events found already in the stream after a restart (not republished).
pub const EVENTS_SKIPPED: &str = "outbox_relay_events_skipped_total";
/// Replication sessions that ended in an error and were restarted.
pub const SESSION_RESTARTS: &str = "outbox_relay_session_restarts_total";

pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(EVENTS_PUBLISHED, "Events acked by JetStream");
    describe_counter!(
        EVENTS_DEAD_LETTERED,
        "Rows sent to {context}.dlq.relay, by reason"
    );
    describe_counter!(PUBLISH_ERRORS, "Failed publish attempts");
    describe_gauge!(INFLIGHT_EVENTS, "Events published and not yet acked");
    describe_histogram!(
        COMMIT_TO_ACK_SECONDS,
        Unit::Seconds,
        "Postgres commit time to JetStream ack"
    );
    describe_gauge!(CONFIRMED_LSN, "Last LSN confirmed to the slot");
    describe_counter!(EVENTS_SKIPPED, "Replayed events already in the stream");
    describe_counter!(
        SESSION_RESTARTS,
        "Replication sessions restarted after an error"
    );
}

/// Serve `/metrics` on `addr`. The commit→ack histogram is kept as a summary
/// (quantiles over a sliding window), which is what operators alert on.
pub fn install(addr: std::net::SocketAddr) -> Result<(), String> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .install()
        .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    describe();
    Ok(())
}
