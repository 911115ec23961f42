//! Replay through the console (SPEC §16): a selection, a dry run that
//! answers a plan bound to exactly what the selection takes, then a job
//! under an `Idempotency-Key` that replays each letter through its own
//! durable's handler once (`ops::dlq::replay`: recorded in `dlq_replays`,
//! so a letter is replayed once whatever the jobs), at a bounded rate, with
//! per-letter results and a cancel.
//!
//! A plan id is a digest of the selection and of the letters it took: the
//! plan is not stored, and executing it reads the letters again, so a
//! selection that takes other letters now is refused (409), never run on
//! what the operator did not see.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::ops::admin_log::{self, Actor, Entry};
use crate::ops::dlq::{self, DeadLetter};
use crate::triage::Class;

/// The letters a selection may take, at most: a larger one is refused
/// (narrow it), never cut short.
pub const PLAN_MAX: usize = 10_000;
/// The letters of one stream read for a plan, at most, before the class,
/// fingerprint, durable and time tests: a stream holding more that the
/// reading's own tests (ids, subject, since) take is refused too, since a
/// plan of the first ones read would be cut short.
pub const READ_MAX: usize = 100_000;
/// A replay job's rate is at most this (letters a second).
pub const RATE_MAX: f64 = 1_000.0;

/// The migration, for `migrate --admin-log-only`.
pub const TABLE: &str = include_str!("../../migrations/0013_admin_jobs.sql");

/// Which dead letters. Every test given must hold; at least one of `ids`,
/// `class` or `fingerprint`, or `all`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Selection {
    /// One stream; default: those the console reads.
    #[serde(default)]
    pub stream: Option<String>,
    #[serde(default)]
    pub ids: Vec<String>,
    #[serde(default)]
    pub class: Option<String>,
    #[serde(default)]
    pub fingerprint: Option<String>,
    /// NATS wildcards, against the original subject.
    #[serde(default)]
    pub subject: Option<String>,
    #[serde(default)]
    pub durable: Option<String>,
    /// RFC 3339: stored at or after.
    #[serde(default)]
    pub since: Option<String>,
    /// RFC 3339: stored before.
    #[serde(default)]
    pub until: Option<String>,
    #[serde(default)]
    pub all: bool,
}

/// A selection checked: its class and times parsed.
#[derive(Debug)]
pub struct Checked {
    pub class: Option<Class>,
    pub since: Option<time::OffsetDateTime>,
    pub until: Option<time::OffsetDateTime>,
}

impl Selection {
    pub fn check(&self) -> Result<Checked, String> {
        if !self.all && self.ids.is_empty() && self.class.is_none() && self.fingerprint.is_none() {
            return Err(
                "the selection takes every letter: name ids, a class or a fingerprint, or say \"all\": true".into(),
            );
        }
        let class = match &self.class {
            None => None,
            Some(c) => Some(Class::parse(c).ok_or_else(|| format!("class {c:?} is not one"))?),
        };
        let time = |what: &str,
                    t: &Option<String>|
         -> Result<Option<time::OffsetDateTime>, String> {
            t.as_deref()
                .map(|t| {
                    time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
                        .map_err(|e| format!("{what} {t:?}: not an RFC 3339 time ({e})"))
                })
                .transpose()
        };
        Ok(Checked {
            class,
            since: time("since", &self.since)?,
            until: time("until", &self.until)?,
        })
    }

    /// The `ops::dlq` selection that reads the letters (the rest is
    /// filtered here).
    pub fn reading(&self, checked: &Checked) -> dlq::Selection {
        dlq::Selection {
            filter: self.subject.clone(),
            ids: self.ids.clone(),
            since: checked.since,
            limit: Some(READ_MAX),
            headers_only: false,
        }
    }

    /// Whether `d` (in any stream) is taken, past what `reading` tested.
    pub fn takes(&self, checked: &Checked, d: &DeadLetter) -> bool {
        checked.class.is_none_or(|c| c.as_str() == d.class)
            && self
                .fingerprint
                .as_deref()
                .is_none_or(|f| f == d.fingerprint)
            && self
                .durable
                .as_deref()
                .is_none_or(|w| d.consumer.as_deref() == Some(w))
            && checked.until.is_none_or(|u| d.stored < u)
    }
}

/// One letter of a plan.
#[derive(Debug, Clone, Serialize)]
pub struct Item {
    pub stream: String,
    /// The stream's creation time: a stream deleted and made again numbers
    /// its letters from 1 again, and a plan must not take those for its own.
    #[serde(skip)]
    pub created: String,
    pub seq: u64,
    pub id: String,
    pub durable: Option<String>,
    pub class: &'static str,
    pub subject: String,
    /// Why it would not be replayed (the relay's own letters, a class
    /// that cannot be: no body, no id).
    pub skipped: Option<&'static str>,
}

