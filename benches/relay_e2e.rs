//! The load harness (SPEC §8): one invocation measures, side by side,
//!
//! - `raw`:  producers inserting rows into a table nobody relays (Postgres alone);
//! - `cdc`:  the same load into `outbox_events`, relayed by the running
//!   `outbox-relay relay --context bench`, received from NATS;
//! - `poll`: the same load into a polling outbox, relayed by a polling worker
//!   that lives here in the bench (`SELECT … FOR UPDATE SKIP LOCKED LIMIT n`,
//!   publish, `UPDATE … SET published_at`), the design we replace;
//! - `noisy`: as `cdc`, beside a neighbour writing `--noise-mb-s` of
//!   unrelated WAL (another table's bulk writes); says what the slot
//!   retains once the load is done.
//! - `big`:  optionally, one transaction of `--big-txn` rows through the relay,
//!   for its peak memory.
//!
//! Latency is the producer's commit returning → the event received from NATS
//! (HDR histogram). Throughput runs from the first commit to the last receipt.
//! Every event must arrive exactly once. Once a second it prints progress and
//! samples the relay's CPU time, RSS and slot lag. At the end: a summary
//! table, a JSON file and an SVG chart in `--out` (default `target/bench`).
//!
//! ```sh
//! scripts/bench.sh --events 200000 --rate 0 --txn-size 50 --payload 256
//! scripts/bench.sh --events 30000 --rate 2000 --txn-size 10 --payload 256
//! ```
//!
//! Against any deployment: `cargo bench --bench relay_e2e -- <flags>` with
//! DATABASE_URL, NATS_URL, RELAY_PID (for CPU and memory), NATS_PID (nats-server CPU; comma-separated PIDs are summed, the nodes of a cluster) and the relay
//! running with `--context bench`.

mod common;
use common::{cpu_seconds, receiver, rss_mib};

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hdrhistogram::Histogram;
use outbox_relay::wire;
use serde_json::json;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use uuid::Uuid;

#[derive(Debug, Clone)]
struct Args {
    events: u64,
    rate: u64,
    txn_size: u64,
    payload: usize,
    producers: u64,
    arrivals: Arrivals,
    /// Where latency ends: `routed` (a core subscription: the server
    /// routes a message as it stores it) or `stored` (a JetStream push
    /// consumer: delivered once stored, on R3 once replicated).
    stored: bool,
    phases: Vec<String>,
    big_txn: u64,
    noise_mb_s: u64,
    poll_batch: i64,
    poll_interval: Duration,
    slot: String,
    out: String,
}

/// The bench's flags, as the binary takes its own.
#[derive(clap::Parser, Debug)]
struct Flags {
    /// Events per phase.
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// Events per second; 0: flat out.
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Events per transaction.
    #[arg(long, default_value_t = 50)]
    txn_size: u64,
    /// Payload bytes per event.
    #[arg(long, default_value_t = 256)]
    payload: usize,
    /// Producer connections.
    #[arg(long, default_value_t = 2)]
    producers: u64,
    /// When the paced producers commit.
    #[arg(long, value_enum, default_value = "poisson")]
    arrivals: Arrivals,
    /// Where latency ends: a core subscription (`routed`) or a JetStream
    /// push consumer (`stored`).
    #[arg(long, default_value = "routed", value_parser = ["routed", "stored"])]
    receive: String,
    /// The phases to run, in order.
    #[arg(long, value_delimiter = ',', default_value = "raw,cdc,poll", value_parser = ["raw", "cdc", "poll", "raw-emit", "emit", "noisy", "peer", "peer-count"])]
    phases: Vec<String>,
    /// `noisy`: MB/s of unrelated WAL written beside the relay's load (a
    /// noisy neighbour: another table's bulk writes).
    #[arg(long, default_value_t = 70)]
    noise_mb_s: u64,
    /// One transaction of this many rows before the paced load (0: none).
    #[arg(long, default_value_t = 0)]
    big_txn: u64,
    /// The polling worker's batch.
    #[arg(long, default_value_t = 500)]
    poll_batch: i64,
    /// The polling worker's pause when it finds nothing.
    #[arg(long, default_value_t = 10)]
    poll_interval_ms: u64,
    /// The relay's slot.
    #[arg(long, default_value = "outbox_relay_bench")]
    slot: String,
    #[command(flatten)]
    common: common::Common,
}

fn parse_args() -> Args {
    let f = <Flags as clap::Parser>::parse();
    Args {
        events: f.events,
        rate: f.rate,
        txn_size: f.txn_size.max(1),
        payload: f.payload,
        producers: f.producers.max(1),
        arrivals: f.arrivals,
        stored: f.receive == "stored",
        phases: f.phases,
        big_txn: f.big_txn,
        noise_mb_s: f.noise_mb_s,
        poll_batch: f.poll_batch,
        poll_interval: Duration::from_millis(f.poll_interval_ms),
        slot: f.slot,
        out: f.common.out,
    }
}

/// When the paced producers (`--rate`) commit. Each producer commits
/// `rate / producers / txn_size` transactions a second; the choice is how
/// the producers' commits fall relative to each other, which matters to a
/// relay that keeps one atomic batch in flight: a transaction that commits
/// while the one before it awaits its ack waits for that ack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Arrivals {
    /// Independent producers: exponential gaps, each producer on its own
    /// schedule (the usual model of many clients). Commits sometimes coincide.
    Poisson,
    /// Evenly spaced: producer p starts p/N of an interval after the first.
    Even,
    /// Every producer commits at the same instants (the harness's schedule
    /// before `--arrivals`): N transactions together, the worst case for one
    /// batch in flight.
    Lockstep,
}

impl Arrivals {
    fn as_str(self) -> &'static str {
        match self {
            Arrivals::Poisson => "poisson",
            Arrivals::Even => "even",
            Arrivals::Lockstep => "lockstep",
        }
    }
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("{k} not set: run through scripts/bench.sh"))
}

