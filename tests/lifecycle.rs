//! SPEC §9: the paths a deployment takes over its life, beyond one relay
//! streaming a plain table from a slot that already exists.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use outbox_relay::wire;

const T: Duration = Duration::from_secs(120);

/// The outbox as migrations/0001 creates it, but partitioned by time into
/// three partitions (old, recent, current).
pub(crate) const PARTITIONED_OUTBOX: &str = "
DROP TABLE outbox_events;
CREATE TABLE outbox_events (
    id               uuid        NOT NULL,
    aggregate_type   text        NOT NULL,
    aggregate_id     text        NOT NULL,
    event_type       text        NOT NULL,
    event_version    int         NOT NULL DEFAULT 1,
    payload          jsonb       NOT NULL,
    occurred_at      timestamptz NOT NULL DEFAULT now(),
    correlation_id   uuid        NULL,
    causation_id     uuid        NULL,
    subject          text        NULL,
    headers          jsonb       NULL,
    published_at     timestamptz NULL,
    publish_attempts int         NOT NULL DEFAULT 0,
    publish_error    text        NULL,
    PRIMARY KEY (id, occurred_at)
) PARTITION BY RANGE (occurred_at);
CREATE TABLE outbox_events_old PARTITION OF outbox_events
    FOR VALUES FROM (MINVALUE) TO ('2026-01-01');
CREATE TABLE outbox_events_recent PARTITION OF outbox_events
    FOR VALUES FROM ('2026-01-01') TO ('2026-06-01');
CREATE TABLE outbox_events_current PARTITION OF outbox_events
    FOR VALUES FROM ('2026-06-01') TO (MAXVALUE);
";

/// Issue 18, defect 1: with a partitioned outbox, pgoutput names each row's
/// partition unless the publication publishes via the root, and the relay
/// used to drop every such row without a word.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_outbox_delivers_rows_of_every_partition_in_commit_order() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_parted").await;
    sqlx::raw_sql(PARTITIONED_OUTBOX)
        .execute(&pool)
        .await
        .unwrap();
    let relay = Service::relay(&url, &stack.nats_url, "parted", &[]);
    let mut sent = HashSet::new();
    for (txn, occurred_at) in [
        "2025-03-01T00:00:00Z",
        "2026-02-01T00:00:00Z",
        "2026-11-01T00:00:00Z",
    ]
    .iter()
    .cycle()
    .take(30)
    .enumerate()
    {
        // One transaction spans all three partitions every third time.
        let mut tx = pool.begin().await.unwrap();
        let span: &[&str] = if txn % 3 == 0 {
            &[
                "2025-03-01T00:00:00Z",
                "2026-02-01T00:00:00Z",
                "2026-11-01T00:00:00Z",
            ]
        } else {
            std::slice::from_ref(occurred_at)
        };
        for (i, at) in span.iter().enumerate() {
            let id = uuid::Uuid::new_v4();
            sqlx::query(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
                 VALUES ($1, 'order', 'p0', 'placed', $2, $3::timestamptz)",
            )
            .bind(id)
            .bind(serde_json::json!({"p": 0, "s": txn * 10 + i}))
            .bind(at)
            .execute(&mut *tx)
            .await
            .unwrap();
            sent.insert(id);
        }
        tx.commit().await.unwrap();
    }
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name("parted"),
        sent.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &sent);
    let m = relay.scrape().await;
    assert_eq!(
        m.value("outbox_relay_events_published_total"),
        Some(sent.len() as f64)
    );
}

