//! A pause is not a crash (SPEC §6, §11): production pauses for seconds far
//! more often than it crashes (a Postgres restart or failover, a path that
//! stalls, a NATS server that stops answering, a process stalled by a VM or
//! its CPU quota). Each test here runs the consumer binary at its default
//! flags under steady load, with a handler whose calls take 1 to 3 s and
//! that finishes its work whether or not the caller is still there (most
//! handlers do), pauses one part for a few seconds, and checks what users
//! are promised: no call repeated (every call here succeeds), no message of
//! an aggregate started before the one before it ended, every message
//! processed. The worst wait of a message (published to first called) is
//! printed, not asserted: timings belong to the bench.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::consumer::{fresh_stream, js};
use async_nats::jetstream;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use outbox_relay::wire;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

/// One call the handler took: the message, its aggregate and place in it,
/// when it began and when its work was done.
#[derive(Clone, Debug)]
struct Effect {
    id: String,
    aggregate: String,
    n: u64,
    start: Instant,
    end: Option<Instant>,
}

/// A handler whose work runs to its end even when the caller goes away (a
/// cut call's work still happens: what a repeated call would do twice).
#[derive(Clone, Default)]
struct Effects {
    log: Arc<Mutex<Vec<Effect>>>,
}

impl Effects {
    async fn serve(&self) -> String {
        let app = axum::Router::new()
            .route("/handle", axum::routing::post(take_effect))
            .with_state(self.clone());
        let url = serve_handler(app).await;
        url
    }

    fn calls(&self) -> Vec<Effect> {
        self.log.lock().unwrap().clone()
    }

    fn running(&self) -> usize {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.end.is_none())
            .count()
    }
}

async fn take_effect(State(e): State<Effects>, body: Bytes) -> StatusCode {
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let p = &body["payload"];
    let at = {
        let mut log = e.log.lock().unwrap();
        log.push(Effect {
            id: body["message_id"].as_str().unwrap_or_default().to_owned(),
            aggregate: p["aggregate"].as_str().unwrap_or_default().to_owned(),
            n: p["n"].as_u64().unwrap_or_default(),
            start: Instant::now(),
            end: None,
        });
        log.len() - 1
    };
    let sleep = Duration::from_millis(p["sleep_ms"].as_u64().unwrap_or(0));
    let (done, answered) = tokio::sync::oneshot::channel();
    let log = e.log.clone();
    // Off the request: hyper drops this future when the caller goes away,
    // and the work must go on regardless.
    tokio::spawn(async move {
        tokio::time::sleep(sleep).await;
        log.lock().unwrap()[at].end = Some(Instant::now());
        let _ = done.send(());
    });
    let _ = answered.await;
    StatusCode::OK
}

/// A message published: id, aggregate, place in it, when.
type Sent = (Uuid, String, u64, Instant);

/// A durable `ctx` on a fresh stream, its handler, and the messages sent.
struct World {
    url: String,
    pool: sqlx::PgPool,
    js: jetstream::Context,
    nats_url: String,
    stream: String,
    ctx: &'static str,
    effects: Effects,
    handler_url: String,
    /// Every message published: id, aggregate, place, when.
    sent: Arc<Mutex<Vec<Sent>>>,
}

/// Aggregates of the load, and messages each: calls of 1 to 3 s keep about
/// this many in flight, under the default `--concurrency`.
const AGGREGATES: usize = 36;
const PER_AGGREGATE: usize = 4;
const MESSAGES: usize = AGGREGATES * PER_AGGREGATE;

impl World {
    /// On the shared stack: a fresh database.
    async fn shared(db: &str, ctx: &'static str) -> World {
        let stack = stack();
        let (url, pool) = fresh_db(&stack, db).await;
        World::on(url, pool, &stack.nats_url, ctx).await
    }

    /// On a database (migrated) and NATS of the test's own.
    async fn on(url: String, pool: sqlx::PgPool, nats_url: &str, ctx: &'static str) -> World {
        let js = js(nats_url).await;
        let stream = fresh_stream(&js, ctx, Duration::from_secs(120)).await;
        let effects = Effects::default();
        let handler_url = effects.serve().await;
        World {
            url,
            pool,
            js,
            nats_url: nats_url.to_owned(),
            stream,
            ctx,
            effects,
            handler_url,
            sent: Default::default(),
        }
    }

    /// A `consume` process at the default flags (`--context` only).
    fn process(&self, name: &str, db_url: &str, nats_url: &str) -> Service {
        Service::consumer_named(
            db_url,
            nats_url,
            &self.stream,
            self.ctx,
            name,
            &self.handler_url,
            &["--context", self.ctx],
        )
    }

