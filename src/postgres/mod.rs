//! Postgres connections: `DATABASE_URL` (with its libpq TLS parameters) as
//! sqlx pools and as `pgwire-replication`'s config, so the SQL and the
//! replication connections always agree. [`provision`] makes sure the
//! table, publication and slot exist.

pub(crate) mod kept;
mod pgpass;
pub(crate) mod pooler;
pub(crate) mod provision;

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use percent_encoding::percent_decode_str;
use pgwire_replication::{Lsn, ReplicationConfig, SslMode, TlsConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::error::{Error, Result};

/// `DATABASE_URL` resolved once, as libpq and sqlx read it: the URL, its
/// query parameters (`host=`, `port=`, `user=`, `password=`, `dbname=`,
/// `sslmode=`, `sslrootcert=`, …), then the `PG*` environment variables
/// and the password file for what they leave out. The pools and the
/// replication connection are both built from this one reading, so they
/// always reach the same server the same way.
#[derive(Clone)]
pub struct Dsn {
    /// For the pools.
    options: PgConnectOptions,
    /// A host name or address, or a Unix socket directory (`/…`).
    pub host: String,
    pub port: u16,
    pub user: String,
    password: String,
    pub database: String,
    /// TLS for the replication connection, the same as the pools'.
    tls: TlsConfig,
}

impl std::fmt::Debug for Dsn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "postgres://{}@{}:{}/{}",
            self.user, self.host, self.port, self.database
        )
    }
}

