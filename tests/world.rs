//! The relay when the world goes away (issue 58): a slot Postgres
//! invalidated, a path that goes silent without a reset. Each test runs on
//! its own Postgres (they change server settings or cut its paths) and
//! checks SPEC §5/§9's promise: nothing lost, nothing doubled, never a
//! stall.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::common::*;
use futures::StreamExt;
use outbox_relay::wire;

const T: Duration = Duration::from_secs(120);

async fn own_pool(url: &str) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .unwrap()
}

/// The ids of `got`, in stream order.
fn msg_ids(got: &[Got]) -> Vec<uuid::Uuid> {
    got.iter()
        .map(|g| uuid::Uuid::parse_str(g.h(wire::MSG_ID).unwrap()).unwrap())
        .collect()
}

/// Events committing before, while and after `silence()` makes the relay's
/// path silent: every one is stored once, in commit order (how long after
/// the silence is printed, not asserted).
async fn every_event_through(
    pool: &sqlx::PgPool,
    nats_url: &str,
    stream: &str,
    silence: impl FnOnce(),
    relay: &Service,
) {
    let mut sent = insert_txn(pool, 0, 0, 5, 8).await;
    read_stream(nats_url, stream, 5, T).await;
    silence();
    let silenced = Instant::now();
    for i in 1..=20 {
        sent.extend(insert_txn(pool, 0, i * 5, 5, 8).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let got = read_stream(nats_url, stream, sent.len() as u64, T).await;
    eprintln!(
        "every event stored {:.1} s after the path went silent",
        silenced.elapsed().as_secs_f64()
    );
    assert_eq!(
        msg_ids(&got),
        sent,
        "every event once, in commit order: {}",
        relay.log_text()
    );
}

/// Remove the WAL the relay's slot still needs until Postgres invalidates
/// it (`max_slot_wal_keep_size`), as a relay down for a long weekend sees.
async fn invalidate_slot(pool: &sqlx::PgPool, slot: &str) {
    sqlx::raw_sql("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        .execute(pool)
        .await
        .unwrap();
    sqlx::raw_sql("SELECT pg_reload_conf()")
        .execute(pool)
        .await
        .unwrap();
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS wal_filler (n int)")
        .execute(pool)
        .await
        .unwrap();
    let deadline = Instant::now() + T;
    loop {
        let status: Option<String> =
            sqlx::query_scalar("SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1")
                .bind(slot)
                .fetch_one(pool)
                .await
                .unwrap();
        if status.as_deref() == Some("lost") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "slot {slot} not invalidated: {status:?}"
        );
        for sql in [
            "INSERT INTO wal_filler VALUES (1)",
            "SELECT pg_switch_wal()",
            "CHECKPOINT",
        ] {
            sqlx::raw_sql(sql).execute(pool).await.unwrap();
        }
    }
    sqlx::raw_sql("ALTER SYSTEM RESET max_slot_wal_keep_size")
        .execute(pool)
        .await
        .unwrap();
    sqlx::raw_sql("SELECT pg_reload_conf()")
        .execute(pool)
        .await
        .unwrap();
}

/// Item 2: a slot Postgres invalidated (the WAL it needed removed) can never
/// stream again. Before, the relay found it, asked to stream from it, and
/// failed on SQLSTATE 55000 with no `--resync-since` line, again at every
/// start. It is the lost-slot path now: the refusal names the reason and the
/// last stored event, and `--resync-since` republishes the rows the slot
/// lost, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidated_slot_is_a_lost_slot_and_resync_since_republishes_the_gap() {
    let own = OwnStack::up("w-invalid", false);
    let (url, nats) = (
        own.get("DATABASE_URL").to_owned(),
        own.get("NATS_URL").to_owned(),
    );
    migrate(&url);
    let pool = own_pool(&url).await;
    let stream = wire::stream_name("winvalid");
    // The resync republishes from the last stored event's time: the
    // stream's duplicate window must outlast the invalidation on a slow box.
    let js = async_nats::jetstream::new(async_nats::connect(&nats).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: wire::stream_name("winvalid"),
        subjects: vec!["winvalid.>".into()],
        duplicate_window: Duration::from_secs(1800),
        ..Default::default()
    })
    .await
    .unwrap();
    let mut relay = Service::relay(&url, &nats, "winvalid", &["--backfill", "none"]);
    relay.wait_ready();
    let mut sent: HashSet<uuid::Uuid> = insert_txn(&pool, 0, 0, 10, 8).await.into_iter().collect();
    let got = read_stream(&nats, &stream, 10, T).await;
    let last = got.last().unwrap().clone();
    assert!(relay.term(Duration::from_secs(30)).success());
    // Written while the relay is down; the slot then loses their WAL.
    sent.extend(insert_txn(&pool, 0, 10, 10, 8).await);
    invalidate_slot(&pool, &wire::slot_name("winvalid")).await;

    let (code, err) = run_relay_bounded(&url, &nats, "winvalid", &[]);
    assert_eq!(code, Some(1), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{err}");
    let since = last.h(wire::OCCURRED_AT).unwrap();
    assert!(lines[0].contains(last.h(wire::MSG_ID).unwrap()), "{err}");
    assert!(lines[0].contains("--resync-since"), "{err}");
    assert!(
        err.contains("invalidated") && err.contains("wal_removed"),
        "the reason is said: {err}"
    );

    let relay = Service::relay(&url, &nats, "winvalid", &["--resync-since", since]);
    sent.extend(insert_txn(&pool, 0, 20, 10, 8).await);
    let got = read_stream(&nats, &stream, sent.len() as u64, T).await;
    let ids = msg_ids(&got);
    let unique: HashSet<uuid::Uuid> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "a duplicate in the stream");
    assert_eq!(unique, sent, "the stream holds every row once");
    drop(relay);
}

