//! First start (SPEC §9): the relay creates its slot, and the rows already
//! in the outbox are published before anything the slot streams.
//!
//! Exactly once across the switch from table to stream comes from one
//! snapshot. A temporary slot `{slot}_init` is created on a replication
//! session of its own with `SNAPSHOT 'export'`: the rows visible in that
//! snapshot are exactly the transactions committed before the slot's
//! consistent point, and the slot streams exactly those committed after.
//! The rows are read in that snapshot (`occurred_at, id` order, a cursor, so
//! memory stays bounded for millions of rows) and published through the
//! session's ordered publisher; once every one is acked, the temporary slot
//! is copied into the relay's persistent slot, at the same position, and
//! streaming starts there.
//!
//! A crash before the copy leaves no slot (a temporary slot dies with its
//! session), so the next start backfills again; the backfilled messages it
//! finds in the stream (`Outbox-Backfill`) say it is finishing an
//! interrupted backfill, not recovering a lost slot, and which rows that
//! backfill was publishing. What the interrupted runs stored is read back
//! ([`publish::backfill_resume`]) and not published again: the stream's
//! duplicate window is long gone after a backfill of hours.
//!
//! Two relays starting at once: the temporary slot admits one at a time, and
//! one admitted after the other finished finds the slot made and stands by.
//!
//! Without a slot but with streamed events of this database in the stream,
//! the slot was lost: the relay refuses to start from "now" and names
//! `--resync-since`, which backfills `occurred_at >= T` the same way.

use std::borrow::Cow;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pgwire_replication::{Lsn, ReplicationClient};
use sqlx::Row;

use super::columns::{Resolved, Role, Source};
use super::config::{Backfill, RelayConfig};
use super::decode::log_dead_letter;
use super::env::Env;
use super::outbox_row::OutboxLayout;
use super::pgoutput::{Column, Relation, Value};
use super::publish::{self, Publisher, TailEvent};
use super::route::{OutMessage, Router};
use crate::error::{Error, Result};
use crate::metrics as m;
use crate::postgres::{parse_lsn, provision};
use crate::wire::{self, Position};

/// Rows per FETCH: small, so a table of multi-MB rows stays within memory.
const BATCH_ROWS: i64 = 64;

