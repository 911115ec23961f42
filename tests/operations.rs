//! SPEC §9 retention and replay: `prune`, `dlq list`, `dlq replay`,
//! `consumer reset`, run as an operator would, against the real stack.

use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

use crate::common::*;
use outbox_relay::wire;

const T: Duration = Duration::from_secs(90);

/// `outbox-relay prune …` to its end: (success, stdout + stderr).
fn prune(url: &str, context: &str, extra: &[&str]) -> (bool, String) {
    let out = Command::new(BIN)
        .args(["prune", "--database-url", url, "--context", context])
        .args(extra)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `n` rows with `occurred_at` that long ago, one transaction; their ids.
async fn rows_aged(pool: &sqlx::PgPool, n: i64, age: &str) -> HashSet<uuid::Uuid> {
    sqlx::query_scalar(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
         SELECT gen_random_uuid(), 'order', 'a' || (g % 7), 'placed', jsonb_build_object('s', g), \
                now() - $2::interval FROM generate_series(1, $1::int8) g RETURNING id",
    )
    .bind(n)
    .bind(age)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

async fn ids_in_table(pool: &sqlx::PgPool) -> HashSet<uuid::Uuid> {
    sqlx::query_scalar::<_, uuid::Uuid>("SELECT id FROM outbox_events")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

/// SPEC §9 retention: with the relay stopped, prune deletes nothing it
/// cannot prove published and says why; a dry run deletes nothing; with the
/// relay caught up it deletes exactly the old rows, every one of them in
/// the stream, and keeps the young ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_deletes_exactly_the_old_published_rows() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "o_prune").await;
    let mut relay = Service::relay(&url, &stack.nats_url, "prune", &[]);
    let published_old = rows_aged(&pool, 200, "10 days").await;
    let young = rows_aged(&pool, 100, "1 hour").await;
    let stream = wire::stream_name("prune");
    read_stream(&stack.nats_url, &stream, 300, T).await;
    relay.kill9();
    // Old by its timestamp, but committed while the relay is down.
    let unpublished_old = rows_aged(&pool, 50, "10 days").await;

    let (ok, out) = prune(&url, "prune", &["--older-than", "7d", "--wait", "2s"]);
    assert!(ok, "{out}");
    assert!(out.contains("outbox: deleted 0 rows"), "{out}");
    assert!(out.contains("the relay is down or behind"), "{out}");
    assert_eq!(
        ids_in_table(&pool).await.len(),
        350,
        "nothing deleted: {out}"
    );

    relay.restart();
    read_stream(&stack.nats_url, &stream, 350, T).await;
    let (ok, out) = prune(&url, "prune", &["--older-than", "7d", "--dry-run"]);
    assert!(ok && out.contains("outbox: would delete 250 rows"), "{out}");
    assert_eq!(
        ids_in_table(&pool).await.len(),
        350,
        "a dry run deletes nothing"
    );

    let (ok, out) = prune(&url, "prune", &["--older-than", "7d", "--batch", "64"]);
    assert!(ok && out.contains("outbox: deleted 250 rows"), "{out}");
    assert_eq!(ids_in_table(&pool).await, young, "{out}");
    let got = read_stream(&stack.nats_url, &stream, 350, T).await;
    let in_stream: HashSet<uuid::Uuid> = got
        .iter()
        .map(|g| g.h(wire::MSG_ID).unwrap().parse().unwrap())
        .collect();
    assert!(published_old.is_subset(&in_stream) && unpublished_old.is_subset(&in_stream));

    // The inbox: processed long ago goes; recent, waiting or parked stays.
    sqlx::raw_sql(
        "INSERT INTO inbox_messages (consumer, message_id, subject, received_at, processed_at)            SELECT 'c', gen_random_uuid(), 's', now() - interval '41 days', now() - interval '40 days'            FROM generate_series(1, 30);          INSERT INTO inbox_messages (consumer, message_id, subject, received_at, processed_at)            SELECT 'c', gen_random_uuid(), 's', now() - interval '2 days', now() - interval '1 day'            FROM generate_series(1, 20);          INSERT INTO inbox_messages (consumer, message_id, subject, received_at, parked_until)            SELECT 'c', gen_random_uuid(), 's', now() - interval '41 days', now()            FROM generate_series(1, 10);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (ok, out) = prune(
        &url,
        "prune",
        &[
            "--older-than",
            "7d",
            "--inbox-older-than",
            "30d",
            "--batch",
            "7",
            "--events-stream",
            &stream,
            "--nats-url",
            &stack.nats_url,
        ],
    );
    assert!(
        ok && out.contains("inbox: deleted 30 processed rows"),
        "{out}"
    );
    // The relay made the stream without a max age: it redelivers forever.
    assert!(
        out.contains("WARNING: --inbox-older-than 30days is shorter than stream"),
        "{out}"
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_messages")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 30, "recent and unprocessed rows stay: {out}");
}

/// SPEC §13: prune reads the id and occurred_at roles of a table of the
/// team's own, keyed by text, and deletes exactly the old published rows,
/// in batches smaller than their number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_reads_the_roles_of_a_table_keyed_by_text() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "o_prune_map").await;
    sqlx::raw_sql(
        "CREATE TABLE events (id text primary key, topic text not null, payload jsonb not null, \
         created_at timestamptz not null default now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let map = [
        "--table",
        "public.events",
        "--columns",
        "subject=topic,occurred_at=created_at",
    ];
    let relay = Service::relay(&url, &stack.nats_url, "prunemap", &map);
    for (n, age) in [(40, "10 days"), (25, "1 hour")] {
        sqlx::query(
            "INSERT INTO events (id, topic, payload, created_at) \
             SELECT 'e-' || g || '-' || $2, 'prunemap.e', '{}', now() - $2::interval \
             FROM generate_series(1, $1::int8) g",
        )
        .bind(n as i64)
        .bind(age)
        .execute(&pool)
        .await
        .unwrap();
    }
    read_stream(&stack.nats_url, &wire::stream_name("prunemap"), 65, T).await;
    let mut args = vec!["--older-than", "7d", "--batch", "7"];
    args.extend(map);
    let (ok, out) = prune(&url, "prunemap", &args);
    assert!(ok && out.contains("outbox: deleted 40 rows"), "{out}");
    let left: Vec<String> = sqlx::query_scalar("SELECT id FROM events")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(
        left.len() == 25 && left.iter().all(|i| i.ends_with("1 hour")),
        "{left:?}"
    );
    drop(relay);
}

/// SPEC §9 retention on a partitioned outbox: whole partitions past the
/// retention go (the current one stays), once the relay has them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_drops_whole_old_partitions_once_published() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "o_prune_parted").await;
    sqlx::raw_sql(crate::lifecycle::PARTITIONED_OUTBOX)
        .execute(&pool)
        .await
        .unwrap();
    let _relay = Service::relay(&url, &stack.nats_url, "pruneparted", &[]);
    for at in ["2025-03-01T00:00:00Z", "2026-02-01T00:00:00Z"] {
        sqlx::query(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
             SELECT gen_random_uuid(), 'order', 'a', 'placed', '{}', $1::timestamptz FROM generate_series(1, 40)",
        )
        .bind(at)
        .execute(&pool)
        .await
        .unwrap();
    }
    let current = rows_aged(&pool, 30, "1 minute").await;
    read_stream(&stack.nats_url, &wire::stream_name("pruneparted"), 110, T).await;

    let (ok, out) = prune(&url, "pruneparted", &["--older-than", "30d"]);
    assert!(ok, "{out}");
    assert!(
        out.contains("dropped partition public.outbox_events_old"),
        "{out}"
    );
    assert!(
        out.contains("dropped partition public.outbox_events_recent"),
        "{out}"
    );
    assert!(out.contains("outbox: deleted 80 rows"), "{out}");
    let left: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'outbox_events'::regclass",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(left, vec!["outbox_events_current".to_string()]);
    assert_eq!(ids_in_table(&pool).await, current);
}

/// Review P1: a partition's DETACH takes ACCESS EXCLUSIVE on the outbox,
/// and while it waited (2 s) behind a long read of it, every producer's
/// INSERT queued behind it. Now each try waits 50 ms: with the read open,
/// producers go on inserting (none waits a second), and once it ends, the
/// partition goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_drop_never_holds_producers_behind_it() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "o_prune_stall").await;
    sqlx::raw_sql(crate::lifecycle::PARTITIONED_OUTBOX)
        .execute(&pool)
        .await
        .unwrap();
    let _relay = Service::relay(&url, &stack.nats_url, "prunestall", &[]);
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
         SELECT gen_random_uuid(), 'order', 'a', 'placed', '{}', '2025-03-01T00:00:00Z' FROM generate_series(1, 10)",
    )
    .execute(&pool)
    .await
    .unwrap();
    read_stream(&stack.nats_url, &wire::stream_name("prunestall"), 10, T).await;
    let produce = "BEGIN; SET LOCAL lock_timeout = '1s'; \
         INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'b', 'placed', '{}'); COMMIT";
    // A long read of the outbox, open (a report, the audit's SQL phase):
    // the DETACH must wait for it; producers need not.
    let mut open = pool.begin().await.unwrap();
    sqlx::raw_sql("SELECT count(*) FROM outbox_events")
        .execute(&mut *open)
        .await
        .unwrap();
    let pruning = {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            prune(
                &url,
                "prunestall",
                &["--older-than", "30d", "--wait", "60s"],
            )
        })
    };
    eventually(T, "prune trying to detach", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%DETACH PARTITION%' \
             AND pid <> pg_backend_pid()",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            > 0
    })
    .await;
    for i in 0..10 {
        sqlx::raw_sql(produce)
            .execute(&pool)
            .await
            .unwrap_or_else(|e| panic!("producer {i} waited behind the prune: {e}"));
    }
    open.commit().await.unwrap();
    let (ok, out) = pruning.await.unwrap();
    assert!(ok, "{out}");
    assert!(
        out.contains("dropped partition public.outbox_events_old"),
        "{out}"
    );
}

