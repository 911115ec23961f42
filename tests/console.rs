//! SPEC §16, the operator console (issue 61): its JSON API through the
//! real router of a real `outbox-relay console`, on real Postgres (tokens,
//! `outbox_admin_log`) and nats-server (the dead letters it reads).

use std::collections::BTreeMap;

use async_nats::jetstream;
use serde_json::Value;

use crate::common::*;
use outbox_relay::wire;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");
/// How long a condition is waited for.
const T: std::time::Duration = std::time::Duration::from_secs(90);

/// Run the binary; (success, stdout, stderr).
fn cli(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(BIN).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `admin token create`: the secret it prints.
pub(crate) fn token(url: &str, name: &str, role: &str) -> String {
    let (ok, out, err) = cli(&[
        "admin",
        "token",
        "create",
        "--database-url",
        url,
        "--name",
        name,
        "--role",
        role,
        "--reason",
        "console test",
    ]);
    assert!(ok, "token create: {out}{err}");
    let secret = out.trim().to_owned();
    assert!(secret.starts_with("oxr_"), "{out}");
    secret
}

/// A dead letter as a consumer writes it; `class` none for one written
/// before the class header.
async fn letter(
    js: &jetstream::Context,
    prefix: &str,
    subject: &str,
    id: &str,
    reason: &str,
    class: Option<&str>,
) {
    let mut h = async_nats::HeaderMap::new();
    h.insert(wire::MSG_ID, format!("cons:{id}").as_str());
    h.insert(wire::DLQ_ORIGINAL_ID, id);
    h.insert(wire::DLQ_REASON, reason);
    h.insert(wire::DLQ_CONSUMER, "billing");
    h.insert(wire::DLQ_ORIGINAL_SUBJECT, subject);
    h.insert(wire::DLQ_ATTEMPTS, "5");
    h.insert("X-Customer-Email", "someone@example.com");
    // A `--header-columns` column: ours by its prefix, the event's by its value.
    h.insert("Outbox-Customer-Phone", "+1 555 0100");
    if let Some(c) = class {
        h.insert(wire::DLQ_CLASS, c);
        let fp = outbox_relay::triage::fingerprint(
            outbox_relay::triage::Class::parse(c).unwrap(),
            reason,
            None,
        );
        h.insert(wire::DLQ_FINGERPRINT, fp.as_str());
    }
    js.publish_with_headers(
        format!("{prefix}.{subject}"),
        h,
        br#"{"card":"4111 1111 1111 1111"}"#.as_ref().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
}

struct Answer {
    status: u16,
    body: Value,
    request_id: Option<String>,
}

/// Send `req`: its status, its JSON body (or its text), its request id.
async fn send(req: reqwest::RequestBuilder) -> Answer {
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let request_id = resp
        .headers()
        .get("x-request-id")
        .map(|v| v.to_str().unwrap().to_owned());
    let text = resp.text().await.unwrap();
    Answer {
        status,
        body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
        request_id,
    }
}

async fn get(http: &reqwest::Client, base: &str, path: &str, bearer: Option<&str>) -> Answer {
    let mut req = http.get(format!("{base}{path}"));
    if let Some(b) = bearer {
        req = req.header("Authorization", format!("Bearer {b}"));
    }
    send(req).await
}

/// Every route × every kind of caller: the status the router answers,
/// each refusal recorded with its request id and actor; what a viewer
/// sees of a letter; letters grouped by class; the log's chain verified,
/// and a row changed behind the triggers found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_answers_each_role_as_the_spec_says_and_refusals_are_recorded() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "console_api").await;
    let js = jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let _ = js.delete_stream("DLQ_CONSOLE").await;
    js.create_stream(jetstream::stream::Config {
        name: "DLQ_CONSOLE".into(),
        subjects: vec!["dlq.console.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    letter(
        &js,
        "dlq.console",
        "orders.placed",
        "0b5d6c1e-0000-4000-8000-000000000001",
        "handler answered 422: unknown sku \"A-1\"",
        Some("handler_rejected"),
    )
    .await;
    letter(
        &js,
        "dlq.console",
        "orders.placed",
        "0b5d6c1e-0000-4000-8000-000000000002",
        "handler answered 422: unknown sku \"B-7\"",
        Some("handler_rejected"),
    )
    .await;
    letter(
        &js,
        "dlq.console",
        "orders.paid",
        "0b5d6c1e-0000-4000-8000-000000000003",
        "last delivery (5) failed: handler timed out",
        Some("transient_exhausted"),
    )
    .await;
    // Written before the class header: classed from its reason.
    letter(
        &js,
        "dlq.console",
        "orders.paid",
        "0b5d6c1e-0000-4000-8000-000000000004",
        "last delivery (5) failed: handler answered 500: boom",
        None,
    )
    .await;

    let tokens: BTreeMap<&str, String> = [
        ("viewer", token(&url, "ann.viewer", "viewer")),
        ("operator", token(&url, "bob.operator", "operator")),
        ("admin", token(&url, "cat.admin", "admin")),
        ("expired", token(&url, "old.admin", "admin")),
        ("revoked", token(&url, "gone.admin", "admin")),
    ]
    .into_iter()
    .collect();
    sqlx::query("UPDATE outbox_admin_tokens SET created_at = now() - interval '2 hours', expires_at = now() - interval '1 hour' WHERE name = 'old.admin'")
        .execute(&pool)
        .await
        .unwrap();
    let (ok, out, err) = cli(&[
        "admin",
        "token",
        "revoke",
        "--database-url",
        &url,
        "--name",
        "gone.admin",
        "--reason",
        "left",
    ]);
    assert!(ok, "{out}{err}");
    // Bad input: one line, nothing made.
    let (ok, _, err) = cli(&[
        "admin",
        "token",
        "create",
        "--database-url",
        &url,
        "--name",
        "Bad Name",
        "--role",
        "admin",
    ]);
    assert!(!ok && err.contains("token name"), "{err}");
    let (ok, _, err) = cli(&[
        "admin",
        "token",
        "create",
        "--database-url",
        &url,
        "--name",
        "cat.admin",
        "--role",
        "viewer",
    ]);
    assert!(!ok && err.contains("exists"), "{err}");
    let (ok, _, err) = cli(&[
        "admin",
        "token",
        "revoke",
        "--database-url",
        &url,
        "--name",
        "nobody",
    ]);
    assert!(!ok && err.contains("no token"), "{err}");
    let (ok, out, _) = cli(&["admin", "token", "list", "--database-url", &url]);
    assert!(
        ok && out.contains("old.admin  admin  expired")
            && out.contains("gone.admin  admin  revoked")
            && out.contains("ann.viewer  viewer  active"),
        "{out}"
    );

    let addr = format!("127.0.0.1:{}", free_port());
    let _console = Service::console(
        &url,
        &stack.nats_url,
        &addr,
        "console_api",
        &["--streams", "DLQ_CONSOLE"],
    );
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();

    let one = "/admin/dead-letters/DLQ_CONSOLE/1";
    let routes: [(&str, &str); 8] = [
        ("/admin/whoami", "viewer"),
        ("/admin/consumers", "viewer"),
        ("/admin/slots", "viewer"),
        ("/admin/dead-letters", "viewer"),
        (one, "viewer"),
        ("/admin/log", "viewer"),
        ("/admin/log/verify", "admin"),
        ("/admin/tokens", "admin"),
    ];
    let unknown = format!("oxr_{}", "0".repeat(64));
    let callers: Vec<(&str, Option<&str>)> = vec![
        ("none", None),
        ("garbage", Some("not-a-token")),
        ("unknown", Some(unknown.as_str())),
        ("expired", Some(tokens["expired"].as_str())),
        ("revoked", Some(tokens["revoked"].as_str())),
        ("viewer", Some(tokens["viewer"].as_str())),
        ("operator", Some(tokens["operator"].as_str())),
        ("admin", Some(tokens["admin"].as_str())),
    ];
    let rank = |r: &str| ["viewer", "operator", "admin"].iter().position(|x| *x == r);
    let mut refused = Vec::new();
    for (route, least) in routes {
        for (who, bearer) in &callers {
            let a = get(&http, &base, route, *bearer).await;
            let want = match rank(who) {
                None => 401,
                Some(r) if r >= rank(least).unwrap() => 200,
                Some(_) => 403,
            };
            assert_eq!(a.status, want, "{route} as {who}: {}", a.body);
            let id = a
                .request_id
                .unwrap_or_else(|| panic!("{route} as {who}: no x-request-id"));
            if want != 200 {
                refused.push((route, *who, want, id));
            }
        }
    }
    assert_eq!(
        get(&http, &base, "/admin/openapi.json", None).await.status,
        200
    );
    assert_eq!(
        get(&http, &base, "/admin/nowhere", Some(&tokens["admin"]))
            .await
            .status,
        404
    );

    // Each refusal is one row: its request id, who, the status.
    for (route, who, status, id) in &refused {
        let row: Option<(String, String, String)> = sqlx::query_as(
            "SELECT actor, role, result FROM outbox_admin_log WHERE request_id = $1",
        )
        .bind(id)
        .fetch_optional(&pool)
        .await
        .unwrap();
        let (actor, role, result) =
            row.unwrap_or_else(|| panic!("{route} as {who} ({status}) is not recorded"));
        assert!(
            result.starts_with(&format!("denied: {status}")),
            "{route} as {who}: {result}"
        );
        match *who {
            "viewer" | "operator" => {
                assert!(
                    actor.starts_with("token:") && role == *who,
                    "{actor} {role}"
                )
            }
            // A token known but no longer valid is named.
            "expired" => assert_eq!(
                (actor.as_str(), role.as_str()),
                ("token:old.admin", "admin")
            ),
            "revoked" => assert_eq!(
                (actor.as_str(), role.as_str()),
                ("token:gone.admin", "admin")
            ),
            _ => assert_eq!((actor.as_str(), role.as_str()), ("anonymous", "anonymous")),
        }
    }
    // The CLI's changes are recorded under the database role, never $USER.
    let made: Vec<(String, String)> = sqlx::query_as(
        "SELECT actor, result FROM outbox_admin_log WHERE action = 'token.create' ORDER BY seq",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(made.len(), 7, "five made, two refused: {made:?}");
    assert!(
        made.iter().all(|(actor, _)| actor.starts_with("db:")),
        "{made:?}"
    );

    // What each role sees of a letter.
    let seen = get(&http, &base, one, Some(&tokens["viewer"])).await.body;
    assert_eq!(seen["payload"], Value::Null, "{seen}");
    assert_eq!(seen["payload_encoding"], "masked");
    assert_eq!(seen["headers"]["X-Customer-Email"][0], "•••", "{seen}");
    assert_eq!(seen["headers"]["Outbox-Customer-Phone"][0], "•••", "{seen}");
    assert_eq!(
        seen["reason"],
        Value::Null,
        "a 422's body may quote the payload: {seen}"
    );
    assert_eq!(
        seen["headers"][wire::DLQ_CLASS][0],
        "handler_rejected",
        "{seen}"
    );
    assert_eq!(seen["class"], "handler_rejected");
    assert_eq!(seen["durable"], "billing");
    assert!(
        seen["next_step"].as_str().unwrap().contains("sign-off"),
        "{seen}"
    );
    let seen = get(&http, &base, one, Some(&tokens["operator"])).await.body;
    assert!(seen["payload"].as_str().unwrap().contains("4111"), "{seen}");
    assert_eq!(
        seen["headers"]["X-Customer-Email"][0],
        "someone@example.com"
    );
    assert!(
        seen["reason"].as_str().unwrap().contains("unknown sku"),
        "{seen}"
    );
    assert_eq!(
        get(
            &http,
            &base,
            "/admin/dead-letters/DLQ_CONSOLE/99",
            Some(&tokens["viewer"])
        )
        .await
        .status,
        404
    );
    assert_eq!(
        get(
            &http,
            &base,
            "/admin/dead-letters/NO_SUCH/1",
            Some(&tokens["viewer"])
        )
        .await
        .status,
        404
    );
    assert_eq!(
        get(
            &http,
            &base,
            "/admin/dead-letters/DLQ_CONSOLE/one",
            Some(&tokens["viewer"])
        )
        .await
        .status,
        400
    );
    // Bodies: one past the limit is 413 for a caller with a token; without
    // one it is refused before it is read.
    let big = serde_json::json!({ "selection": { "all": true }, "reason": "x".repeat(70 * 1024), "dry_run": true });
    let a = post(
        &http,
        &base,
        "/admin/events/replay",
        &tokens["admin"],
        None,
        big.clone(),
    )
    .await;
    assert_eq!(a.status, 413, "{}", a.body);
    let a = http
        .post(format!("{base}/admin/events/replay"))
        .header("Content-Type", "application/json")
        .body(big.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(a.status().as_u16(), 401);

    // Grouped by class: the old letter classed from its reason.
    let g = get(
        &http,
        &base,
        "/admin/dead-letters?group_by=class",
        Some(&tokens["viewer"]),
    )
    .await
    .body;
    let counts: BTreeMap<String, u64> = g["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            (
                x["class"].as_str().unwrap().to_owned(),
                x["count"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        counts,
        [
            ("handler_failed".to_owned(), 1),
            ("handler_rejected".to_owned(), 2),
            ("transient_exhausted".to_owned(), 1)
        ]
        .into_iter()
        .collect(),
        "{g}"
    );
    assert_eq!(g["total"], 4);
    assert_eq!(g["truncated"], false);
    // One cause, one group, whatever the sku.
    let g = get(
        &http,
        &base,
        "/admin/dead-letters?group_by=fingerprint&class=handler_rejected",
        Some(&tokens["viewer"]),
    )
    .await
    .body;
    assert_eq!(g["groups"].as_array().unwrap().len(), 1, "{g}");
    assert_eq!(
        get(
            &http,
            &base,
            "/admin/dead-letters?group_by=colour",
            Some(&tokens["viewer"])
        )
        .await
        .status,
        400
    );

    // The chain holds; a row changed behind the triggers is found.
    let v = get(&http, &base, "/admin/log/verify", Some(&tokens["admin"]))
        .await
        .body;
    assert_eq!(v["holds"], true, "{v}");
    let refused_change = sqlx::query("UPDATE outbox_admin_log SET reason = 'edited' WHERE seq = 2")
        .execute(&pool)
        .await;
    assert!(refused_change.is_err(), "an UPDATE is refused");
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("ALTER TABLE outbox_admin_log DISABLE TRIGGER outbox_admin_log_no_change")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("UPDATE outbox_admin_log SET reason = 'edited' WHERE seq = 2")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE outbox_admin_log ENABLE TRIGGER outbox_admin_log_no_change")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let v = get(&http, &base, "/admin/log/verify", Some(&tokens["admin"]))
        .await
        .body;
    assert_eq!(v["holds"], false, "{v}");
    assert_eq!(v["broken"]["seq"], 2, "{v}");
}

async fn post(
    http: &reqwest::Client,
    base: &str,
    path: &str,
    bearer: &str,
    key: Option<&str>,
    body: Value,
) -> Answer {
    let mut req = http
        .post(format!("{base}{path}"))
        .header("Authorization", format!("Bearer {bearer}"))
        .header("Content-Type", "application/json")
        .body(body.to_string());
    if let Some(k) = key {
        req = req.header("Idempotency-Key", k);
    }
    send(req).await
}

/// The playbook end to end (issue 61's acceptance): a consumer
/// dead-letters three classes; the console groups them; an operator
/// dry-runs and replays the one class it may, each handler called once;
/// the same key replays nothing again, another key nothing twice; a class
/// the operator may not replay is refused and an admin's, allowed; a plan
/// whose selection changed is refused; the log shows every step with its
/// actor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_triages_by_class_and_replays_one_class_each_handler_once() {
    use crate::consumer::{assert_all_acked, fixture, publish, DUP};
    use uuid::Uuid;
    let stack = stack();
    let f = fixture(
        "c_console_e2e",
        "ccon",
        "ccon",
        DUP,
        &["--max-deliver", "2", "--backoff", "100ms"],
    )
    .await;
    let url = db_url(&stack.admin_url, "c_console_e2e");
    let dlq = wire::dlq_stream_name(&wire::consumer_dlq_prefix("ccon"));
    let rejected = Uuid::new_v4();
    let failed = [Uuid::new_v4(), Uuid::new_v4()];
    let transient = [Uuid::new_v4(), Uuid::new_v4()];
    publish(
        &f.js,
        "ccon.e",
        Some(rejected),
        "a",
        br#"{"answers": [422, 200]}"#,
    )
    .await;
    for (i, id) in failed.iter().enumerate() {
        publish(
            &f.js,
            "ccon.e",
            Some(*id),
            &format!("b{i}"),
            br#"{"answers": [500, 500, 200]}"#,
        )
        .await;
    }
    for (i, id) in transient.iter().enumerate() {
        publish(
            &f.js,
            "ccon.e",
            Some(*id),
            &format!("c{i}"),
            br#"{"answers": [503, 503, 200]}"#,
        )
        .await;
    }
    let operator = token(&url, "olga.oncall", "operator");
    let admin = token(&url, "pat.platform", "admin");
    let addr = format!("127.0.0.1:{}", free_port());
    let _console = Service::console(
        &url,
        &stack.nats_url,
        &addr,
        "console_e2e",
        &[
            "--streams",
            &dlq,
            "--operator-replay-classes",
            "transient_exhausted",
            "--replay-rate",
            "50",
        ],
    );
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();
    let by_class = || async {
        let g = get(
            &http,
            &base,
            "/admin/dead-letters?group_by=class",
            Some(&operator),
        )
        .await
        .body;
        g["groups"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| {
                        (
                            x["class"].as_str().unwrap_or_default().to_owned(),
                            x["count"].as_u64().unwrap_or(0),
                        )
                    })
                    .collect::<BTreeMap<String, u64>>()
            })
            .unwrap_or_default()
    };
    let want: BTreeMap<String, u64> = [
        ("handler_rejected", 1),
        ("handler_failed", 2),
        ("transient_exhausted", 2),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    eventually(T, "three classes of letters", || async {
        by_class().await == want
    })
    .await;
    assert_all_acked(&f.js, &f.stream, "ccon").await;
    let calls = |id: &Uuid| f.handler.calls_for(*id).len();
    assert_eq!(
        (calls(&rejected), calls(&failed[0]), calls(&transient[0])),
        (1, 2, 2)
    );

    // The operator's dry run, then the run under a key.
    let selection = serde_json::json!({ "class": "transient_exhausted" });
    let plan = post(&http, &base, "/admin/events/replay", &operator, None,
        serde_json::json!({ "selection": selection, "reason": "INC-7: the pricing service is back", "dry_run": true })).await;
    assert_eq!(plan.status, 200, "{}", plan.body);
    assert_eq!(plan.body["to_replay"], 2, "{}", plan.body);
    let plan_id = plan.body["plan_id"].as_str().unwrap().to_owned();
    let run = serde_json::json!({ "selection": selection, "reason": "INC-7: the pricing service is back", "plan_id": plan_id });
    let no_key = post(
        &http,
        &base,
        "/admin/events/replay",
        &operator,
        None,
        run.clone(),
    )
    .await;
    assert_eq!(no_key.status, 400, "{}", no_key.body);
    let started = post(
        &http,
        &base,
        "/admin/events/replay",
        &operator,
        Some("inc-7-a"),
        run.clone(),
    )
    .await;
    assert_eq!(started.status, 202, "{}", started.body);
    let job_id = started.body["job"]["id"].as_str().unwrap().to_owned();
    eventually(T, "the job done", || async {
        let j = get(
            &http,
            &base,
            &format!("/admin/jobs/{job_id}"),
            Some(&operator),
        )
        .await
        .body;
        j["job"]["state"] == "done"
    })
    .await;
    let j = get(
        &http,
        &base,
        &format!("/admin/jobs/{job_id}"),
        Some(&operator),
    )
    .await
    .body;
    assert_eq!(j["job"]["progress"]["replayed"], 2, "{j}");
    eventually(
        T,
        "each transient letter's handler called once more",
        || async { transient.iter().all(|id| calls(id) == 3) },
    )
    .await;
    assert_all_acked(&f.js, &f.stream, "ccon").await;

    // The same key: the same job, nothing sent. Another key: nothing twice.
    let again = post(
        &http,
        &base,
        "/admin/events/replay",
        &operator,
        Some("inc-7-a"),
        run.clone(),
    )
    .await;
    assert_eq!(
        (again.status, again.body["replayed_before"].clone()),
        (200, Value::Bool(true)),
        "{}",
        again.body
    );
    assert_eq!(again.body["job"]["id"], job_id.as_str());
    let other = post(
        &http,
        &base,
        "/admin/events/replay",
        &operator,
        Some("inc-7-b"),
        run.clone(),
    )
    .await;
    assert_eq!(other.status, 202, "{}", other.body);
    let other_id = other.body["job"]["id"].as_str().unwrap().to_owned();
    eventually(T, "the second job done", || async {
        get(
            &http,
            &base,
            &format!("/admin/jobs/{other_id}"),
            Some(&operator),
        )
        .await
        .body["job"]["state"]
            == "done"
    })
    .await;
    let j = get(
        &http,
        &base,
        &format!("/admin/jobs/{other_id}"),
        Some(&operator),
    )
    .await
    .body;
    assert_eq!(j["job"]["progress"]["already_replayed"], 2, "{j}");
    // A key of one plan for another: refused.
    let wrong = post(&http, &base, "/admin/events/replay", &operator, Some("inc-7-a"),
        serde_json::json!({ "selection": { "class": "handler_failed" }, "reason": "x", "plan_id": "0000" })).await;
    assert_eq!(wrong.status, 409, "{}", wrong.body);

    // A class the operator may not replay; an admin may.
    let failed_sel = serde_json::json!({ "class": "handler_failed" });
    let plan = post(&http, &base, "/admin/events/replay", &operator, None,
        serde_json::json!({ "selection": failed_sel, "reason": "fix 1.4.2 deployed", "dry_run": true })).await;
    let failed_plan = plan.body["plan_id"].as_str().unwrap().to_owned();
    let run_failed = serde_json::json!({ "selection": failed_sel, "reason": "fix 1.4.2 deployed", "plan_id": failed_plan });
    let refused = post(
        &http,
        &base,
        "/admin/events/replay",
        &operator,
        Some("fix-142"),
        run_failed.clone(),
    )
    .await;
    assert_eq!(refused.status, 403, "{}", refused.body);
    let allowed = post(
        &http,
        &base,
        "/admin/events/replay",
        &admin,
        Some("fix-142"),
        run_failed.clone(),
    )
    .await;
    assert_eq!(allowed.status, 202, "{}", allowed.body);
    eventually(
        T,
        "each failed letter's handler called once more",
        || async { failed.iter().all(|id| calls(id) == 3) },
    )
    .await;

    // A plan bound to its letters: one more of the class, and it is refused.
    let rejected_sel = serde_json::json!({ "class": "handler_rejected" });
    let plan = post(
        &http,
        &base,
        "/admin/events/replay",
        &admin,
        None,
        serde_json::json!({ "selection": rejected_sel, "reason": "INC-9", "dry_run": true }),
    )
    .await;
    let stale = plan.body["plan_id"].as_str().unwrap().to_owned();
    publish(
        &f.js,
        "ccon.e",
        Some(Uuid::new_v4()),
        "d",
        br#"{"answers": [422]}"#,
    )
    .await;
    eventually(T, "a second rejected letter", || async {
        by_class().await.get("handler_rejected") == Some(&2)
    })
    .await;
    let changed = post(
        &http,
        &base,
        "/admin/events/replay",
        &admin,
        Some("inc-9"),
        serde_json::json!({ "selection": rejected_sel, "reason": "INC-9", "plan_id": stale }),
    )
    .await;
    assert_eq!(changed.status, 409, "{}", changed.body);
    assert_eq!(calls(&rejected), 1, "nothing replayed on a stale plan");
    assert_eq!(
        transient.iter().map(calls).collect::<Vec<_>>(),
        [3, 3],
        "never a fourth call"
    );

    // Every step, with its actor.
    let steps: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT actor, action, result FROM outbox_admin_log WHERE action LIKE 'replay%' ORDER BY seq",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    let has = |actor: &str, action: &str, result: &str| {
        steps
            .iter()
            .any(|(a, b, r)| a == actor && b == action && r.starts_with(result))
    };
    for (actor, action, result) in [
        ("token:olga.oncall", "replay.plan", "done"),
        ("token:olga.oncall", "replay.start", "done"),
        ("token:olga.oncall", "replay.finish", "done: done"),
        ("token:olga.oncall", "replay", "denied: 403"),
        ("token:pat.platform", "replay.start", "done"),
        ("token:pat.platform", "replay.finish", "done: done"),
    ] {
        assert!(
            has(actor, action, result),
            "no {action} {result} by {actor}: {steps:?}"
        );
    }
    let replayed_by: Vec<String> =
        sqlx::query_scalar("SELECT DISTINCT replayed_by FROM dlq_replays ORDER BY 1")
            .fetch_all(&f.pool)
            .await
            .unwrap();
    assert_eq!(replayed_by, ["token:olga.oncall", "token:pat.platform"]);
    let v = get(&http, &base, "/admin/log/verify", Some(&admin))
        .await
        .body;
    assert_eq!(v["holds"], true, "{v}");
}

/// Delete with sign-off (SPEC §16, issue 61 item 5): an admin asks with a
/// reason and a plan; the letters stay; the admin who asked cannot approve
/// (403, recorded); a second admin's approval deletes exactly the plan's
/// letters; a request whose letters changed is refused; a rejection
/// deletes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_waits_for_a_second_admin_and_deletes_only_what_was_asked() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "console_delete").await;
    let js = jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let _ = js.delete_stream("DLQ_CONSOLE_DEL").await;
    js.create_stream(jetstream::stream::Config {
        name: "DLQ_CONSOLE_DEL".into(),
        subjects: vec!["dlq.consoledel.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let poison = [
        "0b5d6c1e-0000-4000-8000-0000000000a1",
        "0b5d6c1e-0000-4000-8000-0000000000a2",
    ];
    for id in poison {
        letter(
            &js,
            "dlq.consoledel",
            "orders.placed",
            id,
            "handler answered 422: unknown sku \"Z\"",
            Some("handler_rejected"),
        )
        .await;
    }
    letter(
        &js,
        "dlq.consoledel",
        "orders.paid",
        "0b5d6c1e-0000-4000-8000-0000000000b1",
        "last delivery (5) failed: handler timed out",
        Some("transient_exhausted"),
    )
    .await;
    let (ann, bob) = (
        token(&url, "ann.admin", "admin"),
        token(&url, "bob.admin", "admin"),
    );
    let viewer = token(&url, "val.viewer", "viewer");
    let addr = format!("127.0.0.1:{}", free_port());
    let _console = Service::console(
        &url,
        &stack.nats_url,
        &addr,
        "console_delete",
        &["--streams", "DLQ_CONSOLE_DEL"],
    );
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();
    let held = || async {
        js.get_stream("DLQ_CONSOLE_DEL")
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .state
            .messages
    };

    let sel = serde_json::json!({ "class": "handler_rejected" });
    let viewer_asks = post(
        &http,
        &base,
        "/admin/dead-letters/delete",
        &viewer,
        None,
        serde_json::json!({ "selection": sel, "reason": "poison", "dry_run": true }),
    )
    .await;
    assert_eq!(viewer_asks.status, 403, "{}", viewer_asks.body);
    let plan = post(&http, &base, "/admin/dead-letters/delete", &ann, None,
        serde_json::json!({ "selection": sel, "reason": "INC-11: poison, producer fixed", "dry_run": true })).await;
    assert_eq!(
        (plan.status, plan.body["letters"].clone()),
        (200, Value::from(2)),
        "{}",
        plan.body
    );
    let ask = serde_json::json!({ "selection": sel, "reason": "INC-11: poison, producer fixed", "plan_id": plan.body["plan_id"] });
    let asked = post(
        &http,
        &base,
        "/admin/dead-letters/delete",
        &ann,
        Some("inc-11"),
        ask.clone(),
    )
    .await;
    assert_eq!(asked.status, 202, "{}", asked.body);
    assert_eq!(asked.body["request"]["state"], "pending");
    let id = asked.body["request"]["id"].as_str().unwrap().to_owned();
    assert_eq!(held().await, 3, "kept until approved");
    // The same key: the same request.
    let again = post(
        &http,
        &base,
        "/admin/dead-letters/delete",
        &ann,
        Some("inc-11"),
        ask,
    )
    .await;
    assert_eq!(
        (again.status, again.body["request"]["id"].as_str()),
        (200, Some(id.as_str())),
        "{}",
        again.body
    );

    let own = post(
        &http,
        &base,
        &format!("/admin/approvals/{id}/approve"),
        &ann,
        None,
        Value::Null,
    )
    .await;
    assert_eq!(own.status, 403, "{}", own.body);
    assert_eq!(held().await, 3);
    let approved = post(
        &http,
        &base,
        &format!("/admin/approvals/{id}/approve"),
        &bob,
        None,
        Value::Null,
    )
    .await;
    assert_eq!(approved.status, 200, "{}", approved.body);
    assert_eq!(
        approved.body["request"]["state"], "deleted",
        "{}",
        approved.body
    );
    assert_eq!(held().await, 1, "the two poison letters, and only they");
    let twice = post(
        &http,
        &base,
        &format!("/admin/approvals/{id}/approve"),
        &bob,
        None,
        Value::Null,
    )
    .await;
    assert_eq!(twice.status, 409, "{}", twice.body);

    // Asked, then the letters change: the approval deletes nothing.
    let sel = serde_json::json!({ "class": "transient_exhausted" });
    let plan = post(
        &http,
        &base,
        "/admin/dead-letters/delete",
        &bob,
        None,
        serde_json::json!({ "selection": sel, "reason": "INC-12", "dry_run": true }),
    )
    .await;
    let asked = post(&http, &base, "/admin/dead-letters/delete", &bob, Some("inc-12"),
        serde_json::json!({ "selection": sel, "reason": "INC-12", "plan_id": plan.body["plan_id"] })).await;
    let stale = asked.body["request"]["id"].as_str().unwrap().to_owned();
    letter(
        &js,
        "dlq.consoledel",
        "orders.paid",
        "0b5d6c1e-0000-4000-8000-0000000000b2",
        "last delivery (5) failed: handler timed out",
        Some("transient_exhausted"),
    )
    .await;
    let refused = post(
        &http,
        &base,
        &format!("/admin/approvals/{stale}/approve"),
        &ann,
        None,
        Value::Null,
    )
    .await;
    assert_eq!(refused.status, 409, "{}", refused.body);
    assert_eq!(held().await, 2, "nothing deleted");
    // A rejection deletes nothing either.
    let plan = post(
        &http,
        &base,
        "/admin/dead-letters/delete",
        &bob,
        None,
        serde_json::json!({ "selection": sel, "reason": "INC-13", "dry_run": true }),
    )
    .await;
    let asked = post(&http, &base, "/admin/dead-letters/delete", &bob, Some("inc-13"),
        serde_json::json!({ "selection": sel, "reason": "INC-13", "plan_id": plan.body["plan_id"] })).await;
    let rejected = asked.body["request"]["id"].as_str().unwrap().to_owned();
    let r = post(
        &http,
        &base,
        &format!("/admin/approvals/{rejected}/reject"),
        &ann,
        None,
        Value::Null,
    )
    .await;
    assert_eq!(
        (r.status, r.body["request"]["state"].as_str()),
        (200, Some("rejected")),
        "{}",
        r.body
    );
    assert_eq!(held().await, 2);
    let list = get(&http, &base, "/admin/approvals", Some(&viewer))
        .await
        .body;
    let states: Vec<&str> = list["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["state"].as_str().unwrap())
        .collect();
    assert_eq!(states.len(), 3, "{list}");
    assert!(
        states.contains(&"deleted") && states.contains(&"stale") && states.contains(&"rejected"),
        "{list}"
    );

    // The sign-off in the log: who asked, who was refused, who approved.
    let steps: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT actor, action, result FROM outbox_admin_log WHERE action LIKE 'delete%' ORDER BY seq",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    for (actor, action, result) in [
        ("token:val.viewer", "delete", "denied: 403"),
        ("token:ann.admin", "delete.plan", "done"),
        ("token:ann.admin", "delete.request", "done"),
        ("token:ann.admin", "delete.approve", "denied: 403"),
        (
            "token:bob.admin",
            "delete.approve",
            "done: approved; deleting 2 letters",
        ),
        (
            "token:bob.admin",
            "delete.finish",
            "done: 2 letters deleted",
        ),
        (
            "token:ann.admin",
            "delete.approve",
            "failed: the letters changed",
        ),
        ("token:ann.admin", "delete.reject", "done"),
    ] {
        assert!(
            steps
                .iter()
                .any(|(a, b, r)| a == actor && b == action && r.starts_with(result)),
            "no {action} {result} by {actor}: {steps:?}"
        );
    }
}

/// `--admin-addr` on `consume` (SPEC §16): the console beside the
/// consumer, reading its dead-letter stream, under the same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_serves_the_console_beside_itself() {
    use crate::consumer::{fixture, publish, DUP};
    let stack = stack();
    let addr = format!("127.0.0.1:{}", free_port());
    let f = fixture(
        "c_console_beside",
        "cbes",
        "cbes",
        DUP,
        &["--admin-addr", &addr],
    )
    .await;
    let url = db_url(&stack.admin_url, "c_console_beside");
    let viewer = token(&url, "vic.viewer", "viewer");
    publish(
        &f.js,
        "cbes.e",
        Some(uuid::Uuid::new_v4()),
        "a",
        br#"{"answers": [422]}"#,
    )
    .await;
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();
    assert_eq!(get(&http, &base, "/admin/whoami", None).await.status, 401);
    eventually(
        T,
        "the consumer's letter, grouped, through its own console",
        || async {
            let g = get(
                &http,
                &base,
                "/admin/dead-letters?group_by=class",
                Some(&viewer),
            )
            .await;
            g.status == 200 && g.body["groups"][0]["class"] == "handler_rejected"
        },
    )
    .await;
}

/// The pages' forms (SPEC §16: "forms are protected from cross-site
/// requests"): a sign-in or an action posted from another site or origin,
/// or without the session's anti-forgery value, is refused 403 and
/// recorded; the session cookie is HttpOnly and SameSite=Strict, and ends
/// with a sign-out; a page without a session sends the browser to sign in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_site_forms_are_refused_and_recorded() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "console_csrf").await;
    let js = jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let _ = js.delete_stream("DLQ_CONSOLE_CSRF").await;
    js.create_stream(jetstream::stream::Config {
        name: "DLQ_CONSOLE_CSRF".into(),
        subjects: vec!["dlq.consolecsrf.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let admin = token(&url, "kim.admin", "admin");
    let addr = format!("127.0.0.1:{}", free_port());
    let _console = Service::console(
        &url,
        &stack.nats_url,
        &addr,
        "console_csrf",
        &["--streams", "DLQ_CONSOLE_CSRF"],
    );
    let base = format!("http://{addr}");
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let form = |path: &str, cookie: Option<&str>, pairs: &[(&str, &str)]| {
        let mut req = http.post(format!("{base}{path}")).form(pairs);
        if let Some(c) = cookie {
            req = req.header("Cookie", c);
        }
        req
    };

    // No session: sign in first.
    let resp = http.get(format!("{base}/console/")).send().await.unwrap();
    assert_eq!(resp.status(), 303);
    assert_eq!(resp.headers()["location"], "/console/login");

    // A sign-in from another site.
    let resp = form("/console/login", None, &[("token", &admin)])
        .header("Origin", "http://evil.example")
        .header("Sec-Fetch-Site", "cross-site")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    assert!(resp.headers().get("set-cookie").is_none());

    // A sign-in of its own: a session cookie, never the token.
    let resp = form("/console/login", None, &[("token", &admin)])
        .header("Origin", format!("http://{addr}"))
        .header("Sec-Fetch-Site", "same-origin")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 303);
    let set = resp.headers()["set-cookie"].to_str().unwrap().to_owned();
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict") && !set.contains(&admin),
        "{set}"
    );
    let cookie = set.split(';').next().unwrap().to_owned();
    let page = http
        .get(format!("{base}/console/dead-letters"))
        .header("Cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let csrf = page
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no anti-forgery value on the page: {page}"))
        .to_owned();
    assert!(!page.contains(&admin), "the token is never on a page");
    // Not framed, not cached; not read by another site's page.
    let resp = http
        .get(format!("{base}/console/tokens"))
        .header("Cookie", &cookie)
        .send()
        .await
        .unwrap();
    let h = resp.headers();
    assert_eq!(h["x-frame-options"], "DENY");
    assert!(h["content-security-policy"]
        .to_str()
        .unwrap()
        .contains("frame-ancestors 'none'"));
    assert_eq!(h["cache-control"], "no-store");
    let resp = http
        .get(format!("{base}/console/tokens"))
        .header("Cookie", &cookie)
        .header("Sec-Fetch-Site", "same-site")
        .header("Sec-Fetch-Dest", "image")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403, "an image of another site's page");

    // An action without the session's value, or from another origin.
    let dry_run = |csrf: &str| {
        form(
            "/console/replay",
            Some(&cookie),
            &[("csrf", csrf), ("class", "handler_failed"), ("reason", "r")],
        )
    };
    let resp = dry_run("").send().await.unwrap();
    assert_eq!(resp.status(), 403);
    assert!(resp.text().await.unwrap().contains("anti-forgery"));
    let resp = dry_run(&"0".repeat(csrf.len())).send().await.unwrap();
    assert_eq!(resp.status(), 403);
    let resp = dry_run(&csrf)
        .header("Origin", "http://127.0.0.1:1")
        .header("Sec-Fetch-Site", "same-site")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    // Its own page's form: the plan.
    let resp = dry_run(&csrf)
        .header("Origin", format!("http://{addr}"))
        .header("Sec-Fetch-Site", "same-origin")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.text().await.unwrap().contains("plan-id"));

    // Signing out takes the value too, and ends the session.
    let resp = form("/console/logout", Some(&cookie), &[("csrf", "x")])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let resp = form("/console/logout", Some(&cookie), &[("csrf", &csrf)])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 303);
    let resp = http
        .get(format!("{base}/console/"))
        .header("Cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 303, "the session ended");

    // A token revoked ends its sessions: the next page sends the browser
    // to sign in, and forgets the cookie.
    let again = form("/console/login", None, &[("token", &admin)])
        .send()
        .await
        .unwrap();
    let cookie2 = again.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let (ok, out, err) = cli(&[
        "admin",
        "token",
        "revoke",
        "--database-url",
        &url,
        "--name",
        "kim.admin",
        "--reason",
        "left",
    ]);
    assert!(ok, "{out}{err}");
    let resp = http
        .get(format!("{base}/console/"))
        .header("Cookie", &cookie2)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 303);
    assert_eq!(resp.headers()["location"], "/console/login");
    assert!(resp.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .contains("Max-Age=0"));
    let sessions: Vec<String> = sqlx::query_scalar(
        "SELECT action FROM outbox_admin_log WHERE action LIKE 'console.sign%' ORDER BY seq",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        sessions,
        ["console.sign_in", "console.sign_out", "console.sign_in"]
    );

    // Each refusal is a row.
    let refused: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT actor, target, result FROM outbox_admin_log WHERE action = 'request' AND result LIKE 'denied: 403%' ORDER BY seq",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let targets: Vec<(&str, &str)> = refused
        .iter()
        .map(|(a, t, _)| (a.as_str(), t.as_str()))
        .collect();
    assert_eq!(
        targets,
        [
            ("anonymous", "POST /console/login"),
            ("token:kim.admin", "POST /console/replay"),
            ("token:kim.admin", "POST /console/replay"),
            ("token:kim.admin", "POST /console/replay"),
            ("token:kim.admin", "POST /console/logout"),
        ],
        "{refused:?}"
    );
    let (ok, out, err) = cli(&["admin", "log", "verify", "--database-url", &url]);
    assert!(ok, "{out}{err}");
}

/// SPEC §16 item 2: a command that changes something records the
/// database role and, given one, a token's name; a token that may not act
/// (revoked) stops it before it does anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_run_with_a_token_is_recorded_under_its_name() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "console_cli_actor").await;
    // Prune runs against the relay's slot (a slot it need not wait for:
    // it keeps what the slot has not confirmed).
    sqlx::query("SELECT pg_create_logical_replication_slot('outbox_relay_cliactor', 'pgoutput')")
        .execute(&pool)
        .await
        .unwrap();
    let secret = token(&url, "lee.runbook", "operator");
    let prune = |token: &str| {
        cli(&[
            "prune",
            "--database-url",
            &url,
            "--context",
            "cliactor",
            "--older-than",
            "7d",
            "--wait",
            "1s",
            "--admin-token",
            token,
            "--reason",
            "RB-7: monthly retention",
        ])
    };
    let (ok, out, err) = prune(&secret);
    assert!(ok, "{out}{err}");
    let rows: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT actor, role, db_role, result FROM outbox_admin_log WHERE action = 'prune'",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let (actor, role, db_role, result) = &rows[0];
    assert_eq!(
        (actor.as_str(), role.as_str(), result.as_str()),
        ("token:lee.runbook", "operator", "done")
    );
    assert!(!db_role.is_empty(), "the database role too");
    let (ok, out, err) = cli(&[
        "admin",
        "token",
        "revoke",
        "--database-url",
        &url,
        "--name",
        "lee.runbook",
        "--reason",
        "rotated",
    ]);
    assert!(ok, "{out}{err}");
    let (ok, _, err) = prune(&secret);
    assert!(
        !ok && err.contains("--admin-token") && err.contains("revoked"),
        "{err}"
    );
    let (ok, _, err) = prune("oxr_nonsense");
    assert!(!ok && err.contains("unknown token"), "{err}");
    let after: i64 =
        sqlx::query_scalar("SELECT count(*) FROM outbox_admin_log WHERE action = 'prune'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(after, 1, "a refused token does nothing, so records nothing");
    sqlx::query("SELECT pg_drop_replication_slot('outbox_relay_cliactor')")
        .execute(&pool)
        .await
        .unwrap();
}

/// Issue 61 item 7: a durable reset from the console, with a plan. A
/// viewer may not plan; an operator plans (while the consumer runs: a
/// dry run moves nothing) but may not act; acting while the durable is
/// consumed is refused; an admin acts on the plan once under its key (the
/// same key again resets nothing); a plan that no longer holds is
/// refused. The handler then sees each message from the start once more;
/// the log names each step's token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_is_reset_from_a_plan_once() {
    use std::time::Duration;
    let stack = stack();
    let mut f = crate::consumer::fixture(
        "k_reset",
        "kreset",
        "kreset",
        Duration::from_millis(500),
        &[],
    )
    .await;
    let url = db_url(&stack.admin_url, "k_reset");
    let ids: Vec<uuid::Uuid> = (0..6).map(|_| uuid::Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        crate::consumer::publish(&f.js, "kreset.e", Some(*id), &format!("a{i}"), b"{}").await;
    }
    crate::consumer::wait_processed(&f.pool, "kreset", 6).await;
    let viewer = token(&url, "vic.viewer", "viewer");
    let operator = token(&url, "olga.operator", "operator");
    let admin = token(&url, "ada.admin", "admin");
    let addr = format!("127.0.0.1:{}", free_port());
    let _console = Service::console(&url, &stack.nats_url, &addr, "console_reset", &[]);
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();
    let path = "/admin/consumers/reset";
    let asked = |more: Value| {
        let mut body = serde_json::json!({
            "stream": f.stream, "durable": "kreset", "seq": 3, "reason": "inc-21: handler fixed",
        });
        for (k, v) in more.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let dry = serde_json::json!({ "dry_run": true });

    let a = post(&http, &base, path, &viewer, None, asked(dry.clone())).await;
    assert_eq!(a.status, 403, "{}", a.body);
    let a = post(
        &http,
        &base,
        path,
        &operator,
        None,
        asked(serde_json::json!({ "dry_run": true, "durable": "nope" })),
    )
    .await;
    assert_eq!(a.status, 404, "{}", a.body);
    let a = post(
        &http,
        &base,
        path,
        &operator,
        None,
        asked(serde_json::json!({ "dry_run": true, "seq": 99 })),
    )
    .await;
    assert_eq!(a.status, 400, "{}", a.body);
    let plan = post(&http, &base, path, &operator, None, asked(dry.clone())).await;
    assert_eq!(plan.status, 200, "{}", plan.body);
    assert_eq!(
        (
            &plan.body["from_seq"],
            &plan.body["messages"],
            &plan.body["skipped"]
        ),
        (&Value::from(3), &Value::from(4), &Value::from(0)),
        "{}",
        plan.body
    );
    assert!(
        plan.body["cli"]
            .as_str()
            .is_some_and(|c| c.contains("consumer reset") && c.contains("--seq 3")),
        "{}",
        plan.body
    );
    let plan_id = plan.body["plan_id"].as_str().unwrap().to_owned();
    let act = serde_json::json!({ "plan_id": plan_id });

    // An operator plans, and may not act.
    let a = post(
        &http,
        &base,
        path,
        &operator,
        Some("k-1"),
        asked(act.clone()),
    )
    .await;
    assert_eq!(a.status, 403, "{}", a.body);
    // The durable's consumer runs: its lease is held.
    let a = post(&http, &base, path, &admin, Some("k-1"), asked(act.clone())).await;
    assert_eq!(a.status, 409, "{}", a.body);
    assert!(
        a.body["error"].as_str().unwrap().contains("being consumed"),
        "{}",
        a.body
    );
    f.consumer.term(Duration::from_secs(30));
    let a = post(&http, &base, path, &admin, None, asked(act.clone())).await;
    assert_eq!(a.status, 400, "no key: {}", a.body);
    let a = post(
        &http,
        &base,
        path,
        &admin,
        Some("k-1"),
        asked(serde_json::json!({ "plan_id": plan_id, "seq": 2 })),
    )
    .await;
    assert_eq!(a.status, 409, "another start than the plan's: {}", a.body);

    let a = post(&http, &base, path, &admin, Some("k-1"), asked(act.clone())).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        (&a.body["from_seq"], &a.body["reset_before"]),
        (&Value::from(3), &Value::Bool(false)),
        "{}",
        a.body
    );
    let a = post(&http, &base, path, &admin, Some("k-1"), asked(act.clone())).await;
    assert_eq!(
        (a.status, &a.body["reset_before"]),
        (200, &Value::Bool(true)),
        "{}",
        a.body
    );
    let resets: i64 =
        sqlx::query_scalar("SELECT count(*) FROM inbox_resets WHERE reset_by = 'token:ada.admin'")
            .fetch_one(&f.pool)
            .await
            .unwrap();
    assert_eq!(resets, 1, "the same key resets once");
    // A reset whose start is recorded and its end not (a console cut off
    // mid-way): its key does not reset again.
    sqlx::query(
        "INSERT INTO outbox_admin_log (seq, at, db_role, actor, role, action, target, selection, \
           reason, result, request_id, prev_hash, hash) \
         VALUES (0, now(), '', 'token:ada.admin', 'admin', 'consumer.reset.start', $1, \
           '{\"idempotency_key\": \"k-2\"}', 'cut off', 'done: started', 'r-cut', '', '')",
    )
    .bind(format!("{}/kreset", f.stream))
    .execute(&f.pool)
    .await
    .unwrap();
    let a = post(&http, &base, path, &admin, Some("k-2"), asked(act.clone())).await;
    assert_eq!(a.status, 409, "{}", a.body);
    assert!(
        a.body["error"].as_str().unwrap().contains("not recorded"),
        "{}",
        a.body
    );

    f.consumer.restart();
    eventually(T, "messages 3..=6 handled once more", || async {
        ids[2..]
            .iter()
            .all(|id| f.handler.calls_for(*id).len() == 2)
    })
    .await;
    for id in &ids[..2] {
        assert_eq!(f.handler.calls_for(*id).len(), 1, "before the reset point");
    }
    let log: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT action, actor, split_part(result, ':', 1) FROM outbox_admin_log \
         WHERE action LIKE 'consumer.reset%' ORDER BY seq",
    )
    .fetch_all(&f.pool)
    .await
    .unwrap();
    let has = |action: &str, actor: &str, result: &str| {
        log.iter()
            .any(|(a, b, c)| a == action && b == actor && c.starts_with(result))
    };
    assert!(
        has("consumer.reset", "token:vic.viewer", "denied"),
        "{log:?}"
    );
    assert!(
        has("consumer.reset.plan", "token:olga.operator", "done"),
        "{log:?}"
    );
    assert!(
        has("consumer.reset", "token:olga.operator", "denied"),
        "{log:?}"
    );
    assert!(has("consumer.reset", "token:ada.admin", "done"), "{log:?}");
    assert_eq!(
        log.iter()
            .filter(|(a, b, c)| a == "consumer.reset" && b == "token:ada.admin" && c == "done")
            .count(),
        1,
        "{log:?}"
    );
}

