//! Relay integration tests against the real stack (scripts/test.sh).
//! Each test has its own database, context (so slot, publication and stream)
//! and relay process.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use outbox_relay::wire;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const T: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_events_mixed_transactions_arrive_once_in_commit_order() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_mixed").await;
    let _relay = Service::relay(&url, &stack.nats_url, "mixed", &[]);

    // Three concurrent producers, transactions of 1 to 200 rows: 10,000 events.
    let mut tasks = Vec::new();
    for p in 0..3u32 {
        let pool = pool.clone();
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut seq = 0u64;
            let target = if p == 0 { 3334 } else { 3333 };
            while seq < target {
                let n = [1u64, 7, 50, 200][(seq as usize / 3 + p as usize) % 4].min(target - seq);
                ids.extend(insert_txn(&pool, p, seq, n, 16).await);
                seq += n;
            }
            ids
        }));
    }
    let mut sent = HashSet::new();
    for t in tasks {
        sent.extend(t.await.unwrap());
    }
    assert_eq!(sent.len(), 10_000);

    let got = read_stream(&stack.nats_url, &wire::stream_name("mixed"), 10_000, T).await;
    assert_exactly_once_in_order(&got, &sent);

    // Every SPEC §4 header, and the body is the payload.
    let g = &got[0];
    assert_eq!(g.subject, "mixed.event.placed.v1");
    for h in [
        wire::MSG_ID,
        wire::EVENT_TYPE,
        wire::EVENT_VERSION,
        wire::AGGREGATE_TYPE,
        wire::AGGREGATE_ID,
        wire::OCCURRED_AT,
        wire::COMMIT_LSN,
    ] {
        assert!(g.h(h).is_some(), "missing header {h}");
    }
    assert_eq!(g.h(wire::EVENT_TYPE), Some("placed"));
    assert_eq!(g.h(wire::AGGREGATE_TYPE), Some("order"));
    time::OffsetDateTime::parse(
        g.h(wire::OCCURRED_AT).unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .expect("Outbox-Occurred-At is RFC 3339");
    assert!(g.json()["p"].is_u64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_headers_text_format_and_alter_table_mid_stream() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_alter").await;
    let _relay = Service::relay(
        &url,
        &stack.nats_url,
        "alter",
        &[
            "--tuple-format",
            "text",
            "--subject-template",
            "{context}.{aggregate_type}.{partition}",
            "--partitions",
            "4",
        ],
    );
    let corr = uuid::Uuid::new_v4();
    let id1 = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, event_version, payload, correlation_id, headers, occurred_at) \
         VALUES ($1, 'cart', 'c-1', 'added', 3, '{\"sku\": \"A\"}', $2, '{\"traceparent\": \"00-abc-def-01\"}', '2026-01-02 03:04:05.678+00')",
    )
    .bind(id1)
    .bind(corr)
    .execute(&pool)
    .await
    .unwrap();
    // Columns change under the running relay: one added before the payload
    // column would be in a fresh table, one dropped.
    sqlx::query("ALTER TABLE outbox_events ADD COLUMN tenant text DEFAULT 't1'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE outbox_events DROP COLUMN publish_error")
        .execute(&pool)
        .await
        .unwrap();
    let id2 = uuid::Uuid::new_v4();
    sqlx::query("INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, subject) VALUES ($1, 'cart', 'c-2', 'removed', '[1, 2]', 'alter.custom.subject')")
        .bind(id2)
        .execute(&pool)
        .await
        .unwrap();

    let got = read_stream(&stack.nats_url, &wire::stream_name("alter"), 2, T).await;
    assert_eq!(got.len(), 2);
    let (a, b) = (&got[0], &got[1]);
    assert_eq!(a.h(wire::MSG_ID), Some(id1.to_string().as_str()));
    assert!(a.subject.starts_with("alter.cart."), "{}", a.subject);
    let part: u32 = a.subject.rsplit('.').next().unwrap().parse().unwrap();
    assert!(part < 4);
    assert_eq!(a.h(wire::EVENT_VERSION), Some("3"));
    assert_eq!(a.h(wire::CORRELATION_ID), Some(corr.to_string().as_str()));
    assert_eq!(a.h(wire::CAUSATION_ID), None);
    assert_eq!(a.h(wire::TRACEPARENT), Some("00-abc-def-01"));
    assert_eq!(a.h(wire::OCCURRED_AT), Some("2026-01-02T03:04:05.678Z"));
    assert_eq!(a.payload, br#"{"sku": "A"}"#);
    assert_eq!(b.subject, "alter.custom.subject");
    assert_eq!(b.payload, b"[1, 2]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_transaction_streams_with_bounded_memory() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_large").await;
    let mut relay = Service::relay(&url, &stack.nats_url, "large", &["--publish-mode", "batch"]);
    // What the relay holds streaming and idle: its code, runtime,
    // connections. The transaction's share is what it adds to that.
    let idle = relay.rss_kib().expect("the relay's VmRSS");
    const N: u64 = 200_000;
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'bulk', (g % 1000)::text, 'imported', jsonb_build_object('p', 0, 's', g, 'pad', repeat('x', 200)) \
         FROM generate_series(1, $1::int8) g",
    )
    .bind(N as i64)
    .execute(&pool)
    .await
    .unwrap();
    let sent: HashSet<uuid::Uuid> =
        sqlx::query_scalar::<_, uuid::Uuid>("SELECT id FROM outbox_events")
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let started = Instant::now();
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name("large"),
        N,
        Duration::from_secs(400),
    )
    .await;
    let peak = relay.peak_rss_kib();
    assert_exactly_once_in_order(&got, &sent);
    let commit = got[0].h(wire::COMMIT_LSN).unwrap();
    assert!(
        got.iter().all(|g| g.h(wire::COMMIT_LSN) == Some(commit)),
        "one transaction"
    );
    // Over the batch limit: consecutive batches, numbered from 1, the last
    // saying how many there are.
    let number = |g: &Got| g.h(wire::TXN_BATCH).and_then(|k| k.parse::<u64>().ok());
    let last = number(&got[got.len() - 1]).expect("split into batches");
    assert!(
        last >= N / 1000,
        "at most 1,000 events a batch: {last} batches"
    );
    let mut prev = 1;
    for g in &got {
        let k = number(g).expect("every event says its batch");
        assert!(k == prev || k == prev + 1, "batch {k} after {prev}");
        prev = k;
        let count = (k == last).then(|| last.to_string());
        assert_eq!(
            g.h(wire::TXN_BATCHES),
            count.as_deref(),
            "only the last batch says the count"
        );
    }
    // Timing belongs to the bench; memory has a bound: the publish window
    // and the replication buffer, not the transaction, decide it.
    let peak = peak.expect("the relay's VmHWM");
    println!(
        "200k-row transaction: relayed in {:?}; relay RSS idle {idle} KiB, peak {peak} KiB",
        started.elapsed(),
    );
    assert!(
        peak.saturating_sub(idle) < TRANSACTION_RSS_BOUND_KIB,
        "relay peak RSS {peak} KiB is {} KiB over its idle {idle} KiB (bound {TRANSACTION_RSS_BOUND_KIB}) for a 200k-row transaction",
        peak.saturating_sub(idle)
    );
    assert!(relay.term(Duration::from_secs(30)).success());
}