/// Item 1: the relay's path to Postgres goes silent without a reset (a
/// vanished host, a dropped route): the connections open at that moment
/// hear nothing more, new ones pass, and events go on committing. Before,
/// the replication stream waited on its socket for ever (TCP would have
/// given up after ~15 min) while the relay stayed "ready": no event
/// committed after that moment reached the stream. Now Postgres's own
/// view of the connection (`pg_stat_replication.reply_time`, which moves
/// with every status update the relay sends) stops moving, the relay says
/// so, ends the silent walsender and streams again on a new connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_path_gone_silent_is_left_for_a_new_connection() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_wsilent").await;
    let proxy = Proxy::start(&pg_target(&url)).await;
    let stream = wire::stream_name("wsilent");
    let relay = Service::relay(&proxy.pg_url(&url), &stack.nats_url, "wsilent", &[]);
    // Silent for ever for the connections open then; new ones pass.
    every_event_through(
        &pool,
        &stack.nats_url,
        &stream,
        || proxy.black_hole(),
        &relay,
    )
    .await;
    for l in relay.log_text().lines() {
        if l.contains("silent") || l.contains("streaming") || l.contains("session ended") {
            eprintln!("{l}");
        }
    }
    let m = relay.scrape().await;
    assert_eq!(
        m.value("outbox_relay_replication_silences_total"),
        Some(1.0),
        "{}",
        relay.log_text()
    );
    assert!(
        relay.log_text().contains("went silent"),
        "{}",
        relay.log_text()
    );
}

/// Item 1, the NATS side: the relay's paths to nats-server go silent
/// without a reset (the connections open then; new ones pass) while
/// events commit. Every event is stored once, in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_path_gone_silent_is_left_for_a_new_connection() {
    nats_path_gone_silent("wnsilent", &[]).await;
}

/// The same with atomic batches: a batch whose answer is lost is looked up
/// through the relay's client connection, which stalled there for minutes
/// (async-nats pinged an unheard server only after 60 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_path_gone_silent_under_batches_is_left_for_a_new_connection() {
    nats_path_gone_silent("wnsilentb", &["--publish-mode", "batch"]).await;
}

async fn nats_path_gone_silent(ctx: &str, flags: &[&str]) {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, &format!("t_{ctx}")).await;
    let proxy = Proxy::start(stack.nats_url.trim_start_matches("nats://")).await;
    let stream = wire::stream_name(ctx);
    let relay = Service::relay(&url, &proxy.nats_url(), ctx, flags);
    every_event_through(
        &pool,
        &stack.nats_url,
        &stream,
        || proxy.black_hole(),
        &relay,
    )
    .await;
}