/// An OIDC issuer of the test's own: discovery and a key set on a
/// loopback port, and the ES256 keys it signs with.
struct Issuer {
    url: String,
    keys: Vec<(String, Vec<u8>)>,
}

impl Issuer {
    /// `published` of the `keys` are in its key set.
    async fn serve(keys: &[&str], published: &[&str]) -> Issuer {
        use base64::Engine;
        use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
        let rng = ring::rand::SystemRandom::new();
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let mut made = Vec::new();
        let mut jwks = Vec::new();
        for kid in keys {
            let pkcs8 =
                EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &rng).unwrap();
            let pair =
                EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &rng)
                    .unwrap();
            let point = pair.public_key().as_ref();
            if published.contains(kid) {
                jwks.push(serde_json::json!({
                    "kty": "EC", "crv": "P-256", "use": "sig", "alg": "ES256", "kid": kid,
                    "x": b64.encode(&point[1..33]), "y": b64.encode(&point[33..65]),
                }));
            }
            made.push((kid.to_string(), pkcs8.as_ref().to_vec()));
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let discovery = serde_json::json!({ "issuer": url, "jwks_uri": format!("{url}/jwks") });
        let set = serde_json::json!({ "keys": jwks });
        let app = axum::Router::new()
            .route(
                "/.well-known/openid-configuration",
                axum::routing::get(move || async move { axum::Json(discovery) }),
            )
            .route(
                "/jwks",
                axum::routing::get(move || async move { axum::Json(set) }),
            );
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Issuer { url, keys: made }
    }

    /// A JWT signed with key `kid`: `claims` over a valid base (this
    /// issuer, the console's audience, an hour to live).
    fn jwt(&self, kid: &str, claims: Value) -> String {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        let mut body = serde_json::json!({
            "iss": self.url, "aud": "outbox-console", "iat": now, "exp": now + 3600,
        });
        for (k, v) in claims.as_object().unwrap() {
            body[k] = v.clone();
        }
        let der = &self.keys.iter().find(|(k, _)| k == kid).unwrap().1;
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
        header.kid = Some(kid.to_owned());
        jsonwebtoken::encode(&header, &body, &jsonwebtoken::EncodingKey::from_ec_der(der)).unwrap()
    }
}

