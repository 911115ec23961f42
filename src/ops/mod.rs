//! Beside the data paths: metric names and the recorder ([`metrics`]), the
//! `pg_replication_slots` monitor ([`slot_monitor`]) and the operator
//! endpoint ([`endpoint`]: `/metrics`, `/healthz`, `/readyz`).

pub mod admin_log;
pub mod audit;
pub mod dlq;
pub mod durability;
pub mod endpoint;
pub(crate) mod listener;
pub mod metrics;
pub mod prune;
pub mod reset;
pub(crate) mod slot_monitor;
