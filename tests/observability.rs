//! The relay's operator endpoint against the real stack: `/readyz` phases,
//! every SPEC §7 metric, event counts, and slot metrics that keep reporting
//! (from another relay) while a relay is down.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::common::*;
use outbox_relay::wire;

const T: Duration = Duration::from_secs(60);

/// SPEC §7, the relay's and the slots' rows.
const SPEC_RELAY_METRICS: &[&str] = &[
    "outbox_relay_events_published_total",
    "outbox_relay_events_dead_lettered_total",
    "outbox_relay_publish_errors_total",
    "outbox_relay_inflight_events",
    "outbox_relay_commit_to_ack_seconds",
    "outbox_relay_confirmed_lsn",
    "pg_replication_slot_lag_bytes",
    "pg_replication_slot_retained_wal_bytes",
    "pg_replication_slot_active",
    "pg_replication_slot_safe_wal_size_bytes",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_waits_for_the_slot_then_metrics_count_every_event() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "obs_ready").await;
    let stream = &wire::stream_name("obsready");

    // Creating a logical slot waits for every transaction that holds an
    // xid, server-wide. Hold one open: the relay cannot stream until it ends.
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut *blocker)
        .await
        .unwrap();
    let relay = Service::relay_starting(
        &url,
        &stack.nats_url,
        "obsready",
        &["--slot-metrics-interval", "200ms"],
    );
    assert_eq!(relay.http_get("/healthz").await, (200, "ok\n".to_owned()));
    let until = Instant::now() + Duration::from_millis(1500);
    let mut polls = 0;
    while Instant::now() < until {
        let (status, body) = relay.http_get("/readyz").await;
        assert_eq!(status, 503, "ready before the slot streams: {body}");
        assert!(body.contains("not streaming"), "{body}");
        polls += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(polls > 5);
    assert_eq!(
        relay.scrape().await.value("outbox_relay_streaming"),
        Some(0.0)
    );
    assert!(
        !relay.log_text().contains("streaming slot="),
        "the relay streamed while its slot could not be created"
    );

    blocker.rollback().await.unwrap();
    eventually(T, "/readyz ready once streaming", || async {
        // Ready; on this one-replica stream, with why an ack is not durable.
        let (status, body) = relay.http_get("/readyz").await;
        status == 200 && body.starts_with("ready")
    })
    .await;
    assert_eq!(
        relay.scrape().await.value("outbox_relay_streaming"),
        Some(1.0)
    );

    let mut sent = HashSet::new();
    for i in 0..20 {
        sent.extend(insert_txn(&pool, 1, i * 10, 10, 64).await);
    }
    let got = read_stream(&stack.nats_url, stream, 200, T).await;
    assert_exactly_once_in_order(&got, &sent);
    eventually(T, "published_total = 200", || async {
        relay
            .scrape()
            .await
            .value("outbox_relay_events_published_total")
            == Some(200.0)
    })
    .await;

    let m = relay.scrape().await;
    for name in SPEC_RELAY_METRICS {
        assert!(m.has(name), "{name} missing from /metrics:\n{}", m.0);
    }
    assert_eq!(m.value("outbox_relay_publish_errors_total"), Some(0.0));
    assert_eq!(m.value("outbox_relay_inflight_events"), Some(0.0));
    assert_eq!(
        m.value("outbox_relay_events_dead_lettered_total{reason=\"bad_row\"}"),
        Some(0.0)
    );
    // Every event went through the histogram, as a histogram.
    assert_eq!(
        m.value("outbox_relay_commit_to_ack_seconds_count"),
        Some(200.0)
    );
    assert_eq!(
        m.value("outbox_relay_commit_to_ack_seconds_bucket{le=\"+Inf\"}"),
        Some(200.0)
    );
    let slot = &wire::slot_name("obsready");
    assert_eq!(
        m.value(&format!("pg_replication_slot_active{{slot=\"{slot}\"}}")),
        Some(1.0)
    );
    assert_eq!(
        m.value(&format!(
            "pg_replication_slot_wal_status{{slot=\"{slot}\",status=\"reserved\"}}"
        )),
        Some(1.0)
    );
    assert_eq!(m.value("outbox_relay_slot_monitor_up"), Some(1.0));
    // The confirmed LSN it exports is the slot's.
    eventually(T, "exported confirmed LSN matches the slot", || async {
        let exported = relay.scrape().await.value("outbox_relay_confirmed_lsn");
        let slot = slot_confirmed(&pool, slot).await;
        exported.is_some() && exported.map(|v| v as u64) == slot
    })
    .await;

    // `slot status --json` reads the same figures.
    let out = std::process::Command::new(BIN)
        .args([
            "slot",
            "status",
            "--json",
            "--database-url",
            &url,
            "--context",
            "obsready",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["slot"], slot.as_str());
    assert_eq!(status["active"], true);
    assert_eq!(status["wal_status"], "reserved");
    assert!(status["safe_wal_size_bytes"].as_i64().unwrap() > 0);
    assert!(status["lag_bytes"].as_i64().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slot_lag_rises_while_a_relay_is_down_and_falls_after_it_catches_up() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "obs_lag").await;
    let fast = ["--slot-metrics-interval", "200ms"];
    // The watcher reports every logical slot on the server, the other
    // relay's too: that one is what we stop.
    let watcher = Service::relay(&url, &stack.nats_url, "obswatch", &fast);
    let mut relay = Service::relay(&url, &stack.nats_url, "obslag", &fast);
    let slot = &wire::slot_name("obslag");
    let lag = |m: &Scrape| m.value(&format!("pg_replication_slot_lag_bytes{{slot=\"{slot}\"}}"));
    let active = |m: &Scrape| m.value(&format!("pg_replication_slot_active{{slot=\"{slot}\"}}"));

    let mut sent = HashSet::new();
    sent.extend(insert_txn(&pool, 1, 0, 10, 64).await);
    eventually(T, "first events published", || async {
        relay
            .scrape()
            .await
            .value("outbox_relay_events_published_total")
            == Some(10.0)
    })
    .await;

    relay.kill9();
    eventually(T, "the watcher sees the slot inactive", || async {
        active(&watcher.scrape().await) == Some(0.0)
    })
    .await;
    let before = lag(&watcher.scrape().await).expect("lag of the stopped relay's slot");

    // ~2.5 MB of WAL in outbox rows nobody reads while the relay is down.
    let mut seq = 10;
    for _ in 0..20 {
        sent.extend(insert_txn(&pool, 1, seq, 100, 1000).await);
        seq += 100;
    }
    eventually(T, "lag rises past 2 MB", || async {
        lag(&watcher.scrape().await).unwrap_or(0.0) > 2_000_000.0
    })
    .await;
    let peak = lag(&watcher.scrape().await).unwrap();
    assert!(peak > before, "lag {peak} did not rise from {before}");
    let m = watcher.scrape().await;
    let retained = m
        .value(&format!(
            "pg_replication_slot_retained_wal_bytes{{slot=\"{slot}\"}}"
        ))
        .unwrap();
    assert!(
        retained >= lag(&m).unwrap(),
        "retained WAL {retained} < lag"
    );
    // The watcher's own slot stays caught up meanwhile.
    eventually(T, "the watcher's own slot keeps up", || async {
        watcher
            .scrape()
            .await
            .value(&format!(
                "pg_replication_slot_lag_bytes{{slot=\"{}\"}}",
                wire::slot_name("obswatch")
            ))
            .is_some_and(|v| v < 1_000_000.0)
    })
    .await;

    relay.restart();
    relay.wait_ready();
    eventually(T, "lag back near zero after catching up", || async {
        let m = watcher.scrape().await;
        active(&m) == Some(1.0) && lag(&m).is_some_and(|v| v < 256.0 * 1024.0 && v < peak / 4.0)
    })
    .await;
    let got = read_stream(
        &stack.nats_url,
        &wire::stream_name("obslag"),
        sent.len() as u64,
        T,
    )
    .await;
    assert_exactly_once_in_order(&got, &sent);
}

/// Issue 15's relay signals, scraped from the running relay:
/// `outbox_relay_lag_seconds` (now − commit time of the oldest event read
/// and not acked) grows while NATS is gone, so a stalled relay shows, and
/// falls to 0 once everything is acked; `outbox_dlq_messages` counts the
/// relay's own dead letters, and `dlq delete` takes a dealt-with one away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_lag_grows_while_nats_is_gone_and_its_dead_letters_are_counted() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "obs_rlag").await;
    let mut nats = OwnNats::start(&stack, "rlag");
    let relay = Service::relay(&url, &nats.url, "obsrlag", &["--publish-timeout", "1s"]);
    let lag = |m: &Scrape| m.value("outbox_relay_lag_seconds");
    let depth_series = format!(
        "outbox_dlq_messages{{stream=\"{}\",subject=\"{}\"}}",
        wire::stream_name("obsrlag"),
        wire::relay_dlq_subject("obsrlag")
    );

    let mut sent = HashSet::new();
    sent.extend(insert_txn(&pool, 1, 0, 5, 64).await);
    let bad = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, subject) \
         VALUES ($1, 'order', 'o1', 'placed', '{}', 'obsrlag.bad subject')",
    )
    .bind(bad)
    .execute(&pool)
    .await
    .unwrap();
    eventually(T, "published, the dead letter counted, no lag", || async {
        let m = relay.scrape().await;
        m.value("outbox_relay_events_published_total") == Some(6.0)
            && m.value(&depth_series) == Some(1.0)
            && lag(&m) == Some(0.0)
    })
    .await;

    nats.down();
    sent.extend(insert_txn(&pool, 1, 5, 3, 64).await);
    eventually(T, "lag grows past 3 s while NATS is gone", || async {
        lag(&relay.scrape().await).unwrap_or(0.0) > 3.0
    })
    .await;
    nats.up();
    eventually(T, "lag back to 0 once NATS takes the events", || async {
        lag(&relay.scrape().await) == Some(0.0)
    })
    .await;
    let got = read_stream(&nats.url, &wire::stream_name("obsrlag"), 9, T).await;
    let events: Vec<Got> = got
        .into_iter()
        .filter(|g| g.subject != wire::relay_dlq_subject("obsrlag"))
        .collect();
    assert_exactly_once_in_order(&events, &sent);

    let stream = wire::stream_name("obsrlag");
    let (code, out) = run_output_bounded(
        &[
            "dlq",
            "delete",
            "--database-url",
            &url,
            "--nats-url",
            &nats.url,
            "--stream",
            &stream,
            "--id",
            &bad.to_string(),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(&format!("{bad}  deleted")), "{out}");
    eventually(T, "the depth falls to 0", || async {
        relay.scrape().await.value(&depth_series) == Some(0.0)
    })
    .await;
    let (code, out) = run_output_bounded(
        &[
            "dlq",
            "delete",
            "--database-url",
            &url,
            "--nats-url",
            &nats.url,
            "--stream",
            &stream,
            "--all",
        ],
        Duration::from_secs(30),
    );
    assert_ne!(code, Some(0), "nothing left to delete: {out}");
    assert!(out.contains("no dead letter"), "{out}");
}

