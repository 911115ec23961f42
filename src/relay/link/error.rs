//! What a link's dial or its use can fail with, typed so that a caller
//! tells a refusal (authentication, authorization) from a timeout from a
//! broken protocol from a connection that simply went away.

use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The socket failed (refused, reset, unreachable).
    #[error("{server}: {source}")]
    Io {
        server: String,
        #[source]
        source: std::io::Error,
    },
    /// The server answered the handshake with `-ERR`: wrong credentials, or
    /// a user it does not authorize. Another try with the same settings
    /// gets the same answer.
    #[error("{server}: refused: {message}")]
    Refused { server: String, message: String },
    /// No connection, or no finished handshake, in time.
    #[error("{server}: no connection within {after:?}")]
    TimedOut { server: String, after: Duration },
    /// The handshake could not go on: TLS, an unreadable or missing INFO,
    /// a CONNECT that would not encode.
    #[error("{server}: {message}")]
    Handshake { server: String, message: String },
    /// The server closed the connection.
    #[error("the connection closed")]
    Closed,
    /// The link had ended (its reason) when it was asked for an answer.
    #[error("the publish connection ended: {0}")]
    Ended(String),
    /// What the server sent is not NATS.
    #[error("the server broke the protocol: {0}")]
    Protocol(String),
    /// The settings cannot make a link (a file, a server list).
    #[error("{0}")]
    Config(String),
}
