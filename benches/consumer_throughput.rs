//! Consumer throughput: messages/s through `outbox-relay consume` with an
//! HTTP handler that answers 200 at once.
//!
//! ```sh
//! scripts/bench.sh consumer --messages 20000
//! scripts/bench.sh consumer --messages 80000 --concurrency 128 --max-ack-pending 512
//! ```
//! `--concurrency` and `--max-ack-pending` default to the product's (48, 50).
//! Writes `consumer-c{N}.json` and `.svg` under `--out` (default
//! `target/bench`). `--rust` runs the consumer in this process with a Rust
//! handler (inside the inbox transaction) instead of the binary with an
//! HTTP one (`consumer-rust-c{N}.*`).
//!
//! Scale-out (SPEC §11): `--processes P --handler-ms M` starts P processes of
//! one durable and a handler that takes M ms per call; the crew forms before
//! the messages are published (`consumer-c{N}-p{P}-h{M}.*`):
//! `scripts/bench.sh consumer --messages 4000 --concurrency 8 --handler-ms 40 --processes 4`
//! Needs DATABASE_URL (migrated), NATS_URL and RELAY_BIN (the binary to run).

mod common;
use common::{cpu_seconds, env, rss_mib};

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use outbox_relay::wire;

/// The bench's flags.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Messages to publish and consume.
    #[arg(long, default_value_t = 5000)]
    messages: u64,
    /// The consumer's --concurrency (the product's default).
    #[arg(long, default_value_t = 48)]
    concurrency: u64,
    /// The consumer's --max-ack-pending (the product's default).
    #[arg(long, default_value_t = 50)]
    max_ack_pending: u64,
    /// Aggregates the messages spread over.
    #[arg(long, default_value_t = 1000)]
    aggregates: u64,
    /// Consumer processes of the durable.
    #[arg(long, default_value_t = 1)]
    processes: u64,
    /// How long the handler takes per call.
    #[arg(long, default_value_t = 0)]
    handler_ms: u64,
    /// Consume in this process with a Rust handler.
    #[arg(long, default_value_t = false)]
    rust: bool,
    #[command(flatten)]
    common: common::Common,
}

