//! Consumer integration tests: real Postgres, real nats-server, and a real
//! local HTTP handler (axum) whose answers each test scripts per message.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use async_nats::jetstream::{self, stream};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use outbox_relay::wire;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

/// One call the handler received.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    id: String,
    idempotency_key: Option<String>,
    traceparent: Option<String>,
    body: serde_json::Value,
    status: u16,
    at: Instant,
}

/// A local HTTP handler. The message's payload may carry `"answers": [..]`:
/// the n-th call answers the n-th status (the last one repeats); 0 means
/// "hang past the consumer's handler timeout". `"sleep_ms"` delays each answer.
#[derive(Clone, Default)]
pub(crate) struct Handler {
    calls: Arc<Mutex<Vec<Call>>>,
}

impl Handler {
    async fn serve(&self) -> String {
        let app = axum::Router::new()
            .route("/handle", axum::routing::post(answer))
            .with_state(self.clone());
        let url = serve_handler(app).await;
        url
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    pub(crate) fn calls_for(&self, id: Uuid) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| c.id == id.to_string())
            .collect()
    }
}

async fn answer(State(h): State<Handler>, headers: HeaderMap, body: Bytes) -> StatusCode {
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let id = body["message_id"].as_str().unwrap().to_owned();
    let n = h
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.id == id)
        .count();
    let answers: Vec<u16> = body["payload"]["answers"]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_u64().unwrap() as u16).collect())
        .unwrap_or_else(|| vec![200]);
    let status = answers[n.min(answers.len() - 1)];
    let h2 = |k: &str| headers.get(k).map(|v| v.to_str().unwrap().to_owned());
    let sleep = body["payload"]["sleep_ms"].as_u64();
    // Recorded when the call arrives, so a test can act while it runs.
    h.calls.lock().unwrap().push(Call {
        id,
        idempotency_key: h2("idempotency-key"),
        traceparent: h2(wire::TRACEPARENT),
        body,
        status,
        at: Instant::now(),
    });
    if let Some(ms) = sleep {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if status == 0 {
        tokio::time::sleep(Duration::from_secs(5)).await;
        return StatusCode::OK;
    }
    StatusCode::from_u16(status).unwrap()
}

pub(crate) async fn js(nats_url: &str) -> jetstream::Context {
    jetstream::new(async_nats::connect(nats_url).await.unwrap())
}

/// A fresh events stream `{CTX}_EVENTS` on `{ctx}.>`, and its DLQ stream gone.
pub(crate) async fn fresh_stream(
    js: &jetstream::Context,
    ctx: &str,
    dup_window: Duration,
) -> String {
    let name = wire::stream_name(ctx);
    let _ = js.delete_stream(&name).await;
    let _ = js
        .delete_stream(wire::dlq_stream_name(&wire::consumer_dlq_prefix(ctx)))
        .await;
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{ctx}.>")],
        duplicate_window: dup_window,
        ..Default::default()
    })
    .await
    .unwrap();
    name
}

/// One test's world: a fresh database and stream `{CTX}_EVENTS`, a scripted
/// handler, and the consumer binary running as durable `durable`.
pub(crate) struct Fixture {
    pub(crate) pool: sqlx::PgPool,
    pub(crate) js: jetstream::Context,
    pub(crate) stream: String,
    pub(crate) handler: Handler,
    pub(crate) consumer: Service,
}

pub(crate) async fn fixture(
    db: &str,
    ctx: &str,
    durable: &str,
    dup_window: Duration,
    extra: &[&str],
) -> Fixture {
    fixture_on(&stack().nats_url, db, ctx, durable, dup_window, extra).await
}

/// [`fixture`] against a NATS of the test's own, which it may stop.
async fn fixture_on(
    nats_url: &str,
    db: &str,
    ctx: &str,
    durable: &str,
    dup_window: Duration,
    extra: &[&str],
) -> Fixture {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, db).await;
    let js = js(nats_url).await;
    let stream = fresh_stream(&js, ctx, dup_window).await;
    let handler = Handler::default();
    let handler_url = handler.serve().await;
    let mut args = vec!["--context", ctx];
    args.extend_from_slice(extra);
    let consumer = Service::consumer(&url, nats_url, &stream, durable, &handler_url, &args);
    Fixture {
        pool,
        js,
        stream,
        handler,
        consumer,
    }
}

pub(crate) const DUP: Duration = Duration::from_secs(120);

/// Publish as the relay would: id, aggregate and event headers.
pub(crate) async fn publish(
    js: &jetstream::Context,
    subject: &str,
    id: Option<Uuid>,
    aggregate: &str,
    payload: &[u8],
) {
    let id = id.map(|id| id.to_string());
    publish_id(js, subject, id.as_deref(), aggregate, payload).await
}