/// How often progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Create the relay's slot, publishing first what its snapshot holds.
/// Returns the slot's position, where streaming starts.
pub(super) async fn first_start(
    env: &Env<'_>,
    publisher: &mut Publisher,
    router: impl Fn(&str) -> Router,
    max_payload: usize,
) -> Result<Lsn> {
    let Env {
        cfg,
        dsn,
        pool,
        js,
        ready,
        ..
    } = *env;
    let init = wire::init_slot_name(&cfg.slot);
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(pool)
        .await
        .map_err(Error::pg("reading the server's version"))?;
    let mut session =
        ReplicationClient::connect_gated(dsn.replication_config(&init, cfg.publication.as_str()))
            .await?;
    let system = session.identify_system().await?;
    // The temporary slot first, exporting its snapshot whether or not the
    // plan then uses it: the plan is read after it.
    let created = session
        .simple_query(&create_init_slot(&init, version))
        .await
        .map_err(Error::from)
        .map_err(|e| match e.sqlstate().as_deref() {
            // Another relay is in its own first start.
            Some("42710") => Error::SlotBusy {
                slot: init.clone(),
                pid: None,
            },
            // A standby whose primary does not log what decoding needs.
            Some("55000") if e.to_string().contains("on the primary") => Error::setup(
                "the primary's wal_level is not logical, so this standby cannot decode its WAL: on the primary run ALTER SYSTEM SET wal_level = logical; and restart it",
            ),
            _ => e,
        })?;
    // Another relay may have finished its first start since this one found
    // no slot: its temporary slot, which kept this one out, is dropped only
    // once the slot exists. Then the slot, and the stream's tail, are its.
    if provision::existing_slot(pool, &cfg.slot).await?.is_some() {
        return Err(Error::SlotBusy {
            slot: cfg.slot.clone(),
            pid: None,
        });
    }
    // Every stream rows may be routed to (SPEC §13) holds part of what
    // was published.
    let mut streams: Vec<&str> = vec![&cfg.stream];
    for s in &cfg.streams {
        if !streams.contains(&s.as_str()) {
            streams.push(s);
        }
    }
    let mut lasts: Vec<TailEvent> = Vec::new();
    for stream in &streams {
        lasts.extend(
            publish::last_event_of_database(js, stream, &system.system_id, &dsn.database).await?,
        );
    }
    let tail = decisive(lasts);
    let filter = plan(
        &cfg.backfill,
        cfg.resync_since.as_ref(),
        tail.as_ref(),
        &cfg.slot,
        &cfg.stream,
    )?;
    let export = filter.rows != Backfill::None || filter.xid_from.is_some();
    // An interrupted backfill resumes from what its runs stored.
    let resume = match &tail {
        Some(TailEvent {
            backfill: Some(header),
            backfill_end: false,
            ..
        }) if export => {
            let ids = outbox_id_kind(pool, cfg).await?;
            let mut reads = Vec::new();
            for stream in &streams {
                reads.push(
                    publish::backfill_resume(
                        js,
                        stream,
                        (&system.system_id, &dsn.database),
                        header,
                        cfg.max_inflight,
                        ids,
                    )
                    .await?,
                );
            }
            let mut resume = publish::BackfillResume::of(reads);
            // What earlier runs proved holds for their own rows only: under
            // another filter (a wider --unpublished or --resync-since) rows
            // before those bounds may never have been published.
            if *header != header_value(&filter, cfg.unpublished.as_deref()) {
                resume.covered.clear();
            }
            tracing::info!(
                stored = resume.stored.len(),
                covered = %publish::Covered::header(&resume.covered),
                "resuming an interrupted backfill: the rows the stream holds are not published again"
            );
            resume
        }
        _ => publish::BackfillResume::default(),
    };
    // slot_name, consistent_point, snapshot_name, output_plugin
    let field = |i: usize| {
        created
            .first()
            .and_then(|row| row.get(i).cloned().flatten())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
    };
    let consistent = parse_lsn(&field(1).unwrap_or_default())?;
    if export {
        let snapshot = field(2).ok_or_else(|| {
            Error::setup(format!(
                "CREATE_REPLICATION_SLOT {init} exported no snapshot"
            ))
        })?;
        ready.not_ready(format!(
            "not streaming yet: backfilling {} rows from the new slot's snapshot",
            describe(&filter, cfg.unpublished.as_deref())
        ));
        let source = wire::source_id(&system.system_id, system.timeline, &dsn.database, &cfg.slot);
        let started = Instant::now();
        let rows = publish_snapshot(
            env,
            &snapshot,
            &filter,
            &resume,
            &router(&source),
            publisher,
            max_payload,
        )
        .await?;
        let secs = started.elapsed().as_secs_f64();
        tracing::info!(
            rows,
            seconds = format!("{secs:.2}"),
            rows_per_second = (rows as f64 / secs.max(1e-9)) as u64,
            filter = describe(&filter, cfg.unpublished.as_deref()),
            "backfill done"
        );
    }
    let lsn = provision::persist_slot(pool, &init, &cfg.slot).await?;
    tracing::debug!(%consistent, slot_at = %lsn, "snapshot consistent point and the new slot's position");
    // Ends the session; its temporary slot goes with it.
    drop(session);
    Ok(lsn)
}

/// Of the streams' newest events of this database, what decides the plan.
/// Streaming begins only once a first start's backfill is done, so one
/// streamed event anywhere means the slot existed: a backfill event then
/// is an old one, not an interrupted run. The resync then starts from the
/// oldest transaction horizon of them all: events in flight to one stream
/// may have been lost while another acked later ones (repeats, never a
/// loss). With backfill events only, the newest run decides: interrupted,
/// or finished if its last message, in any stream, says so.
fn decisive(lasts: Vec<TailEvent>) -> Option<TailEvent> {
    // No horizon (an older relay wrote it) orders first.
    let oldest = lasts.iter().map(|e| e.xid_horizon).min()?;
    if lasts.iter().any(|e| e.backfill.is_none()) {
        let mut streamed = lasts
            .into_iter()
            .filter(|e| e.backfill.is_none())
            .min_by_key(|e| e.xid_horizon)?;
        streamed.xid_horizon = oldest;
        Some(streamed)
    } else {
        let newest = lasts.iter().map(|e| e.xid_horizon).max()?;
        let ended = lasts
            .iter()
            .any(|e| e.xid_horizon == newest && e.backfill_end);
        let mut last = lasts.into_iter().find(|e| e.xid_horizon == newest)?;
        last.backfill_end = ended;
        Some(last)
    }
}

/// Which rows a new slot's snapshot publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Filter {
    pub rows: Backfill,
    /// Also every row of a transaction whose id (xid8) is at or past this:
    /// after a lost slot, the transactions that may have committed after
    /// the last event the stream holds, whatever their `occurred_at`.
    pub xid_from: Option<u64>,
}

impl From<Backfill> for Filter {
    fn from(rows: Backfill) -> Self {
        Filter {
            rows,
            xid_from: None,
        }
    }
}