/// Issue 18, defect 1: a publication of the relay's name that does not
/// publish the outbox's inserts is refused at start, with the statement that
/// fixes it, instead of streaming nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publication_that_does_not_publish_the_outbox_is_refused_with_the_fix() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_pubother").await;
    let publication = wire::publication_name("pubother");
    let run = || {
        let (code, err) = run_relay_bounded(&url, &stack.nats_url, "pubother", &[]);
        let line = err
            .lines()
            .find(|l| l.starts_with("error:"))
            .unwrap_or_default()
            .to_owned();
        (code, line, err)
    };

    // For another table.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE other (x int primary key); CREATE PUBLICATION {publication} FOR TABLE other"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let (code, line, err) = run();
    assert_eq!(code, Some(1), "{err}");
    assert!(
        line.contains(&format!("ALTER PUBLICATION {publication} ADD TABLE")),
        "{err}"
    );

    // For the table, but without its inserts.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP PUBLICATION {publication}; CREATE PUBLICATION {publication} FOR TABLE outbox_events WITH (publish = 'update')"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let (code, line, err) = run();
    assert_eq!(code, Some(1), "{err}");
    assert!(line.contains("publish = 'insert'"), "{err}");

    // A partitioned outbox behind a publication that names the partitions.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP PUBLICATION {publication}; {PARTITIONED_OUTBOX} \
         CREATE PUBLICATION {publication} FOR TABLE outbox_events WITH (publish = 'insert')"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let (code, line, err) = run();
    assert_eq!(code, Some(1), "{err}");
    assert!(line.contains("publish_via_partition_root = true"), "{err}");
}

