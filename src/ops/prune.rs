//! `outbox-relay prune`: retention for the outbox and the inbox (SPEC §9).
//!
//! # Why a deleted outbox row was published
//!
//! The relay confirms a slot position `L` only once JetStream has acked every
//! event of every transaction whose commit record ends at or before `L`
//! (`relay/watermark.rs`). So a row is provably published when its
//! transaction's commit record ends at or before the slot's
//! `confirmed_flush_lsn`. Prune never reads a row's commit LSN; it proves the
//! bound for a whole snapshot at once:
//!
//! 1. It opens a `REPEATABLE READ` transaction (the anchor) whose first
//!    statement takes snapshot `S` and then reads `W =
//!    pg_current_wal_insert_lsn()`. A transaction visible in `S` became
//!    visible after its commit record was inserted, and that was before `S`
//!    was taken, so its commit record ends at or before `W`.
//! 2. It waits (at most `--wait`) until the slot has confirmed `W`. If it
//!    does not (the relay is down or behind), it deletes nothing from the
//!    outbox and says so.
//! 3. Every delete batch runs in its own short transaction that imports `S`
//!    (`SET TRANSACTION SNAPSHOT`), so it sees, and deletes, only rows that
//!    were visible in `S`: published ones. A row inserted after `S`, even one
//!    with an old `occurred_at`, is invisible to the batch and stays.
//!
//! A partition of a range-partitioned outbox whose upper bound is at or
//! before the cutoff is dropped whole instead: it is locked against inserts
//! (`SHARE`), then `W'` is read and the slot must confirm it while the lock
//! is held (every row in the partition committed before `W'`); only then is
//! it detached and dropped, in the same transaction. Locks wait at most 2 s.
//!
//! Batches are small and ordered by the primary key, so each is an index
//! range from where the last one ended; they hold row locks on old rows only
//! (which producers and the relay never touch).

use std::time::{Duration, Instant};

use pgwire_replication::Lsn;
use serde::Serialize;
use sqlx::{PgPool, Row};

use crate::error::{Error, Result};
use crate::postgres::{db_code, parse_lsn};

/// What to prune.
#[derive(Debug, Clone)]
pub struct PruneConfig {
    pub schema: String,
    pub table: String,
    /// `--columns`: which columns are the id and occurred_at.
    pub columns: crate::relay::columns::ColumnMap,
    pub slot: String,
    pub older_than: Duration,
    pub inbox_older_than: Option<Duration>,
    pub dry_run: bool,
    pub batch: i64,
    /// How long to wait for the slot to confirm what the snapshot holds.
    pub wait: Duration,
}

/// What prune did and why.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub dry_run: bool,
    /// Outbox rows older than the cutoff that were (or would be) deleted.
    pub outbox_deleted: u64,
    pub partitions_dropped: Vec<String>,
    /// Why outbox rows were kept, when some old ones were.
    pub outbox_kept: Vec<String>,
    pub inbox_deleted: u64,
    pub notes: Vec<String>,
    /// The position the slot had to confirm, and what it had confirmed.
    pub needed_lsn: Option<String>,
    pub confirmed_lsn: Option<String>,
    /// Why the outbox was not pruned at all (the relay's slot is not
    /// there): the run fails once the inbox is done.
    pub refused: Option<String>,
}