/// Which rows a new slot backfills, from the settings and the newest event
/// of this database the stream holds. Pure.
pub(super) fn plan(
    configured: &Backfill,
    resync: Option<&Backfill>,
    tail: Option<&TailEvent>,
    slot: &str,
    stream: &str,
) -> Result<Filter> {
    match tail {
        None => Ok(resync.unwrap_or(configured).clone().into()),
        // An interrupted backfill: finish it, with its own filter unless
        // told; the transactions a resync covered stay covered. (A finished
        // one means the slot was made, then lost: below.)
        Some(TailEvent {
            backfill: Some(header),
            backfill_end: false,
            ..
        }) => {
            let interrupted = parse_header(header).unwrap_or(Backfill::Unpublished.into());
            Ok(match resync {
                Some(r) => Filter {
                    rows: r.clone(),
                    xid_from: interrupted.xid_from,
                },
                None => interrupted,
            })
        }
        Some(last) => match resync {
            Some(r) => {
                if last.xid_horizon.is_none() {
                    tracing::warn!(
                        last = %last.id,
                        "the stream's last event of this database carries no {} (an older relay wrote it): this resync republishes occurred_at >= the given time only, and misses a row of a transaction that began before that time and committed after that event",
                        wire::XID_HORIZON
                    );
                }
                tracing::warn!(
                    last = %last.id,
                    "resyncing after a lost slot republishes outbox table rows only: events written with outbox_emit() since the stream's last event lived in the WAL only and cannot be recovered"
                );
                Ok(Filter {
                    rows: r.clone(),
                    xid_from: last.xid_horizon,
                })
            }
            None => {
                let at = last.occurred_at.as_deref().unwrap_or("unknown");
                let covers = if last.xid_horizon.is_some() {
                    "every row that occurred from then on, and every row of a transaction that was still open when that event committed"
                } else {
                    "every row that occurred from then on; that event carries no transaction horizon (an older relay wrote it), so a row of a transaction that began earlier and committed after it is not covered: give a time before the oldest transaction open then"
                };
                let lost = if last.backfill_end {
                    "a backfill finished with that event, and its slot was lost since (or the relay stopped, or could not make the slot persistent, right after it)"
                } else {
                    "the slot was dropped, invalidated or lost in a failover"
                };
                Err(Error::setup(format!(
                    "slot {slot} does not exist, but stream {stream} already holds events of this database (the last: {}, occurred at {at}, commit LSN {}): {lost}, and what was written since is not in the WAL any more. Restart with --resync-since {at} to republish {covers} (consumers' inboxes drop the repeats). Events written with outbox_emit() since that event lived in the WAL only: they cannot be recovered, by --resync-since or otherwise",
                    last.id,
                    last.commit_lsn.as_deref().unwrap_or("unknown"),
                )))
            }
        },
    }
}

/// The `Outbox-Backfill` of a run with this filter; `unpublished`: the
/// `--unpublished` predicate, known by a digest (a resumed run trusts the
/// bounds of one with the same filter only).
fn header_value(filter: &Filter, unpublished: Option<&str>) -> String {
    let rows = match (&filter.rows, unpublished) {
        (Backfill::Since(t), _) => format!("{}{t}", wire::BACKFILL_SINCE),
        (_, Some(p)) => {
            use sha2::{Digest, Sha256};
            let digest = Sha256::digest(p.as_bytes());
            let hex: String = digest[..4].iter().map(|b| format!("{b:02x}")).collect();
            format!("{}{WHERE}{hex}", wire::BACKFILL_UNPUBLISHED)
        }
        _ => wire::BACKFILL_UNPUBLISHED.to_owned(),
    };
    match filter.xid_from {
        Some(x) => format!("{rows}{}{x}", wire::BACKFILL_XID),
        None => rows,
    }
}

/// In `Outbox-Backfill`: `unpublished where <digest of --unpublished>`.
const WHERE: &str = " where ";

fn parse_header(value: &str) -> Option<Filter> {
    let (rows, xid_from) = match value.split_once(wire::BACKFILL_XID) {
        Some((rows, x)) => (rows, Some(x.parse().ok()?)),
        None => (value, None),
    };
    let unpublished = rows == wire::BACKFILL_UNPUBLISHED
        || rows
            .strip_prefix(wire::BACKFILL_UNPUBLISHED)
            .is_some_and(|r| r.starts_with(WHERE));
    let rows = if unpublished {
        Backfill::Unpublished
    } else {
        let t = rows.strip_prefix(wire::BACKFILL_SINCE)?;
        rfc3339(t).ok()?;
        Backfill::Since(t.to_owned())
    };
    Some(Filter { rows, xid_from })
}

fn describe(filter: &Filter, unpublished: Option<&str>) -> String {
    let rows = match &filter.rows {
        Backfill::None => "no".into(),
        Backfill::Unpublished => format!(
            "unpublished ({})",
            unpublished.unwrap_or("published_at IS NULL")
        ),
        Backfill::Since(t) => format!("occurred_at >= {t}"),
    };
    match filter.xid_from {
        Some(x) => format!("{rows}, and of transactions from {x} on,"),
        None => rows,
    }
}