async fn wal_lsn(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8")
        .fetch_one(pool)
        .await
        .expect("pg_current_wal_lsn")
}

async fn slot_lag(pool: &PgPool, slot: &str) -> Option<i64> {
    slot_behind(pool, slot, "confirmed_flush_lsn").await
}

/// How far the current WAL position is past one of the slot's positions.
async fn slot_behind(pool: &PgPool, slot: &str, position: &'static str) -> Option<i64> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), {position})::int8 \
         FROM pg_replication_slots WHERE slot_name = $1"
    )))
    .bind(slot)
    .fetch_optional(pool)
    .await
    .ok()
    .flatten()
}

/// Phases the running relay publishes: rows (`cdc`) or `outbox_emit()`
/// events (`emit`, SPEC §12); or a peer (`peer`, `peer-count`), measured
/// as the relay is.
fn relayed(phase: &str) -> bool {
    phase == "cdc" || phase == "emit" || phase == "noisy" || peer(phase)
}

/// Debezium's embedded Postgres connector (`benches/peers/PeerSink.java`):
/// publishing to JetStream (`peer`) or counting (`peer-count`).
fn peer(phase: &str) -> bool {
    phase == "peer" || phase == "peer-count"
}

/// The slot a phase's publisher reads.
fn slot_of<'a>(a: &'a Args, phase: &str) -> &'a str {
    if peer(phase) {
        PEER_SLOT
    } else {
        &a.slot
    }
}

const PEER_SLOT: &str = "peer_bench";

/// The peer's JVM, started for its phase: its pid once its connector
/// streams (its slot active), its log in `log`.
fn start_peer(phase: &str, db: &str, nats: &str, log: &std::path::Path) -> std::process::Child {
    let cp = env("BENCH_PEER_CP");
    let db = url::Url::parse(db).expect("DATABASE_URL");
    let nats = url::Url::parse(nats.split(',').next().unwrap_or(nats)).expect("NATS_URL");
    let out = std::fs::File::create(log).expect("peer log");
    std::process::Command::new("java")
        .args(["-cp", &cp, "PeerSink"])
        .arg(if phase == "peer" {
            "jetstream"
        } else {
            "count"
        })
        .arg(db.host_str().unwrap_or("127.0.0.1"))
        .arg(db.port().unwrap_or(5432).to_string())
        .arg(db.username())
        .arg(db.password().unwrap_or(""))
        .arg(db.path().trim_start_matches('/'))
        .arg(nats.host_str().unwrap_or("127.0.0.1"))
        .arg(nats.port().unwrap_or(4222).to_string())
        .stdout(out.try_clone().expect("peer log"))
        .stderr(out)
        .spawn()
        .expect("java (scripts/bench.sh peers sets BENCH_PEER_CP)")
}

/// Stop `pid` (SIGTERM) and wait until it is gone.
async fn stop_pid(pid: &str) {
    let _ = std::process::Command::new("kill").arg(pid).status();
    for _ in 0..600 {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Which table a phase's producers write.
fn table(phase: &str) -> &'static str {
    match phase {
        "raw" => "bench_raw",
        "poll" => "bench_poll",
        "peer" | "peer-count" => "bench_peer",
        _ => "outbox_events",
    }
}

async fn setup(pool: &PgPool, js: &async_nats::jetstream::Context, raw_emit: bool, peers: bool) {
    if peers {
        for sql in [
            "CREATE TABLE IF NOT EXISTS bench_peer (LIKE outbox_events INCLUDING ALL)",
            "TRUNCATE bench_peer",
            "DROP PUBLICATION IF EXISTS peer_bench",
            "CREATE PUBLICATION peer_bench FOR TABLE bench_peer WITH (publish = 'insert')",
        ] {
            sqlx::query(sql).execute(pool).await.expect(sql);
        }
        let _ = js.delete_stream("PEERBENCH").await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: "PEERBENCH".into(),
            subjects: vec!["peerbench.>".into()],
            ..Default::default()
        })
        .await
        .expect("create stream PEERBENCH");
    }
    for sql in [
        "CREATE TABLE IF NOT EXISTS bench_raw (LIKE outbox_events INCLUDING ALL)",
        "CREATE TABLE IF NOT EXISTS bench_poll (LIKE outbox_events INCLUDING ALL, seq bigserial)",
        "CREATE INDEX IF NOT EXISTS bench_poll_unpublished ON bench_poll (seq) WHERE published_at IS NULL",
        "TRUNCATE bench_raw, bench_poll",
    ] {
        sqlx::query(sql).execute(pool).await.expect(sql);
    }
    if !raw_emit {
        return;
    }
    // `raw-emit`: outbox_emit() itself, under another name and message
    // prefix, so the relay skips what it writes: Postgres alone.
    let def: String = sqlx::query_scalar("SELECT pg_get_functiondef('outbox_emit'::regproc)")
        .fetch_one(pool)
        .await
        .expect("outbox_emit() is installed (outbox-relay migrate)");
    let raw = def
        .replace("outbox_emit", "bench_emit_raw")
        .replace(outbox_relay::wire::EMIT_PREFIX, "bench-raw-emit");
    sqlx::query(sqlx::AssertSqlSafe(raw))
        .execute(pool)
        .await
        .expect("create bench_emit_raw()");
    let _ = js.delete_stream("BENCHPOLL").await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: "BENCHPOLL".into(),
        subjects: vec!["benchpoll.>".into()],
        ..Default::default()
    })
    .await
    .expect("create stream BENCHPOLL");
}

