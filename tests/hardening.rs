//! Issue 30: defects found by reading the code, each reproduced here on the
//! real stack before it was fixed. One test per defect; the doc comment of
//! each says what it did before the fix.

use std::collections::HashSet;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use outbox_relay::wire;

const T: Duration = Duration::from_secs(90);

/// Defect 4: prune read `confirmed_flush_lsn` by slot name alone, and LSNs
/// are cluster-wide. Pointed at database B with A's context, it took A's
/// slot (which an idle relay keeps advancing) as proof that B's rows were
/// published, and deleted B's unpublished rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_never_trusts_a_slot_of_another_database() {
    let stack = stack();
    let (url_a, _pool_a) = fresh_db(&stack, "h_prune_a").await;
    let (url_b, pool_b) = fresh_db(&stack, "h_prune_b").await;
    // A's relay keeps its slot (outbox_relay_hprunea) confirming.
    let _relay_a = Service::relay(&url_a, &stack.nats_url, "hprunea", &[]);
    // B has no relay at all: none of its rows was ever published.
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
         SELECT gen_random_uuid(), 'order', 'a' || g, 'placed', '{}'::jsonb, now() - interval '10 days' \
         FROM generate_series(1, 20) g",
    )
    .execute(&pool_b)
    .await
    .unwrap();
    // An inbox row done with long ago: the inbox needs no slot, and is
    // pruned all the same.
    sqlx::query(
        "INSERT INTO inbox_messages (consumer, message_id, subject, received_at, processed_at) \
         VALUES ('c', gen_random_uuid(), 's', now() - interval '40 days', now() - interval '40 days')",
    )
    .execute(&pool_b)
    .await
    .unwrap();
    let out = Command::new(BIN)
        .args(["prune", "--database-url", &url_b, "--context", "hprunea"])
        .args([
            "--older-than",
            "7d",
            "--inbox-older-than",
            "30d",
            "--wait",
            "3s",
        ])
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events")
        .fetch_one(&pool_b)
        .await
        .unwrap();
    assert_eq!(left, 20, "B's unpublished rows must stay: {text}");
    // A failure, not a quiet "kept" a nightly job never alerts on.
    assert_eq!(out.status.code(), Some(1), "{text}");
    let inbox: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_messages")
        .fetch_one(&pool_b)
        .await
        .unwrap();
    assert_eq!(inbox, 0, "{text}");
    assert!(text.contains("another database"), "says why: {text}");
}

/// Defect 5: after a VM or storage snapshot restore (same system id, same
/// timeline), new transactions get LSNs the stream's tail already passed,
/// and the relay skipped them as already stored, by position alone. It now
/// skips an event only when the stream holds that very row at that position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_disk_snapshot_does_not_make_the_relay_skip_new_events() {
    let own = OwnStack::up("h-restore", false);
    let (url, nats) = (
        own.get("DATABASE_URL").to_owned(),
        own.get("NATS_URL").to_owned(),
    );
    migrate(&url);
    let connect = || async {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap()
    };
    let stream = wire::stream_name("hrestore");
    let mut relay = Service::relay(&url, &nats, "hrestore", &[]);
    let pool = connect().await;
    let mut before = HashSet::new();
    for i in 0..5 {
        before.extend(insert_txn(&pool, 0, i * 10, 10, 0).await);
    }
    read_stream(&nats, &stream, 50, T).await;
    // A graceful stop confirms everything: the snapshot's slot is caught up.
    relay.term(Duration::from_secs(30));
    pool.close().await;
    own.pg_snapshot("save");

    // History the restore will undo; it reaches the stream first.
    relay.restart();
    relay.wait_ready();
    let pool = connect().await;
    for i in 0..40 {
        insert_txn(&pool, 1, i * 10, 10, 200).await;
    }
    let got = read_stream(&nats, &stream, 450, T).await;
    let tail_lsn = lsn(got.last().unwrap().h(wire::COMMIT_LSN).unwrap());
    relay.term(Duration::from_secs(30));
    pool.close().await;
    own.pg_snapshot("restore");

    // After the restore: new rows at positions the stream's tail passed.
    let pool = connect().await;
    let mut after = HashSet::new();
    for i in 0..5 {
        after.extend(insert_txn(&pool, 2, i * 10, 10, 0).await);
    }
    let now: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(
        lsn(&now) < tail_lsn,
        "the test needs new commits below the stream's tail ({now})"
    );
    relay.restart();
    relay.wait_ready();
    let got = read_stream(&nats, &stream, 500, T).await;
    let ids: HashSet<uuid::Uuid> = got
        .iter()
        .filter_map(|g| g.h(wire::MSG_ID)?.parse().ok())
        .collect();
    let missing: Vec<_> = after.difference(&ids).collect();
    assert!(
        missing.is_empty(),
        "{} of the {} rows committed after the restore never reached the stream\n{}",
        missing.len(),
        after.len(),
        relay.log_text()
    );
    assert!(before.is_subset(&ids));
}

