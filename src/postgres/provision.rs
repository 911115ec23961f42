//! What the relay needs before it streams: `wal_level`, the outbox table,
//! the publication and the slot. Each is created when missing and permitted;
//! otherwise the error names the statement to run.

use pgwire_replication::Lsn;
use sqlx::{PgPool, Row};

use super::kept::{self, Kept};
use super::{db_code, parse_lsn};
use crate::error::{Error, Result};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

pub async fn migrate(pool: &PgPool) -> Result<()> {
    MIGRATOR.run(pool).await.map_err(|e| Error::Setup {
        message: format!("migrations failed: {e}"),
        source: Some(Box::new(e)),
    })?;
    outbox_time_index(pool).await
}

/// The index the audit and prune find a window of the outbox by. Built
/// CONCURRENTLY, so producers keep writing while it builds on a large
/// table, and outside sqlx's migrations: Postgres cannot build one so on a
/// partitioned table, and a build that failed leaves an invalid index that
/// `IF NOT EXISTS` would keep for good.
async fn outbox_time_index(pool: &PgPool) -> Result<()> {
    let kind: Option<String> = sqlx::query_scalar(
        "SELECT relkind::text FROM pg_class WHERE oid = to_regclass('outbox_events')",
    )
    .fetch_optional(pool)
    .await
    .map_err(Error::pg("reading the outbox table"))?;
    match kind.as_deref() {
        Some("r") => {
            let invalid: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_index \
                  WHERE indexrelid = to_regclass('outbox_events_occurred_at') AND NOT indisvalid)",
            )
            .fetch_one(pool)
            .await
            .map_err(Error::pg("reading the outbox's indexes"))?;
            if invalid {
                sqlx::raw_sql("DROP INDEX CONCURRENTLY outbox_events_occurred_at")
                    .execute(pool)
                    .await
                    .map_err(Error::pg("dropping an index a failed build left"))?;
            }
            sqlx::raw_sql(
                "CREATE INDEX CONCURRENTLY IF NOT EXISTS outbox_events_occurred_at \
                 ON outbox_events (occurred_at)",
            )
            .execute(pool)
            .await
            .map_err(Error::pg("building outbox_events_occurred_at"))?;
        }
        // A partitioned outbox (by occurred_at, so prune can drop whole
        // partitions) is read only in the window's partitions; the index,
        // if wanted, is built per partition and attached.
        Some("p") => tracing::info!(
            "outbox_events is partitioned: no index outbox_events_occurred_at made (build one CONCURRENTLY on each partition, then attach them to an index made ON ONLY the parent)"
        ),
        _ => {}
    }
    Ok(())
}

/// What the relay streams from, once [`prepare`]d.
#[derive(Debug)]
pub struct Prepared {
    /// `None` when the slot does not exist yet: the session creates it,
    /// reading the rows before it from the slot's snapshot
    /// (`relay/backfill.rs`).
    pub slot: Option<SlotState>,
    /// The outbox's partitions (schema, name), if it is partitioned. The
    /// publication publishes through the root, so pgoutput must never name
    /// one of them; if it does, the publication changed under the relay.
    pub partitions: Vec<(String, String)>,
    /// The publication the relay keeps and streams through (`kept.rs`).
    pub kept: Kept,
}

#[derive(Debug, Clone)]
pub struct SlotState {
    pub confirmed: Lsn,
    /// The oldest WAL the slot may decode again (`None` before it has one).
    pub restart: Option<Lsn>,
    /// The backend streaming from the slot now, if any (another relay).
    pub active_pid: Option<i32>,
    /// Why Postgres invalidated it, if it did.
    pub invalidated: Option<String>,
}

/// How long a relay on a standby waits for a missing publication to be
/// replayed from the primary before it refuses.
const PUBLICATION_REPLAY_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

async fn publication_exists(pool: &PgPool, publication: &str) -> Result<bool> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)")
        .bind(publication)
        .fetch_one(pool)
        .await
        .map_err(Error::pg("looking up the publication"))
}

