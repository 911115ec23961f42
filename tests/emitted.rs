//! The table-less outbox (SPEC §12): events `outbox_emit()` writes into the
//! WAL, published exactly as rows, against the real stack.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use uuid::Uuid;

use crate::common::*;

const T: Duration = Duration::from_secs(60);
use outbox_relay::wire;

/// `outbox_emit()` with the fields a test sets; the rest defaulted.
async fn emit(
    conn: &mut sqlx::PgConnection,
    aggregate_id: &str,
    event_type: &str,
    payload: serde_json::Value,
) -> Uuid {
    sqlx::query_scalar(
        "SELECT outbox_emit(aggregate_type => 'order', aggregate_id => $1, event_type => $2, payload => $3)",
    )
    .bind(aggregate_id)
    .bind(event_type)
    .bind(payload)
    .fetch_one(conn)
    .await
    .unwrap()
}

async fn insert_row(
    conn: &mut sqlx::PgConnection,
    aggregate_id: &str,
    event_type: &str,
    payload: serde_json::Value,
) -> Uuid {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, $3, $4)",
    )
    .bind(id)
    .bind(aggregate_id)
    .bind(event_type)
    .bind(payload)
    .execute(conn)
    .await
    .unwrap();
    id
}

/// A transaction that interleaves rows and emitted events reaches the stream
/// in insert order, as one transaction (one commit LSN, indexes 0..n, one
/// atomic batch), and an emitted event carries what a row carries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_and_emitted_events_of_one_transaction_keep_insert_order_and_stay_whole() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_emitmix").await;
    let relay = Service::relay(
        &url,
        &stack.nats_url,
        "emitmix",
        &["--publish-mode", "batch"],
    );
    let mut order = Vec::new();
    let mut tx = pool.begin().await.unwrap();
    for i in 0..12 {
        let payload = serde_json::json!({"i": i, "amount": 12.50});
        let id = if i % 3 == 1 {
            insert_row(&mut tx, "o-1", "placed", payload).await
        } else {
            emit(&mut tx, "o-1", "placed", payload).await
        };
        order.push(id.to_string());
    }
    tx.commit().await.unwrap();

    let got = read_stream(&stack.nats_url, &wire::stream_name("emitmix"), 12, T).await;
    let ids: Vec<&str> = got.iter().map(|g| g.h(wire::MSG_ID).unwrap()).collect();
    assert_eq!(ids, order, "insert order, rows and emitted events mixed");
    let lsns: HashSet<&str> = got.iter().map(|g| g.h(wire::COMMIT_LSN).unwrap()).collect();
    assert_eq!(lsns.len(), 1, "one transaction");
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.h(wire::TXN_INDEX), Some(i.to_string().as_str()));
        assert_eq!(g.subject, "emitmix.event.placed.v1");
        assert_eq!(g.json()["i"], i);
    }
    // A row and an emitted event carry the same headers (values aside),
    // but for the emitted event's mark (SPEC §14: the audit has no row to
    // check it against).
    let keys = |g: &Got| {
        let mut k: Vec<String> = g
            .headers
            .keys()
            .filter(|k| *k != wire::EMITTED)
            .cloned()
            .collect();
        k.sort();
        k
    };
    assert_eq!(keys(&got[1]), keys(&got[0]), "row vs emitted headers");
    assert_eq!(
        (got[0].h(wire::EMITTED), got[1].h(wire::EMITTED)),
        (Some("1"), None),
        "event 0 is emitted, event 1 a row"
    );
    assert_eq!(got[0].h(wire::AGGREGATE_ID), Some("o-1"));
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_emitted_events_total"), Some(8.0));
    assert_eq!(
        m.value("outbox_relay_batches_total{result=\"committed\"}"),
        Some(1.0),
        "the transaction went out as one atomic batch"
    );
}

/// An emit in a transaction that rolls back never reaches the stream; one
/// in a later transaction does, and the relay never stalls between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_emit_never_appears() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_emitrb").await;
    let _relay = Service::relay(&url, &stack.nats_url, "emitrb", &[]);
    let mut tx = pool.begin().await.unwrap();
    let gone = emit(&mut tx, "a", "placed", serde_json::json!({"k": 1})).await;
    tx.rollback().await.unwrap();
    // Through a savepoint as well: the emit rolls back with it.
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SAVEPOINT s").execute(&mut *tx).await.unwrap();
    let gone_too = emit(&mut tx, "a", "placed", serde_json::json!({"k": 2})).await;
    sqlx::query("ROLLBACK TO SAVEPOINT s")
        .execute(&mut *tx)
        .await
        .unwrap();
    let kept = emit(&mut tx, "a", "placed", serde_json::json!({"k": 3})).await;
    tx.commit().await.unwrap();
    let mut conn = pool.acquire().await.unwrap();
    let last = emit(&mut conn, "a", "placed", serde_json::json!({"k": 4})).await;

    let stream = wire::stream_name("emitrb");
    let got = read_stream(&stack.nats_url, &stream, 2, T).await;
    let ids: Vec<&str> = got.iter().map(|g| g.h(wire::MSG_ID).unwrap()).collect();
    assert_eq!(ids, [kept.to_string(), last.to_string()]);
    assert_eq!(stream_messages(&stack.nats_url, &stream).await, 2);
    for id in [gone, gone_too] {
        assert!(!ids.contains(&id.to_string().as_str()));
    }
}

