//! Above the components: the operations commands (`audit`, `dlq`,
//! `prune`, `reset`, the admin log they record in), the
//! `pg_replication_slots` monitor ([`slot_monitor`]) and the operator
//! endpoint ([`endpoint`]: `/metrics`, `/healthz`, `/readyz`). They may use
//! the relay and the consumer; neither uses them (tests/layout.rs).

pub mod admin_log;
pub mod audit;
pub mod dlq;
pub mod endpoint;
pub(crate) mod listener;
pub mod prune;
pub mod reset;
pub(crate) mod slot_monitor;
