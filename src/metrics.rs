//! Metric names, defined once (SPEC §7), and the Prometheus recorder.
//!
//! Prometheus naming: `_total` for counters, base units in the name,
//! low-cardinality labels only. The two latency metrics are real histograms
//! (buckets), not summaries, so `histogram_quantile` can aggregate them
//! across instances and over any window an alert wants.
//!
//! Slot metrics (`pg_replication_slot_*`) are not recorded here: they are a
//! snapshot of `pg_replication_slots`, rendered at scrape time by
//! [`crate::ops::slot_monitor`], so a dropped slot disappears at once instead of leaving a
//! stale series behind.

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

// Relay (SPEC §7).
pub const EVENTS_PUBLISHED: &str = "outbox_relay_events_published_total";
pub const EVENTS_DEAD_LETTERED: &str = "outbox_relay_events_dead_lettered_total";
pub const PUBLISH_ERRORS: &str = "outbox_relay_publish_errors_total";
/// Publishes sent again because another writer appended to the stream
/// between two of the relay's (the order chain refused them).
pub const PUBLISH_RESENDS: &str = "outbox_relay_publish_resends_total";
/// 1 while the relay publishes whole transactions as atomic batches.
pub const PUBLISH_BATCHES: &str = "outbox_relay_publish_batches";
/// Atomic batches by `result`: committed, retried (the server lost one),
/// unbatched (refused, sent again event by event).
pub const BATCHES: &str = "outbox_relay_batches_total";
/// Events read from `outbox_emit()`'s logical messages (SPEC §12), before
/// routing: published or dead-lettered like rows, and counted there too.
pub const EMITTED_EVENTS: &str = "outbox_relay_emitted_events_total";
/// Bytes of the events published and not yet acked.
pub const INFLIGHT_BYTES: &str = "outbox_relay_inflight_bytes";
pub const INFLIGHT_EVENTS: &str = "outbox_relay_inflight_events";
pub const COMMIT_TO_ACK_SECONDS: &str = "outbox_relay_commit_to_ack_seconds";
pub const CONFIRMED_LSN: &str = "outbox_relay_confirmed_lsn";
// Relay, beyond SPEC §7 (issue 15's operational signals).
/// Now − commit time of the oldest event read from the slot and not yet
/// acked; 0 when everything read is acked.
pub const RELAY_LAG_SECONDS: &str = "outbox_relay_lag_seconds";
// Relay, beyond SPEC §7.
/// Replayed events found already in the stream after a restart (not republished).
pub const EVENTS_SKIPPED: &str = "outbox_relay_events_skipped_total";
/// Replication sessions that ended in an error and were restarted.
pub const SESSION_RESTARTS: &str = "outbox_relay_session_restarts_total";
/// 1 while the relay streams from its slot (what `/readyz` reports).
pub const STREAMING: &str = "outbox_relay_streaming";
/// 1 while the relay waits as a standby: another process holds the slot.
pub const STANDBY: &str = "outbox_relay_standby";
/// 1 while the relay, having streamed, is stopped by what it cannot go past
/// by itself (its log and `/readyz` say what to run).
pub const HALTED: &str = "outbox_relay_halted";
/// 1 while `--publication` does not publish the outbox and the slot streams
/// it through the publication the relay keeps.
pub const PUBLICATION_KEPT: &str = "outbox_relay_publication_kept";
/// Admin actions (SPEC §16), by action and result.
pub const ADMIN_ACTIONS: &str = "outbox_admin_actions_total";
/// Times the relay halted: a halt a retry got past still shows.
pub const HALTS: &str = "outbox_relay_halts_total";
/// Sessions ended because Postgres stopped hearing the replication
/// connection (a silent path: a vanished host, a dropped route).
pub const REPLICATION_SILENCES: &str = "outbox_relay_replication_silences_total";
/// Sessions ended because the relay's own stream, at its limits with
/// discard new, took nothing more.
pub const STREAM_FULL: &str = "outbox_relay_stream_full_total";
/// Rows published from a new slot's snapshot (first start, resync).
pub const BACKFILL_ROWS: &str = "outbox_relay_backfill_rows_total";
/// 1 while the relay publishes a new slot's snapshot.
pub const BACKFILLING: &str = "outbox_relay_backfilling";
/// 1 when an event the stream acked survives one server's OS crash
/// (replicas, or `sync_interval: always`), else 0 (SPEC §14).
pub const STREAM_DURABLE: &str = "outbox_relay_stream_durable";
/// Rows `outbox-relay audit` found missing from the stream (SPEC §14),
/// summed over runs in its `--metrics-file`.
pub const AUDIT_HOLES: &str = "outbox_audit_holes_total";
/// What `outbox-relay audit --metrics-file` writes (a textfile for
/// node_exporter, not a scrape of a process).
pub const AUDIT_FILE: &[&str] = &[
    AUDIT_HOLES,
    "outbox_audit_findings",
    "outbox_audit_last_run_timestamp_seconds",
    "outbox_audit_last_run_ok",
    "outbox_audit_last_success_timestamp_seconds",
];

