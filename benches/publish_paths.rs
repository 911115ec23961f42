//! What publishing with per-message acks costs the client, by path: through
//! async-nats (`client`: a header map per message and the acks on one
//! wildcard subscription) and through the relay's own publish link (`wire`:
//! `relay/link/`, the code that ships: the header block written straight
//! into the output buffer, the acks parsed off the socket). Flat
//! out with 512 in flight, and paced: `--txns-per-s` transactions of ten
//! messages, each sent at once and its acks awaited, as the relay does at
//! moderate load. No relay and no Postgres: what is left is the floor a
//! relay on either path stands on.
//!
//! `scripts/bench.sh publish-paths [--messages N] [--txns-per-s N] [--out DIR]`

mod common;

use std::borrow::Cow;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use futures::StreamExt;
use outbox_relay::testing::{Dialer, Heard, NatsArgs, Reply};

/// The relay's nine headers for an event, values fresh per message.
fn headers(i: u64) -> [(&'static str, String); 9] {
    [
        ("Nats-Msg-Id", uuid::Uuid::new_v4().to_string()),
        ("Outbox-Event-Type", "tick".to_owned()),
        ("Outbox-Event-Version", "1".to_owned()),
        ("Outbox-Aggregate-Type", "load".to_owned()),
        ("Outbox-Aggregate-Id", format!("a-{}", i % 100)),
        (
            "Outbox-Occurred-At",
            "2026-11-25T17:00:00.123456Z".to_owned(),
        ),
        ("Outbox-Commit-Lsn", "0/16B3740".to_owned()),
        ("Outbox-Txn-Index", (i % 10).to_string()),
        ("Outbox-Source", "7351234567890123456/outbox/1".to_owned()),
    ]
}

#[derive(serde::Deserialize)]
struct Ack {
    seq: Option<u64>,
}

fn stored(payload: &[u8]) {
    let ack: Ack = serde_json::from_slice(payload).expect("an ack");
    assert!(
        ack.seq.is_some(),
        "refused: {}",
        String::from_utf8_lossy(payload)
    );
}

struct Run {
    path: &'static str,
    txns_per_s: u64,
    messages: u64,
    seconds: f64,
    client_us: f64,
    nats_us: f64,
    switches_per_txn: f64,
}

fn context_switches() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("ctxt_switches"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
        .sum()
}

/// Waits between transactions when paced.
struct Pace(Option<tokio::time::Interval>);

impl Pace {
    fn new(txns_per_s: u64) -> Self {
        Self((txns_per_s > 0).then(|| {
            let mut t = tokio::time::interval(Duration::from_micros(1_000_000 / txns_per_s));
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        }))
    }
    fn window(&self) -> u64 {
        if self.0.is_some() {
            10
        } else {
            512
        }
    }
}

async fn client_path(client: &async_nats::Client, subject: &str, n: u64, mut pace: Pace) {
    let prefix = client.new_inbox();
    let mut acks = client
        .subscribe(format!("{prefix}.*"))
        .await
        .expect("subscribe");
    let body = bytes::Bytes::from(vec![b'x'; 256]);
    let window = pace.window();
    let mut acked = 0;
    for i in 0..n {
        if let Some(t) = pace.0.as_mut() {
            if i % 10 == 0 {
                while acked < i {
                    stored(&acks.next().await.expect("an ack").payload);
                    acked += 1;
                }
                t.tick().await;
            }
        }
        while i - acked >= window {
            stored(&acks.next().await.expect("an ack").payload);
            acked += 1;
        }
        let mut map = HeaderMap::new();
        for (k, v) in &headers(i) {
            map.insert(*k, v.as_str());
        }
        client
            .publish_with_reply_and_headers(
                subject.to_owned(),
                format!("{prefix}.{i}"),
                map,
                body.clone(),
            )
            .await
            .expect("publish");
    }
    while acked < n {
        stored(&acks.next().await.expect("an ack").payload);
        acked += 1;
    }
}

/// The relay's own publish link (`relay/link/`): its dialer, its `HPUB`
/// encoder and writer task, its reader and answer queue.
async fn wire_path(url: &str, subject: &str, n: u64, mut pace: Pace) {
    let args = NatsArgs {
        nats_url: url.to_owned(),
        ..NatsArgs::default()
    };
    let mut link = Dialer::new(&args, "bench-publish-paths".into())
        .expect("a dialer")
        .dial()
        .await
        .expect("a link");
    let body = bytes::Bytes::from(vec![b'x'; 256]);
    let window = pace.window();
    let (mut sent, mut acked) = (0u64, 0u64);
    let headers_of = |i: u64| -> Vec<(Cow<'static, str>, String)> {
        headers(i)
            .into_iter()
            .map(|(k, v)| (Cow::Borrowed(k), v))
            .collect()
    };
    macro_rules! read_ack {
        () => {
            match link.next_answer().await.expect("an answer") {
                Heard::Answer(_, Ok(_)) => acked += 1,
                Heard::Answer(_, Err(e)) => panic!("refused: {e}"),
                Heard::Denied(subject) => panic!("not allowed to publish to {subject}"),
            }
        };
    }
    for i in 0..n {
        if let Some(t) = pace.0.as_mut() {
            if i % 10 == 0 {
                while acked < sent {
                    read_ack!();
                }
                t.tick().await;
            }
        }
        while i - acked >= window {
            read_ack!();
        }
        assert!(
            link.publish(subject, Reply::Ack(i), &headers_of(i), &[], &body),
            "the link broke"
        );
        sent += 1;
    }
    while acked < n {
        read_ack!();
    }
}

async fn run(path: &'static str, n: u64, txns_per_s: u64) -> Run {
    let url = common::env("NATS_URL", "publish-paths");
    let nats_pid = common::env("NATS_PID", "publish-paths");
    let client = async_nats::connect(&url).await.expect("connect");
    let js = async_nats::jetstream::new(client.clone());
    let stream = format!("BENCH_PATHS_{}", path.to_uppercase());
    let _ = js.delete_stream(&stream).await;
    js.create_stream(async_nats::jetstream::stream::Config {
        name: stream.clone(),
        subjects: vec![format!("bench.paths.{path}.>")],
        ..Default::default()
    })
    .await
    .expect("create the stream");
    let subject = format!("bench.paths.{path}.tick");
    let (c0, s0, x0, t0) = (
        common::cpu_seconds("self"),
        common::cpu_seconds(&nats_pid),
        context_switches(),
        Instant::now(),
    );
    match path {
        "client" => client_path(&client, &subject, n, Pace::new(txns_per_s)).await,
        _ => wire_path(&url, &subject, n, Pace::new(txns_per_s)).await,
    }
    let seconds = t0.elapsed().as_secs_f64();
    let (c1, s1, x1) = (
        common::cpu_seconds("self"),
        common::cpu_seconds(&nats_pid),
        context_switches(),
    );
    let kept = js
        .get_stream(&stream)
        .await
        .expect("the stream")
        .info()
        .await
        .expect("its info")
        .state
        .messages;
    assert_eq!(kept, n, "{path}: the stream holds {kept} of {n}");
    let _ = js.delete_stream(&stream).await;
    Run {
        path,
        txns_per_s,
        messages: n,
        seconds,
        client_us: (c1 - c0) * 1e6 / n as f64,
        nats_us: (s1 - s0) * 1e6 / n as f64,
        switches_per_txn: (x1 - x0) as f64 * 10.0 / n as f64,
    }
}

/// The bench's flags.
#[derive(clap::Parser, Debug)]
struct Args {
    /// Messages per flat-out run.
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    /// Transactions of ten per second in the paced runs.
    #[arg(long, default_value_t = 200)]
    txns_per_s: u64,
    #[command(flatten)]
    common: common::Common,
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = <Args as clap::Parser>::parse();
    let n = args.messages;
    let rate = args.txns_per_s;
    let paced = (rate * 15 * 10).min(n);
    let mut runs = Vec::new();
    // Alternating, twice: this box's speed drifts within a session.
    for _ in 0..2 {
        for path in ["client", "wire"] {
            runs.push(run(path, n, 0).await);
            runs.push(run(path, paced, rate).await);
        }
    }
    println!("| path | transactions/s | messages | client CPU µs/msg | nats-server CPU µs/msg | context switches per 10 msgs |");
    println!("|---|---|---|---|---|---|");
    for r in &runs {
        let pace = if r.txns_per_s == 0 {
            "flat out".to_owned()
        } else {
            r.txns_per_s.to_string()
        };
        println!(
            "| {} | {pace} | {} in {:.1} s | {:.2} | {:.2} | {:.2} |",
            r.path, r.messages, r.seconds, r.client_us, r.nats_us, r.switches_per_txn
        );
    }
    let json: Vec<serde_json::Value> = runs
        .iter()
        .map(|r| {
            serde_json::json!({
                "path": r.path, "txns_per_s": r.txns_per_s, "messages": r.messages,
                "seconds": r.seconds, "client_cpu_us_per_msg": r.client_us,
                "nats_cpu_us_per_msg": r.nats_us, "context_switches_per_10_msgs": r.switches_per_txn,
            })
        })
        .collect();
    let file = format!(
        "{}/publish-paths-{}.json",
        args.common.out_dir(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    );
    std::fs::write(&file, serde_json::to_vec_pretty(&json).expect("json")).expect("write");
    println!("wrote {file}");
}