impl Item {
    pub fn of(stream: &str, created: &str, d: &DeadLetter) -> Item {
        let class = Class::parse(d.class).unwrap_or(Class::Other);
        let skipped = if d.consumer.is_none() {
            Some("the relay's own letter: fix the row and insert it again")
        } else if !class.replayable() {
            Some("its class cannot be replayed (see its next step)")
        } else {
            None
        };
        Item {
            stream: stream.to_owned(),
            created: created.to_owned(),
            seq: d.seq,
            id: d.id.clone(),
            durable: d.consumer.clone(),
            class: d.class,
            subject: d.subject.clone(),
            skipped,
        }
    }
}

/// The plan's id: the selection and every letter it took, in order, each
/// by its stream (and that stream's making), sequence, id, durable and
/// class.
pub fn plan_id(sel: &Selection, items: &[Item]) -> String {
    let mut h = Sha256::new();
    h.update(serde_json::to_vec(sel).unwrap_or_default());
    for i in items {
        let seq = i.seq.to_string();
        let fields = [
            i.stream.as_str(),
            i.created.as_str(),
            seq.as_str(),
            i.id.as_str(),
            i.durable.as_deref().unwrap_or(""),
            i.class,
        ];
        h.update(b"\n");
        for f in fields {
            h.update((f.len() as u64).to_be_bytes());
            h.update(f.as_bytes());
        }
    }
    h.finalize()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The CLI commands that do what a plan does: the selection's own
/// terms when the CLI has them all, else the plan's letters by id, one
/// command a stream (a letter whose id is not a UUID is not put in a
/// shell command, and is said to be left out).
pub fn cli(sel: &Selection, items: &[Item], reason: &str) -> String {
    let reason = reason.replace('\'', "");
    let shell_safe = |s: &str| {
        !s.is_empty()
            && s.chars().all(|c| {
                c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | '*' | '>' | ':')
            })
    };
    let by_terms = sel.class.is_none()
        && sel.fingerprint.is_none()
        && sel.durable.is_none()
        && sel.until.is_none()
        && sel.stream.as_deref().is_some_and(shell_safe)
        && sel.subject.as_deref().is_none_or(shell_safe)
        && sel.since.as_deref().is_none_or(shell_safe)
        && sel.ids.iter().all(|i| uuid::Uuid::parse_str(i).is_ok());
    if by_terms {
        let mut cmd = String::from("outbox-relay dlq replay");
        if let Some(s) = &sel.stream {
            cmd.push_str(&format!(" --stream {s}"));
        }
        for id in &sel.ids {
            cmd.push_str(&format!(" --id {id}"));
        }
        if let Some(f) = &sel.subject {
            cmd.push_str(&format!(" --filter '{f}'"));
        }
        if let Some(s) = &sel.since {
            cmd.push_str(&format!(" --since {s}"));
        }
        cmd.push_str(&format!(" --reason '{reason}'"));
        return cmd;
    }
    let mut streams: Vec<(&str, Vec<String>)> = Vec::new();
    let mut left_out = 0;
    for i in items.iter().filter(|i| i.skipped.is_none()) {
        let Ok(id) = uuid::Uuid::parse_str(&i.id) else {
            left_out += 1;
            continue;
        };
        if !shell_safe(&i.stream) {
            left_out += 1;
            continue;
        }
        match streams.iter_mut().find(|(s, _)| *s == i.stream) {
            Some((_, ids)) => ids.push(id.to_string()),
            None => streams.push((&i.stream, vec![id.to_string()])),
        }
    }
    let mut lines: Vec<String> = streams
        .into_iter()
        .map(|(stream, ids)| {
            let ids: String = ids.iter().map(|id| format!(" --id {id}")).collect();
            format!("outbox-relay dlq replay --stream {stream}{ids} --reason '{reason}'")
        })
        .collect();
    if left_out > 0 {
        lines.push(format!(
            "# {left_out} letters left out: their ids or streams are not put in a shell command"
        ));
    }
    if lines.is_empty() {
        lines.push("# nothing to replay".into());
    }
    lines.join("\n")
}

/// A job as it is kept.
#[derive(Debug, Serialize)]
pub struct Job {
    pub id: uuid::Uuid,
    pub idempotency_key: String,
    pub plan_id: String,
    pub selection: Value,
    pub reason: String,
    pub actor: String,
    pub state: String,
    pub created_at: String,
    pub finished_at: Option<String>,
    pub items: Vec<Value>,
    pub progress: Value,
}

