//! The console's JSON routes (`/admin/…`), each with the least role it
//! needs. A request without a valid token is answered 401, one whose
//! token's role is short 403, and both are recorded in `outbox_admin_log`
//! with the caller's name and the request's id (which the answer names).

use std::collections::{BTreeMap, HashMap};

use axum::extract::rejection::JsonRejection;
use axum::extract::{Extension, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::Engine;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use super::delete;
use super::replay::{self, Item, Selection};
use super::state::Console;
use super::tokens::{self, Checked, Role};
use crate::ops::admin_log::{self, Actor, Entry};
use crate::ops::dlq;
use crate::triage::{self, Class};
use crate::wire;

/// Every route (method, path), its least role, and what the log calls a
/// request of it. The OpenAPI document names each (a unit test holds them
/// together).
pub(super) const ROUTES: &[(&str, &str, Option<Role>, &str)] = &[
    ("get", "/admin/openapi.json", None, "openapi.read"),
    ("get", "/admin/whoami", Some(Role::Viewer), "whoami"),
    (
        "get",
        "/admin/dead-letters",
        Some(Role::Viewer),
        "dead_letters.read",
    ),
    (
        "get",
        "/admin/dead-letters/{stream}/{seq}",
        Some(Role::Viewer),
        "dead_letter.read",
    ),
    // A dry run is an operator's; running a plan is an admin's, or an
    // operator's for the classes --operator-replay-classes names.
    (
        "post",
        "/admin/events/replay",
        Some(Role::Operator),
        "replay",
    ),
    // Deletion: an admin asks (a dry run, then a request); another admin
    // approves, and only then are the letters deleted.
    (
        "post",
        "/admin/dead-letters/delete",
        Some(Role::Admin),
        "delete",
    ),
    (
        "get",
        "/admin/approvals",
        Some(Role::Viewer),
        "approvals.read",
    ),
    (
        "post",
        "/admin/approvals/{id}/approve",
        Some(Role::Admin),
        "delete.approve",
    ),
    (
        "post",
        "/admin/approvals/{id}/reject",
        Some(Role::Admin),
        "delete.reject",
    ),
    ("get", "/admin/jobs", Some(Role::Viewer), "jobs.read"),
    ("get", "/admin/jobs/{id}", Some(Role::Viewer), "job.read"),
    (
        "post",
        "/admin/jobs/{id}/cancel",
        Some(Role::Operator),
        "job.cancel",
    ),
    ("get", "/admin/log", Some(Role::Viewer), "log.read"),
    ("get", "/admin/log/verify", Some(Role::Admin), "log.verify"),
    ("get", "/admin/tokens", Some(Role::Admin), "tokens.read"),
    (
        "get",
        "/admin/consumers",
        Some(Role::Viewer),
        "consumers.read",
    ),
    // A dry run (the plan) is an operator's; acting on it an admin's: the
    // durable's handler sees every message again from the start given.
    (
        "post",
        "/admin/consumers/reset",
        Some(Role::Operator),
        "consumer.reset",
    ),
    ("get", "/admin/slots", Some(Role::Viewer), "slots.read"),
];

const OPENAPI: &str = include_str!("openapi.json");

/// Letters read for one listing, at most, over every stream: a listing
/// that reached it says `truncated` (never silently short).
const LIST_MAX: usize = 100_000;
/// Log rows in one answer, at most.
const LOG_PAGE_MAX: i64 = 500;

pub(super) fn router() -> Router<Console> {
    Router::new()
        .route(
            "/admin/openapi.json",
            get(|| async { ([(header::CONTENT_TYPE, "application/json")], OPENAPI) }),
        )
        .route("/admin/whoami", get(whoami))
        .route("/admin/dead-letters", get(dead_letters))
        .route("/admin/dead-letters/{stream}/{seq}", get(dead_letter))
        .route("/admin/events/replay", post(events_replay))
        .route("/admin/dead-letters/delete", post(dead_letters_delete))
        .route("/admin/approvals", get(approvals))
        .route("/admin/approvals/{id}/approve", post(approve))
        .route("/admin/approvals/{id}/reject", post(reject))
        .route("/admin/jobs", get(jobs))
        .route("/admin/jobs/{id}", get(job))
        .route("/admin/jobs/{id}/cancel", post(job_cancel))
        .route("/admin/log", get(log))
        .route("/admin/log/verify", get(log_verify))
        .route("/admin/tokens", get(token_list))
        .route("/admin/consumers", get(consumers))
        .route("/admin/consumers/reset", post(consumer_reset))
        .route("/admin/slots", get(slots))
        .fallback(|| async {
            problem(
                StatusCode::NOT_FOUND,
                "no such route; the routes are in /admin/openapi.json",
            )
        })
}

/// An error answer: `{"error": …}`.
pub(super) fn problem(status: StatusCode, error: &str) -> (StatusCode, Json<Value>) {
    (
        status,
        Json(json!({ "error": error, "status": status.as_u16() })),
    )
}

/// The caller of a request that passed its route's guard.
pub(super) struct Caller {
    pub token: tokens::Token,
    pub request_id: String,
}

/// A request whose token [`authenticate`] found valid.
#[derive(Clone)]
pub(super) struct Authenticated {
    token: tokens::Token,
    request_id: String,
}

fn least(action: &str) -> Role {
    ROUTES
        .iter()
        .find(|(_, _, _, a)| *a == action)
        .and_then(|(_, _, r, _)| *r)
        .unwrap_or(Role::Admin)
}

fn unauthorized(why: &str, request_id: &str) -> Response {
    let mut resp = problem(StatusCode::UNAUTHORIZED, why).into_response();
    resp.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"outbox-relay\""),
    );
    with_id(resp, request_id)
}

/// Every `/admin/` request but the OpenAPI document names a valid token,
/// checked before anything else of it is read (its body, a place among
/// the requests at once): a client without one holds nothing. A refusal
/// is a 401, recorded.
pub(super) async fn authenticate(
    State(c): State<Console>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = req.uri().path().to_owned();
    if !path.starts_with("/admin/") || path == "/admin/openapi.json" {
        return next.run(req).await;
    }
    let request_id = uuid::Uuid::new_v4().to_string();
    let target = format!("{} {path}", req.method());
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, rest) = v.split_once(' ')?;
            scheme
                .eq_ignore_ascii_case("bearer")
                .then(|| rest.trim().to_owned())
        });
    let anonymous = |why: String| (why, "anonymous".to_owned(), "anonymous");
    // Without a token, a client certificate the handshake verified
    // (`--admin-client-ca`) speaks for the request.
    let subject = req
        .extensions()
        .get::<axum::extract::ConnectInfo<super::tls::Peer>>()
        .and_then(|info| info.0.subject.clone());
    let (why, actor, role) = match bearer {
        None => match (subject, c.0.settings.tls.as_ref()) {
            // A browser sends its certificate with any request to the
            // console, another site's form too (SameSite does not cover
            // it): a request the browser says came from elsewhere is not
            // the certificate's.
            (Some(subject), Some(_)) if super::session::cross_site(req.headers()).is_some() => {
                let why = format!(
                    "refused: {}; a client certificate speaks only for requests from the console itself",
                    super::session::cross_site(req.headers()).unwrap_or_default()
                );
                let actor = Actor {
                    name: format!("cert:{}", subject.common_name),
                    role: "anonymous",
                    request_id: request_id.clone(),
                };
                record_denial(&c, "request", &target, &actor, StatusCode::FORBIDDEN, &why, true)
                    .await;
                return with_id(
                    problem(StatusCode::FORBIDDEN, &why).into_response(),
                    &request_id,
                );
            }
            (Some(subject), Some(tls)) => match subject.token(&tls.roles) {
                Ok(token) => {
                    req.extensions_mut()
                        .insert(Authenticated { token, request_id });
                    return next.run(req).await;
                }
                Err(why) => (why, format!("cert:{}", subject.common_name), "anonymous"),
            },
            _ => anonymous(
                "no token: send `Authorization: Bearer <token>` (`outbox-relay admin token create`)"
                    .into(),
            ),
        },
        Some(secret) => {
            // A flood of made-up tokens waits on these few checks, not on
            // the pool the jobs write through.
            let Ok(_check) = c.0.checks.try_acquire() else {
                return unavailable("busy: too many token checks at once; retry", &request_id);
            };
            if super::oidc::looks_like_jwt(&secret) {
                match &c.0.oidc {
                    None => anonymous(
                        "a JWT, and this console takes none (it is started without --oidc-issuer)"
                            .into(),
                    ),
                    Some(oidc) => match tokio::time::timeout(OIDC_TIME, oidc.check(&secret)).await {
                        Ok(Ok(super::oidc::Verdict::Valid(token))) => {
                            req.extensions_mut()
                                .insert(Authenticated { token, request_id });
                            return next.run(req).await;
                        }
                        Ok(Ok(super::oidc::Verdict::Refused(why))) => anonymous(why),
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, "console: cannot check a JWT");
                            return unavailable("cannot read the OIDC issuer's keys now; retry", &request_id);
                        }
                        Err(_) => return unavailable("checking the JWT took too long; retry", &request_id),
                    },
                }
            } else {
                match tokio::time::timeout(CHECK_TIME, tokens::check(&c.0.pool, &secret)).await {
                    Ok(Ok(Checked::Valid(token))) => {
                        req.extensions_mut()
                            .insert(Authenticated { token, request_id });
                        return next.run(req).await;
                    }
                    Ok(Ok(Checked::Unknown)) => anonymous("unknown token".into()),
                    Ok(Ok(Checked::Expired(t))) => (
                        format!("token {} has expired: make a new one", t.name),
                        format!("token:{}", t.name),
                        t.role.as_str(),
                    ),
                    Ok(Ok(Checked::Revoked(t))) => (
                        format!("token {} is revoked", t.name),
                        format!("token:{}", t.name),
                        t.role.as_str(),
                    ),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "console: cannot check a token");
                        return unavailable(
                            "cannot check the token now (Postgres unreachable?); retry",
                            &request_id,
                        );
                    }
                    Err(_) => return unavailable("checking the token took too long; retry", &request_id),
                }
            }
        }
    };
    let actor = Actor {
        name: actor,
        role,
        request_id: request_id.clone(),
    };
    record_denial(
        &c,
        "request",
        &target,
        &actor,
        StatusCode::UNAUTHORIZED,
        &why,
        false,
    )
    .await;
    unauthorized(&why, &request_id)
}

