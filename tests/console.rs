//! SPEC §16, the operator console (issue 61): its JSON API through the
//! real router of a real `outbox-relay console`, on real Postgres (tokens,
//! `outbox_admin_log`) and nats-server (the dead letters it reads).

use std::collections::BTreeMap;

use async_nats::jetstream;
use serde_json::Value;

use crate::common::*;
use outbox_relay::wire;

const BIN: &str = env!("CARGO_BIN_EXE_outbox-relay");

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
fn token(url: &str, name: &str, role: &str) -> String {
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
        format!("dlq.console.{subject}"),
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

async fn get(http: &reqwest::Client, base: &str, path: &str, bearer: Option<&str>) -> Answer {
    let mut req = http.get(format!("{base}{path}"));
    if let Some(b) = bearer {
        req = req.header("Authorization", format!("Bearer {b}"));
    }
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
        "orders.placed",
        "0b5d6c1e-0000-4000-8000-000000000001",
        "handler answered 422: unknown sku \"A-1\"",
        Some("handler_rejected"),
    )
    .await;
    letter(
        &js,
        "orders.placed",
        "0b5d6c1e-0000-4000-8000-000000000002",
        "handler answered 422: unknown sku \"B-7\"",
        Some("handler_rejected"),
    )
    .await;
    letter(
        &js,
        "orders.paid",
        "0b5d6c1e-0000-4000-8000-000000000003",
        "last delivery (5) failed: handler timed out",
        Some("transient_exhausted"),
    )
    .await;
    // Written before the class header: classed from its reason.
    letter(
        &js,
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
    let routes: [(&str, &str); 6] = [
        ("/admin/whoami", "viewer"),
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
        if *status == 403 {
            assert!(
                actor.starts_with("token:") && role == *who,
                "{actor} {role}"
            );
        } else {
            assert_eq!((actor.as_str(), role.as_str()), ("anonymous", "anonymous"));
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