/// SPEC §16 "optional OIDC": a JWT from the issuer the console is given,
/// for its audience, is taken with the role its claim maps to, and the log
/// names its subject; one expired, for another audience or issuer, signed
/// by a key the issuer does not publish, or symmetric, or giving no role,
/// is a 401, recorded. A role short of the route is a 403 under the
/// subject. The pages take a JWT at sign-in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oidc_token_is_taken_with_the_role_its_claim_gives() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "console_oidc").await;
    let issuer = Issuer::serve(&["k1", "rogue"], &["k1"]).await;
    let addr = format!("127.0.0.1:{}", free_port());
    let _console = Service::console(
        &url,
        &stack.nats_url,
        &addr,
        "console_oidc",
        &[
            "--oidc-issuer",
            &issuer.url,
            "--oidc-audience",
            "outbox-console",
            "--oidc-roles-claim",
            "realm_access.roles",
            "--oidc-role",
            "admin=platform-admins,viewer=eng",
        ],
    );
    let base = format!("http://{addr}");
    let http = reqwest::Client::new();
    let roles = |r: &[&str]| serde_json::json!({ "realm_access": { "roles": r } });
    let mut admin_claims = roles(&["eng", "platform-admins"]);
    admin_claims["sub"] = "alice-7f3".into();
    let admin = issuer.jwt("k1", admin_claims);
    let a = get(&http, &base, "/admin/whoami", Some(&admin)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        (
            &a.body["token"]["name"],
            &a.body["token"]["role"],
            &a.body["token"]["kind"]
        ),
        (
            &Value::from("alice-7f3"),
            &Value::from("admin"),
            &Value::from("oidc")
        ),
        "{}",
        a.body
    );
    // An action, under the subject.
    let a = post(
        &http,
        &base,
        "/admin/consumers/reset",
        &admin,
        None,
        serde_json::json!({ "stream": "NO_SUCH", "durable": "d", "seq": 1, "reason": "SSO check", "dry_run": true }),
    )
    .await;
    assert_eq!(a.status, 404, "{}", a.body);
    let mut viewer_claims = roles(&["eng"]);
    viewer_claims["sub"] = "bob-2c1".into();
    let viewer = issuer.jwt("k1", viewer_claims);
    let a = get(&http, &base, "/admin/tokens", Some(&viewer)).await;
    assert_eq!(a.status, 403, "{}", a.body);

    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let with = |more: Value| {
        let mut c = roles(&["platform-admins"]);
        c["sub"] = "mallory".into();
        for (k, v) in more.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    };
    let hs256 = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &with(serde_json::json!({ "iss": issuer.url, "aud": "outbox-console", "exp": now + 600 })),
        &jsonwebtoken::EncodingKey::from_secret(b"guess").unwrap(),
    )
    .unwrap();
    let refused = [
        (
            "expired",
            issuer.jwt("k1", with(serde_json::json!({ "exp": now - 600 }))),
            "JWT refused",
        ),
        (
            "another audience",
            issuer.jwt("k1", with(serde_json::json!({ "aud": "grafana" }))),
            "JWT refused",
        ),
        (
            "another issuer",
            issuer.jwt(
                "k1",
                with(serde_json::json!({ "iss": "http://127.0.0.1:1" })),
            ),
            "JWT refused",
        ),
        (
            "an unpublished key",
            issuer.jwt("rogue", with(serde_json::json!({}))),
            "does not publish",
        ),
        ("symmetric", hs256, "HS256"),
        (
            "no role",
            issuer.jwt("k1", with(roles(&["sales"]))),
            "no console role",
        ),
    ];
    for (what, jwt, why) in &refused {
        let a = get(&http, &base, "/admin/whoami", Some(jwt)).await;
        assert_eq!(a.status, 401, "{what}: {}", a.body);
        assert!(
            a.body["error"].as_str().unwrap_or_default().contains(why),
            "{what}: {}",
            a.body
        );
    }

    // The pages take a JWT at sign-in; the session is the subject's.
    let no_redirect = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let resp = no_redirect
        .post(format!("{base}/console/login"))
        .form(&[("token", admin.as_str())])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 303, "{:?}", resp.text().await);
    let cookie = resp
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .and_then(|c| c.split(';').next())
        .unwrap()
        .to_owned();
    let page = no_redirect
        .get(format!("{base}/console/"))
        .header("Cookie", &cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("alice-7f3 · admin"), "{page}");

    let log = Log::read(&pool).await;
    let has = |action: &str, actor: &str, role: &str, result: &str| {
        log.has(action, actor, Some(role), result)
    };
    assert!(
        has("consumer.reset.plan", "oidc:alice-7f3", "admin", "failed"),
        "{log:?}"
    );
    assert!(
        has("tokens.read", "oidc:bob-2c1", "viewer", "denied: 403"),
        "{log:?}"
    );
    assert!(
        has("console.sign_in", "oidc:alice-7f3", "admin", "done"),
        "{log:?}"
    );
    let anonymous_401s = log
        .0
        .iter()
        .filter(|(_, b, _, d)| b == "anonymous" && d.starts_with("denied: 401"))
        .count();
    assert_eq!(anonymous_401s, refused.len(), "{log:?}");
}