/// Bad input to prune is one line and a non-zero exit, and deletes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_refuses_bad_durations() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "o_prune_bad").await;
    rows_aged(&pool, 5, "30 days").await;
    for bad in [
        ["--older-than", "-1d"],
        ["--older-than", "soon"],
        ["--inbox-older-than", "-5m"],
        // Review P2: every confirmed row, with what an audit and a resync
        // still read, and no question asked.
        ["--older-than", "0s"],
        ["--inbox-older-than", "10m"],
    ] {
        let (ok, out) = prune(&url, "prunebad", &bad);
        assert!(!ok, "{bad:?} accepted: {out}");
        assert!(out.lines().next().unwrap_or("").contains("error"), "{out}");
        assert!(out.contains(bad[0]), "{bad:?}: {out}");
    }
    assert_eq!(ids_in_table(&pool).await.len(), 5);
    // Said, it is taken.
    let (ok, out) = prune(
        &url,
        "prunebad",
        &["--older-than", "0s", "--yes", "--check-config"],
    );
    assert!(ok, "{out}");
}

/// SPEC §9 retention under writes: rows committed after prune took its
/// snapshot, even dated long ago (old by `--older-than`), are never deleted,
/// while prune goes on deleting the old rows before them. (A prune by
/// `occurred_at` alone would take them too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_never_touches_rows_committed_after_its_snapshot() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "o_prune_busy").await;
    let _relay = Service::relay(&url, &stack.nats_url, "prunebusy", &[]);
    let before = rows_aged(&pool, 5000, "10 days").await;
    read_stream(&stack.nats_url, &wire::stream_name("prunebusy"), 5000, T).await;

    let prune_url = url.clone();
    let pruning = tokio::task::spawn_blocking(move || {
        prune(
            &prune_url,
            "prunebusy",
            &["--older-than", "7d", "--batch", "10"],
        )
    });
    // Its snapshot is taken once its anchor transaction sits open.
    eventually(T, "prune holds its snapshot", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = 'o_prune_busy' \
               AND application_name = 'outbox-relay' AND state = 'idle in transaction')",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    })
    .await;
    let mut during = HashSet::new();
    while !pruning.is_finished() {
        during.extend(rows_aged(&pool, 5, "10 days").await);
    }
    let (ok, out) = pruning.await.unwrap();
    assert!(ok, "{out}");
    assert!(
        !during.is_empty(),
        "rows were written while prune ran: {out}"
    );
    let left = ids_in_table(&pool).await;
    assert!(
        during.is_subset(&left),
        "{} of {} rows committed after the snapshot were deleted: {out}",
        during.difference(&left).count(),
        during.len()
    );
    assert!(
        before.is_disjoint(&left),
        "every row before the snapshot went: {out}"
    );
}