/// `slot_pool` reaches the relay's slot: the same database, or the
/// standby the relay streams from.
pub async fn run(pool: &PgPool, slot_pool: Option<&PgPool>, cfg: &PruneConfig) -> Result<Report> {
    let mut report = Report {
        dry_run: cfg.dry_run,
        ..Report::default()
    };
    let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(pool)
        .await
        .map_err(Error::pg("asking whether the database is a standby"))?;
    if standby {
        return Err(Error::Config(
            "this database is a standby, which cannot delete: run prune against the primary, with --slot-database-url naming this standby (where the relay's slot is)".into(),
        ));
    }
    let slot_pool = slot_pool_of(pool, slot_pool).await?;
    // Nothing is proven without the relay's slot, and a slot of another
    // database proves nothing here: said, and a failure, not a quiet
    // "kept" every night (review A2: with the relay on a standby the slot
    // is there, and a CronJob against the primary never alerted). The
    // inbox, which needs no slot, is pruned all the same.
    if slot_exists(slot_pool, &cfg.slot).await? {
        outbox(pool, slot_pool, cfg, &mut report).await?;
    } else {
        report.refused = Some(format!(
            "slot {} does not exist in this database (a slot of another database proves nothing here), and prune deletes only outbox rows the relay's slot has confirmed: give the relay's --context or --slot, or, when the relay streams from a standby, --slot-database-url naming it; no outbox row pruned",
            cfg.slot
        ));
    }
    if let Some(age) = cfg.inbox_older_than {
        report.inbox_deleted = inbox(pool, age, cfg.batch, cfg.dry_run).await?;
        report.notes.push(format!(
            "inbox rows processed more than {} ago were {}; keep --inbox-older-than at least the events stream's max age, or a redelivery or replay of an older message reaches the handler again",
            humantime::format_duration(age),
            if cfg.dry_run { "counted (dry run)" } else { "deleted" }
        ));
    }
    Ok(report)
}

fn interval(d: Duration) -> String {
    format!("{} milliseconds", d.as_millis())
}

async fn outbox(
    pool: &PgPool,
    slot_pool: &PgPool,
    cfg: &PruneConfig,
    report: &mut Report,
) -> Result<()> {
    let table = format!("\"{}\".\"{}\"", cfg.schema, cfg.table);
    let keys = Keys::of(pool, &cfg.schema, &cfg.table, &cfg.columns).await?;
    // The anchor: snapshot S, then W.
    let mut anchor = pool
        .begin()
        .await
        .map_err(Error::pg("starting the prune snapshot"))?;
    sqlx::raw_sql(
        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY; \
         SET LOCAL idle_in_transaction_session_timeout = 0",
    )
    .execute(&mut *anchor)
    .await
    .map_err(Error::pg("starting the prune snapshot"))?;
    let row = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT pg_export_snapshot() AS snapshot, {} AS w, \
                (now() - $1::interval)::text AS cutoff, \
                (SELECT relkind = 'p' FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                  WHERE n.nspname = $2 AND c.relname = $3) AS partitioned",
        crate::postgres::WAL_NOW
    )))
    .bind(interval(cfg.older_than))
    .bind(&cfg.schema)
    .bind(&cfg.table)
    .fetch_one(&mut *anchor)
    .await
    .map_err(Error::pg("taking the prune snapshot"))?;
    let snapshot: String = row.get("snapshot");
    let w = parse_lsn(&row.get::<String, _>("w"))?;
    let cutoff: String = row.get("cutoff");
    let Some(partitioned) = row.get::<Option<bool>, _>("partitioned") else {
        return Err(Error::setup(format!(
            "table {table} does not exist: pass the relay's --table"
        )));
    };
    report.needed_lsn = Some(w.to_string());

    // Everything that reads the outbox imports the snapshot in a transaction
    // of its own: the anchor holds no lock on the table, which a partition's
    // DETACH would wait for.
    let old: i64 = {
        let mut tx = in_snapshot(pool, &snapshot).await?;
        let n = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE {} < $1::timestamptz",
            keys.occurred_at(None)
        )))
        .bind(&cutoff)
        .fetch_one(&mut *tx)
        .await
        .map_err(Error::pg("counting old outbox rows"))?;
        tx.rollback()
            .await
            .map_err(Error::pg("counting old outbox rows"))?;
        n
    };
    if old == 0 {
        report
            .outbox_kept
            .push("no outbox row is older than the cutoff".into());
    }

    match wait_confirmed(slot_pool, &cfg.slot, w, cfg.wait).await? {
        Confirmed::Reached(lsn) => report.confirmed_lsn = Some(lsn.to_string()),
        Confirmed::Behind(lsn) => {
            report.confirmed_lsn = lsn.map(|l| l.to_string());
            if old > 0 {
                report.outbox_kept.push(format!(
                    "{old} old rows kept: the relay is down or behind (slot {} confirmed {}, and every row of the snapshot needs {w}); nothing unpublished is ever deleted, so run prune again once the relay has caught up",
                    cfg.slot,
                    lsn.map_or_else(|| "nothing: it does not exist in this database (a slot of another database proves nothing here; give this database's --context or --slot)".into(), |l| l.to_string())
                ));
            }
            return Ok(());
        }
    }
    if old == 0 {
        return Ok(());
    }
    if cfg.dry_run {
        report.outbox_deleted = old as u64;
        return Ok(());
    }

    // By a json key's time, partitions are not bounded by it: rows only.
    if let (true, Some(occurred)) = (partitioned, keys.occurred_column()) {
        for part in old_partitions(pool, cfg, occurred, &cutoff).await? {
            // A busy outbox is tried again, each try from the start (the
            // partition's lock is let go between tries), until --wait.
            let deadline = Instant::now() + cfg.wait;
            loop {
                match drop_partition(pool, slot_pool, &table, &part, &cfg.slot, cfg.wait).await? {
                    Dropped::Rows(rows) => {
                        report.outbox_deleted += rows;
                        report.partitions_dropped.push(part);
                    }
                    Dropped::Kept(why) => report
                        .outbox_kept
                        .push(format!("partition {part} kept: {why}")),
                    Dropped::Busy if Instant::now() < deadline => {
                        tokio::time::sleep(DETACH_PAUSE).await;
                        continue;
                    }
                    Dropped::Busy => report.outbox_kept.push(format!(
                        "partition {part} kept: the outbox stayed busy for {} (a transaction held it; each try waited {} ms, so producers never waited longer)",
                        humantime::format_duration(cfg.wait),
                        DETACH_WAIT.as_millis()
                    )),
                }
                break;
            }
        }
    }
    report.outbox_deleted +=
        delete_batches(pool, &table, &keys, &snapshot, &cutoff, cfg.batch).await?;
    anchor
        .rollback()
        .await
        .map_err(Error::pg("ending the prune snapshot"))?;
    Ok(())
}