fn rfc3339(t: &str) -> Result<time::OffsetDateTime> {
    time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
        .map_err(|e| Error::Config(format!("backfill time {t:?}: {e}")))
}

/// Read the rows in the exported snapshot and publish each, in
/// `occurred_at, id` order; returns once every one is acked.
async fn publish_snapshot(
    env: &Env<'_>,
    snapshot: &str,
    filter: &Filter,
    resume: &publish::BackfillResume,
    router: &Router,
    publisher: &mut Publisher,
    max_payload: usize,
) -> Result<u64> {
    let cfg = env.cfg;
    // Snapshot names are hex digits and dashes; anything else is not one.
    if snapshot.is_empty() || !snapshot.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') {
        return Err(Error::setup(format!(
            "unexpected snapshot name {snapshot:?}"
        )));
    }
    let mut tx = env
        .pool
        .begin()
        .await
        .map_err(Error::pg("starting the backfill transaction"))?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY; \
         SET TRANSACTION SNAPSHOT '{snapshot}'; {}",
        crate::postgres::set_local_tuple_text()
    )))
    .execute(&mut *tx)
    .await
    .map_err(Error::pg("importing the slot's snapshot"))?;

    // The table as pgoutput would describe it: every value read as text, so
    // the stream's row decoding serves the backfill too.
    let typed = outbox_columns(&mut *tx, cfg).await?;
    let columns = &typed;
    let relation = text_relation(&cfg.schema, &cfg.table, &typed);
    let layout = OutboxLayout::new(&relation, &cfg.columns, router.columns());
    let has = |name: &str| columns.iter().any(|(n, _)| n == name);
    // The roles the order and the filters read (SPEC §13).
    let table = format!("{}.{}", cfg.schema, cfg.table);
    let resolved = cfg.columns.resolve(&table, &typed).map_err(Error::setup)?;
    let id_sql = resolved
        .source(Role::Id)
        .map(source_sql)
        .ok_or_else(|| Error::setup(format!("table {table} has no id role")))?;
    let occurred_sql = resolved.source(Role::OccurredAt).map(source_sql);
    // The snapshot's own horizon: every transaction below its xmin had
    // ended before it, so is in it or not at all. Its xmax gives the epoch
    // a row's 32-bit xmin belongs to.
    let (snap_xmin, snap_xmax): (String, String) = sqlx::query_as(
        "SELECT pg_snapshot_xmin(pg_current_snapshot())::text, pg_snapshot_xmax(pg_current_snapshot())::text",
    )
    .fetch_one(&mut *tx)
    .await
    .map_err(Error::pg("reading the snapshot's transaction horizon"))?;
    let snap_xmin: Option<u64> = snap_xmin.parse().ok();
    let snap_xmax: u64 = snap_xmax
        .parse()
        .map_err(|_| Error::setup(format!("unexpected snapshot xmax {snap_xmax:?}")))?;
    let rows = match &filter.rows {
        Backfill::Since(t) => {
            // Re-rendered from the parsed time: only a valid timestamp reaches SQL.
            let at = rfc3339(t)?
                .format(&time::format_description::well_known::Rfc3339)
                .map_err(|e| Error::Config(format!("backfill time {t:?}: {e}")))?;
            let occurred = match resolved.source(Role::OccurredAt) {
                Some(Source::Column(c)) => quote(c),
                _ => {
                    return Err(Error::setup(format!(
                        "--resync-since needs a column (not a json key) for role occurred_at, and table {table} has none (map one with --columns occurred_at=COLUMN)"
                    )))
                }
            };
            Some(format!("{occurred} >= '{at}'::timestamptz"))
        }
        Backfill::Unpublished if cfg.unpublished.is_some() => {
            cfg.unpublished.as_ref().map(|p| format!("({p})"))
        }
        Backfill::Unpublished if has("published_at") => Some("published_at IS NULL".into()),
        Backfill::Unpublished => Some("true".into()),
        Backfill::None => None,
    };
    let xids = filter
        .xid_from
        .map(|from| format!("{} >= {from}", full_xid("xmin", snap_xmax)));
    let mut condition = match (rows, xids) {
        (Some(r), Some(x)) => format!("WHERE (({r}) OR {x})"),
        (Some(r), None) => format!("WHERE {r}"),
        (None, Some(x)) => format!("WHERE {x}"),
        (None, None) => "WHERE false".into(),
    };
    // Without a time column to order by (or an id column), the resume goes
    // by ids alone: a bound is a place in an order the SQL and the stream
    // agree on.
    let plain = |role: Role| matches!(resolved.source(role), Some(Source::Column(_)));
    let kind = id_kind(&resolved, &typed);
    let bounds: Vec<&publish::Covered> = if plain(Role::OccurredAt) {
        // A bound read for ids of another kind (the column retyped since)
        // is no place in this order.
        resume
            .covered
            .iter()
            .filter(|c| Some(c.id.kind()) == kind)
            .collect()
    } else {
        Vec::new()
    };
    // Text ids by their UTF-8 bytes, the order the bounds are read in,
    // whatever the column's collation or the database's encoding.
    let id_order = match kind {
        Some(publish::IdKind::Text) => format!("convert_to({id_sql}, 'UTF8')"),
        _ => id_sql.clone(),
    };
    let order = match &occurred_sql {
        Some(o) => format!("{o}, {id_order}"),
        None => id_order,
    };
    for covered in bounds {
        // Rows an interrupted run's snapshot held (their transaction ended
        // before its horizon) and ordered before what it surely stored.
        let at = covered
            .at
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(|e| Error::setup(format!("rendering the backfill's resume point: {e}")))?;
        // COALESCE: a row whose order key is null compares as null and
        // must be published, not dropped by the NOT.
        condition.push_str(&format!(
            " AND NOT COALESCE(({order}) < ('{at}', {}) AND {} < {}, false)",
            covered.id.sql(),
            full_xid("xmin", snap_xmax),
            covered.horizon
        ));
    }
    let select = columns
        .iter()
        .map(|(name, _)| tuple_text(name))
        .collect::<Vec<_>>()
        .join(", ");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DECLARE outbox_backfill NO SCROLL CURSOR FOR SELECT {select} FROM {}.{} {condition} ORDER BY {order}",
        quote(&cfg.schema),
        quote(&cfg.table)
    )))
    .execute(&mut *tx)
    .await
    .map_err(|e| {
        if crate::postgres::db_code(&e).as_deref() == Some("42501") {
            Error::setup(format!(
                "the backfill may not read {}.{}: GRANT SELECT ON {}.{} TO <relay role>; (or start with --backfill none)",
                cfg.schema, cfg.table, cfg.schema, cfg.table
            ))
        } else {
            Error::pg("reading the outbox for the backfill")(e)
        }
    })?;

    let header = header_value(filter, cfg.unpublished.as_deref());
    // Passed on, so a run interrupted in its turn does not make the next
    // one forget what the runs before it stored.
    let covered = (!resume.covered.is_empty()).then(|| publish::Covered::header(&resume.covered));
    // This run, and the window it publishes under: what the next one
    // proves from its messages (see `publish::prove`).
    let run = format!("{} {}", uuid::Uuid::new_v4().simple(), cfg.max_inflight);
    // The headers added below come on top of what routing checked: a row
    // routed to fit must still fit with them.
    let added = wire::BACKFILL.len()
        + header.len()
        + wire::BACKFILL_RUN.len()
        + run.len()
        + 4
        + covered
            .as_ref()
            .map_or(0, |c| wire::BACKFILL_COVERED.len() + c.len() + 4)
        + wire::BACKFILL_END.len()
        + 1
        + 8;
    let max_payload = max_payload.saturating_sub(added);
    let mut router = router.clone();
    router.set_xid_horizon(snap_xmin);
    let published = metrics::counter!(m::BACKFILL_ROWS);
    metrics::gauge!(m::BACKFILLING).set(1.0);
    let started = Instant::now();
    let mut last_log = Instant::now();
    let mut index: u32 = 0;
    let mut acked: u64 = 0;
    let mut skipped: u64 = 0;
    // Each message waits for the next row: only once the cursor is read
    // to the end is the last one known, and marked.
    let mut held: Option<(u64, OutMessage)> = None;
    loop {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "FETCH FORWARD {BATCH_ROWS} FROM outbox_backfill"
        )))
        .fetch_all(&mut *tx)
        .await
        .map_err(Error::pg("reading the outbox for the backfill"))?;
        if rows.is_empty() {
            break;
        }
        for row in &rows {
            let values = text_values(row, columns.len());
            let pos = Position {
                commit_lsn: Lsn::ZERO,
                index,
            };
            index = index.saturating_add(1);
            let mut msg: OutMessage = match &layout {
                Ok(l) => match l.row(&values) {
                    Ok(r) if resume.stored.contains(&wire::IdKey::of(&r.id)) => {
                        skipped += 1;
                        continue;
                    }
                    Ok(r) => router.route_committed(r, pos, None, max_payload),
                    // Its dead letter, under the row's id, may be stored too.
                    Err(_)
                        if l.id(&values)
                            .is_some_and(|id| resume.stored.contains(&wire::IdKey::of(&id))) =>
                    {
                        skipped += 1;
                        continue;
                    }
                    Err(e) => router.bad_row(l.id(&values), pos, &e.to_string()),
                },
                Err(e) => router.bad_row(None, pos, &e.to_string()),
            };
            msg.headers
                .push((Cow::Borrowed(wire::BACKFILL), header.clone()));
            msg.headers
                .push((Cow::Borrowed(wire::BACKFILL_RUN), run.clone()));
            if let Some(covered) = &covered {
                msg.headers
                    .push((Cow::Borrowed(wire::BACKFILL_COVERED), covered.clone()));
            }
            if let Some(reason) = msg.dlq_reason {
                log_dead_letter(&msg, reason);
            }
            if let Some((ticket, msg)) = held.replace((u64::from(index), msg)) {
                while !publisher.has_room() {
                    acked += await_ack(publisher).await?;
                }
                publisher.publish(ticket, 0, msg).await?;
            }
        }
        if last_log.elapsed() > PROGRESS_EVERY {
            last_log = Instant::now();
            tracing::info!(rows = index, acked, elapsed = ?started.elapsed(), "backfilling");
        }
    }
    if let Some((ticket, mut msg)) = held {
        // Only once everything before it is stored: with several streams,
        // each keeping its own order, a mark stored in one would otherwise
        // say nothing of a row still in flight to another, and the next
        // start would take the run for finished without it.
        while publisher.in_flight() > 0 {
            acked += await_ack(publisher).await?;
        }
        msg.headers
            .push((Cow::Borrowed(wire::BACKFILL_END), "1".into()));
        publisher.publish(ticket, 0, msg).await?;
    }
    while publisher.in_flight() > 0 {
        acked += await_ack(publisher).await?;
    }
    published.increment(acked);
    if skipped > 0 {
        tracing::info!(
            skipped,
            "rows the interrupted backfill had stored were not published again"
        );
    }
    metrics::gauge!(m::BACKFILLING).set(0.0);
    tx.rollback()
        .await
        .map_err(Error::pg("ending the backfill transaction"))?;
    Ok(acked)
}

