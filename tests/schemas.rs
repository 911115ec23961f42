//! Event schemas (SPEC §10), against the real stack.

use std::path::Path;
use std::time::Duration;

use crate::common::*;
use outbox_relay::wire;

const T: Duration = Duration::from_secs(60);

const PLACED_V1: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["amount"],
  "properties": { "amount": { "type": "integer", "minimum": 0 } }
}"#;

async fn insert(pool: &sqlx::PgPool, event_type: &str, payload: serde_json::Value) -> String {
    insert_version(pool, event_type, 1, payload).await
}

async fn insert_version(
    pool: &sqlx::PgPool,
    event_type: &str,
    version: i32,
    payload: serde_json::Value,
) -> String {
    let id = uuid::Uuid::new_v4();
    sqlx::query(
        "INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, event_version, payload) \
         VALUES ($1, 'order', 'o1', $2, $3, $4)",
    )
    .bind(id)
    .bind(event_type)
    .bind(version)
    .bind(payload)
    .execute(pool)
    .await
    .unwrap();
    id.to_string()
}

fn sha256_hex(path: &Path) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(std::fs::read(path).unwrap());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The relay checks each payload against its type's schema: a valid one
/// carries `Outbox-Schema` (path and digest), an invalid one is
/// dead-lettered with reason `schema_invalid` and where and why in the
/// detail, and a type without a schema passes under `allow`, unmarked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_publishes_valid_payloads_and_dead_letters_invalid_ones() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_schema").await;
    let dir = schema_dir("relay", &[("shop/order/placed/v1.json", PLACED_V1)]);
    let relay = Service::relay(
        &url,
        &stack.nats_url,
        "schema",
        &["--schemas", dir.to_str().unwrap()],
    );
    let good = insert(&pool, "shop.order.placed", serde_json::json!({"amount": 3})).await;
    let bad = insert(
        &pool,
        "shop.order.placed",
        serde_json::json!({"amount": -1}),
    )
    .await;
    let other = insert(&pool, "shop.order.shipped", serde_json::json!({"x": 1})).await;
    let got = read_stream(&stack.nats_url, &wire::stream_name("schema"), 3, T).await;
    let ids: Vec<&str> = got.iter().map(|g| g.h(wire::MSG_ID).unwrap()).collect();
    assert_eq!(ids, [good.as_str(), bad.as_str(), other.as_str()]);

    let schema_id = format!(
        "shop/order/placed/v1.json#sha256-{}",
        sha256_hex(&dir.join("shop/order/placed/v1.json"))
    );
    assert_eq!(got[0].h(wire::SCHEMA), Some(schema_id.as_str()));
    assert_ne!(got[0].subject, wire::relay_dlq_subject("schema"));

    assert_eq!(got[1].subject, wire::relay_dlq_subject("schema"));
    assert_eq!(got[1].h(wire::DLQ_REASON), Some("schema_invalid"));
    let detail = got[1].h(wire::DLQ_DETAIL).unwrap();
    assert!(detail.starts_with("/amount: minimum: "), "{detail}");
    assert_eq!(
        got[1].payload, br#"{"amount": -1}"#,
        "the payload, as it was"
    );

    assert_eq!(got[2].h(wire::SCHEMA), None, "no schema, no header");
    assert_ne!(got[2].subject, wire::relay_dlq_subject("schema"));

    let m = relay.scrape().await;
    assert_eq!(
        m.value(r#"outbox_schema_validation_failures_total{stage="relay",event_type="shop.order.placed"}"#),
        Some(1.0)
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `--schema-missing dead-letter`: a type without a schema is dead-lettered
/// with reason `schema_missing`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_type_without_a_schema_is_dead_lettered_when_asked() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_schemamiss").await;
    let dir = schema_dir("missing", &[("shop/order/placed/v1.json", PLACED_V1)]);
    let _relay = Service::relay(
        &url,
        &stack.nats_url,
        "schemamiss",
        &[
            "--schemas",
            dir.to_str().unwrap(),
            "--schema-missing",
            "dead-letter",
        ],
    );
    let ok = insert(&pool, "shop.order.placed", serde_json::json!({"amount": 1})).await;
    let missing = insert(&pool, "shop.order.shipped", serde_json::json!({"x": 1})).await;
    let got = read_stream(&stack.nats_url, &wire::stream_name("schemamiss"), 2, T).await;
    assert_eq!(got[0].h(wire::MSG_ID), Some(ok.as_str()));
    assert_eq!(got[1].h(wire::MSG_ID), Some(missing.as_str()));
    assert_eq!(got[1].subject, wire::relay_dlq_subject("schemamiss"));
    assert_eq!(got[1].h(wire::DLQ_REASON), Some("schema_missing"));
    let _ = std::fs::remove_dir_all(dir);
}

/// A schema file that is not JSON, or not a schema, stops the relay and
/// the consumer at start with one line naming the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_schema_file_stops_relay_and_consume_at_start_naming_it() {
    let stack = stack();
    let (url, _pool) = fresh_db(&stack, "t_schemabroken").await;
    for (case, text, why) in [
        ("json", "{\"type\": ", "not valid JSON"),
        ("schema", r#"{"type": "nope"}"#, "not a valid JSON Schema"),
    ] {
        let dir = schema_dir(
            &format!("broken-{case}"),
            &[
                ("shop/order/placed/v1.json", PLACED_V1),
                ("shop/order/paid/v2.json", text),
            ],
        );
        let (code, err) = run_relay_bounded(
            &url,
            &stack.nats_url,
            "schemabroken",
            &["--schemas", dir.to_str().unwrap()],
        );
        assert_ne!(code, Some(0), "{err}");
        assert!(code.is_some(), "exits: {err}");
        let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(lines.len(), 1, "{err}");
        assert!(lines[0].contains("shop/order/paid/v2.json"), "{err}");
        assert!(lines[0].contains(why), "{err}");

        // `consume` refuses it the same way, before connecting anywhere.
        let port = free_port().to_string();
        let metrics = format!("127.0.0.1:{port}");
        let (code, err) = run_bounded(
            &[
                "consume",
                "--database-url",
                &url,
                "--nats-url",
                &stack.nats_url,
                "--stream",
                "SCHEMABROKEN_EVENTS",
                "--durable",
                "schemabroken",
                "--handler-url",
                "http://127.0.0.1:9/h",
                "--metrics-addr",
                &metrics,
                "--schemas",
                dir.to_str().unwrap(),
            ],
            Duration::from_secs(30),
        );
        assert!(code.is_some() && code != Some(0), "{err}");
        let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(lines.len(), 1, "{err}");
        assert!(
            lines[0].contains("shop/order/paid/v2.json") && lines[0].contains(why),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// SIGHUP compiles the folder again: a version added since start is
/// checked from then on, and a broken file on reload keeps the schemas in
/// force (the relay goes on; the failure is counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_schemas_and_a_broken_reload_keeps_them() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_schemahup").await;
    let dir = schema_dir("hup", &[("shop/order/placed/v1.json", PLACED_V1)]);
    let relay = Service::relay(
        &url,
        &stack.nats_url,
        "schemahup",
        &[
            "--schemas",
            dir.to_str().unwrap(),
            "--schema-missing",
            "dead-letter",
        ],
    );
    let stream = wire::stream_name("schemahup");
    let before = insert_version(
        &pool,
        "shop.order.placed",
        2,
        serde_json::json!({"amount": 1}),
    )
    .await;
    let got = read_stream(&stack.nats_url, &stream, 1, T).await;
    assert_eq!(got[0].h(wire::MSG_ID), Some(before.as_str()));
    assert_eq!(
        got[0].h(wire::DLQ_REASON),
        Some("schema_missing"),
        "no v2 yet"
    );

    let v2 = r#"{"type": "object", "required": ["amount", "currency"]}"#;
    std::fs::write(dir.join("shop/order/placed/v2.json"), v2).unwrap();
    let reloads = |result: &str| format!("outbox_schema_reloads_total{{result=\"{result}\"}}");
    assert_eq!(relay.scrape().await.value(&reloads("ok")), Some(0.0));
    signal(relay.pid(), "HUP");
    eventually(T, "the reload counted", || async {
        relay.scrape().await.value(&reloads("ok")) == Some(1.0)
    })
    .await;
    let valid = insert_version(
        &pool,
        "shop.order.placed",
        2,
        serde_json::json!({"amount": 1, "currency": "EUR"}),
    )
    .await;
    let invalid = insert_version(
        &pool,
        "shop.order.placed",
        2,
        serde_json::json!({"amount": 1}),
    )
    .await;
    let got = read_stream(&stack.nats_url, &stream, 3, T).await;
    assert_eq!(got[1].h(wire::MSG_ID), Some(valid.as_str()));
    let v2_id = format!(
        "shop/order/placed/v2.json#sha256-{}",
        sha256_hex(&dir.join("shop/order/placed/v2.json"))
    );
    assert_eq!(got[1].h(wire::SCHEMA), Some(v2_id.as_str()));
    assert_eq!(got[1].h(wire::DLQ_REASON), None);
    assert_eq!(got[2].h(wire::MSG_ID), Some(invalid.as_str()));
    assert_eq!(got[2].h(wire::DLQ_REASON), Some("schema_invalid"));
    assert!(
        got[2].h(wire::DLQ_DETAIL).unwrap().contains("currency"),
        "{:?}",
        got[2].h(wire::DLQ_DETAIL)
    );

    std::fs::write(dir.join("shop/order/placed/v3.json"), "{ broken").unwrap();
    signal(relay.pid(), "HUP");
    eventually(T, "the failed reload counted", || async {
        relay.scrape().await.value(&reloads("failed")) == Some(1.0)
    })
    .await;
    assert!(
        relay.log_text().contains("shop/order/placed/v3.json"),
        "the log names the broken file"
    );
    let still = insert_version(
        &pool,
        "shop.order.placed",
        2,
        serde_json::json!({"amount": 2, "currency": "EUR"}),
    )
    .await;
    let got = read_stream(&stack.nats_url, &stream, 4, T).await;
    assert_eq!(got[3].h(wire::MSG_ID), Some(still.as_str()));
    assert_eq!(
        got[3].h(wire::SCHEMA),
        Some(v2_id.as_str()),
        "v2 stays in force"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// `--envelope` carries the seeds' fields (`schemaUri` is the schema the
/// payload passed, `ingestedAt` the commit time), and a consumer with
/// `--schemas` checks the envelope's payload, not the envelope.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_envelope_carries_the_seeds_fields_and_the_consumer_checks_its_payload() {
    use std::sync::{Arc, Mutex};
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_schemaenv").await;
    let dir = schema_dir("env", &[("shop/order/placed/v1.json", PLACED_V1)]);
    let schemas = ["--schemas", dir.to_str().unwrap()];
    let _relay = Service::relay(
        &url,
        &stack.nats_url,
        "schemaenv",
        &[&["--envelope"][..], &schemas].concat(),
    );
    let stream = wire::stream_name("schemaenv");
    let before = time::OffsetDateTime::now_utc();
    let good = insert(&pool, "shop.order.placed", serde_json::json!({"amount": 3})).await;
    let got = read_stream(&stack.nats_url, &stream, 1, T).await;
    let v = got[0].json();
    assert_eq!(got[0].h(wire::ENVELOPE), Some("1"));
    assert_eq!(v["eventId"], good.as_str());
    assert_eq!(v["outboxId"], good.as_str());
    assert_eq!(v["eventType"], "shop.order.placed");
    assert_eq!(v["eventVersion"], 1);
    assert_eq!(v["schemaUri"].as_str(), got[0].h(wire::SCHEMA));
    assert!(v["schemaUri"]
        .as_str()
        .unwrap()
        .starts_with("shop/order/placed/v1.json#sha256-"));
    assert_eq!(v["aggregateType"], "order");
    assert_eq!(v["aggregateId"], "o1");
    assert_eq!(v["partitionKey"], "o1");
    assert_eq!(v["sourceContext"], "schemaenv");
    assert!(v["correlationId"].is_null() && v["causationId"].is_null());
    assert_eq!(v["payload"], serde_json::json!({"amount": 3}));
    let at = |k: &str| {
        time::OffsetDateTime::parse(
            v[k].as_str().unwrap_or_else(|| panic!("{k}: {v}")),
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap()
    };
    let (occurred, ingested) = (at("occurredAt"), at("ingestedAt"));
    assert!(occurred <= ingested, "committed after it occurred: {v}");
    assert!(
        ingested >= before - Duration::from_secs(5)
            && ingested <= time::OffsetDateTime::now_utc() + Duration::from_secs(5),
        "ingestedAt is the commit time: {v}"
    );

    // The consumer: the relay's valid envelope reaches the handler; an
    // envelope whose payload fails the schema (another writer's) does not.
    let calls = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = calls.clone();
    let app = axum::Router::new().route(
        "/handle",
        axum::routing::post(move |body: axum::body::Bytes| {
            let seen = seen.clone();
            async move {
                let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
                seen.lock()
                    .unwrap()
                    .push(v["message_id"].as_str().unwrap().to_owned());
                "ok"
            }
        }),
    );
    let handler_url = serve_handler(app).await;
    let _consumer = Service::consumer(
        &url,
        &stack.nats_url,
        &stream,
        "schemaenv",
        &handler_url,
        &[
            &["--context", "schemaenv", "--filter", "schemaenv.event.>"][..],
            &schemas,
        ]
        .concat(),
    );
    let bad = uuid::Uuid::new_v4().to_string();
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let mut h = async_nats::HeaderMap::new();
    h.insert(wire::MSG_ID, bad.as_str());
    h.insert(wire::EVENT_TYPE, "shop.order.placed");
    h.insert(wire::AGGREGATE_ID, "o2");
    h.insert(wire::ENVELOPE, "1");
    let body = serde_json::json!({"eventId": bad, "payload": {"amount": -1}}).to_string();
    js.send_publish(
        "schemaenv.event.shop.order.placed.v1",
        async_nats::jetstream::message::PublishMessage::build()
            .payload(body.into_bytes().into())
            .headers(h),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let dlq = read_stream(
        &stack.nats_url,
        &wire::dlq_stream_name(&wire::consumer_dlq_prefix("schemaenv")),
        1,
        T,
    )
    .await;
    assert_eq!(dlq[0].h(wire::DLQ_ORIGINAL_ID), Some(bad.as_str()));
    let reason = dlq[0].h(wire::DLQ_REASON).unwrap();
    assert!(
        reason.starts_with("schema_invalid: /amount: minimum: "),
        "the payload's pointer, not the envelope's: {reason}"
    );
    eventually(T, "the valid envelope handled", || async {
        calls.lock().unwrap().contains(&good)
    })
    .await;
    assert!(!calls.lock().unwrap().contains(&bad), "no handler call");
    let _ = std::fs::remove_dir_all(dir);
}

/// Issue 30, defect 11: `outbox_schema_validation_failures_total` took the
/// message's own event type as a label, so every distinct type without a
/// schema (`--schema-missing dead-letter`) made a series of its own, in the
/// relay and in the consumer: 100k types, 100k series. Failures of types
/// without a schema now share one label value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_types_without_a_schema_do_not_each_make_a_metric_series() {
    const TYPES: usize = 30;
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "t_schemaseries").await;
    let dir = schema_dir("series", &[("shop/order/placed/v1.json", PLACED_V1)]);
    let schemas = [
        "--schemas",
        dir.to_str().unwrap(),
        "--schema-missing",
        "dead-letter",
    ];
    let relay = Service::relay(&url, &stack.nats_url, "schemaser", &schemas);
    for i in 0..TYPES {
        insert(&pool, &format!("shop.kind{i}"), serde_json::json!({})).await;
    }
    insert(
        &pool,
        "shop.order.placed",
        serde_json::json!({"amount": -1}),
    )
    .await;
    let stream = wire::stream_name("schemaser");
    read_stream(&stack.nats_url, &stream, TYPES as u64 + 1, T).await;

    let app = axum::Router::new().route("/handle", axum::routing::post(|| async { "ok" }));
    let handler_url = serve_handler(app).await;
    let consumer = Service::consumer(
        &url,
        &stack.nats_url,
        &stream,
        "schemaser",
        &handler_url,
        &[
            &["--context", "schemaser", "--filter", "schemaser.event.>"][..],
            &schemas,
        ]
        .concat(),
    );
    let js = async_nats::jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    for i in 0..TYPES {
        let id = uuid::Uuid::new_v4().to_string();
        let mut h = async_nats::HeaderMap::new();
        h.insert(wire::MSG_ID, id.as_str());
        h.insert(wire::EVENT_TYPE, format!("shop.other{i}").as_str());
        h.insert(wire::AGGREGATE_ID, "o1");
        js.send_publish(
            "schemaser.event.x",
            async_nats::jetstream::message::PublishMessage::build()
                .payload("{}".into())
                .headers(h),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    read_stream(
        &stack.nats_url,
        &wire::dlq_stream_name(&wire::consumer_dlq_prefix("schemaser")),
        TYPES as u64,
        T,
    )
    .await;
    for (who, m) in [
        ("relay", relay.scrape().await),
        ("consume", consumer.scrape().await),
    ] {
        let series: Vec<&str> =
            m.0.lines()
                .filter(|l| l.starts_with("outbox_schema_validation_failures_total{"))
                .collect();
        assert!(
            !series.is_empty() && series.len() <= 2,
            "{who}: {} series for {TYPES} types without a schema:\n{}",
            series.len(),
            series.join("\n")
        );
    }
    assert_eq!(
        relay.scrape().await.value(
            r#"outbox_schema_validation_failures_total{stage="relay",event_type="shop.order.placed"}"#
        ),
        Some(1.0),
        "a type with a schema keeps its own series"
    );
    let _ = std::fs::remove_dir_all(dir);
}
