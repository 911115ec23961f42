//! One error type for the crate's boundaries, with a retry class.
//!
//! - [`Class::Transient`]: the connection or the peer failed; reconnect with
//!   backoff and resume from the slot's confirmed LSN.
//! - [`Class::Permanent`]: configuration, privileges or a slot that is gone;
//!   retrying cannot help, so the process exits with one clear line.
//!
//! Every variant that wraps a library failure keeps it as its `source`, so
//! the chain and the library's own kind survive; the class is decided from
//! structured facts (SQLSTATE codes, error kinds), never from message text.
//!
//! Poison rows are not errors at all: routing turns them into dead letters.

use crate::relay::pgoutput::DecodeError;

/// Whether retrying can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Transient,
    Permanent,
}

/// Any library error, kept as a source.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What a failed JetStream publish ran into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishFailure {
    /// The connection would not take the message.
    Send,
    /// `Nats-Expected-Last-Msg-Id` did not match: an earlier message did not
    /// reach the stream, or another writer appended to it.
    OutOfOrder,
    /// No stream captures the subject (or the stream has no leader now).
    NoStream,
    TimedOut,
    /// The stream is at its limits (discard new) and takes nothing more.
    StreamFull,
    Other,
}

impl PublishFailure {
    fn describe(self) -> &'static str {
        match self {
            Self::Send => "could not be sent",
            Self::OutOfOrder => "refused out of order (an earlier message did not reach the stream, or another writer appended to it)",
            Self::NoStream => "found no stream capturing its subject",
            Self::TimedOut => "ack timed out",
            Self::StreamFull => "was refused: the relay's stream is at its limits (max_msgs, max_bytes or max_msgs_per_subject with discard new) and takes nothing more until it has room (raise the limit, or set discard old); nothing is lost meanwhile, the slot keeps every event",
            Self::Other => "failed",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad configuration, found before connecting: one line with the fix.
    #[error("{0}")]
    Config(String),

    /// A missing privilege or object, with the statement that fixes it.
    #[error("{message}")]
    Setup {
        message: String,
        #[source]
        source: Option<BoxError>,
    },

    #[error("postgres: {context}: {source}")]
    Postgres {
        context: String,
        #[source]
        source: sqlx::Error,
    },

    #[error("replication stream: {source}")]
    Replication {
        #[from]
        source: pgwire_replication::PgWireError,
    },

    /// The first connection failed (afterwards the client reconnects by itself).
    #[error("cannot connect to NATS at {servers}: {source}")]
    NatsConnect {
        /// Without credentials.
        servers: String,
        #[source]
        source: BoxError,
    },

    /// An HTTP service we read (an OIDC issuer's keys) did not answer.
    #[error("{context}: {source}")]
    Http {
        context: String,
        #[source]
        source: BoxError,
    },

    #[error("nats: {context}: {source}")]
    Nats {
        context: String,
        #[source]
        source: BoxError,
    },

    #[error("publish: event {id} {}: {source}", .failure.describe())]
    Publish {
        id: String,
        failure: PublishFailure,
        #[source]
        source: BoxError,
    },

    #[error("{0}")]
    Decode(#[from] DecodeError),

    /// Another process (an active relay) streams from the slot: this one
    /// is a standby until it frees.
    #[error("slot {slot} is held by another process{}", .pid.map(|p| format!(" (PID {p})")).unwrap_or_default())]
    SlotBusy { slot: String, pid: Option<i32> },

    /// A stream `--streams` names, missing when the session began, exists
    /// now: the session starts over to route rows to it.
    #[error(
        "stream {stream} exists now: starting the session over to route the rows naming it there"
    )]
    StreamFound { stream: String },

    /// A session ended on purpose, to begin again at once with what has
    /// changed (the slot has passed the making of the kept publication,
    /// `postgres::kept`): said, not counted as a restart.
    #[error("{0}")]
    StartOver(String),

    /// Postgres stopped hearing the replication connection (`relay::heard`).
    #[error("{0}")]
    ReplicationSilent(String),

    /// The server closed the replication stream without an error.
    #[error("replication stream ended by the server")]
    StreamEnded,

    /// The process did not run for this long (SIGSTOP, a VM pause): its
    /// slot may have been taken over meanwhile, so nothing more is sent.
    #[error("the relay was paused for {}.{:01} s (SIGSTOP, a VM pause): another relay may stream from the slot now, so this session sends nothing more and starts over from the slot", .paused.as_secs(), .paused.subsec_millis() / 100)]
    Paused { paused: std::time::Duration },
}

