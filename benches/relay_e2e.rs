//! End-to-end load run against a deployment: producers insert outbox rows,
//! a subscriber receives them from NATS, and the relay's own figures are read
//! from its `/metrics` and `/proc`.
//!
//! ```sh
//! # against the local stack (scripts/bench.sh starts it and a release relay):
//! scripts/bench.sh --events 100000 --rate 0 --txn-size 50 --payload 256
//! scripts/bench.sh --events 30000 --rate 2000 --txn-size 10 --payload 256
//! ```
//!
//! Needs DATABASE_URL (a database with the outbox, relay running with
//! `--context bench`), NATS_URL, RELAY_PID and RELAY_METRICS (host:port).
//! Latency is commit returned to the producer → message received.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hdrhistogram::Histogram;
use sqlx::postgres::PgPoolOptions;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Args {
    events: u64,
    rate: u64,
    txn_size: u64,
    payload: usize,
    producers: u64,
}

fn parse_args() -> Args {
    let mut a = Args {
        events: 50_000,
        rate: 0,
        txn_size: 50,
        payload: 256,
        producers: 2,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let v = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--events" => a.events = v.parse().expect("--events N"),
            "--rate" => a.rate = v.parse().expect("--rate N (0 = flat out)"),
            "--txn-size" => a.txn_size = v.parse().expect("--txn-size N"),
            "--payload" => a.payload = v.parse().expect("--payload BYTES"),
            "--producers" => a.producers = v.parse().expect("--producers N"),
            "--bench" => {
                i += 1;
                continue;
            }
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    a
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} not set: run through scripts/bench.sh"))
}

/// utime + stime of a process, in seconds.
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks: f64 = fields
        .get(11)
        .and_then(|u| u.parse::<f64>().ok())
        .unwrap_or(0.0)
        + fields
            .get(12)
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or(0.0);
    ticks / 100.0
}

fn peak_rss_mib(pid: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

async fn scrape(addr: &str) -> String {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let req = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out
}

fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Cumulative buckets `(le, count)` of histogram `name` in a scrape.
fn buckets(text: &str, name: &str) -> Vec<(f64, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, count) = rest.split_once("\"} ")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, count.parse().ok()?))
        })
        .collect()
}

/// Quantile `q` of the samples recorded between two scrapes, interpolated
/// within its bucket the way Prometheus' `histogram_quantile` does.
fn bucket_quantile(before: &str, after: &str, name: &str, q: f64) -> f64 {
    let b0 = buckets(before, name);
    let delta: Vec<(f64, f64)> = buckets(after, name)
        .into_iter()
        .map(|(le, c)| {
            let c0 = b0.iter().find(|(l, _)| *l == le).map_or(0.0, |x| x.1);
            (le, c - c0)
        })
        .collect();
    let Some(&(_, total)) = delta.last() else {
        return f64::NAN;
    };
    let rank = q * total;
    let mut lower = (0.0, 0.0);
    for &(le, c) in &delta {
        if c >= rank && total > 0.0 {
            if le.is_infinite() {
                return lower.0;
            }
            let width = c - lower.1;
            let frac = if width > 0.0 {
                (rank - lower.1) / width
            } else {
                1.0
            };
            return lower.0 + (le - lower.0) * frac;
        }
        lower = (le, c);
    }
    f64::NAN
}