/// Defect 1: the lost-slot refusal suggested `--resync-since` the last
/// stored event's `occurred_at`, and `occurred_at` is its transaction's
/// start. A row of a transaction that was open when that event committed,
/// and committed after it, has an earlier `occurred_at`: following the
/// product's own advice lost it. The resync now also republishes every row
/// of a transaction the stream cannot have seen committed (`Outbox-Xid-Horizon`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suggested_resync_republishes_a_row_whose_transaction_was_open_at_the_last_event() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "h_resync").await;
    let stream = wire::stream_name("hresync");
    let mut relay = Service::relay(&url, &stack.nats_url, "hresync", &["--backfill", "none"]);
    // A's transaction starts first and stays open.
    let (open, a) = open_row(&pool).await;
    // B starts later, commits, and is the last event the stream stores.
    let b = insert_txn(&pool, 0, 0, 1, 0).await;
    let got = read_stream(&stack.nats_url, &stream, 1, T).await;
    assert_eq!(got.len(), 1);
    assert!(relay.term(Duration::from_secs(30)).success());
    // A commits while no relay reads, then the slot is lost.
    open.commit().await.unwrap();
    follow_the_suggested_resync(&stack, &url, "hresync", a, b[0]).await;
}

/// A transaction that inserted one row and stays open, and the row's id.
async fn open_row(pool: &sqlx::PgPool) -> (sqlx::Transaction<'static, sqlx::Postgres>, uuid::Uuid) {
    let a = uuid::Uuid::new_v4();
    let mut open = pool.begin().await.unwrap();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1, 'order', 'a', 'placed', '{}')",
    )
    .bind(a)
    .execute(&mut *open)
    .await
    .unwrap();
    (open, a)
}

/// Drop the slot of `ctx`, start a relay, take the `--resync-since` its
/// refusal suggests and restart with it: `b` (the last event stored before)
/// and `a` (a row of a transaction open at `b` that committed later) must
/// both be in the stream afterwards.
async fn follow_the_suggested_resync(
    stack: &Stack,
    url: &str,
    ctx: &str,
    a: uuid::Uuid,
    b: uuid::Uuid,
) {
    drop_slot(url, ctx);
    let err = lost_slot_refusal(url, &stack.nats_url, ctx);
    assert!(!err.contains("older relay"), "{err}");
    let since = err
        .split("--resync-since ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("the refusal suggests a resync: {err}"))
        .to_owned();
    let _relay = Service::relay(url, &stack.nats_url, ctx, &["--resync-since", &since]);
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name(ctx),
        2,
        Duration::from_secs(30),
    )
    .await;
    let ids: HashSet<uuid::Uuid> = got
        .iter()
        .filter_map(|g| g.h(wire::MSG_ID)?.parse().ok())
        .collect();
    assert!(ids.contains(&b));
    assert!(
        ids.contains(&a),
        "the row committed after the last stored event is back after the suggested --resync-since {since}: {err}"
    );
}