/// [`publish`] under any message id: a relay on a table keyed by text or
/// bigint (SPEC §13) sends the key's text.
async fn publish_id(
    js: &jetstream::Context,
    subject: &str,
    id: Option<&str>,
    aggregate: &str,
    payload: &[u8],
) {
    let mut h = async_nats::HeaderMap::new();
    if let Some(id) = id {
        h.insert(wire::MSG_ID, id);
    }
    h.insert(wire::AGGREGATE_ID, aggregate);
    h.insert(wire::EVENT_TYPE, "placed");
    h.insert(wire::EVENT_VERSION, "2");
    h.insert(
        wire::TRACEPARENT,
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    );
    js.send_publish(
        subject.to_owned(),
        jetstream::message::PublishMessage::build()
            .payload(payload.to_vec().into())
            .headers(h),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

#[derive(Debug)]
struct InboxRow {
    attempts: i32,
    processed: bool,
    last_error: Option<String>,
}

async fn inbox(pool: &sqlx::PgPool, consumer: &str) -> HashMap<Uuid, InboxRow> {
    sqlx::query_as::<_, (Uuid, i32, bool, Option<String>)>(
        "SELECT message_id, attempts, processed_at IS NOT NULL, last_error FROM inbox_messages WHERE consumer = $1",
    )
    .bind(consumer)
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|(id, attempts, processed, last_error)| (id, InboxRow { attempts, processed, last_error }))
    .collect()
}

pub(crate) async fn wait_processed(pool: &sqlx::PgPool, consumer: &str, n: usize) {
    eventually(T, &format!("{n} inbox rows processed"), || async {
        inbox(pool, consumer)
            .await
            .values()
            .filter(|r| r.processed)
            .count()
            >= n
    })
    .await;
}

/// Nothing left to deliver or to ack: every message was acked or terminated.
pub(crate) async fn assert_all_acked(js: &jetstream::Context, stream: &str, durable: &str) {
    eventually(
        Duration::from_secs(20),
        "consumer has nothing pending or unacked",
        || async {
            let mut c: jetstream::consumer::PullConsumer =
                js.get_consumer_from_stream(durable, stream).await.unwrap();
            let info = c.info().await.unwrap();
            info.num_pending == 0 && info.num_ack_pending == 0
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_answer_of_the_spec_table() {
    let Fixture {
        pool,
        js,
        stream,
        handler,
        consumer,
    } = fixture(
        "c_table",
        "ctab",
        "table",
        DUP,
        &[
            "--max-deliver",
            "3",
            "--backoff",
            "200ms",
            "--handler-timeout",
            "1s",
            "--ack-wait",
            "5s",
            "--concurrency",
            "4",
        ],
    )
    .await;
    let ids: Vec<Uuid> = (0..6).map(|_| Uuid::new_v4()).collect();
    let scripts = [
        r#"{"answers": [200]}"#,
        r#"{"answers": [409]}"#,
        r#"{"answers": [422]}"#,
        r#"{"answers": [500, 503, 200]}"#,
        r#"{"answers": [0, 200]}"#,
        r#"{"answers": [500]}"#,
    ];
    for (i, (id, script)) in ids.iter().zip(scripts).enumerate() {
        publish(
            &js,
            "ctab.event.placed.v2",
            Some(*id),
            &format!("agg-{i}"),
            script.as_bytes(),
        )
        .await;
    }
    wait_processed(&pool, "table", 6).await;
    assert_all_acked(&js, &stream, "table").await;
    let rows = inbox(&pool, "table").await;
    let row = |i: usize| &rows[&ids[i]];

    // 200 and 409: processed on the first call, no error.
    for i in [0, 1] {
        assert_eq!(
            (row(i).attempts, row(i).last_error.as_deref()),
            (1, None),
            "answer {}",
            scripts[i]
        );
        assert_eq!(handler.calls_for(ids[i]).len(), 1);
    }
    // 422: dead-lettered at once, processed with the reason.
    assert_eq!(row(2).attempts, 1);
    assert!(row(2).last_error.as_deref().unwrap().contains("422"));
    assert_eq!(handler.calls_for(ids[2]).len(), 1);
    // Fails twice, then succeeds: three calls, processed once, last error kept.
    assert_eq!(handler.calls_for(ids[3]).len(), 3);
    assert_eq!(row(3).attempts, 3);
    assert!(row(3).last_error.as_deref().unwrap().contains("503"));
    // Timeout, then success.
    assert_eq!(row(4).attempts, 2);
    assert!(row(4).last_error.as_deref().unwrap().contains("timed out"));
    // Fails on every delivery: dead-lettered on the last allowed (3rd) one.
    assert_eq!(handler.calls_for(ids[5]).len(), 3);
    assert_eq!(row(5).attempts, 3);
    assert!(row(5)
        .last_error
        .as_deref()
        .unwrap()
        .contains("last delivery"));
    assert!(rows.values().all(|r| r.processed));

    // Headers the handler got.
    let c = &handler.calls_for(ids[0])[0];
    assert_eq!(
        c.idempotency_key.as_deref(),
        Some(ids[0].to_string().as_str())
    );
    assert_eq!(
        c.traceparent.as_deref(),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(c.body["subject"], "ctab.event.placed.v2");
    assert_eq!(c.body["event_type"], "placed");
    assert_eq!(c.body["event_version"], 2);
    assert_eq!(c.body["payload"]["answers"][0], 200);
    for calls in [handler.calls_for(ids[3]), handler.calls_for(ids[4])] {
        assert!(
            calls
                .iter()
                .all(|c| c.idempotency_key.as_deref() == Some(c.id.as_str())),
            "same key on retries"
        );
    }

    // The DLQ holds exactly the two dead letters, with their headers.
    let dlq = read_stream(
        &stack().nats_url,
        &wire::dlq_stream_name(&wire::consumer_dlq_prefix("ctab")),
        2,
        T,
    )
    .await;
    assert_eq!(dlq.len(), 2);
    for (g, i, attempts) in [(&dlq[0], 2, "1"), (&dlq[1], 5, "3")] {
        assert_eq!(
            g.subject,
            wire::consumer_dlq_subject(&wire::consumer_dlq_prefix("ctab"), "ctab.event.placed.v2")
        );
        assert_eq!(
            g.h(wire::DLQ_ORIGINAL_ID),
            Some(ids[i].to_string().as_str())
        );
        assert_eq!(
            g.h(wire::MSG_ID),
            Some(wire::consumer_dlq_msg_id("table", &ids[i].to_string(), 0).as_str())
        );
        assert_eq!(g.h(wire::DLQ_ATTEMPTS), Some(attempts));
        assert_eq!(
            g.h(wire::DLQ_ORIGINAL_SUBJECT),
            Some("ctab.event.placed.v2")
        );
        assert_eq!(g.h(wire::DLQ_CONSUMER), Some("table"));
        assert_eq!(
            g.h(wire::EVENT_TYPE),
            Some("placed"),
            "original headers kept"
        );
        assert!(g.h(wire::DLQ_REASON).is_some());
        assert_eq!(g.payload, scripts[i].as_bytes(), "original body");
    }

    // The endpoint: ready, and counters that match the answers above.
    let (status, body) = consumer.http_get("/readyz").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("ready: dispatching durable table for 1 process(es)"),
        "{body}"
    );
    assert_eq!(consumer.http_get("/healthz").await.0, 200);
    let m = consumer.scrape().await;
    for name in [
        "outbox_consumer_messages_total",
        "outbox_consumer_handler_seconds",
        "outbox_consumer_pending_messages",
    ] {
        assert!(m.has(name), "{name} missing:\n{}", m.0);
    }
    let result = |r: &str| m.value(&format!("outbox_consumer_messages_total{{result=\"{r}\"}}"));
    // processed: 200, 409, 500-503-200, timeout-200; dead letters: 422 and
    // 500 ×3; retries: 2 + 1 + 2 NAKs; handler calls: 1+1+1+3+2+3.
    assert_eq!(result("processed"), Some(4.0));
    assert_eq!(result("dead_lettered"), Some(2.0));
    assert_eq!(result("retried"), Some(5.0));
    assert_eq!(result("duplicate"), Some(0.0));
    // A lone process refuses no job of the crew, and says so from the start.
    for reason in ["full", "fenced", "late", "unheard", "bad"] {
        let series = format!("outbox_consumer_crew_refusals_total{{reason=\"{reason}\"}}");
        assert_eq!(m.value(&series), Some(0.0), "{series}");
    }
    assert_eq!(handler.calls().len(), 11);
    assert_eq!(m.value("outbox_consumer_handler_seconds_count"), Some(11.0));
    eventually(T, "pending gauge back to 0", || async {
        consumer
            .scrape()
            .await
            .value("outbox_consumer_pending_messages")
            == Some(0.0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_handler_is_retried_then_dead_lettered() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_unreach").await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "cunr", Duration::from_secs(120)).await;
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _consumer = Service::consumer(
        &url,
        &stack.nats_url,
        &stream,
        "unreach",
        &format!("http://127.0.0.1:{port}/h"),
        &[
            "--context",
            "cunr",
            "--max-deliver",
            "2",
            "--backoff",
            "100ms",
        ],
    );
    let id = Uuid::new_v4();
    publish(&js, "cunr.x", Some(id), "a", b"{}").await;
    wait_processed(&pool, "unreach", 1).await;
    let rows = inbox(&pool, "unreach").await;
    assert_eq!(rows[&id].attempts, 2);
    assert!(rows[&id]
        .last_error
        .as_deref()
        .unwrap()
        .contains("unreachable"));
    assert_eq!(
        read_stream(
            &stack.nats_url,
            &wire::dlq_stream_name(&wire::consumer_dlq_prefix("cunr")),
            1,
            T
        )
        .await
        .len(),
        1
    );
    assert_all_acked(&js, &stream, "unreach").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_dead_lettered_not_dropped_nor_retried() {
    let Fixture {
        pool,
        js,
        stream,
        handler,
        consumer: _consumer,
    } = fixture("c_bad", "cbad", "bad", DUP, &[]).await;
    publish(&js, "cbad.no.id", None, "a", b"{}").await;
    let not_json = Uuid::new_v4();
    publish(
        &js,
        "cbad.not.json",
        Some(not_json),
        "b",
        b"this is not json",
    )
    .await;
    let dlq = read_stream(
        &stack().nats_url,
        &wire::dlq_stream_name(&wire::consumer_dlq_prefix("cbad")),
        2,
        T,
    )
    .await;
    assert_eq!(dlq.len(), 2);
    let dead =
        |original: &str| wire::consumer_dlq_subject(&wire::consumer_dlq_prefix("cbad"), original);
    let reason = |original: &str| {
        dlq.iter()
            .find(|g| g.subject == dead(original))
            .unwrap()
            .h(wire::DLQ_REASON)
            .unwrap()
            .to_owned()
    };
    assert!(reason("cbad.no.id").contains(&format!("no {}", wire::MSG_ID)));
    assert!(reason("cbad.not.json").contains("not JSON"));
    assert_eq!(
        dlq.iter()
            .find(|g| g.subject == dead("cbad.not.json"))
            .unwrap()
            .payload,
        b"this is not json"
    );
    assert_all_acked(&js, &stream, "bad").await;
    assert!(
        handler.calls().is_empty(),
        "the handler never sees bad input"
    );
    let rows = inbox(&pool, "bad").await;
    assert!(rows[&not_json].processed && rows[&not_json].last_error.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_published_twice_outside_the_dedupe_window_reaches_the_handler_once() {
    let Fixture {
        pool,
        js,
        stream,
        handler,
        consumer,
    } = fixture("c_twice", "ctwice", "twice", Duration::from_secs(1), &[]).await;
    let id = Uuid::new_v4();
    publish(&js, "ctwice.e", Some(id), "a", b"{}").await;
    wait_processed(&pool, "twice", 1).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    publish(&js, "ctwice.e", Some(id), "a", b"{}").await;
    let mut s = js.get_stream(&stream).await.unwrap();
    assert_eq!(
        s.info().await.unwrap().state.messages,
        2,
        "JetStream stored it twice"
    );
    assert_all_acked(&js, &stream, "twice").await;
    assert_eq!(handler.calls_for(id).len(), 1);
    assert_eq!(inbox(&pool, "twice").await[&id].attempts, 1);
    let m = consumer.scrape().await;
    let result = |r: &str| m.value(&format!("outbox_consumer_messages_total{{result=\"{r}\"}}"));
    assert_eq!(
        (result("processed"), result("duplicate")),
        (Some(1.0), Some(1.0))
    );
}

/// The HTTP path's inbox writers keep a connection each (a pool's pings
/// cost two round trips per statement). Their backends terminated (an
/// operator's `pg_terminate_backend`, a failover), each writer must open a
/// new connection for its next batch, not fail on the dead one forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_writers_reconnect_after_their_backends_are_terminated() {
    let Fixture {
        pool,
        js,
        stream,
        handler,
        consumer: _consumer,
    } = fixture("c_writers", "cwriters", "writers", DUP, &[]).await;
    let ids: Vec<Uuid> = (0..40).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids[..20].iter().enumerate() {
        publish(&js, "cwriters.e", Some(*id), &format!("a{i}"), b"{}").await;
    }
    wait_processed(&pool, "writers", 20).await;
    let (claims, completions): (i64, i64) = sqlx::query_as(
        "WITH gone AS ( \
           SELECT query, pg_terminate_backend(pid) AS done FROM pg_stat_activity \
           WHERE datname = current_database() AND pid <> pg_backend_pid() \
             AND query LIKE '%inbox_messages%') \
         SELECT count(*) FILTER (WHERE done AND query LIKE '%INSERT INTO inbox_messages%'), \
                count(*) FILTER (WHERE done AND query LIKE 'UPDATE inbox_messages SET processed_at%') \
         FROM gone",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(
        claims >= 1 && completions >= 1,
        "the writers' backends were found and terminated: {claims} claim, {completions} completion"
    );
    for (i, id) in ids[20..].iter().enumerate() {
        publish(&js, "cwriters.e", Some(*id), &format!("b{i}"), b"{}").await;
    }
    wait_processed(&pool, "writers", 40).await;
    assert_all_acked(&js, &stream, "writers").await;
    let repeated: Vec<Uuid> = ids
        .iter()
        .copied()
        .filter(|id| handler.calls_for(*id).len() != 1)
        .collect();
    assert!(repeated.is_empty(), "called other than once: {repeated:?}");
}

/// The same writers' Postgres path goes silent (a vanished host, a
/// middlebox dropping an idle flow: no reset, no answer; new connections
/// pass). A writer's next statement waited on its dead connection for as
/// long as TCP keeps retrying (about 15 minutes): no claim and no
/// completion of that process meanwhile (a helper of a crew keeps its
/// writers for its whole life), a successful call unrecorded. The writer
/// must give the connection up, and the retry go through a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_writers_leave_a_postgres_path_gone_silent() {
    use outbox_relay::testing::{Batcher, Claim};
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_wsilent").await;
    let proxy = Proxy::start(&pg_target(&url)).await;
    let via = sqlx::PgPool::connect(&proxy.pg_url(&url)).await.unwrap();
    let batcher = Batcher::start(via, "wsilent".into(), "S".into());
    let (a, b, c) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    for (id, seq) in [(a, 1), (c, 3)] {
        assert!(matches!(
            batcher.claim(id, "s.e", seq).await,
            Ok(Claim::Fresh { attempts: 1 })
        ));
    }
    batcher.complete(a).await.unwrap();
    // Both writers hold a connection now: that path goes silent.
    proxy.black_hole();
    // As the consumer does: a failed write is tried again. Each try may
    // wait for its connection's check or its answer's limit; none may
    // wait for ever.
    let settled = tokio::time::timeout(T, async {
        let (mut claimed, mut completed) = (false, false);
        while !(claimed && completed) {
            let (claim, complete) = tokio::join!(
                async { claimed || batcher.claim(b, "s.e", 2).await.is_ok() },
                async { completed || batcher.complete(c).await.is_ok() },
            );
            (claimed, completed) = (claim, complete);
        }
    })
    .await;
    assert!(
        settled.is_ok(),
        "a claim or a completion waited on a silent connection for {T:?}"
    );
    let rows: HashMap<Uuid, bool> = sqlx::query_as(
        "SELECT message_id, processed_at IS NOT NULL FROM inbox_messages WHERE consumer = 'wsilent'",
    )
    .fetch_all(&pool)
    .await
    .unwrap()
    .into_iter()
    .collect();
    assert_eq!(rows, HashMap::from([(a, true), (b, false), (c, true)]));
}

/// SPEC §13: a table keyed by text or bigint sends that key as
/// `Nats-Msg-Id`. The handler is given it as it is (body and
/// `Idempotency-Key`), a repeat outside the duplicate window is still
/// deduped by the inbox, and a dead letter names the original id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_and_integer_message_ids_are_deduped_and_handed_over_as_they_are() {
    let Fixture {
        pool,
        js,
        handler,
        consumer,
        ..
    } = fixture("c_textid", "ctext", "textid", Duration::from_secs(1), &[]).await;
    let ids = ["1160481716839288832", "order-7", "42"];
    for id in ids {
        publish_id(&js, "ctext.e", Some(id), id, b"{}").await;
    }
    publish_id(&js, "ctext.e", Some("rej-1"), "r", br#"{"answers": [422]}"#).await;
    wait_processed(&pool, "textid", 4).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    publish_id(&js, "ctext.e", Some("order-7"), "order-7", b"{}").await;
    eventually(T, "the repeat counted as a duplicate", || async {
        let m = consumer.scrape().await;
        m.value("outbox_consumer_messages_total{result=\"duplicate\"}") == Some(1.0)
    })
    .await;
    let calls = handler.calls();
    for id in ids {
        let mine: Vec<&Call> = calls.iter().filter(|c| c.id == id).collect();
        assert_eq!(mine.len(), 1, "{id}: one call, under its own id: {calls:?}");
        assert_eq!(mine[0].idempotency_key.as_deref(), Some(id));
    }
    assert_eq!(
        inbox(&pool, "textid").await.len(),
        4,
        "one inbox row per id"
    );
    let dlq = read_stream(
        &stack().nats_url,
        &wire::dlq_stream_name(&wire::consumer_dlq_prefix("ctext")),
        1,
        T,
    )
    .await;
    assert_eq!(dlq[0].h(wire::DLQ_ORIGINAL_ID), Some("rej-1"));
    assert_eq!(dlq[0].h(wire::MSG_ID), Some("textid:rej-1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_aggregate_order_holds_across_retries_while_others_flow() {
    let Fixture {
        pool,
        js,
        handler,
        consumer: _consumer,
        ..
    } = fixture(
        "c_order",
        "corder",
        "order",
        DUP,
        &["--backoff", "1500ms", "--concurrency", "4"],
    )
    .await;
    let a: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    let b: Vec<Uuid> = (0..2).map(|_| Uuid::new_v4()).collect();
    publish(
        &js,
        "corder.e",
        Some(a[0]),
        "A",
        br#"{"answers": [500, 200]}"#,
    )
    .await;
    publish(&js, "corder.e", Some(a[1]), "A", b"{}").await;
    publish(&js, "corder.e", Some(b[0]), "B", b"{}").await;
    publish(&js, "corder.e", Some(a[2]), "A", b"{}").await;
    publish(&js, "corder.e", Some(b[1]), "B", b"{}").await;
    wait_processed(&pool, "order", 5).await;
    let calls = handler.calls();
    let ok_at = |id: Uuid| {
        calls
            .iter()
            .find(|c| c.id == id.to_string() && c.status == 200)
            .unwrap()
            .at
    };
    let first_call = |id: Uuid| calls.iter().find(|c| c.id == id.to_string()).unwrap().at;
    assert!(
        first_call(a[1]) > ok_at(a[0]),
        "A's second event waited for the first's retry"
    );
    assert!(ok_at(a[2]) > ok_at(a[1]), "A in stream order");
    assert!(ok_at(b[1]) < ok_at(a[0]), "B kept flowing while A waited");
    assert_eq!(calls.iter().filter(|c| c.id == a[1].to_string()).count(), 1);
}

/// SPEC §13: a message without `Outbox-Aggregate-Id` (an outbox table with
/// no aggregate role) is ordered with the others of its subject. Before,
/// such messages were not ordered at all: the second of a subject ran
/// while the first waited for its retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_without_an_aggregate_are_ordered_by_subject() {
    let Fixture {
        pool,
        js,
        handler,
        consumer: _consumer,
        ..
    } = fixture(
        "c_noagg",
        "cnoagg",
        "noagg",
        DUP,
        &["--backoff", "1500ms", "--concurrency", "4"],
    )
    .await;
    let x: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    let y: Vec<Uuid> = (0..2).map(|_| Uuid::new_v4()).collect();
    let send = |subject: &'static str, id: Uuid, body: &'static [u8]| {
        let js = js.clone();
        async move {
            let id = id.to_string();
            publish_with(&js, subject, &[(wire::MSG_ID, id.as_str())], body).await;
        }
    };
    send("cnoagg.x", x[0], br#"{"answers": [500, 200]}"#).await;
    send("cnoagg.x", x[1], b"{}").await;
    send("cnoagg.y", y[0], b"{}").await;
    send("cnoagg.x", x[2], b"{}").await;
    send("cnoagg.y", y[1], b"{}").await;
    wait_processed(&pool, "noagg", 5).await;
    let calls = handler.calls();
    let ok_at = |id: Uuid| {
        calls
            .iter()
            .find(|c| c.id == id.to_string() && c.status == 200)
            .unwrap()
            .at
    };
    let first_call = |id: Uuid| calls.iter().find(|c| c.id == id.to_string()).unwrap().at;
    assert!(
        first_call(x[1]) > ok_at(x[0]),
        "x's second message waited for the first's retry"
    );
    assert!(ok_at(x[2]) > ok_at(x[1]), "x in stream order");
    assert!(ok_at(y[1]) < ok_at(x[0]), "y kept flowing while x waited");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_batch_then_restart_processes_each_once() {
    let Fixture {
        pool,
        js,
        stream,
        handler,
        mut consumer,
    } = fixture(
        "c_kill",
        "ckill",
        "killme",
        DUP,
        &["--concurrency", "8", "--ack-wait", "2s"],
    )
    .await;
    let concurrency = 8;
    const N: usize = 300;
    let ids: Vec<Uuid> = (0..N).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        publish(
            &js,
            "ckill.e",
            Some(*id),
            &format!("agg-{}", i % 40),
            br#"{"sleep_ms": 10}"#,
        )
        .await;
    }
    eventually(T, "a third handled", || async {
        handler.calls().len() >= N / 3
    })
    .await;
    consumer.kill9();
    let at_kill = handler.calls().len();
    consumer.restart();
    consumer.wait_ready();
    wait_processed(&pool, "killme", N).await;
    assert_all_acked(&js, &stream, "killme").await;
    assert!(at_kill < N, "killed mid-batch");

    let calls = handler.calls();
    let mut per_id: HashMap<&str, Vec<&Call>> = HashMap::new();
    for c in &calls {
        per_id.entry(c.id.as_str()).or_default().push(c);
    }
    assert_eq!(per_id.len(), N, "every message reached the handler");
    let repeats: Vec<_> = per_id.iter().filter(|(_, c)| c.len() > 1).collect();
    // Only deliveries in flight at the kill can be repeated (the consumer
    // runs at most `concurrency` at once), and with the same key.
    assert!(
        repeats.len() <= concurrency,
        "{} repeats for {concurrency} in flight",
        repeats.len()
    );
    for (id, cs) in &repeats {
        assert!(cs.iter().all(|c| c.idempotency_key.as_deref() == Some(*id)));
    }
    let rows = inbox(&pool, "killme").await;
    assert_eq!(rows.len(), N);
    assert!(rows.values().all(|r| r.processed));
}

/// A Rust handler writing its own effect in the inbox transaction; the
/// first delivery of each message fails after writing. It asks for a
/// transaction per message (`max_group` 1).
struct Effects;

impl outbox_relay::consumer::Handler for Effects {
    fn max_group(&self) -> usize {
        1
    }

    async fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        d: &outbox_relay::consumer::Delivery,
    ) -> outbox_relay::consumer::Outcome {
        use outbox_relay::consumer::Outcome;
        if let Err(e) = sqlx::query("INSERT INTO effects (message_id, delivered) VALUES ($1, $2)")
            .bind(d.message_id)
            .bind(d.delivered)
            .execute(&mut *tx)
            .await
        {
            return Outcome::Retry(e.to_string());
        }
        if d.delivered == 1 {
            Outcome::Retry("first delivery fails after writing".into())
        } else {
            Outcome::Processed
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_handler_writes_roll_back_with_the_inbox_row() {
    let stack = stack();
    let (_url, pool) = fresh_db(&stack, "c_rust").await;
    sqlx::query(
        "CREATE TABLE effects (message_id uuid NOT NULL, delivered int8 NOT NULL, \
         txid int8 NOT NULL DEFAULT txid_current())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "crust", Duration::from_secs(120)).await;
    let cfg = outbox_relay::consumer::ConsumeConfig {
        ack_wait: Duration::from_secs(5),
        max_ack_pending: 50,
        concurrency: 8,
        backoff: vec![Duration::from_millis(200)],
        max_parked_keys: 100_000,
        ..rust_cfg(&stream, "rust", "crust")
    };
    // Published first: with sharing, the first pulls would form groups.
    let ids: Vec<Uuid> = (0..24).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        publish(&js, "crust.e", Some(*id), &format!("a{i}"), b"{}").await;
    }
    let consumer = RustConsumer::start(cfg, &pool, &js, Effects);
    wait_processed(&pool, "rust", ids.len()).await;
    for id in &ids {
        let kept: Vec<i64> =
            sqlx::query_scalar("SELECT delivered FROM effects WHERE message_id = $1")
                .bind(id)
                .fetch_all(&pool)
                .await
                .unwrap();
        assert_eq!(
            kept,
            vec![2],
            "the failed attempt's write was rolled back, the successful one kept"
        );
    }
    let rows = inbox(&pool, "rust").await;
    assert!(ids
        .iter()
        .all(|id| rows[id].attempts == 2 && rows[id].processed));
    consumer.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_handler_keeps_its_delivery_and_sigterm_lets_it_finish() {
    let Fixture {
        pool,
        js,
        stream,
        handler,
        mut consumer,
    } = fixture("c_slow", "cslow", "slow", DUP, &["--ack-wait", "2s"]).await;
    let slow = Uuid::new_v4();
    publish(&js, "cslow.e", Some(slow), "a", br#"{"sleep_ms": 5000}"#).await;
    wait_processed(&pool, "slow", 1).await;
    let info = js
        .get_consumer_from_stream::<jetstream::consumer::pull::Config, _, _>("slow", &stream)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(
        info.num_redelivered, 0,
        "a running delivery was redelivered"
    );
    assert_eq!(handler.calls_for(slow).len(), 1);

    // SIGTERM while a slow delivery runs: it finishes, is acked, exit 0.
    let last = Uuid::new_v4();
    publish(&js, "cslow.e", Some(last), "b", br#"{"sleep_ms": 1500}"#).await;
    eventually(T, "handler called", || async {
        !handler.calls_for(last).is_empty()
    })
    .await;
    let st = consumer.term(Duration::from_secs(30));
    assert!(st.success(), "graceful stop exits 0, got {st:?}");
    assert!(
        inbox(&pool, "slow").await[&last].processed,
        "in-flight delivery finished before exit"
    );
    assert_all_acked(&js, &stream, "slow").await;
}

/// Issue 18, defect 8: `consume` on a 3-node cluster (R3 stream, all three
/// servers in NATS_URL), the stream leader killed twice under load: every
/// message reaches the handler exactly once, in order per aggregate, and
/// pulls resume by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consume_rides_out_the_stream_leader_killed_twice_on_a_3_node_cluster() {
    let stack = stack();
    let (url, _pool) = fresh_db(&stack, "c_cluster").await;
    let cluster = OwnCluster::up("nats-cluster-consume");
    let client = cluster.client().await;
    let js = jetstream::new(client.clone());
    // Short requests, so the first answer of a new leader is seen at once.
    let probe = jetstream::ContextBuilder::new()
        .timeout(Duration::from_millis(200))
        .build(client);
    let stream = wire::stream_name("ccl");
    js.create_stream(stream::Config {
        name: stream.clone(),
        subjects: vec!["ccl.>".into()],
        num_replicas: 3,
        ..Default::default()
    })
    .await
    .unwrap();
    let handler = Handler::default();
    let handler_url = handler.serve().await;
    // Deliveries lost in transit with a dead server come back after ack_wait.
    let consumer = Service::consumer(
        &url,
        &cluster.url,
        &stream,
        "ccl",
        &handler_url,
        &["--ack-wait", "10s"],
    );

    // A producer that rides out the outage: each message until acked, in
    // order, until told to stop (so the handler has work in both rounds).
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (js, stop) = (js.clone(), stop.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(2));
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                let id = Uuid::new_v4();
                loop {
                    let mut h = async_nats::HeaderMap::new();
                    h.insert(wire::MSG_ID, id.to_string().as_str());
                    h.insert(wire::AGGREGATE_ID, format!("a{}", i % 20).as_str());
                    let body = serde_json::json!({"seq": i}).to_string();
                    let sent = js.publish_with_headers("ccl.e", h, body.into()).await;
                    if let Ok(ack) = sent {
                        if ack.await.is_ok() {
                            break;
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                i += 1;
            }
            i
        })
    };
    for round in 1..=2 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let leader = cluster.wait_leader(&js, &stream, T).await;
        cluster.node(leader, "kill");
        let killed = Instant::now();
        // The stream's and the consumer's leaders answer again, elsewhere
        // (they need not be on one node): from then on the wait is ours.
        let deadline = killed + T;
        loop {
            let info = async {
                let mut c: jetstream::consumer::PullConsumer =
                    probe.get_consumer_from_stream("ccl", &stream).await.ok()?;
                c.info().await.ok()?.cluster.clone()?.leader
            }
            .await;
            let stream_leader = cluster.leader(&probe, &stream).await;
            if info.is_some_and(|l| l != format!("n{leader}"))
                && stream_leader.is_some_and(|l| l != leader)
            {
                break;
            }
            assert!(Instant::now() < deadline, "the consumer has no leader");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let answered = Instant::now();
        let before = handler.calls().len();
        eventually(T, "the handler is called again after the kill", || async {
            handler.calls().len() > before
        })
        .await;
        println!(
            "round {round}: killed stream leader n{leader}; the stream's and the consumer's leaders answered {:?} later; \
             the next handler call came {:?} after that",
            answered - killed,
            answered.elapsed()
        );
        cluster.node(leader, "start");
        cluster.wait_healthy(&js, &stream, T).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let n = producer.await.unwrap();
    eventually(T, "every message handled", || async {
        let done: std::collections::HashSet<String> =
            handler.calls().into_iter().map(|c| c.id).collect();
        done.len() == n
    })
    .await;
    let calls = handler.calls();
    assert_eq!(calls.len(), n, "a message reached the handler twice");
    // A delivery lost in transit with the dead server would come back after
    // ack_wait, behind later messages of its aggregate; the consumer sees
    // the gap in its delivery sequence and resets to the ack floor instead.
    let mut last: HashMap<String, u64> = HashMap::new();
    let mut reordered = 0;
    for c in &calls {
        let seq = c.body["payload"]["seq"].as_u64().unwrap();
        let agg = format!("a{}", seq % 20);
        if last.insert(agg, seq).is_some_and(|prev| seq < prev) {
            reordered += 1;
        }
    }
    assert_eq!(reordered, 0, "handler calls out of aggregate order");
    drop(consumer);
}

/// Issue 12, defect 3: one failing aggregate with 60 queued messages does
/// not hold up another aggregate (its later messages are parked in the
/// inbox, not held ack-pending), and once it recovers its messages reach
/// the handler once each, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_aggregate_never_holds_up_the_others() {
    let Fixture {
        pool,
        js,
        stream,
        handler,
        consumer: _consumer,
    } = fixture(
        "t_hol",
        "chol",
        "hol",
        DUP,
        &["--max-ack-pending", "50", "--backoff", "1s"],
    )
    .await;
    // The first hot message fails three times, then everything passes.
    let mut hot = Vec::new();
    for i in 0..120 {
        let id = Uuid::new_v4();
        let answers = if i == 0 {
            "[500, 500, 500, 200]"
        } else {
            "[200]"
        };
        let body = format!(r#"{{"answers": {answers}, "i": {i}}}"#);
        publish(
            &js,
            "chol.event.placed.v2",
            Some(id),
            "hot",
            body.as_bytes(),
        )
        .await;
        hot.push(id);
    }
    let cold = Uuid::new_v4();
    let published = Instant::now();
    publish(&js, "chol.event.placed.v2", Some(cold), "cold", b"{}").await;
    eventually(
        T,
        "the other aggregate is handled while hot fails",
        || async { !handler.calls_for(cold).is_empty() },
    )
    .await;
    // Issue 12's figure (< 1 s with 120 queued); a figure, not an assert.
    let delay = handler.calls_for(cold)[0].at.duration_since(published);
    eprintln!("cold handled {delay:?} after its publish, behind 120 failing hot messages");
    assert!(
        handler.calls_for(hot[1]).is_empty(),
        "a later message of the failing aggregate ran before its predecessor"
    );
    wait_processed(&pool, "hol", 121).await;
    assert_all_acked(&js, &stream, "hol").await;
    let order: Vec<String> = handler
        .calls()
        .into_iter()
        .filter(|c| c.status == 200 && c.id != cold.to_string())
        .map(|c| c.id)
        .collect();
    let expected: Vec<String> = hot.iter().map(Uuid::to_string).collect();
    assert_eq!(
        order, expected,
        "hot's messages succeeded once each, in order"
    );
}

/// Issue 12, defect 6: two durables dead-letter the same message; both
/// dead letters are stored (their ids differ per consumer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_dead_letters_of_one_message_are_both_kept() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_twodlq").await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "ctwo", DUP).await;
    let handler = Handler::default();
    let handler_url = handler.serve().await;
    let id = Uuid::new_v4();
    publish(
        &js,
        "ctwo.event.placed.v2",
        Some(id),
        "a",
        br#"{"answers": [422]}"#,
    )
    .await;
    let _c1 = Service::consumer(
        &url,
        &stack.nats_url,
        &stream,
        "one",
        &handler_url,
        &["--context", "ctwo"],
    );
    let _c2 = Service::consumer(
        &url,
        &stack.nats_url,
        &stream,
        "two",
        &handler_url,
        &["--context", "ctwo"],
    );
    wait_processed(&pool, "one", 1).await;
    wait_processed(&pool, "two", 1).await;
    let dlq = read_stream(
        &stack.nats_url,
        &wire::dlq_stream_name(&wire::consumer_dlq_prefix("ctwo")),
        2,
        T,
    )
    .await;
    let mut consumers: Vec<&str> = dlq.iter().filter_map(|g| g.h(wire::DLQ_CONSUMER)).collect();
    consumers.sort();
    assert_eq!(consumers, vec!["one", "two"]);
    assert!(dlq
        .iter()
        .all(|g| g.h(wire::DLQ_ORIGINAL_ID) == Some(id.to_string().as_str())));
}

/// Issue 12, defect 2: the dead-letter stream refuses the dead letter of a
/// message on its last attempt. The message is not lost: `/readyz` says
/// so, and once the DLQ has room the dead letter is stored and the original
/// acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_the_dlq_refuses_waits_until_it_is_stored() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_dlqfull").await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "cfull", DUP).await;
    // A full DLQ: one message, new ones refused.
    let dlq_name = wire::dlq_stream_name(&wire::consumer_dlq_prefix("cfull"));
    js.create_stream(stream::Config {
        name: dlq_name.clone(),
        subjects: vec![format!("{}.>", wire::consumer_dlq_prefix("cfull"))],
        max_messages: 1,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    })
    .await
    .unwrap();
    js.publish(
        format!("{}.filler", wire::consumer_dlq_prefix("cfull")),
        "x".into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let handler = Handler::default();
    let handler_url = handler.serve().await;
    let consumer = Service::consumer(
        &url,
        &stack.nats_url,
        &stream,
        "full",
        &handler_url,
        &[
            "--context",
            "cfull",
            "--max-deliver",
            "2",
            "--backoff",
            "100ms",
        ],
    );
    let id = Uuid::new_v4();
    publish(
        &js,
        "cfull.event.placed.v2",
        Some(id),
        "a",
        br#"{"answers": [500]}"#,
    )
    .await;
    eventually(T, "/readyz names the refused dead letter", || async {
        let (status, body) = consumer.http_get("/readyz").await;
        status == 503 && body.contains("dead letter")
    })
    .await;
    assert!(!inbox(&pool, "full").await[&id].processed);
    js.get_stream(&dlq_name)
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    wait_processed(&pool, "full", 1).await;
    assert_all_acked(&js, &stream, "full").await;
    let dlq = read_stream(&stack.nats_url, &dlq_name, 1, T).await;
    assert_eq!(
        dlq[0].h(wire::DLQ_ORIGINAL_ID),
        Some(id.to_string().as_str())
    );
    assert_eq!(handler.calls_for(id).len(), 2, "two attempts, then the DLQ");
    eventually(T, "/readyz ready again", || async {
        consumer.http_get("/readyz").await.0 == 200
    })
    .await;
}

/// Issue 12: per-aggregate order and exactly one successful call per
/// message across two instances of one durable, the active one killed
/// (kill -9) and restarted twice under load, with failures parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_holds_across_two_instances_and_kill_9() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_twoinst").await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "cinst", DUP).await;
    let handler = Handler::default();
    let handler_url = handler.serve().await;
    let args = [
        "--context",
        "cinst",
        "--backoff",
        "200ms",
        "--concurrency",
        "8",
    ];
    let mut a = Service::consumer(&url, &stack.nats_url, &stream, "inst", &handler_url, &args);
    let mut b = Service::consumer_named(
        &url,
        &stack.nats_url,
        &stream,
        "inst",
        "inst-b",
        &handler_url,
        &args,
    );
    eventually(T, "the second instance is standby", || async {
        b.scrape().await.value("outbox_consumer_standby") == Some(1.0)
    })
    .await;
    const N: usize = 600;
    let mut sent: HashMap<String, Vec<String>> = HashMap::new();
    let publisher = {
        let js = js.clone();
        tokio::spawn(async move {
            let mut sent: Vec<(String, String)> = Vec::new();
            for i in 0..N {
                let id = Uuid::new_v4();
                let agg = format!("g{}", i % 12);
                // Every 7th message fails once.
                let body = if i % 7 == 0 {
                    r#"{"answers": [503, 200]}"#
                } else {
                    "{}"
                };
                publish(
                    &js,
                    "cinst.event.placed.v2",
                    Some(id),
                    &agg,
                    body.as_bytes(),
                )
                .await;
                sent.push((agg, id.to_string()));
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            sent
        })
    };
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(800)).await;
        a.kill9();
        std::mem::swap(&mut a, &mut b);
        a.wait_ready();
        b.restart();
    }
    for (agg, id) in publisher.await.unwrap() {
        sent.entry(agg).or_default().push(id);
    }
    wait_processed(&pool, "inst", N).await;
    assert_all_acked(&js, &stream, "inst").await;
    let calls = handler.calls();
    let agg_of: HashMap<String, String> = sent
        .iter()
        .flat_map(|(agg, ids)| ids.iter().map(move |id| (id.clone(), agg.clone())))
        .collect();
    let mut succeeded: HashMap<String, Vec<String>> = HashMap::new();
    for c in calls.iter().filter(|c| c.status == 200) {
        succeeded
            .entry(agg_of[&c.id].clone())
            .or_default()
            .push(c.id.clone());
    }
    // A call in flight when its instance was killed is made again by the
    // next one (HTTP is at least once; `Idempotency-Key` names the repeat),
    // at once: before any later message of its aggregate.
    let mut repeats = 0;
    for (agg, ids) in &sent {
        let mut calls = succeeded[agg].clone();
        let before = calls.len();
        calls.dedup();
        repeats += before - calls.len();
        assert_eq!(&calls, ids, "aggregate {agg}: every message, in order");
    }
    println!("calls repeated after a kill -9: {repeats}");
    assert!(
        repeats <= 2 * 8,
        "more repeats than calls in flight at the kills"
    );
}

/// Issue 12, defect 5: a transaction held open across the HTTP call was
/// killed by `idle_in_transaction_session_timeout`, so a successful call was
/// repeated and at last dead-lettered. The HTTP handler now runs outside any
/// transaction: one call, processed, nothing dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_successful_call_is_not_repeated_when_idle_transactions_are_killed() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_idletx").await;
    sqlx::query("ALTER DATABASE t_idletx SET idle_in_transaction_session_timeout = '300ms'")
        .execute(&pool)
        .await
        .unwrap();
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "cidle", DUP).await;
    let handler = Handler::default();
    let handler_url = handler.serve().await;
    let _consumer = Service::consumer(
        &url,
        &stack.nats_url,
        &stream,
        "idle",
        &handler_url,
        &[
            "--context",
            "cidle",
            "--backoff",
            "100ms",
            "--max-deliver",
            "3",
        ],
    );
    let id = Uuid::new_v4();
    publish(
        &js,
        "cidle.event.placed.v2",
        Some(id),
        "a",
        br#"{"sleep_ms": 800}"#,
    )
    .await;
    wait_processed(&pool, "idle", 1).await;
    assert_all_acked(&js, &stream, "idle").await;
    let row = &inbox(&pool, "idle").await[&id];
    assert_eq!(row.attempts, 1);
    assert!(row.last_error.is_none(), "{:?}", row.last_error);
    assert_eq!(
        handler.calls_for(id).len(),
        1,
        "the successful call was repeated"
    );
}

/// A parked message that leaves the stream before its retry (max age, a
/// purge) is recorded and counted as `expired`, and its aggregate's later
/// messages go on; the consumer does not spin on it. Review N5 (issue 56):
/// it was then dropped, with no dead letter; it is dead-lettered from its
/// inbox row (id, subject, reason), so every exhausted failure reaches the
/// DLQ as SPEC §6 says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_message_gone_from_the_stream_is_dead_lettered_and_its_aggregate_goes_on() {
    let Fixture {
        pool,
        js,
        stream,
        handler,
        consumer,
    } = fixture("t_gone", "cgone", "gone", DUP, &["--backoff", "2s"]).await;
    let first = Uuid::new_v4();
    let second = Uuid::new_v4();
    publish(
        &js,
        "cgone.event.placed.v2",
        Some(first),
        "a",
        br#"{"answers": [500]}"#,
    )
    .await;
    publish(&js, "cgone.event.placed.v2", Some(second), "a", b"{}").await;
    eventually(T, "the first message is parked", || async {
        consumer
            .scrape()
            .await
            .value("outbox_consumer_parked_aggregates")
            == Some(1.0)
    })
    .await;
    js.get_stream(&stream)
        .await
        .unwrap()
        .delete_message(1)
        .await
        .unwrap();
    wait_processed(&pool, "gone", 2).await;
    let rows = inbox(&pool, "gone").await;
    assert!(
        rows[&first]
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("left the stream")),
        "{:?}",
        rows[&first].last_error
    );
    assert_eq!(handler.calls_for(first).len(), 1);
    assert_eq!(handler.calls_for(second).len(), 1);
    let m = consumer.scrape().await;
    assert_eq!(
        m.value("outbox_consumer_messages_total{result=\"expired\"}"),
        Some(1.0)
    );
    let prefix = wire::consumer_dlq_prefix("cgone");
    let dlq = read_stream(&stack().nats_url, &wire::dlq_stream_name(&prefix), 1, T).await;
    assert_eq!(dlq.len(), 1, "one dead letter");
    let letter = &dlq[0];
    assert_eq!(
        letter.subject,
        wire::consumer_dlq_subject(&prefix, "cgone.event.placed.v2")
    );
    let first_text = first.to_string();
    assert_eq!(letter.h(wire::DLQ_ORIGINAL_ID), Some(first_text.as_str()));
    assert!(
        letter
            .h(wire::DLQ_REASON)
            .is_some_and(|r| r.starts_with("expired") && r.contains("500")),
        "{:?}",
        letter.h(wire::DLQ_REASON)
    );
}

/// Issue 56, review N4: exactly-once across a failover needs the
/// consumer's database to keep the commits it acknowledged (the inbox row,
/// a Rust handler's effects). Nothing said so. A database that may lose
/// them is named at start, in one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_may_lose_acknowledged_commits_is_named_at_start() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_synccommit").await;
    sqlx::query("DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET synchronous_commit = off', current_database()); END $$")
        .execute(&pool)
        .await
        .unwrap();
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "csync", DUP).await;
    let handler = Handler::default();
    let handler_url = handler.serve().await;
    let mut consumer = Service::consumer_named(
        &url,
        &stack.nats_url,
        &stream,
        "sync",
        "csync",
        &handler_url,
        &["--context", "csync"],
    );
    consumer.wait_ready();
    let log = consumer.log_text();
    assert!(
        log.contains("synchronous_commit is off for the consumer's database"),
        "{log}"
    );
}

/// A stream that deletes acked messages (work-queue or interest retention)
/// would lose a parked message: the consumer refuses it with one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_deletes_acked_messages_is_refused_at_start() {
    let stack = stack();
    let (url, _pool) = fresh_db(&stack, "t_wq").await;
    let js = js(&stack.nats_url).await;
    let _ = js.delete_stream("CWQ_EVENTS").await;
    js.create_stream(stream::Config {
        name: "CWQ_EVENTS".into(),
        subjects: vec!["cwq.>".into()],
        retention: stream::RetentionPolicy::WorkQueue,
        ..Default::default()
    })
    .await
    .unwrap();
    let (code, stderr) = run_bounded(
        &[
            "consume",
            "--database-url",
            &url,
            "--nats-url",
            &stack.nats_url,
            "--context",
            "cwq",
            "--stream",
            "CWQ_EVENTS",
            "--durable",
            "wq",
            "--handler-url",
            "http://127.0.0.1:9/h",
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        Duration::from_secs(30),
    );
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("retention") && stderr.contains("CWQ_EVENTS"),
        "{stderr}"
    );
}

/// A durable new to a large inbox: the statistics say its consumer name has
/// no rows (ANALYZE ran before it started), so with the key led by
/// `consumer` the planner found a batch of its rows by scanning all of that
/// durable's rows, and every completion got slower as its rows grew (found
/// by profiling the consumer bench: 65 ms per 20-row batch). With the key led
/// by the message id, the ids are the index condition whatever the
/// statistics say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_finds_a_batch_by_message_id_whatever_the_statistics_say() {
    let stack = stack();
    let (_, pool) = fresh_db(&stack, "c_inbox_key").await;
    sqlx::raw_sql(
        "INSERT INTO inbox_messages (consumer, message_id, subject) \
           SELECT 'old', gen_random_uuid(), 's' FROM generate_series(1, 20000); \
         ANALYZE inbox_messages; \
         INSERT INTO inbox_messages (consumer, message_id, subject) \
           SELECT 'new', gen_random_uuid(), 's' FROM generate_series(1, 50000);",
    )
    .execute(&pool)
    .await
    .unwrap();
    let ids: Vec<Uuid> =
        sqlx::query_scalar("SELECT message_id FROM inbox_messages WHERE consumer = 'new' LIMIT 20")
            .fetch_all(&pool)
            .await
            .unwrap();
    let plan: serde_json::Value = sqlx::query_scalar(
        "EXPLAIN (FORMAT JSON) UPDATE inbox_messages SET processed_at = now() \
         WHERE consumer = $1 AND message_id = ANY($2)",
    )
    .bind("new")
    .bind(&ids)
    .fetch_one(&pool)
    .await
    .unwrap();
    let scan = &plan[0]["Plan"]["Plans"][0];
    let cond = scan["Index Cond"].as_str().unwrap_or_default();
    assert!(
        cond.contains("message_id = ANY"),
        "the batch's ids are the index condition: {scan:#}"
    );
}

/// SPEC §9 `consumer reset --seq N`: the handler sees every message from N
/// once more, in stream order; one before N is not called again; and an
/// ordinary redelivery of a message processed after the reset stays a
/// duplicate. Bad input is one line and a non-zero exit, and changes
/// nothing; so does a dry run. Review R1: in the version matrix too, where
/// nats-server 2.10–2.12 have no in-place reset (the durable is made again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_reset_replays_from_a_sequence_and_only_then() {
    let stack = stack();
    let window = Duration::from_millis(500);
    let mut f = fixture("c_reset", "creset", "creset", window, &[]).await;
    let url = db_url(&stack.admin_url, "c_reset");
    let ids: Vec<Uuid> = (0..10).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        publish(&f.js, "creset.e", Some(*id), &format!("a{}", i % 3), b"{}").await;
    }
    wait_processed(&f.pool, "creset", 10).await;
    assert_all_acked(&f.js, &f.stream, "creset").await;

    let reset = |extra: &[&str]| {
        let mut args = vec![
            "consumer",
            "reset",
            "--database-url",
            &url,
            "--nats-url",
            &stack.nats_url,
        ];
        args.extend_from_slice(extra);
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let out = std::process::Command::new(BIN)
            .args(&args)
            .output()
            .unwrap();
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    // While an instance consumes, a reset would put messages in flight ahead
    // of earlier ones of their aggregate: refused.
    let (ok, out) = reset(&["--stream", &f.stream, "--durable", "creset", "--seq", "4"]);
    assert!(!ok && out.contains("being consumed"), "{out}");
    f.consumer.term(Duration::from_secs(30));
    for bad in [
        &[
            "--stream",
            "NOPE_EVENTS",
            "--durable",
            "creset",
            "--seq",
            "4",
        ][..],
        &["--stream", &f.stream, "--durable", "nope", "--seq", "4"],
        &["--stream", &f.stream, "--durable", "creset", "--seq", "0"],
        &["--stream", &f.stream, "--durable", "creset", "--seq", "99"],
        &[
            "--stream",
            &f.stream,
            "--durable",
            "creset",
            "--time",
            "2999-01-01T00:00:00Z",
        ],
        &["--stream", &f.stream, "--durable", "creset"],
    ] {
        let (ok, out) = reset(bad);
        assert!(!ok, "{bad:?} accepted: {out}");
        assert!(out.trim_start().starts_with("error"), "{bad:?}: {out}");
    }
    let resets: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_resets")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(resets, 0, "bad input recorded nothing");

    // A dry run says what would happen, and changes nothing.
    let before =
        f.js.get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
            "creset", &f.stream,
        )
        .await
        .unwrap()
        .cached_info()
        .delivered
        .stream_sequence;
    let (ok, out) = reset(&[
        "--stream",
        &f.stream,
        "--durable",
        "creset",
        "--seq",
        "4",
        "--dry-run",
    ]);
    assert!(
        ok && out.contains("dry run: durable creset")
            && out.contains("would start over from sequence 4: 7 messages"),
        "{out}"
    );
    let after =
        f.js.get_consumer_from_stream::<async_nats::jetstream::consumer::pull::Config, _, _>(
            "creset", &f.stream,
        )
        .await
        .unwrap()
        .cached_info()
        .delivered
        .stream_sequence;
    assert_eq!((before, after), (10, 10), "a dry run moves nothing");
    let resets: i64 = sqlx::query_scalar("SELECT count(*) FROM inbox_resets")
        .fetch_one(&f.pool)
        .await
        .unwrap();
    assert_eq!(resets, 0, "a dry run records no reset");

    // On every supported server: in place on 2.14+, made again before.
    let (ok, out) = reset(&["--stream", &f.stream, "--durable", "creset", "--seq", "4"]);
    assert!(
        ok && out.contains("starts over from sequence 4: 7 messages"),
        "{out}"
    );
    f.consumer.restart();
    eventually(T, "messages 4..=10 handled once more", || async {
        ids[3..]
            .iter()
            .all(|id| f.handler.calls_for(*id).len() == 2)
    })
    .await;
    assert_all_acked(&f.js, &f.stream, "creset").await;
    for id in &ids[..3] {
        assert_eq!(f.handler.calls_for(*id).len(), 1, "before the reset point");
    }
    // In stream order, each aggregate's messages in order.
    let second: Vec<String> = f
        .handler
        .calls()
        .into_iter()
        .skip(10)
        .map(|c| c.id)
        .collect();
    let expected: Vec<String> = ids[3..].iter().map(|i| i.to_string()).collect();
    let mut sorted = second.clone();
    sorted.sort_by_key(|id| expected.iter().position(|e| e == id));
    for key in 0..3 {
        let of = |v: &[String]| -> Vec<String> {
            v.iter()
                .filter(|id| {
                    let i = ids.iter().position(|x| x.to_string() == **id).unwrap();
                    i % 3 == key
                })
                .cloned()
                .collect()
        };
        assert_eq!(of(&second), of(&sorted), "aggregate a{key} in order");
    }

    // An ordinary redelivery after the reset: the same id stored again.
    tokio::time::sleep(window * 2).await;
    publish(&f.js, "creset.e", Some(ids[5]), "a2", b"{}").await;
    eventually(T, "the repeat counted as a duplicate", || async {
        f.consumer
            .scrape()
            .await
            .value("outbox_consumer_messages_total{result=\"duplicate\"}")
            .unwrap_or(0.0)
            >= 1.0
    })
    .await;
    assert_eq!(
        f.handler.calls_for(ids[5]).len(),
        2,
        "not called a third time"
    );

    // --time finds the first message stored at or after it.
    f.consumer.term(Duration::from_secs(30));
    let at =
        f.js.get_stream(&f.stream)
            .await
            .unwrap()
            .get_raw_message(7)
            .await
            .unwrap()
            .time
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap();
    let (ok, out) = reset(&["--stream", &f.stream, "--durable", "creset", "--time", &at]);
    assert!(
        ok && out.contains("starts over from sequence 7"),
        "{at}: {out}"
    );

    // Forward past what it has not had acked (7 to 10, after the reset):
    // refused, unless said.
    let (ok, out) = reset(&["--stream", &f.stream, "--durable", "creset", "--seq", "11"]);
    assert!(
        !ok && out.contains("passes over 4 messages") && out.contains("--skip-unacked"),
        "{out}"
    );
    let (ok, out) = reset(&[
        "--stream",
        &f.stream,
        "--durable",
        "creset",
        "--seq",
        "11",
        "--skip-unacked",
    ]);
    assert!(
        ok && out.contains("starts over from sequence 11") && out.contains("passes over 4"),
        "{out}"
    );
}

/// `outbox-relay …` to its end: (success, stdout + stderr).
fn run_cli(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(BIN).args(args).output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Review D4 (issue 61, item 8): `dlq list` ended its read on the first
/// fetch that brought nothing within 500 ms, so a slow link (a leader
/// election, a WAN, a loaded server) listed fewer letters than the stream
/// holds, and said nothing; a replay or delete of that listing then acted
/// on a part. Over a link silent for 7 s partway through, every letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_over_a_slow_link_lists_every_letter() {
    let stack = stack();
    let js = jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let name = "DLQ_SLOW_LIST";
    let _ = js.delete_stream(name).await;
    js.create_stream(jetstream::stream::Config {
        name: name.into(),
        subjects: vec!["dlq.slowlist.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    // More than one fetch's worth (500).
    let count = 1_200;
    let mut acks = Vec::new();
    for i in 0..count {
        let mut h = async_nats::HeaderMap::new();
        let id = Uuid::new_v4().to_string();
        h.insert(wire::MSG_ID, format!("cons:{id}").as_str());
        h.insert(wire::DLQ_ORIGINAL_ID, id.as_str());
        h.insert(wire::DLQ_REASON, "handler answered 422: no");
        h.insert(wire::DLQ_CONSUMER, "billing");
        h.insert(wire::DLQ_ORIGINAL_SUBJECT, "orders.paid");
        acks.push(
            js.publish_with_headers(format!("dlq.slowlist.orders.paid.{i}"), h, "{}".into())
                .await
                .unwrap(),
        );
    }
    for a in acks {
        a.await.unwrap();
    }
    // The link goes silent (both ways, nothing reset) partway through the
    // first batch, for longer than a fetch waits (5.5 s): a leader
    // election, a stalled server, a WAN hiccup.
    let proxy = Proxy::start(stack.nats_url.trim_start_matches("nats://")).await;
    // Past the connection's and the reader's setup, inside the letters.
    proxy.pause_after(64 * 1024);
    let listing = {
        let url = proxy.nats_url();
        tokio::task::spawn_blocking(move || {
            run_cli(&["dlq", "list", "--nats-url", &url, "--stream", name])
        })
    };
    eventually(T, "the link silent mid-listing", || async {
        proxy.is_paused()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(7)).await;
    proxy.resume();
    let (ok, out) = listing.await.unwrap();
    assert!(ok, "{out}");
    assert!(
        out.lines().any(|l| l == format!("{count} dead letters")),
        "every letter listed: {}",
        out.lines().last().unwrap_or_default()
    );
}

/// Review D1 (issue 61, item 8): a consumer's dead-letter stream of
/// another name (`--dlq-prefix deadletters.cdlqn`: `DEADLETTERS_CDLQN`)
/// was taken for an events stream by its name, read for the relay's
/// letters alone, and listed "0 dead letters" while it held one. The
/// commands now tell a stream by what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_reads_a_dead_letter_stream_of_any_name() {
    let stack = stack();
    let prefix = "deadletters.cdlqn";
    let f = fixture(
        "c_dlq_named",
        "cdlqn",
        "cdlqn",
        DUP,
        &["--dlq-prefix", prefix],
    )
    .await;
    let bad = Uuid::new_v4();
    publish(&f.js, "cdlqn.e", Some(bad), "a", br#"{"answers": [422]}"#).await;
    wait_processed(&f.pool, "cdlqn", 1).await;
    let dlq = wire::dlq_stream_name(prefix);
    let (ok, out) = run_cli(&[
        "dlq",
        "list",
        "--nats-url",
        &stack.nats_url,
        "--stream",
        &dlq,
    ]);
    assert!(ok, "{out}");
    assert!(
        out.lines()
            .any(|l| l.contains(&bad.to_string()) && l.contains("422")),
        "the letter in {dlq} is listed: {out}"
    );
    // The events stream still shows the relay's letters alone: none here.
    let (ok, out) = run_cli(&[
        "dlq",
        "list",
        "--nats-url",
        &stack.nats_url,
        "--stream",
        &f.stream,
    ]);
    assert!(ok && !out.contains(&bad.to_string()), "{out}");
}

/// SPEC §16 (issue 61, item 3): every new dead letter says its class, as
/// the playbook triages it, and a fingerprint of its cause that letters of
/// one cause share; `dlq list` shows both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_carry_their_class_and_a_fingerprint_of_their_cause() {
    let stack = stack();
    let f = fixture(
        "c_dlq_class",
        "cdlqc",
        "cdlqc",
        DUP,
        &["--max-deliver", "2", "--backoff", "100ms"],
    )
    .await;
    let ids: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
    let bodies: [&[u8]; 5] = [
        br#"{"answers": [422]}"#,
        br#"{"answers": [500], "order": 1}"#,
        br#"{"answers": [503]}"#,
        br#"{"answers": [500], "order": 2}"#,
        b"not json",
    ];
    for (i, (id, body)) in ids.iter().zip(bodies).enumerate() {
        publish(&f.js, "cdlqc.e", Some(*id), &format!("k{i}"), body).await;
    }
    let dlq = wire::dlq_stream_name(&wire::consumer_dlq_prefix("cdlqc"));
    let listed = |dlq: &str| {
        let (ok, out) = run_cli(&[
            "dlq",
            "list",
            "--nats-url",
            &stack.nats_url,
            "--stream",
            dlq,
            "--json",
        ]);
        assert!(ok, "{out}");
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    eventually(T, "five dead letters", || async {
        listed(&dlq).as_array().is_some_and(|a| a.len() == 5)
    })
    .await;
    let letters = listed(&dlq);
    let of = |id: &Uuid| {
        letters
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["id"] == id.to_string())
            .unwrap_or_else(|| panic!("no letter for {id}: {letters}"))
            .clone()
    };
    let classes: Vec<String> = ids
        .iter()
        .map(|id| of(id)["class"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        classes,
        [
            "handler_rejected",
            "handler_failed",
            "transient_exhausted",
            "handler_failed",
            "bad_message"
        ],
        "{letters}"
    );
    let fp = |i: usize| of(&ids[i])["fingerprint"].as_str().unwrap().to_owned();
    assert_eq!(fp(1), fp(3), "one cause, one fingerprint: {letters}");
    assert_ne!(fp(1), fp(2), "{letters}");
    // In the letter itself, for any reader of the stream.
    let seq = of(&ids[0])["seq"].as_u64().unwrap();
    let raw =
        f.js.get_stream(&dlq)
            .await
            .unwrap()
            .get_raw_message(seq)
            .await
            .unwrap();
    assert_eq!(
        raw.headers.get(wire::DLQ_CLASS).map(|v| v.as_str()),
        Some("handler_rejected")
    );
    assert_eq!(
        raw.headers
            .get(wire::DLQ_FINGERPRINT)
            .map(|v| v.as_str().to_owned()),
        Some(fp(0))
    );
}

/// SPEC §9 dead letters: `dlq list` shows what the consumer dead-lettered;
/// `dlq replay --id` calls the handler once more, exactly once, with the
/// original id; a second replay of it is reported and calls nothing; bad
/// input is one line and a non-zero exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_list_shows_dead_letters_and_replay_calls_the_handler_once_more() {
    let stack = stack();
    let f = fixture("c_dlq_replay", "cdlqr", "cdlqr", DUP, &[]).await;
    let url = db_url(&stack.admin_url, "c_dlq_replay");
    let dlq = wire::dlq_stream_name(&wire::consumer_dlq_prefix("cdlqr"));
    let (bad, good) = (Uuid::new_v4(), Uuid::new_v4());
    publish(
        &f.js,
        "cdlqr.e",
        Some(bad),
        "a",
        br#"{"answers": [422, 200]}"#,
    )
    .await;
    publish(&f.js, "cdlqr.e", Some(good), "b", b"{}").await;
    wait_processed(&f.pool, "cdlqr", 2).await;
    assert_all_acked(&f.js, &f.stream, "cdlqr").await;

    let nats = stack.nats_url.as_str();
    let (ok, out) = run_cli(&["dlq", "list", "--nats-url", nats, "--stream", &dlq]);
    assert!(ok, "{out}");
    let line = out
        .lines()
        .find(|l| l.contains(&bad.to_string()))
        .unwrap_or_else(|| panic!("no line for {bad}: {out}"));
    for part in ["cdlqr.e", "consumer=cdlqr", "attempts=1", "422"] {
        assert!(line.contains(part), "{part} missing: {line}");
    }
    assert!(out.contains("1 dead letters"), "{out}");
    let (ok, out) = run_cli(&[
        "dlq",
        "list",
        "--nats-url",
        nats,
        "--stream",
        &dlq,
        "--json",
    ]);
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|_| panic!("{out}"));
    assert!(ok && listed[0]["id"] == bad.to_string(), "{out}");

    for bad_input in [
        &["dlq", "list", "--nats-url", nats, "--stream", "NOPE_DLQ"][..],
        &[
            "dlq",
            "replay",
            "--database-url",
            &url,
            "--nats-url",
            nats,
            "--stream",
            &dlq,
        ],
        &[
            "dlq",
            "list",
            "--nats-url",
            nats,
            "--stream",
            &dlq,
            "--since",
            "2999-01-01T00:00:00Z",
        ],
    ] {
        let (ok, out) = run_cli(bad_input);
        assert!(
            !ok && out.trim_start().starts_with("error"),
            "{bad_input:?}: {out}"
        );
    }

    let replay = [
        "dlq",
        "replay",
        "--database-url",
        &url,
        "--nats-url",
        nats,
        "--stream",
        &dlq,
        "--id",
    ];
    let id = bad.to_string();
    // Review D5: against a database that is not the durable's (migrated,
    // so the replay records would fit), nothing is sent and it says why.
    // Before: "replayed", the record landed there, and the durable acked
    // the copy as a duplicate without a call.
    let (elsewhere, _) = fresh_db(&stack, "c_dlq_replay_elsewhere").await;
    let (ok, out) = run_cli(&[
        "dlq",
        "replay",
        "--database-url",
        &elsewhere,
        "--nats-url",
        nats,
        "--stream",
        &dlq,
        "--id",
        &id,
    ]);
    assert!(
        ok && out.contains("not_replayable") && out.contains("no inbox row of durable cdlqr"),
        "{out}"
    );
    let (ok, out) = run_cli(&[&replay[..], &[id.as_str()]].concat());
    assert!(ok && out.contains("replayed"), "{out}");
    eventually(T, "the handler called once more", || async {
        f.handler.calls_for(bad).len() == 2
    })
    .await;
    let call = &f.handler.calls_for(bad)[1];
    assert_eq!(
        call.idempotency_key.as_deref(),
        Some(id.as_str()),
        "the original id"
    );
    eventually(T, "the inbox row processed, without its error", || async {
        inbox(&f.pool, "cdlqr")
            .await
            .get(&bad)
            .is_some_and(|r| r.processed && r.last_error.is_none())
    })
    .await;

    let (ok, out) = run_cli(&[&replay[..], &[id.as_str()]].concat());
    assert!(ok && out.contains("already_replayed"), "{out}");
    assert_all_acked(&f.js, &f.stream, "cdlqr").await;
    assert_eq!(f.handler.calls_for(bad).len(), 2, "not a third time");
    assert_eq!(f.handler.calls_for(good).len(), 1);

    // The DLQ's depth, from the running consumer, until the dealt-with
    // dead letter is deleted.
    let depth = format!("outbox_dlq_messages{{stream=\"{dlq}\",subject=\"dlq.cdlqr.>\"}}");
    eventually(T, "the consumer reports one dead letter", || async {
        f.consumer.scrape().await.value(&depth) == Some(1.0)
    })
    .await;
    let delete = [
        "dlq",
        "delete",
        "--database-url",
        &url,
        "--nats-url",
        nats,
        "--stream",
        &dlq,
        "--reason",
        "dealt with: replayed",
    ];
    let (ok, out) = run_cli(&delete);
    assert!(
        !ok && out.contains("--all"),
        "a delete must say which: {out}"
    );
    let (ok, out) = run_cli(&[&delete[..], &["--id", id.as_str()]].concat());
    assert!(ok && out.contains(&format!("{id}  deleted")), "{out}");
    eventually(T, "the depth falls to 0", || async {
        f.consumer.scrape().await.value(&depth) == Some(0.0)
    })
    .await;
    let (ok, out) = run_cli(&["dlq", "list", "--nats-url", nats, "--stream", &dlq]);
    assert!(ok && out.contains("0 dead letters"), "{out}");

    // SPEC §16: each action is in outbox_admin_log under the database role
    // it ran as (never $USER, unset in containers and anyone's to set),
    // with its reason; what bad input refused did not run.
    let pool = sqlx::PgPool::connect(&url).await.unwrap();
    let role: String = sqlx::query_scalar("SELECT session_user::text")
        .fetch_one(&pool)
        .await
        .unwrap();
    let log: Vec<(String, String, String, Option<String>, String)> = sqlx::query_as(
        "SELECT actor, action, target, reason, result FROM outbox_admin_log ORDER BY seq",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let actor = format!("db:{role}");
    assert_eq!(
        log,
        [
            (
                actor.clone(),
                "dlq.replay".into(),
                dlq.clone(),
                None,
                "done".into()
            ),
            (
                actor.clone(),
                "dlq.replay".into(),
                dlq.clone(),
                None,
                "done".into()
            ),
            (
                actor,
                "dlq.delete".into(),
                dlq.clone(),
                Some("dealt with: replayed".into()),
                "done".into()
            ),
        ]
    );
    let by: Vec<String> = sqlx::query_scalar("SELECT replayed_by FROM dlq_replays")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(by, [role]);
}

/// Issue 15's consumer signals, scraped from the running consumer: while a
/// handler call runs long, the durable's oldest unacked message ages
/// (`outbox_consumer_lag_seconds`) and is counted in
/// `outbox_consumer_ack_pending_messages`; once it is acked both are 0.
/// Found in review: while NATS is gone the consumer cannot ask for the
/// durable's state, and the lag froze at its last figure, so the 5 and 30
/// minute alerts never came; it now goes on ageing the oldest message seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_durables_lag_grows_while_a_handler_is_slow_or_nats_is_gone_and_clears_after() {
    let mut nats = OwnNats::start(&stack(), "clag");
    let f = fixture_on(
        &nats.url,
        "c_lag",
        "clag",
        "clag",
        DUP,
        &["--handler-timeout", "90s"],
    )
    .await;
    let lag = |m: &Scrape| m.value("outbox_consumer_lag_seconds");
    let slow = Uuid::new_v4();
    publish(&f.js, "clag.e", Some(slow), "a", br#"{"sleep_ms": 30000}"#).await;
    eventually(T, "lag past 4 s with the message ack-pending", || async {
        let m = f.consumer.scrape().await;
        lag(&m).unwrap_or(0.0) > 4.0 && m.value("outbox_consumer_ack_pending_messages") == Some(1.0)
    })
    .await;
    nats.down();
    let at_down = lag(&f.consumer.scrape().await).unwrap_or(0.0);
    eventually(T, "lag goes on growing while NATS is gone", || async {
        lag(&f.consumer.scrape().await).unwrap_or(0.0) > at_down + 7.0
    })
    .await;
    nats.up();
    wait_processed(&f.pool, "clag", 1).await;
    eventually(T, "lag and ack-pending back to 0", || async {
        let m = f.consumer.scrape().await;
        lag(&m) == Some(0.0) && m.value("outbox_consumer_ack_pending_messages") == Some(0.0)
    })
    .await;
}

/// Found in review: a message a reset brings back to an aggregate that has a
/// parked message is parked behind it, and the parking used to skip its
/// processed row, so it was acked and never handled. It now waits its turn
/// and is handled once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_reaches_an_aggregate_that_has_a_parked_message() {
    let stack = stack();
    let mut f = fixture(
        "c_reset_parked",
        "cresetp",
        "cresetp",
        DUP,
        &["--backoff", "2s"],
    )
    .await;
    let url = db_url(&stack.admin_url, "c_reset_parked");
    let (done, failing) = (Uuid::new_v4(), Uuid::new_v4());
    publish(&f.js, "cresetp.e", Some(done), "h", b"{}").await;
    wait_processed(&f.pool, "cresetp", 1).await;
    publish(
        &f.js,
        "cresetp.e",
        Some(failing),
        "h",
        br#"{"answers": [500, 200]}"#,
    )
    .await;
    eventually(T, "the second message parked", || async {
        inbox(&f.pool, "cresetp")
            .await
            .get(&failing)
            .is_some_and(|r| r.attempts == 1 && !r.processed)
    })
    .await;
    f.consumer.term(Duration::from_secs(30));
    let (ok, out) = run_cli(&[
        "consumer",
        "reset",
        "--database-url",
        &url,
        "--nats-url",
        &stack.nats_url,
        "--stream",
        &f.stream,
        "--durable",
        "cresetp",
        "--seq",
        "1",
    ]);
    assert!(ok, "{out}");
    f.consumer.restart();
    eventually(T, "both handled, the first one once more", || async {
        f.handler.calls_for(done).len() == 2
            && f.handler.calls_for(failing).iter().any(|c| c.status == 200)
    })
    .await;
    assert_all_acked(&f.js, &f.stream, "cresetp").await;
}

/// `--backoff 0s`, one of issue 12's causes of defect 1: the aggregate goes
/// on, in order. The old consumer passed this one too (its redelivery came
/// back here in time); `a_failed_message_deleted_during_its_backoff…` is
/// the defect's failing test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_backoff_retry_unblocks_its_aggregate_in_order() {
    let f = fixture(
        "c_backoff0",
        "cbackoff0",
        "cbackoff0",
        DUP,
        &["--backoff", "0s"],
    )
    .await;
    let ids: Vec<Uuid> = (0..4).map(|_| Uuid::new_v4()).collect();
    publish(
        &f.js,
        "cbackoff0.e",
        Some(ids[0]),
        "z",
        br#"{"answers": [500, 503, 200]}"#,
    )
    .await;
    for id in &ids[1..] {
        publish(&f.js, "cbackoff0.e", Some(*id), "z", b"{}").await;
    }
    wait_processed(&f.pool, "cbackoff0", 4).await;
    assert_all_acked(&f.js, &f.stream, "cbackoff0").await;
    let calls = f.handler.calls();
    assert_eq!(f.handler.calls_for(ids[0]).len(), 3);
    let ok: Vec<String> = calls
        .iter()
        .filter(|c| c.status == 200)
        .map(|c| c.id.clone())
        .collect();
    let expected: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    assert_eq!(ok, expected, "the aggregate in stream order");
}

/// Issue 12, defect 4: per-aggregate order across a SIGTERM restart under
/// load (messages buffered at shutdown used to come back after `ack_wait`,
/// behind later ones of their aggregate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn order_holds_across_a_sigterm_restart_under_load() {
    let mut f = fixture(
        "c_sigterm_order",
        "csigterm",
        "csigterm",
        DUP,
        &["--concurrency", "16", "--max-ack-pending", "200"],
    )
    .await;
    let n = 1500;
    let ids: Vec<Uuid> = (0..n).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        let body = format!(r#"{{"s": {i}, "sleep_ms": 5}}"#);
        publish(
            &f.js,
            "csigterm.e",
            Some(*id),
            &format!("k{}", i % 20),
            body.as_bytes(),
        )
        .await;
    }
    eventually(T, "some handled before the restart", || async {
        f.handler.calls().len() >= n / 4
    })
    .await;
    f.consumer.term(Duration::from_secs(30));
    let before = f.handler.calls().len();
    assert!(
        before < n,
        "the restart came mid-stream ({before} of {n} handled)"
    );
    f.consumer.restart();
    wait_processed(&f.pool, "csigterm", n).await;
    assert_all_acked(&f.js, &f.stream, "csigterm").await;
    // Each aggregate's successful calls in stream order, each message once.
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    for c in f.handler.calls() {
        assert!(seen.insert(c.id.clone()), "{} handled twice", c.id);
        let s = c.body["payload"]["s"].as_i64().unwrap();
        let key = format!("k{}", s % 20);
        if let Some(prev) = last.insert(key.clone(), s) {
            assert!(s > prev, "{key}: {s} after {prev}");
        }
    }
    assert_eq!(seen.len(), n);
}

/// Found in review (last stop, #3): a slow aggregate collected its later
/// messages in memory until JetStream held back at `max_ack_pending`, and
/// every other aggregate waited for the slow call (15 s here; the others
/// must get through within 12). Past the high-water mark
/// they now go to the inbox (acked), the others flow, and the slow
/// aggregate goes on in order once its call returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_aggregate_does_not_hold_the_others_back() {
    let f = fixture(
        "c_slow_key",
        "cslow",
        "cslow",
        DUP,
        &["--max-ack-pending", "20", "--concurrency", "4"],
    )
    .await;
    let slow: Vec<Uuid> = (0..40).map(|_| Uuid::new_v4()).collect();
    for (i, id) in slow.iter().enumerate() {
        let body = if i == 0 {
            r#"{"s": 0, "sleep_ms": 15000}"#.to_owned()
        } else {
            format!(r#"{{"s": {i}}}"#)
        };
        publish(&f.js, "cslow.e", Some(*id), "slow", body.as_bytes()).await;
    }
    let cold = Uuid::new_v4();
    publish(&f.js, "cslow.e", Some(cold), "cold", b"{}").await;
    eventually(
        Duration::from_secs(12),
        "the other aggregate handled while the slow call runs",
        || async { !f.handler.calls_for(cold).is_empty() },
    )
    .await;
    let first_done = f.handler.calls_for(slow[0]).first().map(|c| c.at);
    assert!(first_done.is_some(), "the slow call had started");
    wait_processed(&f.pool, "cslow", 41).await;
    assert_all_acked(&f.js, &f.stream, "cslow").await;
    let order: Vec<i64> = f
        .handler
        .calls()
        .iter()
        .filter(|c| c.id != cold.to_string())
        .map(|c| c.body["payload"]["s"].as_i64().unwrap())
        .collect();
    assert_eq!(
        order,
        (0..40).collect::<Vec<i64>>(),
        "the slow aggregate in order, once each"
    );
}

/// A Rust handler whose messages share group transactions: the payload says
/// how its first delivery goes (`ok`, `fail` after writing, `panic` after
/// writing, or `abort`: a failed statement it ignores, answering processed;
/// `abort2` does that on its retry too, which runs alone); every call is
/// counted.
#[derive(Clone, Default)]
struct Grouped {
    calls: Arc<Mutex<HashMap<Uuid, usize>>>,
}

impl outbox_relay::consumer::Handler for Grouped {
    async fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        d: &outbox_relay::consumer::Delivery,
    ) -> outbox_relay::consumer::Outcome {
        use outbox_relay::consumer::Outcome;
        *self.calls.lock().unwrap().entry(d.message_id).or_default() += 1;
        let body: serde_json::Value = serde_json::from_slice(&d.payload).unwrap();
        if let Err(e) = sqlx::query(
            "INSERT INTO effects (message_id, aggregate, n, delivered) VALUES ($1, $2, $3, $4)",
        )
        .bind(d.message_id)
        .bind(body["aggregate"].as_str().unwrap_or_default())
        .bind(body["n"].as_i64().unwrap_or_default())
        .bind(d.delivered)
        .execute(&mut *tx)
        .await
        {
            return Outcome::Retry(e.to_string());
        }
        match (body["first"].as_str(), d.delivered) {
            (Some("fail"), 1) => Outcome::Retry("first delivery fails after writing".into()),
            (Some("abort"), 1) | (Some("abort2"), 1 | 2) => {
                // An error the handler swallows: its transaction is failed.
                let _ = sqlx::query("SELECT 1 / 0").execute(&mut *tx).await;
                Outcome::Processed
            }
            (Some("panic"), 1) => panic!("first delivery panics after writing ({})", body["n"]),
            _ => Outcome::Processed,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_handler_messages_sharing_a_transaction_each_commit_or_roll_back_alone() {
    let stack = stack();
    let (_url, pool) = fresh_db(&stack, "c_group").await;
    sqlx::query(
        "CREATE TABLE effects (seq bigserial PRIMARY KEY, message_id uuid NOT NULL, \
         aggregate text NOT NULL, n int8 NOT NULL, delivered int8 NOT NULL, \
         txid int8 NOT NULL DEFAULT txid_current())",
    )
    .execute(&pool)
    .await
    .unwrap();
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "cgroup", Duration::from_secs(120)).await;
    let cfg = outbox_relay::consumer::ConsumeConfig {
        concurrency: 64,
        ..rust_cfg(&stream, "group", "cgroup")
    };
    // Published before the consumer starts, so its first pulls are full and
    // its transactions hold many messages each.
    const AGGREGATES: usize = 40;
    const N: usize = 400;
    let mut sent = Vec::new();
    for n in 0..N {
        let id = Uuid::new_v4();
        let aggregate = format!("g{}", n % AGGREGATES);
        let first = match n {
            n if n % 53 == 0 => "panic",
            n if n % 31 == 0 => "abort2",
            n if n % 29 == 0 => "abort",
            n if n % 7 == 0 => "fail",
            _ => "ok",
        };
        let body = serde_json::json!({"aggregate": aggregate, "n": n, "first": first});
        publish(
            &js,
            "cgroup.e",
            Some(id),
            &aggregate,
            body.to_string().as_bytes(),
        )
        .await;
        sent.push((id, aggregate, n as i64, first));
    }
    let handler = Grouped::default();
    let consumer = RustConsumer::start(cfg, &pool, &js, handler.clone());
    wait_processed(&pool, "group", N).await;
    let effects: Vec<(Uuid, String, i64, i64)> =
        sqlx::query_as("SELECT message_id, aggregate, n, delivered FROM effects ORDER BY seq")
            .fetch_all(&pool)
            .await
            .unwrap();
    let rows = inbox(&pool, "group").await;
    let calls = handler.calls.lock().unwrap().clone();
    for (id, _, n, first) in &sent {
        let kept: Vec<i64> = effects.iter().filter(|e| e.0 == *id).map(|e| e.3).collect();
        let expected = match *first {
            "ok" => 1,
            "abort2" => 3,
            _ => 2,
        };
        assert_eq!(
            kept,
            vec![expected],
            "message {n} ({first}): only the successful attempt's write is kept"
        );
        assert_eq!(
            calls[id], expected as usize,
            "message {n} ({first}): handler calls"
        );
        assert_eq!(
            rows[id].attempts, expected as i32,
            "message {n}: inbox attempts"
        );
        assert!(rows[id].processed);
    }
    let (kept, transactions): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT txid) FROM effects")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(
        transactions < kept,
        "messages shared transactions ({kept} effects in {transactions})"
    );
    for g in 0..AGGREGATES {
        let aggregate = format!("g{g}");
        let order: Vec<i64> = effects
            .iter()
            .filter(|e| e.1 == aggregate)
            .map(|e| e.2)
            .collect();
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(
            order, sorted,
            "aggregate {aggregate} committed in stream order"
        );
    }
    consumer.stop().await;
}

/// Issue 12, defect 1: an aggregate waited for its failed message's
/// redelivery, which never comes when the stream deleted the message during
/// the backoff; its later messages got progress acks forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_message_deleted_during_its_backoff_does_not_block_its_aggregate() {
    let f = fixture(
        "c_deleted",
        "cdeleted",
        "cdeleted",
        DUP,
        &["--backoff", "3s"],
    )
    .await;
    let (first, second) = (Uuid::new_v4(), Uuid::new_v4());
    publish(
        &f.js,
        "cdeleted.e",
        Some(first),
        "z",
        br#"{"answers": [500, 200]}"#,
    )
    .await;
    publish(&f.js, "cdeleted.e", Some(second), "z", b"{}").await;
    eventually(T, "the first message failed once", || async {
        !f.handler.calls_for(first).is_empty()
    })
    .await;
    f.js.get_stream(&f.stream)
        .await
        .unwrap()
        .delete_message(1)
        .await
        .unwrap();
    eventually(T, "the aggregate's next message handled", || async {
        f.handler.calls_for(second).iter().any(|c| c.status == 200)
    })
    .await;
    assert_eq!(f.handler.calls_for(second).len(), 1);
}