#[tokio::main]
async fn main() {
    let a = parse_args();
    let db = env("DATABASE_URL");
    let nats = env("NATS_URL");
    let relay_pid = env("RELAY_PID");
    let metrics_addr = env("RELAY_METRICS");

    let pool = PgPoolOptions::new()
        .max_connections(a.producers as u32 + 1)
        .connect(&db)
        .await
        .expect("connect");
    let client = async_nats::connect(&nats).await.expect("nats");
    let mut sub = client.subscribe("bench.>").await.expect("subscribe");
    client.flush().await.expect("flush");

    let commits: Arc<Mutex<HashMap<uuid::Uuid, Instant>>> = Arc::default();
    let cpu0 = cpu_seconds(&relay_pid);
    let before = scrape(&metrics_addr).await;
    let published0 = metric(&before, "outbox_relay_events_published_total").unwrap_or(0.0);
    let start = Instant::now();

    let padding = "x".repeat(a.payload.saturating_sub(40));
    let per_producer = a.events / a.producers;
    let mut producers = Vec::new();
    for p in 0..a.producers {
        let pool = pool.clone();
        let commits = commits.clone();
        let padding = padding.clone();
        let txn_size = a.txn_size;
        let txns = per_producer / txn_size;
        // Each producer takes its share of the rate.
        let interval = (a.rate > 0)
            .then(|| Duration::from_secs_f64(txn_size as f64 * a.producers as f64 / a.rate as f64));
        producers.push(tokio::spawn(async move {
            let mut tick = interval.map(tokio::time::interval);
            for t in 0..txns {
                if let Some(tick) = tick.as_mut() {
                    tick.tick().await;
                }
                let ids: Vec<uuid::Uuid> = (0..txn_size).map(|_| uuid::Uuid::new_v4()).collect();
                let mut q = sqlx::QueryBuilder::new(
                    "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) ",
                );
                q.push_values(&ids, |mut b, id| {
                    b.push_bind(*id)
                        .push_bind("load")
                        .push_bind(format!("{p}-{}", t % 100))
                        .push_bind("tick")
                        .push_bind(serde_json::json!({ "p": p, "pad": padding }));
                });
                q.build().execute(&pool).await.expect("insert");
                let now = Instant::now();
                let mut c = commits.lock().unwrap();
                for id in ids {
                    c.insert(id, now);
                }
            }
        }));
    }

    let expected = per_producer / a.txn_size * a.txn_size * a.producers;
    let mut hist = Histogram::<u64>::new_with_bounds(1, 120_000_000, 3).unwrap();
    let mut early: Vec<(uuid::Uuid, Instant)> = Vec::new();
    let mut received = 0u64;
    let mut last_receipt = start;
    let mut next_report = Instant::now() + Duration::from_secs(2);
    while received < expected {
        let msg = match tokio::time::timeout(Duration::from_secs(30), sub.next()).await {
            Ok(Some(m)) => m,
            _ => {
                eprintln!("stalled: {received}/{expected} received");
                break;
            }
        };
        let now = Instant::now();
        let Some(id) = msg
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .and_then(|v| uuid::Uuid::parse_str(v.as_str()).ok())
        else {
            continue;
        };
        received += 1;
        last_receipt = now;
        match commits.lock().unwrap().remove(&id) {
            Some(t) => hist.saturating_record(now.duration_since(t).as_micros() as u64),
            // Arrived before the producer recorded its commit time: the
            // latency is below the lock hand-off; count it as such later.
            None => early.push((id, now)),
        }
        if now > next_report {
            eprintln!(
                "… {received}/{expected} received, {:.0} ev/s",
                received as f64 / start.elapsed().as_secs_f64()
            );
            next_report = now + Duration::from_secs(2);
        }
    }
    for p in producers {
        p.await.unwrap();
    }
    {
        let commits = commits.lock().unwrap();
        for (id, at) in early {
            if let Some(t) = commits.get(&id) {
                hist.saturating_record(at.saturating_duration_since(*t).as_micros() as u64);
            }
        }
    }

    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = scrape(&metrics_addr).await;
    let published =
        metric(&after, "outbox_relay_events_published_total").unwrap_or(0.0) - published0;
    let cpu = cpu_seconds(&relay_pid) - cpu0;
    let elapsed = last_receipt.duration_since(start).as_secs_f64();
    let q = |p: f64| hist.value_at_quantile(p) as f64 / 1000.0;
    println!(
        "events {received}/{expected} | {:.0} events/s | commit→received p50 {:.2} ms p99 {:.2} ms max {:.2} ms",
        received as f64 / elapsed,
        q(0.5),
        q(0.99),
        hist.max() as f64 / 1000.0
    );
    println!(
        "relay: commit→ack p50 {:.2} ms p99 {:.2} ms (its /metrics histogram, this run) | CPU {:.2} µs/event | peak RSS {:.1} MiB",
        bucket_quantile(&before, &after, "outbox_relay_commit_to_ack_seconds", 0.5) * 1000.0,
        bucket_quantile(&before, &after, "outbox_relay_commit_to_ack_seconds", 0.99) * 1000.0,
        cpu * 1e6 / published.max(1.0),
        peak_rss_mib(&relay_pid)
    );
    std::process::exit(if received == expected { 0 } else { 1 });
}