/// A text-id outbox with a `stream` column, and a stream `b` beside the
/// relay's own (`own`) for rows to name: the database and the relay's
/// flags routing to both.
async fn routed_outbox(
    stack: &Stack,
    db: &str,
    b: async_nats::jetstream::stream::Config,
    own: &str,
) -> (String, sqlx::PgPool, Vec<String>) {
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let _ = js.delete_stream(&b.name).await;
    let name = b.name.clone();
    js.create_stream(b).await.unwrap();
    let (url, pool) = empty_db(stack, db).await;
    sqlx::raw_sql(
        "CREATE TABLE outbox_events (id text primary key, stream text, \
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
        &format!("{name},{own}"),
    ]
    .map(str::to_owned)
    .to_vec();
    (url, pool, flags)
}

/// Item 4: another writer in a routed stream (a shared stream another
/// team publishes to) comes between two of the relay's messages there, so
/// the order chain refuses the second. Before, every message in flight, of
/// every stream, was sent again (and a refusal behind an unanswered
/// message of another stream was taken for a lost leader: an outage, with
/// probes). Now only that stream's messages go again, from the refused one:
/// the relay's own stream, which nobody else writes, gets each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_writer_in_a_routed_stream_costs_that_stream_alone_a_resend() {
    let stack = stack();
    let b = async_nats::jetstream::stream::Config {
        name: "WFOR_B".into(),
        subjects: vec!["wforb.>".into()],
        ..Default::default()
    };
    let (url, pool, flags) = routed_outbox(&stack, "t_wfor", b, "WFOR_EVENTS").await;
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let client = async_nats::connect(&stack.nats_url).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let mut relay = Service::relay(&url, &stack.nats_url, "wfor", &flags);
    relay.wait_ready();
    // Every copy the relay sends to its own stream, stored or refused.
    let mut copies = client.subscribe("wfor.>").await.unwrap();
    client.flush().await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let foreign = {
        let (js, stop) = (js.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                js.publish("wforb.someone.else", "x".into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                n += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            n
        })
    };
    const TXNS: i64 = 20;
    const PER_TXN: i64 = 1_000;
    for t in 0..TXNS {
        sqlx::query(
            "INSERT INTO outbox_events (id, stream, topic, payload) \
             SELECT CASE WHEN g % 2 = 0 THEN 'b' ELSE 'o' END || lpad(g::text, 8, '0'), \
                    CASE WHEN g % 2 = 0 THEN 'WFOR_B' ELSE 'WFOR_EVENTS' END, \
                    CASE WHEN g % 2 = 0 THEN 'wforb.paid' ELSE 'wfor.placed' END, '{}' \
             FROM generate_series($1::int8, $2::int8) g",
        )
        .bind(t * PER_TXN)
        .bind((t + 1) * PER_TXN - 1)
        .execute(&pool)
        .await
        .unwrap();
    }
    let own = read_stream(
        &stack.nats_url,
        "WFOR_EVENTS",
        (TXNS * PER_TXN / 2) as u64,
        T,
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let foreign = foreign.await.unwrap();
    let b = read_stream(
        &stack.nats_url,
        "WFOR_B",
        (TXNS * PER_TXN / 2) as u64 + foreign,
        T,
    )
    .await;
    let ids = |got: &[Got]| -> Vec<String> {
        got.iter()
            .filter_map(|g| g.h(wire::MSG_ID).map(str::to_owned))
            .collect()
    };
    let want = |prefix: &str, parity: i64| -> Vec<String> {
        (0..TXNS * PER_TXN)
            .filter(|g| g % 2 == parity)
            .map(|g| format!("{prefix}{g:08}"))
            .collect()
    };
    assert_eq!(
        ids(&own),
        want("o", 1),
        "the own stream: each once, in order"
    );
    let b_ids: Vec<String> = ids(&b).into_iter().filter(|i| i.starts_with('b')).collect();
    assert_eq!(
        b_ids,
        want("b", 0),
        "the shared stream: each once, in order"
    );
    let ours = |g: &Got| g.h(wire::MSG_ID).is_some_and(|i| i.starts_with('b'));
    let (first, last) = (
        b.iter().position(ours).unwrap(),
        b.iter().rposition(ours).unwrap(),
    );
    assert!(
        b[first..last].iter().any(|g| !ours(g)),
        "the other writer came between the relay's messages"
    );
    let m = relay.scrape().await;
    assert!(
        m.value("outbox_relay_publish_resends_total").unwrap_or(0.0) > 0.0,
        "the shared stream's order chain was broken and mended"
    );
    assert_eq!(m.value("outbox_relay_session_restarts_total"), Some(0.0));
    // Each copy seen by now: the stream holds every event, and the core
    // subscription saw each publish before the stream stored it.
    let mut seen: HashSet<String> = HashSet::new();
    let mut again = Vec::new();
    while let Ok(Some(msg)) = tokio::time::timeout(Duration::from_millis(200), copies.next()).await
    {
        let id = msg
            .headers
            .as_ref()
            .and_then(|h| h.get(wire::MSG_ID))
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        if !seen.insert(id.clone()) {
            again.push(id);
        }
    }
    assert!(
        !seen.is_empty(),
        "the subscription saw the own stream's publishes"
    );
    assert!(
        again.is_empty(),
        "{} of the own stream's events were sent again (first: {:?}): {}",
        again.len(),
        again.first(),
        relay.log_text()
    );
}