/// What a transaction of any size may add to the relay's memory (issue
/// 14): the publish window and the replication buffer, not the
/// transaction (60 MB of payload here), decide it. Measured in a debug
/// build, the peak levels off and does not follow the transaction: 44.5
/// MiB for 2,000 rows, 48.3 to 49.3 for 200,000 (2026-11-24); by
/// 2026-11-30 the relay itself had grown (43 MiB streaming and idle) and
/// the 200,000-row peak stood at 63 to 66 MiB against the old absolute
/// bound of 64 MiB: a test that failed on noise. So the bound is on what
/// the transaction adds to the idle relay: 22.7 MiB measured, bounded at
/// 40 (holding the transaction would add over 60).
const TRANSACTION_RSS_BOUND_KIB: u64 = 40 * 1024;

/// A random schedule, seeded, and the seed printed, so a failing one can be
/// replayed with TEST_SEED.
fn kill_schedule() -> (u64, StdRng) {
    let seed = std::env::var("TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    println!("kill schedule seed: TEST_SEED={seed}");
    (seed, StdRng::seed_from_u64(seed))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_load_loses_nothing_and_duplicates_nothing() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_kill").await;
    let mut relay = Service::relay(&url, &stack.nats_url, "kill", &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let producer = spawn_producer(pool.clone(), 12_000, 1500, stop.clone());
    let (_, mut rng) = kill_schedule();
    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(700..1800))).await;
        relay.kill9();
        // Sometimes come back at once, sometimes after a backlog built up.
        tokio::time::sleep(Duration::from_millis(if round % 2 == 0 {
            50
        } else {
            1200
        }))
        .await;
        relay.restart();
    }
    let sent = producer.await.unwrap();
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name("kill"),
        sent.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &sent);
    let st = relay.term(Duration::from_secs(30));
    assert!(st.success(), "graceful stop exits 0, got {st:?}");
    assert!(
        relay.log_text().contains("relay stopped"),
        "reports the final LSN"
    );
}

/// SPEC §5: with atomic batch publish, a transaction is in the stream all
/// or nothing, even when the relay dies in the middle of it. Each round
/// kills the relay at a random point under a load of multi-row
/// transactions, then, while nothing writes, reads the whole stream: every
/// transaction in it must be whole (the one-event-at-a-time path fails
/// this: a kill between two events of a transaction leaves its first part
/// visible until a restart completes it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_is_in_the_stream_whole_or_not_at_all_across_kill_9() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_atomic").await;
    let mut relay = Service::relay(
        &url,
        &stack.nats_url,
        "atomic",
        &["--publish-mode", "batch"],
    );
    let (seed, mut rng) = kill_schedule();
    let stop = Arc::new(AtomicBool::new(false));
    // Transactions of 1 to 300 rows, each row saying its transaction's size.
    let producer = {
        let (pool, stop) = (pool.clone(), stop.clone());
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
        tokio::spawn(async move {
            let mut sent = HashSet::new();
            let mut txn = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let n: u64 = [1, 2, 17, 60, 300][rng.gen_range(0..5)];
                let mut q = sqlx::QueryBuilder::new(
                    "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) ",
                );
                let ids: Vec<uuid::Uuid> = (0..n).map(|_| uuid::Uuid::new_v4()).collect();
                q.push_values(ids.iter(), |mut b, id| {
                    b.push_bind(*id)
                        .push_bind("order")
                        .push_bind(format!("a{}", txn % 7))
                        .push_bind("placed")
                        .push_bind(serde_json::json!({"txn": txn, "rows": n}));
                });
                q.build().execute(&pool).await.unwrap();
                sent.extend(ids);
                txn += 1;
                tokio::time::sleep(Duration::from_millis(rng.gen_range(0..4))).await;
            }
            sent
        })
    };
    let stream = wire::stream_name("atomic");
    let whole = |got: &[Got]| {
        let mut seen: std::collections::BTreeMap<u64, (u64, u64)> = Default::default();
        for g in got {
            let j = g.json();
            let (txn, rows) = (j["txn"].as_u64().unwrap(), j["rows"].as_u64().unwrap());
            seen.entry(txn).or_insert((0, rows)).0 += 1;
        }
        let partial: Vec<_> = seen.iter().filter(|(_, (n, rows))| n != rows).collect();
        assert!(
            partial.is_empty(),
            "transactions visible in part (txn: (seen, rows)): {partial:?}"
        );
        seen.len()
    };
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(300..1500))).await;
        relay.kill9();
        let held = stream_messages(&stack.nats_url, &stream).await;
        let got = read_stream(&stack.nats_url, &stream, held, T).await;
        let txns = whole(&got);
        println!(
            "killed with {} events of {txns} transactions in the stream, all whole",
            got.len()
        );
        relay.restart();
    }
    stop.store(true, Ordering::Relaxed);
    let sent = producer.await.unwrap();
    let got = read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
    whole(&got);
    let m = relay.scrape().await;
    assert_eq!(
        m.value("outbox_relay_publish_batches"),
        Some(1.0),
        "publishes in batches"
    );
}

/// Review of the batch publisher, defect 3: routing let through a row whose
/// message fits the server's `max_payload` only without the headers the
/// publisher adds (the batch headers, the order chain). In batches the
/// client then refused it at every send, the session ended, and the relay
/// looped on that row forever. Now such a row is too large at routing: it
/// is dead-lettered and what follows flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_fits_only_without_the_publishers_headers_is_dead_lettered() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_nearmax").await;
    let conf =
        std::env::temp_dir().join(format!("outbox-relay-nearmax-{}.conf", std::process::id()));
    std::fs::write(&conf, "max_payload: 4096\n").unwrap();
    let nats = OwnNats::start_with(&stack, "nearmax", &["-c", conf.to_str().unwrap()]);
    let relay = Service::relay(&url, &nats.url, "nearmax", &["--publish-mode", "batch"]);
    let stream = wire::stream_name("nearmax");
    let insert = |pad: usize| {
        let pool = pool.clone();
        async move {
            let id = uuid::Uuid::new_v4();
            sqlx::query(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, 'order', 'a1', 'placed', jsonb_build_object('pad', repeat('x', $2)))",
            )
            .bind(id)
            .bind(pad as i32)
            .execute(&pool)
            .await
            .unwrap();
            id
        }
    };
    // A probe shows the size of the header block and body of such a row.
    let probe = insert(1).await;
    let got = read_stream(&nats.url, &stream, 1, T).await;
    let headers: usize = got[0]
        .headers
        .iter()
        .map(|(k, v)| k.len() + v.len() + 4)
        .sum::<usize>()
        + 12;
    let fixed = headers + got[0].payload.len() - 1;
    // 60 bytes under the limit: it fits alone, not with ~150 bytes of
    // batch headers.
    let near = 4096 - 60 - fixed;
    let mut tx = pool.begin().await.unwrap();
    let big = uuid::Uuid::new_v4();
    let small = uuid::Uuid::new_v4();
    for (id, pad) in [(big, near), (small, 1)] {
        sqlx::query(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'order', 'a1', 'placed', jsonb_build_object('pad', repeat('x', $2)))",
        )
        .bind(id)
        .bind(pad as i32)
        .execute(&mut *tx)
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    let after = insert(1).await;
    let got = read_stream(&nats.url, &stream, 4, T).await;
    let ids: Vec<&str> = got.iter().map(|g| g.h(wire::MSG_ID).unwrap()).collect();
    assert_eq!(
        ids,
        [probe, big, small, after].map(|u| u.to_string()),
        "every row, in order"
    );
    assert_eq!(got[1].subject, wire::relay_dlq_subject("nearmax"));
    assert_eq!(got[1].h(wire::DLQ_REASON), Some("too_large"));
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_session_restarts_total"), Some(0.0));
    let _ = std::fs::remove_file(conf);
}

