//! `outbox-relay audit` (SPEC §14): does the stream hold what the relay
//! confirmed? The outbox rows of a window (by the `occurred_at` role, in a
//! snapshot the slot has confirmed) against this database's messages in the
//! streams (`Outbox-Source`), by id.
//!
//! Memory stays flat whatever the window: the messages' headers are read
//! once, in stream order, and copied into a temporary table of the audit's
//! own transaction (`COPY`, a megabyte at a time), so the comparison is
//! Postgres' set work (hash or sort, spilling to disk), not ids held here.
//! The one check made while reading, commit order, keeps the last position
//! per stream and source. `--repair` republishes the missing rows through
//! the relay's own router, marked `Outbox-Repair`, and never deletes.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, Context};
use futures::StreamExt;
use serde::Serialize;
use sqlx::PgPool;
use time::OffsetDateTime;

use crate::error::{Error, Result};
use crate::metrics as m;
use crate::relay::config::RelayConfig;
use crate::relay::outbox_row::OutboxLayout;
use crate::relay::route::Router;
use crate::wire::{self, Position};
use pgwire_replication::Lsn;

/// What the audit compares, and how long it waits for the relay.
#[derive(Debug, Clone)]
pub struct AuditConfig {
    pub relay: RelayConfig,
    pub since: OffsetDateTime,
    pub until: OffsetDateTime,
    pub repair: bool,
    /// `--repair` publishes rows marked published too (review A5).
    pub include_marked: bool,
    /// `--repair` sends a hole behind later events of its aggregate too
    /// (review A3).
    pub repair_out_of_order: bool,
    /// How long to wait for the slot to confirm the audit's snapshot.
    pub wait: Duration,
    /// How far apart a row's time and its message's store time may be.
    pub slack: Duration,
    /// A message whose row is gone is a finding (`no_row`).
    pub strict: bool,
}

/// One thing the stream does not hold as it should.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Finding {
    /// `missing`, `duplicate`, `no_row` or `out_of_order`.
    pub kind: &'static str,
    pub id: String,
    pub detail: String,
}

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub since: String,
    pub until: String,
    pub rows: i64,
    pub messages: i64,
    /// Events written with `outbox_emit()`: no row to check them against.
    pub unverifiable: i64,
    /// Messages whose row is gone (deleted once published, or never kept);
    /// `no_row` findings with `--strict`.
    pub deleted: i64,
    /// Each kind's count; `findings` lists up to 1,000 of each.
    pub missing: i64,
    pub duplicate: i64,
    pub no_row: i64,
    pub out_of_order: i64,
    /// Rows in the stream as a relay dead letter, not as an event: held,
    /// not lost, but no consumer got them.
    pub dead_lettered: i64,
    pub findings: Vec<Finding>,
    /// What the reader must know of how the window was judged.
    pub notes: Vec<String>,
    /// Rows of the window no stream read can speak for (older than a
    /// stream made after the window's start, that lacks them).
    pub unjudged: i64,
    /// Messages without a row, not judged: a transaction had committed
    /// but was not visible yet (review A12). With `--strict`, and no
    /// finding, the audit could not say (exit 2).
    pub unsettled: i64,
    /// No finding, and something the audit was asked to judge it could
    /// not (exit 2).
    pub undecided: bool,
    /// Ids `--repair` published again.
    pub repaired: Vec<String>,
    /// How long the audit held its snapshot (vacuum waits on it): the wait
    /// for the slot and the copy of the window's rows.
    pub snapshot_seconds: f64,
    pub seconds: f64,
}

impl Report {
    pub fn clean(&self) -> bool {
        self.findings_count() == 0
    }

    /// Every finding counted, dead letters included (SPEC §14: exit 1).
    pub fn findings_count(&self) -> i64 {
        self.missing + self.duplicate + self.no_row + self.out_of_order + self.dead_lettered
    }

    /// One line per finding, then the summary.
    pub fn lines(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .findings
            .iter()
            .map(|f| format!("{} {} {}", f.kind, f.id, f.detail))
            .collect();
        for what in &self.repaired {
            out.push(format!("repaired {what}"));
        }
        for note in &self.notes {
            out.push(format!("note {note}"));
        }
        out.push(format!(
            "audit {} .. {}: {} rows, {} messages; {} missing, {} duplicate, {} without a row, {} out of order, {} dead-lettered; {} emitted events and {} messages whose row was deleted not verifiable; {} repaired; snapshot held {:.2}s; {:.1}s",
            self.since,
            self.until,
            self.rows,
            self.messages,
            self.missing,
            self.duplicate,
            self.no_row,
            self.out_of_order,
            self.dead_lettered,
            self.unverifiable,
            self.deleted,
            self.repaired.len(),
            self.snapshot_seconds,
            self.seconds,
        ));
        out
    }
}

/// COPY chunk size.
const CHUNK: usize = 1 << 20;
/// The slot part of the `Outbox-Source` of a repaired copy.
const REPAIR_SLOT: &str = "audit-repair";
/// At most this many findings of one kind are listed (all are counted).
const MAX_LISTED: i64 = 1000;