/// kill -9 of the relay, four times, while producers emit events (and
/// insert rows) in transactions of 1 to 10: nothing lost, nothing twice,
/// commit order kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_an_emitting_load_loses_nothing_and_duplicates_nothing() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_emitkill").await;
    let mut relay = Service::relay(&url, &stack.nats_url, "emitkill", &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let seed = std::env::var("TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    println!("seed: TEST_SEED={seed}");
    let producer = {
        let (pool, stop) = (pool.clone(), stop.clone());
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut sent = HashSet::new();
            let mut tick = tokio::time::interval(Duration::from_millis(4));
            let mut t = 0u64;
            while !stop.load(Ordering::Relaxed) && sent.len() < 12_000 {
                tick.tick().await;
                let mut tx = pool.begin().await.unwrap();
                for i in 0..rng.gen_range(1..=10) {
                    let agg = format!("a{}", t % 13);
                    let payload = serde_json::json!({"t": t, "i": i});
                    let id = if rng.gen_bool(0.2) {
                        insert_row(&mut tx, &agg, "placed", payload).await
                    } else {
                        emit(&mut tx, &agg, "placed", payload).await
                    };
                    sent.insert(id);
                }
                tx.commit().await.unwrap();
                t += 1;
            }
            sent
        })
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xdead);
    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(500..1500))).await;
        relay.kill9();
        tokio::time::sleep(Duration::from_millis(if round % 2 == 0 {
            50
        } else {
            1000
        }))
        .await;
        relay.restart();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let sent = producer.await.unwrap();
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name("emitkill"),
        sent.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &sent);
    println!(
        "{} events, rows and emitted, exactly once in order",
        sent.len()
    );
}

