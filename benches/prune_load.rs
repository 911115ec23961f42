//! Prune under load: what `outbox-relay prune` costs a producer.
//!
//! Inserts `--rows` outbox rows dated 30 days ago, waits until the running
//! relay (`--context bench`) has confirmed them, then runs a producer at
//! `--rate` events/s (10-row transactions) for `--seconds`, first alone and
//! then while `outbox-relay prune --older-than 7d` deletes the old rows. It
//! reports the producer's commit time (p50, p99, max) in both phases, how
//! long prune took and what it deleted.
//!
//! ```sh
//! scripts/bench.sh prune --rows 1000000 --rate 2000 --seconds 20
//! ```
//! Needs DATABASE_URL, RELAY_BIN, and the relay running with `--context bench`.

mod common;
use common::env;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use sqlx::postgres::PgPoolOptions;

/// Commit times (µs) of a producer at `rate` events/s until `stop`.
async fn produce(pool: sqlx::PgPool, rate: u64, stop: Arc<AtomicBool>) -> Histogram<u64> {
    let mut hist = Histogram::<u64>::new(3).unwrap();
    let mut tick = tokio::time::interval(Duration::from_micros(10_000_000 / rate.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let started = Instant::now();
        sqlx::query(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT gen_random_uuid(), 'order', 'a' || g, 'placed', '{\"n\": 1}' FROM generate_series(1, 10) g",
        )
        .execute(&pool)
        .await
        .unwrap();
        hist.record(started.elapsed().as_micros() as u64).unwrap();
    }
    hist
}

fn summary(h: &Histogram<u64>) -> String {
    let ms = |v: u64| v as f64 / 1000.0;
    format!(
        "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} commits)",
        ms(h.value_at_quantile(0.5)),
        ms(h.value_at_quantile(0.99)),
        ms(h.max()),
        h.len()
    )
}

/// The bench's flags.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Old outbox rows to prune.
    #[arg(long, default_value_t = 1_000_000)]
    rows: u64,
    /// Producer events per second meanwhile.
    #[arg(long, default_value_t = 2000)]
    rate: u64,
    /// How long the producer runs.
    #[arg(long, default_value_t = 20)]
    seconds: u64,
    #[command(flatten)]
    common: common::Common,
}

#[tokio::main]
async fn main() {
    let args = <Args as clap::Parser>::parse();
    let rows = args.rows;
    let rate = args.rate;
    let seconds = args.seconds;
    let (db, bin) = (env("DATABASE_URL", "prune"), env("RELAY_BIN", "prune"));
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&db)
        .await
        .unwrap();

    let started = Instant::now();
    for chunk in 0..rows.div_ceil(100_000) {
        let n = (rows - chunk * 100_000).min(100_000) as i64;
        sqlx::query(
            "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, occurred_at) \
             SELECT gen_random_uuid(), 'order', 'old' || (g % 1000), 'placed', '{\"n\": 1}', \
                    now() - interval '30 days' FROM generate_series(1, $1::int8) g",
        )
        .bind(n)
        .execute(&pool)
        .await
        .unwrap();
    }
    eprintln!(
        "inserted {rows} old rows in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let target: String = sqlx::query_scalar("SELECT pg_current_wal_insert_lsn()::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    loop {
        let caught_up: bool = sqlx::query_scalar(
            "SELECT confirmed_flush_lsn >= $1::pg_lsn FROM pg_replication_slots WHERE slot_name = 'outbox_relay_bench'",
        )
        .bind(&target)
        .fetch_one(&pool)
        .await
        .unwrap();
        if caught_up {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "relay caught up after {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // Alone.
    let stop = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(pool.clone(), rate, stop.clone()));
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let alone = producer.await.unwrap();

    // With prune.
    let stop = Arc::new(AtomicBool::new(false));
    let producer = tokio::spawn(produce(pool.clone(), rate, stop.clone()));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let pruning = Instant::now();
    let out = tokio::process::Command::new(&bin)
        .args([
            "prune",
            "--database-url",
            &db,
            "--context",
            "bench",
            "--older-than",
            "7d",
        ])
        .output()
        .await
        .unwrap();
    let prune_secs = pruning.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let during = producer.await.unwrap();
    let report = String::from_utf8_lossy(&out.stdout);

    println!(
        "prune under load, {rows} old rows, producer at {rate} events/s (10-row transactions):"
    );
    println!("  producer alone:        {}", summary(&alone));
    println!("  producer during prune: {}", summary(&during));
    println!(
        "  p99 rise: {:.2} ms; prune took {prune_secs:.1} s ({:.0} rows/s)",
        (during.value_at_quantile(0.99) as f64 - alone.value_at_quantile(0.99) as f64) / 1000.0,
        rows as f64 / prune_secs
    );
    for line in report.lines() {
        println!("  prune: {line}");
    }
    if !out.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&out.stderr));
        std::process::exit(1);
    }
}