/// `slot_pool` reaches the relay's slot when it is not in `pool`'s server
/// (the relay streams from a standby).
pub async fn run(
    pool: &PgPool,
    slot_pool: Option<&PgPool>,
    js: &Context,
    cfg: &AuditConfig,
) -> Result<Report> {
    let rc = &cfg.relay;
    let rfc = |t: OffsetDateTime| {
        t.format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default()
    };
    // Postgres keeps microseconds, and rounds a finer bound it is given;
    // the messages' times would be compared in nanoseconds (review A13):
    // both sides take the bounds to the microsecond.
    let micro = |t: OffsetDateTime| {
        t.replace_nanosecond(t.nanosecond() / 1_000 * 1_000)
            .unwrap_or(t)
    };
    let (since, until) = (micro(cfg.since), micro(cfg.until));
    // The newest stream made after the window's start (deleted and made
    // again, or new): it holds nothing published before then, so a row
    // older than that which it lacks may have been in the one it replaced.
    let mut made_after: Option<(String, OffsetDateTime)> = None;
    let mut report = Report {
        since: rfc(since),
        until: rfc(until),
        ..Report::default()
    };
    let keys = crate::ops::prune::Keys::of(pool, &rc.schema, &rc.table, &rc.columns).await?;
    let database: String = sqlx::query_scalar("SELECT current_database()::text")
        .fetch_one(pool)
        .await
        .map_err(Error::pg("reading the database name"))?;
    // A standby refuses every write, to temporary tables too, and the
    // comparison is made in those (review A2).
    let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(pool)
        .await
        .map_err(Error::pg("asking whether the database is a standby"))?;
    if standby {
        return Err(Error::Config(format!(
            "database {database} is on a standby, where the audit cannot make the temporary tables it compares in: run it against the primary, with --slot-database-url naming this standby (where the relay's slot is)"
        )));
    }
    // The temporary tables live on one session across transactions.
    crate::postgres::pooler::check_session_pinned_for(
        pool,
        "The audit keeps its temporary tables on one session across transactions, which such a proxy hands to other clients; connect it to Postgres directly, or through a pool in session mode",
    )
    .await?;
    let slot_pool = crate::ops::prune::slot_pool_of(pool, slot_pool).await?;
    if !crate::ops::prune::slot_exists(slot_pool, &rc.slot).await? {
        return Err(Error::Config(format!(
            "slot {} does not exist in this database: give the relay's --context or --slot, or, when the relay streams from a standby, --slot-database-url naming it",
            rc.slot
        )));
    }
    // The system id tells this cluster's messages from another's of the
    // same database name; without the privilege, the name decides.
    let system_id: Option<String> =
        sqlx::query_scalar("SELECT system_identifier::text FROM pg_control_system()")
            .fetch_one(pool)
            .await
            .ok();

    // The streams first: bad input is said before anything waits.
    let mut names: Vec<&str> = vec![&rc.stream];
    for s in &rc.streams {
        if !names.contains(&s.as_str()) {
            names.push(s);
        }
    }
    let mut streams = Vec::new();
    for name in &names {
        let mut stream = match js.get_stream(*name).await {
            Ok(stream) => stream,
            // Rows naming a listed stream that does not exist are the
            // relay's dead letters (`stream_missing`), read from its own.
            Err(e) if *name != rc.stream && crate::relay::publish::stream_not_found(&e) => {
                tracing::info!(
                    stream = name,
                    "listed in --streams but does not exist: its rows are dead letters"
                );
                continue;
            }
            Err(e) => {
                return Err(Error::Config(format!(
                    "stream {name}: {e} (pass the relay's --stream / --streams)"
                )))
            }
        };
        let (state, created) = state_of(&mut stream, name).await?;
        match reach(&state, created, since) {
            Reach::Holds => {}
            Reach::Short(from) => {
                return Err(Error::Config(format!(
                    "stream {name} reaches back to {} only (messages of the window expired, were purged or deleted), after --since {}: audit a window it holds",
                    from.map_or_else(|| "nothing (it is empty)".to_owned(), rfc),
                    report.since
                )))
            }
            Reach::From(made) if made > made_after.as_ref().map_or(since, |(_, t)| *t) => {
                made_after = Some((name.to_string(), made));
            }
            Reach::From(_) => {}
        }
        streams.push((name.to_string(), stream));
    }

    // Rows the relay's first start took for published (the worker it
    // replaced sent them) are held to the stream like any other: a row
    // marked so later may be one the relay sent and the stream lost. A
    // hole among them is said to be one.
    let unpublished = unpublished_rows(pool, rc).await?;
    // Rows outside the publication's row filter (two contexts sharing one
    // table) never reach the relay: not its to publish, nor the repair's
    // (review A5). The filter names the table's columns as the window's
    // subquery does.
    let row_filter: Option<String> = sqlx::query_scalar(
        "SELECT to_jsonb(t) ->> 'rowfilter' FROM pg_publication_tables t \
          WHERE t.pubname = $1 AND t.schemaname = $2 AND t.tablename = $3",
    )
    .bind(&rc.publication)
    .bind(&rc.schema)
    .bind(&rc.table)
    .fetch_optional(pool)
    .await
    .map_err(Error::pg("reading the publication's row filter"))?
    .flatten();
    let table = format!("{}.{}", quote(&rc.schema), quote(&rc.table));
    let at = keys.occurred_at(None);
    let (r_id, r_at) = (keys.id(Some("r")), keys.occurred_at(Some("r")));
    let window = format!("{at} >= $1::timestamptz AND {at} < $2::timestamptz");
    // A row's id as the relay sends it: a text id holding a UUID goes as
    // that UUID's canonical text.
    let sent_id = sent_id_sql(&keys, &r_id);
    // The id in the table's own type, so a message's row is found through
    // the table's key (review A1); a text id is compared as text.
    let key_type = match keys.id_type {
        "uuid" | "int8" | "int4" => keys.id_type,
        _ => "text",
    };

    // Deleted relay dead letters are read where the role may read them
    // (the relay's role is granted SELECT on the outbox alone).
    let (deleted_table, deleted_letters): (bool, bool) = sqlx::query_as(
        "SELECT to_regclass('outbox_deleted_letters') IS NOT NULL, \
                coalesce(has_table_privilege(to_regclass('outbox_deleted_letters'), 'SELECT'), false)",
    )
    .fetch_one(pool)
    .await
    .map_err(Error::pg("looking for outbox_deleted_letters"))?;
    if deleted_table && !deleted_letters {
        report.notes.push(
            "this role may not read outbox_deleted_letters: a row whose relay dead letter an operator deleted shows as missing; GRANT SELECT ON outbox_deleted_letters to it".into(),
        );
    }
    // One session holds the audit's temporary tables; it is closed at the
    // end, never handed back to the pool with them.
    let mut conn = pool
        .acquire()
        .await
        .map_err(Error::pg("connecting for the audit"))?
        .detach();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "{} SELECT set_config('transaction_timeout', '0', false) \
         WHERE current_setting('server_version_num')::int >= 170000",
        crate::postgres::set_local_tuple_text().replace("SET LOCAL", "SET")
    )))
    .execute(&mut conn)
    .await
    .map_err(Error::pg("starting the audit"))?;

    // The audit's snapshot, and the WAL position behind it: once the slot
    // confirmed that, every row the snapshot holds was published. The
    // snapshot is held only to copy the window's rows, not while the
    // streams are read (it would hold back vacuum meanwhile), nor while
    // the relay catches up: the slot first confirms where the WAL is now,
    // then the snapshot is taken, and the rest to confirm is a moment's.
    let deadline = Instant::now() + cfg.wait;
    let confirm = |w: Lsn| async move {
        let left = deadline.saturating_duration_since(Instant::now());
        match crate::ops::prune::wait_confirmed(slot_pool, &rc.slot, w, left).await? {
            crate::ops::prune::Confirmed::Reached(_) => Ok(()),
            crate::ops::prune::Confirmed::Behind(at) => Err(Error::setup(format!(
                "slot {} has not confirmed {w} within {:?} (it is at {}): the relay is down or behind, and rows it has not published yet would show as missing; run the audit again once it has caught up",
                rc.slot,
                cfg.wait,
                at.map_or_else(|| "nothing".to_owned(), |l| l.to_string())
            ))),
        }
    };
    let wal_now = format!("SELECT {}", crate::postgres::WAL_NOW);
    let parse =
        |w: String| Lsn::parse(&w).map_err(|e| Error::setup(format!("WAL position {w:?}: {e}")));
    let w: String = sqlx::query_scalar(sqlx::AssertSqlSafe(wal_now.as_str()))
        .fetch_one(&mut conn)
        .await
        .map_err(Error::pg("reading the WAL position"))?;
    confirm(parse(w)?).await?;
    let held = Instant::now();
    let mut tx = sqlx::Connection::begin(&mut conn)
        .await
        .map_err(Error::pg("starting the audit"))?;
    sqlx::raw_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .map_err(Error::pg("starting the audit"))?;
    let w: String = sqlx::query_scalar(sqlx::AssertSqlSafe(wal_now.as_str()))
        .fetch_one(&mut *tx)
        .await
        .map_err(Error::pg("taking the audit's snapshot"))?;
    let w = parse(w)?;
    confirm(w).await?;

    // What the audit itself costs, without the wait for the relay.
    let started = Instant::now();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TEMP TABLE outbox_audit_rows (id text, at timestamptz, aggregate text, stream text, \
           unpublished bool, dismissed bool, filtered bool); \
         CREATE TEMP TABLE outbox_audit (stream text, seq int8, id text, key {key_type}, source text, \
           emitted bool, lsn int8, counted bool, aggregate text, at timestamptz, \
           dlq_reason text, dlq_detail text); \
         CREATE INDEX ON outbox_audit (id)"
    )))
    .execute(&mut *tx)
    .await
    .map_err(Error::pg("creating the audit's temporary tables"))?;
    let aggregate = keys
        .aggregate(Some("r"))
        .unwrap_or_else(|| "NULL::text".into());
    // A row whose relay dead letter an operator deleted from a stream read
    // here (`dlq delete`: the documented procedure inserts a fixed copy as
    // a new row) was dealt with: not a hole, and never repaired (review
    // A5).
    let dismissed = if deleted_letters {
        format!(
            "EXISTS (SELECT 1 FROM outbox_deleted_letters d WHERE d.id = {sent_id} AND d.stream = ANY($3) \
               AND split_part(d.source, '/', 3) = current_database() AND split_part(d.source, '/', 4) = $4)"
        )
    } else {
        "false".to_owned()
    };
    // The window's rows in a subquery of their own, so that the relay's
    // predicate may name the table as it does there.
    let stream_names: Vec<String> = streams.iter().map(|(n, _)| n.clone()).collect();
    let stream = keys
        .stream(Some("r"))
        .unwrap_or_else(|| "NULL::text".into());
    let filtered = row_filter
        .as_deref()
        .map_or_else(|| "false".to_owned(), |f| format!("({f}) IS NOT TRUE"));
    let insert = format!(
        "INSERT INTO outbox_audit_rows \
         SELECT {sent_id}, {r_at}, {aggregate}, {stream}, r.outbox_audit_unpublished, {dismissed}, \
                r.outbox_audit_filtered \
         FROM (SELECT *, ({unpublished}) AS outbox_audit_unpublished, \
                      {filtered} AS outbox_audit_filtered FROM {table} WHERE {window}) r"
    );
    let mut insert = sqlx::query(sqlx::AssertSqlSafe(insert))
        .bind(&report.since)
        .bind(&report.until);
    if deleted_letters {
        insert = insert.bind(&stream_names).bind(&rc.slot);
    }
    report.rows = insert
        .execute(&mut *tx)
        .await
        .map_err(Error::pg("copying the window's rows"))?
        .rows_affected() as i64;
    if let Some(note) = index_note(&mut tx, rc, &keys).await? {
        report.notes.push(note);
    }
    tx.commit()
        .await
        .map_err(Error::pg("copying the window's rows"))?;
    report.snapshot_seconds = held.elapsed().as_secs_f64();
    sqlx::raw_sql("CREATE INDEX ON outbox_audit_rows (id); ANALYZE outbox_audit_rows")
        .execute(&mut conn)
        .await
        .map_err(Error::pg("indexing the window's rows"))?;

    // This relay's messages: this cluster's database, and this slot (or
    // the audit's own repairs). Another relay of the same database writing
    // into the same stream is not this one (review A10).
    let mine = |source: &str| {
        let mut parts = source.splitn(4, '/');
        let (sys, _, db, slot) = (parts.next(), parts.next(), parts.next(), parts.next());
        db == Some(database.as_str())
            && system_id.as_deref().is_none_or(|s| sys == Some(s))
            && slot.is_none_or(|s| s == rc.slot || s == REPAIR_SLOT)
    };
    let key_of = |id: &str| -> Option<String> {
        match key_type {
            "uuid" => uuid::Uuid::parse_str(id).ok().map(|u| u.to_string()),
            "int8" => id.parse::<i64>().ok().map(|v| v.to_string()),
            "int4" => id.parse::<i32>().ok().map(|v| v.to_string()),
            _ => Some(id.to_owned()),
        }
    };
    let mut reader = Reader {
        since,
        until,
        mine: &mine,
        key_of: &key_of,
        ours_read: 0,
        newest: HashMap::new(),
        progress: Progress::new(),
    };
    // The stream is read from the window's start to its end, each with the
    // clock slack; on only while rows of the window are not found: past
    // the end (the relay was behind), then from the stream's start (an
    // occurred_at ahead of its message's store time, review A8).
    let (start, stop) = (since - cfg.slack, until + cfg.slack);
    // Rows marked published older than a stream made after --since are
    // not looked for: it cannot hold them (judged below).
    let made = made_after
        .as_ref()
        .map_or_else(|| report.since.clone(), |(_, t)| rfc(*t));
    let mut spans = Vec::new();
    for (name, stream) in &mut streams {
        let (state, _) = state_of(stream, name).await?;
        let span = if state.messages == 0 || state.last_timestamp < start {
            Span::default()
        } else {
            reader
                .read(
                    &mut conn,
                    stream,
                    name,
                    jetstream::consumer::DeliverPolicy::ByStartTime { start_time: start },
                    state.last_sequence,
                    Some(stop),
                    true,
                    &mut report,
                )
                .await?
        };
        spans.push((span, state.first_sequence, state.last_sequence));
    }
    let mut lacking = rows_lacking(&mut conn, &made).await?;
    if lacking > 0 {
        for ((name, stream), (span, _, _)) in streams.iter_mut().zip(&spans) {
            let Some(next) = span.next else { continue };
            let (state, _) = state_of(stream, name).await?;
            let by_seq = jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: next,
            };
            reader
                .read(
                    &mut conn,
                    stream,
                    name,
                    by_seq,
                    state.last_sequence,
                    None,
                    true,
                    &mut report,
                )
                .await?;
        }
        lacking = rows_lacking(&mut conn, &made).await?;
    }
    if lacking > 0 {
        let before = lacking;
        for ((name, stream), (span, first, last)) in streams.iter_mut().zip(&spans) {
            // Up to what phase 1 read or stopped at: phase 2 read on from
            // there.
            let end = span
                .first
                .or(span.next)
                .map_or(*last, |f| f.saturating_sub(1));
            if *first == 0 || end < *first {
                continue;
            }
            let by_seq = jetstream::consumer::DeliverPolicy::ByStartSequence {
                start_sequence: *first,
            };
            reader
                .read(
                    &mut conn,
                    stream,
                    name,
                    by_seq,
                    end,
                    None,
                    false,
                    &mut report,
                )
                .await?;
        }
        lacking = rows_lacking(&mut conn, &made).await?;
        if lacking < before {
            report.notes.push(format!(
                "{} rows of the window are in messages stored more than the clock slack ({}) before the window's start: their occurred_at is ahead of the store time (a business time, a producer's fast clock, a timestamp column in a zone east of UTC), and the streams were read from their start to find them",
                before - lacking,
                humantime::format_duration(cfg.slack)
            ));
        }
    }
    let ours_read = reader.ours_read;
    sqlx::raw_sql("ANALYZE outbox_audit")
        .execute(&mut conn)
        .await
        .map_err(Error::pg("indexing the audit's ids"))?;

    report.messages =
        sqlx::query_scalar("SELECT count(*) FROM outbox_audit WHERE counted AND NOT emitted")
            .fetch_one(&mut conn)
            .await
            .map_err(Error::pg("counting the window's messages"))?;
    let lacking = |rows: &str| {
        format!(
            "FROM outbox_audit_rows r WHERE {rows} AND NOT r.dismissed AND NOT r.filtered \
             AND NOT EXISTS (SELECT 1 FROM outbox_audit a WHERE a.id = r.id)"
        )
    };
    // Rows the streams lack that are not the relay's to hold: a relay dead
    // letter an operator deleted, a row the publication filters out.
    let (dismissed, filtered): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE r.dismissed), count(*) FILTER (WHERE r.filtered AND NOT r.dismissed) \
           FROM outbox_audit_rows r \
          WHERE (r.dismissed OR r.filtered) \
            AND NOT EXISTS (SELECT 1 FROM outbox_audit a WHERE a.id = r.id)",
    )
    .fetch_one(&mut conn)
    .await
    .map_err(Error::pg("counting rows dealt with or filtered out"))?;
    if dismissed > 0 {
        report.unjudged += dismissed;
        report.notes.push(format!(
            "{dismissed} rows of the window are not in the streams because an operator deleted their relay dead letter (outbox_deleted_letters): dealt with, not judged, never repaired"
        ));
    }
    if filtered > 0 {
        report.unjudged += filtered;
        report.notes.push(format!(
            "{filtered} rows of the window are outside the row filter of publication {} (WHERE {}): the relay never receives them; not judged, never repaired",
            rc.publication,
            row_filter.as_deref().unwrap_or("?")
        ));
    }
    let holes = lacking("r.at >= $1::timestamptz");
    report.missing = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) {holes}")))
        .bind(&made)
        .fetch_one(&mut conn)
        .await
        .map_err(Error::pg("counting rows missing from the stream"))?;
    // Rows no stream read holds that name a stream (their `stream` role)
    // this audit was not given, and that exists: the relay, given it in
    // --streams, published them there. Not holes this run can judge, and
    // a repair would send them again (review A11).
    // Given a --streams, the audit reads as the relay routes: a row naming
    // another stream was the relay's dead letter, and lacking, a hole.
    if report.missing > 0 && keys.stream(None).is_some() && rc.streams.is_empty() {
        let given: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let elsewhere: Vec<(String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT r.stream, count(*) {} AND r.stream IS NOT NULL AND NOT (r.stream = ANY($1)) \
             GROUP BY r.stream ORDER BY count(*) DESC, r.stream",
            lacking("true")
        )))
        .bind(&given)
        .fetch_all(&mut conn)
        .await
        .map_err(Error::pg("reading the streams the missing rows name"))?;
        let mut unread = Vec::new();
        for (name, n) in elsewhere {
            match js.get_stream(&name).await {
                Ok(_) => unread.push(format!("{n} name {name}")),
                // Not a stream (none of that name, or no valid name): the
                // relay could not have published them there.
                Err(e)
                    if crate::relay::publish::stream_not_found(&e)
                        || matches!(
                            e.kind(),
                            jetstream::context::GetStreamErrorKind::InvalidStreamName
                                | jetstream::context::GetStreamErrorKind::EmptyName
                        ) => {}
                Err(e) => return Err(Error::nats(format!("reading stream {name}"))(e)),
            }
        }
        if !unread.is_empty() {
            return Err(Error::Config(format!(
                "rows of the window that no stream read holds name, in their stream column, streams this audit was not given ({}): the relay routes them there with --streams; audit with the relay's own --streams (its environment's OUTBOX_STREAMS)",
                unread.join(", ")
            )));
        }
    }
    if let Some((name, at_made)) = &made_after {
        // Rows older than a stream made after --since that it lacks: they
        // may have been lost with the stream it replaced, or never been
        // this relay's (marked published: the worker it replaced sent
        // them). The first cannot be judged: the audit says so (exit 2)
        // rather than call the window clean (review A9).
        let (older, marked): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FILTER (WHERE r.unpublished IS DISTINCT FROM false), \
                    count(*) FILTER (WHERE r.unpublished = false) {}",
            lacking("r.at < $1::timestamptz")
        )))
        .bind(&made)
        .fetch_one(&mut conn)
        .await
        .map_err(Error::pg("counting rows older than the stream"))?;
        if older > 0 {
            return Err(Error::Config(format!(
                "stream {name} was made at {}, after --since {}, and does not hold {older} rows of the window older than it: whether they were lost with the stream it replaced cannot be said; audit from its making on (--since {})",
                rfc(*at_made),
                report.since,
                rfc(*at_made)
            )));
        }
        if marked > 0 {
            report.unjudged += marked;
            report.notes.push(format!(
                "{marked} rows of the window marked published, older than stream {name} (made at {}), are not in it: the worker the relay replaced sent them; not judged",
                rfc(*at_made)
            ));
        }
    }
    // Every row missing, and not one message of this database in the
    // streams read from the window's start on, while the slot confirmed
    // the window: the relay wrote them, elsewhere. The flags are not the
    // relay's (another --stream, --streams left out, another table or
    // column map): nothing can be said, and a repair would publish the
    // whole window again.
    if report.missing > 0
        && report.missing + report.unjudged == report.rows
        && ours_read == 0
        && !holds_any(&mut streams, &mine).await
    {
        return Err(Error::Config(format!(
            "none of the window's {} rows is in the streams read ({}), nor any message of this database from the window's start on, though the relay confirmed the window: it writes elsewhere, or these flags are not the relay's (--stream, --streams, --table, --columns, the context); audit with the relay's own settings (its environment)",
            report.rows,
            streams.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
        )));
    }
    let missing: Vec<(String, String, Option<bool>)> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT r.id, r.at::text, r.unpublished {holes} ORDER BY r.at, r.id LIMIT {MAX_LISTED}"
        )))
        .bind(&made)
        .fetch_all(&mut conn)
        .await
        .map_err(Error::pg("finding rows missing from the stream"))?;
    for (id, at, unpublished) in &missing {
        let marked = if *unpublished == Some(false) {
            " (marked published: sent by the worker the relay replaced, if older than the relay's first start)"
        } else {
            ""
        };
        report.findings.push(Finding {
            kind: "missing",
            id: id.clone(),
            detail: format!("row of {at} is not in the stream{marked}"),
        });
    }
    // A row marked published before the relay's first start was sent by
    // the worker it replaced: republished only when asked (review A5).
    let marked = missing.iter().filter(|(_, _, u)| *u == Some(false)).count();
    if cfg.repair && marked > 0 && !cfg.include_marked {
        report.notes.push(format!(
            "{marked} missing rows are marked published (sent by the worker the relay replaced, if older than its first start): not repaired; --include-marked repairs them too"
        ));
    }
    let mut missing: Vec<(String, String)> = missing
        .into_iter()
        .filter(|(_, _, u)| cfg.include_marked || *u != Some(false))
        .map(|(id, at, _)| (id, at))
        .collect();
    // A hole sent now lands after every event the stream holds: behind a
    // later event of its aggregate, consumers would see that aggregate's
    // events out of order (review A3). Such a hole is left, and said,
    // unless --repair-out-of-order. The streams were read to their end:
    // there were holes.
    if cfg.repair && !missing.is_empty() && keys.aggregate(None).is_some() {
        let ids: Vec<String> = missing.iter().map(|(id, _)| id.clone()).collect();
        // A message stored at or after the hole's time was committed
        // after it began: possibly after it, so the hole would follow it.
        sqlx::raw_sql("CREATE INDEX ON outbox_audit (aggregate, at)")
            .execute(&mut conn)
            .await
            .map_err(Error::pg("indexing the audit's aggregates"))?;
        let behind: Vec<(String,)> = sqlx::query_as(
            "SELECT r.id FROM outbox_audit_rows r WHERE r.id = ANY($1) \
               AND EXISTS (SELECT 1 FROM outbox_audit a \
                            WHERE a.aggregate = r.aggregate AND a.at >= r.at AND a.id <> r.id)",
        )
        .bind(&ids)
        .fetch_all(&mut conn)
        .await
        .map_err(Error::pg("finding later events of the holes' aggregates"))?;
        if !behind.is_empty() && !cfg.repair_out_of_order {
            for (id,) in behind.iter().take(MAX_LISTED as usize) {
                report.notes.push(format!(
                    "not repaired: {id}: the stream holds an event of its aggregate stored since its time, and a repair would put it after that (--repair-out-of-order sends it anyway)"
                ));
            }
            missing.retain(|(id, _)| !behind.iter().any(|(b,)| b == id));
        }
    }
    let twice = "FROM outbox_audit WHERE counted GROUP BY id HAVING count(*) > 1";
    report.duplicate = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM (SELECT id {twice}) d"
    )))
    .fetch_one(&mut conn)
    .await
    .map_err(Error::pg("counting ids stored more than once"))?;
    let duplicates: Vec<(String, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, count(*), string_agg(stream || ' seq ' || seq, ', ' ORDER BY stream, seq) \
         {twice} ORDER BY min(seq) LIMIT {MAX_LISTED}"
    )))
    .fetch_all(&mut conn)
    .await
    .map_err(Error::pg("finding ids stored more than once"))?;
    for (id, n, at) in duplicates {
        report.findings.push(Finding {
            kind: "duplicate",
            id,
            detail: format!("stored {n} times: {at}"),
        });
    }
    // A row of the window in the stream as a relay dead letter: accounted
    // for (not missing), but no consumer got it (issue 62: it was called
    // clean).
    let letters = "FROM outbox_audit a WHERE a.dlq_reason IS NOT NULL \
                   AND (a.counted OR EXISTS (SELECT 1 FROM outbox_audit_rows r WHERE r.id = a.id))";
    report.dead_lettered = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(DISTINCT a.id) {letters}"
    )))
    .fetch_one(&mut conn)
    .await
    .map_err(Error::pg("counting dead letters"))?;
    let listed: Vec<(String, String, i64, String, Option<String>)> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT a.id, a.stream, a.seq, a.dlq_reason, a.dlq_detail {letters} \
             ORDER BY a.stream, a.seq LIMIT {MAX_LISTED}"
        )))
        .fetch_all(&mut conn)
        .await
        .map_err(Error::pg("finding dead letters"))?;
    for (id, stream, seq, reason, detail) in listed {
        report.findings.push(Finding {
            kind: "dead_lettered",
            id,
            detail: format!(
                "{reason} (stream {stream} seq {seq}): {}",
                detail.as_deref().unwrap_or("no detail")
            ),
        });
    }
    // Messages committed after the snapshot (its WAL position `w`) have
    // rows the snapshot could not see: not judged. The row is looked up by
    // the table's key; a text id holding a UUID in another spelling, by
    // the relay's canonical form too.
    let a_row = if key_type == "text" {
        format!(
            "(EXISTS (SELECT 1 FROM {table} r WHERE {r_id} = a.key) \
              OR EXISTS (SELECT 1 FROM {table} r WHERE {sent_id} = a.id))"
        )
    } else {
        format!("EXISTS (SELECT 1 FROM {table} r WHERE {r_id} = a.key)")
    };
    let orphans = format!(
        "FROM outbox_audit a WHERE a.counted AND a.lsn < {} AND NOT {a_row}",
        w.0 as i64
    );
    // A commit is in the WAL (the relay may have published it) before it
    // is visible: with synchronous replication, until a standby answered
    // (review A12); pg_xact_status calls it in progress meanwhile. Each
    // count has a snapshot of its own, and the sessions of this database
    // waiting so are read after it: the counts are settled once two in a
    // row agree and no session waited after either. A commit invisible to
    // both waited throughout the time between them, and was seen waiting.
    // Else the audit waits (--wait) and, while one still waits, judges
    // no message without a row. A role sees other roles' sessions with
    // pg_read_all_stats.
    let count_orphans = format!(
        "SELECT count(DISTINCT a.id) FILTER (WHERE NOT a.emitted), \
                count(DISTINCT a.id) FILTER (WHERE a.emitted) {orphans}"
    );
    let waiting = "SELECT count(*) FROM pg_stat_activity \
                    WHERE wait_event = 'SyncRep' AND datname = current_database()";
    let deadline = Instant::now() + cfg.wait;
    let mut before: Option<(i64, i64)> = None;
    let (no_row, emitted, unseen) = loop {
        let (no_row, emitted): (i64, i64) =
            sqlx::query_as(sqlx::AssertSqlSafe(count_orphans.as_str()))
                .fetch_one(&mut conn)
                .await
                .map_err(Error::pg("counting messages without a row"))?;
        if no_row == 0 {
            break (no_row, emitted, 0);
        }
        let unseen: i64 = sqlx::query_scalar(waiting)
            .fetch_one(&mut conn)
            .await
            .map_err(Error::pg("looking for commits waiting for a standby"))?;
        if unseen == 0 && before == Some((no_row, 0)) {
            break (no_row, emitted, 0);
        }
        // Rows deleted all along (a cleanup job) move the count too.
        if Instant::now() >= deadline {
            break (no_row, emitted, unseen);
        }
        before = Some((no_row, unseen));
        tokio::time::sleep(Duration::from_millis(if unseen > 0 { 200 } else { 50 })).await;
    };
    if no_row > 0 && unseen == 0 {
        let sees_all: bool = sqlx::query_scalar(
            "SELECT pg_has_role('pg_read_all_stats', 'MEMBER') \
                 OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)",
        )
        .fetch_one(&mut conn)
        .await
        .map_err(Error::pg("reading the role's privileges"))?;
        if !sees_all {
            report.notes.push(
                "this role cannot see other roles' sessions waiting for a synchronous standby: a commit not visible yet would be counted among the messages without a row; grant it pg_read_all_stats".into(),
            );
        }
    }
    report.unverifiable = emitted;
    if no_row > 0 && unseen > 0 {
        report.unsettled = no_row;
        report.undecided = cfg.strict;
        report.notes.push(format!(
            "{no_row} messages have no row, while {unseen} transactions had committed but were not visible yet after --wait ({}): they wait for a synchronous standby; a row of one of them would be among these; not judged, audit again once they are",
            humantime::format_duration(cfg.wait)
        ));
    } else if cfg.strict {
        // A row deleted once published (a table kept empty, a cleanup
        // job, prune) cannot be told from a message that never had one:
        // counted apart, a finding with --strict only (review A7).
        report.no_row = no_row;
        let listed: Vec<(String, String, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT DISTINCT ON (a.id) a.id, a.stream, a.seq {orphans} AND NOT a.emitted \
             ORDER BY a.id, a.seq LIMIT {MAX_LISTED}"
        )))
        .fetch_all(&mut conn)
        .await
        .map_err(Error::pg("finding messages without a row"))?;
        for (id, stream, seq) in listed {
            report.findings.push(Finding {
                kind: "no_row",
                id,
                detail: format!(
                    "stream {stream} seq {seq}: no row of {}.{} has this id (deleted, or not this table's)",
                    rc.schema, rc.table
                ),
            });
        }
    } else {
        report.deleted = no_row;
    }
    metrics::counter!(m::AUDIT_HOLES).increment(report.missing as u64);

    if cfg.repair && !missing.is_empty() {
        // A repair that stops is said beside what the audit found (exit 1
        // with its findings), not in place of it.
        match repair(
            pool,
            &mut conn,
            js,
            cfg,
            &keys,
            &missing,
            system_id.as_deref(),
            &database,
        )
        .await
        {
            // A copy JetStream dropped (its duplicate window still holds
            // the id) is not a repair: said in a note, not counted.
            Ok(done) => {
                for (stored, what) in done {
                    if stored {
                        report.repaired.push(what);
                    } else {
                        report.notes.push(format!("not repaired: {what}"));
                    }
                }
            }
            Err(e) => report.notes.push(format!("the repair stopped: {e}")),
        }
    }
    // Its temporary tables go with it.
    let _ = sqlx::Connection::close(conn).await;
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Rows of the window that no message read so far holds, less those
/// marked published that are older than a stream made after --since (the
/// worker the relay replaced sent them; not judged, and not looked for).
async fn rows_lacking(conn: &mut sqlx::PgConnection, made: &str) -> Result<i64> {
    sqlx::query_scalar(
        "SELECT count(*) FROM outbox_audit_rows r \
          WHERE (r.at >= $1::timestamptz OR r.unpublished IS DISTINCT FROM false) \
            AND NOT r.dismissed AND NOT r.filtered \
            AND NOT EXISTS (SELECT 1 FROM outbox_audit a WHERE a.id = r.id)",
    )
    .bind(made)
    .fetch_one(conn)
    .await
    .map_err(Error::pg("counting rows not found yet"))
}

