//! SPEC §13: the relay on outbox tables as their own designs define them,
//! started with the flags docs/guide/outbox-tables.md gives for each, in a
//! database `outbox-relay migrate` never touched. Every
//! table is created by its own DDL; rows already there and unpublished are
//! published first, those published already are not, and rows inserted
//! across a kill -9 of the relay arrive once each, in commit order.

use std::time::Duration;

use crate::common::*;
use outbox_relay::wire;

const T: Duration = Duration::from_secs(120);

struct Recipe {
    /// Database name and `--context`.
    ctx: &'static str,
    ddl: &'static str,
    flags: &'static [&'static str],
    /// Inserts row `$2`, unpublished, returning its id's text; `$1` is a
    /// fresh UUID's text for tables whose ids the producer makes.
    insert: &'static str,
    /// Marks every row so far as published (the polling worker's doing).
    publish_all: &'static str,
}

/// What [`load`] left: the ids it expects published, in commit order (as
/// the insert returned them), the relay still running.
struct Loaded {
    expected: Vec<String>,
    /// A time after the rows published before the relay: the audit's
    /// window starts there (those rows were never the stream's).
    since: String,
    relay: Service,
    pool: sqlx::PgPool,
}

/// Rows in the table before the relay's first start, then 300 more in
/// transactions of ten, the relay killed -9 a third of the way through and
/// started again while rows keep coming.
async fn load(recipe: &Recipe) -> Loaded {
    let stack = stack();
    // No `outbox-relay migrate`: the relay needs none of its tables.
    let (url, pool) = empty_db(&stack, &format!("t_{}", recipe.ctx)).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(recipe.ddl))
        .execute(&pool)
        .await
        .unwrap();
    let insert = |n: i32| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(recipe.insert))
                .bind(uuid::Uuid::new_v4().to_string())
                .bind(n)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    // Published by the worker this relay replaces: not again.
    for n in 0..5 {
        insert(-1 - n).await;
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(recipe.publish_all))
        .execute(&pool)
        .await
        .unwrap();
    let since: String = sqlx::query_scalar(
        "SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let mut expected = Vec::new();
    for n in 0..20 {
        expected.push(insert(n).await);
    }
    let mut relay = Service::relay(&url, &stack.nats_url, recipe.ctx, recipe.flags);
    let txn = |from: i32| {
        let pool = pool.clone();
        async move {
            let mut tx = pool.begin().await.unwrap();
            let mut ids = Vec::new();
            for n in from..from + 10 {
                let id: String = sqlx::query_scalar(sqlx::AssertSqlSafe(recipe.insert))
                    .bind(uuid::Uuid::new_v4().to_string())
                    .bind(n)
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                ids.push(id);
            }
            tx.commit().await.unwrap();
            ids
        }
    };
    for t in 0..30 {
        if t == 10 {
            relay.kill9();
        }
        if t == 20 {
            relay.restart();
        }
        expected.extend(txn(100 + t * 10).await);
    }
    relay.wait_ready();
    Loaded {
        expected,
        since,
        relay,
        pool,
    }
}

/// [`load`], then every expected row once, in commit order, in stream
/// `{CTX}_EVENTS`; and `outbox-relay audit` with the relay's flags agrees.
async fn relay_on(recipe: &Recipe) -> Vec<Got> {
    let Loaded {
        expected,
        since,
        relay,
        ..
    } = load(recipe).await;
    let got = read_stream(
        &stack().nats_url,
        &wire::stream_name(recipe.ctx),
        expected.len() as u64,
        T,
    )
    .await;
    assert_eq!(
        ids(&got),
        expected,
        "every unpublished row once, in commit order\n{}",
        relay.log_text()
    );
    let (code, out) = audit(recipe.ctx, &[recipe.flags, &["--since", &since]].concat());
    let n = expected.len();
    assert!(
        code == Some(0) && out.contains(&format!("{n} rows, {n} messages; 0 missing")),
        "the audit finds the stream whole: {out}"
    );
    got
}

/// `outbox-relay audit` on the recipe's database with its flags (and
/// `--last 1h` unless they give a window).
fn audit(ctx: &str, flags: &[&str]) -> (Option<i32>, String) {
    let url = db_url(&stack().admin_url, &format!("t_{ctx}"));
    if flags.contains(&"--repair") {
        // A team's own database: the repair is recorded in the admin log.
        let (code, out) = run_output_bounded(
            &["migrate", "--admin-log-only", "--database-url", &url],
            Duration::from_secs(30),
        );
        assert_eq!(code, Some(0), "{out}");
    }
    let nats = stack().nats_url;
    let mut args = vec!["audit", "--database-url", &url, "--context", ctx];
    args.extend(["--nats-url", &nats, "--wait", "20s"]);
    args.extend(flags);
    if !flags.contains(&"--last") && !flags.contains(&"--since") {
        args.extend(["--last", "1h"]);
    }
    run_output_bounded(&args, Duration::from_secs(60))
}

fn ids(got: &[Got]) -> Vec<String> {
    got.iter()
        .map(|g| g.h(wire::MSG_ID).unwrap_or("").to_owned())
        .collect()
}

/// The event-driven-architecture design's table: `topic` is the subject,
/// `envelope` the whole event and the body; the order key is
/// `envelope.partitionKey`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_envelope_table() {
    let got = relay_on(&Recipe {
        ctx: "billing",
        ddl: "CREATE TABLE outbox (id uuid primary key default gen_random_uuid(), \
              occurred_at timestamptz not null default now(), tenant_id uuid not null, \
              topic text not null, envelope jsonb not null, published_at timestamptz, \
              attempts int not null default 0, last_error text)",
        flags: &[
            "--table",
            "public.outbox",
            "--columns",
            "payload=envelope,subject=topic,aggregate_id=envelope.partitionKey,\
             event_type=envelope.eventType,event_version=envelope.eventVersion,\
             correlation_id=envelope.correlationId",
            "--header-columns",
            "tenant_id",
        ],
        insert: "INSERT INTO outbox (id, tenant_id, topic, envelope) VALUES ($1::uuid, \
                 '5b1c6c1e-0d6a-4c1b-9a57-7c1a3f0c2b11', 'billing.invoice.issued.v1', \
                 jsonb_build_object('eventId', $1::text, 'eventType', 'invoice.issued', \
                 'eventVersion', 1, 'partitionKey', 'inv-' || ($2 % 7), 'correlationId', 'c-' || $2, \
                 'payload', jsonb_build_object('n', $2))) RETURNING id::text",
        publish_all: "UPDATE outbox SET published_at = now()",
    })
    .await;
    let g = &got[0];
    assert_eq!(g.subject, "billing.invoice.issued.v1");
    assert_eq!(g.h(wire::AGGREGATE_ID), Some("inv-0"));
    assert_eq!(g.h(wire::EVENT_TYPE), Some("invoice.issued"));
    assert_eq!(g.h(wire::EVENT_VERSION), Some("1"));
    assert_eq!(g.h(wire::CORRELATION_ID), Some("c-0"));
    assert_eq!(
        g.h("Outbox-Tenant-Id"),
        Some("5b1c6c1e-0d6a-4c1b-9a57-7c1a3f0c2b11")
    );
    assert_eq!(g.h(wire::AGGREGATE_TYPE), None, "no column plays it");
    let body = g.json();
    assert_eq!(body["eventType"], "invoice.issued");
    assert_eq!(body["payload"]["n"], 0);
}

/// PolyShop's table: `event_type` (`order.order.placed.v1`) is the
/// subject; unpublished is `processed = false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_polyshop_table() {
    let got = relay_on(&Recipe {
        ctx: "order",
        ddl: "CREATE TABLE outbox_events (id uuid primary key, \
              aggregate_id text not null, event_type text not null, version int not null default 1, \
              payload json not null, created_at timestamptz not null default now(), \
              processed boolean not null default false, processed_at timestamptz, error_message text)",
        flags: &[
            "--table",
            "public.outbox_events",
            "--columns",
            "subject=event_type,event_version=version,occurred_at=created_at",
            "--unpublished",
            "processed = false",
        ],
        insert: "INSERT INTO outbox_events (id, aggregate_id, event_type, payload) \
                 VALUES ($1::uuid, 'o-' || $2, 'order.order.placed.v1', json_build_object('n', $2)) \
                 RETURNING id::text",
        publish_all: "UPDATE outbox_events SET processed = true, processed_at = now()",
    })
    .await;
    let g = &got[0];
    assert_eq!(g.subject, "order.order.placed.v1");
    assert_eq!(g.h(wire::AGGREGATE_ID), Some("o-0"));
    assert_eq!(g.h(wire::EVENT_VERSION), Some("1"));
    assert!(g.h(wire::OCCURRED_AT).is_some());
    assert_eq!(g.json()["n"], 0);
}