/// Issue 44, item 5: events a relay published while it caught up on WAL
/// written before it started carried no `Outbox-Xid-Horizon` (its horizon
/// samples begin when it starts). When such an event was the last one
/// stored and the slot was then lost, the refusal blamed "an older relay"
/// and its `--resync-since` missed the row of a transaction open at that
/// event and committed later. They now carry the slot's own horizon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_suggested_resync_covers_an_open_transaction_after_a_catch_up() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "h_resync_cu").await;
    let stream = wire::stream_name("hresynccu");
    let mut relay = Service::relay(&url, &stack.nats_url, "hresynccu", &["--backfill", "none"]);
    assert!(relay.term(Duration::from_secs(30)).success());
    // While no relay reads: A's transaction starts and stays open, B's
    // commits.
    let (open, a) = open_row(&pool).await;
    let b = insert_txn(&pool, 0, 0, 1, 0).await;
    // The relay catches B up: the last event the stream stores.
    relay.restart();
    relay.wait_ready();
    let got = read_stream(&stack.nats_url, &stream, 1, T).await;
    assert_eq!(got.len(), 1);
    assert!(relay.term(Duration::from_secs(30)).success());
    open.commit().await.unwrap();
    follow_the_suggested_resync(&stack, &url, "hresynccu", a, b[0]).await;
}

/// Defect 10: a standby relay polling for the slot while Postgres was down
/// longer than its pool's acquire timeout exited ("pool timed out"), while
/// the active relay rode it out: a deployment lost its standby to an outage
/// it was there for. A standby now retries transient errors as the active
/// one does, and still takes over afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_relay_rides_out_postgres_down_longer_than_its_pool_timeout() {
    let own = OwnStack::up("h-standby", false);
    let (url, nats) = (
        own.get("DATABASE_URL").to_owned(),
        own.get("NATS_URL").to_owned(),
    );
    migrate(&url);
    let mut active = Service::relay(&url, &nats, "hstandby", &[]);
    let mut standby = Service::relay_starting(&url, &nats, "hstandby", &[]);
    // Its gauge, not /readyz's text: every message of it names the
    // context, `hstandby`, and a check for "standby" passed before the
    // second relay had met the first (the outage then ended it at start).
    eventually(T, "the second relay reports standby", || async {
        standby.scrape().await.value("outbox_relay_standby") == Some(1.0)
    })
    .await;
    own.pg_power("pg-stop");
    // The outage lasts until the standby has met its pool's timeout.
    eventually(T, "the standby's pool timed out (or it exited)", || {
        let done =
            standby.child.try_wait().unwrap().is_some() || standby.log_text().contains("timed out");
        async move { done }
    })
    .await;
    own.pg_power("pg-start");
    assert!(
        standby.child.try_wait().unwrap().is_none(),
        "the standby exited on a transient error:\n{}",
        standby.log_text()
    );
    active.kill9();
    standby.wait_ready();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let sent = insert_txn(&pool, 0, 0, 10, 0).await;
    let got = read_stream(&nats, &wire::stream_name("hstandby"), 10, T).await;
    let ids: HashSet<uuid::Uuid> = got
        .iter()
        .filter_map(|g| g.h(wire::MSG_ID)?.parse().ok())
        .collect();
    assert!(sent.iter().all(|id| ids.contains(id)));
}