/// Without an index that leads with the window's column, the window is
/// found by reading the whole table, on every run (review A1).
async fn index_note(
    conn: &mut sqlx::PgConnection,
    rc: &RelayConfig,
    keys: &crate::ops::prune::Keys,
) -> Result<Option<String>> {
    let Some(column) = keys.occurred_column() else {
        return Ok(None);
    };
    let indexed: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_index i \
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] \
          WHERE i.indrelid = (quote_ident($1) || '.' || quote_ident($2))::regclass \
            AND a.attname = $3 AND i.indisvalid)",
    )
    .bind(&rc.schema)
    .bind(&rc.table)
    .bind(column)
    .fetch_one(conn)
    .await
    .map_err(Error::pg("reading the table's indexes"))?;
    Ok((!indexed).then(|| {
        format!(
            "no index of {}.{} leads with {column}: the window was found by reading the whole table, as it will be on every run; CREATE INDEX CONCURRENTLY ON {}.{} ({}) makes the audit's cost follow the window",
            rc.schema,
            rc.table,
            quote(&rc.schema),
            quote(&rc.table),
            quote(column)
        )
    }))
}

/// What one read of a stream covered.
#[derive(Debug, Default)]
struct Span {
    /// The first sequence read.
    first: Option<u64>,
    /// The first sequence left unread, past the read's time bound.
    next: Option<u64>,
}

