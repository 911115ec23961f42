//! The publication the relay keeps, so that editing `--publication` while
//! the relay streams loses nothing.
//!
//! pgoutput sends a row only if a publication the session names published
//! its table *when the row was written*, read through the catalog as of
//! that WAL position: rows written while the outbox was out of the
//! publication (`ALTER PUBLICATION … DROP TABLE`, then `ADD TABLE`) never
//! reach the slot, not even when read again, and only the table still has
//! them; published from there they would come after the rows written
//! since. So the relay makes `{slot}_keep` for the outbox's inserts
//! alone, which nobody has a reason to edit, and the session streams
//! through it instead of the operator's. Not beside it: a publication the
//! session names that is dropped fails decoding (`publication "…" does not
//! exist`, up to PostgreSQL 17) for all the WAL written until it is made
//! again, and the kept one carries every row anyway.
//!
//! For the same reason a publication cannot be named for WAL written before
//! it existed, so its comment records the WAL position after it was made,
//! and a slot streams through it once the slot's `restart_lsn` (the oldest
//! WAL it may decode again) has passed that: at once for a slot made after
//! it, within a confirm and a running-transactions record for an older one
//! (until then through `--publication`).
//!
//! Where the operator's publication filters the outbox (a row filter, a
//! column list, generated columns published), an unfiltered one would
//! publish more: none is kept, and an edit stops the relay as before
//! (`relay/guard.rs`).

use pgwire_replication::Lsn;
use sha2::{Digest, Sha256};
use std::sync::Mutex;

use sqlx::PgPool;

use super::{db_code, parse_lsn};
use crate::error::{Error, Result};

/// Where the comment records the position the publication was made at.
const FROM: &str = "in the slot from WAL position ";

/// The publication kept for `slot`: `{slot}_keep` (one slot, one relay's
/// stream: relays sharing `--publication` keep one each), or, for a name
/// too long for that, one shortened with a hash of the whole (a
/// publication name has at most 63 bytes).
pub fn name(slot: &str) -> String {
    const SUFFIX: &str = "_keep";
    if slot.len() + SUFFIX.len() <= 63 {
        return format!("{slot}{SUFFIX}");
    }
    let hash = Sha256::digest(slot.as_bytes());
    let short: String = hash[..4].iter().map(|b| format!("{b:02x}")).collect();
    // 49 + 1 + 8 + 5 = 63; the names are ASCII (validated at config load).
    format!("{}_{short}{SUFFIX}", &slot[..49])
}

/// What the session can do with the kept publication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kept {
    /// None: the operator's publication filters the outbox, this role may
    /// not make one, or it no longer publishes the outbox (said once, at
    /// start).
    None,
    /// Streamed through: the slot has passed its making.
    Now(String),
    /// Not yet: the slot may still decode WAL written before it was made.
    /// The session streams through `--publication` and starts over once
    /// the slot's `restart_lsn` passes `ready`.
    Later { name: String, ready: Lsn },
}

impl Kept {
    /// The publication a session streams through instead of the
    /// operator's, if any.
    pub fn streamed(&self) -> Option<&str> {
        match self {
            Kept::Now(name) => Some(name),
            _ => None,
        }
    }
}

/// Whether `publication` publishes the outbox's rows filtered: a row
/// filter or a column list for it (PostgreSQL 15+), or generated columns
/// (18+). `to_jsonb`: one statement reads whichever columns the server has.
pub async fn filters(pool: &PgPool, publication: &str, schema: &str, table: &str) -> Result<bool> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_publication p \
           WHERE p.pubname = $1 AND ( \
             coalesce(to_jsonb(p) ->> 'pubgencols', 'n') NOT IN ('n', 'false') \
             OR EXISTS (SELECT 1 FROM pg_publication_rel pr \
                        WHERE pr.prpubid = p.oid \
                          AND pr.prrelid = to_regclass(format('%I.%I', $2::text, $3::text)) \
                          AND (to_jsonb(pr) ->> 'prqual' IS NOT NULL \
                               OR to_jsonb(pr) ->> 'prattrs' IS NOT NULL))))",
    )
    .bind(publication)
    .bind(schema)
    .bind(table)
    .fetch_one(pool)
    .await
    .map_err(Error::pg("reading the publication's filters"))
}

/// Where the comment records the outbox's membership row of the
/// publication when that position was taken (after a `; `: a slot or table
/// name may end in "membership").
const MEMBERSHIP: &str = "; membership ";

/// The position a kept publication's comment records, if it does, and the
/// membership row it was taken for.
fn ready_from(comment: Option<&str>) -> Option<(Lsn, &str)> {
    let comment = comment?;
    let rest = comment.split_once(FROM)?.1;
    let word = rest.split_whitespace().next()?;
    let ready = Lsn::parse(word.trim_end_matches('.')).ok()?;
    let membership = comment
        .rsplit_once(MEMBERSHIP)?
        .1
        .split(|c: char| c == ';' || c.is_whitespace())
        .next()?;
    Some((ready, membership))
}