/// Issue 18, defect 8: `NATS_URL` is a comma-separated server list (SPEC
/// §2), for `relay` and `consume` alike; an entry that does not parse is one
/// line naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_url_takes_a_server_list_and_names_a_bad_entry() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_natslist").await;
    // The first server is down: the client must try the next.
    let list = format!("nats://127.0.0.1:{}, {}", free_port(), stack.nats_url);
    let _relay = Service::relay(&url, &list, "natslist", &[]);
    let sent: HashSet<uuid::Uuid> = insert_txn(&pool, 0, 0, 20, 8).await.into_iter().collect();
    let stream = wire::stream_name("natslist");
    let got = read_stream(&stack.nats_url, &stream, 20, T).await;
    assert_exactly_once_in_order(&got, &sent);
    // Ready means connected and pulling.
    let _consumer = Service::consumer(&url, &list, &stream, "listed", "http://127.0.0.1:1/", &[]);

    let bad = format!("{},nats://127.0.0.1:notaport", stack.nats_url);
    for command in [
        vec!["relay"],
        vec![
            "consume",
            "--durable",
            "d",
            "--handler-url",
            "http://127.0.0.1:1/",
        ],
    ] {
        let out = std::process::Command::new(BIN)
            .args(&command)
            .args(["--database-url", &url, "--nats-url", &bad, "--check-config"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{command:?}: {err}");
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{command:?}: one line: {err}");
        assert!(
            lines[0].contains("NATS_URL entry \"nats://127.0.0.1:notaport\""),
            "{command:?}: {err}"
        );
    }
}

/// SPEC §9 standby, and issue 18 defect 6 (a relay that finds its slot held
/// exited, so a kill -9 and an immediate restart crash-looped): a second
/// relay with the same settings waits as a standby and takes over when the
/// active one dies; twice, under load, with nothing lost, doubled or
/// reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_relay_takes_over_after_kill_9_twice_under_load() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_standby").await;
    let mut active = Service::relay(&url, &stack.nats_url, "standby", &[]);
    let mut standby = Service::relay_starting(&url, &stack.nats_url, "standby", &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let producer = spawn_producer(pool.clone(), 1_000_000, 1000, stop.clone());
    for round in 1..=2 {
        eventually(T, "the second relay reports standby", || async {
            let (status, body) = standby.http_get("/readyz").await;
            status == 503
                && body.contains("standby")
                && standby.scrape().await.value("outbox_relay_standby") == Some(1.0)
        })
        .await;
        let m = active.scrape().await;
        assert_eq!(m.value("outbox_relay_standby"), Some(0.0));
        assert_eq!(m.value("outbox_relay_streaming"), Some(1.0));
        tokio::time::sleep(Duration::from_millis(500)).await;
        active.kill9();
        let killed = Instant::now();
        standby.wait_ready();
        println!(
            "round {round}: standby took over {:?} after kill -9",
            killed.elapsed()
        );
        // The killed one comes back as the new standby.
        active.restart();
        std::mem::swap(&mut active, &mut standby);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let sent = producer.await.unwrap();
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name("standby"),
        sent.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &sent);
}

/// `n` unpublished rows, occurred_at one millisecond apart an hour ago, with
/// payload `{"p": producer, "s": 1..=n}`; returns their ids.
async fn preexisting_rows(pool: &sqlx::PgPool, producer: i32, n: i64) -> HashSet<uuid::Uuid> {
    sqlx::query_scalar(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
         SELECT gen_random_uuid(), 'order', 'pre', 'placed', jsonb_build_object('p', $1::int, 's', g), \
                now() - interval '1 hour' + g * interval '1 millisecond' \
         FROM generate_series(1, $2::int8) g RETURNING id",
    )
    .bind(producer)
    .bind(n)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .collect()
}

/// One-row transactions (so `occurred_at` orders them as commits do) until
/// `stop`; returns their ids.
fn trickle(
    pool: sqlx::PgPool,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<HashSet<uuid::Uuid>> {
    tokio::spawn(async move {
        let mut sent = HashSet::new();
        let mut seq = 0;
        while !stop.load(Ordering::Relaxed) {
            sent.extend(insert_txn(&pool, 0, seq, 1, 8).await);
            seq += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        sent
    })
}

/// Issue 18, defect 2 / SPEC §9 first start: rows written before the relay
/// ever ran are published (the unpublished ones, in occurred_at order)
/// before what the slot streams, with inserts going on across the switch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_start_backfills_unpublished_rows_then_streams_under_concurrent_inserts() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_backfill").await;
    let unpublished = preexisting_rows(&pool, 9, 2000).await;
    // What a polling worker already published stays out.
    let published = preexisting_rows(&pool, 8, 300).await;
    sqlx::query("UPDATE outbox_events SET published_at = now() WHERE payload->>'p' = '8'")
        .execute(&pool)
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let producer = trickle(pool.clone(), stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let relay = Service::relay(&url, &stack.nats_url, "backfill", &[]);
    tokio::time::sleep(Duration::from_millis(700)).await;
    stop.store(true, Ordering::Relaxed);
    let mut sent = unpublished.clone();
    sent.extend(producer.await.unwrap());
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name("backfill"),
        sent.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &sent);
    assert!(got
        .iter()
        .all(|g| !published.contains(&uuid::Uuid::parse_str(g.h(wire::MSG_ID).unwrap()).unwrap())));
    // The unpublished rows come first, in occurred_at order, then the rows
    // the producer committed before the slot's snapshot; then the stream.
    assert!(got[..2000].iter().all(|g| g.json()["p"] == 9));
    let backfilled = got
        .iter()
        .take_while(|g| g.h(wire::BACKFILL).is_some())
        .count();
    assert!(backfilled >= 2000);
    assert!(got[backfilled..]
        .iter()
        .all(|g| g.h(wire::BACKFILL).is_none()));
    assert!(backfilled < got.len(), "some rows came through the slot");
    let m = relay.scrape().await;
    assert_eq!(
        m.value("outbox_relay_backfill_rows_total"),
        Some(backfilled as f64)
    );
}

/// SPEC §9: a relay killed while it backfills finishes the backfill on its
/// next start; nothing is lost, nothing doubled in the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_killed_during_backfill_finishes_it_on_the_next_start() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_bfcrash").await;
    let sent = preexisting_rows(&pool, 9, 100_000).await;
    let stream = wire::stream_name("bfcrash");
    let mut relay = Service::relay_starting(&url, &stack.nats_url, "bfcrash", &[]);
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    eventually(T, "the backfill is under way", || async {
        match js.get_stream(&stream).await {
            Ok(mut s) => s.info().await.unwrap().state.messages >= 5_000,
            Err(_) => false,
        }
    })
    .await;
    let (status, body) = relay.http_get("/readyz").await;
    relay.kill9();
    assert_eq!(status, 503, "killed before the backfill ended: {body}");
    relay.restart();
    relay.wait_ready();
    let got = read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
}

/// Issue 18, defect 3 / SPEC §9 slot lost: with no slot but this database's
/// events in the stream, the relay refuses to start from "now"; with
/// --resync-since it republishes the gap from the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_slot_is_refused_then_resync_since_republishes_the_gap() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_slotlost").await;
    let stream = wire::stream_name("slotlost");
    let mut relay = Service::relay(&url, &stack.nats_url, "slotlost", &["--backfill", "none"]);
    let mut sent: HashSet<uuid::Uuid> = HashSet::new();
    for i in 0..10 {
        sent.extend(insert_txn(&pool, 0, i * 10, 10, 8).await);
    }
    let got = read_stream(&stack.nats_url, &stream, 100, T).await;
    let last = got.last().unwrap().clone();
    assert!(relay.term(Duration::from_secs(30)).success());
    drop_slot(&url, "slotlost");
    // Written while no slot existed: only the table has them.
    for i in 10..15 {
        sent.extend(insert_txn(&pool, 0, i * 10, 10, 8).await);
    }

    let line = lost_slot_refusal(&url, &stack.nats_url, "slotlost");
    let since = last.h(wire::OCCURRED_AT).unwrap();
    assert!(line.contains(last.h(wire::MSG_ID).unwrap()), "{line}");
    assert!(line.contains(&format!("--resync-since {since}")), "{line}");

    let relay = Service::relay(
        &url,
        &stack.nats_url,
        "slotlost",
        &["--resync-since", since],
    );
    for i in 15..20 {
        sent.extend(insert_txn(&pool, 0, i * 10, 10, 8).await);
    }
    let got = read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    let ids: Vec<uuid::Uuid> = got
        .iter()
        .map(|g| uuid::Uuid::parse_str(g.h(wire::MSG_ID).unwrap()).unwrap())
        .collect();
    let unique: HashSet<uuid::Uuid> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "a duplicate in the stream");
    assert_eq!(unique, sent, "the stream holds every row once");
    let m = relay.scrape().await;
    assert!(m
        .value("outbox_relay_backfill_rows_total")
        .is_some_and(|n| n >= 50.0));
}