/// Says, on a long run, how far the reading has come (stderr: a report
/// on stdout stays whole).
struct Progress {
    last: Instant,
    read: u64,
}

impl Progress {
    const EVERY: Duration = Duration::from_secs(10);

    fn new() -> Self {
        Progress {
            last: Instant::now(),
            read: 0,
        }
    }

    fn tick(&mut self, name: &str, seq: u64, last: u64) {
        self.read += 1;
        if self.last.elapsed() >= Self::EVERY {
            self.last = Instant::now();
            eprintln!(
                "audit: {} messages read; stream {name} at sequence {seq} of {last}",
                self.read
            );
        }
    }
}

/// Reads stream messages' headers into the audit's temporary table.
struct Reader<'a> {
    since: OffsetDateTime,
    until: OffsetDateTime,
    /// Whether a message's `Outbox-Source` is this relay's.
    mine: &'a dyn Fn(&str) -> bool,
    /// A message id in the table's key type, as COPY text.
    key_of: &'a dyn Fn(&str) -> Option<String>,
    /// This relay's messages read, in the window or not.
    ours_read: u64,
    /// Commit order, checked as read: the newest position per stream and
    /// source.
    newest: HashMap<(String, String), Position>,
    progress: Progress,
}

impl Reader<'_> {
    /// Read `stream` from `from` to sequence `to` (or its end), stopping
    /// before the first message stored after `stop`.
    #[allow(clippy::too_many_arguments)]
    async fn read(
        &mut self,
        conn: &mut sqlx::PgConnection,
        stream: &mut jetstream::stream::Stream,
        name: &str,
        from: jetstream::consumer::DeliverPolicy,
        to: u64,
        stop: Option<OffsetDateTime>,
        check_order: bool,
        report: &mut Report,
    ) -> Result<Span> {
        let rfc = |t: OffsetDateTime| {
            t.format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default()
        };
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                headers_only: true,
                deliver_policy: from,
                ..Default::default()
            })
            .await
            .map_err(Error::nats(format!("reading stream {name}")))?;
        let mut messages = consumer
            .messages()
            .await
            .map_err(Error::nats(format!("reading stream {name}")))?;
        // COPY a megabyte at a time: a statement per chunk, none held open
        // while the stream is read.
        let mut buf = String::with_capacity(CHUNK + 1024);
        let mut span = Span::default();
        loop {
            let msg = match tokio::time::timeout(Duration::from_secs(30), messages.next()).await {
                Ok(Some(Ok(msg))) => msg,
                Ok(Some(Err(e))) => return Err(Error::nats(format!("reading stream {name}"))(e)),
                Ok(None) => break,
                Err(_) => {
                    return Err(Error::setup(format!(
                        "stream {name} stopped answering while read"
                    )))
                }
            };
            let info = msg.info().map_err(|source| Error::Nats {
                context: format!("reading stream {name}"),
                source,
            })?;
            // The last message may be gone (deleted): nothing pending ends
            // the read too.
            let (seq, done) = (info.stream_sequence, info.pending == 0);
            if seq > to {
                break;
            }
            if stop.is_some_and(|t| info.published > t) {
                span.next = Some(seq);
                break;
            }
            span.first.get_or_insert(seq);
            self.progress.tick(name, seq, to);
            if let Some(h) = msg.headers.as_ref() {
                let get = |k: &str| h.get(k).map(|v| v.as_str());
                let source = get(wire::SOURCE).unwrap_or("");
                let occurred = get(wire::OCCURRED_AT).and_then(|t| {
                    OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
                });
                let in_window = occurred.is_some_and(|t| t >= self.since && t < self.until);
                let ours = (self.mine)(source) && get(wire::DLQ_CONSUMER).is_none();
                self.ours_read += u64::from(ours);
                if let (true, Some(id)) = (ours, get(wire::MSG_ID)) {
                    let emitted = get(wire::EMITTED).is_some();
                    // Streamed events only: a backfill's or a repair's have
                    // no WAL position.
                    let pos = Position::from_headers(get);
                    let streamed = pos.filter(|p| p.commit_lsn != Lsn::ZERO);
                    if let (true, true, Some(p)) = (in_window, check_order, streamed) {
                        let key = (name.to_owned(), source.to_owned());
                        match self.newest.get_mut(&key) {
                            Some(prev) if p < *prev => {
                                report.out_of_order += 1;
                                if report.out_of_order <= MAX_LISTED {
                                    report.findings.push(Finding {
                                        kind: "out_of_order",
                                        id: id.to_owned(),
                                        detail: format!(
                                            "stream {name} seq {seq}: WAL position {}#{} after {}#{}",
                                            p.commit_lsn, p.index, prev.commit_lsn, prev.index
                                        ),
                                    });
                                }
                            }
                            Some(prev) => *prev = p,
                            None => {
                                self.newest.insert(key, p);
                            }
                        }
                    }
                    // For a repair, an aggregate's events after the window
                    // too: a hole is not sent behind a later event of its
                    // aggregate. When the stream stored it: after its
                    // commit, so after the time of every row committed
                    // before it.
                    let text = |v: Option<&str>| v.map_or_else(|| "\\N".to_owned(), copy_text);
                    let lsn = pos.map_or(0, |p| p.commit_lsn.0);
                    let _ = writeln!(
                        buf,
                        "{}\t{seq}\t{}\t{}\t{}\t{emitted}\t{}\t{in_window}\t{}\t{}\t{}\t{}",
                        copy_text(name),
                        copy_text(id),
                        text((self.key_of)(id).as_deref()),
                        copy_text(source),
                        lsn as i64,
                        text(get(wire::AGGREGATE_ID)),
                        rfc(info.published),
                        text(get(wire::DLQ_REASON)),
                        text(get(wire::DLQ_DETAIL)),
                    );
                }
            }
            if buf.len() >= CHUNK {
                copy_rows(conn, &mut buf).await?;
            }
            if seq >= to || done {
                break;
            }
        }
        copy_rows(conn, &mut buf).await?;
        Ok(span)
    }
}