/// A Rust handler that, on the first `orphan` deliveries of a message,
/// writes a row whose deferred foreign key fails only at COMMIT.
struct Deferring;

impl outbox_relay::consumer::Handler for Deferring {
    async fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        d: &outbox_relay::consumer::Delivery,
    ) -> outbox_relay::consumer::Outcome {
        use outbox_relay::consumer::Outcome;
        let orphan = serde_json::from_slice::<serde_json::Value>(&d.payload)
            .ok()
            .and_then(|b| b["orphan"].as_i64())
            .unwrap_or(0);
        let write = async {
            sqlx::query("INSERT INTO effects (message_id, delivered) VALUES ($1, $2)")
                .bind(d.message_id)
                .bind(d.delivered)
                .execute(&mut *tx)
                .await?;
            if d.delivered <= orphan {
                sqlx::query("INSERT INTO children (parent) VALUES (999)")
                    .execute(&mut *tx)
                    .await?;
            }
            Ok::<_, sqlx::Error>(())
        };
        match write.await {
            Ok(()) => Outcome::Processed,
            Err(e) => Outcome::Retry(e.to_string()),
        }
    }
}

/// Found in review: a handler whose writes Postgres refuses only at COMMIT
/// failed its whole group, every time, and its attempt was never counted:
/// its aggregate stalled and its group's other messages with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_refused_at_commit_fails_only_its_own_message() {
    let stack = stack();
    let (_url, pool) = fresh_db(&stack, "c_deferred").await;
    for ddl in [
        "CREATE TABLE effects (message_id uuid NOT NULL, delivered int8 NOT NULL)",
        "CREATE TABLE parents (id int PRIMARY KEY)",
        "CREATE TABLE children (parent int REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED)",
    ] {
        sqlx::query(ddl).execute(&pool).await.unwrap();
    }
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "cdefer", Duration::from_secs(120)).await;
    let mut sent = Vec::new();
    // Refused at the first commit, in a group; `2`: at the retry's too,
    // which runs in a transaction of its own.
    for n in 0..60 {
        let id = Uuid::new_v4();
        let orphan = match n % 20 {
            7 => 1,
            13 => 2,
            _ => 0,
        };
        let body = format!(r#"{{"orphan": {orphan}}}"#);
        publish(
            &js,
            "cdefer.e",
            Some(id),
            &format!("d{}", n % 12),
            body.as_bytes(),
        )
        .await;
        sent.push((id, orphan));
    }
    let cfg = rust_cfg(&stream, "defer", "cdefer");
    let consumer = RustConsumer::start(cfg, &pool, &js, Deferring);
    wait_processed(&pool, "defer", sent.len()).await;
    let rows = inbox(&pool, "defer").await;
    let effects: Vec<(Uuid, i64)> = sqlx::query_as("SELECT message_id, delivered FROM effects")
        .fetch_all(&pool)
        .await
        .unwrap();
    for (id, orphan) in &sent {
        let kept: Vec<i64> = effects.iter().filter(|e| e.0 == *id).map(|e| e.1).collect();
        let attempts = *orphan + 1;
        assert_eq!(kept, vec![i64::from(attempts)], "{id} (orphan: {orphan})");
        assert_eq!(rows[id].attempts, attempts, "{id} (orphan: {orphan})");
    }
    let children: i64 = sqlx::query_scalar("SELECT count(*) FROM children")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(children, 0);
    consumer.stop().await;
}