/// Issue 18, defect 4: rows that pass routing but not the server (a header
/// block over 64 KiB, a subject longer than the server's control line, a
/// subject an existing stream does not capture, a message over the stream's
/// `max_msg_size`) are dead-lettered with their own reason; the rows after
/// them flow. They used to end the session on every replay, forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_the_server_would_refuse_are_dead_lettered_and_later_rows_flow() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_refuse").await;
    let stream = wire::stream_name("refuse");
    // An existing stream, used as it is: narrower subjects, a 4 KiB limit.
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let _ = js.delete_stream(&stream).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec!["refuse.event.>".into(), wire::relay_dlq_subject("refuse")],
        max_message_size: 4096,
        ..Default::default()
    })
    .await
    .unwrap();
    let relay = Service::relay(&url, &stack.nats_url, "refuse", &[]);
    let row = |subject: Option<String>, headers: Option<serde_json::Value>, pad: usize| {
        let pool = pool.clone();
        async move {
            let id = uuid::Uuid::new_v4();
            sqlx::query(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, subject, headers) \
                 VALUES ($1, 'order', 'r', 'placed', $2, $3, $4)",
            )
            .bind(id)
            .bind(serde_json::json!({"pad": "x".repeat(pad)}))
            .bind(subject)
            .bind(headers)
            .execute(&pool)
            .await
            .unwrap();
            id
        }
    };
    let good1 = row(None, None, 10).await;
    let big_headers = row(
        None,
        Some(serde_json::json!({"big": "h".repeat(70_000)})),
        10,
    )
    .await;
    let long_subject = row(Some(format!("refuse.event.{}", "s".repeat(5000))), None, 10).await;
    let uncaptured = row(Some("refuse.other.x".into()), None, 10).await;
    let over_stream_limit = row(None, None, 8_000).await;
    let good2 = row(None, None, 10).await;

    let got = read_stream(&stack.nats_url, &stream, 6, T).await;
    let by_id = |id: uuid::Uuid| {
        got.iter()
            .find(|g| g.h(wire::MSG_ID) == Some(id.to_string().as_str()))
            .unwrap_or_else(|| panic!("{id} not in the stream"))
    };
    for id in [good1, good2] {
        assert_eq!(by_id(id).subject, "refuse.event.placed.v1");
        assert_eq!(by_id(id).h(wire::DLQ_REASON), None);
    }
    for (id, reason) in [
        (big_headers, wire::DlqReason::HeadersTooLarge),
        (long_subject, wire::DlqReason::SubjectTooLong),
        (uncaptured, wire::DlqReason::SubjectOutsideStream),
        (over_stream_limit, wire::DlqReason::TooLarge),
    ] {
        let g = by_id(id);
        assert_eq!(g.subject, wire::relay_dlq_subject("refuse"), "{reason:?}");
        assert_eq!(g.h(wire::DLQ_REASON), Some(reason.as_str()));
    }
    assert_eq!(got.len(), 6, "each row once");
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_session_restarts_total"), Some(0.0));
}