/// COPY what `buf` holds into the audit's table, in one statement.
async fn copy_rows(conn: &mut sqlx::PgConnection, buf: &mut String) -> Result<()> {
    if buf.is_empty() {
        return Ok(());
    }
    let mut copy = conn
        .copy_in_raw("COPY outbox_audit FROM STDIN")
        .await
        .map_err(Error::pg("copying the stream's ids"))?;
    copy.send(buf.as_bytes())
        .await
        .map_err(Error::pg("copying the stream's ids"))?;
    copy.finish()
        .await
        .map_err(Error::pg("copying the stream's ids"))?;
    buf.clear();
    Ok(())
}

/// A row's id as the relay sends it, from its SQL `id`: a text id holding
/// a UUID goes as that UUID's canonical text.
fn sent_id_sql(keys: &crate::ops::prune::Keys, id: &str) -> String {
    if keys.id_type == "uuid" || keys.id_type.starts_with("int") {
        format!("{id}::text")
    } else {
        format!(
            "CASE WHEN {id} ~* '^[0-9a-f]{{8}}-?[0-9a-f]{{4}}-?[0-9a-f]{{4}}-?[0-9a-f]{{4}}-?[0-9a-f]{{12}}$' \
             THEN {id}::uuid::text ELSE {id}::text END"
        )
    }
}