/// modkit's table: the subject is `{namespace}.{topic}`; `tenant_id` and
/// `dedupe_key` travel as headers; unpublished is `status <> 'delivered'`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_modkit_table() {
    let got = relay_on(&Recipe {
        ctx: "modkit",
        ddl: "CREATE TABLE modkit_outbox_events (id uuid primary key, namespace text not null, \
              topic text not null, tenant_id uuid null, dedupe_key text null, payload jsonb not null, \
              status text not null, attempts int not null default 0, \
              next_attempt_at timestamptz not null default now(), locked_by uuid null, \
              locked_until timestamptz null, last_error text null, \
              created_at timestamptz not null default now(), updated_at timestamptz not null default now())",
        flags: &[
            "--table",
            "public.modkit_outbox_events",
            "--subject-template",
            "{namespace}.{topic}",
            "--columns",
            "occurred_at=created_at",
            "--header-columns",
            "tenant_id,dedupe_key",
            "--unpublished",
            "status <> 'delivered'",
        ],
        insert: "INSERT INTO modkit_outbox_events (id, namespace, topic, tenant_id, dedupe_key, payload, status) \
                 VALUES ($1::uuid, 'modkit', 'user.created', NULL, 'k-' || $2, jsonb_build_object('n', $2), 'pending') \
                 RETURNING id::text",
        publish_all: "UPDATE modkit_outbox_events SET status = 'delivered'",
    })
    .await;
    let g = &got[0];
    assert_eq!(g.subject, "modkit.user.created");
    assert_eq!(g.h("Outbox-Dedupe-Key"), Some("k-0"));
    assert_eq!(g.h("Outbox-Tenant-Id"), None, "a null column is left out");
    assert_eq!(g.h(wire::AGGREGATE_ID), None);
}

/// DAARION's table: ids are UUIDs or snowflakes as text, `topic` is the
/// subject, and `stream` names the (pre-created) stream each row must land
/// in. Each stream gets its rows once, in commit order, across the kill -9;
/// a row naming a stream that does not exist (listed or not), or one that
/// does not capture its subject, is dead-lettered in the relay's own stream
/// with its reason, and the rows after it go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daarion_table_routes_each_row_to_its_stream() {
    let js = async_nats::jetstream::new(async_nats::connect(&stack().nats_url).await.unwrap());
    for (name, subjects) in [
        ("DAARION_ORDERS", "dorders.>"),
        ("DAARION_BILLING", "dbilling.>"),
    ] {
        let _ = js.delete_stream(name).await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: name.into(),
            subjects: vec![subjects.into()],
            // Short: the relay's own resume, not the window, keeps the
            // replay after the kill -9 from storing repeats.
            duplicate_window: Duration::from_millis(100),
            ..Default::default()
        })
        .await
        .unwrap();
    }
    let Loaded {
        expected,
        since,
        relay,
        pool,
    } = load(&Recipe {
        ctx: "daarion",
        ddl: "CREATE TABLE outbox_events (id text primary key, stream text not null, \
              topic text not null, payload jsonb not null, created_at timestamptz default now(), \
              processed bool default false, processed_at timestamptz, error text)",
        flags: DAARION_FLAGS,
        // Even rows are orders, odd ones invoices; every third id a UUID,
        // the others snowflakes.
        insert: "INSERT INTO outbox_events (id, stream, topic, payload) VALUES ( \
                 CASE WHEN $2 % 3 = 0 THEN $1 ELSE (1160481716839288832 + $2)::text END, \
                 CASE WHEN $2 % 2 = 0 THEN 'DAARION_ORDERS' ELSE 'DAARION_BILLING' END, \
                 CASE WHEN $2 % 2 = 0 THEN 'dorders.order.placed.v1' ELSE 'dbilling.invoice.issued.v1' END, \
                 jsonb_build_object('n', $2)) RETURNING stream || ' ' || id",
        publish_all: "UPDATE outbox_events SET processed = true, processed_at = now()",
    })
    .await;
    for stream in ["DAARION_ORDERS", "DAARION_BILLING"] {
        let want: Vec<String> = expected
            .iter()
            .filter_map(|e| e.strip_prefix(&format!("{stream} ")))
            .map(str::to_owned)
            .collect();
        let got = read_stream(&stack().nats_url, stream, want.len() as u64, T).await;
        assert_eq!(
            ids(&got),
            want,
            "{stream}: its rows once, in commit order\n{}",
            relay.log_text()
        );
        assert!(got
            .iter()
            .all(|g| g.h("Nats-Expected-Stream") == Some(stream)));
    }
    // Rows no stream can take, between rows that go on.
    sqlx::raw_sql(
        "INSERT INTO outbox_events (id, stream, topic, payload) VALUES \
         ('bad-1', 'DAARION_PAYMENTS', 'dpayments.paid.v1', '{}'), \
         ('bad-2', 'ELSEWHERE', 'dorders.order.placed.v1', '{}'), \
         ('bad-3', 'DAARION_ORDERS', 'dbilling.invoice.issued.v1', '{}'), \
         ('after', 'DAARION_ORDERS', 'dorders.order.placed.v1', '{}')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let dead = read_stream(&stack().nats_url, &wire::stream_name("daarion"), 3, T).await;
    let why: Vec<(&str, &str)> = dead
        .iter()
        .map(|g| (g.h(wire::MSG_ID).unwrap(), g.h(wire::DLQ_REASON).unwrap()))
        .collect();
    assert_eq!(
        why,
        [
            ("bad-1", "stream_missing"),
            ("bad-2", "stream_missing"),
            ("bad-3", "subject_outside_stream")
        ]
    );
    assert!(dead[0]
        .h(wire::DLQ_DETAIL)
        .unwrap()
        .contains("does not exist"));
    assert!(dead[1]
        .h(wire::DLQ_DETAIL)
        .unwrap()
        .contains("not one of --streams"));
    eventually(T, "the row after them published", || async {
        let now = read_stream(&stack().nats_url, "DAARION_ORDERS", 0, Duration::ZERO).await;
        now.last().and_then(|g| g.h(wire::MSG_ID)) == Some("after")
    })
    .await;
    // Every stream the rows name, and the dead letters, account for them;
    // the dead letters are findings of their own (issue 62 item 1).
    let n = expected.len() + 4;
    let (code, out) = audit("daarion", &[DAARION_FLAGS, &["--since", &since]].concat());
    assert!(
        code == Some(1)
            && out.contains(&format!("{n} rows, {n} messages; 0 missing"))
            && out.contains("3 dead-lettered"),
        "{out}"
    );
    // Review A11 (a): a CronJob without the relay's OUTBOX_STREAMS reads
    // its own stream alone. The rows routed elsewhere are not holes it can
    // judge: it says which stream they name and what to pass (before: each
    // a "missing" row, exit 1, and --repair would have sent them again).
    let mut unlisted = DAARION_FLAGS.to_vec();
    let at = unlisted.iter().position(|f| *f == "--streams").unwrap();
    unlisted.drain(at..at + 2);
    let (code, out) = audit("daarion", &[&unlisted[..], &["--since", &since]].concat());
    assert!(
        code == Some(2)
            && !out.lines().any(|l| l.starts_with("missing "))
            && out.contains("DAARION_ORDERS")
            && out.contains("--streams"),
        "{out}"
    );
}

const DAARION_FLAGS: &[&str] = &[
    "--table",
    "public.outbox_events",
    "--columns",
    "subject=topic,occurred_at=created_at",
    "--streams",
    "DAARION_ORDERS,DAARION_BILLING,DAARION_PAYMENTS",
    "--unpublished",
    "NOT processed",
];