    /// Publish the load, about 24 messages a second, each aggregate's
    /// messages in order; calls take 1 to 3 s.
    fn load(&self) -> tokio::task::JoinHandle<()> {
        self.load_of_calls(1_000, 2_000)
    }

    /// The load with calls of `base` to `base + spread` ms.
    fn load_of_calls(&self, base: u64, spread: u64) -> tokio::task::JoinHandle<()> {
        let (js, subject, sent) = (
            self.js.clone(),
            format!("{}.e", self.ctx),
            self.sent.clone(),
        );
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(40));
            for k in 0..MESSAGES {
                tick.tick().await;
                let (aggregate, n) = (format!("agg{}", k % AGGREGATES), (k / AGGREGATES) as u64);
                let sleep_ms = base + (k as u64 * 397) % (spread + 1);
                let id = Uuid::new_v4();
                let body =
                    serde_json::json!({"aggregate": aggregate, "n": n, "sleep_ms": sleep_ms});
                let mut h = async_nats::HeaderMap::new();
                h.insert(wire::MSG_ID, id.to_string().as_str());
                h.insert(wire::AGGREGATE_ID, aggregate.as_str());
                h.insert(wire::EVENT_TYPE, "placed");
                h.insert(wire::EVENT_VERSION, "1");
                // Through a NATS that pauses, a publish waits for it.
                loop {
                    let ack = js
                        .send_publish(
                            subject.clone(),
                            jetstream::message::PublishMessage::build()
                                .payload(body.to_string().into())
                                .headers(h.clone()),
                        )
                        .await;
                    if let Ok(ack) = ack {
                        if ack.await.is_ok() {
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                sent.lock()
                    .unwrap()
                    .push((id, aggregate, n, Instant::now()));
            }
        })
    }

    /// Wait until `n` calls are in flight at the handler.
    async fn in_flight(&self, n: usize) {
        eventually(T, &format!("{n} calls in flight"), || async {
            self.effects.running() >= n
        })
        .await;
    }

    /// Wait for the load to be sent, every message processed, and every
    /// call's work done; then check the promises.
    async fn settled(&self, load: tokio::task::JoinHandle<()>) {
        load.await.unwrap();
        eventually(T, "every message processed", || async {
            let processed: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM inbox_messages WHERE consumer = $1 AND processed_at IS NOT NULL",
            )
            .bind(self.ctx)
            .fetch_one(&self.pool)
            .await
            .unwrap_or(0);
            processed >= MESSAGES as i64
        })
        .await;
        eventually(T, "every call's work done", || async {
            self.effects.running() == 0
        })
        .await;
        let verdict = Verdict::of(&self.effects.calls(), &self.sent.lock().unwrap());
        println!(
            "{}: {} calls of {} messages, worst wait {:?}",
            self.ctx,
            self.effects.calls().len(),
            MESSAGES,
            verdict.worst_wait
        );
        assert!(
            verdict.missing.is_empty(),
            "never called: {:?}",
            verdict.missing
        );
        assert!(
            verdict.repeated.is_empty(),
            "{} successful call(s) made again: {:?}",
            verdict.repeated.len(),
            verdict.repeated
        );
        assert!(
            verdict.inversions.is_empty(),
            "order broken: {:?}",
            verdict.inversions
        );
    }
}

/// What the handler saw, against what was sent.
struct Verdict {
    repeated: Vec<(String, usize)>,
    inversions: Vec<String>,
    missing: Vec<Uuid>,
    worst_wait: Duration,
}

impl Verdict {
    fn of(calls: &[Effect], sent: &[Sent]) -> Verdict {
        let mut by_id: HashMap<&str, Vec<&Effect>> = HashMap::new();
        let mut by_aggregate: HashMap<&str, Vec<&Effect>> = HashMap::new();
        for c in calls {
            by_id.entry(c.id.as_str()).or_default().push(c);
            by_aggregate
                .entry(c.aggregate.as_str())
                .or_default()
                .push(c);
        }
        let mut repeated: Vec<(String, usize)> = by_id
            .iter()
            .filter(|(_, c)| c.len() > 1)
            .map(|(id, c)| (id.to_string(), c.len()))
            .collect();
        repeated.sort();
        let mut inversions = Vec::new();
        for (aggregate, calls) in &mut by_aggregate {
            calls.sort_by_key(|c| c.start);
            for pair in calls.windows(2) {
                let (a, b) = (pair[0], pair[1]);
                let overlap = a.end.is_none_or(|end| b.start < end);
                if b.n < a.n || (b.n != a.n && overlap) {
                    inversions.push(format!(
                        "{aggregate}: message {} called {:?} after message {} began{}",
                        b.n,
                        b.start - a.start,
                        a.n,
                        if overlap { ", before it ended" } else { "" }
                    ));
                }
            }
        }
        let mut missing = Vec::new();
        let mut worst_wait = Duration::ZERO;
        for (id, _, _, at) in sent {
            match by_id.get(id.to_string().as_str()) {
                Some(c) => {
                    let first = c.iter().map(|c| c.start).min().unwrap_or(*at);
                    worst_wait = worst_wait.max(first.saturating_duration_since(*at));
                }
                None => missing.push(*id),
            }
        }
        Verdict {
            repeated,
            inversions,
            missing,
            worst_wait,
        }
    }
}