/// Producers: `events` rows in transactions of `txn_size`, flat out or at
/// `rate` in total. Returns each id's commit-returned instant.
async fn produce(
    pool: PgPool,
    a: Args,
    phase: String,
    committed: Arc<AtomicU64>,
) -> HashMap<Uuid, Instant> {
    let per_producer = a.events / a.producers;
    let sql = match phase.as_str() {
        // One call per event, in the order of the arrays.
        "emit" | "raw-emit" => format!(
            "SELECT {}(aggregate_type => t.at, aggregate_id => t.ai, event_type => t.et, payload => t.p, id => t.id) \
             FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[]) WITH ORDINALITY AS t(id, at, ai, et, p, n) ORDER BY t.n",
            if phase == "emit" { "outbox_emit" } else { "bench_emit_raw" }
        ),
        _ => format!(
            "INSERT INTO {} (id, aggregate_type, aggregate_id, event_type, payload) \
             SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[])",
            table(&phase)
        ),
    };
    let padding = "x".repeat(a.payload.saturating_sub(40));
    let mut tasks = Vec::new();
    for p in 0..a.producers {
        let (pool, sql, padding, committed) = (
            pool.clone(),
            sql.clone(),
            padding.clone(),
            committed.clone(),
        );
        let txn_size = a.txn_size;
        let txns = per_producer / txn_size;
        let interval = (a.rate > 0)
            .then(|| Duration::from_secs_f64(txn_size as f64 * a.producers as f64 / a.rate as f64));
        let arrivals = a.arrivals;
        let producers = a.producers;
        tasks.push(tokio::spawn(async move {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(p);
            // Absolute times, so the rate holds whatever each insert takes.
            let mut next = tokio::time::Instant::now();
            if let (Some(i), Arrivals::Even) = (interval, arrivals) {
                next += i.mul_f64(p as f64 / producers as f64);
            }
            let mut out = HashMap::with_capacity((txns * txn_size) as usize);
            for t in 0..txns {
                if let Some(i) = interval {
                    let gap = match arrivals {
                        // Inverse transform: -ln(U) is exponential with mean 1.
                        Arrivals::Poisson => i.mul_f64(-(1.0 - rng.gen::<f64>()).ln()),
                        Arrivals::Even | Arrivals::Lockstep => i,
                    };
                    if t > 0 || arrivals == Arrivals::Poisson {
                        next += gap;
                    }
                    tokio::time::sleep_until(next).await;
                }
                let ids: Vec<Uuid> = (0..txn_size).map(|_| Uuid::new_v4()).collect();
                let aggs: Vec<String> = (0..txn_size)
                    .map(|i| format!("{p}-{}", (t + i) % 100))
                    .collect();
                let types = vec!["tick"; txn_size as usize];
                let payloads: Vec<serde_json::Value> = (0..txn_size)
                    .map(|i| json!({ "p": p, "s": t * txn_size + i, "pad": padding }))
                    .collect();
                sqlx::query(sqlx::AssertSqlSafe(sql.as_str()))
                    .bind(&ids)
                    .bind(vec!["load"; txn_size as usize])
                    .bind(&aggs)
                    .bind(&types)
                    .bind(&payloads)
                    .execute(&pool)
                    .await
                    .expect("insert");
                let now = Instant::now();
                committed.fetch_add(txn_size, Ordering::Relaxed);
                out.extend(ids.into_iter().map(|id| (id, now)));
            }
            out
        }));
    }
    let mut all = HashMap::new();
    for t in tasks {
        all.extend(t.await.expect("producer"));
    }
    all
}

/// The baseline we replace: poll, lock, publish, mark, commit; sleep when empty.
async fn polling_relay(
    pool: PgPool,
    js: async_nats::jetstream::Context,
    batch: i64,
    interval: Duration,
    stop: tokio_util::sync::CancellationToken,
) {
    while !stop.is_cancelled() {
        let mut tx = pool.begin().await.expect("poll begin");
        let rows: Vec<(Uuid, String, serde_json::Value)> = sqlx::query_as(
            "SELECT id, event_type, payload FROM bench_poll WHERE published_at IS NULL \
             ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED",
        )
        .bind(batch)
        .fetch_all(&mut *tx)
        .await
        .expect("poll select");
        if rows.is_empty() {
            tx.rollback().await.ok();
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(interval) => continue,
            }
        }
        // Pipelined publishes, then every ack, then mark them.
        let mut acks = Vec::with_capacity(rows.len());
        for (id, event_type, payload) in &rows {
            let mut h = async_nats::HeaderMap::new();
            h.insert(wire::MSG_ID, id.to_string().as_str());
            let body = serde_json::to_vec(payload).expect("payload");
            acks.push(
                js.publish_with_headers(format!("benchpoll.{event_type}"), h, body.into())
                    .await
                    .expect("poll publish"),
            );
        }
        for ack in acks {
            ack.await.expect("poll ack");
        }
        let ids: Vec<Uuid> = rows.iter().map(|r| r.0).collect();
        sqlx::query("UPDATE bench_poll SET published_at = now() WHERE id = ANY($1)")
            .bind(&ids)
            .execute(&mut *tx)
            .await
            .expect("poll mark");
        tx.commit().await.expect("poll commit");
    }
}

/// One second of a phase, for progress and the chart.
#[derive(Debug, Clone, serde::Serialize)]
struct Sample {
    t: f64,
    received_per_s: f64,
    slot_lag_bytes: Option<i64>,
    relay_cpu: Option<f64>,
    relay_rss_mib: Option<f64>,
}

#[derive(Debug, Clone, serde::Serialize)]
struct PhaseResult {
    phase: String,
    events: u64,
    received: u64,
    duplicates: u64,
    missing: u64,
    seconds: f64,
    events_per_s: f64,
    latency_ms: Option<serde_json::Value>,
    wal_bytes_per_event: f64,
    relay_cpu_us_per_event: Option<f64>,
    /// nats-server's CPU per event of the phase (NATS_PID): it stores and
    /// acks every publish, so it is the relay's other cost.
    nats_cpu_us_per_event: Option<f64>,
    relay_peak_rss_mib: Option<f64>,
    /// Mean events per atomic batch (`--publish-mode batch`).
    events_per_batch: Option<f64>,
    samples: Vec<Sample>,
    /// (receive second, p50 ms, p99 ms)
    latency_by_second: Vec<(f64, f64, f64)>,
    /// `noisy`: the unrelated WAL written meanwhile, and what the slot
    /// still retained once the load was done.
    #[serde(skip_serializing_if = "Option::is_none")]
    noise: Option<serde_json::Value>,
}