/// Issue 57, item 7: a stream `--streams` names, missing when the relay
/// started (not created yet, or deleted and being re-created with new
/// settings). Its rows are dead-lettered (`stream_missing`) while it is
/// missing; once it exists, rows naming it land in it. Before: every row
/// naming it went on being dead-lettered until the relay restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_created_while_the_relay_runs_takes_its_rows() {
    let stack = stack();
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let _ = js.delete_stream("REROUTE_PAY").await;
    let (url, pool) = empty_db(&stack, "t_reroute").await;
    sqlx::raw_sql(
        "CREATE TABLE outbox_events (id text primary key, stream text not null, \
         topic text not null, payload jsonb not null, created_at timestamptz default now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let flags = [
        "--table",
        "public.outbox_events",
        "--columns",
        "subject=topic,occurred_at=created_at",
        "--streams",
        "REROUTE_PAY",
    ];
    let insert = |id: String| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO outbox_events (id, stream, topic, payload) \
                 VALUES ($1, 'REROUTE_PAY', 'rpay.paid.v1', '{}')",
            )
            .bind(id)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    let mut relay = Service::relay(&url, &stack.nats_url, "reroute", &flags);
    relay.wait_ready();
    insert("early".into()).await;
    let dead = read_stream(&stack.nats_url, &wire::stream_name("reroute"), 1, T).await;
    assert_eq!(dead[0].h(wire::DLQ_REASON), Some("stream_missing"));
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "REROUTE_PAY".into(),
        subjects: vec!["rpay.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let own_stream = wire::stream_name("reroute");
    let holds = |stream: String, id: String| {
        let url = stack.nats_url.clone();
        async move {
            read_stream(&url, &stream, 0, Duration::ZERO)
                .await
                .iter()
                .any(|g| g.h(wire::MSG_ID) == Some(id.as_str()))
        }
    };
    let deadline = std::time::Instant::now() + T;
    let mut n = 0;
    loop {
        n += 1;
        let id = format!("late-{n}");
        insert(id.clone()).await;
        eventually(T, "the row published or dead-lettered", || async {
            holds("REROUTE_PAY".into(), id.clone()).await
                || holds(own_stream.clone(), id.clone()).await
        })
        .await;
        if holds("REROUTE_PAY".into(), id.clone()).await {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "rows naming the stream are dead-lettered though it exists: {}",
            relay.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let own = read_stream(&stack.nats_url, &own_stream, 0, Duration::ZERO).await;
    let landed = read_stream(&stack.nats_url, "REROUTE_PAY", 0, Duration::ZERO).await;
    // Each row once: in the new stream, or a dead letter of the gap.
    assert_eq!(own.len() + landed.len(), n + 1, "{}", relay.log_text());
    assert!(relay.exited().is_none(), "{}", relay.log_text());
}

/// The most common outbox a team already has: uuid ids, and a uuid
/// `aggregate_id`, under the default column map. Each row is an event whose
/// `Nats-Aggregate-Id` is the uuid's text, backfilled and streamed alike.
/// Before, every row was an empty `bad_row` dead letter ("unsupported
/// column type oid 2950"), and the audit called the stream whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_with_a_uuid_aggregate_id() {
    let got = relay_on(&Recipe {
        ctx: "uuidagg",
        ddl: "CREATE TABLE team_outbox (id uuid primary key, aggregate_type text not null, \
              aggregate_id uuid not null, event_type text not null, payload jsonb not null, \
              occurred_at timestamptz not null default now(), published_at timestamptz)",
        flags: &[
            "--table",
            "public.team_outbox",
            "--unpublished",
            "published_at IS NULL",
            "--subject-template",
            "uuidagg.{aggregate_type}.{event_type}",
        ],
        insert: "INSERT INTO team_outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1::uuid, 'order', ('00000000-0000-0000-0000-' || lpad(abs($2)::text, 12, '0'))::uuid, \
                 'placed', jsonb_build_object('n', $2)) \
                 RETURNING id::text",
        publish_all: "UPDATE team_outbox SET published_at = now()",
    })
    .await;
    for g in &got {
        let n = g.json()["n"]
            .as_i64()
            .expect("the row's payload is the body");
        let want = format!("00000000-0000-0000-0000-{:012}", n.abs());
        assert_eq!(g.h(wire::AGGREGATE_ID), Some(want.as_str()), "row {n}");
    }
}

/// A team's table whose subject names an enum column and whose headers
/// carry numeric and date columns: each is the type's own text (its output
/// function's), streamed as backfilled. Before, binary tuples carried those
/// columns in a form the relay does not read: every streamed row was a
/// dead letter, while the backfill published the same rows fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_with_enum_numeric_and_date_columns_in_subject_and_headers() {
    let got = relay_on(&Recipe {
        ctx: "typedcols",
        ddl: "CREATE TYPE order_kind AS ENUM ('retail', 'wholesale'); \
              CREATE TABLE typed_outbox (id uuid primary key, aggregate_type text not null, \
              aggregate_id text not null, event_type text not null, kind order_kind not null, \
              amount numeric(12,2) not null, due date not null, payload jsonb not null, \
              occurred_at timestamptz not null default now(), published_at timestamptz)",
        flags: &[
            "--table",
            "public.typed_outbox",
            "--unpublished",
            "published_at IS NULL",
            "--subject-template",
            "typedcols.{kind}.{event_type}",
            "--header-columns",
            "amount,due",
        ],
        insert: "INSERT INTO typed_outbox (id, aggregate_type, aggregate_id, event_type, kind, amount, due, payload) \
                 VALUES ($1::uuid, 'order', 'o' || $2, 'placed', \
                 (CASE WHEN $2 % 2 = 0 THEN 'retail' ELSE 'wholesale' END)::order_kind, \
                 $2 * 1.25, date '2026-01-01' + abs($2), jsonb_build_object('n', $2)) \
                 RETURNING id::text",
        publish_all: "UPDATE typed_outbox SET published_at = now()",
    })
    .await;
    let (amount, due) = (wire::column_header("amount"), wire::column_header("due"));
    for g in &got {
        let n = g.json()["n"]
            .as_i64()
            .expect("the row's payload is the body");
        let kind = if n % 2 == 0 { "retail" } else { "wholesale" };
        assert_eq!(g.subject, format!("typedcols.{kind}.placed"), "row {n}");
        let want_amount = format!("{:.2}", n as f64 * 1.25);
        assert_eq!(g.h(&amount), Some(want_amount.as_str()), "row {n}");
        let want_due = (time::Date::from_calendar_date(2026, time::Month::January, 1).unwrap()
            + time::Duration::days(n.abs()))
        .to_string();
        assert_eq!(g.h(&due), Some(want_due.as_str()), "row {n}");
    }
}

/// A mapped generated column: logical replication leaves it out of the
/// rows it sends (before PostgreSQL 18, and from 18 unless the publication
/// publishes generated columns), so the relay refuses it at start in one
/// line naming the column and what to run. Before, it started, and every
/// streamed row lacked the column: a dead letter each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_generated_column_is_refused_at_start() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_generated").await;
    sqlx::raw_sql(
        "CREATE TABLE gen_outbox (id uuid primary key, aggregate_type text not null, \
         event_type text not null, payload jsonb not null, \
         aggregate_id text GENERATED ALWAYS AS (payload->>'order') STORED, \
         region text GENERATED ALWAYS AS (payload->>'region') STORED, \
         occurred_at timestamptz not null default now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    for (flags, column) in [
        (
            vec![
                "--subject-template",
                "generated.{aggregate_type}.{event_type}",
            ],
            "aggregate_id",
        ),
        (
            vec![
                "--columns",
                "aggregate_id=id",
                "--subject-template",
                "generated.{region}.{event_type}",
            ],
            "region",
        ),
    ] {
        let mut args = vec!["--table", "public.gen_outbox"];
        args.extend(flags);
        let (code, err) = run_relay_bounded(&url, &stack.nats_url, "generated", &args);
        assert_eq!(code, Some(1), "{column}: {err}");
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert!(
            errors.len() == 1
                && errors[0].contains(&format!("column {column} "))
                && errors[0].contains("generated"),
            "one line naming {column}: {err}"
        );
    }
}

/// A publication whose column list (PostgreSQL 15+) leaves out a column
/// the flags map: logical replication leaves it out of every row it
/// sends, so the relay refuses at start, in one line naming the column and
/// the list. Before: it started, and every row's header lacked the column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapped_column_a_publication_column_list_leaves_out_is_refused_at_start() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_collist").await;
    sqlx::raw_sql(
        "CREATE TABLE collist_outbox (id uuid primary key, aggregate_type text not null, \
         aggregate_id text not null, event_type text not null, event_version int not null default 1, \
         payload jsonb not null, tenant text, occurred_at timestamptz not null default now()); \
         CREATE PUBLICATION collist_pub FOR TABLE collist_outbox \
           (id, aggregate_type, aggregate_id, event_type, event_version, payload, occurred_at) \
           WITH (publish = 'insert')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let args = [
        "--table",
        "public.collist_outbox",
        "--publication",
        "collist_pub",
        "--header-columns",
        "tenant",
    ];
    let (code, err) = run_relay_bounded(&url, &stack.nats_url, "collist", &args);
    assert_eq!(code, Some(1), "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert!(
        errors.len() == 1
            && errors[0].contains("column tenant ")
            && errors[0].contains("column list"),
        "one line naming tenant: {err}"
    );
    // Without the header column the list holds every mapped column: it
    // streams (through that publication: a filtered one is not replaced).
    let mut relay = Service::relay(
        &url,
        &stack.nats_url,
        "collist",
        &[
            "--table",
            "public.collist_outbox",
            "--publication",
            "collist_pub",
        ],
    );
    relay.wait_ready();
    assert!(
        relay.log_text().contains("keeps no publication of its own"),
        "{}",
        relay.log_text()
    );
}