/// The table as pgoutput would describe it with every value read as text,
/// so the stream's row decoding serves rows read by SQL too.
pub(crate) fn text_relation(schema: &str, table: &str, columns: &[(String, u32)]) -> Relation {
    Relation {
        id: 0,
        namespace: schema.to_owned(),
        name: table.to_owned(),
        replica_identity: b'd',
        columns: columns
            .iter()
            .map(|(name, ty)| Column {
                key: false,
                name: name.clone(),
                type_oid: *ty,
                type_modifier: -1,
            })
            .collect(),
    }
}

/// A column selected as a text tuple carries it: its type's output
/// function's text (`format('%s', …)` calls it), which a cast to text is
/// not for every type (`true::text` is `true` where the output is `t`;
/// `char(n)` loses its padding), and null as null.
pub(crate) fn tuple_text(column: &str) -> String {
    let c = quote(column);
    format!("CASE WHEN {c} IS NULL THEN NULL ELSE format('%s', {c}) END")
}

/// A row selected with [`tuple_text`], as the decoder takes a tuple in
/// text format.
pub(crate) fn text_values(row: &sqlx::postgres::PgRow, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| match row.try_get::<Option<String>, _>(i) {
            Ok(Some(v)) => Value::Text(Bytes::from(v)),
            _ => Value::Null,
        })
        .collect()
}