/// One process frozen 2.5 s (a VM pause, a GC, CPU throttling, a blocked
/// log pipe). Before: every call in flight at the pause was cut, as if the
/// process had been replaced, and made again once it thawed, though no
/// other process existed to take the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_frozen_for_2_5_s_repeats_no_call() {
    let w = World::shared("p_solofreeze", "psolofreeze").await;
    let mut c = w.process("psolofreeze-a", &w.url, &w.nats_url);
    c.wait_ready();
    let load = w.load();
    w.in_flight(20).await;
    signal(c.pid(), "STOP");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    signal(c.pid(), "CONT");
    w.settled(load).await;
}

/// One process whose path to Postgres stalls 4 s and then carries on (a
/// congested link, a failover of a virtual IP). Before: the lost lease and
/// the failed member checks cut every call in flight, made again after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_whose_postgres_path_stalls_for_4_s_repeats_no_call() {
    let w = World::shared("p_solostall", "psolostall").await;
    let proxy = Proxy::start(&pg_target(&w.url)).await;
    let mut c = w.process("psolostall-a", &proxy.pg_url(&w.url), &w.nats_url);
    c.wait_ready();
    let load = w.load();
    w.in_flight(20).await;
    proxy.pause();
    tokio::time::sleep(Duration::from_secs(4)).await;
    proxy.resume();
    w.settled(load).await;
}

/// One process whose path to Postgres turns slow for 2 s: every answer
/// 1.2 s late (a congested link, a database busy with a checkpoint). Its
/// lease's pings are slow, not lost: the lease holds, and nothing is
/// delivered again. Before, a ping slower than 1 s ended the period: a
/// reset to the ack floor, and every message above it delivered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_whose_postgres_answers_1_2_s_late_keeps_its_lease() {
    let w = World::shared("p_sololate", "psololate").await;
    let proxy = Proxy::start(&pg_target(&w.url)).await;
    let mut c = w.process("psololate-a", &proxy.pg_url(&w.url), &w.nats_url);
    c.wait_ready();
    let load = w.load();
    w.in_flight(20).await;
    let duplicates = |m: &Scrape| {
        m.value("outbox_consumer_messages_total{result=\"duplicate\"}")
            .unwrap_or(0.0)
    };
    let before = duplicates(&c.scrape().await);
    proxy.delay(Duration::from_millis(1_200));
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.delay(Duration::ZERO);
    w.settled(load).await;
    let after = duplicates(&c.scrape().await);
    assert_eq!(after, before, "messages delivered again after a slow ping");
    assert!(
        !c.log_text().contains("lost the consumer lease"),
        "the lease was lost to a slow ping"
    );
}

/// One process through a Postgres crash and a 35 s outage (a failover's
/// length). Before: calls in flight were cut when the lease went, and the
/// successes whose completion waited for Postgres were dropped after
/// `--shutdown-timeout` (30 s) and made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_through_a_35_s_postgres_outage_repeats_no_call() {
    let own = OwnStack::up("p-pgdown", false);
    let (url, nats) = (
        own.get("DATABASE_URL").to_owned(),
        own.get("NATS_URL").to_owned(),
    );
    migrate(&url);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let w = World::on(url.clone(), pool, &nats, "ppgdown").await;
    let mut c = w.process("ppgdown-a", &url, &nats);
    c.wait_ready();
    let load = w.load();
    w.in_flight(20).await;
    own.pg_power_mode("pg-stop", "immediate");
    tokio::time::sleep(Duration::from_secs(35)).await;
    own.pg_power("pg-start");
    w.settled(load).await;
}