/// Migrations while the relay streams (SPEC §13): a column added that
/// plays no role changes nothing, even one named like a role (`stream`); a
/// mapped column renamed stops the relay before it confirms the first row
/// that lacks it, in one line naming the column, and a restart with the
/// map fixed publishes that row. No row is dead-lettered. Before, the new
/// `stream` column took the role and its row was a `stream_missing` dead
/// letter, and the renamed header column dead-lettered every later row
/// while the relay ran on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_while_streaming_loses_no_row() {
    let stack = stack();
    let (url, pool) = empty_db(&stack, "t_migrate").await;
    sqlx::raw_sql(
        "CREATE TABLE mig_outbox (id uuid primary key, aggregate_type text not null, \
         aggregate_id text not null, event_type text not null, payload jsonb not null, \
         tenant text, occurred_at timestamptz not null default now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let flags = |tenant: &'static str| {
        vec![
            "--table",
            "public.mig_outbox",
            "--subject-template",
            "migrate.{aggregate_type}.{event_type}",
            "--header-columns",
            tenant,
        ]
    };
    let insert = |n: i32, tenant: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!(
                "INSERT INTO mig_outbox (id, aggregate_type, aggregate_id, event_type, payload, {tenant}) \
                 VALUES (gen_random_uuid(), 'order', 'o1', 'placed', jsonb_build_object('n', $1), 't1') \
                 RETURNING id::text"
            )))
            .bind(n)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let relay = Service::relay(&url, &stack.nats_url, "migrate", &flags("tenant"));
    let mut expected = vec![insert(0, "tenant").await];
    sqlx::raw_sql("ALTER TABLE mig_outbox ADD COLUMN stream text DEFAULT 'NOWHERE'")
        .execute(&pool)
        .await
        .unwrap();
    expected.push(insert(1, "tenant").await);
    let got = read_stream(&stack.nats_url, &wire::stream_name("migrate"), 2, T).await;
    assert_eq!(ids(&got), expected, "{}", relay.log_text());
    sqlx::raw_sql("ALTER TABLE mig_outbox RENAME COLUMN tenant TO tenant_id")
        .execute(&pool)
        .await
        .unwrap();
    expected.push(insert(2, "tenant_id").await);
    let log = halted(&relay, "the relay halts at a renamed mapped column").await;
    let errors: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("ERROR") || l.starts_with("error"))
        .collect();
    assert!(
        errors
            .iter()
            .any(|l| l.contains("tenant") && l.contains("--header-columns")),
        "one line naming the column and the flag: {log}"
    );
    // The `stream` column added while it ran would take its role by name
    // at a start: the fixed map says it plays none.
    let mut fixed = flags("tenant_id");
    fixed.extend(["--columns", "stream=-"]);
    drop(relay);
    let mut relay = Service::relay(&url, &stack.nats_url, "migrate", &fixed);
    relay.wait_ready();
    let got = read_stream(&stack.nats_url, &wire::stream_name("migrate"), 3, T).await;
    assert_eq!(ids(&got), expected, "{}", relay.log_text());
    for g in &got {
        assert!(
            g.subject.starts_with("migrate.order."),
            "an event, not a dead letter: {}",
            g.subject
        );
        assert!(!g.payload.is_empty());
    }
    assert_eq!(got[2].h(&wire::column_header("tenant_id")), Some("t1"));
}

/// A halt drains first: the transactions of the old layout the relay has
/// read are published and confirmed before it stops, so the restart with
/// the fixed flags starts after them. Before, a halt dropped what was in
/// flight: with atomic batches (one in flight at a time) and the stream's
/// acks 1.5 s on their way (a slow path), the old transactions queued
/// behind the first were never sent, and the fixed start read them again
/// under the new map and halted on them too (the guide said to start once
/// with the old flags, then with the new).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_halt_publishes_and_confirms_what_it_read_before_it_stops() {
    let stack = stack();
    let (url, pool) = empty_db(&stack, "t_halting").await;
    sqlx::raw_sql(
        "CREATE TABLE halting_outbox (id uuid primary key, aggregate_type text not null, \
         aggregate_id text not null, event_type text not null, payload jsonb not null, \
         occurred_at timestamptz not null default now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let flags = |payload: &'static str| {
        vec![
            "--table",
            "public.halting_outbox",
            "--subject-template",
            "halting.{aggregate_type}.{event_type}",
            "--publish-mode",
            "batch",
            "--columns",
            payload,
        ]
    };
    let insert = |payload: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!(
                "INSERT INTO halting_outbox (id, aggregate_type, aggregate_id, event_type, {payload}) \
                 VALUES (gen_random_uuid(), 'order', 'o1', 'placed', '{{}}') RETURNING id::text"
            )))
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let proxy = Proxy::start(&stack.nats_url.replace("nats://", "")).await;
    let mut relay = Service::relay(
        &url,
        &proxy.nats_url(),
        "halting",
        &flags("payload=payload"),
    );
    relay.wait_ready();
    let mut expected = vec![insert("payload").await];
    read_stream(&stack.nats_url, &wire::stream_name("halting"), 1, T).await;
    proxy.delay(Duration::from_millis(1500));
    // Old transactions, then the rename and a row of the new layout, in
    // quick succession: at the halt the first old batch waits for its ack
    // and the others wait behind it.
    for _ in 0..3 {
        expected.push(insert("payload").await);
    }
    sqlx::raw_sql("ALTER TABLE halting_outbox RENAME COLUMN payload TO body")
        .execute(&pool)
        .await
        .unwrap();
    expected.push(insert("body").await);
    halted(&relay, "the relay halts at the renamed payload column").await;
    drop(relay);
    proxy.delay(Duration::ZERO);
    let mut relay = Service::relay(&url, &stack.nats_url, "halting", &flags("payload=body"));
    relay.wait_ready();
    let got = read_stream(&stack.nats_url, &wire::stream_name("halting"), 5, T).await;
    assert_eq!(ids(&got), expected, "{}", relay.log_text());
    assert_eq!(
        relay.scrape().await.value("outbox_relay_halted"),
        Some(0.0),
        "{}",
        relay.log_text()
    );
}

/// Issue 57, item 6: the outbox dropped from the publication while the
/// relay streams (`ALTER PUBLICATION … DROP TABLE`), rows written, and the
/// table added back; then the publication dropped and made again.
/// pgoutput leaves out what the session's publication did not publish when
/// it was written, even when read again. Before: the relay halted, and
/// `audit --repair` published the rows written meanwhile after the rows
/// written since (commit order lost). Now the slot streams through a
/// publication the relay keeps (`{slot}_keep`): the edits cost
/// nothing, every row arrives once and in commit order, and a warning says
/// what changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_dropped_from_the_publication_while_streaming_loses_no_row() {
    let stack = stack();
    let (url, pool) = empty_db(&stack, "t_pubedit").await;
    sqlx::raw_sql(
        "CREATE TABLE pubedit_outbox (id uuid primary key, aggregate_type text not null, \
         aggregate_id text not null, event_type text not null, event_version int not null default 1, \
         payload jsonb not null, occurred_at timestamptz not null default now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let flags = ["--table", "public.pubedit_outbox"];
    let insert = |n: i32| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "INSERT INTO pubedit_outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES (gen_random_uuid(), 'order', 'o1', 'placed', jsonb_build_object('n', $1)) \
                 RETURNING id::text",
            )
            .bind(n)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let stream = wire::stream_name("pubedit");
    let mut relay = Service::relay(&url, &stack.nats_url, "pubedit", &flags);
    relay.wait_ready();
    let mut expected = vec![insert(0).await];
    let got = read_stream(&stack.nats_url, &stream, 1, T).await;
    assert_eq!(ids(&got), expected, "{}", relay.log_text());
    sqlx::raw_sql("ALTER PUBLICATION outbox_relay_pubedit DROP TABLE public.pubedit_outbox")
        .execute(&pool)
        .await
        .unwrap();
    for n in 1..=3 {
        expected.push(insert(n).await);
    }
    let got = read_stream(&stack.nats_url, &stream, 4, T).await;
    assert_eq!(ids(&got), expected, "{}", relay.log_text());
    eventually(T, "a warning names the publication kept", || async {
        relay.log_text().lines().any(|l| {
            l.contains("WARN")
                && l.contains("outbox_relay_pubedit no longer publishes")
                && l.contains("outbox_relay_pubedit_keep")
        })
    })
    .await;
    sqlx::raw_sql("ALTER PUBLICATION outbox_relay_pubedit ADD TABLE public.pubedit_outbox")
        .execute(&pool)
        .await
        .unwrap();
    for n in 4..=5 {
        expected.push(insert(n).await);
    }
    let got = read_stream(&stack.nats_url, &stream, 6, T).await;
    assert_eq!(ids(&got), expected, "{}", relay.log_text());
    sqlx::raw_sql("DROP PUBLICATION outbox_relay_pubedit")
        .execute(&pool)
        .await
        .unwrap();
    expected.push(insert(6).await);
    sqlx::raw_sql(
        "CREATE PUBLICATION outbox_relay_pubedit FOR TABLE public.pubedit_outbox WITH (publish = 'insert')",
    )
    .execute(&pool)
    .await
    .unwrap();
    expected.push(insert(7).await);
    let got = read_stream(&stack.nats_url, &stream, 8, T).await;
    assert_eq!(ids(&got), expected, "{}", relay.log_text());
    assert_eq!(relay.scrape().await.value("outbox_relay_halted"), Some(0.0));
    // Nothing for the audit to find, nothing to repair.
    let (code, out) = audit(
        "pubedit",
        &["--table", "public.pubedit_outbox", "--last", "1h"],
    );
    assert_eq!(code, Some(0), "{out}");
}