/// A check that could not be made now: 503, not a refusal (nothing is
/// recorded of a caller not judged).
fn unavailable(why: &str, request_id: &str) -> Response {
    with_id(
        problem(StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
        request_id,
    )
}

/// How long a token check may take.
const CHECK_TIME: std::time::Duration = std::time::Duration::from_secs(2);
/// How long a JWT's check may take (the issuer's keys fetched: two reads).
const OIDC_TIME: std::time::Duration = std::time::Duration::from_secs(12);

/// The caller, if its token's role reaches the route's; else the 403 to
/// answer, recorded (always: a valid token's refusal is never one of a
/// flood's).
async fn guard(
    c: &Console,
    auth: &Authenticated,
    action: &'static str,
    target: &str,
) -> Result<Caller, Response> {
    let need = least(action);
    let token = auth.token.clone();
    if token.role >= need {
        return Ok(Caller {
            token,
            request_id: auth.request_id.clone(),
        });
    }
    let why = format!(
        "token {} is {}; {action} needs {need}",
        token.name, token.role
    );
    let actor = Actor {
        name: token.actor(),
        role: token.role.as_str(),
        request_id: auth.request_id.clone(),
    };
    record_denial(c, action, target, &actor, StatusCode::FORBIDDEN, &why, true).await;
    Err(with_id(
        problem(StatusCode::FORBIDDEN, &why).into_response(),
        &auth.request_id,
    ))
}

async fn record_denial(
    c: &Console,
    action: &'static str,
    target: &str,
    actor: &Actor,
    status: StatusCode,
    why: &str,
    always: bool,
) {
    let entry = Entry {
        action,
        target: target.to_owned(),
        selection: json!({}),
        reason: None,
    };
    let admitted = if always { Some(0) } else { c.admit_denial() };
    match admitted {
        Some(unrecorded) => {
            let mut result = format!("denied: {} {why}", status.as_u16());
            if unrecorded > 0 {
                result.push_str(&format!(
                    " ({unrecorded} refusals before this one were counted, not recorded)"
                ));
            }
            if let Err(e) = admin_log::record_as(&c.0.pool, &entry, Some(actor), &result).await {
                tracing::warn!(error = %e, "console: a refusal is not recorded");
            }
        }
        None => {
            metrics::counter!(crate::metrics::ADMIN_ACTIONS, "action" => action, "result" => "denied")
                .increment(1);
        }
    }
}

fn with_id(mut resp: Response, request_id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(request_id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

fn ok(caller: &Caller, body: Value) -> Response {
    with_id(Json(body).into_response(), &caller.request_id)
}

async fn whoami(State(c): State<Console>, Extension(auth): Extension<Authenticated>) -> Response {
    match guard(&c, &auth, "whoami", "").await {
        Ok(caller) => ok(&caller, json!({ "token": caller.token })),
        Err(resp) => resp,
    }
}

/// The dimensions letters group by.
const DIMENSIONS: [&str; 5] = ["class", "fingerprint", "subject", "durable", "age"];

fn age_bucket(stored: time::OffsetDateTime, now: time::OffsetDateTime) -> &'static str {
    let age = now - stored;
    if age < time::Duration::hours(1) {
        "<1h"
    } else if age < time::Duration::days(1) {
        "1h-1d"
    } else if age < time::Duration::days(7) {
        "1d-7d"
    } else {
        ">7d"
    }
}

fn rfc3339(t: time::OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// The streams to read: those given, or every stream of the account but
/// key-value and object stores.
async fn streams(c: &Console, only: Option<&str>) -> Result<Vec<String>, Response> {
    if let Some(s) = only {
        let given = &c.0.settings.streams;
        let allowed = if given.is_empty() {
            !s.starts_with("KV_") && !s.starts_with("OBJ_")
        } else {
            given.iter().any(|g| g == s)
        };
        if !allowed {
            return Err(problem(
                StatusCode::NOT_FOUND,
                &format!("the console does not read stream {s} (--streams)"),
            )
            .into_response());
        }
        return Ok(vec![s.to_owned()]);
    }
    if !c.0.settings.streams.is_empty() {
        return Ok(c.0.settings.streams.clone());
    }
    account_streams(c)
        .await
        .map_err(|why| problem(StatusCode::SERVICE_UNAVAILABLE, &why).into_response())
}

/// Every stream of the account but key-value and object stores, sorted.
async fn account_streams(c: &Console) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    let mut listing = c.0.js.stream_names();
    while let Some(name) = listing.next().await {
        match name {
            Ok(n) if !n.starts_with("KV_") && !n.starts_with("OBJ_") => names.push(n),
            Ok(_) => {}
            Err(e) => return Err(format!("listing the streams: {e}")),
        }
    }
    names.sort();
    Ok(names)
}

/// Whether a stream or durable name may be put in a shell command shown.
fn shell_safe(name: &str) -> bool {
    !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
}

/// Dead letters grouped: `?group_by=class,fingerprint` (any of class,
/// fingerprint, subject, durable, age), `?stream=`, `?class=`.
async fn dead_letters(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let caller = match guard(&c, &auth, "dead_letters.read", "").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    let dims: Vec<&str> = q
        .get("group_by")
        .map_or("class,fingerprint", String::as_str)
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    if let Some(bad) = dims.iter().find(|d| !DIMENSIONS.contains(d)) {
        return answer(
            &caller,
            StatusCode::BAD_REQUEST,
            &format!(
                "group_by {bad:?}: group by any of {}",
                DIMENSIONS.join(", ")
            ),
        );
    }
    let class_filter = match q.get("class").map(|c| (c, Class::parse(c))) {
        Some((c, None)) => {
            return answer(
                &caller,
                StatusCode::BAD_REQUEST,
                &format!("class {c:?} is not one"),
            )
        }
        Some((_, Some(class))) => Some(class),
        None => None,
    };
    let names = match streams(&c, q.get("stream").map(String::as_str)).await {
        Ok(n) => n,
        Err(resp) => return with_id(resp, &caller.request_id),
    };
    let sel = dlq::Selection {
        limit: Some(LIST_MAX),
        headers_only: true,
        ..Default::default()
    };
    // Few listings at once: each holds up to LIST_MAX letters' headers.
    let Ok(_listing) = c.0.listings.try_acquire() else {
        return answer(
            &caller,
            StatusCode::SERVICE_UNAVAILABLE,
            "busy: other listings run; retry",
        );
    };
    let masked = caller.token.role < Role::Operator;
    let js = c.0.js.clone();
    let read: Vec<(String, crate::error::Result<Vec<dlq::DeadLetter>>)> =
        futures::stream::iter(names)
            .map(|name| {
                let (js, sel) = (js.clone(), sel.clone());
                async move {
                    let letters = dlq::list(&js, &name, &sel).await;
                    (name, letters)
                }
            })
            .buffered(8)
            .collect()
            .await;
    let now = time::OffsetDateTime::now_utc();
    let mut groups: BTreeMap<Vec<String>, Group> = BTreeMap::new();
    let (mut total, mut truncated, mut unreadable) = (0usize, false, Vec::new());
    for (stream, letters) in read {
        let letters = match letters {
            Ok(l) => l,
            Err(e) => {
                unreadable.push(json!({ "stream": stream, "error": e.to_string() }));
                continue;
            }
        };
        truncated |= letters.len() >= LIST_MAX;
        for d in letters {
            let class = Class::parse(d.class).unwrap_or(Class::Other);
            if class_filter.is_some_and(|f| f != class) {
                continue;
            }
            total += 1;
            let key: Vec<String> = dims
                .iter()
                .map(|dim| match *dim {
                    "class" => d.class.to_owned(),
                    "fingerprint" => d.fingerprint.clone(),
                    "subject" => d.subject.clone(),
                    "durable" => d.consumer.clone().unwrap_or_else(|| "relay".into()),
                    _ => age_bucket(d.stored, now).to_owned(),
                })
                .collect();
            let g = groups.entry(key).or_insert_with(|| Group {
                class,
                count: 0,
                first: d.stored,
                last: d.stored,
                example: json!({
                    "stream": stream,
                    "seq": d.seq,
                    "id": d.id,
                    "reason": if masked { Value::Null } else { Value::String(d.reason.clone()) },
                }),
            });
            g.count += 1;
            g.first = g.first.min(d.stored);
            g.last = g.last.max(d.stored);
        }
    }
    let mut out: Vec<Value> = groups
        .into_iter()
        .map(|(key, g)| {
            let mut v = json!({
                "count": g.count,
                "first_seen": rfc3339(g.first),
                "last_seen": rfc3339(g.last),
                "class": g.class.as_str(),
                "next_step": g.class.next_step(),
                "replayable": g.class.replayable(),
                "example": g.example,
            });
            for (dim, value) in dims.iter().zip(key) {
                v[*dim] = Value::String(value);
            }
            v
        })
        .collect();
    out.sort_by(|a, b| b["count"].as_u64().cmp(&a["count"].as_u64()));
    ok(
        &caller,
        json!({
            "total": total,
            "truncated": truncated,
            "group_by": dims,
            "groups": out,
            "unreadable": unreadable,
        }),
    )
}

struct Group {
    class: Class,
    count: u64,
    first: time::OffsetDateTime,
    last: time::OffsetDateTime,
    example: Value,
}

/// One letter: its headers, its body (masked below `operator`), its class
/// and next step, and the commands that act on it.
async fn dead_letter(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    Path((stream, seq)): Path<(String, String)>,
) -> Response {
    let target = format!("{stream}/{seq}");
    let caller = match guard(&c, &auth, "dead_letter.read", &target).await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    let not_found = |why: String| answer(&caller, StatusCode::NOT_FOUND, &why);
    let Ok(seq) = seq.parse::<u64>() else {
        return answer(
            &caller,
            StatusCode::BAD_REQUEST,
            "a sequence is a whole number",
        );
    };
    if let Err(resp) = streams(&c, Some(&stream)).await {
        return with_id(resp, &caller.request_id);
    }
    let Ok(s) = c.0.js.get_stream(&stream).await else {
        return not_found(format!("no stream {stream}"));
    };
    let m = match s.get_raw_message(seq).await {
        Ok(m) => m,
        Err(e) => return not_found(format!("no message {seq} in {stream}: {e}")),
    };
    let h = &m.headers;
    let get = |k: &str| h.get(k).map(|v| v.as_str().to_owned());
    let Some(reason) = get(wire::DLQ_REASON) else {
        return not_found(format!("message {seq} of {stream} is not a dead letter"));
    };
    let consumer = get(wire::DLQ_CONSUMER);
    let detail = get(wire::DLQ_DETAIL);
    let (class, fingerprint) = triage::of_letter(
        h.get(wire::DLQ_CLASS).map(|v| v.as_str()),
        h.get(wire::DLQ_FINGERPRINT).map(|v| v.as_str()),
        &reason,
        detail.as_deref(),
        consumer.is_some(),
    );
    let masked = caller.token.role < Role::Operator;
    let mut shown: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (k, vs) in h.iter() {
        let name = k.to_string();
        // Only names whose values carry no event data are shown to a
        // viewer: `--header-columns` sends columns as `Outbox-<Column>`.
        let plain = PLAIN_HEADERS.iter().any(|p| p.eq_ignore_ascii_case(&name));
        for v in vs {
            let value = if masked && !plain {
                "•••".to_owned()
            } else {
                v.as_str().to_owned()
            };
            shown.entry(name.clone()).or_default().push(value);
        }
    }
    let (payload, encoding) = if masked {
        (Value::Null, "masked")
    } else {
        match std::str::from_utf8(&m.payload) {
            Ok(text) => (Value::String(text.to_owned()), "utf-8"),
            Err(_) => (
                Value::String(base64::engine::general_purpose::STANDARD.encode(&m.payload)),
                "base64",
            ),
        }
    };
    let id = get(wire::DLQ_ORIGINAL_ID)
        .or_else(|| get(wire::MSG_ID))
        .unwrap_or_default();
    let stored = m.time;
    let since = rfc3339(stored - time::Duration::minutes(5));
    ok(
        &caller,
        json!({
            "stream": stream,
            "seq": seq,
            "time": rfc3339(stored),
            "id": id,
            "subject": get(wire::DLQ_ORIGINAL_SUBJECT).unwrap_or_else(|| m.subject.to_string()),
            "durable": consumer,
            "class": class.as_str(),
            "fingerprint": fingerprint,
            "next_step": class.next_step(),
            "replayable": class.replayable() && consumer.is_some(),
            // A 422's body or a schema error quotes the payload.
            "reason": if masked { Value::Null } else { Value::String(reason) },
            "detail": if masked { Value::Null } else { json!(detail) },
            "attempts": get(wire::DLQ_ATTEMPTS).and_then(|a| a.parse::<i64>().ok()),
            "headers": shown,
            "payload": payload,
            "payload_encoding": encoding,
            "payload_bytes": m.payload.len(),
            "cli": commands(&stream, &id, &since),
        }),
    )
}

/// Headers shown to a viewer as they are: ours, which carry no event
/// data. Every other (a user header column) is masked.
const PLAIN_HEADERS: &[&str] = &[
    wire::MSG_ID,
    wire::DLQ_REASON,
    wire::DLQ_CLASS,
    wire::DLQ_FINGERPRINT,
    wire::DLQ_ATTEMPTS,
    wire::DLQ_CONSUMER,
    wire::DLQ_ORIGINAL_ID,
    wire::DLQ_ORIGINAL_SUBJECT,
    wire::DLQ_ORIGINAL_STREAM,
    wire::DLQ_ORIGINAL_SEQ,
    wire::DLQ_PAYLOAD_OMITTED,
    wire::EVENT_TYPE,
    wire::EVENT_VERSION,
    wire::OCCURRED_AT,
    wire::SOURCE,
    wire::COMMIT_LSN,
    wire::TXN_INDEX,
];

/// The commands that act on a letter, when its id is one to put in a
/// command (a message id: a UUID); otherwise none (a producer's header
/// is not pasted into a shell or a query).
fn commands(stream: &str, id: &str, since: &str) -> Value {
    let Ok(id) = uuid::Uuid::parse_str(id) else {
        return Value::Null;
    };
    if !shell_safe(stream) {
        return Value::Null;
    }
    json!({
        "list": format!("outbox-relay dlq list --stream {stream} --id {id}"),
        "replay": format!("outbox-relay dlq replay --stream {stream} --id {id} --reason '<why>'"),
        "outbox_row": format!("SELECT * FROM outbox_events WHERE id::text = '{id}'"),
        "audit": format!("outbox-relay audit --since {since}"),
    })
}

/// `outbox_admin_log`, oldest first: `?after=<seq>&limit=<n>`; or the
/// newest, newest first: `?last=<n>`.
async fn log(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let caller = match guard(&c, &auth, "log.read", "outbox_admin_log").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    let bad = |what: &str| {
        answer(
            &caller,
            StatusCode::BAD_REQUEST,
            &format!("{what}: a whole number"),
        )
    };
    let after: i64 = match q.get("after").map(|a| a.parse()) {
        None => 0,
        Some(Ok(a)) => a,
        Some(Err(_)) => return bad("after"),
    };
    let limit: i64 = match q.get("limit").map(|a| a.parse::<i64>()) {
        None => 100,
        Some(Ok(l)) => l.clamp(1, LOG_PAGE_MAX),
        Some(Err(_)) => return bad("limit"),
    };
    let last = match q.get("last").map(|a| a.parse::<i64>()) {
        None => None,
        Some(Ok(l)) => Some(l.clamp(1, LOG_PAGE_MAX)),
        Some(Err(_)) => return bad("last"),
    };
    let (order, after, limit) = match last {
        Some(n) => ("seq DESC", 0, n),
        None => ("seq", after, limit),
    };
    let rows: Result<Vec<Value>, _> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT jsonb_build_object('seq', seq, \
             'at', to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
             'db_role', db_role, 'actor', actor, 'role', role, 'action', action, \
             'target', target, 'selection', selection, 'reason', reason, 'result', result, \
             'request_id', request_id, 'hash', hash) \
         FROM outbox_admin_log WHERE seq > $1 ORDER BY {order} LIMIT $2"
    )))
    .bind(after)
    .bind(limit)
    .fetch_all(&c.0.pool)
    .await;
    match rows {
        Ok(rows) => ok(&caller, json!({ "rows": rows })),
        Err(e) => answer(
            &caller,
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("reading outbox_admin_log: {e}"),
        ),
    }
}