async fn await_ack(publisher: &mut Publisher) -> Result<u64> {
    match publisher.next_ack().await {
        Some(ack) => ack.result.map(|_| 1),
        None => Ok(0),
    }
}

/// SQL for the full (xid8) transaction id of a 32-bit xid column, in a
/// snapshot whose xmax is `xmax`: every visible row's xid is below it, so
/// one that reads above xmax's low half is of the previous epoch. (A frozen
/// row from epochs ago may map too high: it is republished, a repeat.)
fn full_xid(column: &str, xmax: u64) -> String {
    let epoch = xmax & !0xFFFF_FFFF;
    let low = xmax & 0xFFFF_FFFF;
    format!(
        "({epoch}::int8 + {column}::text::int8 - CASE WHEN {column}::text::int8 > {low} THEN 4294967296 ELSE 0 END)"
    )
}

/// The temporary slot's command: PostgreSQL 14 knows only the old option
/// syntax (15 added the parenthesized list and deprecated the keywords).
fn create_init_slot(init: &str, server_version_num: i32) -> String {
    let export = if server_version_num < 150_000 {
        "EXPORT_SNAPSHOT"
    } else {
        "(SNAPSHOT 'export')"
    };
    format!("CREATE_REPLICATION_SLOT {init} TEMPORARY LOGICAL pgoutput {export}")
}