/// A slot older than the publication the relay keeps (a relay upgraded to
/// this version, or the kept publication dropped): pgoutput cannot be asked
/// for a publication made after WAL it still decodes (`publication … does
/// not exist`), so the relay streams without it until the slot's
/// `restart_lsn` passes its making, then starts the session over with it;
/// from then on an edit of the operator's publication loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_older_than_the_kept_publication_streams_through_it_once_past_its_making() {
    let stack = stack();
    let (url, pool) = empty_db(&stack, "t_keptlater").await;
    sqlx::raw_sql(
        "CREATE TABLE keptlater_outbox (id uuid primary key, aggregate_type text not null, \
         aggregate_id text not null, event_type text not null, event_version int not null default 1, \
         payload jsonb not null, occurred_at timestamptz not null default now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let flags = ["--table", "public.keptlater_outbox"];
    let insert = || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>(
                "INSERT INTO keptlater_outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES (gen_random_uuid(), 'order', 'o1', 'placed', '{}') RETURNING id::text",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let stream = wire::stream_name("keptlater");
    let mut relay = Service::relay(&url, &stack.nats_url, "keptlater", &flags);
    relay.wait_ready();
    let mut expected = vec![insert().await];
    read_stream(&stack.nats_url, &stream, 1, T).await;
    drop(relay);
    sqlx::raw_sql("DROP PUBLICATION outbox_relay_keptlater_keep")
        .execute(&pool)
        .await
        .unwrap();
    // Written before the kept publication is made again, and still to be
    // decoded: a transaction open across its making, too.
    expected.push(insert().await);
    let mut open = pool.begin().await.unwrap();
    let straddling: String = sqlx::query_scalar(
        "INSERT INTO keptlater_outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'o1', 'placed', '{}') RETURNING id::text",
    )
    .fetch_one(&mut *open)
    .await
    .unwrap();
    let mut relay = Service::relay(&url, &stack.nats_url, "keptlater", &flags);
    relay.wait_ready();
    eventually(T, "the kept publication made again", || async {
        relay.log_text().contains("created the kept publication")
    })
    .await;
    assert!(
        relay
            .log_text()
            .contains("streaming through --publication until the slot passes that position"),
        "{}",
        relay.log_text()
    );
    let through_kept = || {
        relay
            .log_text()
            .lines()
            .any(|l| l.contains("publication=outbox_relay_keptlater_keep") && l.contains(" from="))
    };
    // While the transaction that began before the publication was made is
    // open, the slot may still decode its first row: rows after it are
    // published and confirmed, running-transactions records are written
    // (a checkpoint writes one), and the session must not switch (the
    // slot's confirmed position passes the making; its restart_lsn does
    // not).
    for _ in 0..3 {
        expected.push(insert().await);
        read_stream(&stack.nats_url, &stream, expected.len() as u64, T).await;
        sqlx::raw_sql("CHECKPOINT").execute(&pool).await.unwrap();
    }
    expected.push(insert().await);
    read_stream(&stack.nats_url, &stream, expected.len() as u64, T).await;
    eventually(T, "the slot confirmed past the kept publication's making", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT s.confirmed_flush_lsn >= split_part(split_part(\
                      obj_description(p.oid, 'pg_publication'), 'WAL position ', 2), '.', 1)::pg_lsn \
             FROM pg_replication_slots s, pg_publication p \
             WHERE s.slot_name = 'outbox_relay_keptlater' AND p.pubname = 'outbox_relay_keptlater_keep'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    })
    .await;
    // Two of the relay's checks (one a second) to act on it wrongly.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!through_kept(), "{}", relay.log_text());
    open.commit().await.unwrap();
    expected.push(straddling);
    expected.push(insert().await);
    let got = read_stream(&stack.nats_url, &stream, expected.len() as u64, T).await;
    assert_eq!(ids(&got), expected, "{}", relay.log_text());
    assert!(
        !relay.log_text().contains("does not exist"),
        "{}",
        relay.log_text()
    );
    // Once the slot has passed it (a running-transactions record moves
    // restart_lsn: a checkpoint a second writes one now), the session
    // starts over through the kept publication.
    let mut last_checkpoint = std::time::Instant::now();
    eventually(
        Duration::from_secs(90),
        "a session through the kept publication",
        || {
            let due = last_checkpoint.elapsed() >= Duration::from_secs(1);
            if due {
                last_checkpoint = std::time::Instant::now();
            }
            let pool = pool.clone();
            let seen = through_kept();
            async move {
                if due && !seen {
                    sqlx::raw_sql("CHECKPOINT").execute(&pool).await.unwrap();
                    insert_quiet(&pool).await;
                }
                seen
            }
        },
    )
    .await;
    sqlx::raw_sql("ALTER PUBLICATION outbox_relay_keptlater DROP TABLE public.keptlater_outbox")
        .execute(&pool)
        .await
        .unwrap();
    let last = insert().await;
    eventually(
        T,
        "the row written with the outbox out of --publication",
        || async {
            ids(&read_stream(&stack.nats_url, &stream, 0, Duration::ZERO).await).contains(&last)
        },
    )
    .await;
    let all = ids(&read_stream(&stack.nats_url, &stream, 0, Duration::ZERO).await);
    assert_eq!(
        &all[..expected.len()],
        &expected[..],
        "{}",
        relay.log_text()
    );
    assert_eq!(all.last(), Some(&last), "in commit order");
    let mut once = all.clone();
    once.sort();
    once.dedup();
    assert_eq!(once.len(), all.len(), "each once: {all:?}");
    eventually(
        T,
        "the gauge says the kept publication carries the outbox",
        || async { relay.scrape().await.value("outbox_relay_publication_kept") == Some(1.0) },
    )
    .await;
    assert_eq!(relay.scrape().await.value("outbox_relay_halted"), Some(0.0));
}

