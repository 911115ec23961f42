//! What the relay needs before it streams: `wal_level`, the outbox table,
//! the publication and the slot. Each is created when missing and permitted;
//! otherwise the error names the statement to run.

use pgwire_replication::Lsn;
use sqlx::{PgPool, Row};

use super::{db_code, parse_lsn};
use crate::error::{Error, Result};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

pub async fn migrate(pool: &PgPool) -> Result<()> {
    MIGRATOR.run(pool).await.map_err(|e| Error::Setup {
        message: format!("migrations failed: {e}"),
        source: Some(Box::new(e)),
    })
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
        return Err(Error::setup(format!(
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
        return Err(Error::setup(format!(
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
                return Err(Error::setup(format!(
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
                return Err(Error::setup(format!(
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
                    return Err(Error::setup(format!(
                        "slot {slot} is missing and this role may not create it: grant REPLICATION (ALTER ROLE <role> REPLICATION;) or run SELECT pg_create_logical_replication_slot('{slot}', 'pgoutput');"
                    )))
                }
                Err(e) => return Err(Error::pg("creating the replication slot")(e)),
            }
        }
    };
    Ok(confirmed)
}

pub async fn drop_slot(pool: &PgPool, slot: &str) -> Result<bool> {
    match crate::ops::slot_monitor::slot_status(pool, slot).await? {
        None => Ok(false),
        Some(s) if s.active => Err(Error::setup(format!(
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
