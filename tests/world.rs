//! The relay when the world goes away (issue 58): a slot Postgres
//! invalidated, a path that goes silent without a reset. Each test runs on
//! its own Postgres (they change server settings or cut its paths) and
//! checks SPEC §5/§9's promise: nothing lost, nothing doubled, never a
//! stall.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::common::*;
use outbox_relay::wire;

const T: Duration = Duration::from_secs(120);

async fn own_pool(url: &str) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .unwrap()
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
    let ids: Vec<uuid::Uuid> = got
        .iter()
        .map(|g| uuid::Uuid::parse_str(g.h(wire::MSG_ID).unwrap()).unwrap())
        .collect();
    let unique: HashSet<uuid::Uuid> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "a duplicate in the stream");
    assert_eq!(unique, sent, "the stream holds every row once");
    drop(relay);
}