/// A transaction that sees exactly what the anchor's snapshot saw.
async fn in_snapshot(
    pool: &PgPool,
    snapshot: &str,
) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
    let mut tx = pool
        .begin()
        .await
        .map_err(Error::pg("starting a transaction in the prune snapshot"))?;
    // Snapshot names are server-made hex and dashes.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ; SET TRANSACTION SNAPSHOT '{snapshot}'; \
         SET LOCAL TimeZone = 'UTC'"
    )))
    .execute(&mut *tx)
    .await
    .map_err(Error::pg("importing the prune snapshot"))?;
    Ok(tx)
}

pub(crate) enum Confirmed {
    Reached(Lsn),
    Behind(Option<Lsn>),
}

/// The slot's confirmed position, if the slot decodes *this* database. LSNs
/// are cluster-wide, so a slot of another database (the same name reached
/// with another database's `--context`) confirms nothing about our rows.
/// Whether the slot is in this database (of the server `pool` reaches).
pub(crate) async fn slot_exists(pool: &PgPool, slot: &str) -> Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_replication_slots \
          WHERE slot_name = $1 AND database = current_database())",
    )
    .bind(slot)
    .fetch_one(pool)
    .await
    .map_err(Error::pg("reading the relay's slot"))
}

/// The pool that reaches the relay's slot: `other` (`--slot-database-url`)
/// when given, once it is known to be of this cluster (a standby: the same
/// system identifier, so its WAL positions are this server's), else `pool`.
/// A slot of another cluster would "confirm" positions of another WAL.
pub(crate) async fn slot_pool_of<'a>(
    pool: &'a PgPool,
    other: Option<&'a PgPool>,
) -> Result<&'a PgPool> {
    let Some(other) = other else {
        return Ok(pool);
    };
    let id = |p: &'a PgPool| async move {
        sqlx::query_scalar::<_, String>("SELECT system_identifier::text FROM pg_control_system()")
            .fetch_one(p)
            .await
    };
    let why = "reading the system identifiers (pg_control_system(), for a superuser or a member of pg_monitor) to check that --slot-database-url names a standby of this database";
    let (here, there) = (
        id(pool).await.map_err(Error::pg(why))?,
        id(other).await.map_err(Error::pg(why))?,
    );
    if here != there {
        return Err(Error::Config(format!(
            "--slot-database-url reaches another cluster (system identifier {there}, this database's {here}): it must name a standby of this primary, whose WAL positions are this one's"
        )));
    }
    Ok(other)
}