/// Issue 30, "Also": a kill -9 in the middle of a transaction larger than
/// one atomic batch. The restarted relay finds the transaction's first
/// batches in the stream and goes on from there: every row once, in order,
/// and the `Outbox-Txn-Batch` numbering continues (1..K, each batch whole
/// and contiguous, `Outbox-Txn-Batches: K` on the last), so a consumer that
/// reassembles the transaction gets it whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_in_the_middle_of_a_split_transaction_resumes_its_batch_numbering() {
    const ROWS: u64 = 20_000;
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "h_split").await;
    let stream = wire::stream_name("hsplit");
    // Batches of 32 rows: the transaction is some 600 of them.
    let mut relay = Service::relay(
        &url,
        &stack.nats_url,
        "hsplit",
        &["--max-inflight", "64", "--publish-mode", "batch"],
    );
    // One transaction; `s` numbers the rows in insert order.
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'order', 'a' || (g % 50), 'placed', \
                jsonb_build_object('s', g, 'pad', repeat('x', 512)) \
         FROM generate_series(1, $1) g",
    )
    .bind(ROWS as i64)
    .execute(&pool)
    .await
    .unwrap();
    let sent: HashSet<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM outbox_events")
        .fetch_all(&pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(sent.len() as u64, ROWS);
    let mut held = 0;
    let deadline = std::time::Instant::now() + T;
    while held < ROWS / 10 {
        assert!(
            std::time::Instant::now() < deadline,
            "the transaction never started to arrive"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
        held = stream_messages(&stack.nats_url, &stream).await;
    }
    relay.kill9();
    let held = stream_messages(&stack.nats_url, &stream).await;
    assert!(held < ROWS, "killed in the middle: {held} of {ROWS} stored");
    relay.restart();
    let got = read_stream(&stack.nats_url, &stream, ROWS, T).await;
    assert_exactly_once_in_order(&got, &sent);
    let numbers: Vec<u32> = got
        .iter()
        .map(|g| {
            g.h(wire::TXN_BATCH)
                .expect("split into batches")
                .parse()
                .unwrap()
        })
        .collect();
    let mut expected = 1;
    for pair in numbers.windows(2) {
        assert!(
            pair[1] == pair[0] || pair[1] == pair[0] + 1,
            "batch numbers go {} then {} (killed at {held})",
            pair[0],
            pair[1]
        );
        expected = pair[1];
    }
    assert_eq!(numbers[0], 1);
    let last = numbers.len() - 1;
    let count = got[last]
        .h(wire::TXN_BATCHES)
        .map(|k| k.parse::<u32>().unwrap());
    assert_eq!(count, Some(expected), "the last batch states the count");
    assert!(
        got.iter()
            .filter(|g| g.h(wire::TXN_BATCHES).is_some())
            .count()
            == numbers.iter().filter(|&&n| n == expected).count(),
        "only the last batch carries the count"
    );
}

/// Defect 6: a restart after a backfill was interrupted took a new snapshot
/// and published every row again, relying on `Nats-Msg-Id` alone: past the
/// stream's duplicate window each row already sent became a duplicate. It
/// now resumes from what the stream holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_killed_and_resumed_after_the_duplicate_window_publishes_each_row_once() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "h_bfresume").await;
    let mut sent = HashSet::new();
    for i in 0..6 {
        sent.extend(insert_txn(&pool, 0, i * 10_000, 10_000, 0).await);
    }
    let stream = wire::stream_name("hbfresume");
    // A small pipeline window, so the interrupted backfill leaves a ragged
    // end, and a duplicate window the test can outwait.
    let flags = ["--duplicate-window", "1s", "--max-inflight", "64"];
    let mut relay = Service::relay_starting(&url, &stack.nats_url, "hbfresume", &flags);
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    eventually(T, "the backfill is under way", || async {
        match js.get_stream(&stream).await {
            Ok(mut s) => s.info().await.is_ok_and(|i| i.state.messages >= 3_000),
            Err(_) => false,
        }
    })
    .await;
    relay.kill9();
    let stored = stream_messages(&stack.nats_url, &stream).await;
    assert!(
        stored < sent.len() as u64,
        "the backfill ended before the kill ({stored} stored)"
    );
    // Past the duplicate window: only the relay can keep the rows sent
    // from being sent again.
    tokio::time::sleep(Duration::from_secs(2)).await;
    relay.restart();
    relay.wait_ready();
    let got = read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    let mut seen = HashSet::new();
    let dups = got
        .iter()
        .filter(|g| !seen.insert(g.h(wire::MSG_ID).unwrap().parse::<uuid::Uuid>().unwrap()))
        .count();
    let missing = sent.difference(&seen).count();
    assert_eq!(
        (dups, missing),
        (0, 0),
        "{dups} rows published twice, {missing} missing ({stored} stored before the kill)\n{}",
        relay.log_text()
    );
}

/// Issue 44, item 7: a backfill resumed from what the stream holds read
/// back the last run's newest messages and trusted "every row before these
/// was stored" only when that run had stored two publish windows. When the
/// last run stored fewer (it was itself interrupted at once), everything
/// the runs before it stored was published again, past the duplicate
/// window. Each run now carries the bound it resumed from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_interrupted_twice_in_a_row_publishes_each_row_once() {
    backfill_interrupted("bfagain", None, 3).await;
}

/// Issue 44, item 7: one undecodable row (dead-lettered without its time)
/// among the messages read back made the resume trust nothing but the ids
/// it read: every row stored before them was published again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_with_undecodable_rows_resumes_without_repeats() {
    backfill_interrupted("bfbadrow", Some("aggregate_id"), 2).await;
}