/// A row nobody waits for: what moves the slot along.
async fn insert_quiet(pool: &sqlx::PgPool) {
    sqlx::raw_sql(
        "INSERT INTO keptlater_outbox (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES (gen_random_uuid(), 'order', 'o1', 'placed', '{}')",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// Issue 57, item 6, the other changes that take the outbox out of the
/// slot while the relay streams: each stops it, in one line saying what
/// happened. Before, the relay ran on, and the renamed table's rows were
/// skipped as another table's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rename_or_a_quick_drop_and_add_of_the_outbox_stops_the_relay() {
    // Renamed: its rows arrive under the new name, and are published once
    // the name is back.
    stops_on(
        "renamed",
        &["ALTER TABLE renamed_outbox RENAME TO renamed_outbox_old"],
        "renamed_outbox_old",
        &["renamed"],
        &["ALTER TABLE renamed_outbox_old RENAME TO renamed_outbox"],
    )
    .await;
    // Out of the publication the slot streams through (the one the relay
    // keeps) and back within a second: the rows written between are not in
    // the slot, though every check may see it published.
    stops_on(
        "readded",
        &[
            "ALTER PUBLICATION outbox_relay_readded_keep DROP TABLE readded_outbox",
            "INSERT INTO readded_outbox (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES (gen_random_uuid(), 'order', 'o1', 'placed', '{}')",
            "ALTER PUBLICATION outbox_relay_readded_keep ADD TABLE readded_outbox",
        ],
        "readded_outbox",
        // A check between the two statements sees it out.
        &["joined it again", "does not publish"],
        &[],
    )
    .await;
}

/// Found in review: a relay halted on a renamed outbox tries a session
/// again every 30 s, and an empty table made under the old name meanwhile
/// (a `migrate`, as `/readyz` had suggested) was streamed from instead: the
/// renamed table's rows were never read. A later session of the process
/// refuses another table under the outbox's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_halted_relay_does_not_resume_on_another_table_under_the_outbox_name() {
    let stack = stack();
    let (url, pool) = empty_db(&stack, "t_remade").await;
    let create = "CREATE TABLE remade_outbox (id uuid primary key, aggregate_type text not null, \
         aggregate_id text not null, event_type text not null, event_version int not null default 1, \
         payload jsonb not null, occurred_at timestamptz not null default now())";
    sqlx::raw_sql(create).execute(&pool).await.unwrap();
    let mut relay = Service::relay(
        &url,
        &stack.nats_url,
        "remade",
        &["--table", "public.remade_outbox"],
    );
    relay.wait_ready();
    sqlx::raw_sql("ALTER TABLE remade_outbox RENAME TO remade_outbox_old")
        .execute(&pool)
        .await
        .unwrap();
    halted(&relay, "halted on the rename").await;
    sqlx::raw_sql(create).execute(&pool).await.unwrap();
    sqlx::raw_sql("ALTER PUBLICATION outbox_relay_remade ADD TABLE remade_outbox")
        .execute(&pool)
        .await
        .unwrap();
    // The next try (30 s on) meets the new table.
    eventually(
        Duration::from_secs(90),
        "the retry refuses the new table",
        || async { relay.log_text().contains("another table now") },
    )
    .await;
    assert_eq!(
        relay.scrape().await.value("outbox_relay_halted"),
        Some(1.0),
        "{}",
        relay.log_text()
    );
}

/// A relay on `{ctx}_outbox`; one row streamed; then `change`, one
/// statement at a time, and a row into `table`: the relay must stop, its
/// line containing one of `says`.
/// Then, if there is a `heal`, it is run and the relay started again: the
/// row written after the change is published.
async fn stops_on(ctx: &str, change: &[&str], table: &str, says: &[&str], heal: &[&str]) {
    let stack = stack();
    let (url, pool) = empty_db(&stack, &format!("t_{ctx}")).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {ctx}_outbox (id uuid primary key, aggregate_type text not null, \
         aggregate_id text not null, event_type text not null, event_version int not null default 1, \
         payload jsonb not null, occurred_at timestamptz not null default now())"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let own = format!("public.{ctx}_outbox");
    let mut relay = Service::relay(&url, &stack.nats_url, ctx, &["--table", &own]);
    relay.wait_ready();
    let insert = |table: String| {
        let pool = pool.clone();
        async move {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES (gen_random_uuid(), 'order', 'o1', 'placed', '{{}}')"
            )))
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    insert(format!("{ctx}_outbox")).await;
    read_stream(&stack.nats_url, &wire::stream_name(ctx), 1, T).await;
    for sql in change {
        sqlx::raw_sql(sqlx::AssertSqlSafe(*sql))
            .execute(&pool)
            .await
            .unwrap();
    }
    insert(table.to_owned()).await;
    let log = halted(&relay, &format!("{ctx}: the relay halts")).await;
    assert!(
        log.lines()
            .any(|l| (l.contains("ERROR") || l.starts_with("error"))
                && says.iter().any(|s| l.contains(s))
                && l.contains("audit")),
        "{ctx}: one line saying {says:?}: {log}"
    );
    if heal.is_empty() {
        return;
    }
    for sql in heal {
        sqlx::raw_sql(sqlx::AssertSqlSafe(*sql))
            .execute(&pool)
            .await
            .unwrap();
    }
    drop(relay);
    let relay = Service::relay(&url, &stack.nats_url, ctx, &["--table", &own]);
    let got = read_stream(&stack.nats_url, &wire::stream_name(ctx), 2, T).await;
    assert_eq!(got.len(), 2, "{ctx}: {}", relay.log_text());
    assert!(
        got[1].subject.starts_with(&format!("{ctx}.")),
        "{}",
        got[1].subject
    );
}

/// Wait until `relay` halts (it streamed, then met a change it cannot go
/// past): `outbox_relay_halted` 1 and `/readyz` saying why; its log.
async fn halted(relay: &Service, what: &str) -> String {
    eventually(T, what, || async {
        relay.scrape().await.value("outbox_relay_halted") == Some(1.0)
    })
    .await;
    let (code, body) = relay.http_get("/readyz").await;
    assert!(code == 503 && body.contains("halted"), "{code} {body}");
    relay.log_text()
}

/// A column added while the relay was down, that the next start maps by
/// its name (`correlation_id`): the rows written before it, read on the
/// replay, have no such column and are published without it; the rows
/// after carry it. Found in review: the map pinned at that start asked
/// every row for the column, and the relay stopped at the first old one,
/// with no flags that could get past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_added_while_the_relay_was_down_is_read_where_it_is() {
    let stack = stack();
    let (url, pool) = empty_db(&stack, "t_added").await;
    sqlx::raw_sql(
        "CREATE TABLE add_outbox (id uuid primary key, aggregate_type text not null, \
         aggregate_id text not null, event_type text not null, payload jsonb not null, \
         occurred_at timestamptz not null default now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let insert = |n: i32, with: bool| {
        let pool = pool.clone();
        async move {
            let (cols, vals) = match with {
                true => (
                    ", correlation_id",
                    ", '11111111-2222-3333-4444-555555555555'",
                ),
                false => ("", ""),
            };
            sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!(
                "INSERT INTO add_outbox (id, aggregate_type, aggregate_id, event_type, payload{cols}) \
                 VALUES (gen_random_uuid(), 'order', 'o1', 'placed', jsonb_build_object('n', $1){vals}) \
                 RETURNING id::text"
            )))
            .bind(n)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    let flags = [
        "--table",
        "public.add_outbox",
        "--subject-template",
        "added.{aggregate_type}.{event_type}",
    ];
    let mut relay = Service::relay(&url, &stack.nats_url, "added", &flags);
    let mut expected = vec![insert(0, false).await];
    read_stream(&stack.nats_url, &wire::stream_name("added"), 1, T).await;
    relay.term(T);
    expected.push(insert(1, false).await);
    sqlx::raw_sql("ALTER TABLE add_outbox ADD COLUMN correlation_id uuid")
        .execute(&pool)
        .await
        .unwrap();
    expected.push(insert(2, true).await);
    let relay = Service::relay(&url, &stack.nats_url, "added", &flags);
    let got = read_stream(&stack.nats_url, &wire::stream_name("added"), 3, T).await;
    assert_eq!(ids(&got), expected, "{}", relay.log_text());
    for g in &got {
        assert!(
            g.subject.starts_with("added.order."),
            "an event: {}",
            g.subject
        );
    }
    assert_eq!(got[1].h(wire::CORRELATION_ID), None);
    assert_eq!(
        got[2].h(wire::CORRELATION_ID),
        Some("11111111-2222-3333-4444-555555555555")
    );
}

/// A ledger keyed by a bigint identity whose payload is bytea: the id's
/// decimal is `Nats-Msg-Id`, the bytes are the body as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_keyed_by_bigint_with_a_bytea_payload() {
    let got = relay_on(&Recipe {
        ctx: "ledger",
        ddl: "CREATE TABLE ledger_outbox (id bigint generated always as identity primary key, \
              topic text not null, body bytea not null, created_at timestamptz not null default now(), \
              sent boolean not null default false)",
        flags: &[
            "--table",
            "public.ledger_outbox",
            "--columns",
            "payload=body,subject=topic,occurred_at=created_at",
            "--unpublished",
            "NOT sent",
        ],
        insert: "INSERT INTO ledger_outbox (topic, body) \
                 VALUES ('ledger.entry.posted.v1', convert_to(json_build_object('n', $2, 'u', $1)::text, 'UTF8')) \
                 RETURNING id::text",
        publish_all: "UPDATE ledger_outbox SET sent = true",
    })
    .await;
    let g = &got[0];
    assert_eq!(g.subject, "ledger.entry.posted.v1");
    assert_eq!(
        g.h(wire::MSG_ID),
        Some("6"),
        "the five sent before are not again"
    );
    assert_eq!(g.json()["n"], 0, "the bytea's bytes are the body");
}

