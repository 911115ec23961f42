//! Postgres outside the replication stream: connection settings, migrations,
//! and the slot and publication the relay needs.
//!
//! The replication stream itself is `pgwire-replication`'s; this module turns
//! `DATABASE_URL` into its config and makes sure the slot and publication
//! exist (or says which statement to run when the relay may not create them).

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use percent_encoding::percent_decode_str;
use pgwire_replication::{Lsn, ReplicationConfig, SslMode, TlsConfig};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgPool, Row};

use crate::error::{Error, Result};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

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

pub async fn migrate(pool: &PgPool) -> Result<()> {
    MIGRATOR
        .run(pool)
        .await
        .map_err(|e| Error::Setup(format!("migrations failed: {e}")))
}

/// Make sure the server, table, publication and slot are ready to stream.
/// Returns the slot's confirmed position.
pub async fn prepare(
    pool: &PgPool,
    schema: &str,
    table: &str,
    publication: &str,
    slot: &str,
) -> Result<Lsn> {
    let wal_level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(pool)
        .await
        .map_err(Error::pg("SHOW wal_level"))?;
    if wal_level != "logical" {
        return Err(Error::Setup(format!(
            "wal_level is {wal_level}; the relay needs logical: run ALTER SYSTEM SET wal_level = logical; and restart Postgres"
        )));
    }
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = $2)",
    )
    .bind(schema)
    .bind(table)
    .fetch_one(pool)
    .await
    .map_err(Error::pg("looking up the outbox table"))?;
    if !exists {
        return Err(Error::Setup(format!(
            "table {schema}.{table} does not exist: run `outbox-relay migrate` (or create it) first"
        )));
    }

    let has_pub: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
            .bind(publication)
            .fetch_one(pool)
            .await
            .map_err(Error::pg("looking up the publication"))?;
    if !has_pub {
        let sql = format!(
            "CREATE PUBLICATION {publication} FOR TABLE \"{schema}\".\"{table}\" WITH (publish = 'insert')"
        );
        // The names were validated at config load (lower-case, digits, underscores).
        match sqlx::query(sqlx::AssertSqlSafe(sql.clone())).execute(pool).await {
            Ok(_) => tracing::info!(publication, "created publication"),
            // Another relay created it at the same moment.
            Err(e) if db_code(&e).as_deref() == Some("42710") => {}
            Err(e) if db_code(&e).as_deref() == Some("42501") => {
                return Err(Error::Setup(format!(
                    "publication {publication} is missing and this role may not create it; as the table owner run: {sql};"
                )))
            }
            Err(e) => return Err(Error::pg("creating the publication")(e)),
        }
    }

    let row = sqlx::query(
        "SELECT plugin, database, confirmed_flush_lsn::text AS confirmed \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(Error::pg("looking up the replication slot"))?;
    let confirmed = match row {
        Some(row) => {
            let plugin: Option<String> = row.get("plugin");
            let database: Option<String> = row.get("database");
            let this_db: String = sqlx::query_scalar("SELECT current_database()")
                .fetch_one(pool)
                .await
                .map_err(Error::pg("current_database()"))?;
            if plugin.as_deref() != Some("pgoutput")
                || database.as_deref() != Some(this_db.as_str())
            {
                return Err(Error::Setup(format!(
                    "slot {slot} exists but is not a pgoutput slot of database {this_db} (plugin {plugin:?}, database {database:?}); choose another --slot or drop it"
                )));
            }
            let confirmed: Option<String> = row.get("confirmed");
            parse_lsn(confirmed.as_deref().unwrap_or("0/0"))?
        }
        None => {
            let created = sqlx::query_scalar::<_, String>(
                "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')",
            )
            .bind(slot)
            .fetch_one(pool)
            .await;
            match created {
                Ok(lsn) => {
                    tracing::info!(slot, lsn, "created replication slot");
                    parse_lsn(&lsn)?
                }
                Err(e) if db_code(&e).as_deref() == Some("42501") => {
                    return Err(Error::Setup(format!(
                        "slot {slot} is missing and this role may not create it: grant REPLICATION (ALTER ROLE <role> REPLICATION;) or run SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput');"
                    )))
                }
                Err(e) => return Err(Error::pg("creating the replication slot")(e)),
            }
        }
    };
    Ok(confirmed)
}

pub fn parse_lsn(s: &str) -> Result<Lsn> {
    Lsn::parse(s).map_err(|e| Error::Setup(format!("bad LSN from server {s:?}: {e}")))
}

fn db_code(e: &sqlx::Error) -> Option<String> {
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

pub async fn drop_slot(pool: &PgPool, slot: &str) -> Result<bool> {
    match crate::slots::slot_status(pool, slot).await? {
        None => Ok(false),
        Some(s) if s.active => Err(Error::Setup(format!(
            "slot {slot} is in use by backend PID {}; stop the relay first",
            s.active_pid.unwrap_or_default()
        ))),
        Some(_) => {
            sqlx::query("SELECT pg_drop_replication_slot($1)")
                .bind(slot)
                .execute(pool)
                .await
                .map_err(Error::pg("pg_drop_replication_slot"))?;
            Ok(true)
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
    fn pg_durations() {
        assert_eq!(parse_pg_duration("60s"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("1min"), Some(Duration::from_secs(60)));
        assert_eq!(parse_pg_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_pg_duration("0"), None);
    }
}
