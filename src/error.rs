//! One error type for the relay, with a retry class.
//!
//! - [`Class::Transient`]: the connection or the peer failed; reconnect with
//!   backoff and resume from the slot's confirmed LSN.
//! - [`Class::Permanent`]: configuration, privileges or a slot that is gone;
//!   retrying cannot help, so the process exits with one clear line.
//!
//! Poison rows are not errors at all: routing turns them into dead letters.

use crate::pgoutput::DecodeError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Transient,
    Permanent,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Config(String),

    /// Missing privilege or object, with the statement that fixes it.
    #[error("{0}")]
    Setup(String),

    #[error("postgres: {context}: {source}")]
    Postgres {
        context: String,
        #[source]
        source: sqlx::Error,
    },

    #[error("replication stream: {0}")]
    Replication(#[from] pgwire_replication::PgWireError),

    #[error("nats: {context}: {message}")]
    Nats { context: String, message: String },

    #[error("publish: {0}")]
    Publish(String),

    #[error("{0}")]
    Decode(#[from] DecodeError),

    /// The server closed the replication stream without an error.
    #[error("replication stream ended by the server")]
    StreamEnded,
}

impl Error {
    pub fn class(&self) -> Class {
        match self {
            Error::Config(_) | Error::Setup(_) | Error::Decode(_) => Class::Permanent,
            Error::Postgres { source, .. } => match source {
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::PoolClosed
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_) => Class::Transient,
                sqlx::Error::Database(db) => match db.code().as_deref() {
                    // Connection exceptions, operator intervention (shutdown,
                    // terminated backend), insufficient resources.
                    Some(c)
                        if c.starts_with("08") || c.starts_with("57") || c.starts_with("53") =>
                    {
                        Class::Transient
                    }
                    _ => Class::Permanent,
                },
                _ => Class::Permanent,
            },
            Error::Replication(e) => {
                if e.is_transient() {
                    return Class::Transient;
                }
                let text = e.to_string();
                // The walsender was terminated, the server is shutting down, or
                // another session holds the slot for now: all pass.
                if text.contains("57P01")
                    || text.contains("57P02")
                    || text.contains("57P03")
                    || text.contains("55006")
                    || text.contains("terminating connection")
                    || text.contains("is active for PID")
                    || text.contains("the database system is")
                {
                    Class::Transient
                } else {
                    Class::Permanent
                }
            }
            Error::Nats { .. } | Error::Publish(_) | Error::StreamEnded => Class::Transient,
        }
    }

    pub fn pg(context: impl Into<String>) -> impl FnOnce(sqlx::Error) -> Error {
        let context = context.into();
        move |source| Error::Postgres { context, source }
    }

    pub fn nats<E: std::fmt::Display>(context: impl Into<String>) -> impl FnOnce(E) -> Error {
        let context = context.into();
        move |e| Error::Nats {
            context,
            message: e.to_string(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