/// A map that does not fit the table stops the relay at start with one
/// line naming the role and listing the table's columns; nothing is
/// published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_column_map_is_one_line_naming_the_role_and_the_columns() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_badmap").await;
    sqlx::raw_sql(
        "CREATE TABLE outbox (id uuid primary key, topic text not null, envelope jsonb not null)",
    )
    .execute(&pool)
    .await
    .unwrap();
    for (columns, role) in [
        ("payload=body,subject=topic", "payload=body"),
        ("payload=id", "payload=id"),
        (
            "payload=envelope,aggregate_id=topic.key",
            "aggregate_id=topic.key",
        ),
        ("payload=envelope", "{event_type}"),
        (
            "payload=envelope,subject=topic --unpublished",
            "--unpublished",
        ),
    ] {
        let mut args = vec!["--table", "public.outbox", "--columns"];
        match columns.split_once(" --unpublished") {
            Some((map, _)) => args.extend([map, "--unpublished", "sent_at IS NULL"]),
            None => args.push(columns),
        }
        let (code, err) = run_relay_bounded(&url, &stack.nats_url, "badmap", &args);
        assert_eq!(code, Some(1), "{columns}: {err}");
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert!(
            errors.len() == 1
                && errors[0].contains(role)
                && (errors[0].contains("id, topic, envelope") || errors[0].contains("sent_at")),
            "{columns}: one line naming {role} and the columns: {err}"
        );
    }
    // A misspelt key is told by the rows the table has.
    sqlx::raw_sql(
        "INSERT INTO outbox VALUES (gen_random_uuid(), 'badmap.x', '{\"partitionKey\": \"p\", \"n\": 1}')",
    )
    .execute(&pool)
    .await
    .unwrap();
    let map = "payload=envelope,subject=topic,aggregate_id=envelope.partitonKey";
    let (code, err) = run_relay_bounded(
        &url,
        &stack.nats_url,
        "badmap",
        &["--table", "public.outbox", "--columns", map],
    );
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert!(
        code == Some(1)
            && errors.len() == 1
            && errors[0].contains("aggregate_id=envelope.partitonKey")
            && errors[0].contains("n, partitionKey"),
        "one line naming the key and the keys the rows have: {err}"
    );
    // The envelope embeds the payload as JSON: not from a text column.
    let (code, err) = run_relay_bounded(
        &url,
        &stack.nats_url,
        "badmap",
        &[
            "--table",
            "public.outbox",
            "--columns",
            "payload=topic,subject=topic",
            "--envelope",
        ],
    );
    assert!(
        code == Some(1) && err.contains("--envelope") && err.contains("column topic"),
        "{err}"
    );
    // Refused before the stream was even set up.
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    assert!(js.get_stream(wire::stream_name("badmap")).await.is_err());
}

/// A table whose event id and time live in its jsonb body (SPEC §13's
/// `column.key` sources for the `id` and `occurred_at` roles): the audit
/// checks it (a message deleted from the stream is found, `--repair` puts
/// it back) and `prune` deletes by the body's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audit_and_prune_read_id_and_time_from_a_json_body() {
    let stack = stack();
    let ctx = "jsonkeys";
    let (url, pool) = empty_db(&stack, &format!("t_{ctx}")).await;
    sqlx::raw_sql(
        "CREATE TABLE events (seq bigserial primary key, topic text not null, body jsonb not null)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let flags: &[&str] = &[
        "--table",
        "public.events",
        "--columns",
        "id=body.eventId,occurred_at=body.occurredAt,payload=body,subject=topic",
        // Short, so a repaired copy is stored, not deduplicated.
        "--duplicate-window",
        "1s",
    ];
    let relay = Service::relay(&url, &stack.nats_url, ctx, flags);
    // Ten a week old, twenty of now; one transaction each.
    for (n, age) in [(10, "7 days"), (20, "0 s")] {
        sqlx::query(
            "INSERT INTO events (topic, body) SELECT 'jsonkeys.placed', jsonb_build_object( \
             'eventId', gen_random_uuid()::text, 'occurredAt', now() - $2::interval, 'n', g) \
             FROM generate_series(1, $1::int4) g",
        )
        .bind(n)
        .bind(age)
        .execute(&pool)
        .await
        .unwrap();
    }
    let stream = wire::stream_name(ctx);
    read_stream(&stack.nats_url, &stream, 30, T).await;
    let (code, out) = audit(ctx, &[flags, &["--last", "30d"]].concat());
    assert!(
        code == Some(0) && out.contains("30 rows, 30 messages; 0 missing"),
        "{out}"
    );
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    js.get_stream(&stream)
        .await
        .unwrap()
        .delete_message(15)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (code, out) = audit(ctx, &[flags, &["--last", "30d", "--repair"]].concat());
    assert!(
        code == Some(1) && out.contains("1 missing") && out.contains("; 1 repaired"),
        "{out}"
    );
    let (code, out) = audit(ctx, &[flags, &["--last", "30d"]].concat());
    assert_eq!(code, Some(0), "{out}");

    let mut args = vec!["prune", "--database-url", &url, "--context", ctx];
    args.extend(&flags[..4]);
    args.extend(["--older-than", "1d", "--wait", "20s"]);
    let (code, text) = run_output_bounded(&args, Duration::from_secs(60));
    assert_eq!(code, Some(0), "{text}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        left, 20,
        "the week-old rows deleted by body.occurredAt: {text}"
    );
    drop(relay);
}