/// From the review of issue 45: the bound a resumed backfill skips by was
/// `NOT ((occurred_at, id) < (…) AND …)`, which is null, so false, for a
/// row whose occurred_at is null: those rows (ordered last, so never
/// published by the interrupted run) were skipped and lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_backfill_publishes_rows_without_a_time() {
    backfill_interrupted("bfnulltime", Some("occurred_at"), 2).await;
}

/// 40,000 rows backfilled in `runs` runs, each but the last killed -9: the
/// first after 5,000 rows, the others as soon as they stored anything. With
/// `null`, every 100th row has that column null (`aggregate_id`: it cannot
/// be decoded; `occurred_at`: it has no time).
async fn backfill_interrupted(ctx: &str, null: Option<&str>, runs: usize) {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, &format!("h_{ctx}")).await;
    let mut sent = HashSet::new();
    for i in 0..4 {
        sent.extend(insert_txn(&pool, 0, i * 10_000, 10_000, 0).await);
    }
    if let Some(column) = null {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "ALTER TABLE outbox_events ALTER COLUMN {column} DROP NOT NULL"
        )))
        .execute(&pool)
        .await
        .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE outbox_events SET {column} = NULL WHERE id IN \
             (SELECT id FROM (SELECT id, row_number() OVER (ORDER BY occurred_at, id) AS n \
              FROM outbox_events) r WHERE n % 100 = 50)"
        )))
        .execute(&pool)
        .await
        .unwrap();
    }
    let stream = wire::stream_name(ctx);
    let window = 256u64;
    let flags = ["--duplicate-window", "1s", "--max-inflight", "256"];
    let mut relay = Service::relay_starting(&url, &stack.nats_url, ctx, &flags);
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let count = || async {
        match js.get_stream(&stream).await {
            Ok(mut s) => s.info().await.map_or(0, |i| i.state.messages),
            Err(_) => 0,
        }
    };
    eventually(T, "the backfill is under way", || async {
        count().await >= 5_000
    })
    .await;
    relay.kill9();
    let mut stored = count().await;
    for run in 2..runs + 1 {
        // Past the duplicate window: only the relay can keep the rows sent
        // from being sent again.
        tokio::time::sleep(Duration::from_secs(2)).await;
        relay.restart();
        if run == runs {
            break;
        }
        let deadline = Instant::now() + T;
        let now = loop {
            let now = count().await;
            if now > stored {
                break now;
            }
            assert!(Instant::now() < deadline, "run {run} stored nothing");
        };
        relay.kill9();
        let after = count().await;
        assert!(
            after - stored < 2 * window,
            "run {run} must store less than two windows to show the defect ({now}, then {after}, after {stored})"
        );
        stored = after;
    }
    relay.wait_ready();
    assert!(stored < sent.len() as u64, "the backfill ended early");
    let got = read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    let mut seen = HashSet::new();
    let dups = got
        .iter()
        .filter(|g| !seen.insert(g.h(wire::MSG_ID).unwrap().parse::<uuid::Uuid>().unwrap()))
        .count();
    let missing = sent.difference(&seen).count();
    assert_eq!(
        (dups, missing),
        (0, 0),
        "{dups} rows published twice, {missing} missing ({stored} stored before the last run)\n{}",
        relay.log_text()
    );
}