/// Review of the batch publisher, defect 1: a stream that stops capturing
/// the relay's subjects answers every commit at once with "no responders".
/// Each answer started a look-up and a resend with a fresh clock, so the
/// session never ended and the relay stayed ready, resending forever. Now
/// the session ends after the outage budget (60 s), as event by event, and
/// once the stream captures the subjects again every row arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_a_stream_never_answers_end_the_session_after_the_outage_budget() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_uncapt").await;
    let relay = Service::relay(
        &url,
        &stack.nats_url,
        "uncapt",
        &["--publish-mode", "batch"],
    );
    let stream = wire::stream_name("uncapt");
    let mut sent: HashSet<uuid::Uuid> = insert_txn(&pool, 0, 0, 2, 0).await.into_iter().collect();
    read_stream(&stack.nats_url, &stream, 2, T).await;
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let mut config = js
        .get_stream(&stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    let subjects = config.subjects.clone();
    config.subjects = vec!["uncapt.dlq.>".into()];
    js.update_stream(&config).await.unwrap();
    sent.extend(insert_txn(&pool, 0, 2, 2, 0).await);
    eventually(Duration::from_secs(100), "the session ends", || async {
        relay
            .scrape()
            .await
            .value("outbox_relay_session_restarts_total")
            .is_some_and(|r| r >= 1.0)
    })
    .await;
    config.subjects = subjects;
    js.update_stream(&config).await.unwrap();
    let got = read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
}

/// The last release before atomic batch publish.
const NATS_WITHOUT_BATCHES: &str = "2.11.11";

/// A server older than 2.12.1 gets today's path: one publish per event,
/// chained, in order; and `--publish-mode batch` refuses to start there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_without_atomic_batches_gets_one_publish_per_event() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_oldnats").await;
    let nats = OwnNats::start_version(&stack, "oldnats", NATS_WITHOUT_BATCHES);
    let (code, err) = run_relay_bounded(&url, &nats.url, "oldnats", &["--publish-mode", "batch"]);
    assert_eq!(code, Some(1), "refused at start: {err}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("error:") && l.contains("2.12.1")),
        "one line naming the release it needs: {err}"
    );

    let relay = Service::relay(&url, &nats.url, "oldnats", &[]);
    let mut sent = HashSet::new();
    for (i, n) in [1u64, 40, 3, 120, 7].into_iter().enumerate() {
        sent.extend(insert_txn(&pool, 0, i as u64 * 1000, n, 8).await);
    }
    let got = read_stream(
        &nats.url,
        &wire::stream_name("oldnats"),
        sent.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &sent);
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_publish_batches"), Some(0.0));
    assert_eq!(
        m.value("outbox_relay_batches_total{result=\"committed\"}"),
        Some(0.0)
    );
    // SPEC §15: the 2.11 line has no fix for a 2026 advisory.
    let log = relay.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("upgrade to 2.12.12, 2.14.3")),
        "one warning naming the releases with the fix: {log}"
    );
}

/// Issue 32: nats-server stages an atomic batch of a one-replica file
/// stream on disk, about 2 ms of server CPU per transaction, so `auto`
/// publishes event by event there and says why; a stream that stages in
/// memory (replicated, or memory storage) gets whole transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_publishes_event_by_event_on_a_one_replica_file_stream_and_batches_elsewhere() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_automode").await;
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let mut sent: HashSet<uuid::Uuid> = HashSet::new();
    let file = wire::stream_name("automode");
    let relay = Service::relay(&url, &stack.nats_url, "automode", &[]);
    sent.extend(insert_txn(&pool, 0, 0, 30, 8).await);
    let got = read_stream(&stack.nats_url, &file, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_publish_batches"), Some(0.0));
    assert!(
        relay.log_text().contains("one-replica file stream"),
        "the log says why"
    );
    drop(relay);

    let memory = "AUTOMODE_MEM";
    js.delete_stream(&file).await.unwrap();
    js.create_stream(async_nats::jetstream::stream::Config {
        name: memory.into(),
        subjects: vec!["automode.>".into()],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        allow_atomic_publish: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let relay = Service::relay(&url, &stack.nats_url, "automode", &["--stream", memory]);
    // The new, empty stream gets the table's rows again, then the new ones.
    sent.extend(insert_txn(&pool, 0, 100, 30, 8).await);
    let got = read_stream(&stack.nats_url, memory, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_publish_batches"), Some(1.0));
    assert!(
        m.value("outbox_relay_batches_total{result=\"committed\"}")
            .unwrap_or(0.0)
            >= 1.0
    );
}

/// An existing stream is used as it is: without `allow_atomic` the relay
/// publishes event by event (and says how to change that); asked for
/// batches in so many words, it allows them on the stream and batches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_stream_without_atomic_publish_gets_batches_only_when_asked() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_noatomic").await;
    let stream = wire::stream_name("noatomic");
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    // In memory: `auto` would batch on it, but for the setting.
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec!["noatomic.>".into()],
        storage: async_nats::jetstream::stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut sent: HashSet<uuid::Uuid> = HashSet::new();
    let relay = Service::relay(&url, &stack.nats_url, "noatomic", &[]);
    sent.extend(insert_txn(&pool, 0, 0, 30, 8).await);
    read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    let m = relay.scrape().await;
    assert_eq!(
        m.value("outbox_relay_publish_batches"),
        Some(0.0),
        "auto: the stream says no"
    );
    assert!(
        relay.log_text().contains("allow_atomic"),
        "the log says how to change it"
    );
    drop(relay);

    let relay = Service::relay(
        &url,
        &stack.nats_url,
        "noatomic",
        &["--publish-mode", "batch"],
    );
    sent.extend(insert_txn(&pool, 0, 100, 30, 8).await);
    let got = read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_publish_batches"), Some(1.0));
    assert!(
        m.value("outbox_relay_batches_total{result=\"committed\"}")
            .unwrap()
            >= 1.0
    );
    let mut s = js.get_stream(&stream).await.unwrap();
    assert!(s.info().await.unwrap().config.allow_atomic_publish);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_under_load_loses_nothing_and_keeps_order() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_natsrestart").await;
    let mut nats = OwnNats::start(&stack, "restart");
    let relay = Service::relay(&url, &nats.url, "natsrs", &["--publish-timeout", "2s"]);
    let stop = Arc::new(AtomicBool::new(false));
    let producer = spawn_producer(pool.clone(), 10_000, 1500, stop.clone());
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        nats.down();
        // Readiness follows NATS: the endpoint says so while it is gone.
        eventually(T, "/readyz names NATS while it is down", || async {
            let (status, body) = relay.http_get("/readyz").await;
            status == 503 && body.contains("NATS")
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1000)).await;
        nats.up();
    }
    let sent = producer.await.unwrap();
    let got = read_stream(
        &nats.url,
        &wire::stream_name("natsrs"),
        sent.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &sent);
    eventually(T, "/readyz ready again after NATS came back", || async {
        relay.http_get("/readyz").await.0 == 200
    })
    .await;
    // The outage is ridden out inside the session (publishes whose acks
    // were lost are sent again and acked as duplicates) or by a new one
    // (stored events are found and skipped): together the two counters
    // cover every event, once the last resend is acked.
    let covered = |m: &Scrape| {
        m.value("outbox_relay_events_published_total").unwrap()
            + m.value("outbox_relay_events_skipped_total").unwrap()
    };
    eventually(T, "every event acked or skipped", || async {
        covered(&relay.scrape().await) >= sent.len() as f64
    })
    .await;
}

/// The publish connection answers the server's PINGs while idle: a server
/// that pings every second and allows one unanswered ping would otherwise
/// close it as stale between two events, and the next event would find it
/// gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_publish_connection_answers_the_servers_pings() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_idleping").await;
    let conf = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nats-idleping.conf");
    std::fs::write(&conf, "ping_interval: \"1s\"\nping_max: 1\n").unwrap();
    let nats = OwnNats::start_with(&stack, "idleping", &["-c", conf.to_str().unwrap()]);
    let relay = Service::relay(&url, &nats.url, "idleping", &[]);
    let mut sent = insert_txn(&pool, 0, 0, 3, 8).await;
    read_stream(&nats.url, &wire::stream_name("idleping"), 3, T).await;
    // Idle through four of the server's pings: the subject of the test.
    tokio::time::sleep(Duration::from_secs(4)).await;
    sent.extend(insert_txn(&pool, 0, 3, 3, 8).await);
    let got = read_stream(&nats.url, &wire::stream_name("idleping"), 6, T).await;
    assert_exactly_once_in_order(&got, &sent.into_iter().collect());
    let log = relay.log_text();
    assert!(
        !log.contains("the publish connection failed") && !log.contains("Stale Connection"),
        "the publish connection was closed while idle:\n{log}"
    );
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_publish_resends_total"), Some(0.0));
}