impl Error {
    pub fn class(&self) -> Class {
        match self {
            Error::Config(_) | Error::Setup { .. } | Error::Decode(_) => Class::Permanent,
            Error::Postgres { source, .. } => sqlx_class(source),
            Error::Replication { source } => replication_class(source),
            Error::NatsConnect { .. }
            | Error::SlotBusy { .. }
            | Error::Nats { .. }
            | Error::Http { .. }
            | Error::Publish { .. }
            | Error::StreamEnded
            | Error::ReplicationSilent(_)
            | Error::StreamFound { .. }
            | Error::StartOver(_)
            | Error::Paused { .. } => Class::Transient,
        }
    }

    pub fn setup(message: impl Into<String>) -> Error {
        Error::Setup {
            message: message.into(),
            source: None,
        }
    }

    /// `map_err` helper: a Postgres failure while doing `context`.
    pub fn pg(context: impl Into<String>) -> impl FnOnce(sqlx::Error) -> Error {
        let context = context.into();
        move |source| Error::Postgres { context, source }
    }

    /// `map_err` helper: a NATS failure while doing `context`.
    pub fn nats<E>(context: impl Into<String>) -> impl FnOnce(E) -> Error
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let context = context.into();
        move |e| Error::Nats {
            context,
            source: Box::new(e),
        }
    }

    /// Whether the relay's own stream refused an event for its limits.
    pub fn is_stream_full(&self) -> bool {
        matches!(
            self,
            Error::Publish {
                failure: PublishFailure::StreamFull,
                ..
            }
        )
    }

    /// Whether the slot is in use by another process: found so before
    /// streaming, or refused by the server with object_in_use (55006).
    pub fn is_slot_busy(&self) -> bool {
        matches!(self, Error::SlotBusy { .. }) || self.sqlstate().as_deref() == Some("55006")
    }

    /// The SQLSTATE of a Postgres or replication error, when the server sent one.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            Error::Postgres {
                source: sqlx::Error::Database(db),
                ..
            } => db.code().map(|c| c.into_owned()),
            Error::Replication {
                source: pgwire_replication::PgWireError::Server(text),
            } => replication_sqlstate(text).map(str::to_owned),
            _ => None,
        }
    }
}

fn sqlx_class(e: &sqlx::Error) -> Class {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_) => Class::Transient,
        sqlx::Error::Database(db) => db.code().map_or(Class::Permanent, |c| sqlstate_class(&c)),
        _ => Class::Permanent,
    }
}

fn replication_class(e: &pgwire_replication::PgWireError) -> Class {
    use pgwire_replication::PgWireError as E;
    match e {
        E::Io(_) | E::Task(_) => Class::Transient,
        E::Server(text) => replication_sqlstate(text).map_or(Class::Permanent, sqlstate_class),
        _ => Class::Permanent,
    }
}

/// pgwire-replication renders a server ErrorResponse as
/// `{message} (SQLSTATE {code})`: the code is a protocol field it appends,
/// not words of the message.
fn replication_sqlstate(text: &str) -> Option<&str> {
    let code = text.strip_suffix(')')?.rsplit_once("(SQLSTATE ")?.1;
    (code.len() == 5 && code.bytes().all(|b| b.is_ascii_alphanumeric())).then_some(code)
}

/// Which server errors pass by themselves.
fn sqlstate_class(code: &str) -> Class {
    match code {
        // Connection exceptions, insufficient resources, operator
        // intervention (shutdown, terminated backend, starting up).
        c if c.starts_with("08") || c.starts_with("53") || c.starts_with("57") => Class::Transient,
        // object_in_use: another walsender still holds the slot (the one of a
        // relay that just died, until the server notices).
        "55006" => Class::Transient,
        // Serialization failure, deadlock: the statement may simply be retried.
        "40001" | "40P01" => Class::Transient,
        _ => Class::Permanent,
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A URL as logs and errors may show it: user info (a password, a token)
/// becomes `***`, and the query and fragment, where tokens ride too, go.
/// The one policy for every URL the process names (the handler, each NATS
/// server). User info ends at the *last* `@`: a password may hold `/`, `?`,
/// `#` or `,` unencoded, so nothing before that `@` is trusted to be a host
/// or a path; an `@` later in a path or query hides more than it must,
/// never less.
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    };
    let (user_info, rest) = match rest.rfind('@') {
        Some(at) => ("***@", &rest[at + 1..]),
        None => ("", rest),
    };
    let kept = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    format!("{scheme}{user_info}{kept}")
}