/// Defect 7: two relays on a first start raced the temporary slot. Relay B
/// found no slot, and by the time it created its own temporary slot relay A
/// had finished its first start and dropped its own: B backfilled the table
/// again (republishing what A streams) or, had A streamed already, took the
/// stream's tail for a lost slot. Here a tail of 100k foreign messages
/// makes each first start's scan of the stream take its full budget, which
/// holds B between its look at the slot and its temporary slot while A
/// finishes; rows committed meanwhile reach the stream through A's slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_on_a_first_start_never_backfill_twice() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "h_firstrace").await;
    let stream = wire::stream_name("hfirstrace");
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![wire::stream_subjects("hfirstrace")],
        duplicate_window: Duration::from_secs(1),
        allow_atomic_publish: true,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut acks = Vec::new();
    for i in 0..100_000u32 {
        acks.push(
            js.publish("hfirstrace.someone.else", i.to_string().into())
                .await
                .unwrap(),
        );
        if acks.len() == 5_000 {
            for a in acks.drain(..) {
                a.await.unwrap();
            }
        }
    }
    for a in acks.drain(..) {
        a.await.unwrap();
    }
    let flags = ["--duplicate-window", "1s"];
    let a = Service::relay_starting(&url, &stack.nats_url, "hfirstrace", &flags);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut b =
        Service::relay_starting_named(&url, &stack.nats_url, "hfirstrace", "hfirstrace_b", &flags);
    let _ = &a;
    eventually(T, "relay A created the slot", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = 'outbox_relay_hfirstrace')",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    })
    .await;
    let mut sent = HashSet::new();
    for i in 0..5 {
        sent.extend(insert_txn(&pool, 0, i * 100, 100, 0).await);
    }
    eventually(T, "relay B settled as the standby", || async {
        b.log_text().contains("standby: waiting for the slot")
    })
    .await;
    let got = read_stream(&stack.nats_url, &stream, 100_000 + sent.len() as u64, T).await;
    let mut seen = HashSet::new();
    let dups = got
        .iter()
        .filter_map(|g| g.h(wire::MSG_ID)?.parse::<uuid::Uuid>().ok())
        .filter(|id| !seen.insert(*id))
        .count();
    assert_eq!(dups, 0, "rows published twice\n{}", b.log_text());
    assert!(sent.is_subset(&seen));
    // Committed after the slot was made: they come through it, never from
    // a second backfill.
    let backfilled = got
        .iter()
        .filter(|g| g.h(wire::BACKFILL).is_some())
        .filter(|g| {
            g.h(wire::MSG_ID)
                .and_then(|id| id.parse().ok())
                .is_some_and(|id| sent.contains(&id))
        })
        .count();
    assert_eq!(
        backfilled,
        0,
        "rows committed after the slot was made were backfilled again\n{}",
        b.log_text()
    );
    b.kill9();
}

/// Found in the bench's R3 runs: a relay whose NATS went away first and
/// that was then sent SIGTERM kept running long past its shutdown timeout.
/// SIGTERM must end it within `--shutdown-timeout` whatever NATS does (what
/// was not acked is published again by the next relay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_a_relay_whose_nats_is_gone_within_its_shutdown_timeout() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_termnats").await;
    let mut nats = OwnNats::start(&stack, "termnats");
    let mut relay = Service::relay(&url, &nats.url, "termnats", &["--shutdown-timeout", "2s"]);
    insert_txn(&pool, 0, 0, 5, 8).await;
    read_stream(&nats.url, &wire::stream_name("termnats"), 5, T).await;
    nats.down();
    // Something in flight towards the dead server, then the signal.
    insert_txn(&pool, 0, 5, 5, 8).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = relay.term(Duration::from_secs(20));
    assert!(st.success(), "a graceful exit: {st:?}");
    assert!(relay.log_text().contains("relay stopped"));

    // The consumer, the same way: its NATS gone, SIGTERM ends it. No
    // handler call is needed for that; the URL only has to parse.
    nats.up();
    let mut consumer = Service::consumer(
        &url,
        &nats.url,
        &wire::stream_name("termnats"),
        "termnats",
        "http://127.0.0.1:9/unused",
        &["--context", "termnats", "--shutdown-timeout", "2s"],
    );
    nats.down();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = consumer.term(Duration::from_secs(20));
    assert!(st.success(), "a graceful exit: {st:?}");
}