impl Dsn {
    pub fn parse(url: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::Config(format!(
                "DATABASE_URL: {why} (expected postgres://user[:password]@host[:port]/database)"
            ))
        };
        let parsed = url::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
        if !matches!(parsed.scheme(), "postgres" | "postgresql") {
            return Err(bad(&format!(
                "scheme {:?} is not postgres",
                parsed.scheme()
            )));
        }
        let mut options = PgConnectOptions::from_str(url).map_err(|e| bad(&e.to_string()))?;
        let decode = |s: &str| percent_decode_str(s).decode_utf8_lossy().into_owned();
        // sqlx has no getters for these: read the same sources in the same
        // order (the last query parameter wins, as in sqlx).
        let param = |names: &[&str]| {
            parsed
                .query_pairs()
                .filter(|(k, _)| names.contains(&k.as_ref()))
                .last()
                .map(|(_, v)| v.into_owned())
        };
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let file = |names: &[&str], var: &str| param(names).or_else(|| env(var)).map(PathBuf::from);
        // libpq's files in ~/.postgresql when nothing names others.
        let home = |name: &str| {
            env("HOME")
                .map(|h| PathBuf::from(h).join(".postgresql").join(name))
                .filter(|p| p.is_file())
        };
        let mut root = file(&["sslrootcert", "ssl-root-cert", "ssl-ca"], "PGSSLROOTCERT");
        if root.as_ref().is_some_and(|p| p.as_os_str() == "system") {
            // libpq 16: the system's trust store, and then nothing weaker
            // than verify-full (those roots vouch for any name they signed).
            match param(&["sslmode", "ssl-mode"]).or_else(|| env("PGSSLMODE")).as_deref() {
                None | Some("verify-full") => {
                    options = options.ssl_mode(sqlx::postgres::PgSslMode::VerifyFull)
                }
                Some(other) => {
                    return Err(bad(&format!(
                        "sslrootcert=system with sslmode={other}: as in libpq, the system's roots go only with sslmode=verify-full (or no sslmode)"
                    )))
                }
            }
            let bundle = system_roots().ok_or_else(|| {
                bad("sslrootcert=system: no system certificate bundle found (set SSL_CERT_FILE to one)")
            })?;
            options = options.ssl_root_cert(&bundle);
            root = Some(bundle);
        } else if root.is_none() {
            if let Some(p) = home("root.crt") {
                options = options.ssl_root_cert(&p);
                root = Some(p);
            }
        }
        if let Some(p) = root.as_ref().filter(|p| !p.is_file()) {
            return Err(bad(&format!(
                "sslrootcert={} is not a readable file",
                p.display()
            )));
        }
        let host = match options.get_socket() {
            Some(dir) => dir.to_string_lossy().into_owned(),
            None => options.get_host().to_owned(),
        };
        let socket = host.starts_with('/');
        use sqlx::postgres::PgSslMode as Pg;
        let mode = match options.get_ssl_mode() {
            // PostgreSQL never encrypts a Unix socket.
            Pg::Require | Pg::VerifyCa | Pg::VerifyFull if socket => {
                return Err(bad(&format!(
                    "sslmode={} over the Unix socket {host}: PostgreSQL does not encrypt Unix sockets; use sslmode=prefer or disable, or a TCP host",
                    ssl_mode_name(options.get_ssl_mode())
                )))
            }
            _ if socket => SslMode::Disable,
            Pg::Disable => SslMode::Disable,
            Pg::Allow | Pg::Prefer => SslMode::Prefer,
            // libpq: `require` with a root certificate verifies the chain.
            Pg::Require if root.is_some() => {
                options = options.ssl_mode(Pg::VerifyCa);
                SslMode::VerifyCa
            }
            Pg::Require => SslMode::Require,
            Pg::VerifyCa => SslMode::VerifyCa,
            Pg::VerifyFull => SslMode::VerifyFull,
        };
        let (mut cert, mut key) = (
            file(&["sslcert", "ssl-cert"], "PGSSLCERT"),
            file(&["sslkey", "ssl-key"], "PGSSLKEY"),
        );
        if cert.is_none() && key.is_none() && mode != SslMode::Disable {
            match (home("postgresql.crt"), home("postgresql.key")) {
                (Some(c), Some(k)) => {
                    options = options.ssl_client_cert(&c).ssl_client_key(&k);
                    (cert, key) = (Some(c), Some(k));
                }
                // As libpq: a certificate it would send without its key.
                (Some(c), None) => {
                    return Err(bad(&format!(
                        "{} is present but not postgresql.key beside it (libpq's default client certificate needs its key)",
                        c.display()
                    )))
                }
                _ => {}
            }
        }
        // An address checks against the certificate's IP names, as libpq
        // and the pools do; pgwire-replication refuses an IP host under
        // verify-full unless told the name to check, which is the address.
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let ip = bare.parse::<std::net::IpAddr>().is_ok();
        let tls = TlsConfig {
            mode,
            ca_pem_path: root,
            sni_hostname: (mode == SslMode::VerifyFull && ip).then(|| bare.to_owned()),
            client_cert_pem_path: cert,
            client_key_pem_path: key,
        };
        let port = options.get_port();
        let user = options.get_username().to_owned();
        let database = options.get_database().unwrap_or(&user).to_owned();
        let password = parsed
            .password()
            .map(decode)
            .or_else(|| param(&["password"]))
            .or_else(|| env("PGPASSWORD"))
            .or_else(|| pgpass::find(&host, port, &database, &user))
            .unwrap_or_default();
        Ok(Self {
            options,
            host,
            port,
            user,
            password,
            database,
            tls,
        })
    }

    /// One connection's options (not a pool's), for a check that must not
    /// wait behind the pool.
    pub fn connect_options(&self) -> PgConnectOptions {
        self.options.clone().application_name("outbox-relay")
    }

    pub async fn pool(&self, max_connections: u32) -> Result<PgPool> {
        self.pool_of(self.options.clone(), max_connections).await
    }

    /// A pool for an operations command whose statements may run for
    /// minutes (the audit's copy of a stream): a role's or database's
    /// `statement_timeout` (managed Postgres sets one) would cancel them.
    pub async fn pool_untimed(&self, max_connections: u32) -> Result<PgPool> {
        let opts = self.options.clone().options([
            ("statement_timeout", "0"),
            ("idle_in_transaction_session_timeout", "0"),
            ("lock_timeout", "0"),
        ]);
        self.pool_of(opts, max_connections).await
    }

    async fn pool_of(&self, opts: PgConnectOptions, max_connections: u32) -> Result<PgPool> {
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(opts.application_name("outbox-relay"))
            .await
            .map_err(Error::pg(format!("connecting to {self:?}")))
    }

    /// A pool that connects on first use and reconnects after failures, for
    /// background work that must outlive an unreachable server.
    pub fn lazy_pool(&self, max_connections: u32, acquire_timeout: Duration) -> Result<PgPool> {
        let opts = self.options.clone().application_name("outbox-relay");
        Ok(PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(acquire_timeout)
            .connect_lazy_with(opts))
    }

    /// The replication stream's config. The session is pinned to ISO dates in
    /// UTC so text-format timestamps decode the same on every server.
    pub fn replication_config(
        &self,
        slot: &str,
        publications: impl Into<pgwire_replication::config::Publication>,
    ) -> ReplicationConfig {
        ReplicationConfig::new(
            self.host.clone(),
            self.user.clone(),
            self.password.clone(),
            self.database.clone(),
            slot.to_owned(),
            publications,
        )
        .with_port(self.port)
        .with_tls(self.tls.clone())
        // bytea as hex and intervals in Postgres's own style, as the
        // backfill reads them: a role or database setting must not change
        // what text tuples carry.
        .with_options(
            TUPLE_TEXT
                .iter()
                .map(|(k, v)| format!("-c {k}={v}"))
                .collect::<Vec<_>>()
                .join(" "),
        )
        .with_application_name(format!("outbox-relay:{slot}"))
    }
}