/// An emitted event with a bad subject override, or a payload failing its
/// schema, is dead-lettered like a row, and the next event flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_emitted_event_with_a_bad_subject_or_failing_its_schema_is_dead_lettered() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_emitdlq").await;
    let dir = schema_dir(
        "emitdlq",
        &[(
            "shop/order/placed/v1.json",
            r#"{"type": "object", "required": ["amount"], "properties": {"amount": {"type": "integer", "minimum": 0}}}"#,
        )],
    );
    let _relay = Service::relay(
        &url,
        &stack.nats_url,
        "emitdlq",
        &["--schemas", dir.to_str().unwrap()],
    );
    let mut conn = pool.acquire().await.unwrap();
    let bad_subject: Uuid = sqlx::query_scalar(
        "SELECT outbox_emit('order', 'o-1', 'shop.order.placed', '{\"amount\": 1}', subject => 'emitdlq.orders created')",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    let invalid = emit(
        &mut conn,
        "o-1",
        "shop.order.placed",
        serde_json::json!({"amount": -1}),
    )
    .await;
    let good = emit(
        &mut conn,
        "o-1",
        "shop.order.placed",
        serde_json::json!({"amount": 2}),
    )
    .await;

    let got = read_stream(&stack.nats_url, &wire::stream_name("emitdlq"), 3, T).await;
    let ids: Vec<&str> = got.iter().map(|g| g.h(wire::MSG_ID).unwrap()).collect();
    assert_eq!(
        ids,
        [
            bad_subject.to_string(),
            invalid.to_string(),
            good.to_string()
        ]
    );
    let dlq = wire::relay_dlq_subject("emitdlq");
    assert_eq!(got[0].subject, dlq);
    assert_eq!(got[0].h(wire::DLQ_REASON), Some("invalid_subject"));
    assert_eq!(got[1].subject, dlq);
    assert_eq!(got[1].h(wire::DLQ_REASON), Some("schema_invalid"));
    // Their classes, as the playbook triages them (SPEC §16).
    assert_eq!(got[0].h(wire::DLQ_CLASS), Some("bad_row"));
    assert_eq!(got[1].h(wire::DLQ_CLASS), Some("schema_invalid"));
    assert!(got[1]
        .h(wire::DLQ_FINGERPRINT)
        .is_some_and(|f| f.len() == 16));
    assert_eq!(
        got[1].payload, br#"{"amount": -1}"#,
        "the payload, as it was"
    );
    assert_ne!(got[2].subject, dlq);
    assert!(
        got[2].h(wire::SCHEMA).is_some(),
        "checked against its schema"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Bad arguments raise in the producer's own transaction, which then
/// commits nothing; nothing reaches the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_emit_with_bad_arguments_fails_in_the_producers_transaction() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_emitargs").await;
    let _relay = Service::relay(&url, &stack.nats_url, "emitargs", &[]);
    for (call, says) in [
        ("outbox_emit(NULL, 'a', 'e', '{}')", "aggregate_type"),
        ("outbox_emit('t', '', 'e', '{}')", "aggregate_id"),
        ("outbox_emit('t', 'a', NULL, '{}')", "event_type"),
        ("outbox_emit('t', 'a', 'e', NULL)", "payload"),
        (
            "outbox_emit('t', 'a', 'e', '{}', event_version => 0)",
            "event_version",
        ),
        (
            "outbox_emit('t', 'a', 'e', '{}', headers => '[1]')",
            "headers",
        ),
        ("outbox_emit('t', 'a', 'e', '{}', subject => '')", "subject"),
        (
            "outbox_emit('t', 'a', 'e', '{}', occurred_at => now() + interval '1 hour')",
            "occurred_at",
        ),
        ("outbox_emit('t', 'a', 'e', '{}', id => NULL)", "id"),
        ("outbox_emit('t', 'a', 'e', 'not json')", "json"),
    ] {
        let mut tx = pool.begin().await.unwrap();
        let before = insert_row(&mut tx, "a", "before", serde_json::json!({})).await;
        let err = sqlx::query(sqlx::AssertSqlSafe(format!("SELECT {call}")))
            .execute(&mut *tx)
            .await
            .expect_err(call)
            .to_string();
        assert!(err.contains(says), "{call}: {err}");
        // The transaction is aborted: its earlier row cannot commit.
        assert!(
            tx.commit().await.is_err() || {
                let n: i64 = sqlx::query_scalar("SELECT count(*) FROM outbox_events WHERE id = $1")
                    .bind(before)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                n == 0
            }
        );
    }
    // A good call after all that: the only event in the stream.
    let mut conn = pool.acquire().await.unwrap();
    let ok = emit(&mut conn, "a", "placed", serde_json::json!({})).await;
    let stream = wire::stream_name("emitargs");
    let got = read_stream(&stack.nats_url, &stream, 1, T).await;
    assert_eq!(got[0].h(wire::MSG_ID), Some(ok.to_string().as_str()));
    assert_eq!(stream_messages(&stack.nats_url, &stream).await, 1);
}

/// `--emitted-events off`: rows flow, emitted events are left to another
/// relay of the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emitted_events_off_publishes_rows_only() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_emitoff").await;
    let relay = Service::relay(
        &url,
        &stack.nats_url,
        "emitoff",
        &["--emitted-events", "off"],
    );
    let mut tx = pool.begin().await.unwrap();
    emit(&mut tx, "a", "placed", serde_json::json!({})).await;
    let row = insert_row(&mut tx, "a", "placed", serde_json::json!({})).await;
    tx.commit().await.unwrap();
    let stream = wire::stream_name("emitoff");
    let got = read_stream(&stack.nats_url, &stream, 1, T).await;
    assert_eq!(got[0].h(wire::MSG_ID), Some(row.to_string().as_str()));
    assert_eq!(stream_messages(&stack.nats_url, &stream).await, 1);
    let m = relay.scrape().await;
    assert_eq!(m.value("outbox_relay_emitted_events_total"), Some(0.0));
}

/// Message content reaches the relay unconverted, rows converted to UTF8:
/// in a database of another encoding, outbox_emit() refuses in the
/// producer's transaction instead of writing bytes the relay would publish
/// as they are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_emit_refuses_a_database_that_is_not_utf8() {
    let stack = stack();
    let admin = sqlx::PgPool::connect(&stack.admin_url).await.unwrap();
    sqlx::query("DROP DATABASE IF EXISTS t_emitlatin1 WITH (FORCE)")
        .execute(&admin)
        .await
        .unwrap();
    sqlx::query(
        "CREATE DATABASE t_emitlatin1 ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0",
    )
    .execute(&admin)
    .await
    .unwrap();
    let url = db_url(&stack.admin_url, "t_emitlatin1");
    migrate(&url);
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let err = sqlx::query("SELECT outbox_emit('t', 'a', 'e', '{\"n\": \"é\"}')")
        .execute(&pool)
        .await
        .expect_err("a LATIN1 database")
        .to_string();
    assert!(err.contains("UTF8"), "{err}");
}