// Schemas (SPEC §10).
/// Payloads that failed their schema (or had none, with
/// `--schema-missing dead-letter`), by `stage` (relay, consume) and
/// `event_type`: the type when it has a schema (the schema folder bounds
/// them), else [`NO_SCHEMA_TYPE`]: a label from the message itself would
/// make a series per distinct type anyone writes.
pub const SCHEMA_FAILURES: &str = "outbox_schema_validation_failures_total";
pub const NO_SCHEMA_TYPE: &str = "(no schema)";
/// SIGHUP reloads of `--schemas`, by `result` (ok, failed: the set in force stays).
pub const SCHEMA_RELOADS: &str = "outbox_schema_reloads_total";

// Slots (SPEC §7), rendered by `crate::ops::slot_monitor`.
pub const SLOT_LAG_BYTES: &str = "pg_replication_slot_lag_bytes";
pub const SLOT_RETAINED_WAL_BYTES: &str = "pg_replication_slot_retained_wal_bytes";
pub const SLOT_ACTIVE: &str = "pg_replication_slot_active";
pub const SLOT_SAFE_WAL_SIZE_BYTES: &str = "pg_replication_slot_safe_wal_size_bytes";
/// One series per `status` (reserved, extended, unreserved, lost); the current one is 1.
pub const SLOT_WAL_STATUS: &str = "pg_replication_slot_wal_status";
/// 1 when the last `pg_replication_slots` query succeeded. When it is 0 the
/// slot series are absent rather than stale.
pub const SLOT_MONITOR_UP: &str = "outbox_relay_slot_monitor_up";

// Consumer (SPEC §7).
pub const CONSUMER_MESSAGES: &str = "outbox_consumer_messages_total";
pub const CONSUMER_HANDLER_SECONDS: &str = "outbox_consumer_handler_seconds";
pub const CONSUMER_PENDING: &str = "outbox_consumer_pending_messages";
pub const CONSUMER_PARKED_AGGREGATES: &str = "outbox_consumer_parked_aggregates";
pub const CONSUMER_STANDBY: &str = "outbox_consumer_standby";
/// Processes of this durable alive now (SPEC §11), as this one sees them.
pub const CONSUMER_PROCESSES: &str = "outbox_consumer_processes";
/// Jobs (handler calls with their inbox writes) this process runs now.
pub const CONSUMER_RUNNING_JOBS: &str = "outbox_consumer_running_jobs";
/// Job requests this process refused as a member of the crew, by `reason`
/// ([`CREW_REFUSAL_REASONS`]).
pub const CONSUMER_CREW_REFUSALS: &str = "outbox_consumer_crew_refusals_total";
/// Inbox transactions of processes taken for lost that the crew ended
/// (a frozen Rust-handler process's row locks, freed for the others).
pub const CONSUMER_CREW_TRANSACTIONS_ENDED: &str = "outbox_consumer_crew_transactions_ended_total";
/// Jobs the dispatcher has handed to other processes and not heard back of.
pub const CONSUMER_REMOTE_JOBS: &str = "outbox_consumer_remote_jobs";
pub const CONSUMER_DLQ_FAILING: &str = "outbox_consumer_dead_letters_failing";
/// Delivered to the durable and not yet acked (JetStream's `num_ack_pending`).
pub const CONSUMER_ACK_PENDING: &str = "outbox_consumer_ack_pending_messages";
/// Now − the stream time of the oldest message the durable has not acked;
/// 0 when it has acked everything.
pub const CONSUMER_LAG_SECONDS: &str = "outbox_consumer_lag_seconds";
/// 1 when a dead letter the dead-letter stream acked survives one server's
/// OS crash, else 0 (its original is acked once it is stored).
pub const CONSUMER_DLQ_DURABLE: &str = "outbox_consumer_dlq_durable";
/// Dead letters held in a dead-letter stream and not yet replayed, by
/// `stream` and `subject` (the filter they are counted on).
pub const DLQ_MESSAGES: &str = "outbox_dlq_messages";