/// Issue 18, defect 4: a `--stream` that cannot hold the relay's dead
/// letters is one line at start, not a loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_cannot_hold_the_dead_letters_is_refused_at_start() {
    let stack = stack();
    let (url, _pool) = fresh_db(&stack, "t_wrongstream").await;
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let _ = js.delete_stream("ELSEWHERE").await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "ELSEWHERE".into(),
        subjects: vec!["elsewhere.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let (code, err) = run_relay_bounded(
        &url,
        &stack.nats_url,
        "wrongstream",
        &["--stream", "ELSEWHERE"],
    );
    assert_eq!(code, Some(1), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("does not capture"), "{err}");
    assert!(
        lines[0].contains(&wire::relay_dlq_subject("wrongstream")),
        "{err}"
    );
}

/// Issue 18, defect 5: another writer in the stream (50 msg/s here, during
/// a load) costs the relay a resend, never a session or a stall. Event by
/// event, the order chain refuses the publish that follows a foreign
/// message, and it goes again; in atomic batches (one in flight at a time,
/// so no chain) it costs nothing at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_publisher_in_the_stream_costs_no_session_and_no_stall() {
    foreign_writer_case("foreign", &["--publish-mode", "event"], |resends| {
        resends > 0.0
    })
    .await;
    foreign_writer_case("foreignb", &["--publish-mode", "batch"], |resends| {
        resends == 0.0
    })
    .await;
}

async fn foreign_writer_case(context: &str, extra: &[&str], resends_ok: fn(f64) -> bool) {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, &format!("t_{context}")).await;
    let relay = Service::relay(&url, &stack.nats_url, context, extra);
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let foreign = {
        let (js, stop) = (js.clone(), stop.clone());
        let subject = format!("{context}.someone.else");
        tokio::spawn(async move {
            let mut n = 0u64;
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                js.publish(subject.clone(), format!("{n}").into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                n += 1;
            }
            n
        })
    };
    let producer = spawn_producer(pool.clone(), 6_000, 1500, Arc::new(AtomicBool::new(false)));
    let sent = producer.await.unwrap();
    let ours = |got: &[Got]| -> Vec<Got> {
        got.iter()
            .filter(|g| g.h(wire::SOURCE).is_some())
            .cloned()
            .collect()
    };
    stop.store(true, Ordering::Relaxed);
    let foreign_count = foreign.await.unwrap();
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name(context),
        sent.len() as u64 + foreign_count,
        T,
    )
    .await;
    assert_exactly_once_in_order(&ours(&got), &sent);
    let is_ours = |g: &Got| g.h(wire::SOURCE).is_some();
    let first = got.iter().position(is_ours).unwrap();
    let last = got.iter().rposition(is_ours).unwrap();
    let interleaved = got[first..last].iter().any(|g| !is_ours(g));
    assert!(
        interleaved,
        "the other writer did come between the relay's messages"
    );
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_session_restarts_total"), Some(0.0));
    let resends = m.value("outbox_relay_publish_resends_total").unwrap();
    assert!(resends_ok(resends), "{context}: {resends} resends");
}