/// Make sure the server, table, publication and slot are ready to stream.
pub async fn prepare(
    pool: &PgPool,
    schema: &str,
    table: &str,
    publication: &str,
    slot_name: &str,
) -> Result<Prepared> {
    let slot = slot_name;
    let wal_level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(pool)
        .await
        .map_err(Error::pg("SHOW wal_level"))?;
    if wal_level != "logical" {
        return Err(Error::setup(format!(
            "wal_level is {wal_level}; the relay needs logical: run ALTER SYSTEM SET wal_level = logical; and restart Postgres"
        )));
    }
    let (version_num, version, standby, feedback): (i32, String, bool, String) = sqlx::query_as(
        "SELECT current_setting('server_version_num')::int, current_setting('server_version'), \
                pg_is_in_recovery(), current_setting('hot_standby_feedback')",
    )
    .fetch_one(pool)
    .await
    .map_err(Error::pg("reading the server's version"))?;
    if let Some(warning) = check_server(version_num, &version, standby, &feedback)? {
        tracing::warn!("{warning}");
    }
    if standby {
        let slot: String = sqlx::query_scalar("SELECT current_setting('primary_slot_name')")
            .fetch_one(pool)
            .await
            .map_err(Error::pg("reading primary_slot_name"))?;
        if slot.is_empty() {
            tracing::warn!(
                "DATABASE_URL is a standby without primary_slot_name: while it is disconnected the primary neither keeps the WAL it needs nor honours hot_standby_feedback, and may remove rows this relay's slot still has to decode (the standby then invalidates the slot); give the standby a physical slot on the primary"
            );
        }
        tracing::info!(
            "DATABASE_URL is a physical standby: a new slot is created at the primary's next running-transactions record (the background writer logs one every 15 s while the primary writes WAL; SELECT pg_log_standby_snapshot(); on the primary makes it now)"
        );
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

    let mut has_pub = publication_exists(pool, publication).await?;
    if !has_pub && standby {
        // The primary may have created it a moment ago, and this standby
        // not replayed it yet (issue 58, item 9): a bounded wait, then the
        // refusal that says where to create it.
        tracing::info!(
            publication,
            "the publication is missing on this standby: waiting up to {PUBLICATION_REPLAY_WAIT:?} for the primary's to be replayed"
        );
        let deadline = std::time::Instant::now() + PUBLICATION_REPLAY_WAIT;
        while !has_pub && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            has_pub = publication_exists(pool, publication).await?;
        }
    }
    if !has_pub {
        // Through the root, a partitioned outbox's rows carry the outbox's
        // name, whatever partition holds them (now or in the future).
        let sql = format!(
            "CREATE PUBLICATION {publication} FOR TABLE \"{schema}\".\"{table}\" WITH (publish = 'insert', publish_via_partition_root = true)"
        );
        // The names were validated at config load (lower-case, digits, underscores).
        match sqlx::query(sqlx::AssertSqlSafe(sql.clone())).execute(pool).await {
            Ok(_) => tracing::info!(publication, "created publication"),
            // Another relay created it at the same moment (the duplicate
            // name, or the unique index it waited on).
            Err(e) if matches!(db_code(&e).as_deref(), Some("42710" | "23505")) => {}
            Err(e) if db_code(&e).as_deref() == Some("42501") => {
                return Err(Error::setup(format!(
                    "publication {publication} is missing and this role may not create it; as the table owner run: {sql};"
                )))
            }
            // Read-only: a standby gets its publications from the primary.
            Err(e) if standby && db_code(&e).as_deref() == Some("25006") => {
                return Err(Error::setup(format!(
                    "publication {publication} is missing and DATABASE_URL is a standby, which cannot create it: on the primary run: {sql};"
                )))
            }
            Err(e) => return Err(Error::pg("creating the publication")(e)),
        }
    }

    let unpublished = publishes(pool, publication, schema, table).await?;
    let partitions = partitions(pool, schema, table).await?;

    let slot = match existing_slot(pool, slot).await? {
        Some(SlotState {
            invalidated: Some(reason),
            active_pid,
            ..
        }) => {
            // It can never stream again (START_REPLICATION fails on 55000 at
            // every start): the rows it had yet to decode are lost to it,
            // as to a dropped slot, so the lost-slot path decides.
            if let Some(pid) = active_pid {
                return Err(Error::SlotBusy {
                    slot: slot.to_owned(),
                    pid: Some(pid),
                });
            }
            tracing::warn!(slot, reason, "{}", invalidated_line(slot, &reason));
            drop_invalidated_slot(pool, slot).await?;
            None
        }
        found => found,
    };
    // A first start whose publication does not publish the outbox is a
    // mistake to say (SPEC §4), not an edit to ride out.
    if let (Some(fix), None) = (&unpublished, &slot) {
        return Err(Error::setup(fix.clone()));
    }
    // Another relay streams from the slot: this one waits (asking every
    // second), and neither keeps nor judges anything meanwhile (the
    // outbox out of --publication is the active relay's to ride out).
    if let Some(SlotState {
        active_pid: Some(pid),
        ..
    }) = slot
    {
        return Err(Error::SlotBusy {
            slot: slot_name.to_owned(),
            pid: Some(pid),
        });
    }
    let ensured = kept::ensure(pool, publication, slot_name, schema, table, standby).await?;
    let kept = match ensured {
        Some((name, ready)) => {
            if let Some(fix) = publishes(pool, &name, schema, table).await? {
                tracing::warn!(publication = %name, "the kept publication does not publish the outbox ({fix}): the relay streams through --publication, so an edit of it while the relay streams stops the relay. Drop it (DROP PUBLICATION {name};) and the relay makes it again; never add the table back by hand (rows written meanwhile would be missed)");
                Kept::None
            } else if kept::filters(pool, &name, schema, table).await? {
                tracing::warn!(publication = %name, "the kept publication filters the outbox's rows or columns: the relay streams through --publication; drop it, and the relay makes it again");
                Kept::None
            } else {
                kept::standing(name, ready, slot.as_ref().map(|s| s.restart))
            }
        }
        None => Kept::None,
    };
    if let Some(fix) = unpublished {
        // The outbox edited out of the operator's publication while no
        // relay ran: the kept one carried it into the slot meanwhile, and
        // carries it on. Otherwise the SPEC's refusal.
        let Some(name) = kept.streamed() else {
            return Err(Error::setup(fix));
        };
        tracing::warn!(publication, kept = name, "{fix}. The slot carries the outbox through publication {name}, which the relay keeps for this: nothing is lost");
    }
    Ok(Prepared {
        slot,
        partitions,
        kept,
    })
}