async fn run_phase(
    a: &Args,
    phase: &str,
    pool: &PgPool,
    client: &async_nats::Client,
    relay_pid: Option<&str>,
    nats_pid: Option<&str>,
) -> PhaseResult {
    let mut subject = match phase {
        "cdc" | "emit" | "noisy" => Some("bench.>".to_owned()),
        "poll" => Some("benchpoll.>".to_owned()),
        "peer" => Some("peerbench.>".to_owned()),
        "peer-count" => Some("peercount.ids".to_owned()),
        _ => None,
    };
    // `--receive stored`: the relay's phases end at a push consumer's
    // delivery instead, which the server makes once the message is stored.
    let consumer = if a.stored && relayed(phase) && !peer(phase) {
        let deliver = format!("_BENCH_STORED.{}", uuid::Uuid::new_v4().simple());
        let stream = async_nats::jetstream::new(client.clone())
            .get_stream(wire::stream_name("bench"))
            .await
            .expect("the relay's stream");
        let name = format!("bench_stored_{}", uuid::Uuid::new_v4().simple());
        stream
            .create_consumer(async_nats::jetstream::consumer::push::Config {
                durable_name: Some(name.clone()),
                deliver_subject: deliver.clone(),
                deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::New,
                ack_policy: async_nats::jetstream::consumer::AckPolicy::None,
                filter_subject: "bench.>".into(),
                ..Default::default()
            })
            .await
            .expect("a push consumer");
        subject = Some(deliver);
        Some((stream, name))
    } else {
        None
    };
    let received_at: receiver::Received = Arc::new(Mutex::new(Vec::with_capacity(
        (a.events / a.producers / a.txn_size * a.txn_size * a.producers) as usize,
    )));
    let receiver = subject
        .as_deref()
        .map(|s| receiver::Receiver::start(&env("NATS_URL"), s, received_at.clone()));
    let stop_poll = tokio_util::sync::CancellationToken::new();
    let poller = (phase == "poll").then(|| {
        tokio::spawn(polling_relay(
            pool.clone(),
            async_nats::jetstream::new(client.clone()),
            a.poll_batch,
            a.poll_interval,
            stop_poll.clone(),
        ))
    });

    let expected = a.events / a.producers / a.txn_size * a.txn_size * a.producers;
    let stop_noise = tokio_util::sync::CancellationToken::new();
    let noise = (phase == "noisy").then(|| {
        tokio::spawn(noisy_neighbour(
            pool.clone(),
            a.noise_mb_s,
            stop_noise.clone(),
        ))
    });
    let wal0 = wal_lsn(pool).await;
    let cpu0 = relay_pid.map(cpu_seconds);
    let nats_cpu0 = nats_pid.map(cpu_seconds);
    let batches0 = committed_batches();
    let committed = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let producers = tokio::spawn(produce(
        pool.clone(),
        a.clone(),
        phase.to_owned(),
        committed.clone(),
    ));

    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.tick().await;
    let mut last_count = 0u64;
    let mut last_cpu = cpu0;
    let mut last_receipt = start;
    let deadline = start + Duration::from_secs(600);
    let mut producers = Some(producers);
    let mut commits = HashMap::new();
    loop {
        let received = received_at.lock().unwrap().len() as u64;
        let done_receiving = subject.is_none() || received >= expected;
        if done_receiving && producers.is_none() {
            break;
        }
        if Instant::now() > deadline {
            eprintln!("[{phase}] stopped at the 600 s limit");
            break;
        }
        tokio::select! {
            // The receiver thread records arrivals; this only looks.
            _ = tokio::time::sleep(Duration::from_millis(20)), if subject.is_some() && !done_receiving => {}
            done = async { producers.as_mut()?.await.ok() }, if producers.is_some() => {
                commits = done.expect("producers");
                producers = None;
                if subject.is_none() {
                    last_receipt = Instant::now();
                }
            }
            _ = tick.tick() => {
                let count = if subject.is_some() { received } else { committed.load(Ordering::Relaxed) };
                let cpu = relay_pid.map(cpu_seconds);
                let relay_cpu = match (cpu, last_cpu) { (Some(c), Some(l)) => Some(c - l), _ => None };
                last_cpu = cpu;
                let lag = if relayed(phase) { slot_lag(pool, slot_of(a, phase)).await } else { None };
                let s = Sample {
                    t: start.elapsed().as_secs_f64(),
                    received_per_s: (count - last_count) as f64,
                    slot_lag_bytes: lag,
                    relay_cpu,
                    relay_rss_mib: relay_pid.map(|p| rss_mib(p).0),
                };
                last_count = count;
                eprintln!(
                    "[{phase}] {:>5.1}s  {}/{expected} {}  {:>7.0} ev/s{}{}",
                    s.t,
                    count,
                    if subject.is_some() { "received" } else { "inserted" },
                    s.received_per_s,
                    lag.map(|l| format!("  slot lag {:.1} MiB", l as f64 / 1048576.0)).unwrap_or_default(),
                    relay_cpu.filter(|_| relayed(phase)).map(|c| format!("  relay CPU {:.0}%", c * 100.0)).unwrap_or_default(),
                );
                samples.push(s);
            }
        }
    }
    if let Some(r) = receiver {
        if let Some(&(_, last)) = received_at.lock().unwrap().last() {
            last_receipt = last;
        }
        // Late duplicates would show up here.
        tokio::time::sleep(Duration::from_millis(500)).await;
        r.stop();
    }
    if let Some((stream, name)) = consumer {
        let _ = stream.delete_consumer(&name).await;
    }
    stop_poll.cancel();
    if let Some(p) = poller {
        let _ = p.await;
    }
    stop_noise.cancel();
    let noise = match noise {
        Some(n) => {
            let written = n.await.unwrap_or(0);
            // Idle again: the slot moves past the neighbour's WAL once the
            // relay confirms past a running-transactions record (the
            // background writer logs one every 15 s while WAL moves).
            let quiet = Instant::now();
            let mut retained = slot_retained(pool, &a.slot).await;
            while retained.is_some_and(|b| b > 16 * 1_048_576)
                && quiet.elapsed() < Duration::from_secs(60)
            {
                tokio::time::sleep(Duration::from_secs(1)).await;
                retained = slot_retained(pool, &a.slot).await;
            }
            let seconds = last_receipt.duration_since(start).as_secs_f64().max(1e-9);
            Some(json!({
                "noise_mb_per_s": written as f64 / 1048576.0 / seconds,
                "slot_retained_after_mib": retained.map(|b| b as f64 / 1048576.0),
                "seconds_to_release": quiet.elapsed().as_secs_f64(),
            }))
        }
        None => None,
    };
    let wal1 = wal_lsn(pool).await;
    let elapsed = last_receipt.duration_since(start).as_secs_f64();
    let relay_cpu = match (relay_pid.map(cpu_seconds), cpu0) {
        (Some(c), Some(c0)) if relayed(phase) => Some((c - c0) * 1e6 / expected.max(1) as f64),
        _ => None,
    };
    let events_per_batch = match (committed_batches(), batches0) {
        (Some(b), Some(b0)) if relayed(phase) && b > b0 => Some(expected as f64 / (b - b0)),
        _ => None,
    };
    let nats_cpu = match (nats_pid.map(cpu_seconds), nats_cpu0) {
        (Some(c), Some(c0)) => Some((c - c0) * 1e6 / expected.max(1) as f64),
        _ => None,
    };

    let received = received_at.lock().unwrap().clone();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).expect("histogram");
    let mut by_second: HashMap<u64, Histogram<u64>> = HashMap::new();
    let mut seen = std::collections::HashSet::with_capacity(received.len());
    let mut duplicates = 0;
    for (id, at) in &received {
        if !seen.insert(*id) {
            duplicates += 1;
            continue;
        }
        if let Some(c) = commits.get(id) {
            // A relay can deliver before the producer's commit call returns.
            let us = at.saturating_duration_since(*c).as_micros().max(1) as u64;
            hist.record(us.min(600_000_000)).ok();
            let sec = at.duration_since(start).as_secs();
            by_second
                .entry(sec)
                .or_insert_with(|| {
                    Histogram::new_with_bounds(1, 600_000_000, 2).expect("histogram")
                })
                .record(us.min(600_000_000))
                .ok();
        }
    }
    let missing = if subject.is_some() {
        commits.keys().filter(|id| !seen.contains(*id)).count() as u64
    } else {
        0
    };
    let mut latency_by_second: Vec<(f64, f64, f64)> = by_second
        .into_iter()
        .map(|(s, h)| {
            (
                s as f64 + 0.5,
                h.value_at_quantile(0.5) as f64 / 1000.0,
                h.value_at_quantile(0.99) as f64 / 1000.0,
            )
        })
        .collect();
    latency_by_second.sort_by(|a, b| a.0.total_cmp(&b.0));
    let q = |p: f64| hist.value_at_quantile(p) as f64 / 1000.0;
    let got = if subject.is_some() {
        seen.len() as u64
    } else {
        commits.len() as u64
    };
    PhaseResult {
        phase: phase.to_owned(),
        events: expected,
        received: got,
        duplicates,
        missing,
        seconds: elapsed,
        events_per_s: got as f64 / elapsed.max(1e-9),
        latency_ms: (subject.is_some() && !hist.is_empty()).then(|| {
            json!({"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "p999": q(0.999), "max": hist.max() as f64 / 1000.0})
        }),
        wal_bytes_per_event: (wal1 - wal0) as f64 / expected.max(1) as f64,
        relay_cpu_us_per_event: relay_cpu,
        nats_cpu_us_per_event: nats_cpu,
        relay_peak_rss_mib: relay_pid.filter(|_| relayed(phase)).map(|p| rss_mib(p).1),
        events_per_batch,
        samples,
        latency_by_second,
        noise,
    }
}

/// Unrelated WAL at about `mb_s` MB/s until `stop`: 100 KiB values of a
/// table no publication holds, stored uncompressed (so each is WAL as
/// large), emptied now and then. Returns the bytes written.
async fn noisy_neighbour(
    pool: PgPool,
    mb_s: u64,
    stop: tokio_util::sync::CancellationToken,
) -> u64 {
    const VALUE: i64 = 100 * 1024;
    for sql in [
        "CREATE TABLE IF NOT EXISTS bench_noise (pad text)",
        "ALTER TABLE bench_noise ALTER COLUMN pad SET STORAGE EXTERNAL",
        "TRUNCATE bench_noise",
    ] {
        sqlx::query(sql).execute(&pool).await.expect(sql);
    }
    let per_tick = (mb_s * 1_048_576 / 10 / VALUE as u64).max(1) as i64;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let (mut written, mut ticks) = (0u64, 0u64);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return written,
            _ = tick.tick() => {}
        }
        ticks += 1;
        // Stored EXTERNAL: no compression shrinks it.
        let r = sqlx::query(
            "INSERT INTO bench_noise SELECT repeat('x', $2::int) FROM generate_series(1, $1)",
        )
        .bind(per_tick)
        .bind(VALUE)
        .execute(&pool)
        .await;
        if r.is_ok() {
            written += per_tick as u64 * VALUE as u64;
        }
        if ticks % 50 == 0 {
            let _ = sqlx::query("TRUNCATE bench_noise").execute(&pool).await;
        }
    }
}

