//! Replication-slot monitoring: `pg_replication_slots` for every logical slot
//! on the server, as Prometheus gauges and as `slot status`.
//!
//! The monitor polls on its own connection, apart from the replication
//! stream, so the figures keep coming while the relay cannot stream: a stalled
//! slot retaining WAL is exactly when an operator needs them. The latest
//! snapshot is rendered at scrape time; a failed poll empties it and sets
//! `outbox_relay_slot_monitor_up` to 0 rather than serving stale numbers.

use std::fmt::Write as _;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Serialize;
use sqlx::{PgPool, Row};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics as m;

/// One logical slot, as `slot status` prints it and `/metrics` exports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SlotStatus {
    pub slot: String,
    pub plugin: Option<String>,
    pub database: Option<String>,
    pub active: bool,
    pub active_pid: Option<i32>,
    pub restart_lsn: Option<String>,
    pub confirmed_flush_lsn: Option<String>,
    /// The server's current WAL position (the replay position on a standby).
    pub current_wal_lsn: String,
    /// Current WAL LSN − confirmed_flush_lsn: what the consumer has not confirmed.
    pub lag_bytes: Option<i64>,
    /// Current WAL LSN − restart_lsn: WAL the server keeps for this slot.
    pub retained_wal_bytes: Option<i64>,
    /// reserved | extended | unreserved | lost.
    pub wal_status: Option<String>,
    /// Bytes left before the slot is invalidated; only with max_slot_wal_keep_size.
    pub safe_wal_size_bytes: Option<i64>,
}

/// The states `wal_status` can take (PostgreSQL 13+).
pub const WAL_STATUSES: [&str; 4] = ["reserved", "extended", "unreserved", "lost"];

const QUERY: &str = "\
    SELECT s.slot_name::text, s.plugin::text, s.database::text, s.active, s.active_pid, \
           s.restart_lsn::text, s.confirmed_flush_lsn::text, c.lsn::text, \
           pg_wal_lsn_diff(c.lsn, s.confirmed_flush_lsn)::int8, \
           pg_wal_lsn_diff(c.lsn, s.restart_lsn)::int8, \
           s.wal_status, s.safe_wal_size \
    FROM pg_replication_slots s, \
         LATERAL (SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
                              ELSE pg_current_wal_lsn() END AS lsn) c \
    WHERE s.slot_type = 'logical' AND ($1::text IS NULL OR s.slot_name = $1) \
    ORDER BY s.slot_name";

/// Every logical slot on the server, or only `slot`.
pub async fn list(pool: &PgPool, slot: Option<&str>) -> Result<Vec<SlotStatus>> {
    let rows = sqlx::query(QUERY)
        .bind(slot)
        .fetch_all(pool)
        .await
        .map_err(Error::pg("reading pg_replication_slots"))?;
    Ok(rows
        .iter()
        .map(|r| SlotStatus {
            slot: r.get(0),
            plugin: r.get(1),
            database: r.get(2),
            active: r.get(3),
            active_pid: r.get(4),
            restart_lsn: r.get(5),
            confirmed_flush_lsn: r.get(6),
            current_wal_lsn: r.get::<Option<String>, _>(7).unwrap_or_default(),
            lag_bytes: r.get(8),
            retained_wal_bytes: r.get(9),
            wal_status: r.get(10),
            safe_wal_size_bytes: r.get(11),
        })
        .collect())
}

/// Drop `slot` for `reset`: refused while a backend streams from it.
pub async fn drop_slot(pool: &PgPool, slot: &str) -> Result<bool> {
    match list(pool, Some(slot)).await?.pop() {
        None => Ok(false),
        Some(s) if s.active => Err(Error::setup(format!(
            "slot {slot} is in use by backend PID {}; stop the relay first",
            s.active_pid.unwrap_or_default()
        ))),
        Some(_) => {
            sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(slot)
                .execute(pool)
                .await
                .map_err(Error::pg("pg_drop_replication_slot"))?;
            Ok(true)
        }
    }
}

/// The latest poll, shared between the monitor task and the scrape handler.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// `None` until the first poll finished; `Err` when the last one failed.
    pub slots: Option<std::result::Result<Vec<SlotStatus>, String>>,
}

#[derive(Debug, Clone, Default)]
pub struct SlotMetrics(Arc<RwLock<Snapshot>>);

impl SlotMetrics {
    fn set(&self, slots: std::result::Result<Vec<SlotStatus>, String>) {
        if let Ok(mut s) = self.0.write() {
            s.slots = Some(slots);
        }
    }

    /// Append the Prometheus text for the latest snapshot.
    pub fn render(&self, out: &mut String) {
        let snapshot = match self.0.read() {
            Ok(s) => s.clone(),
            Err(_) => Snapshot::default(),
        };
        render(&snapshot, out);
    }
}

/// Poll every `interval` until `shutdown`. Errors are logged once per change,
/// not once per poll, so an outage does not flood the log.
pub async fn monitor(
    pool: PgPool,
    interval: Duration,
    out: SlotMetrics,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_error: Option<String> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let polled = tokio::time::timeout(interval.max(Duration::from_secs(1)), list(&pool, None))
            .await
            .unwrap_or_else(|_| {
                Err(Error::setup(
                    "reading pg_replication_slots timed out".to_owned(),
                ))
            })
            .map_err(|e| e.to_string());
        match &polled {
            Ok(_) if last_error.is_some() => {
                tracing::info!("slot monitor: pg_replication_slots readable again");
                last_error = None;
            }
            Err(e) if last_error.as_ref() != Some(e) => {
                tracing::warn!(error = %e, "slot monitor: cannot read pg_replication_slots; slot metrics are absent until it can");
                last_error = Some(e.clone());
            }
            _ => {}
        }
        out.set(polled);
    }
}