/// The slot's `catalog_xmin` as a full transaction id: every transaction
/// below it had ended before the slot's restart point, so before any commit
/// the slot still decodes. It is the horizon (SPEC §9, `Outbox-Xid-Horizon`)
/// of the events a relay publishes before its own samples begin: the WAL
/// written while no relay read. `None` for a slot without one.
pub async fn slot_horizon(pool: &PgPool, slot: &str) -> Result<Option<u64>> {
    let row: Option<(Option<String>, String)> = sqlx::query_as(
        "SELECT catalog_xmin::text, pg_snapshot_xmax(pg_current_snapshot())::text \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(Error::pg("reading the slot's transaction horizon"))?;
    Ok(row.and_then(|(xmin, next)| full_xid(xmin?.parse().ok()?, next.parse().ok()?)))
}

/// A 32-bit transaction id as the full (epoch-carrying) id it stands for,
/// given the next full id: the newest one at or below it with those low 32
/// bits. Wraparound protection keeps every live id within 2^31 of the next.
fn full_xid(short: u32, next: u64) -> Option<u64> {
    let candidate = (next & !0xffff_ffff) | u64::from(short);
    if candidate <= next {
        Some(candidate)
    } else {
        candidate.checked_sub(1 << 32)
    }
}

/// The table's columns, `(name, type oid)`, in order.
pub async fn table_columns(pool: &PgPool, schema: &str, table: &str) -> Result<Vec<(String, u32)>> {
    let columns: Vec<(String, i64)> = sqlx::query_as(
        "SELECT a.attname::text, a.atttypid::int8 FROM pg_attribute a \
         JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped \
         ORDER BY a.attnum",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(pool)
    .await
    .map_err(Error::pg("reading the outbox's columns"))?;
    Ok(columns
        .into_iter()
        .map(|(n, t)| (n, u32::try_from(t).unwrap_or_default()))
        .collect())
}

/// The table's generated columns that logical replication leaves out of
/// its rows: every one before PostgreSQL 18; from 18, the virtual ones, and
/// the stored ones unless `publication` publishes generated columns.
pub async fn unreplicated_columns(
    pool: &PgPool,
    schema: &str,
    table: &str,
    publication: &str,
) -> Result<Vec<(String, Unreplicated)>> {
    let read = || Error::pg("reading the outbox's generated columns");
    // `to_jsonb`: `prattrs` (a column list, 15+) and `pubgencols` (18+)
    // exist only on some versions; one statement reads whichever there are.
    let rows: Vec<(String, String, bool)> = sqlx::query_as(
        "WITH t AS (SELECT to_regclass(format('%I.%I', $1::text, $2::text)) AS rel), \
              listed AS (SELECT ARRAY(SELECT jsonb_array_elements_text(to_jsonb(pr) -> 'prattrs'))::int2[] AS attrs \
                         FROM pg_publication_rel pr JOIN pg_publication p ON p.oid = pr.prpubid, t \
                         WHERE p.pubname = $3 AND pr.prrelid = t.rel \
                           AND jsonb_typeof(to_jsonb(pr) -> 'prattrs') = 'array') \
         SELECT a.attname::text, a.attgenerated::text, \
                EXISTS (SELECT 1 FROM listed WHERE NOT (a.attnum = ANY (listed.attrs))) \
         FROM pg_attribute a, t \
         WHERE a.attrelid = t.rel AND a.attnum > 0 AND NOT a.attisdropped \
         ORDER BY a.attnum",
    )
    .bind(schema)
    .bind(table)
    .bind(publication)
    .fetch_all(pool)
    .await
    .map_err(read())?;
    let generated = rows.iter().any(|(_, kind, _)| !kind.is_empty());
    // `pubgencols` is new in 18; a publication not made yet is made by
    // the relay without it.
    let stored_published = generated
        && sqlx::query_scalar::<_, bool>(
            "SELECT coalesce(bool_or(coalesce(to_jsonb(p) ->> 'pubgencols', 'n') = 's'), false) \
             FROM pg_publication p WHERE pubname = $1",
        )
        .bind(publication)
        .fetch_one(pool)
        .await
        .map_err(read())?;
    Ok(rows
        .into_iter()
        .filter_map(|(name, kind, unlisted)| {
            if unlisted {
                Some((name, Unreplicated::NotListed))
            } else {
                // Stored ones reach the slot where the publication says so.
                let sent = kind.is_empty() || (stored_published && kind == "s");
                (!sent).then_some((name, Unreplicated::Generated))
            }
        })
        .collect())
}

/// Why logical replication leaves a column out of the rows it sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreplicated {
    /// A generated column (before PostgreSQL 18, or unless the
    /// publication publishes them).
    Generated,
    /// Outside the publication's column list (PostgreSQL 15+).
    NotListed,
}

/// `--unpublished`: a predicate the table takes, or one line with the
/// server's words.
pub async fn check_predicate(
    pool: &PgPool,
    schema: &str,
    table: &str,
    predicate: &str,
) -> Result<()> {
    let quote = |n: &str| format!("\"{}\"", n.replace('"', "\"\""));
    let sql = format!(
        "SELECT 1 FROM {}.{} WHERE ({predicate}) LIMIT 0",
        quote(schema),
        quote(table)
    );
    match sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await {
        Ok(_) => Ok(()),
        Err(e) if crate::postgres::db_code(&e).is_some() => Err(Error::setup(format!(
            "--unpublished {predicate:?} is not a predicate over {schema}.{table}: {}",
            e.as_database_error()
                .map_or_else(|| e.to_string(), |d| d.message().to_owned())
        ))),
        Err(e) => Err(Error::pg("checking --unpublished")(e)),
    }
}

/// How many rows [`check_keys`] looks at.
const KEY_SAMPLE: i64 = 100;

/// `--columns ROLE=COLUMN.KEY`: a key that none of the table's rows sampled
/// has is refused with one line listing the keys they do have (a misspelt
/// key would dead-letter every row). A table with no rows yet, or one the
/// relay may not read, cannot tell: nothing is refused then.
pub async fn check_keys(
    pool: &PgPool,
    schema: &str,
    table: &str,
    keys: &[(String, String, String)],
) -> Result<()> {
    let quote = |n: &str| format!("\"{}\"", n.replace('"', "\"\""));
    for (role, column, key) in keys {
        let sql = format!(
            "WITH sample AS (SELECT {c}::jsonb AS doc FROM {s}.{t} WHERE jsonb_typeof({c}::jsonb) = 'object' LIMIT {KEY_SAMPLE}) \
             SELECT count(*) FILTER (WHERE doc ? $1), count(*), \
                    (SELECT string_agg(k, ', ' ORDER BY k) FROM (SELECT DISTINCT jsonb_object_keys(doc) AS k FROM sample) ks) \
             FROM sample",
            c = quote(column),
            s = quote(schema),
            t = quote(table)
        );
        let row: std::result::Result<(i64, i64, Option<String>), sqlx::Error> =
            sqlx::query_as(sqlx::AssertSqlSafe(sql))
                .bind(key)
                .fetch_one(pool)
                .await;
        match row {
            Ok((0, n, found)) if n > 0 => {
                return Err(Error::setup(format!(
                    "--columns {role}={column}.{key}: none of {n} rows of table {schema}.{table} has key {key:?} in column {column} (their keys: {})",
                    found.unwrap_or_default()
                )))
            }
            Ok(_) => {}
            // Not readable by the relay's role: the rows will tell.
            Err(e) if crate::postgres::db_code(&e).as_deref() == Some("42501") => {}
            Err(e) => return Err(Error::pg("checking the json keys --columns names")(e)),
        }
    }
    Ok(())
}

/// The slot's state, after checking it is this database's pgoutput slot.
pub async fn existing_slot(pool: &PgPool, slot: &str) -> Result<Option<SlotState>> {
    // `to_jsonb`: the columns that say a slot was invalidated differ by
    // version (`wal_status` 13+, `conflicting` 16+, `invalidation_reason`
    // 17+), and one statement reads whichever the server has.
    let row = sqlx::query(
        "SELECT plugin, database, confirmed_flush_lsn::text AS confirmed, active_pid, \
                current_database()::text AS this_db, to_jsonb(s) AS facts \
         FROM pg_replication_slots s WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(Error::pg("looking up the replication slot"))?;
    let Some(row) = row else {
        return Ok(None);
    };
    let plugin: Option<String> = row.get("plugin");
    let database: Option<String> = row.get("database");
    let this_db: String = row.get("this_db");
    if plugin.as_deref() != Some("pgoutput") || database.as_deref() != Some(this_db.as_str()) {
        return Err(Error::setup(format!(
            "slot {slot} exists but is not a pgoutput slot of database {this_db} (plugin {plugin:?}, database {database:?}); choose another --slot or drop it"
        )));
    }
    let confirmed: Option<String> = row.get("confirmed");
    let facts: serde_json::Value = row.get("facts");
    Ok(Some(SlotState {
        confirmed: parse_lsn(confirmed.as_deref().unwrap_or("0/0"))?,
        restart: facts
            .get("restart_lsn")
            .and_then(serde_json::Value::as_str)
            .and_then(|s| Lsn::parse(s).ok()),
        active_pid: row.get("active_pid"),
        invalidated: invalidation(&facts),
    }))
}

/// Why Postgres invalidated a slot (it can never stream again), from its
/// `pg_replication_slots` row as JSON; `None` while it is usable.
pub fn invalidation(facts: &serde_json::Value) -> Option<String> {
    let text = |k: &str| facts.get(k).and_then(serde_json::Value::as_str);
    if let Some(reason) = text("invalidation_reason") {
        return Some(reason.to_owned());
    }
    // Before 17 only these say it: a standby's slot in conflict with
    // recovery (16: rows removed, or wal_level lowered on the primary), and
    // WAL removed past `max_slot_wal_keep_size`.
    if facts.get("conflicting") == Some(&serde_json::Value::Bool(true)) {
        return Some("conflict".to_owned());
    }
    (text("wal_status") == Some("lost")).then(|| "wal_removed".to_owned())
}

/// Drop the slot while it is still invalidated and unused, in one
/// statement: relays starting together (a rolling deploy) race to drop it,
/// and one that read it invalidated must not drop the slot another made
/// since. Gone already is done.
async fn drop_invalidated_slot(pool: &PgPool, slot: &str) -> Result<()> {
    let dropped = sqlx::query(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots s \
         WHERE slot_name = $1 AND active_pid IS NULL \
           AND (to_jsonb(s)->>'wal_status' = 'lost' \
                OR to_jsonb(s)->>'conflicting' = 'true' \
                OR to_jsonb(s)->>'invalidation_reason' IS NOT NULL)",
    )
    .bind(slot)
    .execute(pool)
    .await;
    match dropped {
        Ok(_) => Ok(()),
        Err(e) if db_code(&e).as_deref() == Some("42704") => Ok(()),
        Err(e) if db_code(&e).as_deref() == Some("55006") => Err(Error::SlotBusy {
            slot: slot.to_owned(),
            pid: None,
        }),
        Err(e) => Err(Error::pg("dropping the invalidated slot")(e)),
    }
}

/// What an invalidated slot means, said once as the relay drops it.
pub fn invalidated_line(slot: &str, reason: &str) -> String {
    let why = match reason {
        "wal_removed" => "the WAL it still needed was removed (max_slot_wal_keep_size)",
        "rows_removed" => "the primary removed rows it still needed to decode (hot_standby_feedback off, or no physical slot for this standby)",
        "idle_timeout" => "it was idle longer than idle_replication_slot_timeout",
        "wal_level_insufficient" => "the primary's wal_level is no longer logical",
        "conflict" => "a conflict with recovery on this standby: the primary removed rows it still needed (hot_standby_feedback off, or no physical slot), or its wal_level is no longer logical",
        _ => "Postgres gave it up",
    };
    format!(
        "slot {slot} was invalidated by Postgres ({reason}: {why}) and can never stream again: dropping it; the rows it had yet to decode are lost to it, as to a dropped slot"
    )
}

/// Make the relay's slot a persistent copy of the temporary `init` slot a
/// first start read its snapshot through: same position, so the stream goes
/// on exactly where the snapshot ends. Returns that position.
pub async fn persist_slot(pool: &PgPool, init: &str, slot: &str) -> Result<Lsn> {
    let copied = sqlx::query("SELECT pg_copy_logical_replication_slot($1, $2, false)")
        .bind(init)
        .bind(slot)
        .execute(pool)
        .await;
    match copied {
        Ok(_) => {}
        // Another relay created the slot meanwhile: it is the active one.
        Err(e) if db_code(&e).as_deref() == Some("42710") => {
            return Err(Error::SlotBusy {
                slot: slot.to_owned(),
                pid: None,
            })
        }
        Err(e) if db_code(&e).as_deref() == Some("42501") => {
            return Err(Error::setup(format!(
                "slot {slot} is missing and this role may not create it: grant REPLICATION (ALTER ROLE <role> REPLICATION;)"
            )))
        }
        Err(e) => return Err(Error::pg("creating the replication slot")(e)),
    }
    match existing_slot(pool, slot).await? {
        Some(s) => {
            tracing::info!(slot, lsn = %s.confirmed, "created replication slot");
            Ok(s.confirmed)
        }
        None => Err(Error::setup(format!(
            "slot {slot} vanished right after it was created; is another process dropping it?"
        ))),
    }
}

/// The PostgreSQL majors SPEC §15 supports, each tested.
pub const SUPPORTED: &str = "14 to 18";

/// SPEC §15, pure: PostgreSQL older than 14 is refused in one line naming
/// it and the range, a newer major than 18 warned about (`Ok(Some(_))`);
/// a standby must be one the relay can decode on (16 or newer, with
/// `hot_standby_feedback`, or the primary removes rows the slot still needs
/// and the standby invalidates it).
pub fn check_server(
    version_num: i32,
    version: &str,
    standby: bool,
    hot_standby_feedback: &str,
) -> Result<Option<String>> {
    let major = version_num / 10_000;
    if major < 14 {
        return Err(Error::Config(format!(
            "PostgreSQL {version} is older than 14, the oldest this relay supports ({SUPPORTED}): upgrade the server"
        )));
    }
    if standby && major < 16 {
        return Err(Error::Config(format!(
            "DATABASE_URL is a standby running PostgreSQL {version}: logical decoding on a standby needs 16 or newer; point DATABASE_URL at the primary, or upgrade"
        )));
    }
    if standby && hot_standby_feedback != "on" {
        return Err(Error::Config(
            "DATABASE_URL is a standby with hot_standby_feedback off: the primary would remove rows the slot still needs, and the standby would invalidate the slot; on the standby run ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf();".into(),
        ));
    }
    Ok((major > 18).then(|| {
        format!("PostgreSQL {version} is newer than the majors this relay is tested on ({SUPPORTED}); it may work")
    }))
}

/// What the server says of carrying the slot across a promotion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailoverFacts {
    pub server_version_num: i32,
    /// The slot's `failover` flag; `None` before PostgreSQL 17 (no such flag).
    pub slot_failover: Option<bool>,
    /// `synchronized_standby_slots`, on servers that have it.
    pub synchronized_standby_slots: Option<String>,
    /// The relay streams from a standby (PostgreSQL 16+): its slot is the
    /// standby's own, which the server will not make a failover slot.
    pub in_recovery: bool,
}

pub async fn failover_facts(pool: &PgPool, slot: &str) -> Result<FailoverFacts> {
    // Through to_jsonb so the same statement runs on servers without the column.
    let row = sqlx::query(
        "SELECT current_setting('server_version_num')::int AS version, \
                (SELECT (to_jsonb(s) ->> 'failover')::bool FROM pg_replication_slots s \
                  WHERE slot_name = $1) AS failover, \
                current_setting('synchronized_standby_slots', true) AS standby_slots, \
                pg_is_in_recovery() AS in_recovery",
    )
    .bind(slot)
    .fetch_one(pool)
    .await
    .map_err(Error::pg("looking up the slot's failover setting"))?;
    Ok(FailoverFacts {
        server_version_num: row.get("version"),
        slot_failover: row.get("failover"),
        synchronized_standby_slots: row.get("standby_slots"),
        in_recovery: row.get("in_recovery"),
    })
}

/// What to do about the slot's failover flag.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FailoverPlan {
    /// `ALTER_REPLICATION_SLOT … (FAILOVER v)` to run before streaming.
    pub alter: Option<bool>,
    pub warning: Option<String>,
    pub note: Option<String>,
}

