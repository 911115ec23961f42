//! The per-event publisher's own NATS connection: `HPUB` out, acks in.
//!
//! Through async-nats every event cost a header map (a hash map of owned
//! names and values, built and dropped per message), a command on the
//! client's channel and a subscription hand-off for its ack. Measured by
//! `scripts/bench.sh publish-paths` on this project's box, that path costs
//! 3.45-3.70 µs of client CPU per message flat out against 1.85-1.95 for a
//! writer that puts the header block straight into its output buffer and
//! reads the acks off the socket (docs/guide/benchmarks.md). So the hot path
//! has its own connection, and so do atomic batches (their messages and
//! commits go through it too); the rest (stream set-up, tail scans, a
//! batch looked up after a lost answer) stays on the async-nats client.
//!
//! The link does as little as a publisher needs: the handshake (INFO,
//! optional TLS, CONNECT with the configured authentication, one wildcard
//! `SUB` for the acks, PING/PONG), `HPUB`, and reading `MSG`/`HMSG` answers.
//! It does not reconnect: a link that breaks answers nothing more, and the
//! publisher, which treats silence and a broken link as an outage, dials a
//! new one when it sends again ([`Dialer`]).
//!
//! Two small tasks serve a link. The writer writes what [`Link::publish`]
//! appended to a buffer; on the relay's one-thread runtime it runs when
//! the session has nothing left to do, so a transaction's events leave in
//! one write. The reader parses answers into a queue the session takes
//! them from, and answers the server's PINGs, busy or idle.
//!
//! One job per file: [`dial`] (servers, TLS, handshake and authentication),
//! [`writer`] (the `HPUB` encoder and the socket writer, the keepalive),
//! [`reader`] (the protocol parser and the socket reader), [`queues`] (what
//! the session and the two tasks share), [`handle`] (the [`Link`] the
//! publisher holds) and [`error`] ([`LinkError`]).

mod dial;
mod error;
mod handle;
mod queues;
mod reader;
mod writer;

pub use dial::Dialer;
pub use error::LinkError;
pub use handle::{Denied, Heard, Link};
pub use queues::Reply;
#[cfg(any(test, feature = "testing"))]
pub use writer::encode_message;

#[cfg(test)]
mod tests;
