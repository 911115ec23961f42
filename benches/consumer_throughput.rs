//! Consumer throughput: messages/s through `outbox-relay consume` with an
//! HTTP handler that answers 200 at once.
//!
//! ```sh
//! scripts/bench.sh consumer --messages 5000 --concurrency 1
//! scripts/bench.sh consumer --messages 20000 --concurrency 32
//! ```
//! Needs DATABASE_URL (migrated), NATS_URL and RELAY_BIN (the binary to run).

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use outbox_relay::wire;

fn arg(name: &str, default: u64) -> u64 {
    let argv: Vec<String> = std::env::args().collect();
    argv.iter()
        .position(|a| a == name)
        .and_then(|i| argv.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} takes a number"))
        })
        .unwrap_or(default)
}

fn env(k: &str) -> String {
    std::env::var(k)
        .unwrap_or_else(|_| panic!("{k} not set: run through scripts/bench.sh consumer"))
}

#[tokio::main]
async fn main() {
    let n = arg("--messages", 5000);
    let concurrency = arg("--concurrency", 1);
    let aggregates = arg("--aggregates", 1000);
    let (db, nats, bin) = (env("DATABASE_URL"), env("NATS_URL"), env("RELAY_BIN"));

    // The handler: 200 at once, counting calls.
    let calls = Arc::new(AtomicU64::new(0));
    let counter = calls.clone();
    let app = axum::Router::new().route(
        "/h",
        axum::routing::post(move || {
            let c = counter.clone();
            async move {
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

    let durable = format!("ctp_c{concurrency}");
    let log_path = std::env::temp_dir().join(format!("consumer-bench-{concurrency}.log"));
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(&bin)
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
        .args(["--max-ack-pending", &(concurrency * 4).max(50).to_string()])
        .stderr(Stdio::from(log))
        .spawn()
        .expect("start the consumer");

    let pool = sqlx::PgPool::connect(&db).await.unwrap();
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
        if let Ok(Some(st)) = child.try_wait() {
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
    // the Postgres it measures.
    let start = Instant::now();
    let mut last_report = Instant::now();
    while calls.load(Ordering::Relaxed) < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if last_report.elapsed() > Duration::from_secs(5) {
            last_report = Instant::now();
            eprintln!("  {} handler calls", calls.load(Ordering::Relaxed));
        }
    }
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
    let _ = child.kill();
    let _ = child.wait();
    let handler_calls = calls.load(Ordering::Relaxed);
    println!(
        "consumer --concurrency {concurrency}: {n} messages; handler called {handler_calls} times in {called:.2} s = {:.0} calls/s; {done} recorded processed after {elapsed:.2} s = {:.0} messages/s",
        handler_calls as f64 / called,
        done as f64 / elapsed,
    );
    if handler_calls != n {
        eprintln!("expected exactly {n} handler calls, got {handler_calls}");
        std::process::exit(1);
    }
    std::process::exit(if done == n { 0 } else { 1 });
}