/// Item 5 (review R8): the slot lost right after a backfill finished,
/// before anything was streamed. The stream's newest events of this
/// database were all backfilled, so the relay took the finished run for an
/// interrupted one and backfilled again from a new snapshot: the outbox's
/// rows came back, but the events written with `outbox_emit()` since (WAL
/// only) were gone without a word. A finished run marks its last message
/// (`Outbox-Backfill-End`), so this is the lost slot it is: refused with
/// the last event and `--resync-since`, which then brings back the rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_lost_after_a_finished_backfill_is_a_lost_slot() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_wbfend").await;
    let stream = wire::stream_name("wbfend");
    let mut sent = Vec::new();
    for i in 0..5 {
        sent.extend(insert_txn(&pool, 0, i * 10, 10, 8).await);
    }
    let mut relay = Service::relay(&url, &stack.nats_url, "wbfend", &[]);
    eventually(T, "the backfill done and the relay streaming", || async {
        relay.scrape().await.value("outbox_relay_streaming") == Some(1.0)
    })
    .await;
    let got = read_stream(&stack.nats_url, &stream, 50, T).await;
    assert_eq!(got.len(), 50);
    let last = got.last().unwrap().clone();
    assert_eq!(
        last.h(wire::BACKFILL_END),
        Some("1"),
        "the run's last message says so"
    );
    assert!(got[..49].iter().all(|g| g.h(wire::BACKFILL_END).is_none()));
    assert!(relay.term(Duration::from_secs(30)).success());
    drop_slot(&url, "wbfend");
    for i in 5..7 {
        sent.extend(insert_txn(&pool, 0, i * 10, 10, 8).await);
    }
    let line = lost_slot_refusal(&url, &stack.nats_url, "wbfend");
    let since = last.h(wire::OCCURRED_AT).unwrap();
    assert!(line.contains(last.h(wire::MSG_ID).unwrap()), "{line}");
    assert!(line.contains(&format!("--resync-since {since}")), "{line}");
    assert!(line.contains("outbox_emit()"), "{line}");
    assert!(line.contains("a backfill finished"), "{line}");
    let _relay = Service::relay(&url, &stack.nats_url, "wbfend", &["--resync-since", since]);
    let got = read_stream(&stack.nats_url, &stream, 70, T).await;
    let ids: HashSet<uuid::Uuid> = msg_ids(&got).into_iter().collect();
    assert!(
        sent.iter().all(|id| ids.contains(id)),
        "every row in the stream after the resync"
    );
}