/// The rows the relay's first start takes for unpublished (`--unpublished`,
/// else `published_at IS NULL` where that column exists), as SQL over the
/// table's columns.
async fn unpublished_rows(pool: &PgPool, rc: &RelayConfig) -> Result<String> {
    if let Some(predicate) = &rc.unpublished {
        return Ok(predicate.clone());
    }
    let columns = crate::postgres::provision::table_columns(pool, &rc.schema, &rc.table).await?;
    Ok(if columns.iter().any(|(name, _)| name == "published_at") {
        "published_at IS NULL".into()
    } else {
        "true".into()
    })
}

/// Add this run's holes to `outbox_audit_holes_total` in a Prometheus text
/// file, so the counter grows across runs (a cron job's process is gone
/// before any scrape); the findings of the last run beside it.
/// `report` is `None` for a run that could not say (exit 2): the file
/// says so (`outbox_audit_last_run_ok 0`) and keeps the last good run's
/// figures, so an alert on audits that stopped succeeding fires.
pub fn write_metrics(path: &std::path::Path, report: Option<&Report>) -> Result<()> {
    let old = std::fs::read_to_string(path).unwrap_or_default();
    let kept = |name: &str| -> Option<i64> {
        old.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
    };
    let before = kept(m::AUDIT_HOLES).unwrap_or(0);
    let now = OffsetDateTime::now_utc().unix_timestamp();
    let (holes, findings, ok, succeeded) = match report {
        Some(r) => (before + r.missing, r.findings_count(), 1, now),
        None => (
            before,
            kept("outbox_audit_findings").unwrap_or(0),
            0,
            kept("outbox_audit_last_success_timestamp_seconds").unwrap_or(0),
        ),
    };
    let text = format!(
        "# HELP {h} Outbox rows outbox-relay audit found missing from the stream.\n# TYPE {h} counter\n{h} {holes}\n\
         # HELP outbox_audit_findings Findings of the last audit run that could say.\n# TYPE outbox_audit_findings gauge\noutbox_audit_findings {findings}\n\
         # HELP outbox_audit_last_run_timestamp_seconds When the last audit run ended.\n# TYPE outbox_audit_last_run_timestamp_seconds gauge\noutbox_audit_last_run_timestamp_seconds {now}\n\
         # HELP outbox_audit_last_run_ok 1 when the last audit run could say (exit 0 or 1), 0 when it could not (exit 2).\n# TYPE outbox_audit_last_run_ok gauge\noutbox_audit_last_run_ok {ok}\n\
         # HELP outbox_audit_last_success_timestamp_seconds When an audit run last could say (exit 0 or 1).\n# TYPE outbox_audit_last_success_timestamp_seconds gauge\noutbox_audit_last_success_timestamp_seconds {succeeded}\n",
        h = m::AUDIT_HOLES,
    );
    // Written whole, then renamed: a scrape never reads half a file, and
    // two runs at once (an overlapping cron) never write one temporary
    // file together.
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| Error::Config(format!("writing {}: {e}", path.display())))
}

/// Whether a stream read holds a message `mine` takes at its head or its
/// tail: a window lost whole (a crash of the server holding it, with no
/// traffic since) is a loss to report, not flags to refuse.
async fn holds_any(
    streams: &mut [(String, jetstream::stream::Stream)],
    mine: &impl Fn(&str) -> bool,
) -> bool {
    for (name, stream) in streams.iter_mut() {
        let Ok((state, _)) = state_of(stream, name).await else {
            continue;
        };
        for seq in [state.first_sequence, state.last_sequence] {
            if seq == 0 {
                continue;
            }
            if let Ok(m) = stream.get_raw_message(seq).await {
                if m.headers
                    .get(wire::SOURCE)
                    .is_some_and(|s| mine(s.as_str()))
                {
                    return true;
                }
            }
        }
    }
    false
}