/// The comment a kept publication carries: the WAL position from which it
/// publishes the outbox, and the membership row it was taken for (the
/// table dropped from it and added again is a new row, from a later
/// position).
fn comment(slot: &str, schema: &str, table: &str, membership: &str, ready: Lsn) -> String {
    format!(
        "outbox-relay: slot {slot} streams the inserts of {schema}.{table} through this publication, so that an edit of --publication loses nothing{MEMBERSHIP}{membership}; {FROM}{ready}. Drop it only with the relay stopped (it is made again); never add the table back by hand"
    )
}

/// What this process said of the kept publication (a relay retries its
/// session every 30 s while halted: each said once).
static SAID: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

fn once(what: &'static str, say: impl FnOnce()) {
    let first = SAID.lock().map_or(true, |mut said| {
        let first = !said.contains(&what);
        said.push(what);
        first
    });
    if first {
        say();
    }
}

/// The kept publication's comment and the outbox's membership row of it
/// (`""`: none), if it exists.
async fn look(
    pool: &PgPool,
    kept: &str,
    schema: &str,
    table: &str,
) -> Result<Option<(Option<String>, String)>> {
    sqlx::query_as(
        "SELECT obj_description(p.oid, 'pg_publication'), \
                coalesce((SELECT string_agg(pr.oid::text, ',' ORDER BY pr.oid) FROM pg_publication_rel pr \
                          WHERE pr.prpubid = p.oid \
                            AND pr.prrelid = to_regclass(format('%I.%I', $2::text, $3::text))), '') \
         FROM pg_publication p WHERE p.pubname = $1",
    )
    .bind(kept)
    .bind(schema)
    .bind(table)
    .fetch_optional(pool)
    .await
    .map_err(Error::pg("looking up the kept publication"))
}

/// Make sure the publication kept for `slot` exists and says from which
/// WAL position it publishes the outbox: its name and that position, or
/// `None` where none is kept. Made when missing and permitted; otherwise
/// one warning says what to run, and the relay streams through
/// `--publication`.
pub async fn ensure(
    pool: &PgPool,
    publication: &str,
    slot: &str,
    schema: &str,
    table: &str,
    standby: bool,
) -> Result<Option<(String, Lsn)>> {
    let kept = name(slot);
    if filters(pool, publication, schema, table).await? {
        once("filters", || {
            tracing::info!(
            publication,
            "the publication filters the outbox's rows or columns: the relay keeps no publication of its own (an unfiltered one would publish more) and streams through this one, so an edit of it while the relay streams stops the relay"
        )
        });
        return Ok(None);
    }
    let create = format!(
        "CREATE PUBLICATION {kept} FOR TABLE \"{}\".\"{}\" WITH (publish = 'insert', publish_via_partition_root = true)",
        schema.replace('"', "\"\""),
        table.replace('"', "\"\"")
    );
    let found = match look(pool, &kept, schema, table).await? {
        Some(found) => found,
        None if standby => {
            once(
                "standby",
                || tracing::info!(publication = %kept, "no kept publication, and a standby cannot make one: the relay streams through --publication (an edit of it then stops the relay); start a relay on the primary once, or run there: {create};"),
            );
            return Ok(None);
        }
        None => {
            // Asked first: a refused CREATE is an ERROR in the server's log
            // at every start.
            let may: bool = sqlx::query_scalar(
                "SELECT coalesce(bool_and(pg_has_role(c.relowner, 'USAGE')), false) \
                        AND has_database_privilege(current_database(), 'CREATE') \
                 FROM pg_class c WHERE c.oid = to_regclass(format('%I.%I', $1::text, $2::text))",
            )
            .bind(schema)
            .bind(table)
            .fetch_one(pool)
            .await
            .map_err(Error::pg("checking who may make the kept publication"))?;
            let refused = || {
                once(
                    "refused",
                    || tracing::warn!(publication = %kept, "this role may not make the kept publication: the relay streams through --publication, so an edit of it while the relay streams stops the relay; as the table owner run: {create};"),
                );
                Ok(None)
            };
            if !may {
                return refused();
            }
            match sqlx::query(sqlx::AssertSqlSafe(create.clone()))
                .execute(pool)
                .await
            {
                Ok(_) => {
                    tracing::info!(publication = %kept, "created the kept publication: an edit of --publication while the relay streams loses nothing")
                }
                // Another relay made it at the same moment (the duplicate
                // name, or the unique index it waited on).
                Err(e) if matches!(db_code(&e).as_deref(), Some("42710" | "23505")) => {}
                Err(e) if db_code(&e).as_deref() == Some("42501") => return refused(),
                Err(e) => return Err(Error::pg("creating the kept publication")(e)),
            }
            match look(pool, &kept, schema, table).await? {
                Some(found) => found,
                // Dropped again at once: next session.
                None => return Ok(None),
            }
        }
    };
    let (text, membership) = found;
    if membership.is_empty() {
        // Not for the outbox (any more): `provision` says so.
        return Ok(Some((kept, Lsn::ZERO)));
    }
    let ready = match ready_from(text.as_deref()) {
        Some((ready, of)) if of == membership => ready,
        // Made by the relay, which stopped before its comment; the table
        // dropped from it and added back; or made by its owner without
        // one. A position is vouched for only once the membership row is
        // committed (it is visible here), and only durably: a position
        // taken anew at each start would let a later start stream from
        // an older confirmed position through --publication, which may
        // have missed rows only this one carried.
        _ => {
            let ready = wal_now(pool).await?;
            let text = comment(slot, schema, table, &membership, ready).replace('\'', "''");
            let sql = format!("COMMENT ON PUBLICATION {kept} IS '{text}'");
            let said = match standby {
                true => Err("a standby".to_owned()),
                false => sqlx::query(sqlx::AssertSqlSafe(sql))
                    .execute(pool)
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string()),
            };
            if let Err(why) = said {
                once(
                    "uncommented",
                    || tracing::warn!(publication = %kept, why, "the kept publication does not say from which WAL position it publishes the outbox, and this role cannot say it: the relay streams through --publication (an edit of it then stops the relay). As the publication's owner, run the COMMENT block of docs/configuration.md (\"Postgres privileges\", as deploy/postgres/relay-role.sql does) in a transaction after the one that made the publication"),
                );
                return Ok(None);
            }
            ready
        }
    };
    Ok(Some((kept, ready)))
}