/// Certificates for the mTLS test, made with rcgen: a CA, the console's
/// certificate for 127.0.0.1, and clients (CN, O) it signed; PEM files in
/// `dir`, and each client's certificate and key as one PEM.
struct Pki {
    dir: std::path::PathBuf,
    ca: String,
}

impl Pki {
    fn new(name: &str) -> (Pki, rcgen::Issuer<'static, rcgen::KeyPair>) {
        let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, format!("{name} CA"));
        let ca = params.self_signed(&key).unwrap().pem();
        std::fs::write(dir.join("ca.pem"), &ca).unwrap();
        (Pki { dir, ca }, rcgen::Issuer::new(params, key))
    }

    /// The console's certificate and key files.
    fn server(&self, issuer: &rcgen::Issuer<'_, rcgen::KeyPair>) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![rcgen::SanType::IpAddress("127.0.0.1".parse().unwrap())];
        let cert = params.signed_by(&key, issuer).unwrap();
        let (c, k) = (self.dir.join("server.pem"), self.dir.join("server.key"));
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c.display().to_string(), k.display().to_string())
    }

    /// A client's certificate and key, one PEM.
    fn client(issuer: &rcgen::Issuer<'_, rcgen::KeyPair>, cn: &str, o: &str) -> String {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params
            .distinguished_name
            .push(rcgen::DnType::OrganizationName, o);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, issuer).unwrap();
        format!("{}{}", cert.pem(), key.serialize_pem())
    }

    /// An HTTPS client trusting the CA, presenting `identity` if given.
    fn http(&self, identity: Option<&str>) -> reqwest::Client {
        let mut b = reqwest::Client::builder()
            .use_rustls_tls()
            .tls_built_in_root_certs(false)
            .add_root_certificate(reqwest::Certificate::from_pem(self.ca.as_bytes()).unwrap())
            .redirect(reqwest::redirect::Policy::none());
        if let Some(pem) = identity {
            b = b.identity(reqwest::Identity::from_pem(pem.as_bytes()).unwrap());
        }
        b.build().unwrap()
    }
}