/// The settings every session that reads rows as text tuples carry runs
/// with (replication, backfill, audit): a role's or database's own (a time
/// zone, `IntervalStyle = iso_8601`, `bytea_output = escape`) must not change
/// what a row reads as, streamed or backfilled.
const TUPLE_TEXT: [(&str, &str); 5] = [
    ("DateStyle", "ISO"),
    ("TimeZone", "UTC"),
    ("bytea_output", "hex"),
    ("IntervalStyle", "postgres"),
    ("extra_float_digits", "1"),
];

/// [`TUPLE_TEXT`] for a transaction: `SET LOCAL …;` each.
pub fn set_local_tuple_text() -> String {
    TUPLE_TEXT
        .iter()
        .map(|(k, v)| format!("SET LOCAL {k} = '{v}'; "))
        .collect()
}

/// The system's certificate bundle, where OpenSSL (so libpq's
/// `sslrootcert=system`) finds it: `SSL_CERT_FILE`, else the usual places.
fn system_roots() -> Option<PathBuf> {
    let named = std::env::var_os("SSL_CERT_FILE").map(PathBuf::from);
    named
        .into_iter()
        .chain(
            [
                "/etc/ssl/certs/ca-certificates.crt",
                "/etc/pki/tls/certs/ca-bundle.crt",
                "/etc/ssl/ca-bundle.pem",
                "/etc/pki/tls/cacert.pem",
                "/etc/ssl/cert.pem",
            ]
            .map(PathBuf::from),
        )
        .find(|p| p.is_file())
}

fn ssl_mode_name(mode: sqlx::postgres::PgSslMode) -> &'static str {
    use sqlx::postgres::PgSslMode as Pg;
    match mode {
        Pg::Disable => "disable",
        Pg::Allow => "allow",
        Pg::Prefer => "prefer",
        Pg::Require => "require",
        Pg::VerifyCa => "verify-ca",
        Pg::VerifyFull => "verify-full",
    }
}