/// A Rust handler that records the transaction each call ran in.
struct Solo;

impl outbox_relay::consumer::Handler for Solo {
    fn max_group(&self) -> usize {
        1
    }

    async fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        d: &outbox_relay::consumer::Delivery,
    ) -> outbox_relay::consumer::Outcome {
        use outbox_relay::consumer::Outcome;
        match sqlx::query("INSERT INTO calls (message_id, txid) VALUES ($1, txid_current())")
            .bind(d.message_id)
            .execute(&mut *tx)
            .await
        {
            Ok(_) => Outcome::Processed,
            Err(e) => Outcome::Retry(e.to_string()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_with_max_group_1_gets_a_transaction_per_message() {
    let stack = stack();
    let (_url, pool) = fresh_db(&stack, "c_solo").await;
    sqlx::query("CREATE TABLE calls (message_id uuid NOT NULL, txid int8 NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "csolo", Duration::from_secs(120)).await;
    // Published first, so that sharing would form groups at once.
    const N: usize = 120;
    for n in 0..N {
        publish(
            &js,
            "csolo.e",
            Some(Uuid::new_v4()),
            &format!("s{n}"),
            b"{}",
        )
        .await;
    }
    let cfg = rust_cfg(&stream, "solo", "csolo");
    let consumer = RustConsumer::start(cfg, &pool, &js, Solo);
    wait_processed(&pool, "solo", N).await;
    let (calls, transactions): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT txid) FROM calls")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((calls, transactions), (N as i64, N as i64));
    consumer.stop().await;
}

/// A Rust-handler consumer's settings for a test (`ctx`: the stream's
/// context, for the DLQ prefix).
fn rust_cfg(stream: &str, durable: &str, ctx: &str) -> outbox_relay::consumer::ConsumeConfig {
    outbox_relay::consumer::ConsumeConfig {
        stream: stream.to_owned(),
        durable: durable.into(),
        filter: None,
        ack_wait: Duration::from_secs(10),
        max_deliver: 5,
        max_ack_pending: 1000,
        concurrency: 32,
        backoff: vec![Duration::from_millis(100)],
        max_parked_keys: 100_000,
        dlq_prefix: wire::consumer_dlq_prefix(ctx),
        dlq_replicas: 1,
        nats_monitor_url: Vec::new(),
        require_durable: false,
        shutdown_timeout: Duration::from_secs(5),
        schemas: None,
    }
}

/// A consumer running a Rust handler in this process.
struct RustConsumer {
    shutdown: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<outbox_relay::Result<()>>,
}

impl RustConsumer {
    fn start<H: outbox_relay::consumer::Handler>(
        cfg: outbox_relay::consumer::ConsumeConfig,
        pool: &sqlx::PgPool,
        js: &jetstream::Context,
        handler: H,
    ) -> Self {
        let shutdown = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(outbox_relay::consumer::run(
            cfg,
            pool.clone(),
            js.clone(),
            handler,
            outbox_relay::Readiness::default(),
            shutdown.clone(),
        ));
        Self { shutdown, task }
    }

    /// Shut down, and the consumer ends cleanly within 20 s.
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

/// SPEC §10: with `--schemas`, the consumer checks a payload against its
/// type's schema before calling the handler; one that fails is
/// dead-lettered (reason starting `schema_invalid`, then where and why)
/// and the handler never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_fails_its_schema_is_dead_lettered_without_a_handler_call() {
    let dir = std::env::temp_dir().join(format!("outbox-relay-cschema-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("placed")).unwrap();
    std::fs::write(
        dir.join("placed/v2.json"),
        r#"{"type":"object","required":["amount"],"properties":{"amount":{"type":"integer","minimum":0}}}"#,
    )
    .unwrap();
    let f = fixture(
        "t_cschema",
        "cschema",
        "cschema",
        DUP,
        &["--schemas", dir.to_str().unwrap()],
    )
    .await;
    let (good, bad) = (Uuid::new_v4(), Uuid::new_v4());
    let subject = "cschema.event.placed.v2";
    publish(&f.js, subject, Some(bad), "a1", br#"{"amount": -5}"#).await;
    publish(&f.js, subject, Some(good), "a1", br#"{"amount": 5}"#).await;
    eventually(T, "the valid message handled", || async {
        f.handler.calls_for(good).len() == 1
    })
    .await;
    let dlq = read_stream(
        &stack().nats_url,
        &wire::dlq_stream_name(&wire::consumer_dlq_prefix("cschema")),
        1,
        T,
    )
    .await;
    assert_eq!(
        dlq[0].h(wire::DLQ_ORIGINAL_ID),
        Some(bad.to_string().as_str())
    );
    let reason = dlq[0].h(wire::DLQ_REASON).unwrap();
    assert!(
        reason.starts_with("schema_invalid: /amount: minimum: "),
        "{reason}"
    );
    assert!(f.handler.calls_for(bad).is_empty(), "no handler call");
    let m = f.consumer.scrape().await;
    assert_eq!(
        m.value(r#"outbox_schema_validation_failures_total{stage="consume",event_type="placed"}"#),
        Some(1.0)
    );

    // A type without a schema (`--schema-missing allow`): the running
    // consumer delivers it and says so on its first delivery; a consumer
    // started later says so at start, naming the type and its subject.
    let shipped = Uuid::new_v4();
    let id = shipped.to_string();
    let headers = [
        (wire::MSG_ID, id.as_str()),
        (wire::AGGREGATE_ID, "a2"),
        (wire::EVENT_TYPE, "shipped"),
        (wire::EVENT_VERSION, "1"),
    ];
    publish_with(&f.js, "cschema.event.shipped.v1", &headers, b"{}").await;
    eventually(T, "the unchecked message handled", || async {
        f.handler.calls_for(shipped).len() == 1
    })
    .await;
    const NO_SCHEMA: &str = "no schema for this event type";
    let log = f.consumer.log_text();
    let noted: Vec<&str> = log.lines().filter(|l| l.contains(NO_SCHEMA)).collect();
    assert_eq!(noted.len(), 1, "said once: {log}");
    assert!(noted[0].contains("shipped"), "{}", noted[0]);

    let stack = stack();
    let handler_url = f.handler.serve().await;
    let late = Service::consumer_named(
        &db_url(&stack.admin_url, "t_cschema"),
        &stack.nats_url,
        &f.stream,
        "cschema_late",
        "cschema_late",
        &handler_url,
        &[
            "--context",
            "cschema",
            "--filter",
            "cschema.event.>",
            "--schemas",
            dir.to_str().unwrap(),
        ],
    );
    let path = log_dir().join("cschema_late.log");
    eventually(T, "the later consumer warns at start", || async {
        std::fs::read_to_string(&path).is_ok_and(|l| l.contains("no schema for an event type"))
    })
    .await;
    let log = std::fs::read_to_string(&path).unwrap();
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("no schema for an event type"))
        .collect();
    assert_eq!(warned.len(), 1, "only the type without one: {log}");
    assert!(
        warned[0].contains("shipped") && warned[0].contains("cschema.event.shipped.v1"),
        "{}",
        warned[0]
    );

    // SIGHUP: the consumer takes up a schema added since start. (The later
    // consumer, not signalled, would hand the next message over unchecked.)
    drop(late);
    let dlq_stream = wire::dlq_stream_name(&wire::consumer_dlq_prefix("cschema"));
    let stored = stream_messages(&stack.nats_url, &dlq_stream).await;
    std::fs::create_dir_all(dir.join("shipped")).unwrap();
    std::fs::write(
        dir.join("shipped/v1.json"),
        r#"{"type":"object","required":["carrier"]}"#,
    )
    .unwrap();
    signal(f.consumer.pid(), "HUP");
    eventually(T, "the consumer reloaded", || async {
        f.consumer
            .scrape()
            .await
            .value(r#"outbox_schema_reloads_total{result="ok"}"#)
            == Some(1.0)
    })
    .await;
    let unshipped = Uuid::new_v4();
    let id = unshipped.to_string();
    let headers = [
        (wire::MSG_ID, id.as_str()),
        (wire::AGGREGATE_ID, "a3"),
        (wire::EVENT_TYPE, "shipped"),
        (wire::EVENT_VERSION, "1"),
    ];
    publish_with(&f.js, "cschema.event.shipped.v1", &headers, b"{}").await;
    let dlq = read_stream(&stack.nats_url, &dlq_stream, stored + 1, T).await;
    let letter = dlq
        .iter()
        .find(|d| d.h(wire::DLQ_ORIGINAL_ID) == Some(unshipped.to_string().as_str()))
        .expect("dead-lettered after the reload");
    assert!(
        letter
            .h(wire::DLQ_REASON)
            .unwrap()
            .starts_with("schema_invalid: /: required: "),
        "{:?}",
        letter.h(wire::DLQ_REASON)
    );
    assert!(f.handler.calls_for(unshipped).is_empty(), "no handler call");
    let _ = std::fs::remove_dir_all(dir);
}

/// A delivery that never reaches the consumer (its pull subscription was
/// renewed while the message was on the way) leaves no gap to notice when
/// it is the last in the stream, and nothing is pending: it used to wait
/// out `--ack-wait` before coming back. A second client taking one
/// delivery and never acking it stands in for the loss, deterministically.
/// The consumer now notices that the server counts a delivery unacked
/// while it holds none, and resets to the ack floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_last_delivery_comes_back_without_waiting_out_ack_wait() {
    use futures::StreamExt;
    let stack = stack();
    let f = fixture("c_lostlast", "clost", "clost", DUP, &["--ack-wait", "300s"]).await;
    publish(&f.js, "clost.e", Some(Uuid::new_v4()), "a0", b"{}").await;
    wait_processed(&f.pool, "clost", 1).await;

    let thief = async_nats::connect(&stack.nats_url).await.unwrap();
    let inbox = thief.new_inbox();
    let mut taken = thief.subscribe(inbox.clone()).await.unwrap();
    thief
        .publish_with_reply(
            format!("$JS.API.CONSUMER.MSG.NEXT.{}.clost", f.stream),
            inbox,
            r#"{"batch":1,"expires":120000000000}"#.into(),
        )
        .await
        .unwrap();
    thief.flush().await.unwrap();
    // The server shares new messages among the waiting pull requests; the
    // one the thief gets is the last published.
    let mut stolen = None;
    for i in 1..=200 {
        publish(
            &f.js,
            "clost.e",
            Some(Uuid::new_v4()),
            &format!("a{i}"),
            b"{}",
        )
        .await;
        if let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(200), taken.next()).await {
            let id = m.headers.as_ref().and_then(|h| h.get(wire::MSG_ID));
            stolen = Some(id.expect("a message, not a status").as_str().to_owned());
            break;
        }
    }
    let stolen: Uuid = stolen.expect("the thief got one of 200").parse().unwrap();
    // Well inside --ack-wait: only noticing the loss brings it back in time.
    eventually(
        Duration::from_secs(60),
        "the stolen delivery handled",
        || async { !f.handler.calls_for(stolen).is_empty() },
    )
    .await;
    assert_all_acked(&f.js, &f.stream, "clost").await;
}

/// Issue 30, defect 3: a message dead-lettered again after a `dlq replay`
/// (or a `consumer reset`) within the DLQ's 2-minute duplicate window had
/// its new dead letter dropped as a duplicate of the first
/// (`Nats-Msg-Id` = `{durable}:{id}` both times): the inbox said
/// dead-lettered, the DLQ held one letter, and replaying the message again
/// answered `already_replayed`. Each dead-lettering now has a letter of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_dead_lettered_again_after_a_replay_or_reset_gets_a_new_dead_letter() {
    let stack = stack();
    let mut f = fixture("c_dlq_again", "cdlqa", "cdlqa", DUP, &[]).await;
    let url = db_url(&stack.admin_url, "c_dlq_again");
    let nats = stack.nats_url.as_str();
    let dlq = wire::dlq_stream_name(&wire::consumer_dlq_prefix("cdlqa"));
    let (replayed, reset) = (Uuid::new_v4(), Uuid::new_v4());
    publish(
        &f.js,
        "cdlqa.e",
        Some(replayed),
        "a",
        br#"{"answers": [422, 422, 200]}"#,
    )
    .await;
    publish(&f.js, "cdlqa.e", Some(reset), "b", br#"{"answers": [422]}"#).await;
    wait_processed(&f.pool, "cdlqa", 2).await;
    let letters = |n: usize| {
        let dlq = dlq.clone();
        async move {
            let (ok, out) = run_cli(&["dlq", "list", "--nats-url", nats, "--stream", &dlq]);
            ok && out.contains(&format!("{n} dead letters"))
        }
    };
    eventually(T, "two dead letters", || letters(2)).await;

    let replay = |id: Uuid| {
        run_cli(&[
            "dlq",
            "replay",
            "--database-url",
            &url,
            "--nats-url",
            nats,
            "--stream",
            &dlq,
            "--id",
            &id.to_string(),
        ])
    };
    let (ok, out) = replay(replayed);
    assert!(ok && out.contains("replayed"), "{out}");
    eventually(T, "the replayed message's second call", || async {
        f.handler.calls_for(replayed).len() == 2
    })
    .await;
    eventually(T, "its second dead letter is stored", || letters(3)).await;
    // Replaying it again sends the new dead letter (the first is reported).
    let (ok, out) = replay(replayed);
    assert!(ok && out.contains("  replayed"), "the new letter: {out}");
    eventually(T, "the third call, which succeeds", || async {
        f.handler.calls_for(replayed).len() == 3
    })
    .await;
    eventually(T, "processed without an error", || async {
        inbox(&f.pool, "cdlqa")
            .await
            .get(&replayed)
            .is_some_and(|r| r.processed && r.last_error.is_none())
    })
    .await;

    // The same after a reset: the handler is called once more, fails, and
    // that failure is a dead letter of its own.
    f.consumer.term(Duration::from_secs(30));
    let (ok, out) = run_cli(&[
        "consumer",
        "reset",
        "--database-url",
        &url,
        "--nats-url",
        nats,
        "--stream",
        &f.stream,
        "--durable",
        "cdlqa",
        "--seq",
        "2",
    ]);
    assert!(ok, "{out}");
    f.consumer.restart();
    eventually(T, "the reset message's second call", || async {
        f.handler.calls_for(reset).len() == 2
    })
    .await;
    eventually(T, "its second dead letter is stored", || letters(4)).await;
}

/// Issue 30, defect 2: parked messages were found by durable name alone,
/// while one process runs per stream and durable. `--durable billing` on
/// two streams: the ORDERS consumer took over PAYMENTS' parked row, looked
/// for its sequence in ORDERS, found nothing and recorded it as "left the
/// stream": the PAYMENTS message was never handled. Parked rows now belong
/// to their stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_durable_name_on_two_streams_keeps_each_streams_parked_messages() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_two_streams").await;
    let js = js(&stack.nats_url).await;
    let orders = fresh_stream(&js, "ctwoa", DUP).await;
    let payments = fresh_stream(&js, "ctwob", DUP).await;
    let handler = Handler::default();
    let handler_url = handler.serve().await;
    let consume = |stream: &str, ctx: &str| {
        Service::consumer(
            &url,
            &stack.nats_url,
            stream,
            "billing",
            &handler_url,
            &["--context", ctx, "--backoff", "3s"],
        )
    };
    let mut pay = consume(&payments, "ctwob");
    let p = Uuid::new_v4();
    publish(&js, "ctwob.e", Some(p), "x", br#"{"answers": [500, 200]}"#).await;
    eventually(
        T,
        "the payment's first call fails and is parked",
        || async {
            handler.calls_for(p).len() == 1
                && inbox(&pool, "billing")
                    .await
                    .get(&p)
                    .is_some_and(|r| r.last_error.is_some())
        },
    )
    .await;
    pay.term(Duration::from_secs(30));
    // ORDERS' consumer of the same name runs while PAYMENTS' is down, past
    // the parked message's backoff.
    let mut ord = consume(&orders, "ctwoa");
    tokio::time::sleep(Duration::from_secs(6)).await;
    let row = inbox(&pool, "billing").await.remove(&p).unwrap();
    assert!(
        !row.processed,
        "ORDERS' consumer must leave PAYMENTS' parked message alone: {:?}\n{}",
        row.last_error,
        ord.log_text()
    );
    ord.term(Duration::from_secs(30));
    pay.restart();
    eventually(T, "the payment handled on its own stream", || async {
        handler.calls_for(p).iter().any(|c| c.status == 200)
    })
    .await;
    eventually(T, "and processed, not recorded as gone", || async {
        inbox(&pool, "billing").await.get(&p).is_some_and(|r| {
            r.processed
                && !r
                    .last_error
                    .as_deref()
                    .is_some_and(|e| e.contains("left the stream"))
        })
    })
    .await;
}

/// Issue 30, defect 12: a webhook secret in `--handler-url` (`?token=…`)
/// leaked: reqwest's error text carries the URL, which went into the log,
/// `last_error` and the dead letter's reason; and `--help` showed the
/// value of `OUTBOX_HANDLER_URL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_in_the_handler_url_never_reaches_logs_inbox_dead_letters_or_help() {
    const SECRET: &str = "s3cret-webhook-token";
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_secret").await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "csec", DUP).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let handler_url = format!("http://user:{SECRET}@127.0.0.1:{port}/h?token={SECRET}");
    let consumer = Service::consumer(
        &url,
        &stack.nats_url,
        &stream,
        "secret",
        &handler_url,
        &[
            "--context",
            "csec",
            "--max-deliver",
            "2",
            "--backoff",
            "100ms",
        ],
    );
    let id = Uuid::new_v4();
    publish(&js, "csec.x", Some(id), "a", b"{}").await;
    wait_processed(&pool, "secret", 1).await;
    let rows = inbox(&pool, "secret").await;
    let last_error = rows[&id].last_error.clone().unwrap();
    assert!(last_error.contains("unreachable"), "{last_error}");
    assert!(!last_error.contains(SECRET), "last_error: {last_error}");
    let dead = read_stream(
        &stack.nats_url,
        &wire::dlq_stream_name(&wire::consumer_dlq_prefix("csec")),
        1,
        T,
    )
    .await;
    for (k, v) in &dead[0].headers {
        assert!(!v.contains(SECRET), "dead letter header {k}: {v}");
    }
    assert!(
        !consumer.log_text().contains(SECRET),
        "{}",
        consumer.log_text()
    );
    let help = std::process::Command::new(BIN)
        .args(["consume", "--help"])
        .env("OUTBOX_HANDLER_URL", &handler_url)
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("OUTBOX_HANDLER_URL"), "{help}");
    assert!(!help.contains(SECRET), "{help}");
}

/// Issue 30, defect 9 (handler bodies): an error body with a NUL byte made
/// Postgres refuse the `last_error` it went into, so the failure was never
/// recorded and the message was retried for ever, holding its aggregate;
/// and the body was read whole before being cut to 200 bytes, so an endless
/// one held the call until the handler timeout and lost its start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_error_body_with_a_nul_byte_or_no_end_is_recorded_and_the_message_goes_on() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_nulbody").await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "cnul", DUP).await;
    let app = axum::Router::new().route(
        "/handle",
        axum::routing::post(|| async {
            let start = futures::stream::once(async {
                Ok::<_, std::io::Error>(Bytes::from_static(b"bad\0byte first-bytes "))
            });
            let endless = futures::stream::unfold((), |()| async {
                tokio::time::sleep(Duration::from_millis(5)).await;
                Some((Ok(Bytes::from(vec![b'x'; 1024])), ()))
            });
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                axum::body::Body::from_stream(futures::StreamExt::chain(start, endless)),
            )
        }),
    );
    let handler_url = serve_handler(app).await;
    let _consumer = Service::consumer(
        &url,
        &stack.nats_url,
        &stream,
        "nulbody",
        &handler_url,
        &[
            "--context",
            "cnul",
            "--max-deliver",
            "2",
            "--backoff",
            "100ms",
            "--handler-timeout",
            "120s",
        ],
    );
    let id = Uuid::new_v4();
    publish(&js, "cnul.x", Some(id), "a", b"{}").await;
    eventually(
        Duration::from_secs(60),
        "the message dead-lettered",
        || async {
            inbox(&pool, "nulbody")
                .await
                .get(&id)
                .is_some_and(|r| r.processed)
        },
    )
    .await;
    let row = &inbox(&pool, "nulbody").await[&id];
    let last_error = row.last_error.as_deref().unwrap();
    assert!(
        last_error.contains("first-bytes"),
        "the body's start: {last_error}"
    );
    assert_eq!(row.attempts, 2);
    let dead = read_stream(
        &stack.nats_url,
        &wire::dlq_stream_name(&wire::consumer_dlq_prefix("cnul")),
        1,
        T,
    )
    .await;
    assert_eq!(
        dead[0].h(wire::DLQ_ORIGINAL_ID),
        Some(id.to_string().as_str())
    );
}

/// Issue 30, defect 9 (dead letters): a message within a few hundred bytes
/// of the server's max payload fits the stream, but its dead letter (the
/// original plus the `Outbox-Dlq-*` headers) did not: the DLQ refused it on
/// every try, for ever, and the message's aggregate never moved. Such a
/// dead letter is now stored without the body, naming where the original
/// is, and `dlq replay` reads the body back from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_too_large_for_the_dlq_is_kept_without_its_body_and_replays_whole() {
    let f = fixture("c_dlqsize", "cdsz", "dlqsize", DUP, &["--backoff", "100ms"]).await;
    let max = async_nats::connect(&stack().nats_url)
        .await
        .unwrap()
        .server_info()
        .max_payload;
    // The original fits with some 160 bytes to spare; its dead letter (some
    // 270 bytes of headers more) would not.
    let pad = "x".repeat(max - 400);
    let big = Uuid::new_v4();
    let body = serde_json::json!({"answers": [422], "pad": pad}).to_string();
    publish(&f.js, "cdsz.x", Some(big), "a", body.as_bytes()).await;
    let after = Uuid::new_v4();
    publish(&f.js, "cdsz.x", Some(after), "a", b"{}").await;
    wait_processed(&f.pool, "dlqsize", 2).await;
    assert!(
        !f.handler.calls_for(after).is_empty(),
        "the aggregate goes on"
    );
    let dlq = wire::dlq_stream_name(&wire::consumer_dlq_prefix("cdsz"));
    let dead = read_stream(&stack().nats_url, &dlq, 1, T).await;
    assert_eq!(
        dead[0].h(wire::DLQ_ORIGINAL_ID),
        Some(big.to_string().as_str())
    );
    assert!(dead[0].payload.is_empty(), "stored without its body");
    assert_eq!(
        dead[0].h(wire::DLQ_PAYLOAD_OMITTED),
        Some(body.len().to_string().as_str())
    );

    let url = db_url(&stack().admin_url, "c_dlqsize");
    let id = big.to_string();
    let (ok, out) = run_cli(&[
        "dlq",
        "replay",
        "--database-url",
        &url,
        "--nats-url",
        &stack().nats_url,
        "--stream",
        &dlq,
        "--id",
        &id,
    ]);
    assert!(ok && out.contains("replayed"), "{out}");
    eventually(T, "the handler called once more, with the body", || async {
        f.handler.calls_for(big).len() == 2
    })
    .await;
    let calls = f.handler.calls_for(big);
    assert_eq!(
        calls[1].body["payload"]["pad"].as_str().map(str::len),
        Some(pad.len())
    );
}

/// Issue 30, defect 10 (consumer): the takeover path ended the process on
/// the first error after taking the lease (`active.run(...).await?`). The
/// error that reaches it is Postgres failing in the instant after the lease
/// was taken, which this test cannot force (the tests' superuser is exempt
/// from connection limits); it holds the neighbouring path instead: a
/// standby whose dispatcher dies while NATS is down stays, and delivers
/// after. (It takes the lease only once NATS is back: cut off from NATS, a
/// dispatcher could reach neither the stream nor the crew, and would keep a
/// process that can from taking over.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_consumer_taking_over_while_nats_is_down_stays_and_delivers_after() {
    let mut nats = OwnNats::start(&stack(), "ctakeover");
    let mut f = fixture_on(&nats.url, "c_takeover", "ctko", "takeover", DUP, &[]).await;
    let url = db_url(&stack().admin_url, "c_takeover");
    let handler_url = f.handler.serve().await;
    let mut standby = Service::consumer_named(
        &url,
        &nats.url,
        &f.stream,
        "takeover",
        "takeover-standby",
        &handler_url,
        &["--context", "ctko"],
    );
    eventually(T, "the second process says another dispatches", || async {
        let (status, body) = standby.http_get("/readyz").await;
        status == 200
            && body.contains("another dispatches")
            && standby.scrape().await.value("outbox_consumer_standby") == Some(1.0)
    })
    .await;
    nats.down();
    f.consumer.kill9();
    eventually(T, "the dead dispatcher's lease is free", || async {
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&f.pool)
        .await
        .unwrap();
        held == 0
    })
    .await;
    assert!(
        standby.child.try_wait().unwrap().is_none(),
        "the standby exited while NATS was down:\n{}",
        standby.log_text()
    );
    nats.up();
    eventually(T, "the standby takes over once NATS is back", || async {
        standby.scrape().await.value("outbox_consumer_standby") == Some(0.0)
    })
    .await;
    let js = js(&nats.url).await;
    let id = Uuid::new_v4();
    publish(&js, "ctko.x", Some(id), "a", b"{}").await;
    wait_processed(&f.pool, "takeover", 1).await;
    assert!(!f.handler.calls_for(id).is_empty());
}