/// `result` label values of [`CONSUMER_MESSAGES`].
pub const CONSUMER_RESULTS: [&str; 5] = [
    "processed",
    "duplicate",
    "retried",
    "dead_lettered",
    "expired",
];

/// `reason` label values of [`CONSUMER_CREW_REFUSALS`]: no room (or
/// leaving), from a dispatcher not served (or an earlier period of it), past
/// the request's last beat, while this process cannot prove it is heard,
/// and a request it cannot read.
pub const CREW_REFUSAL_REASONS: [&str; 5] = ["full", "fenced", "late", "unheard", "bad"];

/// Every metric name this crate exports, for tests and for the deploy/ files'
/// checks. Histograms are listed by base name.
pub const ALL: &[&str] = &[
    EVENTS_PUBLISHED,
    EVENTS_DEAD_LETTERED,
    PUBLISH_ERRORS,
    PUBLISH_RESENDS,
    PUBLISH_BATCHES,
    BATCHES,
    EMITTED_EVENTS,
    SCHEMA_FAILURES,
    SCHEMA_RELOADS,
    RELAY_LAG_SECONDS,
    INFLIGHT_BYTES,
    INFLIGHT_EVENTS,
    COMMIT_TO_ACK_SECONDS,
    CONFIRMED_LSN,
    EVENTS_SKIPPED,
    SESSION_RESTARTS,
    STREAMING,
    STANDBY,
    HALTED,
    PUBLICATION_KEPT,
    HALTS,
    REPLICATION_SILENCES,
    STREAM_FULL,
    BACKFILL_ROWS,
    BACKFILLING,
    STREAM_DURABLE,
    SLOT_LAG_BYTES,
    SLOT_RETAINED_WAL_BYTES,
    SLOT_ACTIVE,
    SLOT_SAFE_WAL_SIZE_BYTES,
    SLOT_WAL_STATUS,
    SLOT_MONITOR_UP,
    CONSUMER_MESSAGES,
    CONSUMER_HANDLER_SECONDS,
    CONSUMER_PENDING,
    CONSUMER_PARKED_AGGREGATES,
    CONSUMER_STANDBY,
    CONSUMER_PROCESSES,
    CONSUMER_RUNNING_JOBS,
    CONSUMER_CREW_REFUSALS,
    CONSUMER_CREW_TRANSACTIONS_ENDED,
    CONSUMER_REMOTE_JOBS,
    CONSUMER_DLQ_FAILING,
    CONSUMER_ACK_PENDING,
    CONSUMER_LAG_SECONDS,
    CONSUMER_DLQ_DURABLE,
    DLQ_MESSAGES,
];

/// Buckets for commit→ack: a healthy relay lives in the low milliseconds, a
/// backlog in seconds; both need resolution.
const COMMIT_TO_ACK_BUCKETS: &[f64] = &[
    0.000_5, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];
/// Buckets for handler calls: milliseconds to the HTTP timeout.
const HANDLER_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Install the process-wide recorder and return the handle that renders it.
/// Histogram samples are kept in lock-free buffers until rendered; `upkeep`
/// must run periodically so an unscraped process does not grow them.
pub fn install() -> crate::error::Result<PrometheusHandle> {
    let builder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(COMMIT_TO_ACK_SECONDS.into()),
            COMMIT_TO_ACK_BUCKETS,
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full(CONSUMER_HANDLER_SECONDS.into()),
                HANDLER_BUCKETS,
            )
        })
        .map_err(|e| crate::error::Error::Setup {
            message: format!("metrics buckets: {e}"),
            source: Some(Box::new(e)),
        })?;
    builder
        .install_recorder()
        .map_err(|e| crate::error::Error::Setup {
            message: format!("cannot install the metrics recorder: {e}"),
            source: Some(Box::new(e)),
        })
}

/// Drain histogram buffers every few seconds until `shutdown`.
pub async fn upkeep(handle: PrometheusHandle, shutdown: tokio_util::sync::CancellationToken) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => handle.run_upkeep(),
        }
    }
}