/// What a session with a slot whose `restart_lsn` is `restart` (`None`:
/// the slot is made after this) can do with the kept publication `name`,
/// made at `ready`, once `provision` found it publishes the outbox.
pub fn standing(name: String, ready: Lsn, restart: Option<Option<Lsn>>) -> Kept {
    match restart {
        None => Kept::Now(name),
        Some(Some(at)) if at >= ready => Kept::Now(name),
        Some(_) => {
            tracing::info!(publication = %name, ready = %ready, "the slot may still decode WAL written before the kept publication was made: streaming through --publication until the slot passes that position, then starting the session over through the kept one");
            Kept::Later { name, ready }
        }
    }
}

/// The WAL position now: past every record inserted yet, so past the
/// commit of any publication this session sees (with `synchronous_commit =
/// off` a commit is visible before it is written out). On a standby, what
/// it has replayed.
async fn wal_now(pool: &PgPool) -> Result<Lsn> {
    let at: String = sqlx::query_scalar(
        "SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() \
                     ELSE pg_current_wal_insert_lsn() END::text",
    )
    .fetch_one(pool)
    .await
    .map_err(Error::pg("reading the WAL position"))?;
    parse_lsn(&at)
}

/// The slot's `restart_lsn` now, if it has one.
pub async fn restart_lsn(pool: &PgPool, slot: &str) -> Result<Option<Lsn>> {
    let at: Option<Option<String>> = sqlx::query_scalar(
        "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(pool)
    .await
    .map_err(Error::pg("reading the slot's restart_lsn"))?;
    at.flatten().map(|s| parse_lsn(&s)).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kept_name_fits_a_publication_name() {
        assert_eq!(name("outbox_relay_billing"), "outbox_relay_billing_keep");
        let long = "a".repeat(63);
        let kept = name(&long);
        assert_eq!(kept.len(), 63, "{kept}");
        assert!(kept.ends_with("_keep"));
        let other = name(&format!("{}b", "a".repeat(62)));
        assert_ne!(kept, other, "two long names keep two publications");
        assert!(crate::config::validate_pg_name("publication", &kept).is_ok());
    }

    #[test]
    fn the_comment_says_the_position_and_membership_it_is_read_back_as() {
        let at = Lsn::parse("1A/2B3C4D").unwrap();
        let text = comment("outbox_relay_x", "public", "outbox_events", "16412", at);
        assert_eq!(ready_from(Some(&text)), Some((at, "16412")), "{text}");
        let named = comment(
            "outbox_relay_membership",
            "public",
            "team_membership",
            "7",
            at,
        );
        assert_eq!(ready_from(Some(&named)), Some((at, "7")), "{named}");
        assert_eq!(ready_from(Some("made by hand")), None);
        assert_eq!(ready_from(None), None);
    }
}