/// Item 3: a routed stream at its limits (`max_msgs` with discard new)
/// refuses the next row for it (10077, "maximum messages exceeded").
/// Before, that ended the session, the replay met the same refusal, and
/// every other stream's events waited behind it for ever. Now such a row
/// is a `stream_full` dead letter in the relay's own stream, and the rows
/// after it, for any stream, flow on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_routed_stream_stops_no_other_stream() {
    let stack = stack();
    let b = async_nats::jetstream::stream::Config {
        name: "WFULL_B".into(),
        subjects: vec!["wfullb.>".into()],
        max_messages: 3,
        discard: async_nats::jetstream::stream::DiscardPolicy::New,
        ..Default::default()
    };
    let (url, pool, flags) = routed_outbox(&stack, "t_wfull", b, "WFULL_EVENTS").await;
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut relay = Service::relay(&url, &stack.nats_url, "wfull", &flags);
    let insert = |id: String, stream: Option<&'static str>, topic: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO outbox_events (id, stream, topic, payload) VALUES ($1, $2, $3, '{}')",
            )
            .bind(id)
            .bind(stream)
            .bind(topic)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    for i in 1..=5 {
        insert(format!("b{i}"), Some("WFULL_B"), "wfullb.paid").await;
    }
    for i in 1..=5 {
        insert(format!("o{i}"), Some("WFULL_EVENTS"), "wfull.placed").await;
    }
    let own = read_stream(&stack.nats_url, &wire::stream_name("wfull"), 7, T).await;
    let (dead, events): (Vec<_>, Vec<_>) =
        own.iter().partition(|g| g.h(wire::DLQ_REASON).is_some());
    let ids = |v: &[&Got]| -> Vec<String> {
        v.iter()
            .filter_map(|g| g.h(wire::MSG_ID).map(str::to_owned))
            .collect()
    };
    assert_eq!(
        ids(&events),
        ["o1", "o2", "o3", "o4", "o5"],
        "the other stream's rows flow, in order: {}",
        relay.log_text()
    );
    let mut dead_ids = ids(&dead);
    dead_ids.sort();
    assert_eq!(dead_ids, ["b4", "b5"], "{}", relay.log_text());
    for dead in &dead {
        assert_eq!(dead.h(wire::DLQ_REASON), Some("stream_full"));
        assert!(
            dead.h(wire::DLQ_DETAIL)
                .is_some_and(|d| d.contains("maximum messages")),
            "{:?}",
            dead.h(wire::DLQ_DETAIL)
        );
    }
    let b = read_stream(&stack.nats_url, "WFULL_B", 3, T).await;
    let b: Vec<&str> = b.iter().filter_map(|g| g.h(wire::MSG_ID)).collect();
    assert_eq!(b, ["b1", "b2", "b3"]);
    let m = relay.scrape().await;
    assert_eq!(
        m.value("outbox_relay_events_dead_lettered_total{reason=\"stream_full\"}"),
        Some(2.0)
    );
    assert!(relay.exited().is_none(), "{}", relay.log_text());
}

/// Item 3, the relay's own stream at its limits: nothing can go past it
/// (its events are in order), so the relay says so in one line, counts
/// it (`outbox_relay_stream_full_total`, alert `OutboxRelayStreamFull`),
/// and once the stream has room stores every event once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_own_stream_is_said_and_loses_nothing() {
    let stack = stack();
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let name = wire::stream_name("wfullo");
    let _ = js.delete_stream(&name).await;
    let mut config = async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec!["wfullo.>".into()],
        max_messages: 3,
        discard: async_nats::jetstream::stream::DiscardPolicy::New,
        duplicate_window: Duration::from_secs(600),
        ..Default::default()
    };
    js.create_stream(config.clone()).await.unwrap();
    let (url, pool) = fresh_db(&stack, "t_wfullo").await;
    let relay = Service::relay(&url, &stack.nats_url, "wfullo", &[]);
    let sent = insert_txn(&pool, 0, 0, 5, 8).await;
    eventually(T, "the full stream counted", || async {
        relay
            .scrape()
            .await
            .value("outbox_relay_stream_full_total")
            .is_some_and(|n| n >= 1.0)
    })
    .await;
    let log = relay.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("at its limits") && l.contains("nothing is lost")),
        "{log}"
    );
    config.max_messages = -1;
    js.update_stream(&config).await.unwrap();
    let got = read_stream(&stack.nats_url, &name, 5, T).await;
    assert_eq!(msg_ids(&got), sent, "every event once, in commit order");
}

