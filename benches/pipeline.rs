//! The whole pipeline: producers commit outbox rows, the running
//! relay (`--context bench`) publishes them, `outbox-relay consume` (started
//! here) calls an HTTP handler (served here). Reports commit → handler-called
//! latency (HDR: p50, p99, max) and the sustained rate, checks every event
//! reached the handler exactly once, and writes JSON to `--out`.
//!
//! ```sh
//! scripts/bench.sh pipeline --events 30000 --rate 2000
//! scripts/bench.sh pipeline --events 100000 --rate 0 --producers 4
//! ```
//! Needs DATABASE_URL, NATS_URL, RELAY_BIN and the relay running with
//! `--context bench`.

mod common;
use common::env;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

/// Per event: when its commit returned, and each time the handler got it.
#[derive(Default)]
struct Book {
    committed: HashMap<Uuid, Instant>,
    called: HashMap<Uuid, Vec<Instant>>,
}

/// The bench's flags.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Events to commit.
    #[arg(long, default_value_t = 30_000)]
    events: u64,
    /// Events per second.
    #[arg(long, default_value_t = 2000)]
    rate: u64,
    /// Producer connections.
    #[arg(long, default_value_t = 2)]
    producers: u64,
    /// Events per transaction.
    #[arg(long, default_value_t = 10)]
    txn_size: u64,
    /// The consumer's --concurrency (the product's default).
    #[arg(long, default_value_t = 48)]
    concurrency: u64,
    /// The consumer's --max-ack-pending (the product's default).
    #[arg(long, default_value_t = 50)]
    max_ack_pending: u64,
    #[command(flatten)]
    common: common::Common,
}

#[tokio::main]
async fn main() {
    let args = <Args as clap::Parser>::parse();
    let events = args.events;
    let rate = args.rate;
    let producers = args.producers.max(1);
    let txn = args.txn_size.max(1);
    // The product's defaults unless told (48 and 50): users run those.
    let concurrency = args.concurrency;
    let max_ack_pending = args.max_ack_pending;
    let (db, nats, bin) = (
        env("DATABASE_URL", "pipeline"),
        env("NATS_URL", "pipeline"),
        env("RELAY_BIN", "pipeline"),
    );
    let book = Arc::new(Mutex::new(Book::default()));

    let handler_book = book.clone();
    let app = axum::Router::new().route(
        "/h",
        axum::routing::post(move |body: axum::body::Bytes| {
            let book = handler_book.clone();
            async move {
                let at = Instant::now();
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                if let Some(id) = v["message_id"]
                    .as_str()
                    .and_then(|s| Uuid::parse_str(s).ok())
                {
                    book.lock().unwrap().called.entry(id).or_default().push(at);
                }
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handler_url = format!("http://{}/h", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let log_path = std::env::temp_dir().join("pipeline-consumer.log");
    let mut consumer = Command::new(&bin)
        .args([
            "consume",
            "--database-url",
            &db,
            "--nats-url",
            &nats,
            "--context",
            "bench",
        ])
        .args(["--durable", "pipeline", "--handler-url", &handler_url])
        .args(["--concurrency", &concurrency.to_string()])
        .args(["--max-ack-pending", &max_ack_pending.to_string()])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .stderr(Stdio::from(std::fs::File::create(&log_path).unwrap()))
        .spawn()
        .expect("start the consumer");
    // Let it bind its durable before the load starts.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let pool = PgPoolOptions::new()
        .max_connections(producers as u32 + 1)
        .connect(&db)
        .await
        .unwrap();
    let per_producer = events / producers;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for p in 0..producers {
        let (pool, book) = (pool.clone(), book.clone());
        tasks.push(tokio::spawn(async move {
            let txns = per_producer / txn;
            let mut tick = (rate > 0).then(|| {
                let mut t = tokio::time::interval(Duration::from_micros(
                    1_000_000 * txn * producers / rate,
                ));
                t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                t
            });
            for t in 0..txns {
                if let Some(tick) = tick.as_mut() {
                    tick.tick().await;
                }
                let ids: Vec<Uuid> = (0..txn).map(|_| Uuid::new_v4()).collect();
                sqlx::query(
                    "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
                     SELECT id, 'order', $2 || '-' || (ord % 50), 'placed', '{\"pad\": \"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}' \
                     FROM unnest($1::uuid[]) WITH ORDINALITY AS t(id, ord)",
                )
                .bind(&ids)
                .bind(format!("p{p}-{t}"))
                .execute(&pool)
                .await
                .unwrap();
                let at = Instant::now();
                let mut b = book.lock().unwrap();
                for id in ids {
                    b.committed.insert(id, at);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let total = (per_producer / txn) * txn * producers;
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut last_report = Instant::now();
    loop {
        let called = book.lock().unwrap().called.len() as u64;
        if called >= total || Instant::now() > deadline {
            break;
        }
        if last_report.elapsed() > Duration::from_secs(5) {
            eprintln!("  {called}/{total} events reached the handler");
            last_report = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = consumer.kill();
    let _ = consumer.wait();

    let b = book.lock().unwrap();
    let mut hist = Histogram::<u64>::new(3).unwrap();
    let mut repeats = 0;
    let mut last = started;
    for (id, at) in &b.committed {
        if let Some(calls) = b.called.get(id) {
            repeats += calls.len() - 1;
            last = last.max(calls[0]);
            hist.record(calls[0].saturating_duration_since(*at).as_micros() as u64)
                .unwrap();
        }
    }
    let reached = hist.len();
    let secs = last.duration_since(started).as_secs_f64();
    let ms = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    let date = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    let command = format!(
        "scripts/bench.sh pipeline --events {events} --rate {rate} --producers {producers} --txn-size {txn} --concurrency {concurrency} --max-ack-pending {max_ack_pending}"
    );
    println!("{command}");
    println!(
        "  {reached}/{total} events reached the handler ({repeats} repeated calls) in {secs:.2} s = {:.0} events/s",
        reached as f64 / secs
    );
    println!(
        "  commit -> handler called: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        ms(0.5),
        ms(0.9),
        ms(0.99),
        hist.max() as f64 / 1000.0
    );
    let report = serde_json::json!({
        "bench": "pipeline",
        "date": date,
        "command": command,
        "events": total,
        "reached": reached,
        "repeated_calls": repeats,
        "seconds": secs,
        "events_per_second": reached as f64 / secs,
        "commit_to_handler_ms": {"p50": ms(0.5), "p90": ms(0.9), "p99": ms(0.99), "max": hist.max() as f64 / 1000.0},
    });
    let out = args.common.out_dir();
    let path = format!("{out}/pipeline-rate{rate}.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report).unwrap()).unwrap();
    println!("  wrote {path}");
    if reached != total || repeats > 0 {
        eprintln!(
            "expected every event exactly once (consumer log: {})",
            log_path.display()
        );
        std::process::exit(1);
    }
}