/// SPEC §16: `outbox_admin_log` records every admin action under the
/// database role it ran as, whatever `$USER` claims and whatever a row
/// inserted by hand says; the database refuses to change or remove a row;
/// a row changed behind the triggers' back (a superuser who disabled them)
/// breaks the chain, which `admin log verify` finds and names, and a chain
/// rewritten after it is caught by the head kept from before. An action
/// that cannot be recorded does not run. Before, nothing was recorded but
/// `$USER` in two tables (unset in containers, set to anything by anyone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_log_names_the_role_refuses_changes_and_finds_a_tampered_row() {
    let stack = stack();
    let (url, pool) = empty_db(&stack, "t_adminlog").await;
    let drop_slot = |reason: &str| {
        Command::new(BIN)
            .args([
                "slot",
                "drop",
                "--yes",
                "--database-url",
                &url,
                "--context",
                "adminlog",
                "--reason",
                reason,
            ])
            .env("USER", "mallory")
            .output()
            .unwrap()
    };
    // A team's own database without the log: refused, not run unrecorded.
    let out = drop_slot("before the log");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--admin-log-only"),
        "{err}"
    );
    let (code, out) = run_output_bounded(
        &["migrate", "--admin-log-only", "--database-url", &url],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{out}");
    for reason in ["first", "second", "third"] {
        let out = drop_slot(reason);
        assert!(out.status.success(), "{out:?}");
    }
    // A row inserted by hand cannot name another role.
    sqlx::raw_sql(
        "INSERT INTO outbox_admin_log (seq, at, db_role, actor, role, action, target, result, request_id, prev_hash, hash) \
         VALUES (0, now(), 'alice', 'db:alice', 'cli', 'slot.drop', 'x', 'done', 'r', '', '')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let role: String = sqlx::query_scalar("SELECT session_user::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    let rows: Vec<(i64, String, String, String, Option<String>)> = sqlx::query_as(
        "SELECT seq, actor, db_role, action, reason FROM outbox_admin_log ORDER BY seq",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 4, "{rows:?}");
    for (i, (seq, actor, db_role, action, _)) in rows.iter().enumerate() {
        assert_eq!(*seq, i as i64 + 1);
        assert_eq!(actor, &format!("db:{role}"), "never $USER, never a claim");
        assert_eq!(db_role, &role);
        assert_eq!(action, "slot.drop");
    }
    assert_eq!(rows[1].4.as_deref(), Some("second"));

    for sql in [
        "UPDATE outbox_admin_log SET reason = 'nothing happened'",
        "DELETE FROM outbox_admin_log WHERE seq = 2",
        "TRUNCATE outbox_admin_log",
    ] {
        let e = sqlx::raw_sql(sql).execute(&pool).await.unwrap_err();
        assert!(e.to_string().contains("append-only"), "{sql}: {e}");
    }
    let verify = |extra: &[&str]| {
        let mut args = vec!["admin", "log", "verify", "--database-url", &url];
        args.extend(extra);
        run_output_bounded(&args, Duration::from_secs(30))
    };
    let (code, out) = verify(&[]);
    assert!(
        code == Some(0) && out.contains("4 rows, the chain holds"),
        "{out}"
    );
    let head = out
        .split("head ")
        .nth(1)
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();

    // Behind the triggers' back, with the database's own hash function
    // replaced to vouch for it: verify hashes by itself.
    sqlx::raw_sql(
        "CREATE OR REPLACE FUNCTION outbox_admin_log_canonical(l outbox_admin_log) RETURNS text \
         LANGUAGE sql AS $$ SELECT 'forged' $$; \
         ALTER TABLE outbox_admin_log DISABLE TRIGGER USER; \
         UPDATE outbox_admin_log SET reason = 'nothing happened' WHERE seq = 2; \
         ALTER TABLE outbox_admin_log ENABLE TRIGGER USER",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (code, out) = verify(&[]);
    assert!(
        code == Some(1) && out.contains("row 2 does not hold"),
        "{out}"
    );
    // The whole chain rewritten from there: it holds again, and only the
    // head kept from before shows it.
    sqlx::raw_sql(
        "ALTER TABLE outbox_admin_log DISABLE TRIGGER USER; \
         DO $$ DECLARE r record; prev text := ''; h text; BEGIN \
           FOR r IN SELECT * FROM outbox_admin_log ORDER BY seq LOOP \
             h := encode(sha256(convert_to(jsonb_build_array(prev, r.seq, \
                  (EXTRACT(epoch FROM r.at) * 1000000)::bigint, r.db_role, r.actor, r.role, \
                  r.action, r.target, r.selection, r.reason, r.result, r.request_id)::text, 'UTF8')), 'hex'); \
             UPDATE outbox_admin_log SET prev_hash = prev, hash = h WHERE seq = r.seq; \
             prev := h; \
           END LOOP; END $$; \
         ALTER TABLE outbox_admin_log ENABLE TRIGGER USER",
    )
    .execute(&pool)
    .await
    .unwrap();
    let (code, out) = verify(&[]);
    assert!(code == Some(0), "a rewritten chain holds by itself: {out}");
    let (code, out) = verify(&["--expect-head", &head]);
    assert!(code == Some(1) && out.contains("not in the chain"), "{out}");
}