/// Issue 57, item 3: every type the start check accepts, as a role, a
/// subject-template placeholder or a header column, carries the same text
/// streamed as backfilled, byte for byte: Postgres's own output for it,
/// whatever the database's settings say (its time zone, date, interval,
/// float and bytea styles are set against us here). Once with types binary
/// tuples carry (read by the relay's own code), once with those only text
/// tuples carry (an enum, a domain, citext, numeric, date, bytea, float8,
/// interval).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_column_type_reads_the_same_streamed_as_backfilled() {
    let stack = stack();
    let (url, pool) = empty_db(&stack, "t_types").await;
    sqlx::raw_sql(
        "CREATE EXTENSION IF NOT EXISTS citext; \
         CREATE TYPE mood AS ENUM ('happy', 'sad'); \
         CREATE DOMAIN label AS text CHECK (VALUE <> ''); \
         CREATE TABLE types_outbox (id uuid primary key, aggregate_type varchar(20) not null, \
           aggregate_id uuid not null, event_type char(6) not null, event_version int2 not null, \
           payload jsonb not null, occurred_at timestamp not null, correlation_id text, \
           h_int2 int2, h_int4 int4, h_int8 int8, h_numeric numeric, h_text text, \
           h_varchar varchar(12), h_char char(5), h_citext citext, h_enum mood, h_domain label, \
           h_date date, h_ts timestamp, h_tstz timestamptz, h_bool bool, h_json json, \
           h_jsonb jsonb, h_bytea bytea, h_uuid uuid, h_float8 float8, h_interval interval); \
         ALTER DATABASE t_types SET timezone = 'America/New_York'; \
         ALTER DATABASE t_types SET DateStyle = 'SQL, DMY'; \
         ALTER DATABASE t_types SET IntervalStyle = 'iso_8601'; \
         ALTER DATABASE t_types SET extra_float_digits = 0; \
         ALTER DATABASE t_types SET bytea_output = 'escape'",
    )
    .execute(&pool)
    .await
    .unwrap();
    // The same values, once before the relays start (backfilled), once
    // after (streamed); `twin` tells them apart.
    let insert = |twin: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO types_outbox VALUES (gen_random_uuid(), 'order', \
                 '6f1c1c3e-0b0e-4b53-9d7e-1f2a3b4c5d6e', 'placed', 3, jsonb_build_object('twin', $1::text), \
                 '2026-01-02 03:04:05.123456', 'corr-1', -7, 42, 9007199254740993, 12345.678900, \
                 'zürich ✓', 'vc', 'ab', 'MiXeD', 'happy', 'dom-val', '2026-01-02', \
                 '2026-01-02 03:04:05.5', '2026-01-02 03:04:05.5+05:30', true, '{\"b\": 1,  \"a\": [1,2]}', \
                 '{\"b\": 1,  \"a\": [1,2]}', '\\xdeadbeef', '6f1c1c3e-0b0e-4b53-9d7e-1f2a3b4c5d6f', \
                 0.1, '1 day 02:03:04')",
            )
            .bind(twin)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    insert("backfilled").await;
    let binary =
        "h_int2,h_int4,h_int8,h_text,h_varchar,h_char,h_ts,h_tstz,h_bool,h_json,h_jsonb,h_uuid";
    let text =
        "h_numeric,h_citext,h_enum,h_domain,h_date,h_bytea,h_float8,h_interval,h_tstz,h_char";
    let configs = [
        (
            "typesbin",
            "typesbin.{aggregate_type}.{h_int4}.{h_uuid}.{h_bool}.{h_varchar}",
            binary,
        ),
        (
            "typestext",
            "typestext.{aggregate_type}.{h_enum}.{h_date}.{h_citext}.{h_domain}.{h_int8}",
            text,
        ),
    ];
    let mut relays = Vec::new();
    for (ctx, template, headers) in configs {
        let relay = Service::relay(
            &url,
            &stack.nats_url,
            ctx,
            &[
                "--table",
                "public.types_outbox",
                "--subject-template",
                template,
                "--header-columns",
                headers,
            ],
        );
        relays.push(relay);
    }
    for r in &mut relays {
        r.wait_ready();
    }
    insert("streamed").await;
    let expected: &[(&str, &str)] = &[
        ("h_int2", "-7"),
        ("h_int4", "42"),
        ("h_int8", "9007199254740993"),
        ("h_text", "zürich ✓"),
        ("h_varchar", "vc"),
        // Its padding is in the header; a NATS client reads header values
        // trimmed.
        ("h_char", "ab"),
        // Timestamps as RFC 3339 in UTC, as `Outbox-Occurred-At`.
        ("h_ts", "2026-01-02T03:04:05.5Z"),
        ("h_tstz", "2026-01-01T21:34:05.5Z"),
        ("h_bool", "true"),
        ("h_json", "{\"b\": 1,  \"a\": [1,2]}"),
        ("h_jsonb", "{\"a\": [1, 2], \"b\": 1}"),
        ("h_uuid", "6f1c1c3e-0b0e-4b53-9d7e-1f2a3b4c5d6f"),
        ("h_numeric", "12345.678900"),
        ("h_citext", "MiXeD"),
        ("h_enum", "happy"),
        ("h_domain", "dom-val"),
        ("h_date", "2026-01-02"),
        ("h_bytea", "\\xdeadbeef"),
        ("h_float8", "0.1"),
        ("h_interval", "1 day 02:03:04"),
    ];
    for ((ctx, _, headers), relay) in configs.iter().zip(&relays) {
        let got = read_stream(&stack.nats_url, &wire::stream_name(ctx), 2, T).await;
        assert_eq!(got.len(), 2, "{ctx}: {}", relay.log_text());
        let (a, b) = (&got[0], &got[1]);
        assert_eq!(a.json()["twin"], "backfilled", "{ctx}");
        assert_eq!(b.json()["twin"], "streamed", "{ctx}");
        assert!(!a.subject.contains(".dlq."), "{ctx}: {}", a.subject);
        assert_eq!(a.subject, b.subject, "{ctx}: the subject");
        for name in [
            wire::AGGREGATE_ID,
            wire::EVENT_TYPE,
            wire::EVENT_VERSION,
            wire::OCCURRED_AT,
            wire::CORRELATION_ID,
        ] {
            assert_eq!(a.h(name), b.h(name), "{ctx}: {name}");
            assert!(a.h(name).is_some(), "{ctx}: {name} missing");
        }
        let mut wrong = Vec::new();
        for column in headers.split(',') {
            let h = wire::column_header(column);
            let want = expected.iter().find(|(c, _)| *c == column).unwrap().1;
            for (how, g) in [("backfilled", a), ("streamed", b)] {
                if g.h(&h) != Some(want) {
                    wrong.push(format!("{h} {how}: {:?}, not {want:?}", g.h(&h)));
                }
            }
        }
        assert!(wrong.is_empty(), "{ctx}: {wrong:#?}");
    }
}

/// Issue 57's acceptance: migrations while the relay streams under load
/// (a row every few milliseconds, each its own transaction): `ADD COLUMN`
/// of a role's name, `RENAME COLUMN` of a header column, then of the
/// payload column, then `ALTER PUBLICATION … DROP TABLE` and back. The
/// relay halts at each breaking change of the column map, and the restart
/// it asks for (with the fixed flags) brings every row into the stream
/// once, as an event (no dead letter), in commit order; the publication's
/// edit stops nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_under_load_lose_no_row() {
    use std::sync::{Arc, Mutex};
    let stack = stack();
    let (url, pool) = empty_db(&stack, "t_migload").await;
    sqlx::raw_sql(
        "CREATE TABLE migload_outbox (id uuid primary key, aggregate_type text not null, \
         aggregate_id text not null, event_type text not null, event_version int not null default 1, \
         payload jsonb not null, tenant text, occurred_at timestamptz not null default now())",
    )
    .execute(&pool)
    .await
    .unwrap();
    // The columns the producer writes: (header column, payload column).
    let names = Arc::new(Mutex::new(("tenant".to_owned(), "payload".to_owned())));
    let sent: Arc<Mutex<Vec<String>>> = Arc::default();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producer = {
        let (pool, names, sent, stop) = (pool.clone(), names.clone(), sent.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let (tenant, payload) = names.lock().unwrap().clone();
                let id = sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(format!(
                    "INSERT INTO migload_outbox (id, aggregate_type, aggregate_id, event_type, {payload}, {tenant}) \
                     VALUES (gen_random_uuid(), 'order', 'o1', 'placed', jsonb_build_object('n', $1::int), 't1') \
                     RETURNING id::text"
                )))
                .bind(n)
                .fetch_one(&pool)
                .await;
                match id {
                    Ok(id) => {
                        sent.lock().unwrap().push(id);
                        n += 1;
                    }
                    // A column renamed under it: the next try names it.
                    Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        })
    };
    let rows = |more: usize| {
        let sent = sent.clone();
        async move {
            let at = sent.lock().unwrap().len();
            eventually(T, &format!("{more} more rows written"), || async {
                sent.lock().unwrap().len() >= at + more
            })
            .await;
        }
    };
    let stream = wire::stream_name("migload");
    let in_stream = |n: usize| {
        let url = stack.nats_url.clone();
        let stream = stream.clone();
        async move {
            eventually(T, &format!("{n} events in the stream"), || async {
                stream_messages(&url, &stream).await >= n as u64
            })
            .await;
        }
    };
    let ddl = |sql: &'static str| {
        let pool = pool.clone();
        async move { sqlx::raw_sql(sql).execute(&pool).await.unwrap() }
    };
    let relay = |flags: &[&str]| {
        let mut args = vec!["--table", "public.migload_outbox"];
        args.extend_from_slice(flags);
        Service::relay(&url, &stack.nats_url, "migload", &args)
    };

    let mut r = relay(&["--header-columns", "tenant"]);
    r.wait_ready();
    rows(100).await;
    ddl("ALTER TABLE migload_outbox ADD COLUMN stream text DEFAULT 'NOWHERE'").await;
    rows(100).await;
    ddl("ALTER TABLE migload_outbox RENAME COLUMN tenant TO tenant_id").await;
    names.lock().unwrap().0 = "tenant_id".into();
    rows(100).await;
    halted(&r, "halted at the renamed header column").await;
    drop(r);
    let r = relay(&["--header-columns", "tenant_id", "--columns", "stream=-"]);
    rows(100).await;
    let written = sent.lock().unwrap().len();
    in_stream(written).await;
    ddl("ALTER TABLE migload_outbox RENAME COLUMN payload TO body").await;
    names.lock().unwrap().1 = "body".into();
    rows(100).await;
    halted(&r, "halted at the renamed payload column").await;
    drop(r);
    let fixed = [
        "--header-columns",
        "tenant_id",
        "--columns",
        "stream=-,payload=body",
    ];
    let r = relay(&fixed);
    rows(100).await;
    let written = sent.lock().unwrap().len();
    in_stream(written).await;
    // Out of the publication and back: the slot carries the outbox through
    // the publication the relay keeps, and nothing stops.
    ddl("ALTER PUBLICATION outbox_relay_migload DROP TABLE migload_outbox").await;
    rows(50).await;
    ddl("ALTER PUBLICATION outbox_relay_migload ADD TABLE migload_outbox").await;
    rows(50).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    producer.await.unwrap();
    let sent = sent.lock().unwrap().clone();
    let got = read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    assert_eq!(
        ids(&got),
        sent,
        "every row once, in commit order\n{}",
        r.log_text()
    );
    for g in &got {
        assert!(!g.subject.contains(".dlq."), "a dead letter: {}", g.subject);
    }
    assert_eq!(r.scrape().await.value("outbox_relay_halted"), Some(0.0));
}
