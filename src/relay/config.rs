//! The relay's configuration, validated: what `relay` (and `audit`, which
//! reads the same outbox) runs with. The command line builds it
//! (`crate::config`); nothing here knows about flags.

use std::time::Duration;

use super::columns::ColumnMap;
use super::route::Template;
use crate::nats::NatsArgs;

/// Everything the relay needs, validated.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub database_url: String,
    pub nats: NatsArgs,
    pub context: String,
    pub slot: String,
    pub publication: String,
    pub schema: String,
    pub table: String,
    pub stream: String,
    pub template: Template,
    /// `--columns`.
    pub columns: ColumnMap,
    /// `--header-columns`.
    pub header_columns: Vec<String>,
    /// `--streams`: where the `stream` role may route rows.
    pub streams: Vec<String>,
    /// `--unpublished`.
    pub unpublished: Option<String>,
    pub partitions: u32,
    pub envelope: bool,
    pub stream_replicas: u8,
    /// `--nats-monitor-url`.
    pub nats_monitor_url: Vec<String>,
    /// `--require-durable`.
    pub require_durable: bool,
    pub stream_max_age: Duration,
    pub stream_max_bytes: i64,
    pub duplicate_window: Duration,
    pub max_inflight: usize,
    pub max_inflight_bytes: usize,
    pub publish_timeout: Duration,
    pub shutdown_timeout: Duration,
    pub binary: bool,
    pub max_backoff: Duration,
    /// What a relay that creates its slot publishes first.
    pub backfill: Backfill,
    /// `--resync-since`, when given: overrides `backfill` for a new slot.
    pub resync_since: Option<Backfill>,
    /// Whether the slot should be a failover slot where the server has them.
    pub failover_slot: bool,
    pub publish_mode: PublishMode,
    /// `--emitted-events on`: publish what `outbox_emit()` writes.
    pub emitted_events: bool,
    /// `--schemas`, compiled (with `--schema-missing`); SIGHUP reloads them.
    pub schemas: Option<std::sync::Arc<crate::schema::Schemas>>,
}

/// `--publish-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishMode {
    /// Atomic batches where the server and the stream support them.
    Auto,
    /// Atomic batches, or refuse to start.
    Batch,
    /// One publish per event.
    Event,
}

/// Which rows the relay reads from its new slot's snapshot before streaming.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backfill {
    None,
    /// `published_at IS NULL` (every row unless a polling relay ran).
    Unpublished,
    /// `occurred_at >=` this RFC 3339 time (a resync after a lost slot).
    Since(String),
}