#[tokio::main]
async fn main() {
    let args = <Args as clap::Parser>::parse();
    let n = args.messages;
    // The product's defaults unless told: users run those.
    let concurrency = args.concurrency;
    let max_ack_pending = args.max_ack_pending;
    let aggregates = args.aggregates;
    // SPEC §11's scale-out target: N processes of one durable, a handler
    // that takes `--handler-ms` per call.
    let processes = args.processes.max(1);
    let handler_ms = args.handler_ms;
    let (db, nats, bin) = (
        env("DATABASE_URL", "consumer"),
        env("NATS_URL", "consumer"),
        env("RELAY_BIN", "consumer"),
    );

    // The handler: 200 at once (or after `--handler-ms`), counting calls.
    let calls = Arc::new(AtomicU64::new(0));
    let counter = calls.clone();
    let app = axum::Router::new().route(
        "/h",
        axum::routing::post(move || {
            let c = counter.clone();
            async move {
                if handler_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(handler_ms)).await;
                }
                c.fetch_add(1, Ordering::Relaxed);
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handler_url = format!("http://{}/h", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let js = jetstream::new(async_nats::connect(&nats).await.unwrap());
    let _ = js.delete_stream("CTP_EVENTS").await;
    let _ = js.delete_stream("DLQ_CTP").await;
    js.create_stream(stream::Config {
        name: "CTP_EVENTS".into(),
        subjects: vec!["ctp.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    // With several processes, or a slow handler, the crew forms first and
    // the messages come after: what is timed is the crew at work, not its
    // forming. Otherwise the stream is full before the consumer starts.
    let prestart = processes > 1 || handler_ms > 0;
    if !prestart {
        fill(&js, n, aggregates).await;
    }

    let rust = args.rust;
    assert!(
        !(rust && processes > 1),
        "--rust runs in this process: one process only"
    );
    let durable = format!("ctp_{}c{concurrency}", if rust { "rust_" } else { "" });
    let log_path = std::env::temp_dir().join(format!("consumer-bench-{concurrency}.log"));
    let log = std::fs::File::create(&log_path).unwrap();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let mut children = if rust {
        // In process: the Rust trait, inside the inbox transaction.
        let cfg = outbox_relay::ConsumeConfig {
            stream: "CTP_EVENTS".into(),
            durable: durable.clone(),
            filter: None,
            ack_wait: Duration::from_secs(120),
            max_deliver: 20,
            max_ack_pending: max_ack_pending as i64,
            concurrency: concurrency as usize,
            backoff: vec![Duration::from_secs(1)],
            max_parked_keys: 100_000,
            dlq_prefix: "dlq.ctp".into(),
            dlq_replicas: 1,
            nats_monitor_url: Vec::new(),
            require_durable: false,
            shutdown_timeout: Duration::from_secs(5),
            schemas: None,
        };
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(concurrency as u32 + 2)
            .connect(&db)
            .await
            .unwrap();
        let js = jetstream::new(async_nats::connect(&nats).await.unwrap());
        let handler = Counting(calls.clone());
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let ready = outbox_relay::Readiness::default();
            outbox_relay::consumer::run(cfg, pool, js, handler, ready, stop).await
        });
        Vec::new()
    } else {
        let mut children = Vec::new();
        for p in 0..processes {
            let log = if p == 0 {
                log.try_clone().unwrap()
            } else {
                std::fs::File::create(
                    std::env::temp_dir().join(format!("consumer-bench-{concurrency}-p{p}.log")),
                )
                .unwrap()
            };
            children.push(
                Command::new(&bin)
                    .args([
                        "consume",
                        "--database-url",
                        &db,
                        "--nats-url",
                        &nats,
                        "--context",
                        "ctp",
                    ])
                    .args([
                        "--stream",
                        "CTP_EVENTS",
                        "--durable",
                        &durable,
                        "--handler-url",
                        &handler_url,
                    ])
                    .args([
                        "--concurrency",
                        &concurrency.to_string(),
                        "--metrics-addr",
                        "127.0.0.1:0",
                    ])
                    .args(["--max-ack-pending", &max_ack_pending.to_string()])
                    .stderr(Stdio::from(log))
                    .spawn()
                    .expect("start the consumer"),
            );
        }
        children
    };

    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    if prestart {
        // Every process holds its crew lock: the crew is formed.
        let members = || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted \
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            )
            .fetch_one(&pool)
            .await
            .unwrap() as u64
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while members().await < processes && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // One beat more, so the dispatcher counts every process in.
        tokio::time::sleep(Duration::from_millis(600)).await;
        fill(&js, n, aggregates).await;
    }
    let processed = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM inbox_messages WHERE consumer = $1 AND processed_at IS NOT NULL",
        )
        .bind(&durable)
        .fetch_one(&pool)
        .await
        .unwrap() as u64
    };
    // Time from the first handler call, so start-up is not counted.
    let deadline = Instant::now() + Duration::from_secs(300);
    while calls.load(Ordering::Relaxed) == 0 && Instant::now() < deadline {
        if let Some(Ok(Some(st))) = children.first_mut().map(|c| c.try_wait()) {
            let text = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(5).collect();
            panic!(
                "consumer exited with {st}: {}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Progress from the handler's own count: polling the inbox would load
    // the Postgres it measures. One sample a second for the chart.
    let start = Instant::now();
    // The consumer's own CPU over the timed window (SPEC target: µs per
    // message); for --rust the consumer is this process, handler included.
    let pids: Vec<String> = if rust {
        vec![std::process::id().to_string()]
    } else {
        children.iter().map(|c| c.id().to_string()).collect()
    };
    let cpu_at_start: f64 = pids.iter().map(|p| cpu_seconds(p)).sum();
    let mut samples: Vec<(f64, u64)> = vec![(0.0, 0)];
    let mut next_sample = Duration::from_secs(1);
    while calls.load(Ordering::Relaxed) < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if start.elapsed() >= next_sample {
            let c = calls.load(Ordering::Relaxed);
            samples.push((start.elapsed().as_secs_f64(), c));
            next_sample += Duration::from_secs(1);
            if samples.len() % 5 == 1 {
                eprintln!("  {c} handler calls");
            }
        }
    }
    samples.push((start.elapsed().as_secs_f64(), calls.load(Ordering::Relaxed)));
    let called = start.elapsed().as_secs_f64();
    // Then every message recorded processed in the inbox, exactly once.
    let mut done = 0;
    while done < n && Instant::now() < deadline {
        done = processed().await;
        if done < n {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let cpu = pids.iter().map(|p| cpu_seconds(p)).sum::<f64>() - cpu_at_start;
    let peak_rss = pids.iter().map(|p| rss_mib(p).1).fold(0.0, f64::max);
    shutdown.cancel();
    for c in &mut children {
        let _ = c.kill();
        let _ = c.wait();
    }
    let handler_calls = calls.load(Ordering::Relaxed);
    println!(
        "consumer --concurrency {concurrency} x {processes} process(es), handler {handler_ms} ms: {n} messages; handler called {handler_calls} times in {called:.2} s = {:.0} calls/s; {done} recorded processed after {elapsed:.2} s = {:.0} messages/s",
        handler_calls as f64 / called,
        done as f64 / elapsed,
    );
    println!(
        "  consumer CPU {cpu:.2} s = {:.1} µs/message; peak RSS {peak_rss:.1} MiB{}",
        cpu * 1e6 / done.max(1) as f64,
        if rust {
            " (bench process, handler included)"
        } else {
            " (largest process)"
        }
    );
    let rates: Vec<(f64, f64)> = samples
        .windows(2)
        .map(|w| {
            (
                w[1].0,
                (w[1].1 - w[0].1) as f64 / (w[1].0 - w[0].0).max(1e-9),
            )
        })
        .collect();
    let date = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    let report = serde_json::json!({
        "bench": "consumer",
        "date": date,
        "command": format!("scripts/bench.sh consumer --messages {n} --concurrency {concurrency} --max-ack-pending {max_ack_pending} --aggregates {aggregates} --processes {processes} --handler-ms {handler_ms}"),
        "processes": processes,
        "handler_ms": handler_ms,
        "messages": n,
        "concurrency": concurrency,
        "max_ack_pending": max_ack_pending,
        "handler": if rust { "rust" } else { "http" },
        "aggregates": aggregates,
        "handler_calls": handler_calls,
        "recorded_processed": done,
        "calls_per_second": handler_calls as f64 / called,
        "messages_per_second": done as f64 / elapsed,
        "consumer_cpu_seconds": cpu,
        "consumer_cpu_us_per_message": cpu * 1e6 / done.max(1) as f64,
        "consumer_peak_rss_mib": peak_rss,
        "per_second": rates.iter().map(|(t, r)| serde_json::json!({"t": t, "calls_per_second": r})).collect::<Vec<_>>(),
    });
    let out = args.common.out_dir();
    let base = format!(
        "{out}/consumer-{}c{concurrency}{}",
        if rust { "rust-" } else { "" },
        if prestart {
            format!("-p{processes}-h{handler_ms}")
        } else {
            String::new()
        }
    );
    std::fs::write(
        format!("{base}.json"),
        serde_json::to_string_pretty(&report).unwrap(),
    )
    .expect("write JSON");
    std::fs::write(
        format!("{base}.svg"),
        chart(
            &rates,
            &format!(
                "outbox-relay consume, {} handler, concurrency {concurrency}: handler calls/s ({date})",
                if rust { "Rust" } else { "HTTP" }
            ),
        ),
    )
    .expect("write SVG");
    println!("wrote {base}.json and {base}.svg");
    if handler_calls != n {
        eprintln!("expected exactly {n} handler calls, got {handler_calls}");
        std::process::exit(1);
    }
    std::process::exit(if done == n { 0 } else { 1 });
}

/// `n` relay-shaped messages over `aggregates` aggregates into the stream.
async fn fill(js: &jetstream::Context, n: u64, aggregates: u64) {
    let mut acks = Vec::with_capacity(n as usize);
    for i in 0..n {
        let mut h = async_nats::HeaderMap::new();
        h.insert(wire::MSG_ID, uuid::Uuid::new_v4().to_string().as_str());
        h.insert(wire::AGGREGATE_ID, (i % aggregates).to_string().as_str());
        let msg = jetstream::message::PublishMessage::build()
            .payload(r#"{"n": 1}"#.into())
            .headers(h);
        acks.push(js.send_publish("ctp.e", msg).await.unwrap());
        // async-nats holds at most 5,000 unacked publishes per context.
        if acks.len() == 1000 {
            for a in acks.drain(..) {
                a.await.unwrap();
            }
        }
    }
    for a in acks {
        a.await.unwrap();
    }
}

/// Handler calls per second over the run, as a line.
fn chart(rates: &[(f64, f64)], title: &str) -> String {
    let (w, h, pad) = (640.0, 320.0, 48.0);
    let t_max = rates.iter().map(|r| r.0).fold(1.0, f64::max);
    let r_max = rates.iter().map(|r| r.1).fold(1.0, f64::max) * 1.1;
    let x = |t: f64| pad + t / t_max * (w - 2.0 * pad);
    let y = |r: f64| h - pad - r / r_max * (h - 2.0 * pad);
    let points: Vec<String> = rates
        .iter()
        .map(|&(t, r)| format!("{:.1},{:.1}", x(t), y(r)))
        .collect();
    let mut svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{pad}" y="20">{title}</text>
<line x1="{pad}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/>
<line x1="{pad}" y1="{y0}" x2="{pad}" y2="{pad}" stroke="black"/>
<text x="{x1}" y="{yl}" text-anchor="end">{t_max:.0} s</text>
<text x="4" y="{ytop}">{r_top:.0}/s</text>
<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{pts}"/>
"##,
        y0 = h - pad,
        x1 = w - pad,
        yl = h - pad + 16.0,
        ytop = y(r_max / 1.1) + 4.0,
        r_top = r_max / 1.1,
        pts = points.join(" "),
    );
    svg.push_str("</svg>\n");
    svg
}

/// A Rust handler that writes nothing: what the consumer and its inbox
/// transaction cost alone.
struct Counting(Arc<AtomicU64>);

impl outbox_relay::Handler for Counting {
    async fn handle(
        &self,
        _tx: &mut sqlx::PgConnection,
        _d: &outbox_relay::Delivery,
    ) -> outbox_relay::Outcome {
        self.0.fetch_add(1, Ordering::Relaxed);
        outbox_relay::Outcome::Processed
    }
}