/// A job's row: id, key, plan, selection, reason, actor, state, made, ended.
type JobRow = (
    uuid::Uuid,
    String,
    String,
    Value,
    String,
    String,
    String,
    String,
    Option<String>,
);

const AT: &str = "'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'";

/// The job `id`, with its items and progress.
pub async fn job(pool: &PgPool, id: uuid::Uuid) -> sqlx::Result<Option<Job>> {
    let row: Option<JobRow> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT id, idempotency_key, plan_id, selection, reason, actor, state, \
                    to_char(created_at AT TIME ZONE 'UTC', {AT}), to_char(finished_at AT TIME ZONE 'UTC', {AT}) \
             FROM outbox_admin_jobs WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(pool)
        .await?;
    let Some((
        id,
        idempotency_key,
        plan_id,
        selection,
        reason,
        actor,
        state,
        created_at,
        finished_at,
    )) = row
    else {
        return Ok(None);
    };
    let items: Vec<Value> = sqlx::query_scalar(
        "SELECT jsonb_build_object('stream', stream, 'seq', seq, 'id', message_id, 'durable', durable, \
                'result', result, 'detail', detail) \
         FROM outbox_admin_job_items WHERE job = $1 ORDER BY ord",
    )
    .bind(id)
    .fetch_all(pool)
    .await?;
    let count = |r: &str| items.iter().filter(|i| i["result"] == r).count();
    let progress = json!({
        "total": items.len(),
        "done": items.iter().filter(|i| !i["result"].is_null()).count(),
        "replayed": count("replayed"),
        "already_replayed": count("already_replayed"),
        "not_replayable": count("not_replayable"),
        "failed": count("failed"),
        "cancelled": count("cancelled"),
    });
    Ok(Some(Job {
        id,
        idempotency_key,
        plan_id,
        selection,
        reason,
        actor,
        state,
        created_at,
        finished_at,
        items,
        progress,
    }))
}

/// The job made under `key`, if any, and its plan.
pub async fn by_key(pool: &PgPool, key: &str) -> sqlx::Result<Option<(uuid::Uuid, String)>> {
    sqlx::query_as("SELECT id, plan_id FROM outbox_admin_jobs WHERE idempotency_key = $1")
        .bind(key)
        .fetch_optional(pool)
        .await
}

/// Jobs, newest first.
pub async fn recent(pool: &PgPool, limit: i64) -> sqlx::Result<Vec<Value>> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT jsonb_build_object('id', j.id, 'plan_id', j.plan_id, 'actor', j.actor, 'reason', j.reason, \
                'state', j.state, 'created_at', to_char(j.created_at AT TIME ZONE 'UTC', {AT}), \
                'total', (SELECT count(*) FROM outbox_admin_job_items i WHERE i.job = j.id), \
                'done', (SELECT count(*) FROM outbox_admin_job_items i WHERE i.job = j.id AND i.result IS NOT NULL)) \
         FROM outbox_admin_jobs j ORDER BY j.created_at DESC LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// A job to make.
pub struct NewJob<'a> {
    pub id: uuid::Uuid,
    pub key: &'a str,
    pub plan: &'a str,
    pub selection: &'a Selection,
    pub reason: &'a str,
    pub actor: &'a str,
    pub items: &'a [Item],
}