/// A stream's state, and when it was made.
async fn state_of(
    stream: &mut jetstream::stream::Stream,
    name: &str,
) -> Result<(jetstream::stream::State, OffsetDateTime)> {
    let info = stream
        .info()
        .await
        .map_err(Error::nats(format!("reading stream {name}")))?;
    Ok((info.state.clone(), info.created))
}

/// How far back a stream holds what it was sent (review A9).
#[derive(Debug, PartialEq, Eq)]
enum Reach {
    /// Everything from the window's start on.
    Holds,
    /// Nothing was ever removed from its head, but it was made at this
    /// time (new, or deleted and made again): it holds nothing from
    /// before.
    From(OffsetDateTime),
    /// Messages of the window were removed from its head (expired,
    /// purged, deleted): it holds from this time, or nothing at all.
    Short(Option<OffsetDateTime>),
}

fn reach(
    state: &jetstream::stream::State,
    created: OffsetDateTime,
    since: OffsetDateTime,
) -> Reach {
    let removed = state.first_sequence > 1 || (state.messages == 0 && state.last_sequence > 0);
    match (removed, state.messages) {
        (false, _) => Reach::From(created),
        // Emptied: all right only if all it ever held predates the window.
        (true, 0) if state.last_timestamp < since => Reach::Holds,
        (true, 0) => Reach::Short(None),
        (true, _) if state.first_timestamp <= since => Reach::Holds,
        (true, _) => Reach::Short(Some(state.first_timestamp)),
    }
}

/// A value in COPY's text format.
fn copy_text(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('\t', "\\t")
        .replace('\n', "\\n")
        .replace('\r', "\\r")
}

/// A SQL identifier, quoted.
use postgres_protocol::escape::escape_identifier as quote;

/// Publish the missing rows again, as the relay would route them now, in
/// (occurred_at, id) order, each acked before the next; marked
/// `Outbox-Repair` so no relay takes one for the tail of its own.
#[allow(clippy::too_many_arguments)]
async fn repair(
    pool: &PgPool,
    conn: &mut sqlx::PgConnection,
    js: &Context,
    cfg: &AuditConfig,
    keys: &crate::ops::prune::Keys,
    missing: &[(String, String)],
    system_id: Option<&str>,
    database: &str,
) -> Result<Vec<(bool, String)>> {
    let rc = &cfg.relay;
    let columns = crate::postgres::provision::table_columns(pool, &rc.schema, &rc.table).await?;
    let relation = crate::relay::backfill::text_relation(&rc.schema, &rc.table, &columns);
    let table = format!("{}.{}", rc.schema, rc.table);
    let extra = rc
        .columns
        .check(
            &table,
            &columns,
            &rc.template.roles(),
            &rc.template.columns(),
            &rc.header_columns,
            &rc.streams,
        )
        .map_err(Error::setup)?;
    let own = js
        .get_stream(&rc.stream)
        .await
        .map_err(Error::nats("reading the relay's stream"))?
        .cached_info()
        .config
        .clone();
    // A message must fit the server and the stream it goes to, as the
    // relay sizes it (review A13: a row over the stream's limit was sent
    // whole, and refused).
    let mut max_payload = js.client().server_info().max_payload.min(
        usize::try_from(own.max_message_size)
            .ok()
            .filter(|m| *m > 0)
            .unwrap_or(usize::MAX),
    );
    let own = own.subjects;
    let source = wire::source_id(system_id.unwrap_or("unknown"), 0, database, REPAIR_SLOT);
    let mut router = Router::new(
        &rc.context,
        rc.template.clone(),
        rc.partitions,
        rc.envelope,
        source,
        own,
    )
    .with_schemas(rc.schemas.clone())
    .with_columns(extra.clone(), &rc.header_columns);
    if !rc.streams.is_empty() {
        let (streams, largest, _) =
            crate::relay::publish::routed_streams(js, &rc.streams, &rc.stream).await?;
        router = router.with_streams(std::sync::Arc::new(streams));
        max_payload = max_payload.min(largest.unwrap_or(usize::MAX));
    }
    let layout = OutboxLayout::new(&relation, &rc.columns, router.columns())
        .map_err(|e| Error::setup(e.to_string()))?;
    let select = columns
        .iter()
        .map(|(name, _)| crate::relay::backfill::tuple_text(name))
        .collect::<Vec<_>>()
        .join(", ");
    let ids: Vec<String> = missing.iter().map(|(id, _)| id.clone()).collect();
    // By the table's key; a text id by its form as sent (a text UUID in
    // canonical form), as found.
    let id = keys.id(None);
    let by_id = match keys.id_type {
        t @ ("uuid" | "int8" | "int4") => format!("{id} = ANY($1::text[]::{t}[])"),
        _ => format!("{} = ANY($1)", sent_id_sql(keys, &id)),
    };
    let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {select} FROM {}.{} WHERE {by_id} ORDER BY {}, {id}",
        quote(&rc.schema),
        quote(&rc.table),
        keys.occurred_at(None),
    )))
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await
    .map_err(Error::pg("reading the rows to repair"))?;
    // A row over the limit is dead-lettered by routing.
    let max_payload = max_payload.saturating_sub(crate::relay::publish::HEADER_RESERVE);
    let render = |values: &[crate::relay::pgoutput::Value], index: usize| {
        let pos = Position {
            commit_lsn: Lsn::ZERO,
            index: index as u32,
        };
        match layout.row(values) {
            Ok(r) => router.route_committed(r, pos, None, max_payload),
            Err(e) => router.bad_row(layout.id(values), pos, &e.to_string()),
        }
    };

    // Before anything is sent: do these flags route as the relay did?
    // Messages of this relay whose rows are still in the table, rendered
    // again, must come out as they were stored (review A4: a repair run
    // from a shell without the relay's template, envelope, schemas or
    // streams sent holes where no consumer looked).
    let sample: Vec<(String, String, i64)> = sqlx::query_as(
        "SELECT a.id, a.stream, a.seq FROM outbox_audit a \
          WHERE a.dlq_reason IS NULL AND NOT a.emitted AND a.source NOT LIKE '%/' || $1 \
          ORDER BY a.seq DESC LIMIT 50",
    )
    .bind(REPAIR_SLOT)
    .fetch_all(&mut *conn)
    .await
    .map_err(Error::pg("choosing messages to check the routing with"))?;
    let sample_ids: Vec<String> = sample.iter().map(|(id, _, _)| id.clone()).collect();
    let present = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT {select} FROM {}.{} WHERE {by_id} LIMIT 20",
        quote(&rc.schema),
        quote(&rc.table),
    )))
    .bind(&sample_ids)
    .fetch_all(&mut *conn)
    .await
    .map_err(Error::pg("reading rows to check the routing with"))?;
    if present.is_empty() {
        return Err(Error::Config(
            "no message of this relay whose row is still in the table to check the routing with: nothing repaired (audit a window that holds some)".into(),
        ));
    }
    let mut compared = 0;
    for row in &present {
        let values = crate::relay::backfill::text_values(row, columns.len());
        let now = render(&values, 0);
        let Some((_, stream, seq)) = sample.iter().find(|(id, _, _)| *id == now.msg_id) else {
            continue;
        };
        // Removed since it was read (limits, a delete): another will do.
        let Ok(stored) = js
            .get_stream(stream)
            .await
            .map_err(Error::nats(format!("reading stream {stream}")))?
            .get_raw_message(*seq as u64)
            .await
        else {
            continue;
        };
        compared += 1;
        let headers: Vec<(String, String)> = stored
            .headers
            .iter()
            .flat_map(|(k, vs)| vs.iter().map(move |v| (k.to_string(), v.to_string())))
            .collect();
        let own = now.stream.as_deref().unwrap_or(&rc.stream);
        if let Some(why) = routing_differs(&stored.subject, &headers, stream, &now, own) {
            return Err(Error::Config(format!(
                "these flags do not route as the relay did: {} ({why}); run the audit with the relay's own settings (its environment: template, envelope, schemas, header columns, streams); nothing repaired",
                now.msg_id
            )));
        }
    }

    if compared == 0 {
        return Err(Error::Config(
            "no message of this relay could be compared with its row to check the routing: nothing repaired (audit a window whose rows the stream holds too)".into(),
        ));
    }

    let mut sent = Vec::new();
    for (index, row) in rows.iter().enumerate() {
        let values = crate::relay::backfill::text_values(row, columns.len());
        let msg = render(&values, index);
        // A row whose id cannot be a message id is dead-lettered under a
        // position of its own: never its id, so the hole would stay and
        // each run add one more dead letter (review A13).
        // A stream these flags do not know (a --streams left out): the
        // relay published it there, or dead-letters it itself.
        if msg.dlq_reason == Some(wire::DlqReason::StreamMissing) {
            sent.push((
                false,
                format!(
                    "{}: routed to a stream these flags do not list (pass the relay's --streams)",
                    msg.msg_id
                ),
            ));
            continue;
        }
        if !ids.contains(&msg.msg_id) {
            sent.push((
                false,
                format!(
                    "a row of the window ({}): its id cannot be a message id, and the relay dead-letters it",
                    msg.msg_id
                ),
            ));
            continue;
        }
        let mut headers = async_nats::HeaderMap::new();
        for (k, v) in &msg.headers {
            headers.append(k.as_ref(), v.as_str());
        }
        headers.insert(wire::REPAIR, "audit");
        // A publish that fails ends the repair, said with what it sent
        // before (it returned an error, and those went unsaid).
        let ack = match js
            .publish_with_headers(msg.subject.clone(), headers, msg.body.clone())
            .await
        {
            Ok(ack) => ack.await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let ack = match ack {
            Ok(ack) => ack,
            Err(e) => {
                sent.push((
                    false,
                    format!(
                        "{}: publishing it failed ({e}); the repair stopped there, {} rows left",
                        msg.msg_id,
                        rows.len() - index - 1
                    ),
                ));
                break;
            }
        };
        sent.push(if ack.duplicate {
            // Deleted inside the duplicate window: JetStream dropped the copy.
            (
                false,
                format!(
                    "{}: not stored, the stream's duplicate window still holds its id; repair again once it passed",
                    msg.msg_id
                ),
            )
        } else {
            (
                true,
                format!(
                    "{} published again as {} (stream {}, seq {})",
                    msg.msg_id, msg.subject, ack.stream, ack.sequence
                ),
            )
        });
    }
    Ok(sent)
}