/// SQL for a role's source in the backfill's order: its column, or a key
/// of a json column as text.
/// The kind of the outbox's ids, where a resumed backfill can bound them:
/// an id column of a type whose order the SQL and the relay agree on.
fn id_kind(resolved: &Resolved, typed: &[(String, u32)]) -> Option<publish::IdKind> {
    use crate::relay::pgoutput::oid;
    let Some(Source::Column(id)) = resolved.source(Role::Id) else {
        return None;
    };
    match typed.iter().find(|(n, _)| n == id)?.1 {
        oid::UUID => Some(publish::IdKind::Uuid),
        oid::INT2 | oid::INT4 | oid::INT8 => Some(publish::IdKind::Int),
        oid::TEXT | oid::VARCHAR => Some(publish::IdKind::Text),
        _ => None,
    }
}

/// The outbox's columns and their type oids, in the table's order.
async fn outbox_columns<'e>(
    ex: impl sqlx::PgExecutor<'e>,
    cfg: &RelayConfig,
) -> Result<Vec<(String, u32)>> {
    let columns: Vec<(String, i64)> = sqlx::query_as(
        "SELECT a.attname::text, a.atttypid::int8 FROM pg_attribute a \
         JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
         WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped \
         ORDER BY a.attnum",
    )
    .bind(&cfg.schema)
    .bind(&cfg.table)
    .fetch_all(ex)
    .await
    .map_err(Error::pg("reading the outbox's columns"))?;
    Ok(columns
        .into_iter()
        .map(|(name, oid)| (name, u32::try_from(oid).unwrap_or_default()))
        .collect())
}

/// [`id_kind`], read from the catalog.
async fn outbox_id_kind(pool: &sqlx::PgPool, cfg: &RelayConfig) -> Result<Option<publish::IdKind>> {
    let typed = outbox_columns(pool, cfg).await?;
    let table = format!("{}.{}", cfg.schema, cfg.table);
    Ok(cfg
        .columns
        .resolve(&table, &typed)
        .ok()
        .and_then(|resolved| id_kind(&resolved, &typed)))
}

fn source_sql(source: &Source) -> String {
    match source {
        Source::Column(c) => quote(c),
        // As text, never cast: one malformed value must not fail the
        // whole read (the row itself is dead-lettered when decoded).
        Source::Key { column, key } => {
            format!("({}->>'{}')", quote(column), key.replace('\'', "''"))
        }
    }
}

