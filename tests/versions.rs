//! SPEC §15: what depends on the servers' releases. `scripts/test.sh` runs
//! these (and a subset of the suite, `MATRIX` there) on every supported
//! PostgreSQL and nats-server release; the refusals run once, on servers of
//! their own.

use std::collections::HashSet;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::*;
use outbox_relay::wire;

const T: Duration = Duration::from_secs(90);

/// The stack's nats-server release, as (major, minor, patch).
async fn nats_release(url: &str) -> (u32, u32, u32) {
    let info = async_nats::connect(url).await.unwrap().server_info();
    let mut parts = info
        .version
        .split(|c: char| !c.is_ascii_digit())
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().unwrap());
    let mut next = || parts.next().unwrap_or(0);
    (next(), next(), next())
}

/// Atomic batches need 2.12.1: older, `--publish-mode batch` is refused in
/// one line naming it and the default publishes event by event; newer,
/// batch mode publishes in atomic batches. Either way, each row once, in
/// commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_publish_mode_follows_the_servers_release() {
    let stack = stack();
    let release = nats_release(&stack.nats_url).await;
    eprintln!("nats-server {release:?}");
    let (url, pool) = fresh_db(&stack, "v_mode").await;
    let batches = release >= (2, 12, 1);
    let flags: &[&str] = if batches {
        &["--publish-mode", "batch"]
    } else {
        let (code, err) =
            run_relay_bounded(&url, &stack.nats_url, "vmode", &["--publish-mode", "batch"]);
        assert!(
            code == Some(1)
                && err
                    .lines()
                    .any(|l| l.starts_with("error:") && l.contains("2.12.1")),
            "refused at start, naming the release it needs: {err}"
        );
        &[]
    };
    let relay = Service::relay(&url, &stack.nats_url, "vmode", flags);
    let mut sent = HashSet::new();
    for (i, n) in [1u64, 40, 3, 120, 7].into_iter().enumerate() {
        sent.extend(insert_txn(&pool, 0, i as u64 * 1000, n, 8).await);
    }
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name("vmode"),
        sent.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &sent);
    let m = relay.scrape().await;
    let committed = m
        .value("outbox_relay_batches_total{result=\"committed\"}")
        .unwrap_or(0.0);
    if batches {
        assert_eq!(m.value("outbox_relay_publish_batches"), Some(1.0));
        assert!(committed >= 1.0, "{committed}");
    } else {
        assert_eq!(m.value("outbox_relay_publish_batches"), Some(0.0));
        assert_eq!(committed, 0.0);
    }
}

/// PostgreSQL 13 (older than 14) is refused at start, in one line naming
/// the version and the supported range.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_older_than_14_is_refused_in_one_line() {
    let own = OwnStack::up_with("pg13", &[("STACK_PG_MAJOR", "13")]);
    let url = own.get("DATABASE_URL").to_owned();
    let (code, err) = run_relay_bounded(&url, own.get("NATS_URL"), "pg13", &[]);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert!(
        code == Some(1)
            && errors.len() == 1
            && errors[0].contains("PostgreSQL 13")
            && errors[0].contains("14"),
        "{err}"
    );
    assert!(errors[0].contains("18"), "names the range: {}", errors[0]);
}

/// nats-server 2.9 (Debian 12's own package) is refused at start in one
/// line naming it and the supported lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_older_than_2_10_is_refused_in_one_line() {
    let stack = stack();
    let bin = stack_tool("nats-bin-debian", &[]);
    let nats = OwnNats::start_bin(&stack, "nats29", &bin);
    let (url, _pool) = fresh_db(&stack, "v_nats29").await;
    let (code, err) = run_relay_bounded(&url, &nats.url, "nats29", &[]);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert!(
        code == Some(1)
            && errors.len() == 1
            && errors[0].contains("2.9.10")
            && errors[0].contains("2.10, 2.11, 2.12, 2.14, 2.15"),
        "{err}"
    );
}

/// A nats-server without JetStream is refused at start in one line that
/// says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_server_without_jetstream_is_refused_in_one_line() {
    let stack = stack();
    let port = free_port();
    let mut nats = Command::new(&stack.nats_bin)
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_listening(port, || "nats-server did not start".into());
    let (url, _pool) = fresh_db(&stack, "v_nojs").await;
    let (code, err) = run_relay_bounded(&url, &format!("nats://127.0.0.1:{port}"), "nojs", &[]);
    let _ = nats.kill();
    let _ = nats.wait();
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert!(
        code == Some(1) && errors.len() == 1 && errors[0].contains("JetStream"),
        "{err}"
    );
}

async fn pool_of(url: &str) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(url)
        .await
        .unwrap()
}