/// One process while its nats-server is frozen 3 s (SIGSTOP: a stalled
/// server, its sockets open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_through_a_3_s_nats_freeze_repeats_no_call() {
    let stack = stack();
    let nats = OwnNats::start(&stack, "pnatsfreeze");
    let (url, pool) = fresh_db(&stack, "p_natsfreeze").await;
    let w = World::on(url.clone(), pool, &nats.url, "pnatsfreeze").await;
    let mut c = w.process("pnatsfreeze-a", &url, &nats.url);
    c.wait_ready();
    let load = w.load();
    w.in_flight(20).await;
    signal(nats.pid(), "STOP");
    tokio::time::sleep(Duration::from_secs(3)).await;
    signal(nats.pid(), "CONT");
    w.settled(load).await;
}

/// `--concurrency` for the crew tests: the dispatcher hands work out once
/// its own slots are full, so each of three processes runs some.
const CREW_CONCURRENCY: &str = "12";

impl World {
    fn crew_process(&self, name: &str, db_url: &str) -> Service {
        Service::consumer_named(
            db_url,
            &self.nats_url,
            &self.stream,
            self.ctx,
            name,
            &self.handler_url,
            &["--context", self.ctx, "--concurrency", CREW_CONCURRENCY],
        )
    }

    /// Three processes of the durable under the load, each helper running
    /// calls; the dispatcher (`a`) first.
    async fn crew_of_three(
        &self,
        name: &str,
        db_url: &str,
    ) -> (Service, Service, Service, tokio::task::JoinHandle<()>) {
        let mut a = self.crew_process(&format!("{name}-a"), db_url);
        a.wait_ready();
        let b = self.crew_process(&format!("{name}-b"), db_url);
        let c = self.crew_process(&format!("{name}-c"), db_url);
        self.processes(&a, 3).await;
        let load = self.load();
        eventually(T, "both helpers run calls", || async {
            b.scrape().await.value("outbox_consumer_running_jobs") >= Some(1.0)
                && c.scrape().await.value("outbox_consumer_running_jobs") >= Some(1.0)
        })
        .await;
        (a, b, c, load)
    }

    async fn processes(&self, s: &Service, n: usize) {
        eventually(T, &format!("{n} processes of the durable"), || async {
            s.scrape().await.value("outbox_consumer_processes") == Some(n as f64)
        })
        .await;
    }
}

/// Three processes; the dispatcher frozen 2.2 s. Before: every helper's
/// proof lapsed 2 s after the dispatcher last acknowledged it, and each cut
/// its calls in flight, which the dispatcher made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_with_the_dispatcher_frozen_for_2_2_s_repeat_no_call() {
    let w = World::shared("p_crewfreeze", "pcrewfreeze").await;
    let (a, _b, _c, load) = w.crew_of_three("pcrewfreeze", &w.url).await;
    signal(a.pid(), "STOP");
    tokio::time::sleep(Duration::from_millis(2_200)).await;
    signal(a.pid(), "CONT");
    w.settled(load).await;
}

/// A helper whose path to Postgres stalls while its calls run, and stays
/// stalled long enough for Postgres to end its member session (8 s). Its
/// calls succeed; their completions wait for Postgres. Before: its proof
/// lapsed 1.5 s into the stall and it cut its calls, and the dispatcher,
/// seeing its lock gone for 3 s, took its jobs for lost while it still
/// beat and listed them: made again either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_helper_cut_off_from_postgres_mid_call_has_its_successes_recorded_once() {
    let w = World::shared("p_helperpg", "phelperpg").await;
    let proxy = Proxy::start(&pg_target(&w.url)).await;
    let mut a = w.crew_process("phelperpg-a", &w.url);
    a.wait_ready();
    let b = w.crew_process("phelperpg-b", &proxy.pg_url(&w.url));
    w.processes(&a, 2).await;
    let load = w.load();
    eventually(T, "the helper runs calls", || async {
        b.scrape().await.value("outbox_consumer_running_jobs") >= Some(4.0)
    })
    .await;
    proxy.pause();
    tokio::time::sleep(Duration::from_secs(8)).await;
    proxy.resume();
    w.settled(load).await;
}