/// Issue 30, defect 8: A/1's call is slow, A/2..A/6 spill to the inbox
/// (parked behind, acked), and the consumer dies before A/1 ends. On
/// restart the inbox's parked A/2 led the aggregate while A/1, still
/// unacked, came back from JetStream and was parked behind A/6: A/2 ran
/// before A/1. Fails today with the calls after the restart going
/// `[1, 0, 2, 3, 4, 5]`; kept ignored until the fix lands (the spill must
/// pin the running head in the inbox before it acks what it spills).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spilled_messages_never_overtake_their_unfinished_head_across_a_crash() {
    let mut f = fixture(
        "c_spillcrash",
        "cspc",
        "spillcrash",
        DUP,
        &["--max-ack-pending", "4", "--concurrency", "2"],
    )
    .await;
    let ids: Vec<Uuid> = (0..6).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        let body = if i == 0 {
            r#"{"s": 0, "sleep_ms": 4000}"#.to_owned()
        } else {
            format!(r#"{{"s": {i}}}"#)
        };
        publish(&f.js, "cspc.e", Some(*id), "a", body.as_bytes()).await;
    }
    // A/1 runs and the others are written behind it in the inbox.
    eventually(T, "A/1 called and A/2..A/6 spilled", || async {
        let rows = inbox(&f.pool, "spillcrash").await;
        !f.handler.calls_for(ids[0]).is_empty() && ids[1..].iter().all(|id| rows.contains_key(id))
    })
    .await;
    f.consumer.kill9();
    let killed_at = Instant::now();
    f.consumer.restart();
    wait_processed(&f.pool, "spillcrash", 6).await;
    let after: Vec<i64> = f
        .handler
        .calls()
        .iter()
        .filter(|c| c.at > killed_at)
        .map(|c| c.body["payload"]["s"].as_i64().unwrap())
        .collect();
    assert_eq!(
        after.first(),
        Some(&0),
        "after the restart A/1 runs first: {after:?}"
    );
    let mut seen = after.clone();
    seen.dedup();
    assert_eq!(seen, (0..6).collect::<Vec<i64>>(), "in order: {after:?}");
}

/// One call a crew test's handler saw: when it started and ended.
#[derive(Debug, Clone)]
struct Timed {
    id: String,
    aggregate: String,
    status: u16,
    start: Instant,
    end: Instant,
}

/// A handler that takes `ms` per call and answers each message's scripted
/// `answers` in turn, recording start and end of every call.
#[derive(Clone)]
struct SlowHandler {
    ms: u64,
    calls: Arc<Mutex<Vec<Timed>>>,
}

impl SlowHandler {
    async fn serve(ms: u64) -> (SlowHandler, String) {
        let h = SlowHandler {
            ms,
            calls: Arc::default(),
        };
        let app = axum::Router::new()
            .route("/handle", axum::routing::post(slow_answer))
            .with_state(h.clone());
        let url = serve_handler(app).await;
        (h, url)
    }

    fn calls(&self) -> Vec<Timed> {
        self.calls.lock().unwrap().clone()
    }
}

async fn slow_answer(State(h): State<SlowHandler>, body: Bytes) -> StatusCode {
    let start = Instant::now();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let id = body["message_id"].as_str().unwrap().to_owned();
    let aggregate = body["payload"]["aggregate"]
        .as_str()
        .unwrap_or("")
        .to_owned();
    let n = h.calls().iter().filter(|c| c.id == id).count();
    let answers: Vec<u16> = body["payload"]["answers"]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_u64().unwrap() as u16).collect())
        .unwrap_or_else(|| vec![200]);
    let status = answers[n.min(answers.len() - 1)];
    tokio::time::sleep(Duration::from_millis(h.ms)).await;
    h.calls.lock().unwrap().push(Timed {
        id,
        aggregate,
        status,
        start,
        end: Instant::now(),
    });
    StatusCode::from_u16(status).unwrap()
}