/// Pure: from `--failover-slot` and what the server says.
pub fn failover_plan(wanted: bool, slot: &str, facts: &FailoverFacts) -> FailoverPlan {
    if facts.in_recovery {
        return FailoverPlan {
            note: wanted.then(|| format!(
                "slot {slot} is this standby's own, which cannot be a failover slot: it stays on this server, and goes on when the standby is promoted"
            )),
            ..FailoverPlan::default()
        };
    }
    if facts.server_version_num < 170_000 {
        return FailoverPlan {
            note: wanted.then(|| format!(
                "PostgreSQL {} has no failover slots: a promoted standby will not have slot {slot}; the relay then refuses to start and names the --resync-since to use",
                facts.server_version_num / 10_000
            )),
            ..FailoverPlan::default()
        };
    }
    let alter = match facts.slot_failover {
        Some(is) if is != wanted => Some(wanted),
        _ => None,
    };
    let unguarded = facts
        .synchronized_standby_slots
        .as_deref()
        .is_none_or(|s| s.trim().is_empty());
    FailoverPlan {
        alter,
        warning: (wanted && unguarded).then(|| format!(
            "slot {slot} is a failover slot but synchronized_standby_slots is empty: the relay may publish events a standby has not received, and a promotion would lose them from the table but not from the stream; set synchronized_standby_slots to the standby's physical slot"
        )),
        note: None,
    }
}