async fn log_verify(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let caller = match guard(&c, &auth, "log.verify", "outbox_admin_log").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    match admin_log::verify(&c.0.pool, q.get("expect_head").map(String::as_str)).await {
        Ok(v) => ok(
            &caller,
            json!({
                "rows": v.rows,
                "head": v.head,
                "holds": v.broken.is_none(),
                "broken": v.broken.map(|(seq, why)| json!({ "seq": seq, "why": why })),
            }),
        ),
        Err(e) => answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

async fn token_list(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
) -> Response {
    let caller = match guard(&c, &auth, "tokens.read", "outbox_admin_tokens").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    match tokens::list(&c.0.pool).await {
        Ok(t) => ok(&caller, json!({ "tokens": t })),
        Err(e) => answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

/// Every durable of every stream (but key-value and object stores), with
/// what it has yet to take and the command that starts it over.
async fn consumers(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
) -> Response {
    let caller = match guard(&c, &auth, "consumers.read", "").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    let names = match account_streams(&c).await {
        Ok(n) => n,
        Err(why) => return answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &why),
    };
    let mut out = Vec::new();
    let mut unreadable = Vec::new();
    for name in names {
        let stream = match c.0.js.get_stream(&name).await {
            Ok(s) => s,
            Err(e) => {
                unreadable.push(json!({ "stream": name, "error": e.to_string() }));
                continue;
            }
        };
        let mut infos = stream.consumers();
        while let Some(info) = infos.next().await {
            match info {
                Ok(i) => {
                    // An ephemeral consumer (a listing's, a tool's) is
                    // nobody's durable: nothing to reset, no lag to watch.
                    let Some(durable) = i.config.durable_name.clone() else {
                        continue;
                    };
                    let reset = (shell_safe(&name) && shell_safe(&durable)).then(|| {
                        format!(
                            "outbox-relay consumer reset --stream {name} --durable {durable} --time <RFC 3339> --reason '<why>'"
                        )
                    });
                    out.push(json!({
                        "stream": name,
                        "durable": durable,
                        "pending": i.num_pending,
                        "ack_pending": i.num_ack_pending,
                        "redelivered": i.num_redelivered,
                        "waiting": i.num_waiting,
                        "delivered_seq": i.delivered.stream_sequence,
                        "ack_floor_seq": i.ack_floor.stream_sequence,
                        "filter": i.config.filter_subject,
                        "cli": reset,
                    }));
                }
                Err(e) => {
                    unreadable.push(json!({ "stream": name, "error": e.to_string() }));
                    break;
                }
            }
        }
    }
    ok(
        &caller,
        json!({ "consumers": out, "unreadable": unreadable }),
    )
}

/// The logical replication slots of the console's database: lag, WAL
/// kept, and how close each is to being invalidated.
async fn slots(State(c): State<Console>, Extension(auth): Extension<Authenticated>) -> Response {
    let caller = match guard(&c, &auth, "slots.read", "pg_replication_slots").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    match crate::ops::slot_monitor::list(&c.0.pool, None).await {
        Ok(s) => ok(&caller, json!({ "slots": s })),
        Err(e) => answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

/// `POST /admin/consumers/reset`: a durable starts over from a sequence or
/// a time (`outbox-relay consumer reset`), planned first.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResetRequest {
    stream: String,
    durable: String,
    seq: Option<u64>,
    /// RFC 3339.
    time: Option<String>,
    #[serde(default)]
    skip_unacked: bool,
    reason: Option<String>,
    #[serde(default)]
    dry_run: bool,
    plan_id: Option<String>,
}

/// A reset's plan id: bound to where the durable would start and what it
/// would pass over, not to the count after it (a live stream grows).
fn reset_plan_id(req: &ResetRequest, done: &crate::ops::reset::Done) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for f in [
        req.stream.as_str(),
        req.durable.as_str(),
        &done.from_seq.to_string(),
        &done.skipped.to_string(),
        if req.skip_unacked { "skip" } else { "" },
    ] {
        h.update((f.len() as u64).to_be_bytes());
        h.update(f.as_bytes());
    }
    let hex: String = h.finalize()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("reset-{hex}")
}

/// The status of a reset's error: bad input (a stream, durable or start
/// that is not there, unacked messages passed over) is 400; a durable in
/// use 409; the rest 503.
fn reset_status(e: &crate::error::Error) -> StatusCode {
    match e {
        crate::error::Error::Config(_) => StatusCode::BAD_REQUEST,
        crate::error::Error::Setup { message, .. } if message.contains("being consumed") => {
            StatusCode::CONFLICT
        }
        crate::error::Error::Setup { message, .. }
            if message.contains("is --stream right") || message.contains("is --durable right") =>
        {
            StatusCode::NOT_FOUND
        }
        _ => StatusCode::SERVICE_UNAVAILABLE,
    }
}

async fn consumer_reset(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    headers: HeaderMap,
    body: Result<Json<ResetRequest>, JsonRejection>,
) -> Response {
    let caller = match guard(&c, &auth, "consumer.reset", "").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    let req = match read_body(&caller, body) {
        Ok(req) => req,
        Err(resp) => return *resp,
    };
    let reason = match reason_of(&caller, req.reason.as_deref(), "a reset") {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    let from = match (req.seq, req.time.as_deref()) {
        (Some(n), None) => crate::ops::reset::StartAt::Seq(n),
        (None, Some(t)) => match crate::ops::reset::parse_time(t) {
            Ok(at) => crate::ops::reset::StartAt::Time(at),
            Err(e) => return answer(&caller, StatusCode::BAD_REQUEST, &e.to_string()),
        },
        _ => {
            return answer(
                &caller,
                StatusCode::BAD_REQUEST,
                "give seq (a stream sequence) or time (RFC 3339), one of them",
            )
        }
    };
    let key = idempotency_key(&headers);
    let target = format!("{}/{}", req.stream, req.durable);
    let who = caller.token.actor();
    let plan = |dry: bool| {
        crate::ops::reset::run(
            &c.0.pool,
            &c.0.js,
            &req.stream,
            &req.durable,
            &from,
            &who,
            crate::ops::reset::Asked {
                dry_run: dry,
                skip_unacked: req.skip_unacked,
            },
        )
    };
    let mut selection = json!({
        "seq": req.seq, "time": req.time, "skip_unacked": req.skip_unacked,
    });
    if req.dry_run {
        let entry = Entry {
            action: "consumer.reset.plan",
            target: target.clone(),
            selection: selection.clone(),
            reason: Some(reason.clone()),
        };
        let done = match plan(true).await {
            Ok(d) => d,
            Err(e) => {
                record(&c, &caller, entry, &format!("failed: {e}")).await;
                return answer(&caller, reset_status(&e), &e.to_string());
            }
        };
        let plan_id = reset_plan_id(&req, &done);
        record(
            &c,
            &caller,
            entry,
            &format!(
                "done: plan {plan_id}, from sequence {}, {} messages",
                done.from_seq, done.messages
            ),
        )
        .await;
        let cli = (shell_safe(&req.stream) && shell_safe(&req.durable)).then(|| {
            format!(
                "outbox-relay consumer reset --stream {} --durable {} --seq {}{} --reason '{}'",
                req.stream,
                req.durable,
                done.from_seq,
                if req.skip_unacked {
                    " --skip-unacked"
                } else {
                    ""
                },
                reason.replace('\'', "")
            )
        });
        return ok(
            &caller,
            json!({
                "plan_id": plan_id,
                "stream": req.stream,
                "durable": req.durable,
                "from_seq": done.from_seq,
                "messages": done.messages,
                "skipped": done.skipped,
                "how": done.how.to_string(),
                "cli": cli,
                "run": "POST the same request with this plan_id, dry_run false and an Idempotency-Key header, the durable's consumers stopped",
            }),
        );
    }
    let Some(key) = key else {
        return answer(
            &caller,
            StatusCode::BAD_REQUEST,
            "acting on a reset's plan needs an Idempotency-Key header (at most 200 characters): the same key never resets twice",
        );
    };
    if caller.token.role < Role::Admin {
        let why = format!(
            "token {} is {}; resetting a durable needs admin (an operator may plan one)",
            caller.token.name, caller.token.role
        );
        record_denial(
            &c,
            "consumer.reset",
            &target,
            &caller_actor(&caller),
            StatusCode::FORBIDDEN,
            &why,
            true,
        )
        .await;
        return answer(&caller, StatusCode::FORBIDDEN, &why);
    }
    let Some(given) = req.plan_id.clone() else {
        return answer(
            &caller,
            StatusCode::BAD_REQUEST,
            "acting needs the plan_id of a dry run of the same reset",
        );
    };
    // One reset at a time through this console: the key's earlier reset
    // is looked for and this one recorded under the same hold.
    let _one = c.0.resets.lock().await;
    match reset_by_key(&c, &key).await {
        Ok(Some((t, p))) if t == target && p == given => {
            return ok(
                &caller,
                json!({ "plan_id": given, "stream": req.stream, "durable": req.durable, "reset_before": true }),
            );
        }
        Ok(Some((t, p))) => {
            return answer(
                &caller,
                StatusCode::CONFLICT,
                &format!("Idempotency-Key {key:?} reset {t} by plan {p}: another reset needs another key"),
            );
        }
        Ok(None) => {}
        Err(e) => return answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &e),
    }
    let now = match plan(true).await {
        Ok(d) => reset_plan_id(&req, &d),
        Err(e) => return answer(&caller, reset_status(&e), &e.to_string()),
    };
    if now != given {
        return answer(
            &caller,
            StatusCode::CONFLICT,
            &format!("the reset would start elsewhere or pass over other messages now than plan {given} said (now {now}): dry-run it again and check the plan"),
        );
    }
    selection["plan_id"] = Value::String(given.clone());
    selection["idempotency_key"] = Value::String(key.clone());
    // The key is claimed in the log before anything is done (a reset that
    // cannot be recorded does not happen): a request cut short, or a
    // second console given the same key at the same moment, finds the
    // claim and does not reset again.
    match started_by_key(&c, &key).await {
        Ok(None) => {}
        Ok(Some((at, rid))) => {
            return answer(
                &caller,
                StatusCode::CONFLICT,
                &format!("a reset under Idempotency-Key {key:?} started at {at} (request {rid}) and its end is not recorded: it may be running, or may have been done; dry-run the durable to see where it stands, and ask again under a new key"),
            )
        }
        Err(e) => return answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &e),
    }
    let actor = caller_actor(&caller);
    let claim = Entry {
        action: "consumer.reset.start",
        target: target.clone(),
        selection: selection.clone(),
        reason: Some(reason.clone()),
    };
    if let Err(e) = admin_log::record_as(&c.0.pool, &claim, Some(&actor), "done: started").await {
        return answer(
            &caller,
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("the reset is not started: it cannot be recorded ({e})"),
        );
    }
    match started_by_key(&c, &key).await {
        Ok(Some((_, rid))) if rid == actor.request_id => {}
        Ok(_) => {
            return answer(
                &caller,
                StatusCode::CONFLICT,
                &format!("another request started a reset under Idempotency-Key {key:?} a moment before this one: nothing is done here"),
            )
        }
        Err(e) => return answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &e),
    }
    let entry = Entry {
        action: "consumer.reset",
        target: target.clone(),
        selection,
        reason: Some(reason),
    };
    // Done and recorded by a task of its own: a request cut short (its
    // client gone, its time up) must not stop a reset half way.
    let (told, outcome) = tokio::sync::oneshot::channel();
    let job = {
        let c = c.clone();
        let (stream, durable) = (req.stream.clone(), req.durable.clone());
        let asked = crate::ops::reset::Asked {
            dry_run: false,
            skip_unacked: req.skip_unacked,
        };
        async move {
            let out =
                crate::ops::reset::run(&c.0.pool, &c.0.js, &stream, &durable, &from, &who, asked)
                    .await;
            let result = match &out {
                Ok(done) => format!(
                    "done: from sequence {}, {} messages again ({})",
                    done.from_seq, done.messages, done.how
                ),
                Err(e) => format!("failed: {e}"),
            };
            if let Err(e) = admin_log::record_as(&c.0.pool, &entry, Some(&actor), &result).await {
                tracing::warn!(error = %e, "console: a reset's end is not recorded");
            }
            let _ = told.send(out);
        }
    };
    tokio::spawn(job);
    match outcome.await {
        Ok(Ok(done)) => ok(
            &caller,
            json!({
                "plan_id": given,
                "stream": req.stream,
                "durable": req.durable,
                "from_seq": done.from_seq,
                "messages": done.messages,
                "skipped": done.skipped,
                "how": done.how.to_string(),
                "reset_before": false,
            }),
        ),
        Ok(Err(e)) => answer(&caller, reset_status(&e), &e.to_string()),
        Err(_) => answer(
            &caller,
            StatusCode::SERVICE_UNAVAILABLE,
            "the reset's task ended: see the admin log",
        ),
    }
}

/// When a reset under `key` was started, and by which request, if one
/// was whose end is not recorded.
async fn started_by_key(c: &Console, key: &str) -> Result<Option<(String, String)>, String> {
    sqlx::query_as(
        "SELECT to_char(s.at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), s.request_id \
           FROM outbox_admin_log s \
          WHERE s.action = 'consumer.reset.start' AND s.selection->>'idempotency_key' = $1 \
            AND NOT EXISTS (SELECT 1 FROM outbox_admin_log e \
                             WHERE e.action = 'consumer.reset' AND e.request_id = s.request_id) \
          ORDER BY s.seq LIMIT 1",
    )
    .bind(key)
    .fetch_optional(&c.0.pool)
    .await
    .map_err(|e| format!("reading outbox_admin_log: {e}"))
}

/// The durable and plan an `Idempotency-Key` reset before, from the log.
async fn reset_by_key(c: &Console, key: &str) -> Result<Option<(String, String)>, String> {
    sqlx::query_as(
        "SELECT target, selection->>'plan_id' FROM outbox_admin_log \
         WHERE action = 'consumer.reset' AND selection->>'idempotency_key' = $1 \
           AND result LIKE 'done%' ORDER BY seq LIMIT 1",
    )
    .bind(key)
    .fetch_optional(&c.0.pool)
    .await
    .map_err(|e| format!("reading outbox_admin_log: {e}"))
}

/// A replay or deletion request (SPEC §16): a selection, a reason, and a
/// dry run, or the plan id of one to act on.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanRequest {
    selection: Selection,
    reason: Option<String>,
    #[serde(default)]
    dry_run: bool,
    plan_id: Option<String>,
}