/// Describe the relay's metrics and create every series at zero, so a fresh
/// relay exports them all and `rate()` has a starting point.
pub fn register_relay() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(EVENTS_PUBLISHED, "Events acked by JetStream");
    describe_counter!(
        EVENTS_DEAD_LETTERED,
        "Rows sent to {context}.dlq.relay, by reason"
    );
    describe_counter!(PUBLISH_ERRORS, "Failed publish attempts");
    describe_counter!(
        PUBLISH_RESENDS,
        "Publishes sent again: another writer appended to the stream, or no stream leader answered"
    );
    describe_gauge!(
        PUBLISH_BATCHES,
        "1 while whole transactions go out as atomic batches"
    );
    describe_counter!(
        BATCHES,
        "Atomic batches by result: committed, retried, unbatched (sent again event by event)"
    );
    describe_counter!(
        EMITTED_EVENTS,
        "Events read from outbox_emit() logical messages (published or dead-lettered like rows)"
    );
    describe_gauge!(
        INFLIGHT_BYTES,
        "Bytes of events published and not yet acked"
    );
    describe_gauge!(INFLIGHT_EVENTS, "Events published and not yet acked");
    describe_histogram!(
        COMMIT_TO_ACK_SECONDS,
        Unit::Seconds,
        "Postgres commit time to JetStream ack"
    );
    describe_gauge!(CONFIRMED_LSN, "Last LSN confirmed to the slot");
    describe_gauge!(
        RELAY_LAG_SECONDS,
        Unit::Seconds,
        "Now minus the commit time of the oldest event read and not yet acked (0 when none)"
    );
    describe_counter!(EVENTS_SKIPPED, "Replayed events already in the stream");
    describe_counter!(
        SESSION_RESTARTS,
        "Replication sessions restarted after an error"
    );
    describe_gauge!(STREAMING, "1 while the relay streams from its slot");
    describe_counter!(
        HALTS,
        "times the relay halted on a change it could not go past by itself (its log says what to run)"
    );
    describe_counter!(
        REPLICATION_SILENCES,
        "sessions ended because Postgres heard nothing from the replication connection for 15 s (a silent path: a vanished host, a dropped route)"
    );
    describe_counter!(
        STREAM_FULL,
        "sessions ended because the relay's own stream is at its limits (max_msgs, max_bytes or max_msgs_per_subject with discard new) and took nothing more; nothing is lost, the slot keeps the events"
    );
    describe_gauge!(
        HALTED,
        "1 while the relay is stopped by a change it cannot go past by itself (a migration, the outbox out of its publication, a lost slot); its log and /readyz say what to run"
    );
    describe_gauge!(
        PUBLICATION_KEPT,
        "1 while --publication does not publish the outbox and the slot streams it through the publication the relay keeps ({slot}_keep)"
    );
    describe_gauge!(
        CONSUMER_DLQ_DURABLE,
        "1 when a dead letter the dead-letter stream acked survives one server's OS crash (replicas, or sync_interval: always)"
    );
    describe_gauge!(
        STREAM_DURABLE,
        "1 when an event the stream acked survives one server's OS crash (replicas, or sync_interval: always)"
    );
    describe_counter!(
        BACKFILL_ROWS,
        "Rows published from a new slot's snapshot (first start, resync)"
    );
    describe_gauge!(
        BACKFILLING,
        "1 while the relay publishes a new slot's snapshot"
    );
    describe_gauge!(
        STANDBY,
        "1 while the relay waits as a standby (another process holds the slot)"
    );

    metrics::counter!(EVENTS_PUBLISHED).increment(0);
    for reason in crate::wire::DlqReason::ALL {
        metrics::counter!(EVENTS_DEAD_LETTERED, "reason" => reason.as_str()).increment(0);
    }
    metrics::counter!(PUBLISH_ERRORS).increment(0);
    metrics::counter!(PUBLISH_RESENDS).increment(0);
    metrics::counter!(EMITTED_EVENTS).increment(0);
    metrics::gauge!(PUBLISH_BATCHES).set(0.0);
    for result in ["committed", "retried", "unbatched"] {
        metrics::counter!(BATCHES, "result" => result).increment(0);
    }
    metrics::gauge!(INFLIGHT_BYTES).set(0.0);
    metrics::counter!(EVENTS_SKIPPED).increment(0);
    metrics::counter!(SESSION_RESTARTS).increment(0);
    metrics::gauge!(INFLIGHT_EVENTS).set(0.0);
    metrics::gauge!(STREAMING).set(0.0);
    metrics::gauge!(STANDBY).set(0.0);
    metrics::gauge!(HALTED).set(0.0);
    metrics::gauge!(PUBLICATION_KEPT).set(0.0);
    metrics::counter!(HALTS).increment(0);
    metrics::counter!(REPLICATION_SILENCES).increment(0);
    metrics::counter!(STREAM_FULL).increment(0);
    metrics::counter!(BACKFILL_ROWS).increment(0);
    metrics::gauge!(BACKFILLING).set(0.0);
    metrics::gauge!(RELAY_LAG_SECONDS).set(0.0);
}