/// Comma-separated URLs (`NATS_URL`), each as [`redact_url`] shows it.
pub fn redact_urls(urls: &str) -> String {
    urls.split(',')
        .map(redact_url)
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    #[test]
    fn urls_lose_their_credentials_query_and_fragment() {
        assert_eq!(
            redact_urls("nats://u:p@a:4222,tls://tok@b:4222,nats://c:4222"),
            "nats://***@a:4222,tls://***@b:4222,nats://c:4222"
        );
        assert_eq!(redact_urls("c:4222"), "c:4222");
        assert_eq!(redact_url("u:p@c:4222"), "***@c:4222", "no scheme");
        assert_eq!(
            redact_url("http://u:pw@127.0.0.1:9/hook?token=abc#frag"),
            "http://***@127.0.0.1:9/hook"
        );
        assert_eq!(
            redact_url("postgres://app:s3cret@db/orders?password=x"),
            "postgres://***@db/orders"
        );
        // Unencoded in a password: the user info still ends at the last @.
        assert_eq!(redact_url("http://u:p,w@h/hook"), "http://***@h/hook");
        assert_eq!(
            redact_urls("nats://user:pa/ss@host:4222"),
            "nats://***@host:4222"
        );
        assert_eq!(redact_urls("nats://user:p#ss@host"), "nats://***@host");
        assert_eq!(redact_urls("nats://user:p?ss@host"), "nats://***@host");
        // A comma in a single URL's query is not a list separator.
        assert_eq!(redact_url("http://h/hook?token=a,SECRET"), "http://h/hook");
        // An @ in a path or query hides more than it must, never less.
        assert_eq!(redact_url("http://h/p@q?x=a@b"), "http://***@b");
    }

    use super::*;
    use pgwire_replication::PgWireError;

    fn server(text: &str) -> Error {
        Error::Replication {
            source: PgWireError::Server(text.into()),
        }
    }

    #[test]
    fn replication_errors_are_classed_by_sqlstate() {
        let cases = [
            (
                "replication slot \"s\" is active for PID 42 (SQLSTATE 55006)",
                Class::Transient,
            ),
            (
                "terminating connection due to administrator command (SQLSTATE 57P01)",
                Class::Transient,
            ),
            (
                "the database system is starting up (SQLSTATE 57P03)",
                Class::Transient,
            ),
            ("connection failure (SQLSTATE 08006)", Class::Transient),
            ("too many connections (SQLSTATE 53300)", Class::Transient),
            (
                "replication slot \"s\" does not exist (SQLSTATE 42704)",
                Class::Permanent,
            ),
            ("permission denied (SQLSTATE 42501)", Class::Permanent),
            // The words alone decide nothing.
            (
                "terminating connection, is active for PID",
                Class::Permanent,
            ),
            (
                "text mentioning (SQLSTATE 57P01) in the middle",
                Class::Permanent,
            ),
        ];
        for (text, class) in cases {
            assert_eq!(server(text).class(), class, "{text}");
        }
        assert_eq!(
            server("x (SQLSTATE 55006)").sqlstate().as_deref(),
            Some("55006")
        );
        assert!(server("slot \"s\" is active for PID 7 (SQLSTATE 55006)").is_slot_busy());
        assert!(!server("x (SQLSTATE 57P01)").is_slot_busy());
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(Error::from(PgWireError::from(io)).class(), Class::Transient);
        assert_eq!(
            Error::from(PgWireError::Auth("bad password".into())).class(),
            Class::Permanent
        );
    }

    #[test]
    fn sql_errors_and_the_rest() {
        let pg = |e: sqlx::Error| Error::pg("x")(e).class();
        assert_eq!(pg(sqlx::Error::PoolTimedOut), Class::Transient);
        assert_eq!(
            pg(sqlx::Error::Io(std::io::ErrorKind::BrokenPipe.into())),
            Class::Transient
        );
        assert_eq!(pg(sqlx::Error::RowNotFound), Class::Permanent);
        for (code, class) in [
            ("08006", Class::Transient),
            ("57P01", Class::Transient),
            ("40001", Class::Transient),
            ("42501", Class::Permanent),
            ("23505", Class::Permanent),
        ] {
            assert_eq!(sqlstate_class(code), class, "{code}");
        }
        assert_eq!(Error::Config("x".into()).class(), Class::Permanent);
        assert_eq!(Error::setup("x").class(), Class::Permanent);
        assert_eq!(Error::StreamEnded.class(), Class::Transient);
        let nats = Error::nats("lookup")(std::io::Error::other("down"));
        assert_eq!(nats.class(), Class::Transient);
        assert_eq!(nats.to_string(), "nats: lookup: down");
        assert!(std::error::Error::source(&nats).is_some(), "source kept");
    }
}