/// A plan request read: its body, its reason (required), its
/// `Idempotency-Key` (required unless a dry run).
struct Asked {
    req: PlanRequest,
    reason: String,
    key: Option<String>,
}

/// Read a plan request for `what` (`a replay`, `a deletion`): a body that
/// is not one is 400 (413 past the limit, 415 not JSON).
fn asked(
    caller: &Caller,
    headers: &HeaderMap,
    body: Result<Json<PlanRequest>, JsonRejection>,
    what: &str,
) -> Result<Asked, Box<Response>> {
    let req = read_body(caller, body)?;
    let reason = reason_of(caller, req.reason.as_deref(), what)?;
    let key = idempotency_key(headers);
    if !req.dry_run && key.is_none() {
        return Err(Box::new(answer(
            caller,
            StatusCode::BAD_REQUEST,
            &format!("acting on a plan for {what} needs an Idempotency-Key header (at most 200 characters): the same key never acts twice"),
        )));
    }
    Ok(Asked { req, reason, key })
}

/// A JSON body, or the answer to one that is not (400; 413 past the
/// limit, 415 not JSON).
fn read_body<T>(caller: &Caller, body: Result<Json<T>, JsonRejection>) -> Result<T, Box<Response>> {
    body.map(|Json(req)| req).map_err(|e| {
        let status = match e.status() {
            StatusCode::PAYLOAD_TOO_LARGE => StatusCode::PAYLOAD_TOO_LARGE,
            StatusCode::UNSUPPORTED_MEDIA_TYPE => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            _ => StatusCode::BAD_REQUEST,
        };
        Box::new(answer(
            caller,
            status,
            &format!("the body: {}", e.body_text()),
        ))
    })
}