/// The process of the crew that dispatches now (its standby gauge is 0).
async fn dispatcher(crew: &[Option<Service>]) -> usize {
    let deadline = Instant::now() + T;
    loop {
        for (i, s) in crew.iter().enumerate() {
            if let Some(s) = s {
                if s.scrape().await.value("outbox_consumer_standby") == Some(0.0) {
                    return i;
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "no process of the crew dispatches"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// SPEC §11: three processes of one durable all work; one is killed (kill
/// -9), one stopped (SIGTERM), one started mid-run. Every message is handled,
/// a successful call is repeated only where a process died with it in
/// flight, an aggregate's calls never overlap and keep stream order, work
/// moves within 5 s of the kill and 1 s of the SIGTERM, and a failing
/// aggregate holds up no other. Before the crew, the second and third
/// processes were standbys: they handled nothing (the check that each
/// process handled a share fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_of_one_durable_share_its_work_across_a_kill_a_sigterm_and_a_join() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_crew").await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "ccrew", DUP).await;
    let (handler, handler_url) = SlowHandler::serve(20).await;
    let args = [
        "--context",
        "ccrew",
        "--backoff",
        "300ms",
        "--concurrency",
        "4",
    ];
    let start = |name: &str| {
        Service::consumer_named(
            &url,
            &stack.nats_url,
            &stream,
            "crew",
            name,
            &handler_url,
            &args,
        )
    };
    let mut crew: Vec<Option<Service>> = vec![Some(start("crew-a"))];
    crew[0].as_mut().unwrap().wait_ready();
    crew.push(Some(start("crew-b")));
    crew.push(Some(start("crew-c")));
    eventually(T, "three processes of the durable", || async {
        crew[0]
            .as_ref()
            .unwrap()
            .scrape()
            .await
            .value("outbox_consumer_processes")
            == Some(3.0)
    })
    .await;

    const N: usize = 2000;
    let published: Arc<Mutex<Vec<(String, String, Instant)>>> = Arc::default();
    let publisher = {
        let js = js.clone();
        let published = published.clone();
        tokio::spawn(async move {
            for i in 0..N {
                let id = Uuid::new_v4();
                // Aggregate `f` fails three times per message; others pass.
                let agg = if i % 100 == 0 {
                    "f".to_owned()
                } else {
                    format!("g{}", i % 40)
                };
                let body = if agg == "f" {
                    format!(r#"{{"aggregate": "{agg}", "answers": [503, 503, 503, 200]}}"#)
                } else {
                    format!(r#"{{"aggregate": "{agg}"}}"#)
                };
                publish(
                    &js,
                    "ccrew.event.placed.v2",
                    Some(id),
                    &agg,
                    body.as_bytes(),
                )
                .await;
                published
                    .lock()
                    .unwrap()
                    .push((agg, id.to_string(), Instant::now()));
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        })
    };
    // Work moved: the longest pause between handler calls starting, from `t`
    // until the publisher stopped (messages kept arriving all along).
    let stall = |t: Instant, until: Instant| {
        let mut starts: Vec<Instant> = handler
            .calls()
            .iter()
            .map(|c| c.start)
            .filter(|s| *s > t && *s < until)
            .collect();
        starts.sort();
        let mut last = t;
        let mut longest = Duration::ZERO;
        for s in starts {
            longest = longest.max(s - last);
            last = s;
        }
        longest.max(until.saturating_duration_since(last))
    };

    eventually(T, "each of the three processes handles a share", || async {
        for s in crew.iter().flatten() {
            let processed = s
                .scrape()
                .await
                .value(r#"outbox_consumer_messages_total{result="processed"}"#);
            if !processed.is_some_and(|p| p > 0.0) {
                return false;
            }
        }
        true
    })
    .await;
    let killed = dispatcher(&crew).await;
    let calls_before_kill = handler.calls().len();
    let t_kill = Instant::now();
    crew[killed].as_mut().unwrap().kill9();
    crew[killed] = None;
    crew.push(Some(start("crew-d")));
    crew.last_mut().unwrap().as_mut().unwrap().wait_ready();
    // The SIGTERM comes once the kill's takeover is done (work flows again:
    // more calls than the 12 the crew can have had in flight at the kill):
    // SPEC §11 bounds each handover, not one inside the other.
    eventually(T, "calls flow again after the kill", || async {
        handler.calls().len() >= calls_before_kill + 20
    })
    .await;
    let termed = dispatcher(&crew).await;
    let t_term = Instant::now();
    let st = crew[termed].as_mut().unwrap().term(Duration::from_secs(30));
    assert!(st.success(), "SIGTERM exit: {st:?}");
    crew[termed] = None;
    publisher.await.unwrap();
    let publisher_done = published.lock().unwrap().last().unwrap().2;
    wait_processed(&pool, "crew", N).await;
    assert_all_acked(&js, &stream, "crew").await;

    assert!(
        t_term + Duration::from_secs(1) < publisher_done,
        "the run covers the SIGTERM"
    );
    let after_kill = stall(
        t_kill,
        publisher_done
            .min(t_kill + Duration::from_secs(5))
            .min(t_term),
    );
    let after_term = stall(t_term, publisher_done.min(t_term + Duration::from_secs(5)));
    println!(
        "longest pause in handler calls: {after_kill:?} after the kill -9 of the dispatcher, {after_term:?} after its successor's SIGTERM ({calls_before_kill} calls before the kill)"
    );
    assert!(
        after_kill < Duration::from_secs(5),
        "kill -9: {after_kill:?}"
    );
    assert!(
        after_term < Duration::from_secs(1),
        "SIGTERM: {after_term:?}"
    );

    let published = published.lock().unwrap().clone();
    let mut sent: HashMap<String, Vec<String>> = HashMap::new();
    for (agg, id, _) in &published {
        sent.entry(agg.clone()).or_default().push(id.clone());
    }
    let calls = handler.calls();
    let mut by_agg: HashMap<String, Vec<Timed>> = HashMap::new();
    for c in &calls {
        by_agg
            .entry(c.aggregate.clone())
            .or_default()
            .push(c.clone());
    }
    let mut repeats = 0;
    for (agg, ids) in &sent {
        let mut calls = by_agg[agg].clone();
        calls.sort_by_key(|c| c.start);
        for w in calls.windows(2) {
            assert!(
                w[1].start >= w[0].end,
                "aggregate {agg}: calls overlap ({} and {})",
                w[0].id,
                w[1].id
            );
        }
        let mut ok: Vec<String> = calls
            .iter()
            .filter(|c| c.status == 200)
            .map(|c| c.id.clone())
            .collect();
        let before = ok.len();
        ok.dedup();
        repeats += before - ok.len();
        assert_eq!(&ok, ids, "aggregate {agg}: every message once, in order");
    }
    println!("successful calls repeated: {repeats}");
    assert!(
        repeats <= 4,
        "more repeats than the killed process had calls in flight"
    );
    // The failing aggregate held up no other: the rest was done first.
    let f_done = by_agg["f"].iter().map(|c| c.end).max().unwrap();
    let others_done = calls
        .iter()
        .filter(|c| c.aggregate != "f")
        .map(|c| c.end)
        .max()
        .unwrap();
    assert!(
        others_done < f_done,
        "the other aggregates finished before the failing one"
    );
}

/// The Rust handler of the crew test: one effect row per message, written
/// inside the inbox transaction, with the process and the call's start and
/// end. A payload's `fails` makes that many first deliveries fail after
/// writing (their effects roll back).
struct CrewEffects {
    process: String,
    call_timeout: Duration,
}

impl outbox_relay::consumer::Handler for CrewEffects {
    async fn handle(
        &self,
        tx: &mut sqlx::PgConnection,
        d: &outbox_relay::consumer::Delivery,
    ) -> outbox_relay::consumer::Outcome {
        use outbox_relay::consumer::Outcome;
        let v: serde_json::Value = serde_json::from_slice(&d.payload).unwrap_or_default();
        let aggregate = v["aggregate"].as_str().unwrap_or("").to_owned();
        let fails = v["fails"].as_i64().unwrap_or(0);
        let started: f64 =
            match sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
                .fetch_one(&mut *tx)
                .await
            {
                Ok(t) => t,
                Err(e) => return Outcome::Retry(e.to_string()),
            };
        tokio::time::sleep(Duration::from_millis(20)).await;
        if let Err(e) = sqlx::query(
            "INSERT INTO crew_effects (message_id, aggregate, process, started, ended) \
             VALUES ($1, $2, $3, $4, extract(epoch FROM clock_timestamp())::float8)",
        )
        .bind(d.message_id)
        .bind(&aggregate)
        .bind(&self.process)
        .bind(started)
        .execute(&mut *tx)
        .await
        {
            return Outcome::Retry(e.to_string());
        }
        // Inside the call, its writes and inbox row uncommitted.
        if let Some(ms) = v["sleep_ms"].as_u64() {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        // The first delivery only: past its call timeout, in Rust or in a
        // statement (a lock wait, say).
        if d.delivered == 1 {
            if let Some(ms) = v["sleep_first_ms"].as_u64() {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            if let Some(s) = v["pg_sleep_first"].as_f64() {
                if let Err(e) = sqlx::query("SELECT pg_sleep($1)")
                    .bind(s)
                    .execute(&mut *tx)
                    .await
                {
                    return Outcome::Retry(e.to_string());
                }
            }
        }
        if d.delivered <= fails {
            Outcome::Retry("fails as scripted, after writing".into())
        } else {
            Outcome::Processed
        }
    }

    fn call_timeout(&self) -> Duration {
        self.call_timeout
    }
}

/// The table `CrewEffects` writes to.
async fn crew_effects_table(pool: &sqlx::PgPool) {
    sqlx::query(
        "CREATE TABLE crew_effects (message_id uuid NOT NULL, aggregate text NOT NULL, process text NOT NULL, started float8 NOT NULL, ended float8 NOT NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
}

/// One process of a Rust-handler crew ([`crew_rust_child`]), logging to
/// `{log}-{name}.log`; `call_timeout_ms` for its handler, else 30 s.
fn rust_child(
    db: &str,
    nats: &str,
    stream: &str,
    log: &str,
    name: &str,
    call_timeout_ms: Option<u64>,
) -> std::process::Child {
    let logs = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("relay-logs");
    std::fs::create_dir_all(&logs).unwrap();
    let log = std::fs::File::create(logs.join(format!("{log}-{name}.log"))).unwrap();
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "consumer::crew_rust_child",
        "--exact",
        "--ignored",
        "--nocapture",
    ])
    .env("CREW_CHILD_DB", db)
    .env("CREW_CHILD_NATS", nats)
    .env("CREW_CHILD_STREAM", stream)
    .env("CREW_CHILD_NAME", name)
    .env("RUST_LOG", "outbox_relay=info");
    if let Some(ms) = call_timeout_ms {
        cmd.env("CREW_CHILD_CALL_TIMEOUT_MS", ms.to_string());
    }
    cmd.stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

/// Not a test: one process of the Rust crew test below, which starts it
/// with `CREW_CHILD_*` set. It runs until SIGTERM (or kill -9).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a process of the Rust crew test, started by it"]
async fn crew_rust_child() {
    let (Ok(db), Ok(nats), Ok(stream), Ok(process)) = (
        std::env::var("CREW_CHILD_DB"),
        std::env::var("CREW_CHILD_NATS"),
        std::env::var("CREW_CHILD_STREAM"),
        std::env::var("CREW_CHILD_NAME"),
    ) else {
        return;
    };
    // Its log, as `consume` writes it: printed when the test fails.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_ansi(false)
        .try_init();
    // Named after the process: a test finds its sessions by name.
    let options: sqlx::postgres::PgConnectOptions = db.parse().unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(10)
        .connect_with(options.application_name(&format!("crew-{process}")))
        .await
        .unwrap();
    let js = js(&nats).await;
    let mut cfg = rust_cfg(&stream, "rcrew", "crcrew");
    cfg.concurrency = 4;
    cfg.max_deliver = 20;
    cfg.backoff = vec![Duration::from_millis(300)];
    cfg.ack_wait = Duration::from_secs(120);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
        term.recv().await;
        stop.cancel();
    });
    outbox_relay::consumer::run(
        cfg,
        pool,
        js,
        CrewEffects {
            process,
            call_timeout: std::env::var("CREW_CHILD_CALL_TIMEOUT_MS")
                .ok()
                .and_then(|ms| ms.parse().ok())
                .map_or(Duration::from_secs(30), Duration::from_millis),
        },
        outbox_relay::Readiness::default(),
        shutdown,
    )
    .await
    .unwrap();
}

/// SPEC §11 with the Rust handler: three processes of one durable, one
/// killed (kill -9), one stopped (SIGTERM), one started mid-run. Every
/// message has exactly one committed effect, an aggregate's calls never
/// overlap and keep stream order, work moves within 5 s of the kill and 1 s
/// of the SIGTERM, and a failing aggregate holds up no other. Before the
/// crew, only the first process wrote effects (the check that all three
/// did fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_of_a_rust_handler_durable_keep_exactly_once_effects_across_a_kill_a_sigterm_and_a_join(
) {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_rcrew").await;
    crew_effects_table(&pool).await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "crcrew", DUP).await;
    let spawn = |name: &str| rust_child(&url, &stack.nats_url, &stream, "rcrew", name, None);
    // Member locks: the lease's connection holds a second lock (the
    // dispatcher's tag) beside the lease itself.
    let members = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks l WHERE locktype = 'advisory' AND objsubid = 2 AND granted \
             AND mode = 'ExclusiveLock' AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
             AND NOT EXISTS (SELECT 1 FROM pg_locks x WHERE x.pid = l.pid AND x.locktype = 'advisory' AND x.objsubid = 1)",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let leases = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let pg_now = || async {
        sqlx::query_scalar::<_, f64>("SELECT extract(epoch FROM clock_timestamp())::float8")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let mut a = spawn("a");
    eventually(T, "the first process dispatches", || async {
        leases().await == 1
    })
    .await;
    let mut b = spawn("b");
    let mut c = spawn("c");
    eventually(T, "three processes of the durable", || async {
        members().await == 3
    })
    .await;

    const N: usize = 1500;
    let publisher = {
        let js = js.clone();
        tokio::spawn(async move {
            let mut sent: HashMap<String, Vec<Uuid>> = HashMap::new();
            for i in 0..N {
                let id = Uuid::new_v4();
                let agg = if i % 100 == 0 {
                    "f".to_owned()
                } else {
                    format!("g{}", i % 30)
                };
                let body = if agg == "f" {
                    format!(r#"{{"aggregate": "{agg}", "fails": 3}}"#)
                } else {
                    format!(r#"{{"aggregate": "{agg}"}}"#)
                };
                publish(
                    &js,
                    "crcrew.event.placed.v2",
                    Some(id),
                    &agg,
                    body.as_bytes(),
                )
                .await;
                sent.entry(agg).or_default().push(id);
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            sent
        })
    };
    eventually(T, "each of the three processes writes effects", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(DISTINCT process) FROM crew_effects")
            .fetch_one(&pool)
            .await
            .unwrap()
            == 3
    })
    .await;
    let t_kill = pg_now().await;
    a.kill().unwrap();
    a.wait().unwrap();
    let mut d = spawn("d");
    eventually(T, "three processes again", || async {
        members().await == 3
    })
    .await;
    // The SIGTERM comes once the kill's takeover is done (work flows again:
    // more calls than the 12 the crew can have had in flight at the kill):
    // SPEC §11 bounds each handover, not one inside the other.
    eventually(T, "calls flow again after the kill", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM crew_effects WHERE started > $1")
            .bind(t_kill)
            .fetch_one(&pool)
            .await
            .unwrap()
            >= 20
    })
    .await;
    let t_term = pg_now().await;
    signal(b.id(), "TERM");
    let st = tokio::task::spawn_blocking(move || b.wait().unwrap())
        .await
        .unwrap();
    assert!(st.success(), "SIGTERM exit: {st:?}");
    let sent = publisher.await.unwrap();
    let publisher_done = pg_now().await;
    eventually(T, "every message has its effect", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(DISTINCT message_id) FROM crew_effects")
            .fetch_one(&pool)
            .await
            .unwrap()
            == N as i64
    })
    .await;
    assert_all_acked(&js, &stream, "rcrew").await;
    for child in [&mut c, &mut d] {
        signal(child.id(), "TERM");
    }
    for mut child in [c, d] {
        tokio::task::spawn_blocking(move || child.wait().unwrap())
            .await
            .unwrap();
    }

    let rows: Vec<(Uuid, String, f64, f64)> = sqlx::query_as(
        "SELECT message_id, aggregate, started, ended FROM crew_effects ORDER BY started",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), N, "exactly one committed effect per message");
    let stall = |t: f64, until: f64| {
        let mut last = t;
        let mut longest: f64 = 0.0;
        for (_, _, s, _) in rows.iter().filter(|r| r.2 > t && r.2 < until) {
            longest = longest.max(s - last);
            last = *s;
        }
        longest.max(until - last)
    };
    assert!(t_term + 1.0 < publisher_done, "the run covers the SIGTERM");
    let after_kill = stall(t_kill, publisher_done.min(t_kill + 5.0).min(t_term));
    let after_term = stall(t_term, publisher_done.min(t_term + 5.0));
    println!(
        "longest pause in handler calls: {after_kill:.3}s after the kill -9 of the dispatcher, {after_term:.3}s after a SIGTERM"
    );
    assert!(after_kill < 5.0, "kill -9: {after_kill}s");
    assert!(after_term < 1.0, "SIGTERM: {after_term}s");
    let mut by_agg: HashMap<String, Vec<(Uuid, f64, f64)>> = HashMap::new();
    for (id, agg, s, e) in &rows {
        by_agg.entry(agg.clone()).or_default().push((*id, *s, *e));
    }
    for (agg, ids) in &sent {
        let calls = &by_agg[agg];
        for w in calls.windows(2) {
            assert!(w[1].1 >= w[0].2, "aggregate {agg}: effects overlap");
        }
        let order: Vec<Uuid> = calls.iter().map(|c| c.0).collect();
        assert_eq!(&order, ids, "aggregate {agg}: stream order");
    }
    let f_done = by_agg["f"].iter().map(|c| c.2).fold(0.0, f64::max);
    let others_done = rows
        .iter()
        .filter(|r| r.1 != "f")
        .map(|r| r.3)
        .fold(0.0, f64::max);
    assert!(
        others_done < f_done,
        "the other aggregates finished before the failing one"
    );
}

/// Review of the crew, finding 1: a helper killed while it runs K/1, with
/// K/2 waiting behind it in the dispatcher. The lost job ended K's lane and
/// K/2 started at once (the dispatcher still counted the dead helper's
/// room), before the reset brought K/1 back: K/2 reached the handler before
/// K/1's repeat. K/2 must come after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_waiting_behind_a_job_lost_with_its_helper_runs_after_that_job_again() {
    let f = fixture(
        "c_crewlost",
        "ccrewlost",
        "crewlost",
        DUP,
        &["--concurrency", "1", "--backoff", "200ms"],
    )
    .await;
    let mut a = f.consumer;
    a.wait_ready();
    let url = db_url(&stack().admin_url, "c_crewlost");
    let handler_url = f.handler.serve().await;
    let helper = |name: &str| {
        Service::consumer_named(
            &url,
            &stack().nats_url,
            &f.stream,
            "crewlost",
            name,
            &handler_url,
            &[
                "--context",
                "ccrewlost",
                "--concurrency",
                "1",
                "--backoff",
                "200ms",
            ],
        )
    };
    let mut helpers = [helper("crewlost-b"), helper("crewlost-c")];
    eventually(T, "three processes of the durable", || async {
        a.scrape().await.value("outbox_consumer_processes") == Some(3.0)
            && a.scrape().await.value("outbox_consumer_standby") == Some(0.0)
    })
    .await;
    // X/1 holds the dispatcher's only slot; K/1 goes to a helper, which
    // dies; the other helper has room for K/2 at once.
    let (x1, k1, k2) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    publish(
        &f.js,
        "ccrewlost.e",
        Some(x1),
        "x",
        br#"{"sleep_ms": 8000}"#,
    )
    .await;
    eventually(T, "X/1 is called", || async {
        !f.handler.calls_for(x1).is_empty()
    })
    .await;
    publish(
        &f.js,
        "ccrewlost.e",
        Some(k1),
        "k",
        br#"{"sleep_ms": 3000}"#,
    )
    .await;
    eventually(T, "K/1 is called (in a helper)", || async {
        !f.handler.calls_for(k1).is_empty()
    })
    .await;
    publish(&f.js, "ccrewlost.e", Some(k2), "k", b"{}").await;
    let mut running_k1 = None;
    let deadline = Instant::now() + T;
    while running_k1.is_none() {
        for (i, h) in helpers.iter().enumerate() {
            if h.scrape().await.value("outbox_consumer_running_jobs") == Some(1.0) {
                running_k1 = Some(i);
            }
        }
        assert!(Instant::now() < deadline, "no helper runs K/1");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    helpers[running_k1.unwrap()].kill9();
    wait_processed(&f.pool, "crewlost", 3).await;
    let k1_calls = f.handler.calls_for(k1);
    let k2_calls = f.handler.calls_for(k2);
    assert_eq!(k2_calls.len(), 1);
    assert_eq!(k1_calls.len(), 2, "K/1 is called again after B died");
    assert!(
        k1_calls[1].at < k2_calls[0].at,
        "K/2 reached the handler before K/1 came back: K/1 at {:?}, K/2 at {:?}",
        k1_calls.iter().map(|c| c.at).collect::<Vec<_>>(),
        k2_calls[0].at
    );
}

/// A handler whose calls are spans: each starts when the call arrives and
/// ends when it is answered or when the caller goes away (hyper drops the
/// call's future with its connection). The payload's `sleep_ms` is the
/// time each call takes.
#[derive(Clone, Default)]
struct Spans {
    calls: Arc<Mutex<Vec<Span>>>,
}

/// A call: the message id, its start, and its end once it has ended.
type Span = (String, Instant, Option<Instant>);

struct SpanEnd(Spans, usize);

impl Drop for SpanEnd {
    fn drop(&mut self) {
        self.0.calls.lock().unwrap()[self.1].2 = Some(Instant::now());
    }
}

impl Spans {
    async fn serve(&self) -> String {
        let app = axum::Router::new()
            .route("/handle", axum::routing::post(span_answer))
            .with_state(self.clone());
        let url = serve_handler(app).await;
        url
    }

    /// When each call of `id` began, in order.
    fn starts(&self, id: Uuid) -> Vec<Instant> {
        let id = id.to_string();
        let mut at: Vec<Instant> = self
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.0 == id)
            .map(|c| c.1)
            .collect();
        at.sort();
        at
    }

    fn started(&self, id: Uuid) -> usize {
        let id = id.to_string();
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.0 == id)
            .count()
    }

    /// Two calls of one message at once, as (start, end) pairs.
    fn overlaps(&self, id: Uuid) -> Vec<String> {
        let id = id.to_string();
        let spans: Vec<(Instant, Instant)> = self
            .calls
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.0 == id)
            .map(|c| (c.1, c.2.unwrap_or_else(Instant::now)))
            .collect();
        let mut found = Vec::new();
        for (i, a) in spans.iter().enumerate() {
            for b in &spans[i + 1..] {
                if b.0 < a.1 && a.0 < b.1 {
                    found.push(format!(
                        "one call ran {:?}..{:?}, another {:?}..{:?} (from the first call's start)",
                        Duration::ZERO,
                        a.1 - a.0,
                        b.0 - a.0,
                        b.1 - a.0
                    ));
                }
            }
        }
        found
    }
}

async fn span_answer(State(h): State<Spans>, body: Bytes) -> StatusCode {
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let id = body["message_id"].as_str().unwrap().to_owned();
    let _end = {
        let mut calls = h.calls.lock().unwrap();
        calls.push((id.clone(), Instant::now(), None));
        SpanEnd(h.clone(), calls.len() - 1)
    };
    if let Some(ms) = body["payload"]["sleep_ms"].as_u64() {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    // `fail_first`: that many first calls of the message answer 500.
    if let Some(n) = body["payload"]["fail_first"].as_u64() {
        let before = h.calls.lock().unwrap().iter().filter(|c| c.0 == id).count() as u64;
        if before <= n {
            return StatusCode::INTERNAL_SERVER_ERROR;
        }
    }
    body["payload"]["status"]
        .as_u64()
        .and_then(|s| StatusCode::from_u16(s as u16).ok())
        .unwrap_or(StatusCode::OK)
}

/// The one process of `crew` that runs `n` jobs for the crew.
async fn running_jobs(crew: &[&Service], n: f64) -> usize {
    let deadline = Instant::now() + T;
    loop {
        for (i, s) in crew.iter().enumerate() {
            if s.scrape().await.value("outbox_consumer_running_jobs") == Some(n) {
                return i;
            }
        }
        assert!(Instant::now() < deadline, "no process runs {n} job(s)");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One consumer process of durable `ctx` (its log `{ctx}-solo`) on a fresh
/// database and stream, calling a [`Spans`] handler.
struct OneConsumer {
    url: String,
    pool: sqlx::PgPool,
    js: jetstream::Context,
    stream: String,
    spans: Spans,
    consumer: Service,
}

impl OneConsumer {
    async fn start(db: &str, ctx: &str, dup_window: Duration, extra: &[&str]) -> OneConsumer {
        let stack = stack();
        let (url, pool) = fresh_db(&stack, db).await;
        let js = js(&stack.nats_url).await;
        let stream = fresh_stream(&js, ctx, dup_window).await;
        let spans = Spans::default();
        let handler_url = spans.serve().await;
        let mut args = vec!["--context", ctx];
        args.extend_from_slice(extra);
        let name = format!("{ctx}-solo");
        let mut consumer = Service::consumer_named(
            &url,
            &stack.nats_url,
            &stream,
            ctx,
            &name,
            &handler_url,
            &args,
        );
        consumer.wait_ready();
        OneConsumer {
            url,
            pool,
            js,
            stream,
            spans,
            consumer,
        }
    }
}

/// A crew of `names` (the first started first: it dispatches), each with
/// `--concurrency 1`; `via` gives a process its own NATS URL.
struct Crew {
    pool: sqlx::PgPool,
    js: jetstream::Context,
    spans: Spans,
    handler_url: String,
    url: String,
    stream: String,
    ctx: &'static str,
}

impl Crew {
    async fn new(db: &str, ctx: &'static str) -> Crew {
        let stack = stack();
        let (url, pool) = fresh_db(&stack, db).await;
        let js = js(&stack.nats_url).await;
        let stream = fresh_stream(&js, ctx, DUP).await;
        let spans = Spans::default();
        let handler_url = spans.serve().await;
        Crew {
            pool,
            js,
            spans,
            handler_url,
            url,
            stream,
            ctx,
        }
    }

    /// A process of the durable on the stack's NATS: `--context` and `extra`.
    fn process_with(&self, name: &str, extra: &[&str]) -> Service {
        let mut args = vec!["--context", self.ctx];
        args.extend_from_slice(extra);
        Service::consumer_named(
            &self.url,
            &stack().nats_url,
            &self.stream,
            self.ctx,
            name,
            &self.handler_url,
            &args,
        )
    }

    fn process(&self, name: &str, nats_url: &str) -> Service {
        self.process_via(name, &self.url, nats_url)
    }

    fn process_via(&self, name: &str, db_url: &str, nats_url: &str) -> Service {
        Service::consumer_named(
            db_url,
            nats_url,
            &self.stream,
            self.ctx,
            name,
            &self.handler_url,
            &["--context", self.ctx, "--concurrency", "1"],
        )
    }

    async fn publish(&self, id: Uuid, aggregate: &str, sleep_ms: u64) {
        let body = format!(r#"{{"sleep_ms": {sleep_ms}}}"#);
        publish(
            &self.js,
            &format!("{}.e", self.ctx),
            Some(id),
            aggregate,
            body.as_bytes(),
        )
        .await;
    }

    async fn called(&self, id: Uuid) {
        eventually(T, "the message reaches the handler", || async {
            self.spans.started(id) > 0
        })
        .await;
    }

    /// With dispatcher `a` and helper `b` formed: X (taking `x_ms`) holds
    /// A's only slot, so K/1 (15 s) goes to B. Returns K/1's id once B runs it.
    async fn k1_running_on_b(&self, a: &Service, b: &Service, x_ms: u64) -> Uuid {
        eventually(T, "two processes of the durable", || async {
            a.scrape().await.value("outbox_consumer_processes") == Some(2.0)
        })
        .await;
        let (x, k1) = (Uuid::new_v4(), Uuid::new_v4());
        self.publish(x, "x", x_ms).await;
        self.called(x).await;
        self.publish(k1, "k", 15_000).await;
        self.called(k1).await;
        assert_eq!(running_jobs(&[b], 1.0).await, 0, "B runs K/1");
        k1
    }

    async fn called_again(&self, k1: Uuid) {
        eventually(T, "K/1 called again", || async {
            self.spans.started(k1) >= 2
        })
        .await;
    }

    /// Both messages processed, and K/1's two calls one after the other.
    async fn assert_k1_ran_once_at_a_time(&self, k1: Uuid) {
        wait_processed(&self.pool, self.ctx, 2).await;
        let overlaps = self.spans.overlaps(k1);
        assert!(overlaps.is_empty(), "K/1 ran twice at once: {overlaps:?}");
    }
}

/// Review of the crew, finding 2: a helper cut off from NATS (its
/// Postgres is fine) while it runs K/1. The dispatcher, hearing nothing for
/// 5 s, took the job for lost and ran K/1 again while the helper still
/// called the handler with it: two calls of one message at once. The helper
/// must stop a job it cannot be heard running before the dispatcher gives
/// up on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_helper_cut_off_from_nats_stops_its_job_before_the_dispatcher_runs_it_again() {
    let crew = Crew::new("c_crewcut", "ccrewcut").await;
    let nats = stack().nats_url;
    let proxy = Proxy::start(nats.trim_start_matches("nats://")).await;
    let mut a = crew.process("crewcut-a", &nats);
    a.wait_ready();
    let b = crew.process("crewcut-b", &proxy.nats_url());
    let k1 = crew.k1_running_on_b(&a, &b, 2_000).await;
    proxy.cut();
    crew.called_again(k1).await;
    // Review N9 (e): the call B cut is in its handler figures (a cut call
    // never reached the histogram: the slowest calls, during incidents).
    assert_eq!(
        b.scrape()
            .await
            .value("outbox_consumer_handler_seconds_count"),
        Some(1.0),
        "B's one call, cut, is timed"
    );
    proxy.heal();
    crew.assert_k1_ran_once_at_a_time(k1).await;
}

/// Review N9 (a) (issue 56): a dead letter the DLQ refused at a helper was
/// in no figure: `outbox_consumer_dead_letters_failing` and `/readyz` read
/// the dispatcher's own jobs only, so at N processes about (N-1)/N of DLQ
/// failures were invisible. The helper says so, and clears it once stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_refused_at_a_helper_is_shown_by_that_helper() {
    let crew = Crew::new("c_dlqhelper", "cdlqhelper").await;
    // A full DLQ: one message, new ones refused.
    let prefix = wire::consumer_dlq_prefix("cdlqhelper");
    let dlq_name = wire::dlq_stream_name(&prefix);
    crew.js
        .create_stream(stream::Config {
            name: dlq_name.clone(),
            subjects: vec![format!("{prefix}.>")],
            max_messages: 1,
            discard: stream::DiscardPolicy::New,
            ..Default::default()
        })
        .await
        .unwrap();
    crew.js
        .publish(format!("{prefix}.filler"), "x".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let nats = stack().nats_url;
    let mut a = crew.process("dlqhelper-a", &nats);
    a.wait_ready();
    let b = crew.process("dlqhelper-b", &nats);
    eventually(T, "two processes of the durable", || async {
        a.scrape().await.value("outbox_consumer_processes") == Some(2.0)
    })
    .await;
    // X holds A's only slot: K, rejected by the handler, runs at B.
    let (x, k) = (Uuid::new_v4(), Uuid::new_v4());
    crew.publish(x, "x", 20_000).await;
    crew.called(x).await;
    publish(
        &crew.js,
        &format!("{}.e", crew.ctx),
        Some(k),
        "k",
        br#"{"status": 422}"#,
    )
    .await;
    crew.called(k).await;
    eventually(T, "B counts the dead letter it cannot store", || async {
        b.scrape()
            .await
            .value("outbox_consumer_dead_letters_failing")
            == Some(1.0)
    })
    .await;
    let (status, body) = b.http_get("/readyz").await;
    assert_eq!(status, 503, "B's /readyz: {body}");
    assert!(body.contains("dead letter"), "{body}");
    crew.js
        .get_stream(&dlq_name)
        .await
        .unwrap()
        .purge()
        .await
        .unwrap();
    eventually(T, "stored, and B's figure back to 0", || async {
        b.scrape()
            .await
            .value("outbox_consumer_dead_letters_failing")
            == Some(0.0)
            && b.http_get("/readyz").await.0 == 200
    })
    .await;
}

/// Review of the crew, finding 4: a new dispatcher took over after hearing
/// the crew for 1.5 s, without the process it had not heard (cut off from
/// NATS, still running K/1), and reset the durable: K/1 came again and ran
/// in the new dispatcher while the old call went on. A new dispatcher must
/// account for every live process before it resets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_dispatcher_waits_for_a_live_process_it_cannot_hear_before_running_its_job_again() {
    let crew = Crew::new("c_crewadopt", "ccrewadopt").await;
    let nats = stack().nats_url;
    let proxy = Proxy::start(nats.trim_start_matches("nats://")).await;
    let mut a = crew.process("crewadopt-a", &nats);
    a.wait_ready();
    let b = crew.process("crewadopt-b", &proxy.nats_url());
    let k1 = crew.k1_running_on_b(&a, &b, 1_000).await;
    wait_processed(&crew.pool, crew.ctx, 1).await;
    let c = crew.process("crewadopt-c", &nats);
    eventually(T, "three processes of the durable", || async {
        c.scrape().await.value("outbox_consumer_processes") == Some(3.0)
    })
    .await;
    proxy.cut();
    a.kill9();
    crew.called_again(k1).await;
    proxy.heal();
    crew.assert_k1_ran_once_at_a_time(k1).await;
}

/// Review of the crew, finding 2 (its Postgres side): a helper cut off from
/// Postgres while it runs K/1, its member lock then freed by the server (a
/// dead peer found by keepalives, an idle-session timeout, an operator's
/// `pg_terminate_backend`). First the dispatcher took the job for lost at
/// once and ran K/1 again while the call went on; then the helper cut its
/// call 1.5 s into the cut-off and the dispatcher ran it again 3 s after
/// the lock went (issue 56: a pause cost a call). A helper still heard
/// keeps its job: the call runs to its end, the success it cannot record
/// goes to the dispatcher, which records it, and K/1 is called once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_helper_cut_off_from_postgres_finishes_its_job_and_the_dispatcher_records_it() {
    let crew = Crew::new("c_crewlock", "ccrewlock").await;
    let nats = stack().nats_url;
    let proxy = Proxy::start(&pg_target(&crew.url)).await;
    let mut a = crew.process("crewlock-a", &nats);
    a.wait_ready();
    let b = crew.process_via("crewlock-b", &proxy.pg_url(&crew.url), &nats);
    let k1 = crew.k1_running_on_b(&a, &b, 1_000).await;
    wait_processed(&crew.pool, crew.ctx, 1).await;
    let (_, ready) = b.http_get("/readyz").await;
    let member: i64 = ready
        .split("crew member ")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("B's /readyz names its crew member: {ready}"));
    proxy.freeze();
    let closed: bool = sqlx::query_scalar(
        "SELECT bool_or(pg_terminate_backend(pid)) FROM pg_locks \
         WHERE locktype = 'advisory' AND objsubid = 2 AND objid::text::bigint = $1",
    )
    .bind(member)
    .fetch_one(&crew.pool)
    .await
    .unwrap();
    assert!(closed, "B's member lock is held by a backend");
    wait_processed(&crew.pool, crew.ctx, 2).await;
    assert_eq!(crew.spans.started(k1), 1, "K/1 called again");
}

/// Issue 56, item 1 ("a 200 whose completion cannot be written yet is …
/// handed to a process that can write it"): a helper cut off from Postgres
/// asks the crew to record its success on `{crew}.record`. That was a
/// queue group, so the server handed each request to one process at
/// random, the asker itself or another cut-off one among them, and such a
/// pick went unanswered (10 s more with the job listed; the likely cause of
/// the rare CI failure of the test above). And a process answered
/// "recorded" for a message the inbox has no row of. Asked here as B would
/// ask, ten times, with B cut off: every request answered, and none for an
/// unknown id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_to_record_a_success_reaches_a_process_that_can_write_it() {
    let crew = Crew::new("c_crewrec", "ccrewrec").await;
    let nats = stack().nats_url;
    let proxy = Proxy::start(&pg_target(&crew.url)).await;
    let mut a = crew.process("crewrec-a", &nats);
    a.wait_ready();
    let b = crew.process_via("crewrec-b", &proxy.pg_url(&crew.url), &nats);
    let k1 = crew.k1_running_on_b(&a, &b, 1_000).await;
    proxy.freeze();
    let client = async_nats::connect(&nats).await.unwrap();
    let subject = format!(
        "{}.{}.{}.record",
        outbox_relay::wire::CREW_PREFIX,
        crew.stream,
        crew.ctx
    );
    let ask = |id: Uuid| {
        let (client, subject) = (client.clone(), subject.clone());
        async move {
            // As long as a helper waits for an answer (HANDOFF_AFTER).
            tokio::time::timeout(
                Duration::from_secs(5),
                client.request(subject, id.to_string().into()),
            )
            .await
            .ok()
            .and_then(Result::ok)
            .map(|reply| reply.payload.to_vec())
        }
    };
    for i in 0..10 {
        assert_eq!(
            ask(k1).await.as_deref(),
            Some(&b"recorded"[..]),
            "request {i} for K/1 went unanswered"
        );
    }
    let processed: Option<bool> = sqlx::query_scalar(
        "SELECT processed_at IS NOT NULL FROM inbox_messages WHERE consumer = $1 AND message_id = $2",
    )
    .bind(crew.ctx)
    .bind(k1)
    .fetch_optional(&crew.pool)
    .await
    .unwrap();
    assert_eq!(processed, Some(true), "the inbox says K/1 processed");
    assert_eq!(
        ask(Uuid::new_v4()).await,
        None,
        "recorded: a message the inbox has no row of"
    );
}

/// How long a process stays frozen (SIGSTOP) or cut off in the tests of
/// issue 43: well past the 10 s a takeover may take.
const PARTITION: Duration = Duration::from_secs(30);

/// Wait up to `limit` for `id`'s first call: how long it took, or `None`.
async fn first_call_within(spans: &Spans, id: Uuid, limit: Duration) -> Option<Duration> {
    let since = Instant::now();
    while since.elapsed() < limit {
        if spans.started(id) > 0 {
            return Some(since.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// The durable's count of delivered, unacked messages reaches `n`.
async fn ack_pending(js: &jetstream::Context, stream: &str, durable: &str, n: usize) {
    eventually(
        T,
        &format!("{n} message(s) delivered and unacked"),
        || async {
            let mut c: jetstream::consumer::PullConsumer =
                js.get_consumer_from_stream(durable, stream).await.unwrap();
            c.info().await.unwrap().num_ack_pending == n
        },
    )
    .await;
}

/// Issue 43, item 1: the dispatcher freezes (SIGSTOP: a VM pause, a stuck
/// disk) while it runs K/1 and holds K/2 behind it. Its lease was a session
/// advisory lock, which a frozen process keeps for as long as it is frozen:
/// the whole durable stopped (21.5 s of a 20 s freeze measured). Another
/// process must take over within seconds, and the frozen one, once it
/// thaws, must start nothing more: K/2 is called once, after K/1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_dispatcher_loses_the_lease_within_seconds_and_starts_nothing_when_it_thaws() {
    let crew = Crew::new("c_freeze", "cfreeze").await;
    let nats = stack().nats_url;
    let mut a = crew.process("freeze-a", &nats);
    a.wait_ready();
    let b = crew.process("freeze-b", &nats);
    eventually(T, "two processes of the durable", || async {
        a.scrape().await.value("outbox_consumer_processes") == Some(2.0)
    })
    .await;
    let (k1, k2, q1) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    crew.publish(k1, "k", 1_500).await;
    crew.called(k1).await;
    crew.publish(k2, "k", 10).await;
    ack_pending(&crew.js, &crew.stream, crew.ctx, 2).await;

    signal(a.pid(), "STOP");
    crew.publish(q1, "q", 10).await;
    let takeover = first_call_within(&crew.spans, q1, PARTITION).await;
    signal(a.pid(), "CONT");
    let takeover = takeover.unwrap_or_else(|| {
        panic!("no other process dispatched while the dispatcher was frozen for {PARTITION:?}")
    });
    println!("takeover after SIGSTOP of the dispatcher: {takeover:?}");
    wait_processed(&crew.pool, crew.ctx, 3).await;
    // Thawed, A finds its lease gone and comes back as a helper.
    eventually(T, "the thawed process back in standby", || async {
        a.scrape().await.value("outbox_consumer_standby") == Some(1.0)
    })
    .await;
    assert_eq!(
        b.scrape().await.value("outbox_consumer_standby"),
        Some(0.0),
        "B dispatches"
    );
    assert_eq!(crew.spans.started(k2), 1, "K/2 called again");
    let k1_calls = crew.spans.starts(k1);
    assert!(k1_calls.len() <= 2, "K/1 called {} times", k1_calls.len());
    assert!(
        k1_calls.iter().all(|t| *t < crew.spans.starts(k2)[0]),
        "K/2 ran before a call of K/1"
    );
    for id in [k1, k2] {
        let overlaps = crew.spans.overlaps(id);
        assert!(overlaps.is_empty(), "{id} ran twice at once: {overlaps:?}");
    }
}

/// Issue 43, item 1: the dispatcher's path to Postgres goes silent (a
/// black-holed network; the process and its NATS are fine). Postgres kept
/// its lease's backend, and the lock with it, until TCP keepalive reaped it
/// (about 2 h 11 min on Linux): no process could dispatch. Another must
/// take over within seconds, and every message after is called once, in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatcher_cut_off_from_postgres_loses_the_lease_within_seconds() {
    let crew = Crew::new("c_pgsilent", "cpgsilent").await;
    let nats = stack().nats_url;
    let proxy = Proxy::start(&pg_target(&crew.url)).await;
    let mut a = crew.process_via("pgsilent-a", &proxy.pg_url(&crew.url), &nats);
    a.wait_ready();
    let b = crew.process("pgsilent-b", &nats);
    eventually(T, "two processes of the durable", || async {
        b.scrape().await.value("outbox_consumer_processes") == Some(2.0)
    })
    .await;
    let p0 = Uuid::new_v4();
    crew.publish(p0, "p", 10).await;
    wait_processed(&crew.pool, crew.ctx, 1).await;

    proxy.freeze();
    let qs: Vec<Uuid> = (0..3).map(|_| Uuid::new_v4()).collect();
    crew.publish(qs[0], "q", 10).await;
    let takeover = first_call_within(&crew.spans, qs[0], PARTITION).await;
    proxy.heal();
    let takeover = takeover.unwrap_or_else(|| {
        panic!("no other process dispatched while the dispatcher's Postgres path was silent for {PARTITION:?}")
    });
    println!("takeover after the dispatcher's Postgres path went silent: {takeover:?}");
    for id in &qs[1..] {
        crew.publish(*id, "q", 10).await;
    }
    wait_processed(&crew.pool, crew.ctx, 4).await;
    let mut last = None;
    for id in std::iter::once(p0).chain(qs.iter().copied()) {
        let starts = crew.spans.starts(id);
        assert_eq!(starts.len(), 1, "{id} called {} times", starts.len());
        assert!(last < Some(starts[0]), "q out of order");
        last = Some(starts[0]);
    }
}

/// Issue 43, item 4: the dispatcher's lease connection is terminated (an
/// operator's `pg_terminate_backend`; a failover or a restart does the
/// same) while dozens of calls are in flight. Every running job was
/// aborted, those whose handler had already answered 200 included, and each
/// came again: a repeated successful call per job, with one process. A lost
/// lease must stop *starting* calls and let the running ones finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_repeats_no_successful_call() {
    let crew = Crew::new("c_leaselost", "cleaselost").await;
    let nats = stack().nats_url;
    let mut a = Service::consumer_named(
        &crew.url,
        &nats,
        &crew.stream,
        crew.ctx,
        "leaselost-a",
        &crew.handler_url,
        &["--context", crew.ctx],
    );
    a.wait_ready();
    const N: usize = 120;
    let ids: Vec<Uuid> = (0..N).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        crew.publish(*id, &format!("agg{i}"), 600).await;
    }
    eventually(T, "calls in flight", || async {
        crew.spans.calls.lock().unwrap().len() >= 30
    })
    .await;
    let tag = format!("outbox-relay dispatcher {}/{}", crew.stream, crew.ctx);
    let closed: bool = sqlx::query_scalar(
        "SELECT bool_or(pg_terminate_backend(pid)) FROM pg_locks \
         WHERE locktype = 'advisory' AND objsubid = 2 AND classid = hashtext($1)::oid",
    )
    .bind(&tag)
    .fetch_one(&crew.pool)
    .await
    .unwrap();
    assert!(closed, "the lease is held by a backend");
    wait_processed(&crew.pool, crew.ctx, N).await;
    let repeated: Vec<(Uuid, usize)> = ids
        .iter()
        .map(|id| (*id, crew.spans.started(*id)))
        .filter(|(_, n)| *n > 1)
        .collect();
    assert!(
        repeated.is_empty(),
        "successful calls repeated after the lease was lost: {repeated:?}"
    );
}

/// Issue 43, item 8: at the default flags (`--concurrency 48`,
/// `--max-ack-pending 50`) the durable let 50 messages out at once and the
/// dispatcher ran 48 of them itself, so a second process ran about 2: three
/// processes did 1.04 times what one did. Two processes at the defaults,
/// with a handler that takes 300 ms, must share the work about evenly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_at_the_default_flags_takes_its_share() {
    let crew = Crew::new("c_share", "cshare").await;
    let start = |name: &str| crew.process_with(name, &[]);
    let mut a = start("share-a");
    a.wait_ready();
    let b = start("share-b");
    eventually(T, "two processes of the durable", || async {
        a.scrape().await.value("outbox_consumer_processes") == Some(2.0)
    })
    .await;
    const N: usize = 400;
    for i in 0..N {
        crew.publish(Uuid::new_v4(), &format!("agg{i}"), 300).await;
    }
    wait_processed(&crew.pool, crew.ctx, N).await;
    let processed = r#"outbox_consumer_messages_total{result="processed"}"#;
    let by_a = a.scrape().await.value(processed).unwrap_or(0.0);
    let by_b = b.scrape().await.value(processed).unwrap_or(0.0);
    assert_eq!(by_a + by_b, N as f64, "every message processed once");
    assert!(
        by_a.min(by_b) >= N as f64 * 0.3,
        "one process did {} of {N}, the other {}",
        by_a.min(by_b),
        by_a.max(by_b)
    );
}