/// The same with the relay's window full behind the outage: the client
/// stops taking publishes once its command queue (2,048) is full, well
/// inside the window (4,096), and async-nats bounds a request's answer but
/// not its sending. A publish with no time limit held the session, and so
/// did the next session's opening, so neither the stall clock nor SIGTERM
/// reached the relay until NATS came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_relay_whose_publishes_wait_on_a_nats_outage() {
    let stack = stack();
    let (pool, _nats, mut relay) = relay_behind_a_full_outage(&stack, "natsfull").await;
    // Past the stall clock: a relay that can still act has noticed.
    tokio::time::sleep(Duration::from_secs(4)).await;
    relay.term(Duration::from_secs(30));
    // Stopped while its next session was opening, it reports what the
    // process confirmed, not that session's nothing (it logged 0/0).
    let log = relay.log_text();
    let said = log
        .lines()
        .rev()
        .find_map(|l| l.split("relay stopped confirmed_lsn=").nth(1))
        .unwrap_or_else(|| panic!("no stop line in the log:\n{log}"));
    let slot = slot_confirmed(&pool, &wire::slot_name("natsfull"))
        .await
        .expect("the slot");
    assert!(
        lsn(said.trim()) >= slot,
        "the stop line says {said}, the slot was confirmed to {slot:#X}"
    );
}

/// A session that ended with events in flight left
/// `outbox_relay_inflight_events` at its last value: a relay waiting for NATS
/// (or a standby) reported events in flight that no session held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_between_sessions_reports_nothing_in_flight() {
    let stack = stack();
    let (_pool, mut nats, relay) = relay_behind_a_full_outage(&stack, "idlegauge").await;
    eventually(T, "the session ended", || async {
        let m = relay.scrape().await;
        m.value("outbox_relay_streaming") == Some(0.0)
            && m.value("outbox_relay_session_restarts_total") >= Some(1.0)
    })
    .await;
    eventually(
        Duration::from_secs(5),
        "nothing in flight between sessions",
        || async {
            let m = relay.scrape().await;
            m.value("outbox_relay_inflight_events") == Some(0.0)
                && m.value("outbox_relay_inflight_bytes") == Some(0.0)
        },
    )
    .await;
    nats.up();
    read_stream(&nats.url, &wire::stream_name("idlegauge"), 3001, T).await;
}

/// A relay (`--publish-timeout 2s`) that published one event, then lost
/// NATS with 3,000 more to publish: more than the client's command queue
/// (2,048) takes, so a publish waits on the outage.
async fn relay_behind_a_full_outage(
    stack: &Stack,
    context: &str,
) -> (sqlx::PgPool, OwnNats, Service) {
    let (url, pool) = fresh_db(stack, &format!("t_{context}")).await;
    let mut nats = OwnNats::start(stack, context);
    let relay = Service::relay(&url, &nats.url, context, &["--publish-timeout", "2s"]);
    insert_txn(&pool, 0, 0, 1, 8).await;
    read_stream(&nats.url, &wire::stream_name(context), 1, T).await;
    nats.down();
    insert_txn(&pool, 0, 1, 3000, 8).await;
    (pool, nats, relay)
}

/// Review R5 (issue 58, item 5): a backfill of a table keyed by text or
/// bigint ids, interrupted and resumed over a slow path to NATS, past the
/// duplicate window, publishes each row once. The bound a run proves
/// ("every row before this one is stored") was trusted for uuid ids only,
/// the order the SQL and the relay agreed on: for other ids the resume
/// knew only the ids it read back within ten seconds, and published the
/// rest again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_of_text_ids_resumed_over_a_slow_path_publishes_each_row_once() {
    backfill_resumed_over_a_slow_path("bftext", "text", "'ord-' || g", None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_of_bigint_ids_resumed_over_a_slow_path_publishes_each_row_once() {
    backfill_resumed_over_a_slow_path("bfbigint", "bigint", "g * 7919 % 100003", None).await;
}

/// The same with rows routed to two streams (`--streams`): no run's bound
/// was trusted there (rows before it may have gone to the other stream and
/// been lost in flight), so each stream was read back whole within ten
/// seconds, and the rest published again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backfill_routed_to_two_streams_resumed_over_a_slow_path_publishes_each_row_once() {
    backfill_resumed_over_a_slow_path("bfrouted", "uuid", "gen_random_uuid()", Some("BFROUTED_B"))
        .await;
}