/// The request's reason, required for `what` (`a replay`, `a reset`).
fn reason_of(caller: &Caller, given: Option<&str>, what: &str) -> Result<String, Box<Response>> {
    let reason = given.map(str::trim).unwrap_or_default().to_owned();
    if reason.is_empty() {
        return Err(Box::new(answer(
            caller,
            StatusCode::BAD_REQUEST,
            &format!("{what} needs a reason (a ticket, an incident: the sign-off's why)"),
        )));
    }
    Ok(reason)
}

/// The `Idempotency-Key` header, if one of at most 200 characters.
fn idempotency_key(headers: &HeaderMap) -> Option<String> {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty() && k.len() <= 200)
        .map(str::to_owned)
}

/// The plan acted on is the one the selection takes now: else the 400
/// (none given) or 409 to answer.
fn other_plan(caller: &Caller, given: Option<&str>, now: &str) -> Option<Response> {
    match given {
        None => Some(answer(
            caller,
            StatusCode::BAD_REQUEST,
            "acting needs the plan_id of a dry run of the same selection",
        )),
        Some(p) if p != now => Some(answer(
            caller,
            StatusCode::CONFLICT,
            &format!("the selection takes other letters now than plan {p} did (now {now}): dry-run it again and check the plan"),
        )),
        Some(_) => None,
    }
}