/// Issue 58 item 8 (review N12): an event JetStream answers as a duplicate
/// was stored before (a replay the read-back did not reach): it is skipped,
/// not published. Before, every duplicate ack counted in
/// `outbox_relay_events_published_total` (and its full age in the
/// commit-to-ack histogram), so a replay inflated the figure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_ack_counts_as_skipped_not_published() {
    let stack = stack();
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let name = wire::stream_name("wdup");
    let _ = js.delete_stream(&name).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: name.clone(),
        subjects: vec!["wdup.>".into()],
        duplicate_window: Duration::from_secs(600),
        ..Default::default()
    })
    .await
    .unwrap();
    let (url, pool) = fresh_db(&stack, "t_wdup").await;
    let mut relay = Service::relay(&url, &stack.nats_url, "wdup", &["--publish-mode", "event"]);
    relay.wait_ready();
    // Ids the stream already holds (stored by an earlier run this relay
    // cannot read back: no source header), then rows with them and new ones.
    let earlier: Vec<uuid::Uuid> = (0..5).map(|_| uuid::Uuid::new_v4()).collect();
    for id in &earlier {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", id.to_string().as_str());
        js.publish_with_headers("wdup.earlier", h, "{}".into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let later: Vec<uuid::Uuid> = (0..3).map(|_| uuid::Uuid::new_v4()).collect();
    for id in earlier.iter().chain(&later) {
        sqlx::query(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'order', 'o1', 'placed', '{}')",
        )
        .bind(id)
        .execute(&pool)
        .await
        .unwrap();
    }
    eventually(T, "every row acked", || async {
        let m = relay.scrape().await;
        m.value("outbox_relay_events_published_total")
            .unwrap_or(0.0)
            + m.value("outbox_relay_events_skipped_total").unwrap_or(0.0)
            >= 8.0
    })
    .await;
    let m = relay.scrape().await;
    assert_eq!(
        m.value("outbox_relay_events_published_total"),
        Some(later.len() as f64),
        "{}",
        relay.log_text()
    );
    assert_eq!(
        m.value("outbox_relay_events_skipped_total"),
        Some(earlier.len() as f64)
    );
}

/// Review N7 (issue 58, item 5): a restart whose replay lies far behind what
/// the stream holds — one big transaction, the relay killed with part of it
/// stored — over a slow path to NATS and past the duplicate window, stores
/// no event twice. The read-back was capped (a million messages, ten
/// seconds); what it did not reach was published again, and once the
/// window had passed, stored again. Now the stream is read back at the
/// replay's pace, as far as the replay has come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_far_behind_the_stream_stores_nothing_twice_past_the_duplicate_window() {
    let stack = stack();
    let ctx = "wreadback";
    let (url, pool) = fresh_db(&stack, "t_wreadback").await;
    let proxy = Proxy::start(stack.nats_url.trim_start_matches("nats://")).await;
    let stream = wire::stream_name(ctx);
    let mut relay = Service::relay(&url, &proxy.nats_url(), ctx, &["--duplicate-window", "1s"]);
    relay.wait_ready();
    const N: u64 = 60_000;
    let sent: HashSet<uuid::Uuid> = sqlx::query_scalar(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'bulk', (g % 100)::text, 'imported', jsonb_build_object('s', g) \
         FROM generate_series(1, $1::int8) g RETURNING id",
    )
    .bind(N as i64)
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let count = || async {
        match js.get_stream(&stream).await {
            Ok(mut s) => s.info().await.map_or(0, |i| i.state.messages),
            Err(_) => 0,
        }
    };
    // Killed with a third stored: the slot is still before the commit.
    eventually(T, "a third of the transaction stored", || async {
        count().await >= N / 3
    })
    .await;
    relay.kill9();
    let stored = count().await;
    assert!(stored < N, "killed before the transaction was all stored");
    // A slow path (each answer 400 ms late), and the window passed: what
    // the restart does not read back is stored a second time.
    proxy.delay(Duration::from_millis(400));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let restarted = Instant::now();
    relay.restart();
    // Once it stores past what was there, the read-back is behind it: the
    // path may be fast again.
    eventually(
        Duration::from_secs(300),
        "the restart storing new events",
        || async { count().await > stored },
    )
    .await;
    proxy.delay(Duration::ZERO);
    let got = read_stream(&stack.nats_url, &stream, N, T).await;
    let distinct: HashSet<&str> = got.iter().filter_map(|g| g.h(wire::MSG_ID)).collect();
    eprintln!(
        "{stored} of {N} stored before the kill; every event stored {:.1} s after the restart; relay peak RSS {:?} KiB",
        restarted.elapsed().as_secs_f64(),
        relay.peak_rss_kib()
    );
    assert_eq!(
        got.len() - distinct.len(),
        0,
        "events stored twice ({} messages, {} events): {}",
        got.len(),
        distinct.len(),
        relay.log_text()
    );
    assert_exactly_once_in_order(&got, &sent);
}