async fn slot_confirmed(pool: &PgPool, slot: &str) -> Result<Option<Lsn>> {
    let text: Option<Option<String>> = sqlx::query_scalar(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots \
         WHERE slot_name = $1 AND database = current_database()",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(Error::pg("reading the slot's confirmed position"))?;
    text.flatten().map(|t| parse_lsn(&t)).transpose()
}

pub(crate) async fn wait_confirmed(
    pool: &PgPool,
    slot: &str,
    w: Lsn,
    wait: Duration,
) -> Result<Confirmed> {
    let deadline = Instant::now() + wait;
    loop {
        let confirmed = slot_confirmed(pool, slot).await?;
        match confirmed {
            Some(c) if c >= w => return Ok(Confirmed::Reached(c)),
            _ if Instant::now() >= deadline => return Ok(Confirmed::Behind(confirmed)),
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Leaf partitions of a range-partitioned outbox whose upper bound is at or
/// before the cutoff, oldest first.
async fn old_partitions(
    pool: &PgPool,
    cfg: &PruneConfig,
    occurred_at: &str,
    cutoff: &str,
) -> Result<Vec<String>> {
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT format('%I.%I', pn.nspname, p.relname) \
         FROM pg_inherits i \
         JOIN pg_class parent ON parent.oid = i.inhparent \
         JOIN pg_namespace n ON n.oid = parent.relnamespace \
         JOIN pg_partitioned_table pt ON pt.partrelid = parent.oid \
         JOIN pg_class p ON p.oid = i.inhrelid \
         JOIN pg_namespace pn ON pn.oid = p.relnamespace, \
         LATERAL (SELECT substring(pg_get_expr(p.relpartbound, p.oid) \
                  FROM 'TO \\(''([^'']+)''\\)') AS upper) b \
         WHERE n.nspname = $1 AND parent.relname = $2 AND pt.partstrat = 'r' \
           AND pt.partnatts = 1 \
           AND (SELECT attname FROM pg_attribute WHERE attrelid = parent.oid \
                 AND attnum = pt.partattrs[0]) = $4 \
           AND p.relkind = 'r' AND b.upper IS NOT NULL \
           AND b.upper::timestamptz <= $3::timestamptz \
         ORDER BY b.upper::timestamptz",
    )
    .bind(&cfg.schema)
    .bind(&cfg.table)
    .bind(cutoff)
    .bind(occurred_at)
    .fetch_all(pool)
    .await
    .map_err(Error::pg("listing the outbox's partitions"))?;
    Ok(rows)
}

/// How long one try of a partition's DETACH waits for the outbox's lock
/// (producers' INSERTs queue behind it that long at most), and the pause
/// between tries.
const DETACH_WAIT: Duration = Duration::from_millis(50);
const DETACH_PAUSE: Duration = Duration::from_millis(200);

/// What one try at a partition came to.
enum Dropped {
    Rows(u64),
    Kept(String),
    /// The outbox was busy for the DETACH: try again.
    Busy,
}

/// Drop one old partition once every row in it is provably published.
async fn drop_partition(
    pool: &PgPool,
    slot_pool: &PgPool,
    parent: &str,
    part: &str,
    slot: &str,
    wait: Duration,
) -> Result<Dropped> {
    let mut tx = pool
        .begin()
        .await
        .map_err(Error::pg("starting a partition drop"))?;
    let locked = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET LOCAL lock_timeout = '2s'; LOCK TABLE {part} IN SHARE MODE"
    )))
    .execute(&mut *tx)
    .await;
    match locked {
        Ok(_) => {}
        Err(e) if matches!(db_code(&e).as_deref(), Some("55P03" | "40P01")) => {
            return Ok(Dropped::Kept("busy (lock not granted within 2 s)".into()))
        }
        Err(e) => return Err(Error::pg(format!("locking partition {part}"))(e)),
    }
    let (rows, w): (i64, String) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {part}), {}",
        crate::postgres::WAL_NOW
    )))
    .fetch_one(&mut *tx)
    .await
    .map_err(Error::pg(format!("reading partition {part}")))?;
    let w = parse_lsn(&w)?;
    if let Confirmed::Behind(c) = wait_confirmed(slot_pool, slot, w, wait).await? {
        return Ok(Dropped::Kept(format!(
            "the relay has not confirmed {w} (slot {slot} at {})",
            c.map_or_else(|| "nothing".into(), |l| l.to_string())
        )));
    }
    // DETACH takes ACCESS EXCLUSIVE on the parent, and every producer's
    // INSERT queues behind it while it waits (review P1: 2 s a run): so
    // it waits DETACH_WAIT at most, and a busy outbox is tried again by
    // the caller, this transaction (and its lock on the partition) gone.
    let detached = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET LOCAL lock_timeout = '{}ms'; ALTER TABLE {parent} DETACH PARTITION {part}",
        DETACH_WAIT.as_millis()
    )))
    .execute(&mut *tx)
    .await;
    match detached {
        Ok(_) => {}
        Err(e) if matches!(db_code(&e).as_deref(), Some("55P03" | "40P01")) => {
            return Ok(Dropped::Busy)
        }
        Err(e) => return Err(Error::pg(format!("detaching partition {part}"))(e)),
    }
    let dropped = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET LOCAL lock_timeout = '2s'; DROP TABLE {part}"
    )))
    .execute(&mut *tx)
    .await;
    match dropped {
        Ok(_) => {}
        Err(e) if matches!(db_code(&e).as_deref(), Some("55P03" | "40P01")) => {
            return Ok(Dropped::Kept(
                "its drop was not granted a lock within 2 s".into(),
            ))
        }
        Err(e) => return Err(Error::pg(format!("dropping partition {part}"))(e)),
    }
    tx.commit()
        .await
        .map_err(Error::pg(format!("dropping partition {part}")))?;
    tracing::info!(
        partition = part,
        rows,
        "dropped an old, published outbox partition"
    );
    Ok(Dropped::Rows(rows as u64))
}