fn answer(caller: &Caller, status: StatusCode, why: &str) -> Response {
    with_id(problem(status, why).into_response(), &caller.request_id)
}

fn caller_actor(caller: &Caller) -> Actor {
    Actor {
        name: caller.token.actor(),
        role: caller.token.role.as_str(),
        request_id: caller.request_id.clone(),
    }
}

/// The letters a selection takes, each with its stream; `Err` with the
/// answer when they cannot all be read, or are too many for one plan.
async fn plan_letters(
    c: &Console,
    caller: &Caller,
    sel: &Selection,
) -> Result<Vec<(String, String, dlq::DeadLetter)>, Response> {
    let checked = sel
        .check()
        .map_err(|why| answer(caller, StatusCode::BAD_REQUEST, &why))?;
    let names = streams(c, sel.stream.as_deref())
        .await
        .map_err(|resp| with_id(resp, &caller.request_id))?;
    let reading = sel.reading(&checked);
    let mut out = Vec::new();
    for name in names {
        let unreadable = |e: String| {
            answer(
                caller,
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("reading {name}: {e}; a plan needs every letter it takes"),
            )
        };
        let created = match c.0.js.get_stream(&name).await {
            Ok(s) => rfc3339(s.cached_info().created),
            Err(e) => return Err(unreadable(e.to_string())),
        };
        let letters = dlq::list(&c.0.js, &name, &reading)
            .await
            .map_err(|e| unreadable(e.to_string()))?;
        if letters.len() >= replay::READ_MAX {
            return Err(answer(
                caller,
                StatusCode::BAD_REQUEST,
                &format!(
                    "{name} holds more than {} letters the selection's ids, subject and since take: narrow them, so that a plan reads all it takes",
                    replay::READ_MAX
                ),
            ));
        }
        out.extend(
            letters
                .into_iter()
                .filter(|d| sel.takes(&checked, d))
                .map(|d| (name.clone(), created.clone(), d)),
        );
        if out.len() > replay::PLAN_MAX {
            return Err(answer(
                caller,
                StatusCode::BAD_REQUEST,
                &format!(
                    "the selection takes more than {} letters: narrow it",
                    replay::PLAN_MAX
                ),
            ));
        }
    }
    Ok(out)
}

async fn record(c: &Console, caller: &Caller, entry: Entry, result: &str) {
    let actor = caller_actor(caller);
    if let Err(e) = admin_log::record_as(&c.0.pool, &entry, Some(&actor), result).await {
        tracing::warn!(error = %e, action = entry.action, "console: an action is not recorded");
    }
}

/// The job `id` as an answer (`before`: the key's earlier job).
async fn job_answer(c: &Console, caller: &Caller, id: uuid::Uuid, before: bool) -> Response {
    match replay::job(&c.0.pool, id).await {
        Ok(Some(j)) => ok(caller, json!({ "job": j, "replayed_before": before })),
        Ok(None) => answer(caller, StatusCode::NOT_FOUND, "no such job"),
        Err(e) => answer(
            caller,
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("reading outbox_admin_jobs: {e}"),
        ),
    }
}

/// `POST /admin/events/replay`: a dry run answers a plan; a plan with an
/// `Idempotency-Key` starts a job (202), or answers the job that key
/// started before (200), whatever the letters now.
async fn events_replay(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    headers: HeaderMap,
    body: Result<Json<PlanRequest>, JsonRejection>,
) -> Response {
    let caller = match guard(&c, &auth, "replay", "").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    let Asked { req, reason, key } = match asked(&caller, &headers, body, "a replay") {
        Ok(a) => a,
        Err(resp) => return *resp,
    };
    if let (false, Some(key)) = (req.dry_run, key.as_deref()) {
        match replay::by_key(&c.0.pool, key).await {
            Ok(Some((id, plan))) if req.plan_id.as_deref() == Some(plan.as_str()) => {
                return job_answer(&c, &caller, id, true).await;
            }
            Ok(Some((id, plan))) => {
                return answer(
                    &caller,
                    StatusCode::CONFLICT,
                    &format!("Idempotency-Key {key:?} ran plan {plan} (job {id}): another plan needs another key"),
                );
            }
            Ok(None) => {}
            Err(e) => {
                return answer(
                    &caller,
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("reading outbox_admin_jobs: {e}"),
                )
            }
        }
    }
    let letters = match plan_letters(&c, &caller, &req.selection).await {
        Ok(l) => l,
        Err(resp) => return resp,
    };
    let items: Vec<Item> = letters
        .iter()
        .map(|(s, created, d)| Item::of(s, created, d))
        .collect();
    let letters: Vec<(String, dlq::DeadLetter)> =
        letters.into_iter().map(|(s, _, d)| (s, d)).collect();
    let plan = replay::plan_id(&req.selection, &items);
    let to_replay = items.iter().filter(|i| i.skipped.is_none()).count();
    let selection = serde_json::to_value(&req.selection).unwrap_or_default();
    if req.dry_run {
        record(
            &c,
            &caller,
            Entry {
                action: "replay.plan",
                target: plan.clone(),
                selection: selection.clone(),
                reason: Some(reason.clone()),
            },
            &format!("done: {} letters, {to_replay} to replay", items.len()),
        )
        .await;
        return ok(
            &caller,
            json!({
                "plan_id": plan,
                "selection": selection,
                "letters": items.len(),
                "to_replay": to_replay,
                "items": items,
                "cli": replay::cli(&req.selection, &items, &reason),
                "run": "POST the same selection with this plan_id, dry_run false and an Idempotency-Key header",
            }),
        );
    }
    let Some(key) = key else {
        return answer(
            &caller,
            StatusCode::BAD_REQUEST,
            "acting needs an Idempotency-Key header",
        );
    };
    if let Some(resp) = other_plan(&caller, req.plan_id.as_deref(), &plan) {
        return resp;
    }
    // Seed 001: replay is an admin's; an operator's only for the classes
    // the console allows it.
    let operator_may = &c.0.settings.operator_classes;
    let allowed = caller.token.role == Role::Admin
        || items
            .iter()
            .filter(|i| i.skipped.is_none())
            .all(|i| Class::parse(i.class).is_some_and(|k| operator_may.contains(&k)));
    if !allowed {
        let may = if operator_may.is_empty() {
            "none (--operator-replay-classes)".to_owned()
        } else {
            operator_may
                .iter()
                .map(|k| k.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let why = format!(
            "token {} is {}; replaying these classes needs admin (an operator may replay {may})",
            caller.token.name, caller.token.role
        );
        record_denial(
            &c,
            "replay",
            &plan,
            &caller_actor(&caller),
            StatusCode::FORBIDDEN,
            &why,
            true,
        )
        .await;
        return answer(&caller, StatusCode::FORBIDDEN, &why);
    }
    // Made, recorded and run by a task of its own: a request cut short (its
    // client gone, its time up) must not leave a job made and never run.
    let (made_tx, made_rx) = tokio::sync::oneshot::channel();
    let run = Start {
        console: c.clone(),
        key: key.clone(),
        plan: plan.clone(),
        selection: req.selection.clone(),
        reason,
        actor: caller_actor(&caller),
        items,
        letters,
    };
    tokio::spawn(start(run, made_tx));
    match made_rx.await {
        Ok(Made::Started(id)) => {
            let mut resp = job_answer(&c, &caller, id, false).await;
            if resp.status() == StatusCode::OK {
                *resp.status_mut() = StatusCode::ACCEPTED;
            }
            resp
        }
        Ok(Made::Before(id, before)) if before == plan => job_answer(&c, &caller, id, true).await,
        Ok(Made::Before(id, before)) => answer(
            &caller,
            StatusCode::CONFLICT,
            &format!("Idempotency-Key {key:?} ran plan {before} (job {id}): another plan needs another key"),
        ),
        Ok(Made::Failed(why)) => answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &why),
        Err(_) => answer(&caller, StatusCode::SERVICE_UNAVAILABLE, "the job's task ended"),
    }
}

/// What making a job came to.
enum Made {
    Started(uuid::Uuid),
    /// The key's job, made a moment before by another request, and its plan.
    Before(uuid::Uuid, String),
    Failed(String),
}

/// A job to make, record and run.
struct Start {
    console: Console,
    key: String,
    plan: String,
    selection: Selection,
    reason: String,
    actor: Actor,
    items: Vec<Item>,
    letters: Vec<(String, dlq::DeadLetter)>,
}

/// Make the job, record its start (a job that cannot be recorded does not
/// run, as a command that cannot be does not), say so, then run it.
async fn start(s: Start, made: tokio::sync::oneshot::Sender<Made>) {
    let c = &s.console;
    let id = uuid::Uuid::new_v4();
    let created = replay::create(
        &c.0.pool,
        replay::NewJob {
            id,
            key: &s.key,
            plan: &s.plan,
            selection: &s.selection,
            reason: &s.reason,
            actor: &s.actor.name,
            items: &s.items,
        },
    )
    .await;
    match created {
        Ok(true) => {}
        Ok(false) => {
            let _ = made.send(match replay::by_key(&c.0.pool, &s.key).await {
                Ok(Some((id, plan))) => Made::Before(id, plan),
                _ => Made::Failed("reading the key's job".into()),
            });
            return;
        }
        Err(e) => {
            let _ = made.send(Made::Failed(format!("making the job: {e}")));
            return;
        }
    }
    let to_replay = s.items.iter().filter(|i| i.skipped.is_none()).count();
    let entry = Entry {
        action: "replay.start",
        target: id.to_string(),
        selection: json!({
            "plan_id": s.plan,
            "selection": serde_json::to_value(&s.selection).unwrap_or_default(),
            "idempotency_key": s.key,
        }),
        reason: Some(s.reason.clone()),
    };
    let recorded = admin_log::record_as(
        &c.0.pool,
        &entry,
        Some(&s.actor),
        &format!("done: job {id}, {to_replay} letters to replay"),
    )
    .await;
    if let Err(e) = recorded {
        replay::fail(&c.0.pool, id).await;
        let _ = made.send(Made::Failed(format!(
            "the job cannot be recorded in outbox_admin_log ({e}): it does not run"
        )));
        return;
    }
    let cancel = tokio_util::sync::CancellationToken::new();
    c.0.jobs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(id, cancel.clone());
    let _ = made.send(Made::Started(id));
    let letters = s
        .letters
        .into_iter()
        .zip(&s.items)
        .enumerate()
        .filter(|(_, (_, i))| i.skipped.is_none())
        .map(|(ord, ((stream, d), _))| (ord, stream, d))
        .collect();
    replay::run(replay::Run {
        pool: c.0.pool.clone(),
        js: c.0.js.clone(),
        id,
        letters,
        actor: s.actor,
        reason: s.reason,
        plan: s.plan,
        rate: c.0.settings.replay_rate,
        cancel,
    })
    .await;
    c.0.jobs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id);
}