/// Issue 44, item 3: an idle publish link on a path that went silent (a
/// black hole: nothing is reset, nothing arrives) was kept until the next
/// event stalled on it. The link now PINGs an idle server and gives the
/// connection up when no PONG comes, while idle, so the next event goes
/// on a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_publish_link_on_a_silent_path_is_given_up_while_idle() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_idlesilent").await;
    let proxy = Proxy::start(stack.nats_url.trim_start_matches("nats://")).await;
    let relay = Service::relay(&url, &proxy.nats_url(), "idlesilent", &[]);
    let stream = wire::stream_name("idlesilent");
    let mut sent = insert_txn(&pool, 0, 0, 3, 8).await;
    read_stream(&stack.nats_url, &stream, 3, T).await;
    proxy.freeze();
    eventually(T, "the idle link is given up", || async {
        relay.log_text().contains("taken for dead")
    })
    .await;
    proxy.heal();
    sent.extend(insert_txn(&pool, 0, 3, 3, 8).await);
    let got = read_stream(&stack.nats_url, &stream, 6, T).await;
    assert_exactly_once_in_order(&got, &sent.into_iter().collect());
}

/// A server list whose first entry accepts connections and never speaks
/// (a hung host): the publish connection gives it up after its handshake
/// timeout and publishes through the next server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_first_server_is_passed_over() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_silentfirst").await;
    let nats = OwnNats::start(&stack, "silentfirst");
    // Connections queue in its backlog; nothing is ever read or written.
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let servers = format!("nats://{},{}", hole.local_addr().unwrap(), nats.url);
    let relay = Service::relay(&url, &servers, "silentfirst", &[]);
    let sent = insert_txn(&pool, 0, 0, 20, 8).await;
    let got = read_stream(&nats.url, &wire::stream_name("silentfirst"), 20, T).await;
    assert_exactly_once_in_order(&got, &sent.into_iter().collect());
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_session_restarts_total"), Some(0.0));
    drop(hole);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walsender_terminated_while_ack_held_never_confirms_past_it() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_held").await;
    let nats = OwnNats::start(&stack, "held");
    let _relay = Service::relay(&url, &nats.url, "held", &["--publish-timeout", "30s"]);
    let slot = &wire::slot_name("held");
    // Warm up: one event through, so the stream and slot exist.
    let mut sent: HashSet<uuid::Uuid> = insert_txn(&pool, 0, 0, 1, 0).await.into_iter().collect();
    read_stream(&nats.url, &wire::stream_name("held"), 1, T).await;

    // Hold every JetStream ack: freeze the server.
    signal(nats.pid(), "STOP");
    let before: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    sent.extend(insert_txn(&pool, 0, 1, 3, 0).await);
    let after_commit: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    // Let the relay read and publish it (acks held), and WAL move on elsewhere.
    tokio::time::sleep(Duration::from_secs(2)).await;
    sqlx::raw_sql("CREATE TABLE other (x int); INSERT INTO other SELECT generate_series(1, 1000)")
        .execute(&pool)
        .await
        .unwrap();
    // Other tests write WAL meanwhile, and keepalives between transactions
    // may confirm it: what must never be confirmed is the held commit itself.
    let mut confirmed_while_held = Vec::new();
    for _ in 0..3 {
        sqlx::query(
            "SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL",
        )
        .bind(slot)
        .execute(&pool)
        .await
        .unwrap();
        confirmed_while_held.push(slot_confirmed(&pool, slot).await.unwrap());
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    // Release: the event is (re)published once and the slot moves past it.
    signal(nats.pid(), "CONT");
    let got = read_stream(&nats.url, &wire::stream_name("held"), 4, T).await;
    assert_exactly_once_in_order(&got, &sent);
    // Decoding resends a transaction whose commit record starts at or after
    // the slot's confirmed LSN; Outbox-Commit-Lsn is that start.
    let held_commit = lsn(got[1].h(wire::COMMIT_LSN).unwrap());
    assert!(held_commit > lsn(&before) && held_commit < lsn(&after_commit));
    for confirmed in confirmed_while_held {
        assert!(
            confirmed <= held_commit,
            "slot confirmed {confirmed:x} past the unacked commit at {held_commit:x}"
        );
    }
    eventually(T, "slot confirms past the released commit", || {
        let pool = pool.clone();
        let target = lsn(&after_commit);
        async move { slot_confirmed(&pool, slot).await.unwrap() >= target }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_outbox_in_busy_database_retains_little_wal() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_idle").await;
    let _relay = Service::relay(&url, &stack.nats_url, "idle", &[]);
    let slot = &wire::slot_name("idle");
    sent_one_and_wait(&stack, &pool, &wire::stream_name("idle")).await;
    let start: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE filler (id int, pad text)")
        .execute(&pool)
        .await
        .unwrap();
    // 200 MB of WAL or more, in transactions of ~9 MB, none touching the outbox.
    let mut written: i64 = 0;
    for _ in 0..60 {
        sqlx::query(
            "INSERT INTO filler SELECT g, repeat(md5(g::text), 30) FROM generate_series(1, 9000) g",
        )
        .execute(&pool)
        .await
        .unwrap();
        written =
            sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::int8")
                .bind(&start)
                .fetch_one(&pool)
                .await
                .unwrap();
        if written > 200_000_000 {
            break;
        }
    }
    assert!(written > 200_000_000, "wrote only {written} bytes of WAL");
    let retained = || {
        let pool = pool.clone();
        async move {
            let r: Option<i64> = sqlx::query_scalar(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8 FROM pg_replication_slots WHERE slot_name = $1",
            )
            .bind(slot)
            .fetch_one(&pool)
            .await
            .unwrap();
            r.unwrap()
        }
    };
    // restart_lsn follows the confirmed LSN at the next running-xacts record
    // (the background writer logs one every 15 s while WAL moves).
    eventually(
        Duration::from_secs(90),
        "retained WAL under 32 MB",
        || async {
            let _ = sqlx::query("SELECT pg_switch_wal()").execute(&pool).await;
            retained().await < 32 * 1024 * 1024
        },
    )
    .await;
    println!(
        "WAL written {written} bytes; retained by the slot {} bytes",
        retained().await
    );
}

async fn sent_one_and_wait(stack: &Stack, pool: &sqlx::PgPool, stream: &str) {
    insert_txn(pool, 0, 0, 1, 0).await;
    assert_eq!(read_stream(&stack.nats_url, stream, 1, T).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_rows_are_dead_lettered_with_a_reason_and_later_rows_flow() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_poison").await;
    let _relay = Service::relay(&url, &stack.nats_url, "poison", &[]);
    let insert = |subject: Option<&'static str>, payload: String| {
        let pool = pool.clone();
        async move {
            let id = uuid::Uuid::new_v4();
            sqlx::query("INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, subject) VALUES ($1, 'a', '1', 'e', $2::jsonb, $3)")
                .bind(id)
                .bind(payload)
                .bind(subject)
                .execute(&pool)
                .await
                .unwrap();
            id
        }
    };
    let wildcard = insert(Some("poison.orders.*"), "{\"k\": 1}".into()).await;
    let space = insert(Some("poison.orders created"), "{\"k\": 2}".into()).await;
    let huge = insert(None, format!("{{\"big\": \"{}\"}}", "y".repeat(1_500_000))).await;
    let outside = insert(Some("elsewhere.x"), "{\"k\": 3}".into()).await;
    let good = insert(None, "{\"k\": 4}".into()).await;

    let got = read_stream(&stack.nats_url, &wire::stream_name("poison"), 5, T).await;
    assert_eq!(
        got.len(),
        5,
        "every row is in the stream, good or dead-lettered"
    );
    let by_id = |id: uuid::Uuid| {
        got.iter()
            .find(|g| g.h(wire::MSG_ID) == Some(id.to_string().as_str()))
            .unwrap()
    };
    for (id, reason) in [
        (wildcard, "invalid_subject"),
        (space, "invalid_subject"),
        (huge, "too_large"),
        (outside, "subject_outside_stream"),
    ] {
        let g = by_id(id);
        assert_eq!(g.subject, wire::relay_dlq_subject("poison"), "{reason}");
        assert_eq!(g.h(wire::DLQ_REASON), Some(reason));
        assert_eq!(g.h(wire::EVENT_TYPE), Some("e"));
    }
    assert!(by_id(huge).payload.is_empty(), "too-large body is dropped");
    assert_eq!(
        by_id(wildcard).payload,
        br#"{"k": 1}"#,
        "body kept when it fits"
    );
    let g = by_id(good);
    assert_eq!(g.subject, "poison.event.e.v1");
    assert_eq!(g.h(wire::DLQ_REASON), None);
    assert_eq!(
        got.last().unwrap().h(wire::MSG_ID),
        Some(good.to_string().as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_configuration_exits_with_one_clear_line() {
    let stack = stack();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(BIN).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, err) = run(&[
        "relay",
        "--database-url",
        &stack.admin_url,
        "--slot",
        "Bad-Name",
    ]);
    assert_eq!(code, Some(1));
    assert!(err.contains("invalid slot name"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (code, err) = run(&[
        "relay",
        "--database-url",
        "postgres://nobody@127.0.0.1:1/x",
        "--nats-url",
        &stack.nats_url,
    ]);
    assert_eq!(code, Some(1));
    assert_eq!(
        err.trim()
            .lines()
            .filter(|l| l.starts_with("error:"))
            .count(),
        1,
        "{err}"
    );
    // A database without the outbox table: says to run migrate.
    let (url, _pool) = {
        let admin = sqlx::PgPool::connect(&stack.admin_url).await.unwrap();
        sqlx::query("DROP DATABASE IF EXISTS t_nomig WITH (FORCE)")
            .execute(&admin)
            .await
            .unwrap();
        sqlx::query("CREATE DATABASE t_nomig")
            .execute(&admin)
            .await
            .unwrap();
        let url = db_url(&stack.admin_url, "t_nomig");
        (url.clone(), sqlx::PgPool::connect(&url).await.unwrap())
    };
    let (code, err) = run(&[
        "relay",
        "--database-url",
        &url,
        "--nats-url",
        &stack.nats_url,
        "--context",
        "nomig",
    ]);
    assert_eq!(code, Some(1));
    assert!(err.contains("outbox-relay migrate"), "{err}");
    let (code, err) = run(&["slot", "drop", "--database-url", &url, "--context", "nomig"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--yes"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_after_the_duplicate_window_adds_no_duplicates() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_window").await;
    // A 1 s duplicate window: JetStream's own dedupe cannot help after it.
    let mut relay = Service::relay(
        &url,
        &stack.nats_url,
        "window",
        &["--duplicate-window", "1s"],
    );
    let client = async_nats::connect(&stack.nats_url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut sent = HashSet::new();
    let mut replay_forced = false;
    for attempt in 0..5u64 {
        // A burst of transactions; kill -9 the moment the stream has them all,
        // before the relay's next standby status (throttled to 1 s) confirms them.
        let base = sent.len() as u64;
        for t in 0..20 {
            sent.extend(insert_txn(&pool, 0, base + t * 10, 10, 0).await);
        }
        let deadline = Instant::now() + T;
        loop {
            let mut stream = js.get_stream(&wire::stream_name("window")).await.unwrap();
            if stream.info().await.unwrap().state.messages >= sent.len() as u64 {
                break;
            }
            assert!(Instant::now() < deadline, "burst not stored");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        relay.kill9();
        let last = read_stream(
            &stack.nats_url,
            &wire::stream_name("window"),
            sent.len() as u64,
            T,
        )
        .await;
        let last_commit = lsn(last.last().unwrap().h(wire::COMMIT_LSN).unwrap());
        let confirmed = slot_confirmed(&pool, &wire::slot_name("window"))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        relay.restart();
        relay.wait_ready();
        if confirmed <= last_commit {
            // The slot is behind what the stream holds: those events are replayed now.
            replay_forced = true;
            break;
        }
        println!("attempt {attempt}: slot had confirmed everything before the kill; trying again");
    }
    assert!(
        replay_forced,
        "could not force a replay past the duplicate window in 5 attempts"
    );
    sent.extend(insert_txn(&pool, 0, 10_000, 5, 0).await);
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name("window"),
        sent.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &sent);
    let skipped = relay
        .scrape()
        .await
        .value("outbox_relay_events_skipped_total");
    assert!(
        skipped.is_some_and(|s| s > 0.0),
        "the relay found its tail in the stream and skipped what it held: {skipped:?}"
    );
}

/// A DSN password must not reach the logs at any level, nor `--help`, nor an
/// error line, including on the reconnect path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dsn_password_never_appears_in_logs_help_or_errors() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_secret").await;
    const RAW: &str = "Tr0ub4dor&3-horse";
    const ENCODED: &str = "Tr0ub4dor%263-horse";
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'secret_user') THEN \
         CREATE ROLE secret_user LOGIN SUPERUSER REPLICATION PASSWORD '{RAW}'; END IF; END $$"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let secret_url = url.replacen(
        "postgres://postgres@",
        &format!("postgres://secret_user:{ENCODED}@"),
        1,
    );
    assert_ne!(secret_url, url, "the test URL has the expected shape");
    let leaks = |text: &str| text.contains(RAW) || text.contains(ENCODED);

    let mut relay = Service::relay_traced(&secret_url, &stack.nats_url, "secret", &[]);
    let mut sent = HashSet::new();
    sent.extend(insert_txn(&pool, 1, 0, 5, 16).await);
    // The reconnect path logs errors and reconnects with the same settings.
    sqlx::query("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 'outbox_relay_secret' AND active_pid IS NOT NULL")
        .execute(&pool)
        .await
        .unwrap();
    sent.extend(insert_txn(&pool, 1, 5, 5, 16).await);
    let got = read_stream(&stack.nats_url, &wire::stream_name("secret"), 10, T).await;
    assert_exactly_once_in_order(&got, &sent);
    assert!(relay.term(Duration::from_secs(30)).success());
    let log = relay.log_text();
    assert!(
        log.lines().count() > 50 && log.contains("TRACE"),
        "the relay logged at trace level"
    );
    assert!(
        log.contains("reconnecting"),
        "the reconnect path ran:\n{log}"
    );
    assert!(!leaks(&log), "password in the relay's trace log");

    // Connection errors, configuration errors and --help.
    let bad_port = secret_url.replacen(
        &stack
            .admin_url
            .rsplit_once(':')
            .unwrap()
            .1
            .split('/')
            .next()
            .unwrap()
            .to_string(),
        "1",
        1,
    );
    for (args, env_url) in [
        (
            vec![
                "relay",
                "--database-url",
                bad_port.as_str(),
                "--nats-url",
                stack.nats_url.as_str(),
            ],
            None,
        ),
        (
            vec![
                "relay",
                "--database-url",
                &format!("{secret_url}?sslmode=bogus"),
                "--check-config",
            ],
            None,
        ),
        (vec!["migrate", "--database-url", bad_port.as_str()], None),
        (vec!["relay", "--help"], Some(secret_url.as_str())),
        (vec!["consume", "--help"], Some(secret_url.as_str())),
    ] {
        let mut cmd = std::process::Command::new(BIN);
        cmd.args(&args).env("RUST_LOG", "trace");
        if let Some(u) = env_url {
            // Every secret `--help` could show from the environment.
            cmd.env("DATABASE_URL", u)
                .env("NATS_PASSWORD", RAW)
                .env("NATS_TOKEN", RAW)
                .env("NATS_USER", "someone");
        }
        let out = cmd.output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!text.is_empty(), "{args:?} printed nothing");
        assert!(!leaks(&text), "password printed by {args:?}:\n{text}");
    }
}

/// Postgres itself crashes (immediate shutdown, recovery on start) and then
/// restarts cleanly, under load: every committed event reaches the stream
/// exactly once, in commit order, and the relay is streaming afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_and_restart_under_load_lose_nothing_and_keep_order() {
    let own = OwnStack::up("pg-crash", false);
    let (url, nats_url) = (
        own.get("DATABASE_URL").to_owned(),
        own.get("NATS_URL").to_owned(),
    );
    migrate(&url);
    let relay = Service::relay(&url, &nats_url, "pgcrash", &[]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&url)
        .await
        .unwrap();

    // A producer that rides out the outage: a failed commit may or may not
    // have happened, so the database, not the producer, says what was sent.
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (pool, stop) = (pool.clone(), stop.clone());
        tokio::spawn(async move {
            let mut seq = 0u64;
            let mut failures = 0;
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let ids: Vec<uuid::Uuid> = (0..10).map(|_| uuid::Uuid::new_v4()).collect();
                let payloads: Vec<serde_json::Value> = (0..10)
                    .map(|i| serde_json::json!({"p": 0, "s": seq + i}))
                    .collect();
                let r = sqlx::query(
                    "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
                     SELECT id, 'order', 'o', 'placed', p FROM UNNEST($1::uuid[], $2::jsonb[]) AS t(id, p)",
                )
                .bind(&ids)
                .bind(&payloads)
                .execute(&pool)
                .await;
                seq += 10;
                if r.is_err() {
                    failures += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            failures
        })
    };
    tokio::time::sleep(Duration::from_millis(1500)).await;
    own.pg_restart("immediate");
    tokio::time::sleep(Duration::from_millis(2000)).await;
    own.pg_restart("fast");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.store(true, Ordering::Relaxed);
    // The pool may ride out a short restart by reconnecting within its
    // acquire timeout, so the producer's failures are not asserted.
    let _failures = producer.await.unwrap();

    let committed: HashSet<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM outbox_events")
        .fetch_all(&pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert!(
        committed.len() > 1000,
        "{} events committed",
        committed.len()
    );
    let got = read_stream(
        &nats_url,
        &wire::stream_name("pgcrash"),
        committed.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &committed);
    eventually(T, "/readyz ready after the restarts", || async {
        relay.http_get("/readyz").await.0 == 200
    })
    .await;
    let restarts = relay
        .scrape()
        .await
        .value("outbox_relay_session_restarts_total");
    assert!(
        restarts.is_some_and(|r| r >= 2.0),
        "both restarts ended a relay session: {restarts:?}"
    );
}

/// A nats-server whose account has an `admin` user and a `relay` user
/// that may not publish to `deny` (a subject list in NATS config syntax).
fn nats_with_relay_user(stack: &Stack, name: &str, deny: &str) -> (OwnNats, std::path::PathBuf) {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("nats.conf");
    std::fs::write(
        &conf,
        format!(
            "accounts {{ APP {{ jetstream: enabled, users: [ \
             {{ user: admin, password: admin }}, \
             {{ user: relay, password: relay, permissions: {{ publish: {{ deny: {deny} }} }} }} ] }} }}\n"
        ),
    )
    .unwrap();
    let nats = OwnNats::start_with(stack, name, &["-c", conf.to_str().unwrap()]);
    (nats, conf)
}

async fn insert_typed(pool: &sqlx::PgPool, rows: &[&str]) -> Vec<uuid::Uuid> {
    let mut tx = pool.begin().await.unwrap();
    let mut ids = Vec::new();
    for event_type in rows {
        let id = uuid::Uuid::new_v4();
        sqlx::query(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
             VALUES ($1, 'order', 'a1', $2, '{}')",
        )
        .bind(id)
        .bind(*event_type)
        .execute(&mut *tx)
        .await
        .unwrap();
        ids.push(id);
    }
    tx.commit().await.unwrap();
    ids
}

/// Issue 44, item 1: a row whose subject the relay's NATS user may not
/// publish stalled the relay for ever: nats-server answers `-ERR
/// 'Permissions Violation for Publish to "…"'`, keeps the connection and
/// never answers the message; the link only logged it. SPEC §9: such a row
/// is dead-lettered (reason `refused`) and the rows after it flow, event by
/// event and in batches alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_the_relays_user_may_not_publish_is_dead_lettered_and_later_rows_flow() {
    let stack = stack();
    for mode in ["event", "batch"] {
        let ctx = format!("permdeny{mode}");
        let (url, pool) = fresh_db(&stack, &format!("t_{ctx}")).await;
        let deny = format!(r#"["{ctx}.event.secret.>"]"#);
        let (nats, _conf) = nats_with_relay_user(&stack, &ctx, &deny);
        let relay = Service::relay(
            &url,
            &nats.url,
            &ctx,
            &[
                "--nats-user",
                "relay",
                "--nats-password",
                "relay",
                "--publish-mode",
                mode,
            ],
        );
        let mut ids = insert_typed(&pool, &["placed"]).await;
        ids.extend(insert_typed(&pool, &["secret"]).await);
        ids.extend(insert_typed(&pool, &["placed", "secret", "placed"]).await);
        ids.extend(insert_typed(&pool, &["placed"]).await);
        let admin =
            async_nats::ConnectOptions::with_user_and_password("admin".into(), "admin".into())
                .connect(&nats.url)
                .await
                .unwrap();
        let got = read_stream_with(admin, &wire::stream_name(&ctx), 6, T).await;
        let got_ids: Vec<&str> = got.iter().map(|g| g.h(wire::MSG_ID).unwrap()).collect();
        assert_eq!(
            got_ids,
            ids.iter().map(|u| u.to_string()).collect::<Vec<_>>(),
            "{mode}: every row, once, in commit order"
        );
        for i in [1, 3] {
            assert_eq!(
                got[i].subject,
                wire::relay_dlq_subject(&ctx),
                "{mode}: row {i}"
            );
            assert_eq!(
                got[i].h(wire::DLQ_REASON),
                Some("refused"),
                "{mode}: row {i}"
            );
            assert!(
                got[i]
                    .h(wire::DLQ_DETAIL)
                    .is_some_and(|e| e.contains("ermission")),
                "{mode}: the dead letter says why: {:?}",
                got[i].h(wire::DLQ_DETAIL)
            );
        }
        drop(relay);
    }
}

/// Issue 44, item 1: when the relay's user may not publish to the
/// dead-letter subject either, the relay stops with one clear line that
/// names it, instead of looping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_denied_its_dead_letter_subject_stops_with_one_clear_line() {
    let stack = stack();
    let ctx = "permdlq";
    let (url, pool) = fresh_db(&stack, "t_permdlq").await;
    let deny = format!(r#"["{ctx}.event.secret.>", "{ctx}.dlq.>"]"#);
    let (nats, _conf) = nats_with_relay_user(&stack, ctx, &deny);
    insert_typed(&pool, &["secret"]).await;
    let (code, err) = run_relay_bounded(
        &url,
        &nats.url,
        ctx,
        &["--nats-user", "relay", "--nats-password", "relay"],
    );
    assert_eq!(code, Some(1), "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert!(
        errors.len() == 1
            && errors[0].contains(&wire::relay_dlq_subject(ctx))
            && errors[0].contains("ermission"),
        "one line naming the dead-letter subject: {err}"
    );
}

/// Issue 44, item 4: a session routes under its first connection's
/// `max_payload`. When the server came back with a smaller one, the link
/// refused a larger row unsent, and the publisher chained the next row to
/// that id the stream never got. The row is dead-lettered (`too_large`)
/// before it is sent, and the rows after it flow, each once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_over_a_restarted_servers_smaller_max_payload_is_dead_lettered() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_shrunk").await;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("shrunk");
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("nats.conf");
    std::fs::write(&conf, "max_payload: 1048576\n").unwrap();
    let mut nats = OwnNats::start_with(&stack, "shrunk", &["-c", conf.to_str().unwrap()]);
    let relay = Service::relay(&url, &nats.url, "shrunk", &["--publish-mode", "event"]);
    let stream = wire::stream_name("shrunk");
    let row = |pad: i32| {
        let pool = pool.clone();
        async move {
            let id = uuid::Uuid::new_v4();
            sqlx::query(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, 'order', 'a1', 'placed', jsonb_build_object('pad', repeat('x', $2)))",
            )
            .bind(id)
            .bind(pad)
            .execute(&pool)
            .await
            .unwrap();
            id
        }
    };
    let first = row(20_000).await;
    read_stream(&nats.url, &stream, 1, T).await;
    nats.down();
    std::fs::write(&conf, "max_payload: 8192\n").unwrap();
    nats.up();
    let ids = [row(1).await, row(20_000).await, row(1).await];
    let got = read_stream(&nats.url, &stream, 4, T).await;
    let id_of = |g: &Got| g.h(wire::MSG_ID).unwrap().to_owned();
    assert_eq!(
        got.iter().map(id_of).collect::<Vec<_>>(),
        [first, ids[0], ids[1], ids[2]].map(|i| i.to_string()),
        "{}",
        relay.log_text()
    );
    assert_eq!(got[2].subject, wire::relay_dlq_subject("shrunk"));
    assert_eq!(got[2].h(wire::DLQ_REASON), Some("too_large"));
    assert_ne!(got[3].subject, got[2].subject);
}

/// Issue 44, item 2: the account's `max_payload` (4 KiB here, under the
/// server's 1 MiB) comes in the INFO the server sends after CONNECT, which
/// the publish link ignored: a row between the two limits made the server
/// close the connection on every try and was never dead-lettered. It is
/// dead-lettered as `too_large`, and later rows flow, on both paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_over_the_accounts_max_payload_is_dead_lettered() {
    let stack = stack();
    for mode in ["event", "batch"] {
        let ctx = format!("acctpay{mode}");
        let (url, pool) = fresh_db(&stack, &format!("t_{ctx}")).await;
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(&ctx);
        std::fs::create_dir_all(&dir).unwrap();
        let conf = dir.join("nats.conf");
        std::fs::write(
            &conf,
            "accounts { APP { jetstream: enabled, limits: { max_payload: 4096 }, \
             users: [ { user: relay, password: relay } ] } }\n",
        )
        .unwrap();
        let nats = OwnNats::start_with(&stack, &ctx, &["-c", conf.to_str().unwrap()]);
        let relay = Service::relay(
            &url,
            &nats.url,
            &ctx,
            &[
                "--nats-user",
                "relay",
                "--nats-password",
                "relay",
                "--publish-mode",
                mode,
            ],
        );
        let mut ids = Vec::new();
        for pad in [1, 6_000, 1] {
            let id = uuid::Uuid::new_v4();
            sqlx::query(
                "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, 'order', 'a1', 'placed', jsonb_build_object('pad', repeat('x', $2)))",
            )
            .bind(id)
            .bind(pad)
            .execute(&pool)
            .await
            .unwrap();
            ids.push(id);
        }
        let client =
            async_nats::ConnectOptions::with_user_and_password("relay".into(), "relay".into())
                .connect(&nats.url)
                .await
                .unwrap();
        let got = read_stream_with(client, &wire::stream_name(&ctx), 3, T).await;
        let got_ids: Vec<&str> = got.iter().map(|g| g.h(wire::MSG_ID).unwrap()).collect();
        assert_eq!(
            got_ids,
            ids.iter().map(|u| u.to_string()).collect::<Vec<_>>(),
            "{mode}: every row, once, in order"
        );
        assert_eq!(got[1].subject, wire::relay_dlq_subject(&ctx), "{mode}");
        assert_eq!(got[1].h(wire::DLQ_REASON), Some("too_large"), "{mode}");
        drop(relay);
    }
}

/// Issue 44, item 9: the replication connection read `DATABASE_URL` its own
/// way: it ignored `?host=` and `?port=` (a Unix socket) and the `PG*`
/// variables, and defaulted to 127.0.0.1:5432, so the pools and the
/// replication connection went to different places. Both read it as libpq
/// and sqlx do now: a socket in the URL's query, then nothing in the URL
/// but `PG*` variables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_replication_connection_reads_database_url_as_the_pools_do() {
    let stack = stack();
    let dir = std::env::var("STACK_DIR").expect("STACK_DIR (scripts/test.sh sets it)");
    let port = std::env::var("PG_PORT").expect("PG_PORT (scripts/test.sh sets it)");
    let sock = format!("{dir}/pgsock");
    let walsender_on_socket = |pool: sqlx::PgPool, slot: String| async move {
        let rows: Vec<bool> = sqlx::query_scalar(
            "SELECT client_addr IS NULL FROM pg_stat_replication WHERE application_name = $1",
        )
        .bind(format!("outbox-relay:{slot}"))
        .fetch_all(&pool)
        .await
        .unwrap();
        rows
    };

    let (_, pool) = fresh_db(&stack, "t_dsnsock").await;
    let url = format!("postgres:///t_dsnsock?host={sock}&port={port}&user=postgres");
    let relay = Service::relay(&url, &stack.nats_url, "dsnsock", &[]);
    let ids = insert_typed(&pool, &["placed"]).await;
    let got = read_stream(&stack.nats_url, &wire::stream_name("dsnsock"), 1, T).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].h(wire::MSG_ID), Some(ids[0].to_string().as_str()));
    assert_eq!(
        walsender_on_socket(pool.clone(), wire::slot_name("dsnsock")).await,
        [true],
        "the replication connection is on the socket"
    );
    drop(relay);

    let (_, pool) = fresh_db(&stack, "t_dsnenv").await;
    let relay = Service::relay_env(
        "postgres://",
        &stack.nats_url,
        "dsnenv",
        &[],
        &[
            ("PGHOST", "127.0.0.1"),
            ("PGPORT", &port),
            ("PGUSER", "postgres"),
            ("PGDATABASE", "t_dsnenv"),
            ("PGSSLMODE", "disable"),
        ],
    );
    let ids = insert_typed(&pool, &["placed"]).await;
    let got = read_stream(&stack.nats_url, &wire::stream_name("dsnenv"), 1, T).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].h(wire::MSG_ID), Some(ids[0].to_string().as_str()));
    assert_eq!(
        walsender_on_socket(pool.clone(), wire::slot_name("dsnenv")).await,
        [false],
        "the replication connection is on TCP, as PGHOST says"
    );
    drop(relay);
}