/// Where prune and the audit read a row's id and time (SPEC §13): a column,
/// or a top-level key of a json column. A key's time is cast, so a value
/// that is not a time stops the command with Postgres's own message.
pub(crate) struct Keys {
    id: crate::relay::columns::Source,
    /// The id's type, to read a text bound back into it.
    pub id_type: &'static str,
    occurred: crate::relay::columns::Source,
    /// The aggregate id, when the table has one (the audit's repair keeps
    /// an aggregate's order with it).
    aggregate: Option<crate::relay::columns::Source>,
    /// The stream a row names (`--streams`), when the table has one.
    stream: Option<crate::relay::columns::Source>,
}

impl Keys {
    pub async fn of(
        pool: &PgPool,
        schema: &str,
        table_name: &str,
        map: &crate::relay::columns::ColumnMap,
    ) -> Result<Keys> {
        use crate::relay::columns::{Role, Source};
        use crate::relay::pgoutput::oid;
        let table = format!("{schema}.{table_name}");
        let columns = crate::postgres::provision::table_columns(pool, schema, table_name).await?;
        if columns.is_empty() {
            return Err(Error::setup(format!(
                "table {table} does not exist: pass the relay's --table"
            )));
        }
        let resolved = map.resolve(&table, &columns).map_err(Error::setup)?;
        let source = |role: Role| {
            resolved.source(role).cloned().ok_or_else(|| {
                Error::setup(format!(
                    "table {table} has no {role} role: map one with --columns {role}=SOURCE, as the relay's"
                ))
            })
        };
        let (id, occurred) = (source(Role::Id)?, source(Role::OccurredAt)?);
        let id_type = match &id {
            Source::Column(c) => match columns.iter().find(|(n, _)| n == c).map(|c| c.1) {
                Some(oid::UUID) => "uuid",
                Some(oid::INT8) => "int8",
                Some(oid::INT4) => "int4",
                Some(oid::VARCHAR) => "varchar",
                _ => "text",
            },
            Source::Key { .. } => "text",
        };
        Ok(Keys {
            id,
            id_type,
            occurred,
            aggregate: resolved.source(Role::AggregateId).cloned(),
            stream: resolved.source(Role::Stream).cloned(),
        })
    }