async fn jobs(State(c): State<Console>, Extension(auth): Extension<Authenticated>) -> Response {
    let caller = match guard(&c, &auth, "jobs.read", "outbox_admin_jobs").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    match replay::recent(&c.0.pool, 100).await {
        Ok(j) => ok(&caller, json!({ "jobs": j })),
        Err(e) => answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

async fn job(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    Path(id): Path<String>,
) -> Response {
    let caller = match guard(&c, &auth, "job.read", &id).await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    match uuid::Uuid::parse_str(&id) {
        Ok(id) => job_answer(&c, &caller, id, false).await,
        Err(_) => answer(&caller, StatusCode::BAD_REQUEST, "a job id is a UUID"),
    }
}

async fn job_cancel(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    Path(id): Path<String>,
) -> Response {
    let caller = match guard(&c, &auth, "job.cancel", &id).await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    let Ok(id) = uuid::Uuid::parse_str(&id) else {
        return answer(&caller, StatusCode::BAD_REQUEST, "a job id is a UUID");
    };
    let running =
        c.0.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned();
    let Some(cancel) = running else {
        return answer(
            &caller,
            StatusCode::CONFLICT,
            "this console runs no such job now (done, cancelled, or another console's)",
        );
    };
    cancel.cancel();
    record(
        &c,
        &caller,
        Entry {
            action: "replay.cancel",
            target: id.to_string(),
            selection: json!({}),
            reason: None,
        },
        "done",
    )
    .await;
    with_id(
        (
            StatusCode::ACCEPTED,
            Json(json!({ "job": id, "cancelling": true })),
        )
            .into_response(),
        &caller.request_id,
    )
}

/// Delete the letters one by one, each one's result (a failure is that
/// letter's, and the rest go on): the results and how many failed.
async fn delete_letters(c: &Console, letters: Vec<(String, dlq::DeadLetter)>) -> (Value, usize) {
    let mut out = Vec::new();
    let mut failed = 0;
    for (stream, d) in letters {
        let (seq, id) = (d.seq, d.id.clone());
        match dlq::delete(&c.0.js, &c.0.pool, &stream, vec![d]).await {
            Ok(done) => out.extend(done.into_iter().map(
                |d| json!({ "stream": stream, "seq": d.seq, "id": d.id, "result": d.result }),
            )),
            Err(e) => {
                failed += 1;
                out.push(json!({ "stream": stream, "seq": seq, "id": id, "result": "failed", "error": e.to_string() }));
            }
        }
    }
    (Value::Array(out), failed)
}

/// `POST /admin/dead-letters/delete`: a dry run answers a plan; a plan
/// with an `Idempotency-Key` makes a request a second admin approves (the
/// letters stay until then), or, with `--delete-approvals 1`, deletes.
async fn dead_letters_delete(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    headers: HeaderMap,
    body: Result<Json<PlanRequest>, JsonRejection>,
) -> Response {
    let caller = match guard(&c, &auth, "delete", "").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    let Asked { req, reason, key } = match asked(&caller, &headers, body, "a deletion") {
        Ok(a) => a,
        Err(resp) => return *resp,
    };
    if let (false, Some(key)) = (req.dry_run, key.as_deref()) {
        match delete::by_key(&c.0.pool, key).await {
            Ok(Some(r)) if req.plan_id.as_deref() == r["plan_id"].as_str() => {
                return ok(&caller, json!({ "request": r, "made_before": true }));
            }
            Ok(Some(r)) => {
                return answer(
                    &caller,
                    StatusCode::CONFLICT,
                    &format!(
                        "Idempotency-Key {key:?} asked for plan {}: another plan needs another key",
                        r["plan_id"]
                    ),
                );
            }
            Ok(None) => {}
            Err(e) => {
                return answer(
                    &caller,
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("reading outbox_admin_deletions: {e}"),
                )
            }
        }
    }
    let letters = match plan_letters(&c, &caller, &req.selection).await {
        Ok(l) => l,
        Err(resp) => return resp,
    };
    let items: Vec<Item> = letters
        .iter()
        .map(|(s, created, d)| Item::of(s, created, d))
        .collect();
    let plan = replay::plan_id(&req.selection, &items);
    let selection = serde_json::to_value(&req.selection).unwrap_or_default();
    if req.dry_run {
        record(
            &c,
            &caller,
            Entry {
                action: "delete.plan",
                target: plan.clone(),
                selection: selection.clone(),
                reason: Some(reason),
            },
            &format!("done: {} letters", items.len()),
        )
        .await;
        return ok(
            &caller,
            json!({
                "plan_id": plan,
                "selection": selection,
                "letters": items.len(),
                "items": items,
                "approvals": c.0.settings.delete_approvals,
                "cli": "outbox-relay dlq delete --stream <stream> --id <id> … --reason '<why>' (the CLI deletes at once: its sign-off is the database role and the log)",
            }),
        );
    }
    let Some(key) = key else {
        return answer(
            &caller,
            StatusCode::BAD_REQUEST,
            "acting needs an Idempotency-Key header",
        );
    };
    if let Some(resp) = other_plan(&caller, req.plan_id.as_deref(), &plan) {
        return resp;
    }
    let id = uuid::Uuid::new_v4();
    let by = caller.token.actor();
    match delete::create(&c.0.pool, id, &key, &plan, &req.selection, &reason, &by).await {
        Ok(true) => {}
        Ok(false) => {
            return match delete::by_key(&c.0.pool, &key).await {
                Ok(Some(r)) if r["plan_id"].as_str() == Some(plan.as_str()) => {
                    ok(&caller, json!({ "request": r, "made_before": true }))
                }
                Ok(Some(_)) => answer(
                    &caller,
                    StatusCode::CONFLICT,
                    "this Idempotency-Key asked for another plan",
                ),
                _ => answer(
                    &caller,
                    StatusCode::SERVICE_UNAVAILABLE,
                    "reading the request",
                ),
            };
        }
        Err(e) => {
            return answer(
                &caller,
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("making the request: {e}"),
            )
        }
    }
    record(&c, &caller, Entry {
        action: "delete.request",
        target: id.to_string(),
        selection: json!({ "plan_id": plan, "selection": selection, "idempotency_key": key, "letters": items.len() }),
        reason: Some(reason.clone()),
    }, &format!("done: request {id}, {} letters kept until approved", items.len())).await;
    if c.0.settings.delete_approvals <= 1 {
        // A small team's console: the asking admin's sign-off is the one.
        return approve_and_delete(
            &c,
            &caller,
            id,
            letters.into_iter().map(|(s, _, d)| (s, d)).collect(),
            &plan,
        )
        .await;
    }
    let resp = match delete::get(&c.0.pool, id).await {
        Ok(Some(r)) => json!({ "request": r, "made_before": false }),
        _ => json!({ "request": { "id": id } }),
    };
    with_id(
        (StatusCode::ACCEPTED, Json(resp)).into_response(),
        &caller.request_id,
    )
}

/// Take request `id` and delete its letters, which are `letters` (read
/// again for this approval and found still the plan's). The sign-off is
/// recorded first (a deletion that cannot be recorded does not run); the
/// letters are deleted by a task of its own (a request cut short, its
/// time or its client gone, must not leave a deletion half done and
/// unsaid), its end recorded as `delete.finish`.
async fn approve_and_delete(
    c: &Console,
    caller: &Caller,
    id: uuid::Uuid,
    letters: Vec<(String, dlq::DeadLetter)>,
    plan: &str,
) -> Response {
    let by = caller.token.actor();
    match delete::decide(&c.0.pool, id, "deleting", &by, None).await {
        Ok(true) => {}
        Ok(false) => {
            return answer(
                caller,
                StatusCode::CONFLICT,
                "the request is no longer pending (decided meanwhile)",
            )
        }
        Err(e) => {
            return answer(
                caller,
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("taking the request: {e}"),
            )
        }
    }
    let actor = caller_actor(caller);
    let approval = Entry {
        action: "delete.approve",
        target: id.to_string(),
        selection: json!({ "plan_id": plan, "letters": letters.len() }),
        reason: None,
    };
    let signed = format!("done: approved; deleting {} letters", letters.len());
    if let Err(e) = admin_log::record_as(&c.0.pool, &approval, Some(&actor), &signed).await {
        let why =
            format!("the approval cannot be recorded in outbox_admin_log ({e}): nothing deleted");
        let _ = delete::finish(&c.0.pool, id, "failed", &json!({ "error": why })).await;
        return answer(caller, StatusCode::SERVICE_UNAVAILABLE, &why);
    }
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let (console, plan) = (c.clone(), plan.to_owned());
    tokio::spawn(async move {
        let (result, failed) = delete_letters(&console, letters).await;
        let n = result.as_array().map_or(0, Vec::len);
        let (state, outcome) = match failed {
            0 => ("deleted", format!("done: {n} letters deleted")),
            f => (
                "failed",
                format!("failed: {f} of {n} letters not deleted (each one's error in the request)"),
            ),
        };
        if let Err(e) = delete::finish(&console.0.pool, id, state, &result).await {
            tracing::warn!(request = %id, error = %e, "console: a deletion's result is not written");
        }
        let end = Entry {
            action: "delete.finish",
            target: id.to_string(),
            selection: json!({ "plan_id": plan }),
            reason: None,
        };
        if let Err(e) = admin_log::record_as(&console.0.pool, &end, Some(&actor), &outcome).await {
            tracing::warn!(request = %id, error = %e, "console: a deletion's end is not recorded");
        }
        let _ = done_tx.send(());
    });
    let _ = done_rx.await;
    match delete::get(&c.0.pool, id).await {
        Ok(Some(r)) => ok(caller, json!({ "request": r })),
        _ => ok(caller, json!({ "request": { "id": id } })),
    }
}

async fn approvals(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
) -> Response {
    let caller = match guard(&c, &auth, "approvals.read", "outbox_admin_deletions").await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    match delete::recent(&c.0.pool, 100).await {
        Ok(r) => ok(
            &caller,
            json!({ "requests": r, "approvals": c.0.settings.delete_approvals }),
        ),
        Err(e) => answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

/// `POST /admin/approvals/{id}/approve`: a second admin's sign-off; the
/// letters are read again and deleted only if they are still the plan's.
async fn approve(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    Path(id): Path<String>,
) -> Response {
    let caller = match guard(&c, &auth, "delete.approve", &id).await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    let Ok(id) = uuid::Uuid::parse_str(&id) else {
        return answer(&caller, StatusCode::BAD_REQUEST, "a request id is a UUID");
    };
    let request = match delete::get(&c.0.pool, id).await {
        Ok(Some(r)) => r,
        Ok(None) => return answer(&caller, StatusCode::NOT_FOUND, "no such request"),
        Err(e) => return answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    };
    if request["state"] != "pending" {
        return answer(
            &caller,
            StatusCode::CONFLICT,
            &format!("the request is {}, not pending", request["state"]),
        );
    }
    // One person may hold a token, an OIDC subject and a certificate of
    // one name: the same name under another kind is not a second admin.
    let asker = request["requested_by"].as_str().unwrap_or_default();
    let asker_name = asker.split_once(':').map_or(asker, |(_, n)| n);
    let me = caller.token.actor();
    if asker_name == caller.token.name {
        let why = "a deletion needs a second admin's approval: the one who asked cannot approve it (--delete-approvals 1 for a team of one)";
        record_denial(
            &c,
            "delete.approve",
            &id.to_string(),
            &caller_actor(&caller),
            StatusCode::FORBIDDEN,
            why,
            true,
        )
        .await;
        return answer(&caller, StatusCode::FORBIDDEN, why);
    }
    let Ok(selection) = serde_json::from_value::<Selection>(request["selection"].clone()) else {
        return answer(
            &caller,
            StatusCode::CONFLICT,
            "the request's selection cannot be read",
        );
    };
    let letters = match plan_letters(&c, &caller, &selection).await {
        Ok(l) => l,
        Err(resp) => return resp,
    };
    let items: Vec<Item> = letters
        .iter()
        .map(|(s, created, d)| Item::of(s, created, d))
        .collect();
    let plan = replay::plan_id(&selection, &items);
    if Some(plan.as_str()) != request["plan_id"].as_str() {
        let _ = delete::decide(
            &c.0.pool,
            id,
            "stale",
            &me,
            Some(&json!({ "why": "the letters changed since the request" })),
        )
        .await;
        record(
            &c,
            &caller,
            Entry {
                action: "delete.approve",
                target: id.to_string(),
                selection: json!({ "plan_id": request["plan_id"], "now": plan }),
                reason: None,
            },
            "failed: the letters changed since the request; nothing deleted",
        )
        .await;
        return answer(&caller, StatusCode::CONFLICT, "the selection takes other letters now than when it was asked: nothing deleted; ask again");
    }
    approve_and_delete(
        &c,
        &caller,
        id,
        letters.into_iter().map(|(s, _, d)| (s, d)).collect(),
        &plan,
    )
    .await
}

async fn reject(
    State(c): State<Console>,
    Extension(auth): Extension<Authenticated>,
    Path(id): Path<String>,
) -> Response {
    let caller = match guard(&c, &auth, "delete.reject", &id).await {
        Ok(caller) => caller,
        Err(resp) => return resp,
    };
    let Ok(id) = uuid::Uuid::parse_str(&id) else {
        return answer(&caller, StatusCode::BAD_REQUEST, "a request id is a UUID");
    };
    let me = caller.token.actor();
    match delete::decide(&c.0.pool, id, "rejected", &me, None).await {
        Ok(true) => {
            record(
                &c,
                &caller,
                Entry {
                    action: "delete.reject",
                    target: id.to_string(),
                    selection: json!({}),
                    reason: None,
                },
                "done",
            )
            .await;
            match delete::get(&c.0.pool, id).await {
                Ok(Some(r)) => ok(&caller, json!({ "request": r })),
                _ => ok(&caller, json!({ "request": { "id": id } })),
            }
        }
        Ok(false) => answer(&caller, StatusCode::CONFLICT, "no such pending request"),
        Err(e) => answer(&caller, StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_openapi_document_names_every_route_and_only_those() {
        let doc: Value = serde_json::from_str(OPENAPI).expect("openapi.json is JSON");
        let paths = doc["paths"].as_object().expect("paths");
        let mut named = 0;
        for (path, ops) in paths {
            for method in ops.as_object().expect("operations").keys() {
                named += 1;
                assert!(
                    ROUTES.iter().any(|(m, p, _, _)| m == method && p == path),
                    "openapi.json names {method} {path}, which the router does not serve"
                );
            }
        }
        for (method, path, _, _) in ROUTES {
            assert!(
                paths.get(*path).and_then(|p| p.get(*method)).is_some(),
                "{method} {path} is not in openapi.json"
            );
        }
        assert_eq!(named, ROUTES.len());
    }

    #[test]
    fn ages_are_bucketed() {
        let now = time::OffsetDateTime::now_utc();
        assert_eq!(age_bucket(now - time::Duration::minutes(5), now), "<1h");
        assert_eq!(age_bucket(now - time::Duration::hours(5), now), "1h-1d");
        assert_eq!(age_bucket(now - time::Duration::days(3), now), "1d-7d");
        assert_eq!(age_bucket(now - time::Duration::days(30), now), ">7d");
    }
}