/// SPEC §16 "mTLS": with `--admin-client-ca`, a connection without a
/// certificate that CA signed is refused at the handshake; a request
/// without a token is its certificate's (`cert:<CN>`, the role its O
/// gives), refused 401 when that gives none, 403 when short, each
/// recorded; a bearer token, when sent, decides. The pages' cookie is
/// `Secure` over TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_is_required_and_speaks_for_a_request() {
    let stack = stack();
    let (url, pool) = fresh_db(&stack, "console_mtls").await;
    let (pki, issuer) = Pki::new("console-mtls");
    let (cert, key) = pki.server(&issuer);
    let ops = Pki::client(&issuer, "ops-bot", "platform");
    let intern = Pki::client(&issuer, "intern", "eng");
    let sales = Pki::client(&issuer, "sam", "sales");
    let ann_cert = Pki::client(&issuer, "ann.admin", "platform");
    let (_, other) = Pki::new("console-mtls-other");
    let stranger = Pki::client(&other, "ops-bot", "platform");
    let admin_token = token(&url, "ann.admin", "admin");
    let addr = format!("127.0.0.1:{}", free_port());
    let ca = pki.dir.join("ca.pem").display().to_string();
    // Without a map, no O or OU value gives a role: refused at start.
    let (ok, _, err) = cli(&[
        "console",
        "--database-url",
        &url,
        "--nats-url",
        &stack.nats_url,
        "--admin-tls-cert",
        &cert,
        "--admin-tls-key",
        &key,
        "--admin-client-ca",
        &ca,
        "--check-config",
    ]);
    assert!(!ok && err.contains("--admin-cert-role"), "{err}");
    let _console = Service::console(
        &url,
        &stack.nats_url,
        &addr,
        "console_mtls",
        &[
            "--admin-tls-cert",
            &cert,
            "--admin-tls-key",
            &key,
            "--admin-client-ca",
            &ca,
            "--admin-cert-role",
            "admin=platform,viewer=eng",
        ],
    );
    let base = format!("https://{addr}");

    // No certificate, another CA's, or plain HTTP: no answer at all.
    for (what, client) in [
        ("no certificate", pki.http(None)),
        ("another CA's", pki.http(Some(&stranger))),
    ] {
        let r = client.get(format!("{base}/admin/whoami")).send().await;
        assert!(r.is_err(), "{what}: {r:?}");
    }
    let plain = reqwest::get(format!("http://{addr}/admin/whoami")).await;
    assert!(
        plain.as_ref().map_or(true, |r| r.status() != 200),
        "plain HTTP: {plain:?}"
    );

    let as_ops = pki.http(Some(&ops));
    let a = get(&as_ops, &base, "/admin/whoami", None).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        (
            &a.body["token"]["name"],
            &a.body["token"]["role"],
            &a.body["token"]["kind"]
        ),
        (
            &Value::from("ops-bot"),
            &Value::from("admin"),
            &Value::from("cert")
        ),
        "{}",
        a.body
    );
    let a = send(
        as_ops
            .post(format!("{base}/admin/consumers/reset"))
            .header("Content-Type", "application/json")
            .body(serde_json::json!({ "stream": "NO_SUCH", "durable": "d", "seq": 1, "reason": "mTLS check", "dry_run": true }).to_string()),
    )
    .await;
    assert_eq!(a.status, 404, "{}", a.body);
    let as_intern = pki.http(Some(&intern));
    assert_eq!(
        get(&as_intern, &base, "/admin/tokens", None).await.status,
        403
    );
    // A token sent decides.
    assert_eq!(
        get(&as_intern, &base, "/admin/tokens", Some(&admin_token))
            .await
            .status,
        200
    );
    let a = get(&pki.http(Some(&sales)), &base, "/admin/whoami", None).await;
    assert_eq!(a.status, 401, "{}", a.body);
    assert!(
        a.body["error"]
            .as_str()
            .unwrap()
            .contains("gives no console role"),
        "{}",
        a.body
    );

    // Another site's form, sent with the browser's certificate: not the
    // certificate's (before: approved as cert:ops-bot).
    let js = jetstream::new(async_nats::connect(&stack.nats_url).await.unwrap());
    let _ = js.delete_stream("DLQ_CONSOLE_MTLS").await;
    js.create_stream(jetstream::stream::Config {
        name: "DLQ_CONSOLE_MTLS".into(),
        subjects: vec!["dlq.consolemtls.>".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    letter(
        &js,
        "dlq.consolemtls",
        "orders.placed",
        "0b5d6c1e-0000-4000-8000-0000000000c1",
        "handler answered 422: unknown sku",
        Some("handler_rejected"),
    )
    .await;
    let sel = serde_json::json!({ "stream": "DLQ_CONSOLE_MTLS", "class": "handler_rejected" });
    let plan = post(
        &as_ops,
        &base,
        "/admin/dead-letters/delete",
        &admin_token,
        None,
        serde_json::json!({ "selection": sel, "reason": "INC-40: poison", "dry_run": true }),
    )
    .await;
    assert_eq!(plan.status, 200, "{}", plan.body);
    let asked = post(&as_ops, &base, "/admin/dead-letters/delete", &admin_token, Some("inc-40"),
        serde_json::json!({ "selection": sel, "reason": "INC-40: poison", "plan_id": plan.body["plan_id"] })).await;
    assert_eq!(asked.status, 202, "{}", asked.body);
    let id = asked.body["request"]["id"].as_str().unwrap().to_owned();
    let approve = format!("{base}/admin/approvals/{id}/approve");
    let forged = send(
        as_ops
            .post(&approve)
            .header("Origin", "https://evil.example"),
    )
    .await;
    assert_eq!(forged.status, 403, "{}", forged.body);
    let forged = send(as_ops.post(&approve).header("Sec-Fetch-Site", "cross-site")).await;
    assert_eq!(forged.status, 403, "{}", forged.body);
    // The admin who asked, by token, is the same person by certificate.
    let own = send(pki.http(Some(&ann_cert)).post(&approve)).await;
    assert_eq!(own.status, 403, "{}", own.body);
    assert!(
        own.body["error"].as_str().unwrap().contains("second admin"),
        "{}",
        own.body
    );
    let approved = send(as_ops.post(&approve)).await;
    assert_eq!(approved.status, 200, "{}", approved.body);

    // The pages over TLS: a Secure cookie.
    let resp = as_intern
        .post(format!("{base}/console/login"))
        .form(&[("token", admin_token.as_str())])
        .send()
        .await
        .unwrap();
    let cookie = resp
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(cookie.contains("; Secure"), "{cookie}");

    let log = Log::read(&pool).await;
    let has = |action: &str, actor: &str, result: &str| log.has(action, actor, None, result);
    assert!(
        has("consumer.reset.plan", "cert:ops-bot", "failed"),
        "{log:?}"
    );
    assert!(has("tokens.read", "cert:intern", "denied: 403"), "{log:?}");
    assert!(has("request", "cert:sam", "denied: 401"), "{log:?}");
    assert!(has("request", "cert:ops-bot", "denied: 403"), "{log:?}");
    assert!(has("delete.approve", "cert:ops-bot", "done"), "{log:?}");
}

/// `outbox_admin_log` as a test reads it: (action, actor, role, result).
#[derive(Debug)]
struct Log(Vec<(String, String, String, String)>);

impl Log {
    async fn read(pool: &sqlx::PgPool) -> Log {
        Log(
            sqlx::query_as("SELECT action, actor, role, result FROM outbox_admin_log ORDER BY seq")
                .fetch_all(pool)
                .await
                .unwrap(),
        )
    }

    /// A row of `action` by `actor` (of `role`, when given) whose result
    /// starts so.
    fn has(&self, action: &str, actor: &str, role: Option<&str>, result: &str) -> bool {
        self.0.iter().any(|(a, b, c, d)| {
            a == action && b == actor && role.is_none_or(|r| r == c) && d.starts_with(result)
        })
    }
}