/// Issue 43, item 9: the dispatcher's figures (parked aggregates, dead
/// letters failing, messages pending) froze on a process that stopped
/// dispatching while it lived on, and the autoscaler takes the largest
/// figure of any process. A, cut off from Postgres, loses the lease to B:
/// A must report no parked aggregate, B the one there is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_stops_dispatching_reports_no_stale_figures() {
    let crew = Crew::new("c_stale", "cstale").await;
    let nats = stack().nats_url;
    let proxy = Proxy::start(&pg_target(&crew.url)).await;
    let mut a = crew.process_via("stale-a", &proxy.pg_url(&crew.url), &nats);
    a.wait_ready();
    let b = crew.process("stale-b", &nats);
    eventually(T, "two processes of the durable", || async {
        b.scrape().await.value("outbox_consumer_processes") == Some(2.0)
    })
    .await;
    let body = br#"{"status": 500}"#;
    publish(
        &crew.js,
        &format!("{}.e", crew.ctx),
        Some(Uuid::new_v4()),
        "x",
        body,
    )
    .await;
    eventually(T, "A reports the parked aggregate", || async {
        a.scrape().await.value("outbox_consumer_parked_aggregates") == Some(1.0)
    })
    .await;
    proxy.cut();
    eventually(T, "B dispatches", || async {
        b.scrape().await.value("outbox_consumer_standby") == Some(0.0)
    })
    .await;
    eventually(T, "B reports the parked aggregate", || async {
        b.scrape().await.value("outbox_consumer_parked_aggregates") == Some(1.0)
    })
    .await;
    eventually(T, "A no longer reports it", || async {
        a.scrape().await.value("outbox_consumer_parked_aggregates") == Some(0.0)
    })
    .await;
    proxy.heal();
}

/// Issue 43, item 5: a job lost with its helper let the aggregate's spilled
/// later message run before the lost one came back. K/1 runs on B; K/2 and
/// K/3 spill to the inbox (the durable's window is small); B is killed.
/// The dispatcher took K/1 for lost and went on with K/2, parked behind
/// it, at once, while the reset that brings K/1 back was still to come:
/// K/2 reached the handler before K/1's second call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_lost_with_its_helper_comes_back_before_its_spilled_successors() {
    let crew = Crew::new("c_lostorder", "clostorder").await;
    let start =
        |name: &str| crew.process_with(name, &["--concurrency", "1", "--max-ack-pending", "2"]);
    let mut a = start("lostorder-a");
    a.wait_ready();
    let mut b = start("lostorder-b");
    // Two waiting is half the durable's window (2 a process, 4 for the
    // two): K/2 and K/3, behind busy K, spill.
    let k1 = crew.k1_running_on_b(&a, &b, 1_500).await;
    let (k2, k3) = (Uuid::new_v4(), Uuid::new_v4());
    crew.publish(k2, "k", 10).await;
    crew.publish(k3, "k", 10).await;
    for i in 0..4 {
        crew.publish(Uuid::new_v4(), &format!("y{i}"), 10).await;
    }
    // K/2 and K/3 wait in the inbox (spilled), the others ran.
    eventually(T, "K/2 and K/3 spilled to the inbox", || async {
        let rows: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inbox_messages WHERE consumer = $1 \
             AND message_id = ANY($2) AND parked_until IS NOT NULL",
        )
        .bind(crew.ctx)
        .bind(vec![k2, k3])
        .fetch_one(&crew.pool)
        .await
        .unwrap();
        rows == 2
    })
    .await;
    wait_processed(&crew.pool, crew.ctx, 5).await;
    b.kill9();
    crew.called_again(k1).await;
    wait_processed(&crew.pool, crew.ctx, 8).await;
    let (k1s, k2s, k3s) = (
        crew.spans.starts(k1),
        crew.spans.starts(k2),
        crew.spans.starts(k3),
    );
    assert_eq!(
        (k2s.len(), k3s.len()),
        (1, 1),
        "K/2 and K/3 called once each"
    );
    assert!(
        k1s.iter().all(|t| *t < k2s[0]) && k2s[0] < k3s[0],
        "K/1's calls {:?}, K/2 at {:?}, K/3 at {:?}: out of order",
        k1s,
        k2s[0],
        k3s[0]
    );
}

/// Issue 43, item 6: a parked message whose copy enters the stream again (a
/// resync republish; one durable name on two streams) was skipped by its
/// retry. Parking the copy behind it moved the parked row to the copy's
/// sequence while the scheduler kept the old one, so the retry found
/// nothing there and went on to the aggregate's next parked message: K/2
/// ran before K/1 succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_message_whose_copy_comes_again_keeps_its_place() {
    // A short duplicate window: the copy is stored, not deduplicated.
    let window = Duration::from_millis(200);
    let solo = OneConsumer::start("c_parkcopy", "cparkcopy", window, &["--backoff", "3s"]).await;
    let (js, pool, spans) = (&solo.js, &solo.pool, &solo.spans);
    let (k1, k2) = (Uuid::new_v4(), Uuid::new_v4());
    let k1_body = br#"{"fail_first": 1}"#;
    publish(js, "cparkcopy.e", Some(k1), "k", k1_body).await;
    publish(js, "cparkcopy.e", Some(k2), "k", b"{}").await;
    eventually(T, "K/1 and K/2 parked", || async {
        let rows: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inbox_messages WHERE consumer = 'cparkcopy' \
             AND message_id = ANY($1) AND parked_until IS NOT NULL",
        )
        .bind(vec![k1, k2])
        .fetch_one(pool)
        .await
        .unwrap();
        rows == 2
    })
    .await;
    // K/1's copy, once the duplicate window let it in.
    let deadline = Instant::now() + T;
    let k1_text = k1.to_string();
    loop {
        let headers = [(wire::MSG_ID, k1_text.as_str()), (wire::AGGREGATE_ID, "k")];
        let ack = publish_with(js, "cparkcopy.e", &headers, k1_body).await;
        if !ack.duplicate {
            break;
        }
        assert!(Instant::now() < deadline, "the copy was never stored");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_processed(pool, "cparkcopy", 2).await;
    let (k1s, k2s) = (spans.starts(k1), spans.starts(k2));
    assert_eq!(k2s.len(), 1, "K/2 called once");
    assert!(
        k1s.len() >= 2 && k1s.iter().all(|t| *t < k2s[0]),
        "K/2 called before K/1 succeeded: K/1 at {k1s:?}, K/2 at {:?}",
        k2s[0]
    );
}

/// Issue 43, item 2: a takeover whose reset to the ack floor fails (no
/// leader yet, a permission, a timeout) was not tried again: the new
/// dispatcher pulled at once, so K/2 ran while K/1, unacked with the dead
/// dispatcher, came back only after `--ack-wait`, behind it. The reset is
/// made to fail for real: the consumer's NATS user may not publish to the
/// reset API (a configuration reload after the first dispatcher took
/// over) until the configuration is reloaded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_reset_that_fails_is_tried_again_before_anything_is_pulled() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_resetfail").await;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("resetfail");
    std::fs::create_dir_all(&dir).unwrap();
    let conf = dir.join("nats.conf");
    let write_conf = |deny: bool| {
        let deny = if deny {
            r#", permissions: { publish: { deny: ["$JS.API.CONSUMER.RESET.>"] } }"#
        } else {
            ""
        };
        std::fs::write(
            &conf,
            format!(
                "accounts {{ APP {{ jetstream: enabled, users: [ \
                 {{ user: admin, password: admin }}, \
                 {{ user: consumer, password: consumer{deny} }} ] }} }}\n"
            ),
        )
        .unwrap();
    };
    write_conf(false);
    let nats = OwnNats::start_with(&stack, "resetfail", &["-c", conf.to_str().unwrap()]);
    let admin = jetstream::new(
        async_nats::ConnectOptions::with_user_and_password("admin".into(), "admin".into())
            .connect(&nats.url)
            .await
            .unwrap(),
    );
    let stream = fresh_stream(&admin, "cresetfail", DUP).await;
    let spans = Spans::default();
    let handler_url = spans.serve().await;
    let start = |name: &str| {
        Service::consumer_named(
            &url,
            &nats.url,
            &stream,
            "cresetfail",
            name,
            &handler_url,
            &[
                "--context",
                "cresetfail",
                "--concurrency",
                "1",
                "--ack-wait",
                "30s",
                "--nats-user",
                "consumer",
                "--nats-password",
                "consumer",
            ],
        )
    };
    let mut a = start("resetfail-a");
    a.wait_ready();
    let b = start("resetfail-b");
    eventually(T, "two processes of the durable", || async {
        a.scrape().await.value("outbox_consumer_processes") == Some(2.0)
    })
    .await;
    let (k1, k2) = (Uuid::new_v4(), Uuid::new_v4());
    publish(
        &admin,
        "cresetfail.e",
        Some(k1),
        "k",
        br#"{"sleep_ms": 1000}"#,
    )
    .await;
    eventually(T, "K/1 called", || async { spans.started(k1) > 0 }).await;
    // From now on the consumer's user may not reset: a reset request of
    // that user goes unanswered once the reload took.
    let probe =
        async_nats::ConnectOptions::with_user_and_password("consumer".into(), "consumer".into())
            .connect(&nats.url)
            .await
            .unwrap();
    write_conf(true);
    signal(nats.pid(), "HUP");
    eventually(T, "the reset API denied to the consumer's user", || async {
        let ask = probe.request(format!("$JS.API.CONSUMER.RESET.{stream}.none"), "".into());
        tokio::time::timeout(Duration::from_millis(500), ask)
            .await
            .is_err()
    })
    .await;
    a.kill9();
    publish(&admin, "cresetfail.e", Some(k2), "k", b"{}").await;
    eventually(T, "B's takeover reset refused", || async {
        let log = b.log_text();
        (log.contains("no answer to the consumer reset")
            || log.contains("cannot reset the consumer"))
            && b.scrape().await.value("outbox_consumer_standby") == Some(0.0)
    })
    .await;
    write_conf(false);
    signal(nats.pid(), "HUP");
    wait_processed(&pool, "cresetfail", 2).await;
    let (k1s, k2s) = (spans.starts(k1), spans.starts(k2));
    assert_eq!(k1s.len(), 2, "K/1 called again after its dispatcher died");
    assert_eq!(k2s.len(), 1, "K/2 called once");
    assert!(
        k1s[1] < k2s[0],
        "K/2 called before K/1 came back: K/1 at {k1s:?}, K/2 at {:?}",
        k2s[0]
    );
}

/// Issue 43, item 7: a parked message delivered again (a `consumer reset`
/// below it here; an ack lost with a crash does the same) still waits its
/// backoff. The claim of a redelivered parked row said "due now"; here the
/// dispatcher knew the row's head from the inbox and kept its backoff (this
/// held before the claim said how long the row is still parked for, which
/// covers a head the dispatcher does not know).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_message_delivered_again_still_waits_its_backoff() {
    let mut solo =
        OneConsumer::start("c_redelivered", "credelivered", DUP, &["--backoff", "12s"]).await;
    let (nats_url, url, stream) = (stack().nats_url, solo.url.clone(), solo.stream.clone());
    let (js, pool, spans) = (&solo.js, &solo.pool, &solo.spans);
    let k1 = Uuid::new_v4();
    publish(js, "credelivered.e", Some(k1), "k", br#"{"fail_first": 1}"#).await;
    eventually(T, "K/1 parked", || async {
        let parked: Option<bool> = sqlx::query_scalar(
            "SELECT parked_until IS NOT NULL FROM inbox_messages \
             WHERE consumer = 'credelivered' AND message_id = $1",
        )
        .bind(k1)
        .fetch_optional(pool)
        .await
        .unwrap();
        parked == Some(true)
    })
    .await;
    solo.consumer.term(Duration::from_secs(30));
    let (code, out) = run_bounded(
        &[
            "consumer",
            "reset",
            "--database-url",
            &url,
            "--nats-url",
            &nats_url,
            "--stream",
            &stream,
            "--durable",
            "credelivered",
            "--seq",
            "1",
        ],
        T,
    );
    assert_eq!(code, Some(0), "{out}");
    solo.consumer.restart();
    solo.consumer.wait_ready();
    wait_processed(pool, "credelivered", 1).await;
    let starts = spans.starts(k1);
    assert_eq!(starts.len(), 2, "K/1 failed once, then succeeded");
    assert!(
        starts[1] - starts[0] >= Duration::from_secs(9),
        "K/1 retried {:?} after its failure, its 12 s backoff cut short",
        starts[1] - starts[0]
    );
}

/// Issue 43, item 11: a stream that captures the dead-letter subjects
/// (`dlq.{context}.>` here) was taken as the dead-letter stream: dead
/// letters went back into the stream being consumed, came back to the
/// handler as events, and their ids, the originals', were deduplicated.
/// Refused at start with one line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_captures_the_dead_letter_subjects_is_refused() {
    let stack = stack();
    let (url, _) = fresh_db(&stack, "c_dlqcap").await;
    let js = js(&stack.nats_url).await;
    let name = wire::stream_name("cdlqcap");
    let _ = js.delete_stream(&name).await;
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec!["cdlqcap.>".into(), "dlq.cdlqcap.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let (code, out) = run_bounded(
        &[
            "consume",
            "--database-url",
            &url,
            "--nats-url",
            &stack.nats_url,
            "--context",
            "cdlqcap",
            "--stream",
            &name,
            "--durable",
            "cdlqcap",
            "--handler-url",
            "http://127.0.0.1:9/h",
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        Duration::from_secs(30),
    );
    assert!(
        code.is_some_and(|c| c != 0)
            && out.contains("captures the dead-letter subjects dlq.cdlqcap.>"),
        "exit {code:?}: {out}"
    );
}

/// Issue 43, item 11: a `traceparent` with a control character made every
/// HTTP call fail before it left (an invalid header value), reported as
/// "handler unreachable" and retried for about 80 minutes before its dead
/// letter. A traceparent that is not one is dropped, as the W3C says a
/// receiver does; a valid one still travels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_traceparent_is_dropped_and_the_call_goes_out() {
    let f = fixture("c_badtrace", "cbadtrace", "cbadtrace", DUP, &[]).await;
    let (bad, good) = (Uuid::new_v4(), Uuid::new_v4());
    for (id, tp) in [
        (
            bad,
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\u{1}",
        ),
        (
            good,
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ),
    ] {
        let id = id.to_string();
        let headers = [
            (wire::MSG_ID, id.as_str()),
            (wire::AGGREGATE_ID, id.as_str()),
            (wire::TRACEPARENT, tp),
        ];
        publish_with(&f.js, "cbadtrace.e", &headers, b"{}").await;
    }
    wait_processed(&f.pool, "cbadtrace", 2).await;
    let calls = f.handler.calls_for(bad);
    assert_eq!(calls.len(), 1, "called once");
    assert_eq!(
        calls[0].traceparent, None,
        "the malformed traceparent dropped"
    );
    assert_eq!(
        f.handler.calls_for(good)[0].traceparent.as_deref(),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
}

/// Issue 43, item 11: a message within a few hundred bytes of the server's
/// max_payload, handed to a helper: the request (the message and its head)
/// was over the limit, the job was taken for lost and reset to the ack
/// floor, and the reset brought it back to the same helper, over and over
/// until the dispatcher had a slot of its own. It runs in the dispatcher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_too_large_to_hand_off_runs_in_the_dispatcher() {
    let crew = Crew::new("c_bighand", "cbighand").await;
    let nats = stack().nats_url;
    let mut a = crew.process("bighand-a", &nats);
    a.wait_ready();
    let b = crew.process("bighand-b", &nats);
    eventually(T, "two processes of the durable", || async {
        a.scrape().await.value("outbox_consumer_processes") == Some(2.0)
    })
    .await;
    let x = Uuid::new_v4();
    crew.publish(x, "x", 8_000).await;
    crew.called(x).await;
    // Y fills the message to 150 bytes short of max_payload.
    let y = Uuid::new_v4();
    let y_text = y.to_string();
    let headers = [(wire::MSG_ID, y_text.as_str()), (wire::AGGREGATE_ID, "y")];
    let max = crew.js.client().server_info().max_payload;
    // NATS/1.0 and CRLF, a line a header, the empty line.
    let header_len = 10
        + 2
        + headers
            .iter()
            .map(|(k, v)| k.len() + v.len() + 4)
            .sum::<usize>();
    let pad = "p".repeat(max - header_len - 150 - r#"{"pad":""}"#.len());
    let body = format!(r#"{{"pad":"{pad}"}}"#);
    publish_with(
        &crew.js,
        &format!("{}.e", crew.ctx),
        &headers,
        body.as_bytes(),
    )
    .await;
    wait_processed(&crew.pool, crew.ctx, 2).await;
    let x_end = {
        let calls = crew.spans.calls.lock().unwrap();
        calls
            .iter()
            .find(|c| c.0 == x.to_string())
            .and_then(|c| c.2)
            .expect("X's call ended")
    };
    let y_calls = crew.spans.starts(y);
    assert_eq!(y_calls.len(), 1, "Y called once");
    assert!(
        y_calls[0] < x_end,
        "Y waited for X's slot: it could not be handed to B"
    );
    drop(b);
}

/// Issue 43, item 1 (helpers): a helper whose path to Postgres goes silent
/// while NATS is fine went on offering room. The dispatcher handed it jobs,
/// it could not claim them, stopped them at its next failed check, and each
/// came back through a reset to the ack floor: a reset per job. A helper
/// that cannot prove its member lock offers no room and gets nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_helper_cut_off_from_postgres_is_sent_no_jobs() {
    let crew = Crew::new("c_helpercut", "chelpercut").await;
    let nats = stack().nats_url;
    let proxy = Proxy::start(&pg_target(&crew.url)).await;
    let mut a = crew.process("helpercut-a", &nats);
    a.wait_ready();
    let _b = crew.process_via("helpercut-b", &proxy.pg_url(&crew.url), &nats);
    eventually(T, "two processes of the durable", || async {
        a.scrape().await.value("outbox_consumer_processes") == Some(2.0)
    })
    .await;
    proxy.freeze();
    // B can no longer prove its member lock (at most 2.5 s after its last
    // check): it offers no room, and Postgres ends its member session
    // (3 s): the dispatcher counts it out.
    eventually(T, "the dispatcher counts B out", || async {
        let (_, ready) = a.http_get("/readyz").await;
        ready.contains("for 1 process(es)")
    })
    .await;
    let ids: Vec<Uuid> = (0..8).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        crew.publish(*id, &format!("agg{i}"), 200).await;
    }
    wait_processed(&crew.pool, crew.ctx, ids.len()).await;
    proxy.heal();
    let resets = a.log_text().matches(r#"why="lost delivery""#).count();
    assert_eq!(resets, 0, "resets to the ack floor for jobs lost in B");
    for id in &ids {
        assert_eq!(crew.spans.started(*id), 1, "{id} called once");
    }
}

/// Issue 43, item 10: failing aggregates, all due for their retry, took
/// every slot and queued ahead of a healthy aggregate, which waited for
/// them all. Twelve aggregates fail (1 s a call, retried every 200 ms) on
/// four slots; a healthy message must start before the retries queued
/// ahead of it have all had their turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_aggregates_leave_the_healthy_ones_their_share() {
    let extra = [
        "--concurrency",
        "4",
        "--backoff",
        "200ms",
        "--max-deliver",
        "-1",
    ];
    let solo = OneConsumer::start("c_fairshare", "cfairshare", DUP, &extra).await;
    let failing = br#"{"sleep_ms": 1000, "status": 500}"#;
    for i in 0..12 {
        publish(
            &solo.js,
            "cfairshare.e",
            Some(Uuid::new_v4()),
            &format!("f{i}"),
            failing,
        )
        .await;
    }
    eventually(T, "the twelve failing aggregates parked", || async {
        let parked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inbox_messages WHERE consumer = 'cfairshare' AND parked_until IS NOT NULL",
        )
        .fetch_one(&solo.pool)
        .await
        .unwrap();
        parked == 12
    })
    .await;
    let h = Uuid::new_v4();
    let published = Instant::now();
    publish(&solo.js, "cfairshare.e", Some(h), "h", b"{}").await;
    eventually(T, "the healthy message called", || async {
        solo.spans.started(h) > 0
    })
    .await;
    let h_start = solo.spans.starts(h)[0];
    let ahead = solo
        .spans
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.0 != h.to_string() && c.1 > published && c.1 < h_start)
        .count();
    assert!(
        ahead < 4,
        "{ahead} failing calls started between the healthy message's publish and its call"
    );
}

/// A call of [`FirstCallSlow`]: its message, when it began, whether it
/// ran to its end.
type SlowCall = (Uuid, Instant, Arc<AtomicBool>);

/// A Rust handler whose first call takes 3 s; each call records when it
/// began and whether it ran to its end.
#[derive(Clone, Default)]
struct FirstCallSlow {
    calls: Arc<Mutex<Vec<SlowCall>>>,
}

impl outbox_relay::consumer::Handler for FirstCallSlow {
    async fn handle(
        &self,
        _tx: &mut sqlx::PgConnection,
        d: &outbox_relay::consumer::Delivery,
    ) -> outbox_relay::consumer::Outcome {
        let ended = Arc::new(AtomicBool::new(false));
        let first = {
            let mut calls = self.calls.lock().unwrap();
            calls.push((d.message_id, Instant::now(), ended.clone()));
            calls.len() == 1
        };
        if first {
            tokio::time::sleep(Duration::from_secs(3)).await;
        }
        ended.store(true, Ordering::SeqCst);
        outbox_relay::consumer::Outcome::Processed
    }
}

/// Once `consumer::run` has returned, no Rust handler call is made or goes
/// on: a call queued for the shared inbox transaction when its job was
/// stopped is dropped, and a call in progress is cut off with its
/// transaction (rolled back; the message comes again). Before, the
/// transaction writer outlived the consumer: it finished the slow call and
/// then made the queued one, seconds after `run` had returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_rust_handler_call_runs_after_the_consumer_has_stopped() {
    let stack = stack();
    let (url, _) = fresh_db(&stack, "c_after_stop").await;
    // Four connections: one shared-transaction writer (a quarter of them),
    // so the second message's call queues behind the first's.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "cafter", DUP).await;
    let mut cfg = rust_cfg(&stream, "after", "cafter");
    cfg.shutdown_timeout = Duration::from_millis(300);
    let handler = FirstCallSlow::default();
    let consumer = RustConsumer::start(cfg, &pool, &js, handler.clone());

    let first = Uuid::new_v4();
    publish(&js, "cafter.e", Some(first), "a", b"{}").await;
    let deadline = Instant::now() + T;
    while handler.calls.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the first call never came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The second message, of another aggregate, is delivered while the
    // first call runs: its job waits for the writer.
    let second = Uuid::new_v4();
    publish(&js, "cafter.e", Some(second), "b", b"{}").await;
    loop {
        let info = js
            .get_consumer_from_stream::<jetstream::consumer::pull::Config, _, _>("after", &stream)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .clone();
        if info.num_ack_pending == 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the second message was never delivered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    consumer.stop().await;
    let stopped = Instant::now();

    // Past the end of the slow call: anything still running would show.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let calls = handler.calls.lock().unwrap().clone();
    let late: Vec<_> = calls.iter().filter(|(_, at, _)| *at > stopped).collect();
    assert!(
        late.is_empty(),
        "calls made after the consumer stopped: {late:?}"
    );
    let finished: Vec<_> = calls
        .iter()
        .filter(|(_, _, ended)| ended.load(Ordering::SeqCst))
        .map(|(id, _, _)| *id)
        .collect();
    assert!(
        finished.is_empty(),
        "calls that went on after the consumer stopped: {finished:?} (first {first}, second {second})"
    );
}