/// A SQL identifier, quoted.
use postgres_protocol::escape::escape_identifier as quote;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_temporary_slot_is_asked_for_in_the_servers_own_syntax() {
        assert_eq!(
            create_init_slot("s_init", 140_023),
            "CREATE_REPLICATION_SLOT s_init TEMPORARY LOGICAL pgoutput EXPORT_SNAPSHOT"
        );
        for v in [150_000, 180_004] {
            assert!(create_init_slot("s_init", v).ends_with("pgoutput (SNAPSHOT 'export')"));
        }
    }

    fn streamed() -> TailEvent {
        TailEvent {
            id: "0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11".into(),
            occurred_at: Some("2026-11-20T10:00:00Z".into()),
            commit_lsn: Some("0/16B3748".into()),
            backfill: None,
            backfill_end: false,
            xid_horizon: Some(7_000),
        }
    }

    /// Across streams: one streamed event anywhere means the slot existed
    /// (a lost slot, not an interrupted backfill), and the resync starts
    /// from the oldest horizon of them all.
    #[test]
    fn the_streams_newest_events_decide_as_one() {
        let at = |backfill: bool, h: u64| TailEvent {
            backfill: backfill.then(|| "unpublished".to_owned()),
            xid_horizon: Some(h),
            ..streamed()
        };
        assert_eq!(decisive(Vec::new()), None);
        let d = decisive(vec![at(true, 5), at(false, 9), at(false, 7)]).unwrap();
        assert_eq!((d.backfill, d.xid_horizon), (None, Some(5)));
        let d = decisive(vec![at(true, 3), at(true, 4)]).unwrap();
        assert_eq!((d.backfill.is_some(), d.xid_horizon), (true, Some(4)));
        let old = TailEvent {
            xid_horizon: None,
            ..at(false, 1)
        };
        assert_eq!(decisive(vec![at(false, 8), old]).unwrap().xid_horizon, None);
        // The newest run finished if its last message in any stream says so.
        let end = |h: u64| TailEvent {
            backfill_end: true,
            ..at(true, h)
        };
        let d = decisive(vec![at(true, 4), end(4), at(true, 3)]).unwrap();
        assert_eq!((d.xid_horizon, d.backfill_end), (Some(4), true));
        let d = decisive(vec![at(true, 4), end(3)]).unwrap();
        assert_eq!(
            (d.xid_horizon, d.backfill_end),
            (Some(4), false),
            "an older run's end"
        );
    }

    /// Review R8: the slot lost right after a backfill finished is a lost
    /// slot (its events written with `outbox_emit()` since are gone), not
    /// an interrupted backfill to finish quietly.
    #[test]
    fn a_finished_backfills_lost_slot_is_refused_as_a_lost_slot() {
        let tail = TailEvent {
            backfill: Some(header_value(&Backfill::Unpublished.into(), None)),
            backfill_end: true,
            ..streamed()
        };
        let err = plan(&Backfill::Unpublished, None, Some(&tail), "s", "S")
            .unwrap_err()
            .to_string();
        assert!(err.contains("--resync-since 2026-11-20T10:00:00Z"), "{err}");
        assert!(err.contains("outbox_emit()"), "{err}");
        assert!(err.contains("a backfill finished with that event"), "{err}");
        let since = Backfill::Since("2026-11-20T10:00:00Z".into());
        assert_eq!(
            plan(&Backfill::Unpublished, Some(&since), Some(&tail), "s", "S").unwrap(),
            Filter {
                rows: since,
                xid_from: Some(7_000)
            }
        );
    }

    #[test]
    fn a_first_start_backfills_as_configured() {
        let plan = |b: &Backfill, r: Option<&Backfill>| plan(b, r, None, "s", "S");
        assert_eq!(
            plan(&Backfill::Unpublished, None).unwrap(),
            Backfill::Unpublished.into()
        );
        assert_eq!(plan(&Backfill::None, None).unwrap(), Backfill::None.into());
        let since = Backfill::Since("2026-11-01T00:00:00Z".into());
        assert_eq!(plan(&Backfill::None, Some(&since)).unwrap(), since.into());
    }

    #[test]
    fn a_lost_slot_is_refused_with_the_last_event_and_the_fix() {
        let err = plan(
            &Backfill::Unpublished,
            None,
            Some(&streamed()),
            "slot_a",
            "A_EVENTS",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("0b7e5c3e-8d7f-4f57-9b5a-3f0d9a3c2e11"),
            "{err}"
        );
        assert!(err.contains("--resync-since 2026-11-20T10:00:00Z"), "{err}");
        assert!(
            err.contains("still open when that event committed"),
            "{err}"
        );
        let since = Backfill::Since("2026-11-20T10:00:00Z".into());
        assert_eq!(
            plan(
                &Backfill::Unpublished,
                Some(&since),
                Some(&streamed()),
                "s",
                "S"
            )
            .unwrap(),
            Filter {
                rows: since,
                xid_from: Some(7_000)
            },
            "whatever time is given, transactions past the last event's horizon come back"
        );
    }

    #[test]
    fn without_a_horizon_the_refusal_says_what_the_time_misses() {
        let old = TailEvent {
            xid_horizon: None,
            ..streamed()
        };
        let err = plan(&Backfill::Unpublished, None, Some(&old), "s", "S")
            .unwrap_err()
            .to_string();
        assert!(err.contains("is not covered"), "{err}");
    }

    #[test]
    fn a_row_xid_is_placed_in_the_snapshots_epoch() {
        let one_epoch = (1u64 << 32) + 100;
        assert_eq!(
            full_xid("xmin", one_epoch),
            "(4294967296::int8 + xmin::text::int8 - CASE WHEN xmin::text::int8 > 100 THEN 4294967296 ELSE 0 END)"
        );
    }

    #[test]
    fn an_interrupted_backfill_is_finished_with_its_own_filter() {
        for filter in [
            Backfill::Unpublished.into(),
            Backfill::Since("2026-11-20T10:00:00Z".into()).into(),
            Filter {
                rows: Backfill::Since("2026-11-20T10:00:00Z".into()),
                xid_from: Some(12_345),
            },
        ] {
            let tail = TailEvent {
                backfill: Some(header_value(&filter, None)),
                ..streamed()
            };
            assert_eq!(
                plan(&Backfill::None, None, Some(&tail), "s", "S").unwrap(),
                filter
            );
        }
        assert_eq!(parse_header("since not-a-time"), None);
        // From the review: a run under another --unpublished writes another
        // header, so a resumed run trusts bounds of its own filter only.
        let f: Filter = Backfill::Unpublished.into();
        let a = header_value(&f, Some("tenant_id = 1"));
        assert_ne!(a, header_value(&f, Some("true")));
        assert_ne!(a, header_value(&f, None));
        assert_eq!(a, header_value(&f, Some("tenant_id = 1")));
        assert_eq!(parse_header(&a), Some(f));
        assert_eq!(parse_header("unpublished; xid nope"), None);
    }

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote("a\"b"), "\"a\"\"b\"");
    }
}
