//! outbox-relay: the transactional outbox, relayed from the Postgres WAL to
//! NATS JetStream.
//!
//! The modules follow the data's path:
//! [`postgres`] (slot, publication) → replication stream → [`events`]
//! ([`pgoutput`] decode, [`outbox`] row, [`route`] subject and headers) → [`publish`]
//! (JetStream, in order) → [`watermark`] (slot ack), driven by [`relay`].
//! The consumer: [`consume`] (pull, per-aggregate order) → [`inbox`] (dedupe)
//! → [`handler`] (HTTP or Rust, in the inbox transaction) → [`dlq`].
//! Beside them: [`metrics`] (names, recorder), [`slots`] (`pg_replication_slots`
//! monitor) and [`endpoint`] (`/metrics`, `/healthz`, `/readyz`).

pub mod config;
pub mod consume;
pub mod dlq;
pub mod endpoint;
pub mod error;
pub mod events;
pub mod handler;
pub mod inbox;
pub mod metrics;
pub mod nats;
pub mod outbox;
pub mod pgoutput;
pub mod postgres;
pub mod publish;
pub mod relay;
pub mod route;
pub mod slots;
pub mod watermark;

pub use error::{Error, Result};

/// Select ring as the process-wide TLS provider before any TLS connection
/// (Postgres or NATS). Two providers are linked in, and rustls refuses to
/// guess; call this first in any binary that uses the crate's connections.
pub fn install_tls_provider() {
    // Err means one is installed already, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}