/// Issue 44, item 4: `--publish-timeout` could not raise the 2 s stall
/// after which the publisher takes the stream's leader for gone: a healthy
/// but slow path (acks after 3 s here, with `--publish-timeout 30s`) had the
/// link dropped and everything sent again, over and over. The stall scales
/// with the timeout now (a fifth of it, 2 s at least).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_healthy_stream_is_waited_for_as_publish_timeout_says() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_slowacks").await;
    let proxy = Proxy::start(stack.nats_url.trim_start_matches("nats://")).await;
    let relay = Service::relay(
        &url,
        &proxy.nats_url(),
        "slowacks",
        &["--publish-timeout", "30s", "--publish-mode", "event"],
    );
    proxy.delay(Duration::from_millis(3_000));
    let mut sent = HashSet::new();
    for i in 0..5 {
        sent.extend(insert_txn(&pool, 0, i * 10, 4, 8).await);
    }
    let got = read_stream(&stack.nats_url, &wire::stream_name("slowacks"), 20, T).await;
    assert_exactly_once_in_order(&got, &sent);
    let m = relay.scrape().await;
    assert_eq!(
        m.value("outbox_relay_publish_resends_total"),
        Some(0.0),
        "nothing was sent again for a slow ack"
    );
}

/// Issue 44, item 8: an active relay frozen (SIGSTOP) while events were in
/// flight, thawed after a standby had taken the slot over and published
/// them, sent its stale copies again, alone and past the duplicate window:
/// stored twice. A relay that was paused long enough to lose its slot
/// stops publishing before it sends anything more, and starts over from
/// the slot (as a standby, here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_thawed_after_a_takeover_sends_nothing_stale() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_relayfreeze").await;
    let admin = sqlx::PgPool::connect(&stack.admin_url).await.unwrap();
    // A frozen relay's walsender is ended after 3 s: the standby takes over.
    sqlx::query("ALTER DATABASE t_relayfreeze SET wal_sender_timeout = '3s'")
        .execute(&admin)
        .await
        .unwrap();
    let proxy = Proxy::start(stack.nats_url.trim_start_matches("nats://")).await;
    let extra = ["--duplicate-window", "1s", "--publish-mode", "event"];
    let mut a = Service::relay(&url, &proxy.nats_url(), "relayfreeze", &extra);
    let b = Service::relay_starting_named(
        &url,
        &stack.nats_url,
        "relayfreeze",
        "relayfreeze-b",
        &extra,
    );
    let stream = wire::stream_name("relayfreeze");
    let mut sent = HashSet::new();
    sent.extend(insert_txn(&pool, 0, 0, 10, 8).await);
    let got = read_stream(&stack.nats_url, &stream, 10, T).await;
    assert_eq!(got.len(), 10);
    // A sends the next ten into a path that answers nothing, and freezes.
    proxy.freeze();
    sent.extend(insert_txn(&pool, 0, 10, 10, 8).await);
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    signal(a.pid(), "STOP");
    proxy.heal();
    // B takes the slot over and publishes them; the duplicate window passes.
    let got = read_stream(&stack.nats_url, &stream, 20, T).await;
    assert_exactly_once_in_order(&got, &sent);
    tokio::time::sleep(Duration::from_secs(2)).await;
    signal(a.pid(), "CONT");
    // A has thawed: give it time to send whatever it would.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let got = read_stream(&stack.nats_url, &stream, 20, Duration::from_secs(5)).await;
    assert_exactly_once_in_order(&got, &sent);
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "the thawed relay goes on, as a standby"
    );
    drop(b);
}