/// The WAL position (as text) a slot must confirm to have decoded every
/// commit visible now: the insert position, or the flush position when
/// nothing lies between them but a page header. That is an idle cluster
/// whose last record ended on a page boundary (after a WAL switch, say):
/// a walsender sends no further than the flush, and nothing more is
/// written, so the insert position would not be confirmed for as long as
/// the cluster stays idle (review A13). A header is 40 bytes on a
/// segment's first page, 24 on the others; 40 past another page is 16
/// bytes of a record, and the insert position stands.
pub const WAL_NOW: &str =
    "(CASE WHEN pg_wal_lsn_diff(pg_current_wal_insert_lsn(), pg_current_wal_flush_lsn()) \
       = CASE WHEN pg_wal_lsn_diff(pg_current_wal_flush_lsn(), '0/0') \
                   % pg_size_bytes(current_setting('wal_segment_size')) = 0 THEN 40 \
              WHEN pg_wal_lsn_diff(pg_current_wal_flush_lsn(), '0/0') \
                   % current_setting('wal_block_size')::numeric = 0 THEN 24 END \
     THEN pg_current_wal_flush_lsn() ELSE pg_current_wal_insert_lsn() END)::text";

pub fn parse_lsn(s: &str) -> Result<Lsn> {
    Lsn::parse(s).map_err(|e| Error::setup(format!("bad LSN from server {s:?}: {e}")))
}

pub(crate) fn db_code(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// The server's `wal_sender_timeout`; `None` when disabled (0), or when
/// it reads in an unexpected unit (warned about). Read from
/// `pg_settings`, whose `setting` is in the parameter's base unit
/// (milliseconds here), not parsed from `SHOW`'s text (`60s`, `1min`).
pub async fn wal_sender_timeout(pool: &sqlx::PgPool) -> Result<Option<Duration>> {
    let (setting, unit): (String, Option<String>) =
        sqlx::query_as("SELECT setting, unit FROM pg_settings WHERE name = 'wal_sender_timeout'")
            .fetch_one(pool)
            .await
            .map_err(Error::pg("reading wal_sender_timeout"))?;
    match (setting.parse::<u64>(), unit.as_deref()) {
        (Ok(ms), Some("ms")) => Ok((ms > 0).then(|| Duration::from_millis(ms))),
        // As a server that says nothing we read: feedback every second,
        // and no pause limit of its own.
        _ => {
            tracing::warn!(setting, ?unit, "wal_sender_timeout is not in milliseconds as expected; sending feedback every second");
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dsn_parts() {
        let d = Dsn::parse("postgres://app:p%40ss@db.local:6543/orders?sslmode=disable").unwrap();
        assert_eq!(
            (d.host.as_str(), d.port, d.user.as_str()),
            ("db.local", 6543, "app")
        );
        assert_eq!(d.password, "p@ss");
        assert_eq!(d.database, "orders");
        assert!(!format!("{d:?}").contains("p@ss"), "password never printed");
        assert!(matches!(Dsn::parse("mysql://x/y"), Err(Error::Config(_))));
        assert!(matches!(Dsn::parse("not a url"), Err(Error::Config(_))));
    }

    #[test]
    fn the_system_roots_go_with_verify_full_only() {
        let err = Dsn::parse("postgres://app@db.local/orders?sslrootcert=system&sslmode=require")
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("verify-full"), "{err}");
        if system_roots().is_some() {
            let d = Dsn::parse("postgres://app@db.local/orders?sslrootcert=system").unwrap();
            assert_eq!(d.tls.mode, SslMode::VerifyFull);
            assert!(d.tls.ca_pem_path.is_some_and(|p| p.is_file()));
        }
    }

    #[test]
    fn verify_full_checks_an_address_host_as_an_address() {
        let d = Dsn::parse("postgres://app@127.0.0.1/orders?sslmode=verify-full").unwrap();
        assert_eq!(d.tls.sni_hostname.as_deref(), Some("127.0.0.1"));
        let d = Dsn::parse("postgres://app@[::1]:5432/orders?sslmode=verify-full").unwrap();
        assert_eq!(d.tls.sni_hostname.as_deref(), Some("::1"));
        let d = Dsn::parse("postgres://app@db.local/orders?sslmode=verify-full").unwrap();
        assert_eq!(d.tls.sni_hostname, None);
    }
}