/// Every series the alert and recording rules read (deploy/prometheus) is
/// exported by a running relay or consumer once each has had work: the
/// rules cannot wait on a metric no process sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_rules_read_is_scraped_from_the_running_processes() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "obs_rules").await;
    let dir = std::env::temp_dir().join(format!("outbox-relay-obsrules-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("placed")).unwrap();
    std::fs::write(
        dir.join("placed/v1.json"),
        r#"{"type":"object","required":["p"]}"#,
    )
    .unwrap();
    let schemas = ["--schemas", dir.to_str().unwrap()];
    let relay = Service::relay(&url, &stack.nats_url, "obsrules", &schemas);
    let app = axum::Router::new().route("/handle", axum::routing::post(|| async { "ok" }));
    let handler_url = serve_handler(app).await;
    let stream = wire::stream_name("obsrules");
    let consumer = Service::consumer(
        &url,
        &stack.nats_url,
        &stream,
        "obsrules",
        &handler_url,
        &[
            &["--context", "obsrules", "--filter", "obsrules.event.>"][..],
            &schemas,
        ]
        .concat(),
    );

    // A valid event (published, handled), and one the relay's schema
    // check dead-letters.
    insert_txn(&pool, 1, 0, 1, 8).await;
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         VALUES ($1, 'order', 'o1', 'placed', '{}')",
    )
    .bind(uuid::Uuid::new_v4())
    .execute(&pool)
    .await
    .unwrap();
    // One the consumer's check dead-letters (another writer's message).
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let id = uuid::Uuid::new_v4().to_string();
    let headers = [
        (wire::MSG_ID, id.as_str()),
        (wire::EVENT_TYPE, "placed"),
        (wire::AGGREGATE_ID, "o2"),
    ];
    publish_with(&js, "obsrules.event.placed.v1", &headers, b"{}").await;

    let rules_dir = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus");
    let mut wanted = std::collections::BTreeSet::new();
    for file in ["alerts.yml", "rules.yml"] {
        let text = std::fs::read_to_string(format!("{rules_dir}/{file}")).unwrap();
        for expr in text.lines().filter_map(|l| l.trim().strip_prefix("expr:")) {
            for w in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                // The audit's metrics are its file's (tests/audit.rs).
                if (w.starts_with("outbox_") && !w.starts_with("outbox_audit_"))
                    || w.starts_with("pg_replication_slot")
                {
                    wanted.insert(w.to_owned());
                }
            }
        }
    }
    assert!(wanted.len() > 15, "{wanted:?}");
    eventually(T, "every series the rules read is exported", || async {
        let (r, c) = (relay.scrape().await, consumer.scrape().await);
        // A slot that has never been near its limit has no safe-size figure
        // unless max_slot_wal_keep_size is set; the slot tests cover it.
        wanted
            .iter()
            .filter(|n| n.as_str() != "pg_replication_slot_safe_wal_size_bytes")
            .all(|n| r.has(n) || c.has(n))
    })
    .await;
    // Each failure is counted once its message has come through (the
    // series above exist from the start).
    eventually(T, "each process counted its schema failure", || async {
        let (r, c) = (relay.scrape().await, consumer.scrape().await);
        r.value(r#"outbox_schema_validation_failures_total{stage="relay",event_type="placed"}"#)
            .is_some()
            && c.value(
                r#"outbox_schema_validation_failures_total{stage="consume",event_type="placed"}"#,
            )
            .is_some()
    })
    .await;
    let (r, c) = (relay.scrape().await, consumer.scrape().await);
    assert_eq!(
        r.value(r#"outbox_schema_validation_failures_total{stage="relay",event_type="placed"}"#),
        Some(1.0)
    );
    assert_eq!(
        c.value(r#"outbox_schema_validation_failures_total{stage="consume",event_type="placed"}"#),
        Some(1.0)
    );
    let _ = std::fs::remove_dir_all(dir);
}