/// Issue 43, item 10: parked aggregates were held in memory without bound
/// and loaded whole at takeover. With `--max-parked-keys 2`, eight
/// aggregates fail: six are held by the inbox only. Their later messages
/// must still wait behind them (the inbox is asked), they are read back as
/// room frees, a restart loads two and leaves the rest in the inbox, and
/// every message runs once, in its aggregate's order, healthy ones
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_aggregates_past_the_memory_bound_wait_in_the_inbox_and_keep_their_order() {
    let extra = [
        "--concurrency",
        "4",
        "--backoff",
        "1s",
        "--max-parked-keys",
        "2",
    ];
    let mut solo = OneConsumer::start("c_parkcap", "cparkcap", DUP, &extra).await;
    let failing = br#"{"fail_first": 2}"#;
    let mut keys: Vec<(String, Vec<Uuid>)> = Vec::new();
    for k in 0..8 {
        let first = Uuid::new_v4();
        publish(
            &solo.js,
            "cparkcap.e",
            Some(first),
            &format!("f{k}"),
            failing,
        )
        .await;
        keys.push((format!("f{k}"), vec![first]));
    }
    eventually(T, "the eight failing aggregates parked", || async {
        let parked: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT aggregate_key) FROM inbox_messages \
             WHERE consumer = 'cparkcap' AND parked_until IS NOT NULL AND processed_at IS NULL",
        )
        .fetch_one(&solo.pool)
        .await
        .unwrap();
        parked == 8
    })
    .await;
    // Later messages of every failing aggregate, held in memory or not.
    for (key, ids) in &mut keys {
        for _ in 0..2 {
            let id = Uuid::new_v4();
            publish(&solo.js, "cparkcap.e", Some(id), key, b"{}").await;
            ids.push(id);
        }
    }
    let mut healthy = Vec::new();
    for i in 0..6 {
        let id = Uuid::new_v4();
        publish(&solo.js, "cparkcap.e", Some(id), &format!("h{i}"), b"{}").await;
        healthy.push(id);
    }
    eventually(T, "the healthy messages called", || async {
        healthy.iter().all(|id| solo.spans.started(*id) == 1)
    })
    .await;
    // A restart (SIGTERM) takes over with more parked than memory holds.
    assert!(solo.consumer.term(Duration::from_secs(30)).success());
    solo.consumer.restart();
    solo.consumer.wait_ready();
    let total = keys.iter().map(|(_, ids)| ids.len()).sum::<usize>() + healthy.len();
    eventually(Duration::from_secs(90), "every message processed", || async {
        let done: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM inbox_messages WHERE consumer = 'cparkcap' AND processed_at IS NOT NULL",
        )
        .fetch_one(&solo.pool)
        .await
        .unwrap();
        done as usize == total
    })
    .await;
    for (key, ids) in &keys {
        assert_eq!(
            solo.spans.started(ids[0]),
            3,
            "{key}: two failures, then success"
        );
        for later in &ids[1..] {
            assert_eq!(
                solo.spans.started(*later),
                1,
                "{key}: a later message called once"
            );
        }
        for pair in ids.windows(2) {
            let before = *solo.spans.starts(pair[0]).last().unwrap();
            let after = solo.spans.starts(pair[1])[0];
            assert!(
                before < after,
                "{key}: a later message ran before an earlier one succeeded"
            );
        }
    }
}

/// Issue 43, item 11: `dlq replay` refused a dead letter it had never sent
/// (a run stopped between recording the replay and publishing it leaves a
/// pending record: "already_replayed", and no call ever came), and said
/// "replayed" for a durable that would never deliver the copy (gone, or
/// filtered to other subjects).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dlq_replay_sends_a_replay_left_unsent_and_refuses_one_nothing_would_deliver() {
    let stack = stack();
    let mut f = fixture("c_dlq_pending", "cdlqp", "cdlqp", DUP, &[]).await;
    let url = db_url(&stack.admin_url, "c_dlq_pending");
    let dlq = wire::dlq_stream_name(&wire::consumer_dlq_prefix("cdlqp"));
    let (first, second) = (Uuid::new_v4(), Uuid::new_v4());
    for id in [first, second] {
        publish(
            &f.js,
            "cdlqp.e",
            Some(id),
            "a",
            br#"{"answers": [422, 200]}"#,
        )
        .await;
    }
    wait_processed(&f.pool, "cdlqp", 2).await;
    let nats = stack.nats_url.as_str();
    let (ok, out) = run_cli(&[
        "dlq",
        "list",
        "--nats-url",
        nats,
        "--stream",
        &dlq,
        "--json",
    ]);
    assert!(ok, "{out}");
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    let seq_of = |id: Uuid| {
        listed
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["id"] == id.to_string())
            .unwrap_or_else(|| panic!("{id} not listed: {out}"))["seq"]
            .as_i64()
            .unwrap()
    };
    // What a run stopped between its two steps leaves: the record, no copy.
    let created =
        f.js.get_stream(&dlq)
            .await
            .unwrap()
            .cached_info()
            .created
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap();
    sqlx::query(
        "INSERT INTO dlq_replays (dlq_stream, dlq_created, dlq_seq, consumer, message_id, replayed_by) \
         VALUES ($1, $2::timestamptz, $3, 'cdlqp', $4, 'a stopped run')",
    )
    .bind(&dlq)
    .bind(&created)
    .bind(seq_of(first))
    .bind(first)
    .execute(&f.pool)
    .await
    .unwrap();
    let replay = |id: Uuid| {
        let id = id.to_string();
        run_cli(&[
            "dlq",
            "replay",
            "--database-url",
            &url,
            "--nats-url",
            nats,
            "--stream",
            &dlq,
            "--id",
            &id,
        ])
    };
    let (ok, out) = replay(first);
    assert!(
        ok && out.contains("replayed") && !out.contains("already_replayed"),
        "{out}"
    );
    eventually(T, "the handler called once more", || async {
        f.handler.calls_for(first).len() == 2
    })
    .await;

    // A durable filtered to other subjects, then none at all: nothing would
    // deliver a copy. The dead letter stays, and no replay is recorded.
    assert!(f.consumer.term(Duration::from_secs(30)).success());
    let stream = f.js.get_stream(&f.stream).await.unwrap();
    stream
        .update_consumer(jetstream::consumer::pull::Config {
            durable_name: Some("cdlqp".into()),
            filter_subject: "cdlqp.other".into(),
            ack_policy: jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .unwrap();
    let (ok, out) = replay(second);
    assert!(
        ok && out.contains("not_replayable") && out.contains("cdlqp.other"),
        "{out}"
    );
    stream.delete_consumer("cdlqp").await.unwrap();
    let (ok, out) = replay(second);
    assert!(
        ok && out.contains("not_replayable") && out.contains("no durable cdlqp"),
        "{out}"
    );
    let recorded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM dlq_replays WHERE message_id = $1")
            .bind(second)
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(recorded, 0, "a refused replay leaves no record");
    assert_eq!(f.handler.calls_for(second).len(), 1);
}

/// Issue 56, item 5: a replay whose publish is stored but gets no answer
/// (the ack lost: a stream that does not answer, a cut path, a leader
/// change) while the consumer is busy with the aggregate. Before: the record was taken back, so the stored copy reached
/// the consumer as a duplicate and called nothing, and the next run said
/// "replayed (the stream had this replay already…)" of a replay that never
/// ran. Now the run fails saying to run it again, the copy calls the
/// handler once, and the next run says it was used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dlq_replay_whose_publish_goes_unanswered_still_calls_the_handler_once() {
    let stack = stack();
    let f = fixture("c_dlq_unanswered", "cdlqu", "cdlqu", DUP, &[]).await;
    let url = db_url(&stack.admin_url, "c_dlq_unanswered");
    let dlq = wire::dlq_stream_name(&wire::consumer_dlq_prefix("cdlqu"));
    let bad = Uuid::new_v4();
    publish(
        &f.js,
        "cdlqu.e",
        Some(bad),
        "a",
        br#"{"answers": [422, 200]}"#,
    )
    .await;
    wait_processed(&f.pool, "cdlqu", 1).await;
    // A long call of the same aggregate holds the copy back past the
    // replay's wait for its answer (a consumer behind, or down).
    let blocker = Uuid::new_v4();
    publish(
        &f.js,
        "cdlqu.e",
        Some(blocker),
        "a",
        br#"{"sleep_ms": 10000}"#,
    )
    .await;
    eventually(T, "the long call begun", || async {
        f.handler.calls_for(blocker).len() == 1
    })
    .await;
    // The stream stores what is published to it and answers nothing.
    let answers = |no_ack: bool| {
        let (js, stream) = (f.js.clone(), f.stream.clone());
        async move {
            let mut config = js
                .get_stream(&stream)
                .await
                .unwrap()
                .cached_info()
                .config
                .clone();
            config.no_ack = no_ack;
            js.update_stream(config).await.unwrap();
        }
    };
    answers(true).await;
    let nats = stack.nats_url.as_str();
    let id = bad.to_string();
    let replay = [
        "dlq",
        "replay",
        "--database-url",
        &url,
        "--nats-url",
        nats,
        "--stream",
        &dlq,
        "--id",
        &id,
    ];
    let (ok, out) = run_cli(&replay);
    assert!(
        !ok && out.contains("run the same replay again"),
        "an unanswered replay must fail and say what to do: {out}"
    );
    eventually(T, "the stored copy calls the handler", || async {
        f.handler.calls_for(bad).len() == 2
    })
    .await;
    answers(false).await;
    let (ok, out) = run_cli(&replay);
    assert!(ok && out.contains("already_replayed"), "{out}");
    assert_all_acked(&f.js, &f.stream, "cdlqu").await;
    assert_eq!(
        f.handler.calls_for(bad).len(),
        2,
        "called once more, not twice"
    );
}

/// Issue 43, item 7: a retry lost with its helper came back after 1 s
/// whatever its backoff, so a message that takes its helpers down was tried
/// again every second. K/1 fails once on helper B, and its retry (the
/// second attempt, counted) runs on B too while X holds A's only slot
/// (7 s: A is free again soon after); B is killed during it. The third
/// attempt must wait the second attempt's backoff (12 s), not come back
/// within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_lost_with_its_helper_keeps_its_backoff() {
    let crew = Crew::new("c_lostretry", "clostretry").await;
    let start =
        |name: &str| crew.process_with(name, &["--concurrency", "1", "--backoff", "1s, 12s"]);
    let mut a = start("lostretry-a");
    a.wait_ready();
    let mut b = start("lostretry-b");
    eventually(T, "two processes of the durable", || async {
        a.scrape().await.value("outbox_consumer_processes") == Some(2.0)
    })
    .await;
    let (x, k1) = (Uuid::new_v4(), Uuid::new_v4());
    crew.publish(x, "x", 7_000).await;
    crew.called(x).await;
    let subject = format!("{}.e", crew.ctx);
    let body = br#"{"sleep_ms": 3000, "fail_first": 1}"#;
    publish(&crew.js, &subject, Some(k1), "k", body).await;
    eventually(T, "K/1's retry called", || async {
        crew.spans.started(k1) == 2
    })
    .await;
    assert_eq!(running_jobs(&[&b], 1.0).await, 0, "B runs K/1's retry");
    b.kill9();
    let killed = Instant::now();
    while killed.elapsed() < Duration::from_secs(6) {
        assert_eq!(
            crew.spans.started(k1),
            2,
            "K/1 tried again {:?} after its helper died, inside its 12 s backoff",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eventually(
        Duration::from_secs(60),
        "K/1 tried a third time",
        || async { crew.spans.started(k1) == 3 },
    )
    .await;
    wait_processed(&crew.pool, crew.ctx, 2).await;
}

/// PgBouncer (Debian's) in front of the consumer's Postgres, `pool_mode`
/// of `mode`, listening on a port of its own; stopped on drop.
struct Bouncer {
    child: std::process::Child,
    dir: std::path::PathBuf,
    port: u16,
}

impl Bouncer {
    fn start(mode: &str) -> Bouncer {
        let bin = stack_tool("pgbouncer-bin", &[]);
        let target = pg_target(&stack().admin_url);
        let pg_port = target.rsplit_once(':').unwrap().1.to_owned();
        // Outside a private checkout: PgBouncer drops root for nobody.
        let dir = std::env::temp_dir().join(format!(
            "outbox-relay-pgbouncer-{mode}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let port = free_port();
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").unwrap();
        std::fs::write(
            dir.join("pgbouncer.ini"),
            format!(
                "[databases]\n* = host=127.0.0.1 port={pg_port}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {}\npool_mode = {mode}\n\
                 default_pool_size = 8\nmax_client_conn = 200\n\
                 ignore_startup_parameters = extra_float_digits,options\n",
                dir.join("users.txt").display()
            ),
        )
        .unwrap();
        let mut cmd = std::process::Command::new(&bin);
        let uid = std::process::Command::new("id").arg("-u").output().unwrap();
        if String::from_utf8_lossy(&uid.stdout).trim() == "0" {
            // PgBouncer refuses to run as root.
            cmd.args(["-u", "nobody"]);
        }
        let child = cmd
            .arg(dir.join("pgbouncer.ini"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.join("pgbouncer.log")).unwrap())
            .spawn()
            .unwrap();
        wait_listening(port, || {
            let log = std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default();
            format!("PgBouncer did not start: {log}")
        });
        Bouncer { child, dir, port }
    }

    fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Issue 43: behind a transaction-pooling PgBouncer the crew's session
/// advisory locks would stay on server connections handed to other
/// clients: the consumer refuses to start, in one line. Behind a session
/// pool it starts and consumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_pooling_proxy_is_refused_at_start_and_a_session_pool_is_not() {
    let stack = stack();
    let (_url, pool) = fresh_db(&stack, "c_bouncer").await;
    let js = js(&stack.nats_url).await;
    let _ = js.delete_stream("CBOUNCE_EVENTS").await;
    js.create_stream(stream::Config {
        name: "CBOUNCE_EVENTS".into(),
        subjects: vec!["cbounce.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    for mode in ["transaction", "statement"] {
        let bouncer = Bouncer::start(mode);
        let url = bouncer.url("c_bouncer");
        let args = consume_args(
            &url,
            &stack.nats_url,
            "CBOUNCE_EVENTS",
            "bounce",
            "http://127.0.0.1:9/h",
            &["--metrics-addr", "127.0.0.1:0"],
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = run_bounded(&args, Duration::from_secs(30));
        let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error")).collect();
        assert!(
            code == Some(1) && errors.len() == 1 && errors[0].contains("transaction-pooling"),
            "{mode}: {stderr}"
        );
    }
    let bouncer = Bouncer::start("session");
    let handler = Handler::default();
    let handler_url = handler.serve().await;
    let consumer = Service::consumer(
        &bouncer.url("c_bouncer"),
        &stack.nats_url,
        "CBOUNCE_EVENTS",
        "bounce",
        &handler_url,
        &[],
    );
    let id = Uuid::new_v4();
    publish_with(&js, "cbounce.x", &[(wire::MSG_ID, &id.to_string())], b"{}").await;
    eventually(
        T,
        "the message handled through the session pool",
        || async { handler.calls_for(id).len() == 1 },
    )
    .await;
    drop(consumer);
    drop(pool);
}

/// Issue 43: a process frozen (SIGSTOP) inside a Rust handler's call holds
/// that message's inbox row and the call's writes, uncommitted. Postgres
/// ends the frozen transaction once it has been idle past the handler's
/// call timeout (here 5 s, plus 5 s), and the process that took the lease
/// runs the message: one committed effect, and the aggregate goes on in
/// order. Before, the new process waited on the row lock for as long as
/// the freeze lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_frozen_inside_a_rust_call_holds_its_message_no_longer_than_the_call_timeout() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_rfreeze").await;
    crew_effects_table(&pool).await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "crfreeze", DUP).await;
    let spawn =
        |name: &str| rust_child(&url, &stack.nats_url, &stream, "rfreeze", name, Some(5000));
    let a = Reaped(spawn("a"));
    let slow = Uuid::new_v4();
    publish(
        &js,
        "crfreeze.event.placed.v1",
        Some(slow),
        "k",
        br#"{"aggregate": "k", "sleep_ms": 4000}"#,
    )
    .await;
    // Inside the call: its effect written, the transaction idle.
    eventually(T, "a inside the slow call", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state = 'idle in transaction' AND query LIKE 'INSERT INTO crew_effects%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            > 0
    })
    .await;
    signal(a.0.id(), "STOP");
    let frozen = Instant::now();
    let b = Reaped(spawn("b"));
    let next = Uuid::new_v4();
    publish(
        &js,
        "crfreeze.event.placed.v1",
        Some(next),
        "k",
        br#"{"aggregate": "k"}"#,
    )
    .await;
    let effects = |id: Uuid| {
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (String, f64)>(
                "SELECT process, ended FROM crew_effects WHERE message_id = $1",
            )
            .bind(id)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    eventually(T, "b runs the message the frozen a held", || async {
        effects(slow).await.len() == 1 && effects(next).await.len() == 1
    })
    .await;
    println!(
        "the held message ran elsewhere {:.1} s after the freeze",
        frozen.elapsed().as_secs_f64()
    );
    let (first, second) = (effects(slow).await, effects(next).await);
    assert_eq!(first[0].0, "b", "the frozen process committed nothing");
    assert!(first[0].1 <= second[0].1, "the aggregate keeps its order");
    // Thawed, a finds its transaction gone: still one effect each.
    signal(a.0.id(), "CONT");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(effects(slow).await.len(), 1);
    drop((a, b));
}

/// SPEC §11 with the Rust handler: a process frozen inside its calls holds
/// up its own aggregates only, and only until the crew takes its jobs for
/// lost. Its handler's calls may take 300 s, so Postgres would keep the
/// frozen group's transaction (and the row locks of up to 32 messages) for
/// five minutes: the crew ends it instead, and the other process runs the
/// frozen one's messages, and every message published meanwhile, while it
/// is still frozen. Before, the redelivered messages' claims waited on the
/// frozen transaction's row locks, taking every group writer of the other
/// process with them: nothing ran until the thaw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_rust_handler_process_holds_up_only_its_own_aggregates() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_rstall").await;
    crew_effects_table(&pool).await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "crstall", DUP).await;
    let spawn = |name: &str| {
        rust_child(
            &url,
            &stack.nats_url,
            &stream,
            "rstall",
            name,
            Some(300_000),
        )
    };
    let a = Reaped(spawn("a"));
    eventually(T, "a dispatches", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 AND granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            == 1
    })
    .await;
    let b = Reaped(spawn("b"));
    let pg_now = || async {
        sqlx::query_scalar::<_, f64>("SELECT extract(epoch FROM clock_timestamp())::float8")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    // Published at a time by Postgres's clock, which dates the effects.
    let sent: Arc<Mutex<Vec<(Uuid, String, f64)>>> = Default::default();
    let send = |aggregate: String, sleep_ms: u64| {
        let (js, sent, pool) = (js.clone(), sent.clone(), pool.clone());
        async move {
            let id = Uuid::new_v4();
            let at: f64 =
                sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            let body = format!(r#"{{"aggregate": "{aggregate}", "sleep_ms": {sleep_ms}}}"#);
            publish(
                &js,
                "crstall.event.placed.v2",
                Some(id),
                &aggregate,
                body.as_bytes(),
            )
            .await;
            sent.lock().unwrap().push((id, aggregate, at));
        }
    };
    // Calls of 400 ms on 40 aggregates until b is inside one of its own.
    let in_call = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name = 'crew-b' AND state = 'idle in transaction' \
             AND query LIKE 'INSERT INTO crew_effects%'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            > 0
    };
    let mut k = 0;
    while !in_call().await {
        send(format!("g{}", k % 40), 400).await;
        k += 1;
        assert!(k < 2_000, "b never ran a call");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    signal(b.0.id(), "STOP");
    let frozen = pg_now().await;
    // Meanwhile, aggregates b never saw.
    for i in 0..40 {
        send(format!("fresh{i}"), 50).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ids: Vec<Uuid> = sent.lock().unwrap().iter().map(|(id, ..)| *id).collect();
    eventually(T, "every message run while b is frozen", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(DISTINCT message_id) FROM crew_effects WHERE message_id = ANY($1)",
        )
        .bind(&ids)
        .fetch_one(&pool)
        .await
        .unwrap()
            == ids.len() as i64
    })
    .await;
    let effects: Vec<(Uuid, String, f64)> =
        sqlx::query_as("SELECT message_id, process, ended FROM crew_effects ORDER BY ended")
            .fetch_all(&pool)
            .await
            .unwrap();
    let ended: HashMap<Uuid, f64> = effects.iter().map(|(id, _, e)| (*id, *e)).collect();
    let worst_fresh = sent
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, agg, _)| agg.starts_with("fresh"))
        .map(|(id, _, at)| ended[id] - at)
        .fold(0.0, f64::max);
    let last = effects.iter().map(|(.., e)| *e).fold(0.0, f64::max);
    println!(
        "after b froze: the last message ran {:.1} s later; the worst wait of an aggregate b never held was {worst_fresh:.1} s",
        last - frozen
    );
    // Thawed, b finds its transaction ended and runs none of it again: it
    // takes its member lock again (Postgres ended the session that held it
    // while it was frozen), and the next message is run once.
    signal(b.0.id(), "CONT");
    eventually(T, "b back in the crew", || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
             WHERE a.application_name = 'crew-b' AND l.locktype = 'advisory' \
             AND l.objsubid = 2 AND l.mode = 'ExclusiveLock'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
            > 0
    })
    .await;
    let after = Uuid::new_v4();
    publish(
        &js,
        "crstall.event.placed.v2",
        Some(after),
        "g0",
        br#"{"aggregate": "g0"}"#,
    )
    .await;
    eventually(T, "the next message run", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM crew_effects WHERE message_id = $1")
            .bind(after)
            .fetch_one(&pool)
            .await
            .unwrap()
            == 1
    })
    .await;
    let repeated: Vec<(Uuid, i64)> = sqlx::query_as(
        "SELECT message_id, count(*) FROM crew_effects GROUP BY 1 HAVING count(*) > 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(repeated.is_empty(), "effects committed twice: {repeated:?}");
    // The ended transaction was no failed attempt of its messages.
    let counted: Vec<(Uuid, i32, Option<String>)> = sqlx::query_as(
        "SELECT message_id, attempts, last_error FROM inbox_messages \
         WHERE consumer = 'rcrew' AND (attempts <> 1 OR processed_at IS NULL)",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        counted.is_empty(),
        "attempts counted, or left unprocessed: {counted:?}"
    );
    drop((a, b));
}

/// A Rust handler's transaction that Postgres ends under it (a failover, an
/// administrator, the crew fencing a process) committed nothing and failed
/// no call: its message runs again at once, its attempt not counted.
/// Before, a lone message's transaction ended while it recorded the
/// handler's success read as a failed commit: parked for its backoff with
/// an attempt counted, and dead-lettered once those ran out, although its
/// handler had succeeded. (A deferred trigger holds the COMMIT here, so
/// the session is ended in it; ended elsewhere, it was retried already.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_transaction_ended_by_the_server_is_no_failed_attempt() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "c_rended").await;
    crew_effects_table(&pool).await;
    sqlx::raw_sql(
        "CREATE FUNCTION slow_completion() RETURNS trigger LANGUAGE plpgsql AS \
           $$BEGIN PERFORM pg_sleep(2); RETURN NULL; END$$; \
         CREATE CONSTRAINT TRIGGER slow_completion AFTER UPDATE ON inbox_messages \
           DEFERRABLE INITIALLY DEFERRED FOR EACH ROW \
           WHEN (NEW.processed_at IS NOT NULL) EXECUTE FUNCTION slow_completion();",
    )
    .execute(&pool)
    .await
    .unwrap();
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "crended", DUP).await;
    let a = Reaped(rust_child(
        &url,
        &stack.nats_url,
        &stream,
        "rended",
        "a",
        None,
    ));
    let id = Uuid::new_v4();
    publish(
        &js,
        "crended.event.placed.v1",
        Some(id),
        "k",
        br#"{"aggregate": "k"}"#,
    )
    .await;
    let completing = || async {
        sqlx::query_scalar::<_, Option<i32>>(
            "SELECT max(pid) FROM pg_stat_activity WHERE datname = current_database() \
             AND application_name = 'crew-a' AND state = 'active' AND query = 'COMMIT'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    eventually(T, "a recording the success", || async {
        completing().await.is_some()
    })
    .await;
    let pid = completing().await.unwrap();
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ended);
    wait_processed(&pool, "rcrew", 1).await;
    let (attempts, error): (i32, Option<String>) = sqlx::query_as(
        "SELECT attempts, last_error FROM inbox_messages WHERE consumer = 'rcrew' AND message_id = $1",
    )
    .bind(id)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        attempts, 1,
        "the ended transaction counted as an attempt: {error:?}"
    );
    let effects: i64 =
        sqlx::query_scalar("SELECT count(*) FROM crew_effects WHERE message_id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(effects, 1);
    drop(a);
}

/// `outbox_consumer_remote_jobs` counts the jobs other processes run for
/// the dispatcher, and nothing else. One process alone parks messages
/// behind a slow call (`--max-ack-pending 4`: the waiting ones spill to the
/// inbox) while its path to Postgres is paused, so those writes wait.
/// Before, every task of the dispatcher that was not a local call counted
/// as a job "in the other processes": bookkeeping tasks included, with no
/// other process in sight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_jobs_counts_only_jobs_other_processes_run() {
    let stack = stack();
    let (url, _pool) = fresh_db(&stack, "c_remote").await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "cremote", DUP).await;
    let handler = Handler::default();
    let handler_url = handler.serve().await;
    let proxy = Proxy::start(&pg_target(&url)).await;
    let mut c = Service::consumer(
        &proxy.pg_url(&url),
        &stack.nats_url,
        &stream,
        "cremote",
        &handler_url,
        &["--context", "cremote", "--max-ack-pending", "4"],
    );
    c.wait_ready();
    let first = Uuid::new_v4();
    publish(
        &js,
        "cremote.event.placed.v1",
        Some(first),
        "k",
        br#"{"sleep_ms": 3000}"#,
    )
    .await;
    eventually(T, "k/1 called", || async {
        !handler.calls_for(first).is_empty()
    })
    .await;
    proxy.pause();
    let mut ids = vec![first];
    for _ in 0..6 {
        let id = Uuid::new_v4();
        publish(&js, "cremote.event.placed.v1", Some(id), "k", b"{}").await;
        ids.push(id);
    }
    let mut most: f64 = 0.0;
    for _ in 0..15 {
        let m = c.scrape().await;
        most = most.max(m.value("outbox_consumer_remote_jobs").unwrap_or(0.0));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    proxy.resume();
    eventually(T, "every message called", || async {
        ids.iter().all(|id| !handler.calls_for(*id).is_empty())
    })
    .await;
    assert_eq!(
        most, 0.0,
        "jobs counted as run by other processes, with none"
    );
    for id in &ids {
        assert_eq!(handler.calls_for(*id).len(), 1, "{id} called again");
    }
}

/// A child process killed (even a stopped one) when the test ends, passed
/// or not.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A Rust handler's call over its `call_timeout` (here 1 s) fails and is
/// retried, its writes rolled back, whether it overran in Rust or in a
/// statement (which Postgres cancels); the group's other calls commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rust_call_over_its_timeout_fails_alone_and_is_retried() {
    let stack = stack();
    let (_url, pool) = fresh_db(&stack, "c_rtimeout").await;
    crew_effects_table(&pool).await;
    let js = js(&stack.nats_url).await;
    let stream = fresh_stream(&js, "crtimeout", DUP).await;
    let consumer = RustConsumer::start(
        rust_cfg(&stream, "rtimeout", "crtimeout"),
        &pool,
        &js,
        CrewEffects {
            process: "p".into(),
            call_timeout: Duration::from_secs(1),
        },
    );
    let bodies: [&[u8]; 3] = [
        br#"{"aggregate": "r", "sleep_first_ms": 3000}"#,
        br#"{"aggregate": "s", "pg_sleep_first": 600}"#,
        br#"{"aggregate": "t"}"#,
    ];
    let mut ids = Vec::new();
    for (i, body) in bodies.iter().enumerate() {
        let id = Uuid::new_v4();
        publish(
            &js,
            "crtimeout.event.placed.v1",
            Some(id),
            &format!("a{i}"),
            body,
        )
        .await;
        ids.push(id);
    }
    let effects = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM crew_effects WHERE message_id = ANY($1)")
            .bind(&ids)
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    eventually(T, "every message's effect, once", || async {
        effects().await == 3
    })
    .await;
    let attempts: Vec<i32> = sqlx::query_scalar(
        "SELECT attempts FROM inbox_messages WHERE message_id = ANY($1) ORDER BY attempts",
    )
    .bind(&ids)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(attempts, [1, 2, 2], "the two slow calls failed once each");
    consumer.stop().await;
    assert_eq!(effects().await, 3, "no effect of a failed call committed");
}