    /// The id in SQL, its column qualified by `alias` when given.
    pub fn id(&self, alias: Option<&str>) -> String {
        source_sql(&self.id, alias, None)
    }

    /// The time in SQL (a timestamptz), qualified by `alias` when given.
    pub fn occurred_at(&self, alias: Option<&str>) -> String {
        source_sql(&self.occurred, alias, Some("timestamptz"))
    }

    /// The aggregate id as text, qualified by `alias` when given.
    pub fn aggregate(&self, alias: Option<&str>) -> Option<String> {
        self.aggregate
            .as_ref()
            .map(|a| format!("({})::text", source_sql(a, alias, None)))
    }

    /// The stream a row names as text, qualified by `alias` when given.
    pub fn stream(&self, alias: Option<&str>) -> Option<String> {
        self.stream
            .as_ref()
            .map(|a| format!("({})::text", source_sql(a, alias, None)))
    }

    /// The time's column, when it is one: partitions are bounded by it.
    pub(crate) fn occurred_column(&self) -> Option<&str> {
        match &self.occurred {
            crate::relay::columns::Source::Column(c) => Some(c),
            crate::relay::columns::Source::Key { .. } => None,
        }
    }
}

/// An ISO 8601 / RFC 3339 date and time, as a json key holds one.
const TIME_SHAPE: &str =
    r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|z|[+-]\d{2}(:?\d{2})?)?$";

fn source_sql(
    source: &crate::relay::columns::Source,
    alias: Option<&str>,
    cast: Option<&str>,
) -> String {
    use crate::relay::columns::Source;
    let quote = postgres_protocol::escape::escape_identifier;
    let column = |c: &str| match alias {
        Some(a) => format!("{a}.{}", quote(c)),
        None => quote(c),
    };
    match source {
        Source::Column(c) => column(c),
        Source::Key { column: c, key } => {
            let text = format!("({}->>'{}')", column(c), key.replace('\'', "''"));
            match cast {
                // Only what reads as a time is cast: one malformed value
                // (a row the relay dead-lettered) must not fail the whole
                // statement. It reads as null, in no window.
                Some(ty) => format!("(CASE WHEN {text} ~ '{TIME_SHAPE}' THEN {text}::{ty} END)"),
                None => text,
            }
        }
    }
}

/// Delete the rows older than the cutoff that snapshot `snapshot` sees, a
/// batch per transaction, in id order.
async fn delete_batches(
    pool: &PgPool,
    table: &str,
    keys: &Keys,
    snapshot: &str,
    cutoff: &str,
    batch: i64,
) -> Result<u64> {
    let (id, id_type, at) = (keys.id(None), keys.id_type, keys.occurred_at(None));
    let t_at = keys.occurred_at(Some("t"));
    let mut deleted = 0u64;
    let mut after: Option<String> = None;
    loop {
        let mut tx = in_snapshot(pool, snapshot).await?;
        let (n, last): (i64, Option<String>) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "WITH victims AS ( \
                 SELECT tableoid AS vrel, ctid AS vrow, {id} AS vid FROM {table} \
                 WHERE {at} < $1::timestamptz \
                   AND ($2::text IS NULL OR {id} > $2::text::{id_type}) \
                 ORDER BY {id} LIMIT $3), \
             gone AS (DELETE FROM {table} t USING victims v \
                      WHERE t.tableoid = v.vrel AND t.ctid = v.vrow \
                        AND {t_at} < $1::timestamptz RETURNING 1) \
             SELECT (SELECT count(*) FROM gone), (SELECT vid::text FROM victims ORDER BY vid DESC LIMIT 1)"
        )))
        .bind(cutoff)
        .bind(after.as_deref())
        .bind(batch)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| match db_code(&e).as_deref() {
            Some("40001") => Error::setup(
                "an old outbox row changed while prune ran (a concurrent delete or update); what was deleted so far stays deleted: run prune again",
            ),
            _ => Error::pg("deleting a batch of old outbox rows")(e),
        })?;
        tx.commit()
            .await
            .map_err(Error::pg("committing a delete batch"))?;
        deleted += n as u64;
        match last {
            Some(id) => after = Some(id),
            None => return Ok(deleted),
        }
    }
}