/// What `pg_publication` says of the publication and the outbox table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PublicationFacts {
    inserts: bool,
    via_root: bool,
    partitioned: bool,
    /// The table, or any of its partitions, is in the publication.
    includes_table: bool,
}

async fn publication_facts(
    pool: &PgPool,
    publication: &str,
    schema: &str,
    table: &str,
) -> Result<PublicationFacts> {
    let row = sqlx::query(
        "SELECT p.pubinsert, p.pubviaroot, c.relkind = 'p' AS partitioned, \
                EXISTS (SELECT 1 FROM (SELECT c.oid AS relid UNION SELECT relid FROM pg_partition_tree(c.oid)) pt \
                        JOIN pg_class pc ON pc.oid = pt.relid \
                        JOIN pg_namespace pn ON pn.oid = pc.relnamespace \
                        JOIN pg_publication_tables t \
                          ON t.pubname = p.pubname AND t.schemaname = pn.nspname AND t.tablename = pc.relname) \
                  AS includes_table \
         FROM pg_publication p, pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE p.pubname = $1 AND n.nspname = $2 AND c.relname = $3",
    )
    .bind(publication)
    .bind(schema)
    .bind(table)
    .fetch_one(pool)
    .await
    .map_err(Error::pg("reading the publication"))?;
    Ok(PublicationFacts {
        inserts: row.get("pubinsert"),
        via_root: row.get("pubviaroot"),
        partitioned: row.get("partitioned"),
        includes_table: row.get("includes_table"),
    })
}