/// Metrics both `relay` and `consume` export when given `--schemas`.
pub fn register_schemas() {
    use metrics::describe_counter;
    describe_counter!(
        SCHEMA_FAILURES,
        "Payloads that failed their schema (or had none, with --schema-missing dead-letter), by stage and event_type"
    );
    describe_counter!(
        SCHEMA_RELOADS,
        "SIGHUP reloads of --schemas by result: ok, failed (the schemas in force stay)"
    );
    for result in ["ok", "failed"] {
        metrics::counter!(SCHEMA_RELOADS, "result" => result).increment(0);
    }
}

/// The consumer's counterpart of [`register_relay`].
pub fn register_consumer() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_counter!(
        CONSUMER_MESSAGES,
        "Deliveries by result: processed, duplicate, retried (parked for a later attempt), dead_lettered, expired (left the stream while parked)"
    );
    describe_histogram!(CONSUMER_HANDLER_SECONDS, Unit::Seconds, "Handler call time");
    describe_gauge!(
        CONSUMER_PENDING,
        "Messages in the stream not yet delivered to the consumer"
    );
    describe_gauge!(
        CONSUMER_PARKED_AGGREGATES,
        "Aggregates with messages parked in the inbox after a failed attempt"
    );
    describe_gauge!(
        CONSUMER_STANDBY,
        "1 while another process of this durable dispatches (this one still runs the jobs it is sent)"
    );
    describe_gauge!(
        CONSUMER_PROCESSES,
        "Processes of this durable alive now (each holds its crew lock in Postgres)"
    );
    describe_gauge!(
        CONSUMER_RUNNING_JOBS,
        "Jobs (handler calls with their inbox writes) this process runs now"
    );
    describe_counter!(
        CONSUMER_CREW_REFUSALS,
        "Job requests this process refused as a member of the crew, by reason: full, fenced (not the dispatcher it serves), late, unheard (it cannot prove it is heard), bad"
    );
    describe_counter!(
        CONSUMER_CREW_TRANSACTIONS_ENDED,
        "Inbox transactions of processes taken for lost (frozen, cut off) that this dispatcher ended, so their messages run elsewhere at once"
    );
    describe_gauge!(
        CONSUMER_REMOTE_JOBS,
        "Jobs this dispatcher has handed to other processes of the durable and not heard back of"
    );
    describe_gauge!(
        CONSUMER_DLQ_FAILING,
        "Dead letters the DLQ stream has not stored yet (retried until it does)"
    );
    describe_gauge!(
        CONSUMER_ACK_PENDING,
        "Messages delivered to the durable and not yet acked"
    );
    describe_gauge!(
        CONSUMER_LAG_SECONDS,
        Unit::Seconds,
        "Now minus the stream time of the oldest message the durable has not acked (0 when none)"
    );
    describe_gauge!(
        DLQ_MESSAGES,
        "Dead letters held in a dead-letter stream and not yet replayed, by stream and subject"
    );
    metrics::gauge!(CONSUMER_STANDBY).set(0.0);
    metrics::gauge!(CONSUMER_PROCESSES).set(0.0);
    metrics::gauge!(CONSUMER_RUNNING_JOBS).set(0.0);
    metrics::gauge!(CONSUMER_REMOTE_JOBS).set(0.0);
    metrics::gauge!(CONSUMER_PARKED_AGGREGATES).set(0.0);
    metrics::gauge!(CONSUMER_DLQ_FAILING).set(0.0);
    for result in CONSUMER_RESULTS {
        metrics::counter!(CONSUMER_MESSAGES, "result" => result).increment(0);
    }
    for reason in CREW_REFUSAL_REASONS {
        metrics::counter!(CONSUMER_CREW_REFUSALS, "reason" => reason).increment(0);
    }
    metrics::counter!(CONSUMER_CREW_TRANSACTIONS_ENDED).increment(0);
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALERTS: &str = include_str!("../deploy/prometheus/alerts.yml");
    const RULES: &str = include_str!("../deploy/prometheus/rules.yml");
    const DASHBOARD: &str = include_str!("../deploy/grafana/outbox-relay.json");

    /// Our metric names in a PromQL expression (histogram series by base name).
    fn names_in(expr: &str) -> Vec<String> {
        expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .filter(|w| w.starts_with("outbox_") || w.starts_with("pg_replication_slot"))
            .map(|w| {
                ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| w.strip_suffix(s).filter(|b| ALL.contains(b)))
                    .unwrap_or(w)
                    .to_owned()
            })
            .collect()
    }

    fn alert_exprs() -> Vec<String> {
        exprs(ALERTS)
    }

    fn exprs(file: &str) -> Vec<String> {
        file.lines()
            .filter_map(|l| l.trim().strip_prefix("expr:"))
            .map(|e| e.trim().to_owned())
            .collect()
    }

    fn dashboard_exprs() -> Vec<String> {
        let dash: serde_json::Value = serde_json::from_str(DASHBOARD).expect("dashboard is JSON");
        let panels = dash["panels"].as_array().expect("panels");
        panels
            .iter()
            .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
            .map(|t| t["expr"].as_str().expect("target expr").to_owned())
            .collect()
    }

    #[test]
    fn deploy_files_name_only_metrics_we_export() {
        let alerts = alert_exprs();
        let rules = ALERTS.matches("- alert:").count();
        assert_eq!(alerts.len(), rules, "every alert has a one-line expr");
        let dash = dashboard_exprs();
        assert!(dash.len() > 10);
        let recorded = exprs(RULES);
        assert_eq!(recorded.len(), RULES.matches("- record:").count());
        for expr in alerts.iter().chain(&dash).chain(&recorded) {
            let names = names_in(expr);
            assert!(!names.is_empty(), "{expr} names none of our metrics");
            for n in names {
                assert!(
                    ALL.contains(&n.as_str()) || AUDIT_FILE.contains(&n.as_str()),
                    "{expr}: {n} is not exported"
                );
            }
        }
    }

    #[test]
    fn alerts_cover_what_operators_need() {
        let covered = |needle: &str| alert_exprs().iter().any(|e| e.contains(needle));
        for needle in [
            "pg_replication_slot_active == 0",
            "pg_replication_slot_lag_bytes",
            "pg_replication_slot_retained_wal_bytes",
            "status=\"unreserved\"",
            "status=\"lost\"",
            "histogram_quantile(0.99, sum by (le, instance) (rate(outbox_relay_commit_to_ack_seconds_bucket",
            "outbox_relay_events_dead_lettered_total",
            "result=\"dead_lettered\"",
            "outbox_consumer_pending_messages",
            "max by (job) (outbox_relay_lag_seconds) > 60",
            "max by (job) (outbox_consumer_lag_seconds) > 60",
            "max by (job) (outbox_consumer_lag_seconds) > 300",
            "max by (job) (outbox_consumer_lag_seconds) > 1800",
            "max by (stream, subject) (outbox_dlq_messages) > 0",
            "outbox_schema_validation_failures_total",
            "outbox_schema_reloads_total{result=\"failed\"}",
            "increase(outbox_audit_holes_total[3h]) > 0",
            "time() - outbox_audit_last_success_timestamp_seconds",
        ] {
            assert!(covered(needle), "no alert on {needle}");
        }
    }

    /// `scripts/test.sh` sets PROMTOOL_BIN; the rules must then pass both
    /// `promtool check rules` and their unit tests. Under CI the tool must be
    /// there: a missing promtool is a failure, not a skip.
    #[test]
    fn promtool_accepts_the_rules() {
        let Ok(promtool) = std::env::var("PROMTOOL_BIN") else {
            assert!(
                std::env::var_os("CI").is_none(),
                "PROMTOOL_BIN is not set under CI: scripts/test.sh must provide promtool"
            );
            eprintln!("PROMTOOL_BIN not set: promtool checks skipped (scripts/test.sh sets it)");
            return;
        };
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus");
        for args in [
            &["check", "rules", "rules.yml", "alerts.yml"][..],
            &["test", "rules", "alerts_test.yml"],
        ] {
            let out = std::process::Command::new(&promtool)
                .args(args)
                .current_dir(dir)
                .output()
                .expect("run promtool");
            assert!(
                out.status.success(),
                "promtool {args:?} failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