/// Prometheus text exposition of a snapshot. Pure, so it is unit-tested.
pub fn render(snapshot: &Snapshot, out: &mut String) {
    let up = matches!(snapshot.slots, Some(Ok(_)));
    header(
        out,
        m::SLOT_MONITOR_UP,
        "1 when the last pg_replication_slots query succeeded",
    );
    let _ = writeln!(out, "{} {}", m::SLOT_MONITOR_UP, u8::from(up));
    let Some(Ok(slots)) = &snapshot.slots else {
        return;
    };

    let gauge =
        |out: &mut String, name: &str, help: &str, value: &dyn Fn(&SlotStatus) -> Option<i64>| {
            header(out, name, help);
            for s in slots {
                if let Some(v) = value(s) {
                    let _ = writeln!(out, "{name}{{slot=\"{}\"}} {v}", escape(&s.slot));
                }
            }
        };
    gauge(
        out,
        m::SLOT_LAG_BYTES,
        "Current WAL LSN minus the slot's confirmed_flush_lsn, in bytes",
        &|s| s.lag_bytes,
    );
    gauge(
        out,
        m::SLOT_RETAINED_WAL_BYTES,
        "Current WAL LSN minus the slot's restart_lsn: WAL kept for the slot, in bytes",
        &|s| s.retained_wal_bytes,
    );
    gauge(
        out,
        m::SLOT_ACTIVE,
        "1 when a walsender holds the slot",
        &|s| Some(i64::from(s.active)),
    );
    gauge(
        out,
        m::SLOT_SAFE_WAL_SIZE_BYTES,
        "Bytes of WAL that can still be written before the slot is lost (max_slot_wal_keep_size)",
        &|s| s.safe_wal_size_bytes,
    );
    header(
        out,
        m::SLOT_WAL_STATUS,
        "The slot's wal_status: 1 for the current status, 0 for the others",
    );
    for s in slots {
        let Some(current) = s.wal_status.as_deref() else {
            continue;
        };
        let mut statuses: Vec<&str> = WAL_STATUSES.to_vec();
        if !statuses.contains(&current) {
            statuses.push(current);
        }
        for status in statuses {
            let _ = writeln!(
                out,
                "{}{{slot=\"{}\",status=\"{}\"}} {}",
                m::SLOT_WAL_STATUS,
                escape(&s.slot),
                escape(status),
                u8::from(status == current)
            );
        }
    }
}

fn header(out: &mut String, name: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} gauge");
}

/// Label values escape `\`, `"` and newlines (exposition format).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(name: &str, wal_status: Option<&str>, safe: Option<i64>) -> SlotStatus {
        SlotStatus {
            slot: name.into(),
            plugin: Some("pgoutput".into()),
            database: Some("app".into()),
            active: name == "a",
            active_pid: None,
            restart_lsn: Some("0/10".into()),
            confirmed_flush_lsn: Some("0/20".into()),
            current_wal_lsn: "0/30".into(),
            lag_bytes: Some(16),
            retained_wal_bytes: Some(32),
            wal_status: wal_status.map(Into::into),
            safe_wal_size_bytes: safe,
        }
    }

    fn lines(s: &Snapshot) -> Vec<String> {
        let mut out = String::new();
        render(s, &mut out);
        out.lines()
            .filter(|l| !l.starts_with('#'))
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn every_slot_gets_its_series() {
        let s = Snapshot {
            slots: Some(Ok(vec![
                slot("a", Some("reserved"), Some(1024)),
                slot("b", Some("lost"), None),
            ])),
        };
        let l = lines(&s);
        for want in [
            "outbox_relay_slot_monitor_up 1",
            "pg_replication_slot_lag_bytes{slot=\"a\"} 16",
            "pg_replication_slot_lag_bytes{slot=\"b\"} 16",
            "pg_replication_slot_retained_wal_bytes{slot=\"b\"} 32",
            "pg_replication_slot_active{slot=\"a\"} 1",
            "pg_replication_slot_active{slot=\"b\"} 0",
            "pg_replication_slot_safe_wal_size_bytes{slot=\"a\"} 1024",
            "pg_replication_slot_wal_status{slot=\"a\",status=\"reserved\"} 1",
            "pg_replication_slot_wal_status{slot=\"a\",status=\"lost\"} 0",
            "pg_replication_slot_wal_status{slot=\"b\",status=\"lost\"} 1",
            "pg_replication_slot_wal_status{slot=\"b\",status=\"reserved\"} 0",
        ] {
            assert!(l.iter().any(|x| x == want), "missing {want}: {l:#?}");
        }
        // NULL safe_wal_size (no max_slot_wal_keep_size) is absent, not 0.
        assert!(!l
            .iter()
            .any(|x| x.starts_with("pg_replication_slot_safe_wal_size_bytes{slot=\"b\"}")));
    }

    #[test]
    fn a_failed_poll_reports_down_and_no_stale_slots() {
        for s in [
            Snapshot { slots: None },
            Snapshot {
                slots: Some(Err("connection refused".into())),
            },
        ] {
            assert_eq!(lines(&s), vec!["outbox_relay_slot_monitor_up 0"]);
        }
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn unknown_wal_status_is_still_reported() {
        let s = Snapshot {
            slots: Some(Ok(vec![slot("a", Some("future"), None)])),
        };
        assert!(lines(&s)
            .iter()
            .any(|x| x == "pg_replication_slot_wal_status{slot=\"a\",status=\"future\"} 1"));
    }
}