/// 60,000 rows of ids `id_sql` (of `g`; 120,000 routed), their times in
/// 100 ties (so the id's order decides), backfilled (with `routed`, every
/// third row to that stream); the relay killed with a third stored, then
/// restarted over a path 400 ms slow once the duplicate window has passed.
async fn backfill_resumed_over_a_slow_path(
    ctx: &str,
    id_type: &str,
    id_sql: &str,
    routed: Option<&str>,
) {
    let stack = stack();
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let own = wire::stream_name(ctx);
    let mut streams = vec![own.clone()];
    if let Some(b) = routed {
        let _ = js.delete_stream(b).await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: b.into(),
            subjects: vec![format!("{}.>", b.to_lowercase())],
            duplicate_window: Duration::from_secs(1),
            ..Default::default()
        })
        .await
        .unwrap();
        streams.push(b.to_owned());
    }
    let (url, pool) = empty_db(&stack, &format!("h_{ctx}")).await;
    // Enough stored for a read of ten seconds over the slow path not to
    // reach it all, in every stream.
    let rows: u64 = if routed.is_some() { 120_000 } else { 60_000 };
    // Routed: every third row to the other stream, the rest to the
    // relay's own, named in a `stream` column.
    let (stream_column, stream_value, topic) = match routed {
        Some(b) => (
            ", stream text",
            format!(", CASE WHEN g % 3 = 0 THEN '{b}' ELSE '{own}' END"),
            format!(
                "CASE WHEN g % 3 = 0 THEN '{}.placed' ELSE '{ctx}.placed' END",
                b.to_lowercase()
            ),
        ),
        None => ("", String::new(), format!("'{ctx}.placed'")),
    };
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE outbox_events (id {id_type} primary key, topic text not null, \
         payload jsonb not null, created_at timestamptz not null{stream_column}); \
         INSERT INTO outbox_events SELECT {id_sql}, {topic}, jsonb_build_object('g', g), \
         now() - interval '1 hour' + (g % 100) * interval '1 millisecond'{stream_value} \
         FROM generate_series(1, {rows}) g"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let sent: HashSet<String> = sqlx::query_scalar("SELECT id::text FROM outbox_events")
        .fetch_all(&pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    let proxy = Proxy::start(stack.nats_url.trim_start_matches("nats://")).await;
    let listed = streams.join(",");
    let mut flags = vec![
        "--columns",
        "subject=topic,occurred_at=created_at",
        "--duplicate-window",
        "1s",
        "--max-inflight",
        "256",
    ];
    if routed.is_some() {
        flags.extend(["--streams", listed.as_str()]);
    }
    let mut relay = Service::relay_starting(&url, &proxy.nats_url(), ctx, &flags);
    let count = || async {
        let mut n = 0;
        for name in &streams {
            if let Ok(mut s) = js.get_stream(name).await {
                n += s.info().await.map_or(0, |i| i.state.messages);
            }
        }
        n
    };
    eventually(T, "a third of the backfill stored", || async {
        count().await >= rows / 3
    })
    .await;
    relay.kill9();
    let stored = count().await;
    assert!(
        stored < sent.len() as u64,
        "the backfill ended before the kill"
    );
    // Past the duplicate window, over a slow path: only what the restart
    // knows of the streams keeps the rows stored from going again.
    proxy.delay(Duration::from_millis(400));
    tokio::time::sleep(Duration::from_secs(2)).await;
    relay.restart();
    eventually(
        Duration::from_secs(300),
        "the resumed backfill storing",
        || async { count().await > stored },
    )
    .await;
    proxy.delay(Duration::ZERO);
    relay.wait_ready();
    eventually(T, "every row stored", || async {
        count().await >= sent.len() as u64
    })
    .await;
    let mut got = Vec::new();
    for name in &streams {
        let held = stream_messages(&stack.nats_url, name).await;
        got.extend(read_stream(&stack.nats_url, name, held, T).await);
    }
    let letters = got
        .iter()
        .filter(|g| g.h(wire::DLQ_REASON).is_some())
        .count();
    assert_eq!(letters, 0, "rows dead-lettered: {}", relay.log_text());
    let mut seen = HashSet::new();
    let dups = got
        .iter()
        .filter(|g| !seen.insert(g.h(wire::MSG_ID).unwrap().to_owned()))
        .count();
    let missing = sent.difference(&seen).count();
    assert_eq!(
        (dups, missing),
        (0, 0),
        "{dups} rows published twice, {missing} missing ({stored} stored before the restart)\n{}",
        relay.log_text()
    );
}