/// Make the job: false when its key was taken meanwhile (another request
/// under the same key made it first).
pub async fn create(pool: &PgPool, job: NewJob<'_>) -> sqlx::Result<bool> {
    let NewJob {
        id,
        key,
        plan,
        selection: sel,
        reason,
        actor,
        items,
    } = job;
    let mut tx = pool.begin().await?;
    let made = sqlx::query(
        "INSERT INTO outbox_admin_jobs (id, idempotency_key, kind, plan_id, selection, reason, actor, state) \
         VALUES ($1, $2, 'replay', $3, $4, $5, $6, 'running') ON CONFLICT (idempotency_key) DO NOTHING",
    )
    .bind(id)
    .bind(key)
    .bind(plan)
    .bind(serde_json::to_value(sel).unwrap_or_default())
    .bind(reason)
    .bind(actor)
    .execute(&mut *tx)
    .await?;
    if made.rows_affected() == 0 {
        return Ok(false);
    }
    // One statement for every item (up to PLAN_MAX).
    let ords: Vec<i32> = (0..items.len() as i32).collect();
    let streams: Vec<&str> = items.iter().map(|i| i.stream.as_str()).collect();
    let seqs: Vec<i64> = items
        .iter()
        .map(|i| i64::try_from(i.seq).unwrap_or(i64::MAX))
        .collect();
    let ids: Vec<&str> = items.iter().map(|i| i.id.as_str()).collect();
    let durables: Vec<Option<&str>> = items.iter().map(|i| i.durable.as_deref()).collect();
    let results: Vec<Option<&str>> = items
        .iter()
        .map(|i| i.skipped.map(|_| "not_replayable"))
        .collect();
    let details: Vec<Option<&str>> = items.iter().map(|i| i.skipped).collect();
    sqlx::query(
        "INSERT INTO outbox_admin_job_items (job, ord, stream, seq, message_id, durable, result, detail, done_at) \
         SELECT $1, o, s, q, m, d, r, t, CASE WHEN r IS NULL THEN NULL ELSE now() END \
         FROM unnest($2::int4[], $3::text[], $4::int8[], $5::text[], $6::text[], $7::text[], $8::text[]) \
             AS u(o, s, q, m, d, r, t)",
    )
    .bind(id)
    .bind(&ords)
    .bind(&streams)
    .bind(&seqs)
    .bind(&ids)
    .bind(&durables)
    .bind(&results)
    .bind(&details)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// A job made but not run (its start could not be recorded).
pub async fn fail(pool: &PgPool, id: uuid::Uuid) {
    let _ = sqlx::query(
        "UPDATE outbox_admin_jobs SET state = 'failed', finished_at = now() WHERE id = $1",
    )
    .bind(id)
    .execute(pool)
    .await;
}

/// Jobs a console left running when it stopped: said so. Another console
/// on the database (a relay's, a consumer's) may be running its own: only
/// a job that has written no letter's result for 10 minutes is taken for
/// one left (a job writes one a letter, at least one every 100 s).
pub async fn interrupted(pool: &PgPool) -> sqlx::Result<u64> {
    Ok(sqlx::query(
        "UPDATE outbox_admin_jobs j SET state = 'interrupted', finished_at = now() \
         WHERE j.state = 'running' AND j.created_at < now() - interval '10 minutes' \
           AND NOT EXISTS (SELECT 1 FROM outbox_admin_job_items i \
                           WHERE i.job = j.id AND i.done_at > now() - interval '10 minutes')",
    )
    .execute(pool)
    .await?
    .rows_affected())
}

/// What a job needs to run.
pub struct Run {
    pub pool: PgPool,
    pub js: async_nats::jetstream::Context,
    pub id: uuid::Uuid,
    pub letters: Vec<(usize, String, DeadLetter)>,
    pub actor: Actor,
    pub reason: String,
    pub plan: String,
    /// Letters a second, at most.
    pub rate: f64,
    pub cancel: CancellationToken,
}

/// Replay each letter in turn, writing its result as it comes; the job's
/// end recorded in the admin log with its figures.
pub async fn run(r: Run) {
    let gap = Duration::from_secs_f64(1.0 / r.rate.clamp(0.01, RATE_MAX));
    let mut tick = tokio::time::interval(gap);
    let mut cancelled = false;
    for (ord, stream, letter) in r.letters {
        if !cancelled {
            tokio::select! {
                _ = r.cancel.cancelled() => cancelled = true,
                _ = tick.tick() => {}
            }
        }
        let (result, detail) = if cancelled {
            (
                "cancelled".to_owned(),
                "the job was cancelled before this letter".to_owned(),
            )
        } else {
            match dlq::replay(&r.pool, &r.js, &stream, vec![letter], &r.actor.name).await {
                Ok(mut done) => match done.pop() {
                    Some(d) => (d.result, d.detail),
                    None => ("failed".into(), "no result".into()),
                },
                Err(e) => ("failed".into(), e.to_string()),
            }
        };
        let wrote = sqlx::query(
            "UPDATE outbox_admin_job_items SET result = $3, detail = $4, done_at = now() WHERE job = $1 AND ord = $2",
        )
        .bind(r.id)
        .bind(ord as i32)
        .bind(&result)
        .bind(&detail)
        .execute(&r.pool)
        .await;
        if let Err(e) = wrote {
            tracing::warn!(job = %r.id, error = %e, "console: a replay's result is not written");
        }
    }
    let state = if cancelled { "cancelled" } else { "done" };
    let _ =
        sqlx::query("UPDATE outbox_admin_jobs SET state = $2, finished_at = now() WHERE id = $1")
            .bind(r.id)
            .bind(state)
            .execute(&r.pool)
            .await;
    let figures = match job(&r.pool, r.id).await {
        Ok(Some(j)) => j.progress,
        _ => Value::Null,
    };
    let entry = Entry {
        action: "replay.finish",
        target: r.id.to_string(),
        selection: json!({ "plan_id": r.plan, "progress": figures }),
        reason: Some(r.reason),
    };
    if let Err(e) =
        admin_log::record_as(&r.pool, &entry, Some(&r.actor), &format!("done: {state}")).await
    {
        tracing::warn!(job = %r.id, error = %e, "console: a job's end is not recorded");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_selection_must_narrow_or_say_all_and_parses_its_parts() {
        assert!(Selection::default().check().is_err());
        let all = Selection {
            all: true,
            ..Default::default()
        };
        assert!(all.check().is_ok());
        let bad = Selection {
            class: Some("nope".into()),
            ..Default::default()
        };
        assert!(bad.check().unwrap_err().contains("nope"));
        let bad = Selection {
            ids: vec!["x".into()],
            since: Some("yesterday".into()),
            ..Default::default()
        };
        assert!(bad.check().unwrap_err().contains("RFC 3339"));
        let ok = Selection {
            class: Some("handler_failed".into()),
            ..Default::default()
        };
        assert_eq!(ok.check().unwrap().class, Some(Class::HandlerFailed));
    }

    #[test]
    fn a_plan_id_changes_with_the_selection_and_with_what_it_took() {
        let sel = Selection {
            class: Some("handler_failed".into()),
            ..Default::default()
        };
        let item = |seq| Item {
            stream: "DLQ_A".into(),
            created: "2026-11-30T00:00:00Z".into(),
            seq,
            id: "x".into(),
            durable: Some("billing".into()),
            class: "handler_failed",
            subject: "orders.paid".into(),
            skipped: None,
        };
        let a = plan_id(&sel, &[item(1), item(2)]);
        assert_eq!(a, plan_id(&sel, &[item(1), item(2)]));
        assert_ne!(
            a,
            plan_id(&sel, &[item(1), item(2), item(3)]),
            "a letter more"
        );
        assert_ne!(a, plan_id(&sel, &[item(1)]), "a letter less");
        let other = Selection {
            class: Some("handler_rejected".into()),
            ..Default::default()
        };
        assert_ne!(a, plan_id(&other, &[item(1), item(2)]), "another selection");
        // The stream made again: its letters numbered from 1 again.
        let mut remade = item(1);
        remade.created = "2026-12-01T00:00:00Z".into();
        assert_ne!(
            a,
            plan_id(&sel, &[remade, item(2)]),
            "another stream of that name"
        );
        let mut other_letter = item(1);
        other_letter.id = "y".into();
        assert_ne!(
            a,
            plan_id(&sel, &[other_letter, item(2)]),
            "another letter at that place"
        );
    }

    #[test]
    fn a_plans_cli_is_its_letters_by_id_when_the_cli_cannot_say_its_selection() {
        let id = "6d9f6051-078b-4923-8568-6b00144ea67f";
        let item = |stream: &str, id: &str, skipped| Item {
            stream: stream.into(),
            created: String::new(),
            seq: 1,
            id: id.into(),
            durable: Some("billing".into()),
            class: "transient_exhausted",
            subject: "orders.paid".into(),
            skipped,
        };
        let by_class = Selection {
            class: Some("transient_exhausted".into()),
            ..Default::default()
        };
        let items = [
            item("DLQ_A", id, None),
            item("DLQ_B", id, None),
            item("DLQ_A", "$(rm -rf /)", None),
            item("DLQ_A", id, Some("its class cannot be replayed")),
        ];
        let cli = cli(&by_class, &items, "INC-7: it's back");
        assert_eq!(
            cli.lines().collect::<Vec<_>>(),
            [
                format!(
                    "outbox-relay dlq replay --stream DLQ_A --id {id} --reason 'INC-7: its back'"
                ),
                format!(
                    "outbox-relay dlq replay --stream DLQ_B --id {id} --reason 'INC-7: its back'"
                ),
                "# 1 letters left out: their ids or streams are not put in a shell command"
                    .to_owned(),
            ]
        );
        let by_terms = Selection {
            stream: Some("DLQ_A".into()),
            ids: vec![id.into()],
            ..Default::default()
        };
        assert_eq!(
            super::cli(&by_terms, &items, "r"),
            format!("outbox-relay dlq replay --stream DLQ_A --id {id} --reason 'r'")
        );
    }
}