/// Issue 18, defect 7: rows of 5 MB, with the publish window bounded in
/// bytes; every row arrives once, in order, and the relay's peak memory
/// stays near window + WAL buffer, not rows × window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_megabyte_rows_flow_under_the_byte_bound() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_bigrows").await;
    let conf = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nats-bigrows.conf");
    std::fs::write(&conf, "max_payload: 8MB\n").unwrap();
    let nats = OwnNats::start_with(&stack, "bigrows", &["-c", conf.to_str().unwrap()]);
    let relay = Service::relay(
        &url,
        &nats.url,
        "bigrows",
        &["--max-inflight-bytes", "16MiB"],
    );
    const ROWS: i64 = 40;
    let sent: HashSet<uuid::Uuid> = sqlx::query_scalar(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'doc', 'd', 'stored', jsonb_build_object('p', 0, 's', g, 'pad', repeat('x', 5000000)) \
         FROM generate_series(1, $1::int8) g RETURNING id",
    )
    .bind(ROWS)
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    // Read by sequence: an ordered consumer pulling 200 MB through a busy
    // 2-core box misses its own heartbeats and starts over.
    let js = async_nats::jetstream::new(async_nats::connect(&nats.url).await.unwrap());
    let stream_name = wire::stream_name("bigrows");
    eventually(T, "every row stored", || async {
        let mut s = js.get_stream(&stream_name).await.unwrap();
        s.info().await.unwrap().state.messages >= ROWS as u64
    })
    .await;
    let mut stream = js.get_stream(&stream_name).await.unwrap();
    assert_eq!(
        stream.info().await.unwrap().state.messages,
        ROWS as u64,
        "a row stored twice"
    );
    let got = read_stream_by_seq(&js, &stream_name, ROWS as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
    assert!(got.iter().all(|g| g.payload.len() > 5_000_000));
    let peak = relay.peak_rss_kib().expect("VmHWM");
    println!("5 MB rows: relay peak RSS {peak} KiB with --max-inflight-bytes 16MiB");
    // The design bound: the 16 MiB window, 16 buffered WAL messages of 5 MB
    // and the ~25 MiB base; the 40 rows held at once would be 200 MB.
    assert!(peak < 128 * 1024, "peak RSS {peak} KiB");
}

/// Issue 18, defect 8: on a 3-node cluster with an R3 stream, the stream
/// leader killed (kill -9) twice under load and restarted: nothing lost,
/// doubled or reordered, and publishing rides out the election inside the
/// session (no reconnect, no stream lookup waiting out a request timeout).
/// Prints the catch-up: from the new leader's first answer until the stream
/// holds every row committed by then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_rides_out_the_stream_leader_killed_twice_on_a_3_node_cluster() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_cluster").await;
    let cluster = OwnCluster::up("nats-cluster-relay");
    let stream = wire::stream_name("cluster");
    let relay = Service::relay(&url, &cluster.url, "cluster", &["--stream-replicas", "3"]);
    let client = cluster.client().await;
    let js = async_nats::jetstream::new(client.clone());
    // Short requests, so the first answer of a new leader is seen at once.
    let probe = async_nats::jetstream::ContextBuilder::new()
        .timeout(Duration::from_millis(200))
        .build(client.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let producer = spawn_producer(pool.clone(), 1_000_000, 1000, stop.clone());
    cluster.wait_healthy(&js, &stream, T).await;
    // SPEC §14: three replicas make an acked event durable.
    eventually(T, "outbox_relay_stream_durable 1", || async {
        relay.scrape().await.value("outbox_relay_stream_durable") == Some(1.0)
    })
    .await;
    for round in 1..=2 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let leader = cluster.wait_leader(&js, &stream, T).await;
        cluster.node(leader, "kill");
        let killed = Instant::now();
        let deadline = killed + T;
        // The new leader answers publishes: a conditional one it must
        // refuse (the stream is past sequence 1), so nothing is stored.
        loop {
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Expected-Last-Sequence", "1");
            let answer = match probe
                .publish_with_headers("cluster.probe", headers, "".into())
                .await
            {
                Ok(ack) => ack.await.map(|_| ()),
                Err(e) => Err(e),
            };
            use async_nats::jetstream::context::PublishErrorKind as K;
            match answer {
                Err(e) if matches!(e.kind(), K::WrongLastSequence) => break,
                Ok(()) => panic!("the probe was stored"),
                Err(_) => {}
            }
            assert!(Instant::now() < deadline, "no new stream leader");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let answered = Instant::now();
        let committed: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events")
            .fetch_one(&pool)
            .await
            .unwrap();
        loop {
            let stored = async {
                let mut s = probe.get_stream(&stream).await.ok()?;
                Some(s.info().await.ok()?.state.messages)
            }
            .await;
            if stored.is_some_and(|n| n >= committed as u64) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the relay did not catch up after the leader died"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        println!(
            "round {round}: killed leader n{leader}; a new leader answered {:?} later; \
             the stream held all {committed} rows committed by then {:?} after that",
            answered - killed,
            answered.elapsed()
        );
        cluster.node(leader, "start");
        cluster.wait_healthy(&js, &stream, T).await;
    }
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::Relaxed);
    let sent = producer.await.unwrap();
    // By sequence: a node restarted by `wait_healthy` can stall an ordered
    // consumer for good.
    let got = read_stream_by_seq(&js, &stream, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
    let m = relay.scrape().await;
    println!(
        "resends: {:?}",
        m.value("outbox_relay_publish_resends_total")
    );
    assert_eq!(
        m.value("outbox_relay_session_restarts_total")
            .unwrap_or(0.0),
        0.0,
        "a leader election needed a new session"
    );
    assert_eq!(
        m.value("outbox_relay_publish_batches"),
        Some(1.0),
        "the default mode keeps transactions whole on a replicated stream"
    );
}

