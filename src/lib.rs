//! outbox-relay: the transactional outbox, relayed from the Postgres WAL to
//! NATS JetStream, and consumed through an inbox.
//!
//! The modules follow the data's path (ARCHITECTURE.md draws them):
//! - [`relay`]: replication stream → decode → route → publish → slot ack;
//! - [`consumer`]: pull → inbox (dedupe) → handler (HTTP or Rust, in the
//!   inbox transaction) → ack, NAK or dead letter;
//! - below both paths, what they share: [`wire`] (the contract: headers,
//!   names, positions), [`schema`] (the event schemas payloads are checked
//!   against), [`metrics`] (names and the recorder), [`readiness`] (what
//!   `/readyz` reports), [`durability`] (the NATS placement verdict), and
//!   the Postgres and NATS connections;
//! - above them, [`ops`]: the operations commands (audit, dlq, prune,
//!   reset), the slot monitor and the operator endpoint, then the
//!   [`console`] and the [`cli`]. No component imports `ops` (tests/layout.rs).
//!
//! A Rust service embeds the consumer with its own [`Handler`]:
//! [`consumer::run`] with a [`ConsumeConfig`] and a [`Readiness`].

pub(crate) mod backoff;
pub mod cli;
pub mod config;
pub mod console;
pub mod consumer;
pub mod durability;
pub mod error;
mod json;
pub mod metrics;
pub(crate) mod nats;
pub mod ops;
pub(crate) mod postgres;
pub mod readiness;
pub mod relay;
pub mod schema;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod triage;
pub mod wire;

pub use consumer::{ConsumeConfig, Delivery, Handler, Outcome};
pub use error::{Error, Result};
pub use readiness::Readiness;

/// Select ring as the process-wide TLS provider before any TLS connection
/// (Postgres or NATS). Two providers are linked in, and rustls refuses to
/// guess; call this first in any binary that uses the crate's connections.
pub fn install_tls_provider() {
    // Err means one is installed already, which is what we want.
    let _ = rustls::crypto::ring::default_provider().install_default();
}