/// Headers that differ between two publishes of one row by the same
/// settings: where and when it was read, and the publish's own.
fn volatile(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.starts_with(wire::NATS_HEADER_PREFIX)
        || n.starts_with("outbox-backfill")
        || n.starts_with("outbox-txn-")
        || [
            wire::TRACEPARENT,
            wire::COMMIT_LSN,
            wire::SOURCE,
            wire::XID_HORIZON,
            wire::REPAIR,
            wire::EMITTED,
        ]
        .iter()
        .any(|v| v.eq_ignore_ascii_case(&n))
}

/// Why a row's message as stored (`subject`, `headers`, in `stream`) is
/// not what routing it again gives (`now`, to `now_stream`); `None` when
/// it is, but for the headers of the publish itself.
fn routing_differs(
    subject: &str,
    headers: &[(String, String)],
    stream: &str,
    now: &crate::relay::route::OutMessage,
    now_stream: &str,
) -> Option<String> {
    if subject != now.subject {
        return Some(format!("stored as {subject}, now {}", now.subject));
    }
    if stream != now_stream {
        return Some(format!("stored in stream {stream}, now {now_stream}"));
    }
    // A schema is named with its file's digest: an edit of the file (a
    // SIGHUP since) is the same routing.
    let kept = |h: &mut Vec<(String, String)>| {
        h.retain(|(k, _)| !volatile(k));
        for (k, v) in h.iter_mut() {
            k.make_ascii_lowercase();
            if k == &wire::SCHEMA.to_ascii_lowercase() {
                if let Some((path, _)) = v.split_once("#sha256-") {
                    *v = path.to_owned();
                }
            }
        }
        h.sort();
        h.clone()
    };
    let was = kept(&mut headers.to_vec());
    let is = kept(
        &mut now
            .headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    );
    if was == is {
        return None;
    }
    let first = was
        .iter()
        .find(|h| !is.contains(h))
        .or_else(|| is.iter().find(|h| !was.contains(h)))
        .map(|(k, _)| k.clone())
        .unwrap_or_default();
    let value = |hs: &[(String, String)]| {
        hs.iter()
            .find(|(k, _)| *k == first)
            .map_or_else(|| "none".to_owned(), |(_, v)| v.clone())
    };
    Some(format!(
        "header {first}: stored {}, now {}",
        value(&was),
        value(&is)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_reaches_back_only_as_far_as_nothing_was_removed() {
        let t = |s: i64| OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(s);
        let state = |first: u64, last: u64, messages: u64, first_ts: i64, last_ts: i64| {
            let mut st: jetstream::stream::State = serde_json::from_value(serde_json::json!({
                "messages": messages, "bytes": 0, "first_seq": first,
                "first_ts": "1970-01-01T00:00:00Z", "last_seq": last,
                "last_ts": "1970-01-01T00:00:00Z", "consumer_count": 0,
            }))
            .unwrap();
            st.first_timestamp = t(first_ts);
            st.last_timestamp = t(last_ts);
            st
        };
        let since = t(1000);
        // Whole since it was made: judged from then.
        assert_eq!(
            reach(&state(1, 10, 10, 900, 1100), t(800), since),
            Reach::From(t(800))
        );
        assert_eq!(
            reach(&state(1, 10, 10, 1200, 1300), t(1150), since),
            Reach::From(t(1150))
        );
        // Head removed, still reaching back.
        assert_eq!(
            reach(&state(5, 10, 6, 990, 1100), t(0), since),
            Reach::Holds
        );
        assert_eq!(
            reach(&state(5, 10, 6, 1010, 1100), t(0), since),
            Reach::Short(Some(t(1010)))
        );
        // Purged after holding the window: nothing to say.
        assert_eq!(
            reach(&state(11, 10, 0, 0, 1100), t(0), since),
            Reach::Short(None)
        );
        // Emptied of what predates the window only.
        assert_eq!(reach(&state(11, 10, 0, 0, 900), t(0), since), Reach::Holds);
        // Never held anything.
        assert_eq!(
            reach(&state(0, 0, 0, 0, 0), t(1200), since),
            Reach::From(t(1200))
        );
    }

    #[test]
    fn routing_differs_on_subject_stream_or_a_lasting_header_only() {
        let now = crate::relay::route::OutMessage {
            subject: "shop.order.placed".into(),
            msg_id: "a".into(),
            headers: vec![
                (wire::MSG_ID.into(), "a".into()),
                (wire::EVENT_TYPE.into(), "placed".into()),
                (wire::COMMIT_LSN.into(), "0/0".into()),
            ],
            body: Default::default(),
            dlq_reason: None,
            stream: None,
        };
        let h = |pairs: &[(&str, &str)]| -> Vec<(String, String)> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        // The publish's own headers (position, source, expectations) and
        // the names' case differ; the routing does not.
        let stored = h(&[
            ("Nats-Msg-Id", "a"),
            ("outbox-event-type", "placed"),
            (wire::COMMIT_LSN, "0/16B3748"),
            (wire::SOURCE, "1/0/db/slot"),
            (wire::EXPECTED_LAST_MSG_ID, "z"),
        ]);
        assert_eq!(
            routing_differs("shop.order.placed", &stored, "S", &now, "S"),
            None
        );
        assert!(
            routing_differs("shop.event.placed.v1", &stored, "S", &now, "S")
                .is_some_and(|w| w.contains("shop.event.placed.v1"))
        );
        assert!(
            routing_differs("shop.order.placed", &stored, "T", &now, "S")
                .is_some_and(|w| w.contains("stream T"))
        );
        let mut enveloped = stored.clone();
        enveloped.push((wire::ENVELOPE.into(), "cloudevents".into()));
        assert_eq!(
            routing_differs("shop.order.placed", &enveloped, "S", &now, "S").as_deref(),
            Some("header outbox-envelope: stored cloudevents, now none")
        );
    }

    #[test]
    fn copy_text_escapes_what_copy_reads_specially() {
        assert_eq!(copy_text("a\tb\\c\nd"), "a\\tb\\\\c\\nd");
        assert_eq!(copy_text("plain-id"), "plain-id");
    }

    #[test]
    fn the_summary_counts_each_kind() {
        let r = Report {
            rows: 3,
            messages: 2,
            missing: 1,
            findings: vec![Finding {
                kind: "missing",
                id: "a".into(),
                detail: "row".into(),
            }],
            ..Report::default()
        };
        let lines = r.lines();
        assert_eq!(lines[0], "missing a row");
        assert!(lines[1].contains("1 missing, 0 duplicate"), "{}", lines[1]);
        assert!(!r.clean());
    }
}