/// SPEC §9 table shapes: a row inserted and deleted in the same transaction
/// (so the table stays empty) is still delivered: the publication publishes
/// inserts only, and the insert is in the WAL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn insert_and_delete_in_one_transaction_delivers_the_event() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_insdel").await;
    let _relay = Service::relay(&url, &stack.nats_url, "insdel", &[]);
    let mut sent = HashSet::new();
    for i in 0..5u64 {
        let mut tx = pool.begin().await.unwrap();
        let id = uuid::Uuid::new_v4();
        sqlx::query(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'order', 'x', 'placed', $2)",
        )
        .bind(id)
        .bind(serde_json::json!({"p": 0, "s": i}))
        .execute(&mut *tx)
        .await
        .unwrap();
        sqlx::query("DELETE FROM outbox_events WHERE id = $1")
            .bind(id)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        sent.insert(id);
    }
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "the table stays empty");
    let got = read_stream(&stack.nats_url, &wire::stream_name("insdel"), 5, T).await;
    assert_exactly_once_in_order(&got, &sent);
}

/// SPEC §9 failover, where the server carries slots across a promotion
/// (failover slots: PostgreSQL 17, or the run's newer major): the relay makes its slot a failover slot,
/// the standby synchronizes it, and after the primary crashes under load and
/// the standby is promoted, the relay goes on from the synchronized slot:
/// no refusal and no resync, every row of the new primary exactly once and
/// in order, and nothing in the stream that the new primary lacks (the
/// primary's `synchronized_standby_slots` holds the relay back to what the
/// standby has).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_slot_carries_the_relay_across_a_promotion() {
    use sqlx::postgres::PgPoolOptions;
    let stack = stack();
    let pair = OwnPgPair::up("failover", 17);
    migrate(&pair.primary_url);
    let connect = |url: String| async move {
        PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&url)
            .await
            .unwrap()
    };
    let primary = connect(pair.primary_url.clone()).await;
    let standby = connect(pair.standby_url.clone()).await;
    let slot = wire::slot_name("failover");
    let mut relay = Service::relay(&pair.primary_url, &stack.nats_url, "failover", &[]);
    let failover: Option<bool> =
        sqlx::query_scalar("SELECT failover FROM pg_replication_slots WHERE slot_name = $1")
            .bind(&slot)
            .fetch_one(&primary)
            .await
            .unwrap();
    assert_eq!(failover, Some(true), "the relay's slot is a failover slot");

    // Load on the primary until it dies; a failed commit ends the producer.
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (pool, stop) = (primary.clone(), stop.clone());
        tokio::spawn(async move {
            let mut seq = 0u64;
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                if try_insert_txn(&pool, 0, seq, 10, 0).await.is_err() {
                    break;
                }
                seq += 10;
            }
            seq
        })
    };
    eventually(
        T,
        "the standby has the slot, synchronized and persistent",
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT synced AND NOT temporary AND confirmed_flush_lsn IS NOT NULL \
             FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(&slot)
            .fetch_optional(&standby)
            .await
            .ok()
            .flatten()
            .unwrap_or(false)
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    pair.failover();
    stop.store(true, Ordering::Relaxed);
    let before = producer.await.unwrap();
    relay.kill9();
    println!("{before} rows offered to the old primary");

    // The promoted standby is the primary now: the same relay settings.
    let mut relay = Service::relay(&pair.standby_url, &stack.nats_url, "failover", &[]);
    for seq in (1_000_000..1_000_500).step_by(10) {
        try_insert_txn(&standby, 0, seq, 10, 0).await.unwrap();
    }
    let rows: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM outbox_events")
        .fetch_all(&standby)
        .await
        .unwrap();
    let rows: HashSet<uuid::Uuid> = rows.into_iter().collect();
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name("failover"),
        rows.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &rows);
    let log = relay.log_text();
    assert!(!log.contains("resync"), "no resync was needed: {log}");
    // It found where the old primary's relay stopped (an ancestor timeline's
    // message before the switch point), rather than replaying into the
    // duplicate window.
    assert!(
        !log.contains("relying on the duplicate window"),
        "resumed from the old timeline's tail: {log}"
    );
    relay.term(Duration::from_secs(10));
}