/// What the slot keeps: the WAL from its restart point on.
async fn slot_retained(pool: &PgPool, slot: &str) -> Option<i64> {
    slot_behind(pool, slot, "restart_lsn").await
}

/// One transaction of `rows` rows of about `payload` bytes each through
/// the relay: whether every row came once, contiguous and in insert order,
/// how fast, and the relay's peak RSS.
async fn big_txn(
    pool: &PgPool,
    client: &async_nats::Client,
    rows: u64,
    payload: usize,
    relay_pid: &str,
) -> serde_json::Value {
    let mut sub = client.subscribe("bench.>").await.expect("subscribe");
    client.flush().await.expect("flush");
    let start = Instant::now();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload) \
         SELECT gen_random_uuid(), 'load', 'big-' || (g % 100), 'tick', \
                jsonb_build_object('g', g, 'pad', repeat('x', $2)) \
         FROM generate_series(1, $1) g",
    )
    .bind(rows as i64)
    .bind(payload.saturating_sub(24) as i32)
    .execute(pool)
    .await
    .expect("big insert");
    let committed = start.elapsed().as_secs_f64();
    let (mut got, mut bytes, mut in_order, mut next) = (0u64, 0u64, true, 1i64);
    let mut last_report = Instant::now();
    while got < rows {
        match tokio::time::timeout(Duration::from_secs(60), sub.next()).await {
            Ok(Some(m)) => {
                got += 1;
                bytes += m.payload.len() as u64;
                // Insert order is `g`; a repeat or a gap breaks the run.
                let g = serde_json::from_slice::<serde_json::Value>(&m.payload)
                    .ok()
                    .and_then(|v| v["g"].as_i64());
                in_order &= g == Some(next);
                next += 1;
            }
            _ => break,
        }
        if last_report.elapsed() > Duration::from_secs(1) {
            last_report = Instant::now();
            eprintln!(
                "[big] {:>5.1}s  {got}/{rows} received  relay RSS {:.1} MiB",
                start.elapsed().as_secs_f64(),
                rss_mib(relay_pid).0
            );
        }
    }
    // Nothing more may come: a repeat after the last would be one too many.
    let extra = match tokio::time::timeout(Duration::from_secs(2), sub.next()).await {
        Ok(Some(_)) => 1,
        _ => 0,
    };
    let total = start.elapsed().as_secs_f64();
    json!({
        "rows": rows,
        "payload_bytes": payload,
        "received": got,
        "received_mib": bytes as f64 / 1048576.0,
        "once_contiguous_in_insert_order": in_order && got == rows && extra == 0,
        "insert_seconds": committed,
        "seconds": total,
        "rows_per_second_after_commit": got as f64 / (total - committed).max(1e-9),
        "relay_peak_rss_mib": rss_mib(relay_pid).1,
    })
}

fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

/// `outbox_relay_batches_total{result="committed"}` from the relay's
/// `/metrics` (`RELAY_METRICS`, host:port), if it answers.
fn committed_batches() -> Option<f64> {
    use std::io::{Read, Write};
    let addr = std::env::var("RELAY_METRICS").ok()?;
    let mut conn = std::net::TcpStream::connect(&addr).ok()?;
    conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        conn,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    conn.read_to_string(&mut text).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("outbox_relay_batches_total{result=\"committed\"} "))
        .and_then(|v| v.trim().parse().ok())
}

/// Which NATS `scripts/bench.sh` started (`BENCH_NATS_CLUSTER`).
fn nats_setup() -> &'static str {
    if std::env::var("BENCH_NATS_CLUSTER").is_ok_and(|v| v == "1") {
        "3-node NATS cluster, R3 stream (nats-server CPU: the three nodes summed)"
    } else {
        "one nats-server, R1 stream"
    }
}

/// The relay's `--publish-mode`, as `scripts/bench.sh` started it.
fn publish_mode() -> String {
    std::env::var("OUTBOX_PUBLISH_MODE").unwrap_or_else(|_| "auto".into())
}

fn summary(a: &Args, results: &[PhaseResult]) -> String {
    let mut s = String::new();
    let raw = results
        .iter()
        .find(|r| r.phase == "raw")
        .map(|r| r.events_per_s);
    let raw_wal = results
        .iter()
        .find(|r| r.phase == "raw")
        .map(|r| r.wal_bytes_per_event);
    let _ = writeln!(
        s,
        "\n{} events, txn {}, payload {} B, {} producers, rate {}, publish mode {}, {}",
        a.events,
        a.txn_size,
        a.payload,
        a.producers,
        if a.rate == 0 {
            "flat out".to_owned()
        } else {
            format!("{}/s ({} arrivals)", a.rate, a.arrivals.as_str())
        },
        publish_mode(),
        nats_setup()
    );
    let _ = writeln!(
        s,
        "| phase | events/s | vs raw | p50 ms | p99 ms | p99.9 ms | max ms | WAL B/event | extra WAL B/event | publisher CPU µs/event | nats-server CPU µs/event | publisher peak RSS MiB | events/batch | once |"
    );
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for r in results {
        let l = |k: &str| r.latency_ms.as_ref().and_then(|v| v[k].as_f64());
        let _ = writeln!(
            s,
            "| {} | {:.0} | {} | {} | {} | {} | {} | {:.0} | {} | {} | {} | {} | {} | {} |",
            r.phase,
            r.events_per_s,
            raw.map_or("-".into(), |raw| format!("{:.2}", r.events_per_s / raw)),
            fmt_opt(l("p50"), 2),
            fmt_opt(l("p99"), 2),
            fmt_opt(l("p999"), 2),
            fmt_opt(l("max"), 1),
            r.wal_bytes_per_event,
            raw_wal.map_or("-".into(), |w| format!("{:.0}", r.wal_bytes_per_event - w)),
            fmt_opt(r.relay_cpu_us_per_event, 1),
            fmt_opt(r.nats_cpu_us_per_event, 1),
            fmt_opt(r.relay_peak_rss_mib, 1),
            fmt_opt(r.events_per_batch, 0),
            if r.phase.starts_with("raw") {
                "-".to_owned()
            } else if r.duplicates == 0 && r.missing == 0 && r.received == r.events {
                "yes".to_owned()
            } else {
                format!("NO: {} missing, {} duplicates", r.missing, r.duplicates)
            }
        );
    }
    s
}