/// A check, while the relay streams, that the slot still carries the
/// outbox's inserts: the table under its name (its oid), and what makes it
/// a member of the publication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StillPublished {
    pub oid: i64,
    /// The publication's oid and its membership row for the table
    /// (`pg_publication_rel`; none for `FOR ALL TABLES`): the table dropped
    /// from it and added again, or the publication made again, changes it.
    /// Partitions' rows are left out: retention detaches and drops them.
    pub membership: String,
    /// A minute before the check, or before the oldest transaction then
    /// open (its rows' `occurred_at` may be its start), UTC (RFC 3339): an
    /// audit window from a good check's covers any change after it.
    pub since: String,
}

/// Whether the publication still publishes the inserts of `schema.table`:
/// `Ok(Err(why))`, in a line saying what to run, when it does not (the
/// table dropped from it, renamed, or gone).
pub async fn still_published(
    pool: &PgPool,
    publication: &str,
    schema: &str,
    table: &str,
) -> Result<std::result::Result<StillPublished, String>> {
    // One statement a check, with the window's start.
    let found: Option<(Option<i64>, Option<i64>, String, String)> = sqlx::query_as(
        "WITH t AS (SELECT to_regclass(format('%I.%I', $2::text, $3::text)) AS rel) \
         SELECT t.rel::oid::int8, p.oid::int8, \
                coalesce((SELECT string_agg(pr.oid::text, ',' ORDER BY pr.oid) FROM pg_publication_rel pr \
                          WHERE pr.prpubid = p.oid AND pr.prrelid = t.rel::oid), ''), \
                to_char((LEAST(now(), (SELECT min(xact_start) FROM pg_stat_activity \
                         WHERE datname = current_database())) - interval '1 minute') AT TIME ZONE 'UTC', \
                        'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
         FROM t LEFT JOIN pg_publication p ON p.pubname = $1",
    )
    .bind(publication)
    .bind(schema)
    .bind(table)
    .fetch_optional(pool)
    .await
    .map_err(Error::pg("reading the outbox's publication"))?;
    let (oid, publication_oid, rels, since) = match found {
        Some((Some(oid), Some(p), rels, since)) => (oid, p, rels, since),
        Some((None, ..)) | None => {
            return Ok(Err(format!(
                "table {schema}.{table} is gone (renamed, or dropped?)"
            )))
        }
        Some((Some(_), None, ..)) => return Ok(Err(format!("publication {publication} is gone"))),
    };
    let facts = match publication_facts(pool, publication, schema, table).await {
        Ok(f) => f,
        // Gone between the two statements.
        Err(Error::Postgres {
            source: sqlx::Error::RowNotFound,
            ..
        }) => {
            return Ok(Err(format!(
                "table {schema}.{table} or publication {publication} is gone"
            )))
        }
        Err(e) => return Err(e),
    };
    Ok(match publication_fix(publication, schema, table, &facts) {
        Some(fix) => Err(fix),
        None => Ok(StillPublished {
            oid,
            membership: format!("{publication_oid}:{rels}"),
            since,
        }),
    })
}