/// Issue 44, item 4: on the per-event path, an answer 10158 ("duplicate
/// message id is in process": a resend while the first copy waits for its
/// quorum) ended the session, where the batch path rides it out. The
/// stream leader's two followers are frozen (SIGSTOP) for 5 s under load, so
/// nothing commits and the relay's probes meet their own first copies; the
/// session rides it out: no restart, nothing lost, doubled or reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_event_path_rides_out_ids_still_in_process_on_a_3_node_cluster() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_inprocess").await;
    let cluster = OwnCluster::up("nats-cluster-inprocess");
    let stream = wire::stream_name("inprocess");
    let extra = ["--stream-replicas", "3", "--publish-mode", "event"];
    let first = Service::relay(&url, &cluster.url, "inprocess", &extra);
    let client = cluster.client().await;
    let js = async_nats::jetstream::new(client.clone());
    cluster.wait_healthy(&js, &stream, T).await;
    drop(first);
    // The relay on the leader alone, so its probes reach the leader.
    let leader = cluster.wait_leader(&js, &stream, T).await;
    let leader_url = cluster.url.split(',').nth(leader - 1).unwrap().to_owned();
    let relay = Service::relay(&url, &leader_url, "inprocess", &extra);
    let stop = Arc::new(AtomicBool::new(false));
    let producer = spawn_producer(pool.clone(), 1_000_000, 500, stop.clone());
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let followers: Vec<usize> = (1..=3).filter(|n| *n != leader).collect();
    for n in &followers {
        cluster.signal(*n, "STOP");
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    for n in &followers {
        cluster.signal(*n, "CONT");
    }
    cluster.wait_healthy(&js, &stream, T).await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    stop.store(true, Ordering::Relaxed);
    let sent = producer.await.unwrap();
    let got = read_stream_by_seq(&js, &stream, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
    let m = relay.scrape().await;
    assert_eq!(
        m.value("outbox_relay_session_restarts_total"),
        Some(0.0),
        "the session rode it out"
    );
}

/// Issue 44, item 3: a server put in lame duck mode tells its clients to
/// move before it closes their connections (nats-server: after a 10 s
/// grace, spread over two minutes). The publish link ignored it and
/// stayed until the server closed it. It now moves once the answers of
/// what is in flight are in, under load, with nothing lost, doubled or
/// reordered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_moves_off_a_server_in_lame_duck_mode_under_load() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_lameduck").await;
    let cluster = OwnCluster::up("nats-cluster-lameduck");
    let nodes: Vec<&str> = cluster.url.split(',').collect();
    let stream = wire::stream_name("lameduck");
    // Given the first node only: it learns the others from it.
    let relay = Service::relay(&url, nodes[0], "lameduck", &["--stream-replicas", "3"]);
    let js = async_nats::jetstream::new(cluster.client().await);
    let stop = Arc::new(AtomicBool::new(false));
    let producer = spawn_producer(pool.clone(), 1_000_000, 1000, stop.clone());
    cluster.wait_healthy(&js, &stream, T).await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    cluster.signal(1, "USR2");
    eventually(
        Duration::from_secs(9),
        "the publish link leaves the lame duck before its grace period ends",
        || async { relay.log_text().contains("the publish connection moves") },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::Relaxed);
    let sent = producer.await.unwrap();
    let got = read_stream_by_seq(&js, &stream, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
}