/// A chart line: name, colour, dashed, points.
type Line<'a> = (String, &'a str, bool, Vec<(f64, f64)>);

/// Throughput and latency over time, CDC against polling, as one SVG.
fn chart(results: &[PhaseResult], title: &str) -> String {
    let (w, h, pad) = (900.0, 260.0, 60.0);
    let colors = [
        ("cdc", "#1f77b4"),
        ("poll", "#d62728"),
        ("raw", "#7f7f7f"),
        ("emit", "#2ca02c"),
        ("raw-emit", "#bcbd22"),
        ("noisy", "#9467bd"),
    ];
    let color = |p: &str| colors.iter().find(|c| c.0 == p).map_or("#000", |c| c.1);
    let t_max = results
        .iter()
        .flat_map(|r| r.samples.iter().map(|s| s.t))
        .fold(1.0, f64::max);
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{pad}" y="20" font-size="14">{title}</text>
"#,
        2.0 * h + 90.0
    );
    // Panel 1: events/s; panel 2: latency p50 (dashed) and p99, log scale.
    for (panel, y0) in [(0, 45.0), (1, 75.0 + h)] {
        let plot_h = h - 40.0;
        let (label, series): (&str, Vec<Line>) = if panel == 0 {
            (
                "events/s",
                results
                    .iter()
                    .map(|r| {
                        (
                            r.phase.clone(),
                            color(&r.phase),
                            false,
                            r.samples.iter().map(|s| (s.t, s.received_per_s)).collect(),
                        )
                    })
                    .collect(),
            )
        } else {
            let mut v = Vec::new();
            for r in results.iter().filter(|r| !r.latency_by_second.is_empty()) {
                v.push((
                    format!("{} p50", r.phase),
                    color(&r.phase),
                    true,
                    r.latency_by_second.iter().map(|x| (x.0, x.1)).collect(),
                ));
                v.push((
                    format!("{} p99", r.phase),
                    color(&r.phase),
                    false,
                    r.latency_by_second.iter().map(|x| (x.0, x.2)).collect(),
                ));
            }
            ("latency ms (log)", v)
        };
        let log = panel == 1;
        let ys = series.iter().flat_map(|s| s.3.iter().map(|p| p.1));
        let y_max = ys.clone().fold(1.0, f64::max);
        let y_min = if log {
            ys.fold(f64::MAX, f64::min).max(0.01)
        } else {
            0.0
        };
        let (lo, hi) = if log {
            (
                y_min.log10().floor(),
                y_max.log10().ceil().max(y_min.log10().floor() + 1.0),
            )
        } else {
            (0.0, y_max * 1.1)
        };
        let x = |t: f64| pad + (w - 2.0 * pad) * t / t_max;
        let y = |v: f64| {
            let f = if log {
                (v.max(0.01).log10() - lo) / (hi - lo)
            } else {
                v / hi
            };
            y0 + plot_h - plot_h * f.clamp(0.0, 1.0)
        };
        let _ = writeln!(
            svg,
            r##"<rect x="{pad}" y="{y0}" width="{}" height="{plot_h}" fill="none" stroke="#999"/><text x="{pad}" y="{}" >{label}</text>"##,
            w - 2.0 * pad,
            y0 - 5.0
        );
        let ticks: Vec<f64> = if log {
            (lo as i32..=hi as i32).map(|e| 10f64.powi(e)).collect()
        } else {
            (0..=4).map(|i| hi * i as f64 / 4.0).collect()
        };
        for t in ticks {
            let _ = writeln!(
                svg,
                r##"<line x1="{pad}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                w - pad,
                pad - 4.0,
                y(t) + 4.0,
                if t >= 1000.0 {
                    format!("{:.1}k", t / 1000.0)
                } else if t >= 1.0 {
                    format!("{t:.0}")
                } else {
                    format!("{t}")
                },
                yy = y(t)
            );
        }
        for (i, (name, c, dashed, pts)) in series.iter().enumerate() {
            if pts.is_empty() {
                continue;
            }
            let path: Vec<String> = pts
                .iter()
                .map(|(t, v)| format!("{:.1},{:.1}", x(*t), y(*v)))
                .collect();
            let _ = writeln!(
                svg,
                r#"<polyline fill="none" stroke="{c}" stroke-width="1.5" {} points="{}"/><text x="{}" y="{}" fill="{c}">{name}</text>"#,
                if *dashed {
                    r#"stroke-dasharray="4 3""#
                } else {
                    ""
                },
                path.join(" "),
                w - pad + 5.0,
                y0 + 14.0 * (i as f64 + 1.0)
            );
        }
        for i in 0..=5 {
            let t = t_max * i as f64 / 5.0;
            let _ = writeln!(
                svg,
                r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
                x(t),
                y0 + plot_h + 14.0,
                if t_max < 20.0 {
                    format!("{t:.1}")
                } else {
                    format!("{t:.0}")
                }
            );
        }
        let _ = writeln!(
            svg,
            r#"<text x="{}" y="{}" text-anchor="middle">seconds since the phase started</text>"#,
            w / 2.0,
            y0 + plot_h + 28.0
        );
    }
    svg.push_str("</svg>\n");
    svg
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = parse_args();
    let db = env("DATABASE_URL");
    let nats = env("NATS_URL");
    let relay_pid = std::env::var("RELAY_PID").ok();
    let nats_pid = std::env::var("NATS_PID").ok();
    let pool = PgPoolOptions::new()
        .max_connections(a.producers as u32 + 2)
        .connect(&db)
        .await
        .expect("connect to DATABASE_URL");
    let client = async_nats::connect(&nats)
        .await
        .expect("connect to NATS_URL");
    setup(
        &pool,
        &async_nats::jetstream::new(client.clone()),
        a.phases.iter().any(|p| p == "raw-emit"),
        a.phases.iter().any(|p| peer(p)),
    )
    .await;

    let mut results = Vec::new();
    let mut relay_running = true;
    for phase in a.phases.clone() {
        eprintln!("== phase {phase}");
        if !peer(&phase) {
            let r = run_phase(
                &a,
                &phase,
                &pool,
                &client,
                relay_pid.as_deref(),
                nats_pid.as_deref(),
            )
            .await;
            results.push(r);
            continue;
        }
        // One slot decodes the WAL, as in the relay's phases: the relay's
        // walsender would decode the peer's rows too (and drop them).
        if let (Some(pid), true) = (&relay_pid, relay_running) {
            stop_pid(pid).await;
            relay_running = false;
        }
        std::fs::create_dir_all(&a.out).expect("create --out");
        let log = std::path::PathBuf::from(&a.out).join(format!("{phase}.log"));
        let mut jvm = start_peer(&phase, &db, &nats, &log);
        let pid = jvm.id().to_string();
        let started = Instant::now();
        loop {
            let active: Option<bool> =
                sqlx::query_scalar("SELECT active FROM pg_replication_slots WHERE slot_name = $1")
                    .bind(PEER_SLOT)
                    .fetch_optional(&pool)
                    .await
                    .expect("pg_replication_slots");
            let ready = std::fs::read_to_string(&log)
                .unwrap_or_default()
                .contains("ready");
            if active == Some(true) && ready {
                break;
            }
            if let Ok(Some(st)) = jvm.try_wait() {
                panic!("the peer exited ({st}): see {}", log.display());
            }
            assert!(
                started.elapsed() < Duration::from_secs(180),
                "the peer did not start: see {}",
                log.display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!(
            "[{phase}] Debezium streaming after {:.1} s",
            started.elapsed().as_secs_f64()
        );
        // The JVM compiles its hot paths in the first seconds of load: a
        // warm-up, not measured, as a service long up would be.
        let mut warm = a.clone();
        (warm.events, warm.rate) = (20_000, 0);
        eprintln!("[{phase}] warm-up: 20000 events flat out, not measured");
        run_phase(
            &warm,
            &phase,
            &pool,
            &client,
            Some(&pid),
            nats_pid.as_deref(),
        )
        .await;
        let r = run_phase(&a, &phase, &pool, &client, Some(&pid), nats_pid.as_deref()).await;
        results.push(r);
        stop_pid(&pid).await;
        let _ = jvm.wait();
        sqlx::query("SELECT pg_drop_replication_slot($1)")
            .bind(PEER_SLOT)
            .execute(&pool)
            .await
            .expect("drop the peer's slot");
    }
    let big = match (&relay_pid, a.big_txn) {
        (Some(pid), n) if n > 0 => {
            eprintln!("== phase big: one transaction of {n} rows");
            Some(big_txn(&pool, &client, n, a.payload, pid).await)
        }
        _ => None,
    };

    let table = summary(&a, &results);
    println!("{table}");
    for r in &results {
        if let Some(n) = &r.noise {
            println!(
                "noisy neighbour: {:.1} MB/s of unrelated WAL beside the load; the slot retained {:.1} MiB {:.0} s after it was done",
                n["noise_mb_per_s"].as_f64().unwrap_or(0.0),
                n["slot_retained_after_mib"].as_f64().unwrap_or(-1.0),
                n["seconds_to_release"].as_f64().unwrap_or(0.0)
            );
        }
    }
    if let Some(b) = &big {
        println!(
            "big transaction: {} rows, {}/{} received ({:.0} MiB) in {:.1} s (insert {:.1} s, then {:.0} rows/s), once, contiguous and in insert order: {}, relay peak RSS {:.1} MiB",
            b["rows"],
            b["received"],
            b["rows"],
            b["received_mib"].as_f64().unwrap_or(0.0),
            b["seconds"].as_f64().unwrap_or(0.0),
            b["insert_seconds"].as_f64().unwrap_or(0.0),
            b["rows_per_second_after_commit"].as_f64().unwrap_or(0.0),
            b["once_contiguous_in_insert_order"],
            b["relay_peak_rss_mib"].as_f64().unwrap_or(0.0)
        );
    }

    std::fs::create_dir_all(&a.out).expect("create --out");
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let base = format!(
        "{}/relay-{}-{stamp}",
        a.out,
        if a.rate == 0 {
            "flat".to_owned()
        } else {
            format!("rate{}", a.rate)
        }
    );
    let report = json!({
        "unix_time": stamp,
        "args": {
            "events": a.events, "rate": a.rate, "txn_size": a.txn_size, "payload": a.payload,
            "producers": a.producers, "poll_batch": a.poll_batch,
            "arrivals": (a.rate > 0).then_some(a.arrivals.as_str()),
            "receive": if a.stored { "stored" } else { "routed" },
            "publish_mode": publish_mode(),
            "nats": nats_setup(),
            "schemas": std::env::var("OUTBOX_SCHEMAS").ok(),
            "poll_interval_ms": a.poll_interval.as_millis() as u64,
        },
        "phases": results,
        "big_txn": big,
    });
    std::fs::write(
        format!("{base}.json"),
        serde_json::to_string_pretty(&report).expect("json"),
    )
    .expect("write JSON");
    let title = format!(
        "outbox-relay: {} events, txn {}, {} B, {}",
        a.events,
        a.txn_size,
        a.payload,
        if a.rate == 0 {
            "flat out".to_owned()
        } else {
            format!("{} ev/s", a.rate)
        }
    );
    std::fs::write(format!("{base}.svg"), chart(&results, &title)).expect("write SVG");
    println!("wrote {base}.json and {base}.svg");

    let ok = results.iter().all(|r| {
        r.phase.starts_with("raw")
            || (r.missing == 0 && r.duplicates == 0 && r.received == r.events)
    });
    std::process::exit(if ok { 0 } else { 1 });
}