/// SPEC §15: the relay streaming from a physical standby (PostgreSQL 16 or
/// newer: the slot is the standby's) does what it does on a primary: the
/// first start backfills from the standby's snapshot, a kill -9 loses and
/// repeats nothing, an idle outbox on a busy primary retains little WAL on
/// the standby, and the standby's promotion keeps the slot and the stream
/// whole. What it cannot do there (create the publication) it says how to
/// do on the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_on_a_standby_streams_as_on_the_primary_across_kill_9_idleness_and_promotion() {
    let stack = stack();
    let pair = OwnPgPair::up("standby", 16);
    migrate(&pair.primary_url);
    let primary = pool_of(&pair.primary_url).await;
    let ctx = "stby";
    // The publication is the primary's to create: the relay says so.
    let (code, err) = run_relay_bounded(&pair.standby_url, &stack.nats_url, ctx, &[]);
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert!(
        code == Some(1) && errors.len() == 1 && errors[0].contains("on the primary"),
        "{err}"
    );
    let create = errors[0]
        .split("run: ")
        .nth(1)
        .and_then(|s| s.strip_suffix(';'))
        .unwrap_or_else(|| panic!("the line gives the statement: {}", errors[0]))
        .to_owned();
    // The standby lags (replay paused): the publication the primary has
    // just created is not there yet when the relay starts. It waits for it
    // (issue 58, item 9: it refused, and exited).
    let standby = pool_of(&pair.standby_url).await;
    sqlx::query("SELECT pg_wal_replay_pause()")
        .execute(&standby)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(create))
        .execute(&primary)
        .await
        .unwrap();

    // Rows before the first start: backfilled from the standby's snapshot
    // (in occurred_at order: one a transaction, so that is commit order).
    let mut sent = HashSet::new();
    for t in 0..20 {
        sent.extend(insert_txn(&primary, 1, t, 1, 8).await);
    }
    let mut relay = Service::relay_starting(&pair.standby_url, &stack.nats_url, ctx, &[]);
    eventually(
        T,
        "the relay waits for the publication's replay",
        || async { relay.log_text().contains("waiting up to") },
    )
    .await;
    sqlx::query("SELECT pg_wal_replay_resume()")
        .execute(&standby)
        .await
        .unwrap();
    // A slot on a standby is created at the primary's next running-xacts
    // record: the background writer logs one every 15 s while WAL moves;
    // this says it now, as the deployment guide tells operators.
    let slot = wire::slot_name(ctx);
    eventually(T, "the relay's slot on the standby", || async {
        let _ = sqlx::query("SELECT pg_log_standby_snapshot()")
            .execute(&primary)
            .await;
        let standby = pool_of(&pair.standby_url).await;
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
        )
        .bind(&slot)
        .fetch_one(&standby)
        .await
        .unwrap()
    })
    .await;
    relay.wait_ready();
    for t in 0..30 {
        if t == 10 {
            relay.kill9();
        }
        if t == 20 {
            relay.restart();
        }
        sent.extend(insert_txn(&primary, 2, t * 10, 10, 8).await);
    }
    let stream = wire::stream_name(ctx);
    let got = read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);

    // An idle outbox on a busy primary: the standby's slot keeps up.
    let standby = pool_of(&pair.standby_url).await;
    sqlx::query("CREATE TABLE filler (id int, pad text)")
        .execute(&primary)
        .await
        .unwrap();
    for _ in 0..8 {
        sqlx::query(
            "INSERT INTO filler SELECT g, repeat(md5(g::text), 30) FROM generate_series(1, 9000) g",
        )
        .execute(&primary)
        .await
        .unwrap();
    }
    eventually(T, "the standby's slot retains under 8 MB", || async {
        let _ = sqlx::query("SELECT pg_log_standby_snapshot()")
            .execute(&primary)
            .await;
        let retained: Option<i64> = sqlx::query_scalar(
            "SELECT pg_wal_lsn_diff(pg_last_wal_replay_lsn(), restart_lsn)::int8 \
             FROM pg_replication_slots WHERE slot_name = $1",
        )
        .bind(&slot)
        .fetch_one(&standby)
        .await
        .unwrap();
        retained.is_some_and(|r| r < 8 * 1024 * 1024)
    })
    .await;

    // Issue 62 item 5 (review A2): the audit cannot make its temporary
    // tables on the standby, and says where to run it (before: exit 2 on
    // "cannot execute CREATE TABLE in a read-only transaction"); against
    // the primary, with the standby named for the slot, it judges the
    // stream (before: the slot was not found).
    let audit = |db: &str, extra: &[&str]| {
        let mut args = vec!["audit", "--database-url", db, "--context", ctx];
        args.extend([
            "--nats-url",
            &stack.nats_url,
            "--last",
            "1h",
            "--wait",
            "60s",
        ]);
        args.extend(extra);
        run_output_bounded(&args, Duration::from_secs(120))
    };
    let (code, out) = audit(&pair.standby_url, &[]);
    assert!(
        code == Some(2) && out.contains("standby") && out.contains("--slot-database-url"),
        "{out}"
    );
    let (code, out) = audit(&pair.primary_url, &[]);
    assert!(
        code == Some(2) && out.contains("does not exist in this database"),
        "{out}"
    );
    // A slot of another cluster would confirm positions of another WAL.
    let (code, out) = audit(
        &pair.primary_url,
        &["--slot-database-url", &stack.admin_url],
    );
    assert!(code == Some(2) && out.contains("another cluster"), "{out}");
    // The slot confirms the primary's WAL position once the standby has
    // replayed past it: a busy primary, as in production.
    let busy = {
        let primary = primary.clone();
        tokio::spawn(async move {
            loop {
                let _ = sqlx::query("SELECT pg_log_standby_snapshot()")
                    .execute(&primary)
                    .await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    // (Blocking one of the test's two workers; the other keeps it busy.)
    let (code, out) = audit(
        &pair.primary_url,
        &["--slot-database-url", &pair.standby_url],
    );
    assert!(
        code == Some(0) && out.contains(&format!(": {} rows, {} messages", sent.len(), sent.len())),
        "{out}"
    );
    // Prune, likewise: refused on the standby; against the primary it
    // needs the standby for the slot (before: "kept: … does not exist in
    // this database", exit 0, every night).
    let prune = |db: &str, extra: &[&str]| {
        let mut args = vec!["prune", "--database-url", db, "--context", ctx];
        args.extend(["--older-than", "1h", "--dry-run", "--wait", "60s"]);
        args.extend(extra);
        run_output_bounded(&args, Duration::from_secs(120))
    };
    let (code, out) = prune(&pair.standby_url, &[]);
    assert!(code == Some(1) && out.contains("standby"), "{out}");
    let (code, out) = prune(&pair.primary_url, &[]);
    assert!(
        code == Some(1)
            && out.contains("does not exist in this database")
            && out.contains("--slot-database-url"),
        "{out}"
    );
    let (code, out) = prune(
        &pair.primary_url,
        &["--slot-database-url", &pair.standby_url],
    );
    assert_eq!(code, Some(0), "{out}");
    busy.abort();

    // The primary crashes, the standby is promoted: same URL, same slot.
    pair.failover();
    let promoted = pool_of(&pair.standby_url).await;
    for t in 0..5 {
        sent.extend(insert_txn(&promoted, 3, t * 10, 10, 8).await);
    }
    let got = read_stream(&stack.nats_url, &stream, sent.len() as u64, T).await;
    assert_exactly_once_in_order(&got, &sent);
    drop(relay);
}

/// A standby the relay cannot decode on is refused at start with the
/// setting that fixes it: PostgreSQL 15 (decoding on a standby needs 16),
/// `hot_standby_feedback` off, a primary or a standby whose `wal_level` is
/// not logical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_the_relay_cannot_decode_on_is_refused_with_the_setting_that_fixes_it() {
    let stack = stack();
    /// (major, `pg-pair-up` settings, what the refusal names)
    type Case = (
        u32,
        &'static [(&'static str, &'static str)],
        &'static [&'static str],
    );
    let cases: [Case; 4] = [
        (15, &[], &["PostgreSQL 15", "16"]),
        (
            16,
            &[("STACK_STANDBY_FEEDBACK", "off")],
            &["hot_standby_feedback", "on"],
        ),
        (
            16,
            &[("STACK_PRIMARY_WAL_LEVEL", "replica")],
            &["wal_level", "primary", "logical"],
        ),
        (
            16,
            &[("STACK_STANDBY_WAL_LEVEL", "replica")],
            &["wal_level is replica", "logical"],
        ),
    ];
    for (major, env, says) in cases {
        let pair = OwnPgPair::up_with("standby-bad", major, env);
        migrate(&pair.primary_url);
        let primary = pool_of(&pair.primary_url).await;
        sqlx::raw_sql(
            "CREATE PUBLICATION outbox_relay_stbybad FOR TABLE outbox_events \
             WITH (publish = 'insert', publish_via_partition_root = true)",
        )
        .execute(&primary)
        .await
        .unwrap();
        // Replayed on the standby first: a relay that finds no publication
        // refuses that before it judges the standby (CI on a loaded box).
        standby_replayed(&primary, &pair.standby_url).await;
        let (code, err) = run_relay_bounded(
            &pair.standby_url,
            &stack.nats_url,
            "stbybad",
            &["--publication", "outbox_relay_stbybad"],
        );
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert!(
            code == Some(1) && errors.len() == 1 && says.iter().all(|s| errors[0].contains(s)),
            "{major} {env:?}: one line naming {says:?}: {err}"
        );
    }
}

/// Wait for the standby at `standby_url` to replay all the primary wrote
/// so far (a publication just made there, say).
async fn standby_replayed(primary: &sqlx::PgPool, standby_url: &str) {
    let upto: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(primary)
        .await
        .unwrap();
    let standby = pool_of(standby_url).await;
    eventually(T, "the standby replayed the publication", || async {
        sqlx::query_scalar::<_, bool>("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
            .bind(&upto)
            .fetch_one(&standby)
            .await
            .unwrap_or(false)
    })
    .await;
}
