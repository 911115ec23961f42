//! Postgres connections: `DATABASE_URL` (with its libpq TLS parameters) as
//! sqlx pools and as `pgwire-replication`'s config, so the SQL and the
//! replication connections always agree. [`provision`] makes sure the
//! table, publication and slot exist.

pub(crate) mod provision;

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use percent_encoding::percent_decode_str;
use pgwire_replication::{Lsn, ReplicationConfig, SslMode, TlsConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::error::{Error, Result};

/// The parts of `DATABASE_URL` the replication connection needs.
#[derive(Clone)]
pub struct Dsn {
    url: String,
    pub host: String,
    pub port: u16,
    pub user: String,
    password: String,
    pub database: String,
    /// TLS for the replication connection, from the URL's libpq parameters
    /// (`sslmode`, `sslrootcert`, `sslcert`, `sslkey`); sqlx reads the same
    /// parameters for the SQL connections.
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
        let decode = |s: &str| percent_decode_str(s).decode_utf8_lossy().into_owned();
        let param = |name: &str| {
            parsed
                .query_pairs()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.into_owned())
        };
        let root = param("sslrootcert").map(PathBuf::from);
        // libpq's default is `prefer`; `require` with a root certificate
        // verifies the chain, as libpq does.
        let mode = match param("sslmode").as_deref().unwrap_or("prefer") {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" if root.is_some() => SslMode::VerifyCa,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(bad(&format!(
                    "sslmode={other} is not one of disable, allow, prefer, require, verify-ca, verify-full"
                )))
            }
        };
        if let Some(p) = root.as_ref().filter(|p| !p.is_file()) {
            return Err(bad(&format!(
                "sslrootcert={} is not a readable file",
                p.display()
            )));
        }
        let tls = TlsConfig {
            mode,
            ca_pem_path: root,
            sni_hostname: None,
            client_cert_pem_path: param("sslcert").map(PathBuf::from),
            client_key_pem_path: param("sslkey").map(PathBuf::from),
        };
        let user = match parsed.username() {
            "" => std::env::var("PGUSER").unwrap_or_else(|_| "postgres".into()),
            u => decode(u),
        };
        let password = match parsed.password() {
            Some(p) => decode(p),
            None => std::env::var("PGPASSWORD").unwrap_or_default(),
        };
        let database = match parsed.path().trim_start_matches('/') {
            "" => user.clone(),
            d => decode(d),
        };
        Ok(Self {
            url: url.to_owned(),
            host: parsed.host_str().unwrap_or("127.0.0.1").to_owned(),
            port: parsed.port().unwrap_or(5432),
            user,
            password,
            database,
            tls,
        })
    }

    pub async fn pool(&self, max_connections: u32) -> Result<PgPool> {
        let opts = PgConnectOptions::from_str(&self.url)
            .map_err(|e| Error::Config(format!("DATABASE_URL: {e}")))?
            .application_name("outbox-relay");
        PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(opts)
            .await
            .map_err(Error::pg(format!("connecting to {self:?}")))
    }

    /// A pool that connects on first use and reconnects after failures, for
    /// background work that must outlive an unreachable server.
    pub fn lazy_pool(&self, max_connections: u32, acquire_timeout: Duration) -> Result<PgPool> {
        let opts = PgConnectOptions::from_str(&self.url)
            .map_err(|e| Error::Config(format!("DATABASE_URL: {e}")))?
            .application_name("outbox-relay");
        Ok(PgPoolOptions::new()
            .max_connections(max_connections)
            .acquire_timeout(acquire_timeout)
            .connect_lazy_with(opts))
    }

    /// The replication stream's config. The session is pinned to ISO dates in
    /// UTC so text-format timestamps decode the same on every server.
    pub fn replication_config(&self, slot: &str, publication: &str) -> ReplicationConfig {
        ReplicationConfig::new(
            self.host.clone(),
            self.user.clone(),
            self.password.clone(),
            self.database.clone(),
            slot.to_owned(),
            publication.to_owned(),
        )
        .with_port(self.port)
        .with_tls(self.tls.clone())
        .with_options("-c DateStyle=ISO -c TimeZone=UTC")
        .with_application_name(format!("outbox-relay:{slot}"))
    }
}

pub fn parse_lsn(s: &str) -> Result<Lsn> {
    Lsn::parse(s).map_err(|e| Error::setup(format!("bad LSN from server {s:?}: {e}")))
}

pub(crate) fn db_code(e: &sqlx::Error) -> Option<String> {
    match e {
        sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

/// `SHOW wal_sender_timeout` text (`60s`, `1min`, `500ms`, `0`) as a duration;
/// `None` when disabled.
pub fn parse_pg_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().ok()?;
    let d = match unit.trim() {
        "" | "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "min" => Duration::from_secs(n * 60),
        "h" => Duration::from_secs(n * 3600),
        "d" => Duration::from_secs(n * 86400),
        "us" => Duration::from_micros(n),
        _ => return None,
    };
    (!d.is_zero()).then_some(d)
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
    fn pg_durations() {
        assert_eq!(parse_pg_duration("60s"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("1min"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_pg_duration("0"), None);
    }
}