/// Delete (or count) inbox rows processed before `age` ago, in batches in
/// key order. Rows not processed (waiting, parked) are never touched.
async fn inbox(pool: &PgPool, age: Duration, batch: i64, dry_run: bool) -> Result<u64> {
    if dry_run {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inbox_messages WHERE processed_at < now() - $1::interval",
        )
        .bind(interval(age))
        .fetch_one(pool)
        .await
        .map_err(Error::pg("counting old inbox rows"))?;
        return Ok(n as u64);
    }
    let mut deleted = 0u64;
    let mut after: Option<(uuid::Uuid, String)> = None;
    loop {
        let (n, last_id, last_consumer): (i64, Option<uuid::Uuid>, Option<String>) =
            sqlx::query_as(
                "WITH victims AS ( \
                     SELECT message_id, consumer FROM inbox_messages \
                     WHERE processed_at < now() - $1::interval \
                       AND ($2::uuid IS NULL OR (message_id, consumer) > ($2, $3)) \
                     ORDER BY message_id, consumer LIMIT $4), \
                 gone AS (DELETE FROM inbox_messages i USING victims v \
                          WHERE i.message_id = v.message_id AND i.consumer = v.consumer \
                            AND i.processed_at < now() - $1::interval RETURNING 1), \
                 last AS (SELECT message_id, consumer FROM victims \
                          ORDER BY message_id DESC, consumer DESC LIMIT 1) \
                 SELECT (SELECT count(*) FROM gone), (SELECT message_id FROM last), \
                        (SELECT consumer FROM last)",
            )
            .bind(interval(age))
            .bind(after.as_ref().map(|a| a.0))
            .bind(after.as_ref().map(|a| a.1.clone()).unwrap_or_default())
            .bind(batch)
            .fetch_one(pool)
            .await
            .map_err(Error::pg("deleting a batch of old inbox rows"))?;
        deleted += n as u64;
        match (last_id, last_consumer) {
            (Some(id), Some(c)) => after = Some((id, c)),
            _ => return Ok(deleted),
        }
    }
}

/// Pure: the warning when inbox rows would be pruned younger than the
/// events stream keeps messages (0 = forever).
pub fn inbox_age_warning(inbox_age: Duration, max_age: Duration, stream: &str) -> Option<String> {
    let keeps = if max_age.is_zero() {
        "forever".to_owned()
    } else {
        humantime::format_duration(max_age).to_string()
    };
    (max_age.is_zero() || inbox_age < max_age).then(|| {
        format!(
            "WARNING: --inbox-older-than {} is shorter than stream {stream} keeps messages ({keeps}): a redelivery, reset or replay of a message whose inbox row was pruned reaches the handler again",
            humantime::format_duration(inbox_age)
        )
    })
}

impl Report {
    /// The lines `prune` prints without `--json`.
    pub fn lines(&self) -> Vec<String> {
        let verb = if self.dry_run {
            "would delete"
        } else {
            "deleted"
        };
        let mut out = vec![format!("outbox: {verb} {} rows", self.outbox_deleted)];
        for p in &self.partitions_dropped {
            out.push(format!("outbox: dropped partition {p}"));
        }
        for k in &self.outbox_kept {
            out.push(format!("outbox: kept: {k}"));
        }
        if let (Some(n), Some(c)) = (&self.needed_lsn, &self.confirmed_lsn) {
            out.push(format!(
                "outbox: snapshot needed the slot at {n}; it confirmed {c}"
            ));
        }
        out.push(format!(
            "inbox: {verb} {} processed rows",
            self.inbox_deleted
        ));
        out.extend(self.notes.iter().map(|n| format!("note: {n}")));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::inbox_age_warning;
    use std::time::Duration;

    #[test]
    fn inbox_rows_younger_than_the_stream_keeps_messages_are_warned_about() {
        let day = Duration::from_secs(86_400);
        assert!(
            inbox_age_warning(30 * day, Duration::ZERO, "S").is_some_and(|w| w.contains("forever"))
        );
        assert!(inbox_age_warning(7 * day, 14 * day, "S").is_some());
        assert_eq!(inbox_age_warning(30 * day, 14 * day, "S"), None);
        assert_eq!(inbox_age_warning(14 * day, 14 * day, "S"), None);
    }
}