/// What makes `publication` publish the outbox's inserts under the
/// outbox's own name (a line with the statement to run), or `None` when it
/// already does.
pub async fn publishes(
    pool: &PgPool,
    publication: &str,
    schema: &str,
    table: &str,
) -> Result<Option<String>> {
    let facts = publication_facts(pool, publication, schema, table).await?;
    Ok(publication_fix(publication, schema, table, &facts))
}

/// The statement that makes the publication publish the outbox's inserts
/// under the outbox's own name, or `None` when it already does.
fn publication_fix(
    publication: &str,
    schema: &str,
    table: &str,
    f: &PublicationFacts,
) -> Option<String> {
    let why = format!("publication {publication} does not publish the inserts of {schema}.{table}");
    if !f.includes_table {
        return Some(format!(
            "{why} (another table's?): run ALTER PUBLICATION {publication} ADD TABLE \"{schema}\".\"{table}\"; or choose another --publication"
        ));
    }
    if !f.inserts {
        return Some(format!(
            "{why}: run ALTER PUBLICATION {publication} SET (publish = 'insert');"
        ));
    }
    if f.partitioned && !f.via_root {
        return Some(format!(
            "{why} under its own name (it is partitioned, and rows would carry their partition's name): run ALTER PUBLICATION {publication} SET (publish_via_partition_root = true);"
        ));
    }
    None
}

/// The outbox's partitions at every level, without the outbox itself.
async fn partitions(pool: &PgPool, schema: &str, table: &str) -> Result<Vec<(String, String)>> {
    sqlx::query_as(
        "SELECT pn.nspname::text, pc.relname::text \
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace, \
              pg_partition_tree(c.oid) pt \
              JOIN pg_class pc ON pc.oid = pt.relid \
              JOIN pg_namespace pn ON pn.oid = pc.relnamespace \
         WHERE n.nspname = $1 AND c.relname = $2 AND pt.relid <> c.oid",
    )
    .bind(schema)
    .bind(table)
    .fetch_all(pool)
    .await
    .map_err(Error::pg("listing the outbox's partitions"))
}

#[cfg(test)]
mod version_tests {
    use super::check_server;