/// Issue 44, item 6: a batch whose commit went unanswered was judged stored
/// by WAL position alone. After a disk-snapshot restore the stream holds
/// messages of this source at positions the WAL reaches again, so a batch
/// the stream never stored (its R1 stream's node was down) was taken as
/// stored and its rows were lost. It is now judged by its ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_batch_is_judged_stored_by_its_ids_not_its_position() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_batchids").await;
    let cluster = OwnCluster::up("nats-cluster-batchids");
    let js = async_nats::jetstream::new(cluster.client().await);
    let stream = wire::stream_name("batchids");
    let nodes: Vec<String> = cluster.url.split(',').map(str::to_owned).collect();
    let extra = ["--publish-mode", "batch"];
    let mut relay = Service::relay(&url, &nodes[0], "batchids", &extra);
    let first = insert_txn(&pool, 0, 0, 1, 0).await;
    let got = read_stream_by_seq(&js, &stream, 1, T).await;
    // The relay must publish through a node that does not hold the stream.
    let home = cluster.wait_leader(&js, &stream, T).await;
    relay.term(Duration::from_secs(30));
    // What a restored snapshot leaves: this source's message at a position
    // past the WAL's.
    let source = got[0].h(wire::SOURCE).unwrap().to_owned();
    let fake = uuid::Uuid::new_v4().to_string();
    publish_with(
        &js,
        "batchids.order.restored",
        &[
            (wire::MSG_ID, &fake),
            (wire::SOURCE, &source),
            (wire::COMMIT_LSN, "FF/0"),
            (wire::TXN_INDEX, "0"),
        ],
        b"{}",
    )
    .await;
    let via = if home == 1 { &nodes[1] } else { &nodes[0] };
    let relay = Service::relay(&url, via, "batchids", &extra);
    cluster.node(home, "kill");
    let mut sent: HashSet<uuid::Uuid> = first.into_iter().collect();
    let batch = insert_txn(&pool, 0, 1, 10, 0).await;
    sent.extend(batch.iter().copied());
    eventually(T, "the relay looks its batch up", || async {
        relay.log_text().contains("looking it up in the stream")
    })
    .await;
    cluster.node(home, "start");
    let got = read_stream_by_seq(&js, &stream, 12, T).await;
    let ids: HashSet<uuid::Uuid> = got
        .iter()
        .filter_map(|g| g.h(wire::MSG_ID)?.parse().ok())
        .collect();
    let missing: Vec<_> = batch.iter().filter(|id| !ids.contains(id)).collect();
    assert!(missing.is_empty(), "lost {missing:?}\n{}", relay.log_text());
    let ours: Vec<Got> = got
        .into_iter()
        .filter(|g| g.h(wire::MSG_ID) != Some(fake.as_str()))
        .collect();
    assert_exactly_once_in_order(&ours, &sent);
}