/// Issue 56, item 11: the dispatcher hands its lease on (a SIGTERM: a
/// deploy) while a helper's path to Postgres is stalled. That helper cannot
/// answer the next dispatcher's sync (it cannot ask Postgres who holds the
/// lease) and goes on beating its jobs. Before: the takeover waited for it
/// (up to its 30 s limit), nobody acknowledged its beats, its lock could
/// not be proven, and it cut its calls in flight, which were made again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_helper_cut_off_from_postgres_through_a_handover_repeats_no_call() {
    let w = World::shared("p_handpg", "phandpg").await;
    let proxy = Proxy::start(&pg_target(&w.url)).await;
    let a = w.crew_process("phandpg-a", &w.url);
    let b = w.crew_process("phandpg-b", &proxy.pg_url(&w.url));
    let c = w.crew_process("phandpg-c", &w.url);
    eventually(T, "three processes, the first dispatching", || async {
        a.scrape().await.value("outbox_consumer_standby") == Some(0.0)
            && a.scrape().await.value("outbox_consumer_processes") == Some(3.0)
    })
    .await;
    // Calls longer than every proof the helper has of its own.
    let load = w.load_of_calls(6_000, 2_000);
    eventually(T, "the helper to be cut off runs calls", || async {
        b.scrape().await.value("outbox_consumer_running_jobs") >= Some(2.0)
    })
    .await;
    proxy.pause();
    signal(a.pid(), "TERM");
    eventually(T, "the third process dispatches", || async {
        c.scrape().await.value("outbox_consumer_standby") == Some(0.0)
    })
    .await;
    // The stall outlasts every proof the helper had of its own (1.5 s on
    // its lock, 3 s on the last dispatcher's acknowledgements).
    tokio::time::sleep(Duration::from_secs(8)).await;
    proxy.resume();
    w.settled(load).await;
}

/// Three processes whose paths to Postgres all stall 4 s at once (the
/// database's host congested, a virtual IP moving). No process can have
/// taken another's work while none of them reaches Postgres, so no call
/// may be made again. Before, on a loaded box: every member lock went with
/// the stall, and the dispatcher's next period took the crew for whoever
/// it had heard or found locked at its first poll; a helper that took its
/// lock back a moment later ran 7 jobs it never adopted, and they ran
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_whose_postgres_stalls_4_s_repeat_no_call() {
    let w = World::shared("p_crewstall", "pcrewstall").await;
    let proxy = Proxy::start(&pg_target(&w.url)).await;
    let via = proxy.pg_url(&w.url);
    let (_a, _b, _c, load) = w.crew_of_three("pcrewstall", &via).await;
    proxy.pause();
    tokio::time::sleep(Duration::from_secs(4)).await;
    proxy.resume();
    w.settled(load).await;
}

/// Three processes through a Postgres crash and a 35 s outage (a
/// failover's length): every session ends, the lease and the member locks
/// with them. Before: the helpers cut their calls in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_through_a_35_s_postgres_outage_repeat_no_call() {
    let own = OwnStack::up("p-crewpgdown", false);
    let (url, nats) = (
        own.get("DATABASE_URL").to_owned(),
        own.get("NATS_URL").to_owned(),
    );
    migrate(&url);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    let w = World::on(url.clone(), pool, &nats, "pcrewpgdown").await;
    let (_a, _b, _c, load) = w.crew_of_three("pcrewpgdown", &url).await;
    own.pg_power_mode("pg-stop", "immediate");
    tokio::time::sleep(Duration::from_secs(35)).await;
    own.pg_power("pg-start");
    w.settled(load).await;
}

/// Review N10: a dispatcher whose Postgres answers every round trip 400 ms
/// late (a loaded database, a far one) must still hear its helpers' beats
/// as they come. Before, it waited for each poll of who is alive (up to
/// 500 ms, every 500 ms) inside the loop that reads the beats: the beats
/// queued, their acknowledgements fell further behind, and 5 s in every
/// process's proof lapsed; the dispatcher gave its lease up, cut its calls
/// in flight, and 6 successful calls were made again (and requests named
/// an expiry beat already past, refused as `late`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_whose_postgres_answers_400_ms_late_repeats_no_call() {
    let w = World::shared("p_slowdisp", "pslowdisp").await;
    let proxy = Proxy::start(&pg_target(&w.url)).await;
    let mut a = w.crew_process("pslowdisp-a", &proxy.pg_url(&w.url));
    a.wait_ready();
    let b = w.crew_process("pslowdisp-b", &w.url);
    w.processes(&a, 2).await;
    proxy.delay(Duration::from_millis(400));
    let load = w.load();
    w.settled(load).await;
    let m = b.scrape().await;
    let helped = m
        .value("outbox_consumer_messages_total{result=\"processed\"}")
        .unwrap_or(0.0);
    let late = m
        .value("outbox_consumer_crew_refusals_total{reason=\"late\"}")
        .unwrap_or(0.0);
    println!("pslowdisp: the helper processed {helped}, refused {late} as late");
    assert!(helped > 0.0, "the helper was handed no job");
    assert_eq!(late, 0.0, "jobs refused as late");
}