    #[test]
    fn versions_outside_14_to_18_and_standbys_that_cannot_decode_are_refused() {
        for (num, v) in [(140_000, "14.0"), (150_018, "15.18"), (180_004, "18.4")] {
            assert_eq!(check_server(num, v, false, "off").unwrap(), None, "{v}");
        }
        let e = check_server(130_023, "13.23", false, "on")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("PostgreSQL 13.23") && e.contains("14 to 18"),
            "{e}"
        );
        assert!(check_server(190_000, "19devel", false, "on")
            .unwrap()
            .unwrap()
            .contains("newer"));
        let e = check_server(150_018, "15.18", true, "on")
            .unwrap_err()
            .to_string();
        assert!(e.contains("PostgreSQL 15.18") && e.contains("16"), "{e}");
        let e = check_server(160_014, "16.14", true, "off")
            .unwrap_err()
            .to_string();
        assert!(e.contains("hot_standby_feedback = on"), "{e}");
        assert_eq!(check_server(160_014, "16.14", true, "on").unwrap(), None);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_slot_is_invalidated_by_whichever_column_the_version_has() {
        let of = |v: serde_json::Value| invalidation(&v);
        assert_eq!(of(serde_json::json!({"wal_status": "reserved"})), None);
        assert_eq!(
            of(serde_json::json!({"wal_status": "lost"})).as_deref(),
            Some("wal_removed")
        );
        assert_eq!(
            of(serde_json::json!({"wal_status": "reserved", "conflicting": true})).as_deref(),
            Some("conflict")
        );
        assert_eq!(
            of(
                serde_json::json!({"wal_status": "reserved", "conflicting": false, "invalidation_reason": null})
            ),
            None
        );
        assert_eq!(
            of(serde_json::json!({"wal_status": "lost", "invalidation_reason": "idle_timeout"}))
                .as_deref(),
            Some("idle_timeout")
        );
        assert!(invalidated_line("s", "idle_timeout").contains("idle_replication_slot_timeout"));
    }

    #[test]
    fn a_short_xid_takes_the_epoch_of_the_next_id_or_the_one_before() {
        assert_eq!(full_xid(700, 900), Some(700));
        assert_eq!(full_xid(900, 900), Some(900));
        let next = (3 << 32) | 5;
        assert_eq!(full_xid(4, next), Some((3 << 32) | 4));
        // Below the wrap: the previous epoch.
        assert_eq!(full_xid(0xffff_fff0, next), Some((2 << 32) | 0xffff_fff0));
        // Epoch 0 has no previous one.
        assert_eq!(full_xid(10, 5), None);
    }

    use super::*;

    fn facts(version: i32, failover: Option<bool>, standby: Option<&str>) -> FailoverFacts {
        FailoverFacts {
            server_version_num: version,
            slot_failover: failover,
            synchronized_standby_slots: standby.map(str::to_owned),
            in_recovery: false,
        }
    }

    #[test]
    fn a_standbys_own_slot_is_never_made_a_failover_slot() {
        let on_standby = FailoverFacts {
            in_recovery: true,
            ..facts(170_010, Some(false), Some(""))
        };
        let plan = failover_plan(true, "s", &on_standby);
        assert_eq!((plan.alter, plan.warning), (None, None));
        assert!(plan.note.unwrap_or_default().contains("standby's own"));
    }

    #[test]
    fn failover_slots_only_where_the_server_has_them() {
        let old = failover_plan(true, "s", &facts(150_018, None, None));
        assert_eq!(old.alter, None);
        assert!(old
            .note
            .as_deref()
            .unwrap_or("")
            .contains("PostgreSQL 15 has no failover slots"));
        assert_eq!(
            failover_plan(false, "s", &facts(160_004, None, None)),
            FailoverPlan::default()
        );

        let new = failover_plan(true, "s", &facts(170_010, Some(false), Some("standby1")));
        assert_eq!((new.alter, new.warning, new.note), (Some(true), None, None));
        let set = failover_plan(true, "s", &facts(170_010, Some(true), Some("standby1")));
        assert_eq!(set, FailoverPlan::default());
        let off = failover_plan(false, "s", &facts(170_010, Some(true), Some("")));
        assert_eq!((off.alter, off.warning), (Some(false), None));
    }

    #[test]
    fn a_failover_slot_no_standby_guards_is_warned_about() {
        for standby in [None, Some(""), Some("  ")] {
            let plan = failover_plan(true, "s", &facts(170_010, Some(true), standby));
            assert!(plan
                .warning
                .as_deref()
                .unwrap_or("")
                .contains("synchronized_standby_slots"));
        }
    }

    const GOOD: PublicationFacts = PublicationFacts {
        inserts: true,
        via_root: false,
        partitioned: false,
        includes_table: true,
    };

    #[test]
    fn a_publication_must_publish_the_outbox_inserts_under_its_name() {
        let fix = |f: PublicationFacts| publication_fix("pub", "public", "outbox_events", &f);
        assert_eq!(fix(GOOD), None, "a plain table needs no root");
        let parted = PublicationFacts {
            partitioned: true,
            via_root: true,
            ..GOOD
        };
        assert_eq!(fix(parted), None);
        let other = fix(PublicationFacts {
            includes_table: false,
            ..GOOD
        });
        assert!(other
            .unwrap()
            .contains("ALTER PUBLICATION pub ADD TABLE \"public\".\"outbox_events\""));
        let no_inserts = fix(PublicationFacts {
            inserts: false,
            ..GOOD
        });
        assert!(no_inserts.unwrap().contains("SET (publish = 'insert')"));
        let leaves = fix(PublicationFacts {
            via_root: false,
            ..parted
        });
        assert!(leaves
            .unwrap()
            .contains("SET (publish_via_partition_root = true)"));
    }
}
